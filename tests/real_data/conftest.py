"""Shared fixtures: tiny data and partitions built here, and the ``linattn`` CLI in a subprocess.

Runs through the CLI or ``start_run`` use the real data layer (``real_data.data``).
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
if str(REPO) not in sys.path:  # the checkout is not installed into the venv
    sys.path.insert(0, str(REPO))

from real_data.data.base import Partition, TensorDataset  # noqa: E402

# Tiny models: one thread is faster and, on a shared 2-core machine, far steadier; the CLI
# subprocesses get the same through OMP_NUM_THREADS so in- and out-of-process runs match.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")


def digits_dataset(n_train: int = 1500, dtype=torch.float32) -> TensorDataset:
    """sklearn digits as ``(N, 1, 8, 8)`` in [0, 1], a fixed train/test split."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.images / 16.0, dtype=dtype).unsqueeze(1)
    y = torch.tensor(d.target, dtype=torch.int64)
    order = np.random.default_rng(0).permutation(len(y))
    tr, te = order[:n_train], order[n_train:]
    return TensorDataset("digits", "image", x[tr], y[tr], x[te], y[te], 10)


def random_partition(dataset: TensorDataset, num_clients: int, seed: int,
                     alpha: float | None = None, min_size: int = 10) -> Partition:
    """IID (``alpha=None``) or Dirichlet(alpha) label split; local tests share the label mix."""
    rng = np.random.default_rng(seed)
    y = dataset.y_train.numpy()
    n = len(y)
    if alpha is None:
        parts = np.array_split(rng.permutation(n), num_clients)
    else:
        for _ in range(100):
            parts = [[] for _ in range(num_clients)]
            for c in range(dataset.num_classes):
                ix = rng.permutation(np.flatnonzero(y == c))
                cuts = (np.cumsum(rng.dirichlet([alpha] * num_clients)) * len(ix)).astype(int)
                for m, chunk in enumerate(np.split(ix, cuts[:-1])):
                    parts[m].extend(chunk.tolist())
            if min(len(p) for p in parts) >= min_size:
                break
        parts = [np.sort(np.array(p, dtype=np.int64)) for p in parts]
    yt = dataset.y_test.numpy()
    tests = tuple(np.flatnonzero(np.isin(yt, np.unique(y[p]))) for p in parts)
    return Partition(tuple(np.asarray(p, dtype=np.int64) for p in parts), tests,
                     "iid" if alpha is None else "dirichlet",
                     {} if alpha is None else {"alpha": alpha}, seed)


CLI_BOOT = (
    "import sys; sys.path.insert(0, {here!r}); "
    "from linattn.cli import main; sys.exit(main(sys.argv[1:]))"
)


def cli_command(*args: str) -> list[str]:
    """``python -c <boot> args...``: the ``linattn`` CLI from this checkout."""
    return [sys.executable, "-c", CLI_BOOT.format(here=str(HERE)), *args]


