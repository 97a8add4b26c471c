"""Checkpoints: the whole :class:`~real_data.federation.FedState` plus every RNG state.

The run's randomness is derived from (seed, round, client) so resuming does not need the RNG
states; they are saved (and restored) anyway so that any code drawing from a global generator
resumes identically as well. Files are written atomically (temporary file, then rename).
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import torch

from real_data.federation import FedState


def rng_states() -> dict:
    out = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
           "python": random.getstate()}
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def restore_rng_states(states: dict) -> None:
    """Restore the generators; the states must be CPU byte tensors (as ``rng_states`` gives and
    ``load_checkpoint`` returns them, whatever device the run itself uses)."""
    torch.set_rng_state(states["torch"].cpu())
    np.random.set_state(states["numpy"])
    random.setstate(states["python"])
    if "cuda" in states and torch.cuda.is_available():
        cuda = [s.cpu() for s in states["cuda"]][: torch.cuda.device_count()]
        for index, state in enumerate(cuda):
            torch.cuda.set_rng_state(state, index)


def _to_device(obj, device: torch.device):
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        moved = [_to_device(v, device) for v in obj]
        return type(obj)(moved) if isinstance(obj, list) or not hasattr(obj, "_fields") \
            else type(obj)(*moved)
    return obj


def save_checkpoint(path: Path, state: FedState, extra: dict) -> None:
    """Write ``state`` and ``extra`` (elapsed time, config) atomically."""
    payload = {"round": state.round, "global_params": state.global_params,
               "client_state": state.client_state, "server_state": state.server_state,
               "prev_grad_norm_last": state.prev_grad_norm_last, "rng": rng_states(),
               "extra": extra}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(payload, tmp)
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def load_checkpoint(path: Path, device: torch.device) -> tuple[FedState, dict, dict]:
    """(state, extra, rng states) from a checkpoint file (our own files: full unpickling).

    The model state goes to ``device``; the generator states stay on the CPU, where
    ``torch.set_rng_state`` needs them (loading them onto a GPU broke resuming CUDA runs).
    """
    payload = torch.load(path, map_location="cpu", weights_only=False)
    state = FedState(payload["round"], _to_device(payload["global_params"], device),
                     _to_device(payload["client_state"], device),
                     _to_device(payload["server_state"], device), payload["prev_grad_norm_last"])
    return state, payload["extra"], payload["rng"]
