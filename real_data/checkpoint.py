"""Checkpoints: the whole :class:`~real_data.federation.FedState` plus every RNG state.

The run's randomness is derived from (seed, round, client) so resuming does not need the RNG
states; they are saved (and restored) anyway so that any code drawing from a global generator
resumes identically as well. Files are written atomically (temporary file, then rename): a
write that fails (disk full, read-only file system) leaves the previous file as it was and no
temporary file, and raises an ``OSError`` naming the checkpoint. A file that is not one of our
checkpoints (truncated, garbage, another program's) raises :class:`DataError` naming it.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch

from linattn.errors import DataError
from linattn.fileio import atomic_path
from real_data.federation import FedState


def rng_states() -> dict:
    out = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
           "python": random.getstate()}
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def restore_rng_states(states: dict) -> None:
    """Restore the generators from ``rng_states()``'s dict. ``torch.set_rng_state`` needs CPU
    byte tensors, and a checkpoint loaded onto a GPU holds them there (resuming a CUDA run
    once failed so): they are moved back here."""
    torch.set_rng_state(states["torch"].cpu())
    np.random.set_state(states["numpy"])
    random.setstate(states["python"])
    if "cuda" in states and torch.cuda.is_available():
        cuda = [s.cpu() for s in states["cuda"]][: torch.cuda.device_count()]
        for index, state in enumerate(cuda):
            torch.cuda.set_rng_state(state, index)


def save_checkpoint(path: Path, state: FedState, extra: dict) -> None:
    """Write ``state`` and ``extra`` (elapsed time, config) atomically."""
    # each tensor its own storage: a parameter averaged in a chunk is a view of it (and a
    # frozen one of an earlier round's), and torch.save writes a view's whole storage
    payload = {"round": state.round,
               "global_params": {n: t.clone() for n, t in state.global_params.items()},
               "client_state": state.client_state, "server_state": state.server_state,
               "prev_grad_norm_last": state.prev_grad_norm_last, "plateau": state.plateau,
               "rng": rng_states(),
               "extra": extra}
    # through a file object: a failed write raises the OSError (ENOSPC, EROFS, ...) rather
    # than torch's RuntimeError from its own writer
    with atomic_path(path) as tmp, open(tmp, "wb") as fh:
        torch.save(payload, fh)


_KEYS = {"round", "global_params", "client_state", "server_state", "prev_grad_norm_last",
         "rng", "extra"}
_CORRUPT_FIX = ("move it away to restart the run from round 0, or copy a good "
                "checkpoints/round_<t>.pt over it")


def read_payload(path: Path, device, fix: str = _CORRUPT_FIX):
    """The unpickled contents of a checkpoint file (our own files: full unpickling); a file
    that does not load (truncated zip, garbage, a foreign pickle) is a DataError naming it
    and ``fix``."""
    with open(path, "rb") as fh:  # a missing or unreadable file: the OSError names it
        try:
            return torch.load(fh, map_location=device, weights_only=False)
        except Exception as exc:  # noqa: BLE001 - truncated zip, garbage, a foreign pickle
            first = (str(exc).strip().splitlines() or [""])[0][:120]
            raise DataError(f"{path}: not a readable checkpoint ({type(exc).__name__}: {first}); "
                            f"{fix}") from None


def load_checkpoint(path: Path, device: torch.device) -> tuple[FedState, dict, dict]:
    """(state, extra, rng states) from a checkpoint file (our own files: full unpickling).

    Everything (modules in a server state too, e.g. FedTP's hypernetwork) goes to ``device``;
    :func:`restore_rng_states` takes the generator states wherever they were loaded.
    """
    payload = read_payload(path, device)
    if not (isinstance(payload, dict) and _KEYS <= set(payload)):
        raise DataError(f"{path}: not a linattn checkpoint (no {', '.join(sorted(_KEYS))}); "
                        f"{_CORRUPT_FIX}")
    state = FedState(payload["round"], payload["global_params"], payload["client_state"],
                     payload["server_state"], payload["prev_grad_norm_last"],
                     payload.get("plateau"))
    return state, payload["extra"], payload["rng"]
