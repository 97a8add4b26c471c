"""Peer benchmark: one FedAvg workload on linattn and on two peer simulators, side by
side in one command, on the CPU (Flower's clients run in Ray worker processes) or, with
``--device cuda``, on a GPU (linattn's engines and pfl; Flower is CPU-only here).

Engines (``--engines``; they run in the order given there):

- ``linattn-vectorized``: the native round loop (:meth:`Federation.run_round`) with
  ``train.engine=vectorized`` (the round's clients stacked into batched kernels);
- ``linattn-sequential``: the same loop with ``train.engine=sequential`` (one client after
  another, ``loss.backward()`` and ``torch.optim.SGD``: what most frameworks do);
- ``flower``: Flower's simulation engine (flwr, Ray backend) through the repo's adapter
  (:mod:`real_data.flower`): the FedAvg strategy is the Federation's trainer hook and sends one
  TRAIN message per sampled client; ``--flower-actors`` Ray actors of one CPU each run the
  ClientApp, whose clients train with ``--flower-engine`` (default ``sequential``);
- ``pfl``: pfl-research's simulator (``pfl.algorithm.FederatedAveraging`` on a
  ``pfl.aggregate.simulate.SimulatedBackend``, ``pfl.model.pytorch.PyTorchModel``), with the
  same ViT (wrapped: ``loss``/``metrics`` methods), the same initial weights, the same clients
  per round (a pfl user sampler that yields :func:`~real_data.federation.sample_clients`), the
  same minibatches (a pfl ``Dataset`` whose ``iter`` yields :func:`make_batches`' plan for
  (seed, round, client)), pfl's own local loop (``local_num_steps`` K,
  ``local_max_grad_norm``, a fresh ``torch.optim.SGD`` per user) and FedAvg weighting by
  data points (``WeightByDatapoints``: ``len(user dataset)`` is n_m, as linattn's p_m); the
  server step is pfl's: the weighted mean model difference applied by a central SGD with
  learning rate 1. pfl's first iteration also evaluates each user before and after local
  training (``evaluation_frequency`` counts from iteration 0): the untimed warm-up round.

The workload (defaults): the shipped ``fmnist_vit`` model (ViT dim 64, depth 4, 4 heads,
patch 4, MLP 128) on the cached Fashion-MNIST, its Dirichlet(0.3) split over 50 clients,
FedAvg with 10 clients per round, K = 10 local steps of B = 32, SGD lr 0.05, momentum 0.9,
gradient clipping at 5, fp32, on the CPU. ``--warmup`` untimed rounds, then ``--rounds`` timed
rounds; the median round wall time is reported (and every round time is kept). A round is
everything between two global models: client sampling, minibatch plans, local training,
aggregation and (linattn engines) the round's diagnostics; evaluation is kept out of the timed
rounds (``eval.every`` lies past the last round) and done once at the end, on the whole test
split with :meth:`Federation.evaluate`, for every engine alike.

Threads: ``torch.set_num_threads(--threads)`` in this process (linattn engines, pfl, Flower's
server side); Flower gets ``--flower-actors`` Ray actors (Ray ``num_cpus`` = actors, one CPU per
client) each set to ``--threads // --flower-actors`` torch threads (checked from inside the
actors and recorded as ``actor_threads``).

pfl 0.6.0 (Python 3.10-3.12, ``numpy<3``) is in the ``dev`` extra (``pip install -e ".[dev]"``
brings it). The CPU measurement in docs/results/performance.md uses pfl 0.4.0, which pins
``numpy<2.0`` against this project's ``numpy>=2.2`` and needs Python < 3.12; it runs on numpy
2.4 unchanged when installed without its pins::

    pip install --no-deps pfl==0.4.0 multiprocess==0.70.19 dill==0.4.1 dp-accounting==0.5.1 \\
        prv-accountant==0.2.0 absl-py==1.4.0 dm-tree==0.1.10 wrapt

An engine that cannot run (pfl or flwr missing, an error) is reported as not run, with the
reason, and the others go on.

Usage: ``python benchmarks/bench_peers.py [--rounds 8] [--clients-per-round 10]
[--out docs/bench/peers.json] [key=value overrides of the config]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from linattn.errors import UserError
from linattn.fileio import atomic_write_json
from real_data.config import Config, load_config
from real_data.federation import Federation, FedState, sample_clients
from real_data.metrics import step_flops

ENGINES = ("linattn-vectorized", "linattn-sequential", "flower", "pfl")
ACTOR_THREADS_ENV = "LINATTN_PEERS_ACTOR_THREADS"  # torch threads inside each Flower actor
PROBE_ENV = "LINATTN_PEERS_PROBE"  # folder where each Flower actor records its thread count
PFL_INSTALL = 'pip install "pfl==0.6.0" (in the dev extra)'


# -- the workload ----------------------------------------------------------------------------
def bench_config(config: str = "fmnist_vit", clients_per_round: int = 10, local_steps: int = 10,
                 batch_size: int = 32, rounds: int = 6,
                 overrides: list[str] | tuple[str, ...] = (), device: str = "cpu") -> Config:
    """The FedAvg workload: ``config`` with FedAvg, fp32 on ``device``, the given round shape.

    ``train.rounds`` and ``eval.every`` are set one past ``rounds``, so no round the benchmark
    runs evaluates (the final model is evaluated once, outside the timing).
    """
    base = [f"train.clients_per_round={clients_per_round}", f"train.local_steps={local_steps}",
            "train.local_epochs=null", f"train.batch_size={batch_size}",
            "train.precision=fp32", f"train.device={device}", f"train.rounds={rounds + 1}",
            f"eval.every={rounds + 1}", "eval.clients=false", "run.progress=false",
            "run.plot=false"]
    return load_config(config, ["algorithm.name=fedavg", *base, *overrides])


def _sync(cfg: Config) -> None:
    """Wait for the device (round times on a GPU count the work, not its launch)."""
    if str(cfg.train.device).startswith("cuda"):
        torch.cuda.synchronize()


def load_workload(cfg: Config):
    """(resolved config, dataset, partition): what every engine shares."""
    from real_data.runs import load_data, make_partition_for, resolve

    dataset = load_data(cfg)
    partition = make_partition_for(cfg, dataset)
    return resolve(cfg, dataset), dataset, partition


def with_engine(cfg: Config, engine: str) -> Config:
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, engine=engine))


def _check_fedavg(cfg: Config) -> None:
    t = cfg.train
    if cfg.algorithm.name != "fedavg" or t.local_steps is None:
        raise UserError("bench_peers: algorithm.name must be fedavg and train.local_steps (K) "
                        "set; drop the overrides that change them")
    if float(getattr(cfg.model.params, "dropout", 0.0)) > 0:
        raise UserError("bench_peers: model.dropout must be 0 (deterministic training)")


# -- linattn: native round loop, and Flower -----------------------------------------------------
def run_native(cfg: Config, dataset, partition, engine: str, rounds: int) -> dict:
    """``rounds`` rounds of the native loop with ``train.engine=engine``; times and params."""
    fed = Federation(with_engine(cfg, engine), dataset, partition)
    state, times = fed.initial_state(), []
    for rnd in range(1, rounds + 1):
        t0 = time.perf_counter()
        state, _ = fed.run_round(state, rnd)
        _sync(cfg)
        times.append(time.perf_counter() - t0)
    return {"times_s": times, "params": state.global_params}


def _flower_client_data(cfg):
    """The ClientApp's data: as the adapter's default, after setting the actor's threads."""
    torch.set_num_threads(int(os.environ.get(ACTOR_THREADS_ENV, "1")))
    probe = os.environ.get(PROBE_ENV)
    if probe:
        Path(probe, f"{os.getpid()}.json").write_text(json.dumps(
            {"pid": os.getpid(), "torch_threads": torch.get_num_threads(),
             "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")}))
    from real_data.flower.client import simulation_data

    return simulation_data(cfg)