def run_cli(*args: str, env: dict | None = None, timeout: float = 120):
    return subprocess.run(cli_command(*args), cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def tuned_study(tmp_path, plan: dict):
    """``plan`` written to tmp_path/plan.yaml and its tuning stage run by the CLI into
    tmp_path/out (asserted to succeed); returns (plan file, out_dir, the loaded plan)."""
    import yaml

    from real_data import study

    path, out = tmp_path / "plan.yaml", tmp_path / "out"
    path.write_text(yaml.safe_dump(plan))
    res = run_cli("study", "--plan", str(path), "--out", str(out), "--stage", "tune")
    assert res.returncode == 0, res.stderr[-2000:]
    return path, out, study.load_plan(path, out)


@pytest.fixture(scope="session")
def digits() -> TensorDataset:
    return digits_dataset()


@pytest.fixture(scope="session")
def digits64() -> TensorDataset:
    return digits_dataset(dtype=torch.float64)


TINY = ["model.dim=8", "model.mlp_dim=16", "model.depth=1", "model.heads=2",
        "train.batch_size=8", "train.local_steps=3", "run.progress=false", "run.plot=false"]


def tiny_config(*overrides: str):
    """The shipped digits_vit config, shrunk further, with extra overrides."""
    from real_data.config import load_config

    return load_config("digits_vit", [*TINY, *overrides])


def federation(cfg, dataset, partition):
    from real_data.federation import Federation

    return Federation(cfg, dataset, partition)


def train_rounds(fed, rounds: int):
    """Run ``rounds`` rounds from the initial state; returns (state, all records)."""
    state, records = fed.initial_state(), []
    for rnd in range(1, rounds + 1):
        state, rec = fed.run_round(state, rnd)
        records += rec
    return state, records


def global_metrics(path) -> dict[str, dict[int, float]]:
    """A run's ``metrics.csv`` global rows as {metric: {round: value}}."""
    out: dict[str, dict[int, float]] = {}
    with open(path, newline="") as fh:
        for r in csv.DictReader(fh):
            if r["client"] == "global":
                out.setdefault(r["metric"], {})[int(r["round"])] = float(r["value"])
    return out


def metric_rows(path) -> dict[tuple, float]:
    """Every row of a ``metrics.csv``, keyed by (round, client, metric, stage)."""
    with open(path, newline="") as fh:
        return {(r["round"], r["client"], r["metric"], r.get("stage")): float(r["value"])
                for r in csv.DictReader(fh)}


PRETRAIN_SKIP = 1000  # runs on pretrained models use digits samples 0..999, pretraining the rest


def pretrained_file(tmp_path, dataset, activation="relu"):
    """A tiny ViT trained centrally on digits samples PRETRAIN_SKIP.. (disjoint from the run's
    data, :func:`pretrain_target`); returns (path, PretrainResult)."""
    from real_data.models import build_model, complete_model_config
    from real_data.pretrain import PretrainSettings, pretrain_model, save_pretrained

    cfg = tiny_config("algorithm.name=fedavg", f"model.activation={activation}")
    mcfg = complete_model_config("vit", cfg.model.params, dataset.input_shape, 10)
    model = build_model("vit", mcfg, 5, dataset.x_train.dtype)
    res = pretrain_model(model, dataset, PretrainSettings("digits", skip=PRETRAIN_SKIP,
                                                          epochs=2, batch_size=32, lr=1e-2),
                         torch.device("cpu"))
    path = tmp_path / "pretrained.pt"
    save_pretrained(path, res, {"source": "digits", "model_config": {"activation": activation}})
    return path, res


def pretrain_target(dataset) -> TensorDataset:
    """The first PRETRAIN_SKIP training samples: the federation's data beside a pretraining."""
    return TensorDataset(dataset.name, dataset.task, dataset.x_train[:PRETRAIN_SKIP],
                         dataset.y_train[:PRETRAIN_SKIP], dataset.x_test, dataset.y_test, 10)


def plain_loop(fed, part, rounds: int, *, scaffold: bool = False, mu: float = 0.0,
               frozen: tuple[str, ...] = (), t0: int | None = None):
    """A FedAvg-family round, one client after another, in float64: (x, c, c_m) per round.

    Client m of round t starts from x and takes K_m steps on the runner's minibatches on the
    parameters that train (every one, or all but ``frozen`` after round ``t0``), on the
    gradient g_m(y) + mu (y - x) (FedProx's term). Plain SGD, written out: y <- y - eta
    (g + c - c_m); heavy-ball SGD: ``torch.optim.SGD`` on g + c - c_m; Adam:
    ``torch.optim.Adam`` on g, then y <- y - eta (c - c_m) (SCAFFOLD's correction only with
    ``scaffold``). SCAFFOLD's option II on the trained parameters: c_m+ = c_m - c + (x - y) /
    (A eta), A = K_m, or with momentum beta the sum of the heavy-ball weights
    sum_{k <= K_m} (1 - beta^k) / (1 - beta); the other variates stay. Server: x <- x + eta_g
    sum_m p_m (y_m - x) (the runner's sample weights p_m, eta_g the algorithm's ``server_lr``
    or 1), c <- c + (1/N) sum_m Delta c_m. eta is the round's learning rate of the schedule.
    """
    from torch.func import functional_call

    from real_data.engines import make_batches, task_loss
    from real_data.federation import sample_clients

    cfg, model, t = fed.cfg, fed.model, fed.cfg.train
    n_clients = part.num_clients
    eta_g = getattr(cfg.algorithm.params, "server_lr", 1.0)
    x = {n: p.detach().clone() for n, p in fed.initial_state().global_params.items()}
    c = {n: torch.zeros_like(p) for n, p in x.items()}
    ci = [{n: torch.zeros_like(p) for n, p in x.items()} for _ in range(n_clients)]
    state = fed.initial_state()
    out = []
    for rnd in range(1, rounds + 1):
        trained = [n for n in x if t0 is None or rnd <= t0 or n not in frozen]
        ids = sample_clients(cfg.role_seed("sampling"), rnd, n_clients, t.clients_per_round)
        eta = fed.round_lr(state, rnd)
        batches = make_batches(part.train, ids, cfg.role_seed("training"), rnd, t.batch_size,
                               t.local_steps, t.local_epochs)
        ys, deltas = [], []
        for j, m in enumerate(ids):
            y = {n: p.clone().requires_grad_(n in trained) for n, p in x.items()}
            live = [y[n] for n in trained]
            opt = (torch.optim.Adam(live, lr=eta) if t.optimizer == "adam" else
                   torch.optim.SGD(live, lr=eta, momentum=t.momentum))
            k = int(batches.steps[j])
            for s in range(k):
                ix = batches.idx[j, s]
                loss = task_loss(functional_call(model, y, (fed.x_train[ix],)),
                                 fed.y_train[ix])
                grads = dict(zip(trained, torch.autograd.grad(loss, live)))
                with torch.no_grad():
                    for n in trained:
                        grads[n] = grads[n] + mu * (y[n] - x[n])
                        if scaffold and t.optimizer == "sgd":
                            grads[n] = grads[n] + c[n] - ci[m][n]
                    if t.optimizer == "sgd" and not t.momentum:  # the paper's step
                        for n in trained:
                            y[n].sub_(eta * grads[n])
                        continue
                    for n in trained:
                        y[n].grad = grads[n]
                    opt.step()
                    if scaffold and t.optimizer == "adam":
                        for n in trained:
                            y[n].sub_(eta * (c[n] - ci[m][n]))
            y = {n: p.detach() for n, p in y.items()}
            if scaffold:
                b = t.momentum if t.optimizer == "sgd" else 0.0
                a = sum((1 - b**i) / (1 - b) for i in range(1, k + 1)) if b else k
                new = {n: ci[m][n] - c[n] + (x[n] - y[n]) / (a * eta) if n in trained
                       else ci[m][n] for n in x}
                deltas.append({n: new[n] - ci[m][n] for n in x})
                ci[m] = new
            ys.append(y)
        sizes = torch.as_tensor(part.sizes[ids], dtype=torch.float64)
        p = sizes / sizes.sum()
        x = {n: v + eta_g * sum(p[j] * (ys[j][n] - v) for j in range(len(ids)))
             for n, v in x.items()}
        c = {n: v + sum(d[n] for d in deltas) / n_clients for n, v in c.items()}
        out.append(({n: v.clone() for n, v in x.items()}, {n: v.clone() for n, v in c.items()},
                    [{n: v.clone() for n, v in cm.items()} for cm in ci]))
    return out


def max_abs_error(a: dict, b: dict) -> float:
    """The largest absolute difference over the tensors of ``a`` and their namesakes in ``b``."""
    return max(float((a[n] - b[n]).abs().max()) for n in a)


# the attention key biases get no data gradient (softmax is shift-invariant in them), so under
# FedProx's term alone the fast and the sequential engine part there by about 1e-3; the metrics
# that sum over them are compared through the other parameters instead
KEY_BIAS_METRICS = ("qk_change", "update_norm", "update_dispersion", "update_dispersion_rel")


def assert_rows_agree(alone, group, skip: tuple[str, ...] = (), rel: float = 1e-6,
                      floor: float = 1e-9) -> None:
    """The same (round, client, metric, stage) rows in two metrics.csv, every value within
    ``rel`` (relative, with the absolute ``floor``), metrics in ``skip`` left out."""
    a, g = metric_rows(alone), metric_rows(group)
    assert a.keys() == g.keys(), (alone, group)
    bad = {k: (a[k], g[k]) for k in a
           if k[2] not in skip and abs(a[k] - g[k]) > rel * abs(a[k]) + floor}
    assert not bad, (alone, list(bad.items())[:5])


def assert_group_equals_alone(tmp_path, cfgs: dict, skip: dict | None = None) -> None:
    """Each config of ``cfgs`` (name -> Config) run alone and all of them as one stacked group
    (:func:`real_data.stacked_runs.run_group`): every run's metrics.csv rows agree within
    :func:`assert_rows_agree`'s tolerance; ``skip`` maps a run's name to metrics left out."""
    from real_data.runs import load_data, start_run
    from real_data.stacked_runs import RunRequest, run_group

    for name, cfg in cfgs.items():
        start_run(cfg, out=tmp_path / "alone" / name)
    run_group([RunRequest(tmp_path / "group" / n, c) for n, c in cfgs.items()],
              dataset=load_data(next(iter(cfgs.values()))), log=lambda s: None)
    for name in cfgs:
        assert_rows_agree(tmp_path / "alone" / name / "metrics.csv",
                          tmp_path / "group" / name / "metrics.csv", (skip or {}).get(name, ()))


def assert_run_refused(tmp_path, capsys, args: list[str], text: str) -> None:
    """``linattn run --config digits_vit ARGS`` exits 2, says ``text`` on stderr and writes
    nothing under its ``run.out_dir``."""
    from linattn.cli import main as linattn_main

    out = tmp_path / "runs"
    code = linattn_main(["run", "--config", "digits_vit", *args, f"run.out_dir={out}"])
    assert code == 2
    assert text in capsys.readouterr().err
    assert not out.exists() or not any(out.iterdir())
