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
