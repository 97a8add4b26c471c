"""A lower bound on the memory one round needs, so that what cannot fit is refused up front.

The bound counts only what a round must hold at once, whatever the engine does to save memory
(the fast engine trains clients in chunks as small as one client):

- the round's minibatch plan: ``C x S x B`` int64 indices (C clients, S steps, B samples),
- one client's local step: its inputs and, per block, the saved activations of ``B`` samples
  (``~ 8 d + 2 m`` numbers per token, plus ``h N`` attention weights per token for softmax),
- the model three times (the global copy, one client's copy, its gradient),
- one evaluation batch of ``min(eval.batch_size, test samples)`` samples.

A config whose bound exceeds the device's memory (GPU: its total memory; CPU: the physical
memory, or the cgroup limit when lower) is refused with the keys that make it large. Anything
under the bound may still run out of memory; that is for the engine to handle.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from linattn.errors import ConfigError

GIB = 2**30


def _tokens_and_width(model, input_shape: tuple[int, ...]) -> tuple[int, int]:
    """(tokens per sample N, input numbers per sample) of a resolved model config."""
    numel = math.prod(input_shape)
    if hasattr(model, "patch"):  # ViT: (H / p)^2 patches and the CLS token
        return (model.image_size // model.patch) ** 2 + 1, numel
    return model.seq_len, numel


def parameter_count(model) -> int:
    """Parameters of a resolved ViT or character-Transformer config (biases included)."""
    d, m, depth = model.dim, model.mlp_dim, model.depth
    block = 4 * (d * d + d) + 2 * d * m + d + m + 4 * d  # q, k, v, out; MLP; two norms
    if hasattr(model, "patch"):
        tokens = (model.image_size // model.patch) ** 2 + 1
        embed = model.channels * model.patch**2 * d + d + d + tokens * d
        head = 2 * d + d * model.num_classes + model.num_classes
    else:
        embed = model.vocab_size * d + model.seq_len * d
        head = 2 * d + d * model.vocab_size + model.vocab_size
    return embed + depth * block + head


def round_bytes(cfg, input_shape: tuple[int, ...], client_sizes, test_samples: int
                ) -> dict[str, tuple[int, str]]:
    """Lower bounds in bytes by part of a round -> (bytes, the keys that set it).

    ``cfg`` is a resolved :class:`~real_data.config.Config` (model fields filled from the
    data); ``client_sizes`` the training samples of each client.
    """
    t, model = cfg.train, cfg.model.params
    act = 8 if t.precision == "fp64" else (2 if t.precision == "bf16" else 4)
    param = 8 if t.precision == "fp64" else 4
    tokens, numel = _tokens_and_width(model, input_shape)
    d, m, depth, heads = model.dim, model.mlp_dim, model.depth, model.heads
    per_token = 8 * d + 2 * m + (heads * tokens if model.attention == "softmax" else 0)
    clients = min(t.clients_per_round or len(client_sizes), len(client_sizes))
    largest = max(client_sizes, default=1)
    steps = t.local_steps if t.local_steps is not None else \
        max(1, math.ceil(t.local_epochs * largest / t.batch_size))
    b, e = t.batch_size, min(cfg.eval.batch_size, max(test_samples, 1))
    return {
        "the round's minibatch plan": (
            8 * clients * steps * b,
            "train.batch_size, train.local_steps (or local_epochs), train.clients_per_round"),
        "one client's local step": (
            b * (numel * act + tokens * depth * per_token * act),
            "train.batch_size, model.dim, model.mlp_dim, model.depth"),
        "the model, a client's copy and its gradient": (
            3 * param * parameter_count(model), "model.dim, model.mlp_dim, model.depth"),
        "one evaluation batch": (
            e * (numel * act + tokens * per_token * act), "eval.batch_size"),
    }


def device_memory(device: torch.device) -> int:
    """Bytes the device can hold: a GPU's total memory; the CPU's physical memory (or the
    cgroup's limit when it is lower)."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit in (Path("/sys/fs/cgroup/memory.max"),
                  Path("/sys/fs/cgroup/memory/memory.limit_in_bytes")):
        try:
            total = min(total, int(limit.read_text().strip()))
        except (OSError, ValueError):
            continue
    return int(total)


def check_memory(cfg, dataset, partition, device: torch.device) -> None:
    """Raise :class:`ConfigError` when a round's lower bound exceeds ``device``'s memory."""
    parts = round_bytes(cfg, tuple(dataset.input_shape), [len(ix) for ix in partition.train],
                        len(dataset.y_test))
    need = sum(b for b, _ in parts.values())
    have = device_memory(device)
    if need <= have:
        return
    name, (size, keys) = max(parts.items(), key=lambda kv: kv[1][0])
    raise ConfigError(
        f"one round needs at least {need / GIB:.3g} GiB ({name}: {size / GIB:.3g} GiB) but "
        f"the {device.type} device has {have / GIB:.3g} GiB; lower {keys} "
        f"(train.batch_size={cfg.train.batch_size}, eval.batch_size={cfg.eval.batch_size}, "
        f"model.dim={cfg.model.params.dim})")
