"""Divergence of simulated runs: which seeds of a setting blew up, and from which round.

A run has diverged at round t when its global model (M_t, V_t) holds a NaN, an infinity or an
entry beyond :data:`LIMIT` in absolute value (squares of such entries overflow float64 in the
metrics). The warm-up is checked on ``kernels``/``values``; each frozen stage (one per T0) on
its own value path. :func:`simulations.metrics.compute_metrics` reports NaN for every metric of
a diverged round instead of feeding it to a linear solver.
"""

from __future__ import annotations

import numpy as np

LIMIT = 1e30


def healthy(x: np.ndarray, matrix_axes: int = 2) -> np.ndarray:
    """True where the trailing ``matrix_axes`` axes of ``x`` are all finite and within
    :data:`LIMIT` (NaN compares False, so it counts as not healthy)."""
    axes = tuple(range(x.ndim - matrix_axes, x.ndim))
    with np.errstate(invalid="ignore"):
        return np.all(np.abs(x) <= LIMIT, axis=axes)


def _first_bad(ok: np.ndarray) -> int | None:
    bad = np.flatnonzero(~ok)
    return int(bad[0]) if bad.size else None


def diverged_runs(result) -> list[dict]:
    """One record per diverged seed of a :class:`~simulations.engine.SimResult`.

    Each record: ``seed``, ``warmup_round`` (the first warm-up round t whose (M_t, V_t) is not
    healthy, or ``None``) and ``frozen`` (T0 -> the first round of that frozen stage that is
    not healthy, for the T0 whose stage diverged on its own).
    """
    warm = healthy(result.kernels) & healthy(result.values)  # (S, H+1)
    out = []
    t0s = [int(t) for t in result.setting.warmup_rounds]
    for k, seed in enumerate(np.asarray(result.seeds).tolist()):
        first = _first_bad(warm[k])
        frozen = {}
        for j, t0 in enumerate(t0s):
            if first is not None and first <= t0:
                continue  # its warm-up had diverged already
            path = result.frozen_values[k, j, t0:]
            bad = _first_bad(healthy(path))
            if bad is not None:
                frozen[t0] = t0 + bad
        if first is not None or frozen:
            out.append({"seed": int(seed), "warmup_round": first, "frozen": frozen})
    return out


def describe(records: list[dict]) -> str:
    """``seed 0: warm-up from round 3; seed 2: frozen stage of T0=8 from round 12``."""
    parts = []
    for r in records:
        where = [f"warm-up from round {r['warmup_round']}"] if r["warmup_round"] is not None \
            else []
        where += [f"frozen stage of T0={t0} from round {rnd}" for t0, rnd in r["frozen"].items()]
        parts.append(f"seed {r['seed']}: {', '.join(where)}")
    return "; ".join(parts)
