"""Flower's simulation engine (Ray backend) for linattn runs, and the apps for ``flwr run``.

From Python::

    from real_data.flower import simulate
    [result] = simulate([(load_config("digits_vit", ["partition.num_clients=4"]), Path("r"))])

From the shell (``--ray-address auto`` joins a running Ray cluster, see docs/scaleout.md)::

    python -m real_data.flower --config digits_vit --out runs/flower partition.num_clients=4

One simulated node per client (``partition.num_clients`` nodes); several runs in one call
share one Ray start. ``server_app`` and ``client_app`` are the components of a Flower App for
``flwr run`` (simulation or deployment); the server reads ``config``, ``overrides``
(space-separated ``key=value``), ``out`` and ``resume`` from the run config.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from real_data.flower.client import make_client_app
from real_data.flower.strategy import strategy_for


def default_backend_config(ray_address: str | None = None) -> dict:
    """One CPU (and a GPU share where there is one) per client actor; no dashboard."""
    import torch

    init = {"include_dashboard": False}
    if ray_address:
        init["address"] = ray_address
    else:
        init["num_cpus"] = os.cpu_count() or 1
    gpus = 0.25 if torch.cuda.is_available() else 0.0
    return {"init_args": init, "client_resources": {"num_cpus": 1, "num_gpus": gpus}}


def make_server_app(runs: list, results: list) -> ServerApp:
    """A ServerApp that runs each ``(cfg, out)`` (or ``(None, resume_dir)``) in turn."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        for cfg, path in runs:
            strategy = (strategy_for(cfg, out=path) if cfg is not None
                        else strategy_for(resume=path))
            results.append(strategy.start(grid))

    return app


def simulate(runs: list, num_supernodes: int | None = None,
             backend_config: dict | None = None) -> list:
    """Run ``[(cfg, out), ...]`` on the Ray simulation engine; their RunResults in order.

    ``(None, run_dir)`` resumes a run directory. ``num_supernodes`` defaults to the first
    config's ``partition.num_clients`` (every run must have that many clients).
    """
    from flwr.simulation import run_simulation

    if num_supernodes is None:
        cfg = runs[0][0]
        if cfg is None:
            import yaml

            saved = yaml.safe_load((Path(runs[0][1]) / "config.yaml").read_text())
            num_supernodes = int(saved["partition"]["num_clients"])
        else:
            num_supernodes = cfg.partition.num_clients
    results: list = []
    run_simulation(make_server_app(runs, results), make_client_app(), num_supernodes,
                   backend_name="ray", backend_config=backend_config or default_backend_config())
    if len(results) != len(runs):
        raise RuntimeError("the Flower simulation stopped early; see the log above")
    return results


# -- components for `flwr run` (a Flower App's [tool.flwr.app.components]) -----------------------
server_app = ServerApp()
client_app = make_client_app()


@server_app.main()
def _main(grid: Grid, context: Context) -> None:
    from real_data.config import load_config

    rc = context.run_config
    if rc.get("resume"):
        strategy_for(resume=Path(str(rc["resume"]))).start(grid)
        return
    overrides = str(rc.get("overrides", "")).split()
    out = Path(str(rc["out"])) if rc.get("out") else None
    strategy_for(load_config(str(rc["config"]), overrides), out=out).start(grid)


def main(argv: list[str] | None = None) -> int:
    """``python -m real_data.flower``: one run on the Ray simulation engine."""
    ap = argparse.ArgumentParser(prog="python -m real_data.flower", description=__doc__)
    ap.add_argument("--config", help="YAML file or shipped config name")
    ap.add_argument("--out", type=Path, help="run directory (default: run.out_dir/<name>)")
    ap.add_argument("--resume", type=Path, metavar="RUN_DIR")
    ap.add_argument("--ray-address", help="join this Ray cluster (e.g. auto) instead of "
                    "starting Ray locally")
    ap.add_argument("overrides", nargs="*", metavar="key=value")
    args = ap.parse_args(argv)
    from real_data.config import load_config

    run = ((None, args.resume) if args.resume is not None
           else (load_config(args.config, args.overrides), args.out))
    [result] = simulate([run], backend_config=default_backend_config(args.ray_address))
    acc = result.summary.get("final", {}).get("test_acc")
    print(f"{result.run_dir}: {result.rounds_completed} rounds, {result.status}"
          + (f", test_acc {acc:.4f}" if acc is not None else ""))
    return 0 if result.status == "completed" else 1