def run_flower(cfg: Config, dataset, partition, rounds: int, actors: int = 2,
               actor_threads: int = 1, client_engine: str = "sequential") -> dict:
    """``rounds`` rounds on Flower's Ray simulation engine (one supernode per client).

    The server side is the native loop with the adapter's FedAvg strategy as its trainer
    hook (what :meth:`LinattnStrategy.start` runs, without the run directory); each sampled
    client gets a TRAIN message and trains in a Ray actor with ``client_engine``.
    """
    from flwr.serverapp import ServerApp
    from flwr.simulation import run_simulation

    from real_data.flower import make_client_app, strategy_for

    cfg = with_engine(cfg, client_engine)  # the config the clients receive
    out: dict = {}
    app = ServerApp()

    @app.main()
    def main(grid, context) -> None:
        strategy = strategy_for(cfg)
        strategy.grid = grid  # as LinattnStrategy.start(grid) does before the round loop
        fed = Federation(cfg, dataset, partition, trainer=strategy)
        state, times = fed.initial_state(), []
        for rnd in range(1, rounds + 1):
            t0 = time.perf_counter()
            state, _ = fed.run_round(state, rnd)
            times.append(time.perf_counter() - t0)
        out.update(times_s=times, params=state.global_params)

    backend = {"init_args": {"num_cpus": actors, "include_dashboard": False},
               "client_resources": {"num_cpus": 1, "num_gpus": 0.0}}
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")  # Ray's FutureWarning
    with tempfile.TemporaryDirectory() as probe:
        here = str(Path(__file__).resolve().parent)
        path = os.pathsep.join(x for x in (here, os.environ.get("PYTHONPATH")) if x)
        env = {ACTOR_THREADS_ENV: str(actor_threads), PROBE_ENV: probe, "PYTHONPATH": path}
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)  # Ray's workers inherit the driver's environment
        try:
            import bench_peers  # by module name (benchmarks/ is on sys.path, also for Ray)

            run_simulation(app, make_client_app(data_fn=bench_peers._flower_client_data),
                           partition.num_clients, backend_name="ray", backend_config=backend)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        seen = [json.loads(p.read_text()) for p in sorted(Path(probe).glob("*.json"))]
    if "times_s" not in out:
        raise RuntimeError("the Flower simulation stopped before the last round (see its log)")
    out["actor_threads"] = seen
    return out


