"""Central pretraining on a source data set: FedSQ's structural copy S and its initial Q.

``linattn pretrain --config fmnist_vit_fedsq --source mnist --out pretrained/mnist_vit.pt``
trains the run config's model (same architecture; the source data's shape and classes) with
Adam on the whole source training split and writes the parameters plus their provenance.
A disjoint split of the target data set: ``--source fmnist --source-skip 30000`` trains on the
training samples after the first 30000, and the target run sets ``data.train_limit=30000``.
For naturally split data (Shakespeare) ``--exclude-largest-groups 100`` trains only on the
roles outside the 100 largest, the clients a ``partition.scheme=natural num_clients=100`` run
federates, so the transfer source is disjoint from every federated client.

The file holds ``{"params": {name: tensor}, "meta": {...}}`` (tensors and plain values only,
read back with ``torch.load(weights_only=True)``).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from linattn.errors import ConfigError, UserError
from real_data.engines.base import task_loss
from real_data.metrics import evaluate


@dataclass(frozen=True)
class PretrainSettings:
    """Attributes
    ----------
    source : str
        Source data set (``real_data.data.load_dataset`` name).
    skip, limit : int
        Use training samples ``skip .. skip + limit`` of the source (``limit=None``: to the end).
    epochs, batch_size : int
    lr, weight_decay : float
        Adam's step size and L2 coefficient.
    seed : int
        Model initialization and minibatch order.
    exclude_largest_groups : int
        Natural-client data only: leave out the training samples of the N largest groups
        (the clients of a ``natural`` partition with ``num_clients=N``); 0 keeps all.
    """

    source: str = "mnist"
    skip: int = 0
    limit: int | None = None
    epochs: int = 3
    batch_size: int = 64
    lr: float = 1e-3
    weight_decay: float = 0.0
    seed: int = 0
    exclude_largest_groups: int = 0

    def __post_init__(self) -> None:
        checks = [(self.skip >= 0, "--source-skip", self.skip, ">= 0"),
                  (self.limit is None or self.limit >= 1, "--source-limit", self.limit, ">= 1"),
                  (self.epochs >= 1, "--epochs", self.epochs, ">= 1"),
                  (self.batch_size >= 1, "--batch-size", self.batch_size, ">= 1"),
                  (self.lr > 0, "--lr", self.lr, "> 0"),
                  (self.exclude_largest_groups >= 0, "--exclude-largest-groups",
                   self.exclude_largest_groups, ">= 0")]
        for ok, key, value, allowed in checks:
            if not ok:
                raise ConfigError(f"{key}={value} must be {allowed}")


@dataclass(frozen=True)
class PretrainResult:
    """Trained parameters, the source test accuracy and the mean loss of every epoch."""

    params: dict[str, torch.Tensor]
    source_test_acc: float
    epoch_losses: tuple[float, ...]


def pretrain_model(model: torch.nn.Module, dataset, settings: PretrainSettings,
                   device: torch.device) -> PretrainResult:
    """Train ``model`` (in place) on the training split of ``dataset`` (a TensorDataset)."""
    index = source_indices(dataset, settings)
    x = dataset.x_train[index].to(device)
    y = dataset.y_train[index].to(device)
    if len(y) == 0:
        raise UserError(f"--source-skip={settings.skip} leaves no training samples of "
                        f"{dataset.name} ({len(dataset.y_train)} in all)")
    if x.is_floating_point():
        x = x.to(next(model.parameters()).dtype)
    opt = torch.optim.Adam(model.parameters(), lr=settings.lr,
                           weight_decay=settings.weight_decay)
    order_rng = torch.Generator().manual_seed(settings.seed)
    losses = []
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(settings.seed)
        model.train()
        for _ in range(settings.epochs):
            # 1. one pass over a fresh permutation, full batches only
            perm = torch.randperm(len(y), generator=order_rng).to(device)
            total, count = 0.0, 0
            for start in range(0, len(y) - settings.batch_size + 1, settings.batch_size):
                ix = perm[start:start + settings.batch_size]
                loss = task_loss(model(x[ix]), y[ix])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                total, count = total + float(loss.detach()), count + 1
            losses.append(total / max(count, 1))
        model.eval()
    xt = dataset.x_test.to(device)
    xt = xt.to(next(model.parameters()).dtype) if xt.is_floating_point() else xt
    _, hit = evaluate(model, xt, dataset.y_test.to(device), 1024)
    params = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    return PretrainResult(params, float(hit.mean()), tuple(losses))


def source_indices(dataset, settings: PretrainSettings) -> torch.Tensor:
    """Indices of the source training samples used: skip/limit, minus excluded groups."""
    index = np.arange(len(dataset.y_train))
    if settings.exclude_largest_groups:
        if dataset.groups_train is None:
            raise UserError(f"--exclude-largest-groups needs natural clients; {dataset.name} "
                            "has none")
        from real_data.data.partition import natural

        if settings.exclude_largest_groups >= len(dataset.groups_train):
            raise UserError(f"--exclude-largest-groups={settings.exclude_largest_groups} leaves "
                            f"none of the {len(dataset.groups_train)} groups of {dataset.name}")
        taken = natural(dataset, settings.exclude_largest_groups, 0).train
        index = np.setdiff1d(index, np.concatenate(taken))
    end = None if settings.limit is None else settings.skip + settings.limit
    return torch.as_tensor(index[settings.skip:end])


def save_pretrained(path: Path, result: PretrainResult, meta: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"params": result.params, "meta": meta}, path)


def load_pretrained(path: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """(parameters, meta) of a file written by :func:`save_pretrained`."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"pretrained model {path} not found; make it with `linattn pretrain "
                        "--config <run config> --source <data set> --out <file>`")
    payload = torch.load(path, map_location="cpu", weights_only=True)
    return payload["params"], payload.get("meta", {})


def checked_pretrained(path: str | Path, ctx, key: str, reset_head: bool = True
                       ) -> dict[str, torch.Tensor]:
    """The parameters of pretrained file ``path`` for the model of ``ctx`` (an
    :class:`~real_data.algorithms.AlgorithmContext`); every mismatch (model settings,
    parameter names, shapes outside the head when ``reset_head``) is a UserError naming
    ``key`` and the fix."""
    from real_data.models import names_of_kind

    loaded, meta = load_pretrained(path)
    trained_on, ours = meta.get("model_config") or {}, ctx.model or {}
    for field in ("attention", "activation", "dim", "depth", "heads", "mlp_dim"):
        if field in trained_on and field in ours and trained_on[field] != ours[field]:
            raise UserError(f"{key}={path}: pretrained with model.{field}="
                            f"{trained_on[field]!r}, this run has model.{field}="
                            f"{ours[field]!r}; pretrain with the run's model (linattn pretrain "
                            f"--config <run config> ... model.{field}=<value>)")
    missing = [n for n in ctx.names if n not in loaded]
    if missing or set(loaded) - set(ctx.names):
        raise UserError(f"{key}={path}: its parameters do not match the model (missing "
                        f"{missing[:5]}); pretrain with the run's model")
    head = names_of_kind(ctx.groups, "head")
    for n, shape in ctx.shapes.items():
        if tuple(loaded[n].shape) != tuple(shape) and not (reset_head and n in head):
            raise UserError(f"{key}={path}: {n} has shape {tuple(loaded[n].shape)}, the "
                            f"model {tuple(shape)}")
    return loaded


def transfer_init(params: dict[str, torch.Tensor], loaded: dict[str, torch.Tensor], ctx,
                  reset_head: bool = True) -> dict[str, torch.Tensor]:
    """``params`` with every tensor replaced by the pretrained one (the head kept as
    initialized when ``reset_head``)."""
    from real_data.models import names_of_kind

    keep = names_of_kind(ctx.groups, "head") if reset_head else ()
    return {n: p if n in keep else loaded[n].to(p.device, p.dtype) for n, p in params.items()}


def run_pretrain(cfg, settings: PretrainSettings, out: Path, dataset=None) -> dict:
    """Pretrain the model of run config ``cfg`` on ``settings.source``; write ``out``.

    Returns the meta dict written beside the parameters (source, settings, accuracy, wall
    time, provenance).
    """
    from real_data.device import resolve_device
    from real_data.models import build_model, complete_model_config
    from real_data.rundir import provenance

    if dataset is None:
        from real_data.data import load_dataset

        dataset = load_dataset(settings.source, root=cfg.data.root)
    mcfg = complete_model_config(cfg.model.name, dataclasses.replace(
        cfg.model.params, **_data_fields(cfg.model.name)), dataset.input_shape,
        dataset.num_classes)
    device = resolve_device(cfg.train.device)
    dtype = torch.float64 if cfg.train.precision == "fp64" else torch.float32
    model = build_model(cfg.model.name, mcfg, settings.seed, dtype).to(device)
    start = time.perf_counter()
    result = pretrain_model(model, dataset, settings, device)
    meta = {"model": cfg.model.name, "model_config": _plain(dataclasses.asdict(mcfg)),
            "settings": _plain(dataclasses.asdict(settings)), "source": dataset.name,
            "samples": int(len(source_indices(dataset, settings))),
            "source_test_acc": result.source_test_acc,
            "epoch_losses": list(result.epoch_losses),
            "wall_time_s": time.perf_counter() - start,
            "provenance": _plain(provenance(device))}
    save_pretrained(out, result, meta)
    return meta


def _data_fields(model_name: str) -> dict:
    """Data-dependent model fields, cleared so that the source data fill them."""
    if model_name == "vit":
        return {"channels": None, "image_size": None, "num_classes": None}
    return {"seq_len": None, "vocab_size": None}


def _plain(x):
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_plain(v) for v in x]
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, str):  # also str subclasses such as torch.__version__
        return str(x)
    return x