# -- pfl-research ------------------------------------------------------------------------------
def run_pfl(cfg: Config, dataset, partition, rounds: int) -> dict:
    """``rounds`` rounds of pfl's FedAvg simulation on the same workload (module docstring)."""
    os.environ["PFL_PYTORCH_DEVICE"] = str(cfg.train.device)  # pfl's device: the workload's
    import pfl
    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.aggregate.weighting import WeightByDatapoints
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.callback.base import TrainingProcessCallback
    from pfl.data import FederatedDataset
    from pfl.data.dataset import Dataset
    from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
    from pfl.metrics import Metrics, Weighted
    from pfl.model.pytorch import PyTorchModel

    from real_data.engines import make_batches, task_loss
    from real_data.models import build_model, complete_model_config

    _check_fedavg(cfg)
    t = cfg.train
    if t.optimizer != "sgd":
        raise ValueError("the pfl side is written for train.optimizer=sgd")
    training_seed = cfg.role_seed("training")
    dev = torch.device(cfg.train.device)
    x, y = dataset.x_train.float().to(dev), dataset.y_train.to(dev)
    train_idx = partition.train

    class Wrapped(torch.nn.Module):
        """linattn's model with the ``loss`` and ``metrics`` methods pfl calls."""

        def __init__(self, net: torch.nn.Module) -> None:
            super().__init__()
            self.net = net

        def forward(self, xb):
            return self.net(xb)

        def loss(self, xb, yb):
            return task_loss(self.net(xb), yb)

        @torch.no_grad()
        def metrics(self, xb, yb):
            logits = self.net(xb)
            n = len(yb)
            return {"loss": Weighted(float(task_loss(logits, yb)) * n, n),
                    "accuracy": Weighted(float((logits.argmax(-1) == yb).sum()), n)}

    class Planned(Dataset):
        """Client m in round t: n_m samples (its FedAvg weight), linattn's minibatches."""

        def __init__(self, rnd: int, m: int) -> None:
            super().__init__((x, y), user_id=f"{rnd}:{m}")
            plan = make_batches(train_idx, np.array([m]), training_seed, rnd, t.batch_size,
                                t.local_steps, None, dev)
            self._steps = plan.idx[0]  # (K, B) indices into x
            self._n = len(train_idx[m])

        def __len__(self) -> int:
            return self._n

        def iter(self, batch_size):  # noqa: A003 - pfl's name
            for idx in self._steps:
                yield [x[idx], y[idx]]

    def sampler() -> Callable[[], tuple[int, int]]:
        """pfl user sampler: the clients of round 1, then of round 2, ... (native order)."""

        def users():
            rnd = 0
            while True:
                rnd += 1
                for m in sample_clients(cfg.role_seed("sampling"), rnd,
                                        partition.num_clients, t.clients_per_round):
                    yield rnd, int(m)

        it = users()
        return lambda: next(it)

    class Clock(TrainingProcessCallback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_train_begin(self, *, model):
            self._t = time.perf_counter()
            return Metrics()

        def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
            _sync(cfg)
            now = time.perf_counter()
            self.times.append(now - self._t)
            self._t = now
            return False, Metrics()

    # the same initial weights as the native runner (same builder, same seed, same names)
    mcfg = complete_model_config(cfg.model.name, cfg.model.params, dataset.input_shape,
                                 dataset.num_classes)
    net = build_model(cfg.model.name, mcfg, training_seed, torch.float32).to(dev)
    module = Wrapped(net)
    local = lambda params, lr: torch.optim.SGD(  # noqa: E731 - pfl passes lr itself
        params, lr=lr, momentum=t.momentum, weight_decay=t.weight_decay, foreach=False)
    model = PyTorchModel(model=module, local_optimizer_create=local,
                         central_optimizer=torch.optim.SGD(module.parameters(), lr=1.0))
    users = FederatedDataset(lambda uid: Planned(*uid), sampler())
    backend = SimulatedBackend(training_data=users, val_data=users,
                               postprocessors=[WeightByDatapoints()])
    clock = Clock()
    algo_params = NNAlgorithmParams(central_num_iterations=rounds,
                                    evaluation_frequency=10**9,  # pfl evaluates iteration 0 only
                                    train_cohort_size=t.clients_per_round
                                    or partition.num_clients, val_cohort_size=None)
    train_params = NNTrainHyperParams(local_num_epochs=None, local_learning_rate=t.lr,
                                      local_batch_size=t.batch_size,
                                      local_num_steps=t.local_steps,
                                      local_max_grad_norm=t.clip_grad_norm)
    FederatedAveraging().run(algo_params, backend, model, train_params,
                             NNEvalHyperParams(local_batch_size=t.batch_size),
                             callbacks=[clock], send_metrics_to_platform=False)
    params = {n.removeprefix("net."): p.detach().clone()
              for n, p in module.named_parameters()}
    return {"times_s": clock.times, "params": params, "pfl_version": pfl.__version__}


# -- the comparison ----------------------------------------------------------------------------
def relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """max over tensors of ||a - b|| / ||b|| (names must match)."""
    if a.keys() != b.keys():
        raise ValueError(f"parameter names differ: {sorted(a.keys() ^ b.keys())[:5]}")
    return max(float((a[n].double() - b[n].double()).norm() / b[n].double().norm().clamp_min(
        1e-30)) for n in b)


def _versions() -> dict:
    from importlib import metadata

    out = {}
    for name in ("torch", "numpy", "flwr", "ray", "pfl"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def _row(name: str, how: str, threads: str, res: dict, warmup: int, samples: int) -> dict:
    timed = res["times_s"][warmup:]
    med = statistics.median(timed)
    return {"engine": name, "how": how, "threads": threads, "status": "ok",
            "round_s": med, "round_s_iqr": np.percentile(timed, [25, 75]).tolist(),
            "times_s": res["times_s"], "warmup_rounds": warmup, "timed_rounds": len(timed),
            "client_samples_per_s": samples / med,
            **{k: v for k, v in res.items() if k not in ("times_s", "params")}}


def run_all(args: argparse.Namespace, log: Callable[[str], None] = print) -> dict:
    """Every requested engine on the workload; the JSON payload (results in order)."""
    torch.set_num_threads(args.threads)
    total = args.warmup + args.rounds
    extra = [] if args.num_clients is None else [f"partition.num_clients={args.num_clients}"]
    cfg = bench_config(args.config, args.clients_per_round, args.local_steps, args.batch_size,
                       total, [*extra, *args.overrides], args.device)
    _check_fedavg(cfg)
    cfg, dataset, partition = load_workload(cfg)
    t = cfg.train
    per_round = t.clients_per_round or partition.num_clients
    samples = per_round * t.local_steps * t.batch_size
    evaluator = Federation(cfg, dataset, partition)
    n_params = sum(p.numel() for p in evaluator.model.parameters())
    params0 = {n: p.detach() for n, p in evaluator.model.named_parameters()}
    flops = step_flops(lambda ps, xb: evaluator.algorithm.forward(evaluator.model, ps, xb),
                       params0, tuple(params0), evaluator.x_train[:t.batch_size],
                       evaluator.y_train[:t.batch_size]) * per_round * t.local_steps
    log(f"workload: {cfg.name} ({cfg.data.name}, {n_params:,} parameters), "
        f"{partition.num_clients} clients, {per_round} per round, K={t.local_steps}, "
        f"B={t.batch_size}, SGD lr={t.lr:g} momentum={t.momentum:g} clip={t.clip_grad_norm}, "
        f"fp32; {args.warmup} warm-up + {args.rounds} timed rounds; "
        f"torch threads {torch.get_num_threads()}")
    actor_threads = max(args.threads // args.flower_actors, 1)
    how = {
        "linattn-vectorized": ("native round loop, train.engine=vectorized (clients stacked)",
                               f"{args.threads} (torch, this process)"),
        "linattn-sequential": ("native round loop, train.engine=sequential (one client at a "
                               "time)", f"{args.threads} (torch, this process)"),
        "flower": (f"flwr {_versions()['flwr']} Ray simulation engine, {partition.num_clients}"
                   f" supernodes, {args.flower_actors} actors x 1 CPU, clients train with "
                   f"train.engine={args.flower_engine}",
                   f"{args.flower_actors} actors x {actor_threads} (torch); server "
                   f"{args.threads}"),
        "pfl": (f"pfl {_versions()['pfl'] or '(not installed)'} SimulatedBackend + "
                "FederatedAveraging, PyTorchModel, WeightByDatapoints, one user at a time",
                f"{args.threads} (torch, this process)"),
    }
    rows, finals = [], {}
    for name in args.engines:
        log(f"-- {name}: {how[name][0]}")
        started = time.perf_counter()
        try:
            if name == "linattn-vectorized":
                res = run_native(cfg, dataset, partition, "vectorized", total)
            elif name == "linattn-sequential":
                res = run_native(cfg, dataset, partition, "sequential", total)
            elif name == "flower":
                res = run_flower(cfg, dataset, partition, total, args.flower_actors,
                                 actor_threads, args.flower_engine)
            else:
                res = run_pfl(cfg, dataset, partition, total)
        except Exception as exc:  # noqa: BLE001 - recorded as not run, the others go on
            reason = f"{type(exc).__name__}: {exc}"
            if name == "pfl" and isinstance(exc, ModuleNotFoundError):
                reason += f" (install: {PFL_INSTALL})"
            log(f"   NOT RUN: {reason}")
            rows.append({"engine": name, "how": how[name][0], "threads": how[name][1],
                         "status": "not run", "reason": reason,
                         "traceback": traceback.format_exc(limit=6)})
            continue
        torch.set_num_threads(args.threads)  # whatever the engine did to this process
        row = _row(name, *how[name], res, args.warmup, samples)
        row["gflops"] = flops / row["round_s"] / 1e9
        row["engine_wall_s"] = time.perf_counter() - started
        ev, _ = evaluator.evaluate(FedState(total, res["params"]))
        row.update(test_acc=ev["test_acc"], test_loss=ev["test_loss"])
        finals[name] = res["params"]
        rows.append(row)
        log(f"   median {row['round_s']:.3f} s/round ({row['client_samples_per_s']:,.0f} "
            f"client-samples/s), rounds {', '.join(f'{s:.2f}' for s in res['times_s'])} s; "
            f"test_acc {ev['test_acc']:.4f}")
    ref = next((r for r in rows if r["engine"] == "linattn-vectorized" and r["status"] == "ok"),
               None)
    for r in rows:
        if r["status"] != "ok":
            continue
        r["time_vs_vectorized"] = r["round_s"] / ref["round_s"] if ref else None
        if "linattn-sequential" in finals:
            r["param_rel_diff_vs_sequential"] = relative_difference(
                finals[r["engine"]], finals["linattn-sequential"])
    from bench_engines import cpu_name, provenance

    return {"benchmark": "peers: one FedAvg workload on linattn, Flower, pfl",
            **provenance(torch.device(args.device)),
            "device": (f"GPU: {torch.cuda.get_device_name(args.device)}" if args.device != "cpu"
                       else f"CPU: {cpu_name()}, {os.cpu_count()} cores"),
            "cpu_count": os.cpu_count(),
            "torch_threads": args.threads, "versions": _versions(),
            "config": {k: v for k, v in vars(args).items() if k != "out"},
            "workload": {"config": cfg.name, "data": cfg.data.name, "model": {
                "name": cfg.model.name, **dataclasses.asdict(cfg.model.params)},
                "parameters": n_params, "num_clients": partition.num_clients,
                "partition": {"scheme": cfg.partition.scheme, "alpha": cfg.partition.alpha,
                              "sizes": partition.sizes.tolist()},
                "clients_per_round": per_round, "local_steps": t.local_steps,
                "batch_size": t.batch_size, "optimizer": t.optimizer, "lr": t.lr,
                "momentum": t.momentum, "clip_grad_norm": t.clip_grad_norm,
                "precision": t.precision, "client_samples_per_round": samples,
                "flops_per_round": flops,
                "test_samples": len(dataset.y_test)},
            "results": rows}


def render_markdown(data: dict) -> str:
    """The results as a markdown table."""
    out = ["| engine | how clients run | torch threads | median s/round (IQR) | "
           "client-samples/s | GFLOP/s | time / vectorized | test acc | max rel. param diff "
           "vs sequential |", "|---|---|---|--:|--:|--:|--:|--:|--:|"]
    for r in data["results"]:
        if r["status"] != "ok":
            out.append(f"| {r['engine']} | {r['how']} | {r['threads']} | not run: "
                       f"{r['reason']} | - | - | - | - | - |")
            continue
        lo, hi = r["round_s_iqr"]
        ratio = "-" if r.get("time_vs_vectorized") is None else f"{r['time_vs_vectorized']:.2f}"
        diff = r.get("param_rel_diff_vs_sequential")
        diff = "-" if diff is None else f"{diff:.1e}"
        out.append(f"| {r['engine']} | {r['how']} | {r['threads']} | {r['round_s']:.3f} "
                   f"({lo:.3f}-{hi:.3f}) | {r['client_samples_per_s']:,.0f} | "
                   f"{r['gflops']:.1f} | {ratio} | "
                   f"{r['test_acc']:.4f} | {diff} |")
    return "\n".join(out)


def _parser() -> argparse.ArgumentParser:
    names = lambda s: [v for v in s.split(",") if v]  # noqa: E731
    ap = argparse.ArgumentParser(prog="python benchmarks/bench_peers.py",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="fmnist_vit", help="YAML file or shipped config")
    ap.add_argument("--engines", type=names, default=list(ENGINES),
                    help=f"comma list of {', '.join(ENGINES)}")
    ap.add_argument("--rounds", type=int, default=8, help="timed rounds (median reported)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    ap.add_argument("--clients-per-round", type=int, default=10)
    ap.add_argument("--num-clients", type=int, default=None,
                    help="clients in the partition (default: the config's)")
    ap.add_argument("--local-steps", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2, help="torch threads in this process")
    ap.add_argument("--flower-actors", type=int, default=2,
                    help="Ray actors (1 CPU each); each gets threads // actors torch threads")
    ap.add_argument("--flower-engine", default="sequential", choices=("sequential",
                                                                      "vectorized"),
                    help="linattn engine inside the Flower clients")
    ap.add_argument("--device", default="cpu",
                    help="cpu, or cuda for linattn's engines and pfl on the GPU (not Flower)")
    ap.add_argument("--out", type=Path, help="JSON file")
    ap.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    bad = [e for e in args.engines if e not in ENGINES]
    if bad:
        raise UserError(f"bench_peers: unknown engines {bad} (valid: {', '.join(ENGINES)})")
    if args.rounds < 1 or args.warmup < 0 or args.threads < 1 or args.flower_actors < 1:
        raise UserError("bench_peers: needs --rounds >= 1, --warmup >= 0, --threads >= 1 and "
                        "--flower-actors >= 1")
    if args.device not in ("cpu", "cuda"):
        raise UserError(f"bench_peers: --device must be cpu or cuda, got {args.device!r}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UserError("bench_peers: --device cuda but torch sees no CUDA device")
    if args.device == "cuda" and "flower" in args.engines:
        raise UserError("bench_peers: Flower runs on the CPU here; drop it from --engines "
                        "with --device cuda")
    if "pfl" in args.engines and args.warmup < 1:
        raise UserError("bench_peers: pfl evaluates every user in its first round; give "
                        "--warmup >= 1 so that round is not timed")
    extra = [] if args.num_clients is None else [f"partition.num_clients={args.num_clients}"]
    _check_fedavg(bench_config(args.config, args.clients_per_round, args.local_steps,
                               args.batch_size, args.warmup + args.rounds,
                               [*extra, *args.overrides], args.device))  # bad: exit 2
    started = time.perf_counter()
    data = run_all(args, lambda s: print(s, flush=True))
    data["total_wall_s"] = time.perf_counter() - started
    table = render_markdown(data)
    print(table)
    if args.out:
        data["markdown"] = table
        data["source"] = Path(__file__).read_text()
        atomic_write_json(args.out, data, indent=1)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except UserError as exc:  # a bad option: say which and exit 2, nothing written
        print(f"error: {exc}")
        raise SystemExit(2) from None
