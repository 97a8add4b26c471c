"""Figure 6: gradient-norm jumps after aggregation, full-model training versus frozen stage.

The jump of round t is the ratio of the clients' gradient norm at the first local step of
round t (at the freshly aggregated global model) to its norm at the last local step of round
t - 1 (at the client's own iterate), both averaged over clients with weights p_m:

    jump_t = sum_m p_m ||g_m(x_t)|| / sum_m p_m ||g_m(y_{m,t-1}^{(K-1)})||.

Left: the simulator's per-round jumps (minibatch gradients of the whole model, mean +- 2 SE
over seeds; ``compute_metrics(...).gradient_jump``), full-model training for all T rounds.
The simulator records gradient norms only while the whole model trains, so the right panel
compares the two stages on the exact population dynamics instead: the same ratio with exact
client gradients (``linattn_theory.objectives.local_gradients``) along a run with warm-up
T0 = T/3, the whole model's gradient before T0 and the value block's after (the round that
crosses T0 is left out), beside the same rounds with the whole model trained throughout.
Both are computed here and cached.

    python -m figures.fig6_gradient_jumps [--quick] [--out DIR]
"""

from __future__ import annotations

import numpy as np
from matplotlib.lines import Line2D

from figures import common
from figures.cache import cached, source_digest
from figures.common import FigureOutput, cache_config, fmt, grid_setting, run_standalone
from figures.style import new_figure, save, series_style
from linattn_theory.objectives import local_gradients

NAME = "fig6_gradient_jumps"


def schedule(grid) -> tuple[int, float, int]:
    """(K, eta, T0 of the right panel): the last P1 point's K and eta, T0 = T // 3."""
    _, k, lr = grid.p1_points[-1]
    return k, lr, grid.total_rounds // 3


def population_jumps(problem, start, lr: float, local_steps: int, total_rounds: int,
                     warmup_rounds: int) -> dict:
    """Per-round gradient norms and jumps of two-stage FedAvg with exact client gradients.

    Rounds t < T0 train (M, V) (eq. 19, norm of the whole gradient), rounds t >= T0 train V
    with M = M_T0 (eq. 14, norm of grad_V). Returns ``first``, ``last`` (T,) and ``jump``
    (T,), jump[t] = first[t] / last[t-1] (NaN at t = 0 and at t = T0, where the norm changes
    from the whole model's to the value block's), and the global ``kernels`` (T0+1, d, d).
    """
    p = problem.weights
    c = problem.num_clients
    kernel, value = np.array(start.kernel, dtype=float), np.array(start.value, dtype=float)
    first, last, kernels = np.empty(total_rounds), np.empty(total_rounds), [kernel]
    for t in range(total_rounds):
        frozen = t >= warmup_rounds
        m = np.repeat(kernel[None], c, axis=0)  # (C, d, d) one local copy per client
        v = np.repeat(value[None], c, axis=0)  # (C, d, d_y)
        for k in range(local_steps):
            grad_m, grad_v = local_gradients(problem, m, v)
            sq = np.sum(grad_v**2, axis=(1, 2))
            if not frozen:
                sq = sq + np.sum(grad_m**2, axis=(1, 2))
            norm = float(p @ np.sqrt(sq))
            if k == 0:
                first[t] = norm
            last[t] = norm
            v = v - lr * grad_v
            if not frozen:
                m = m - lr * grad_m
        value = np.tensordot(p, v, axes=1)
        if not frozen:
            kernel = np.tensordot(p, m, axes=1)
            kernels.append(kernel)
    jump = np.full(total_rounds, np.nan)
    jump[1:] = first[1:] / last[:-1]
    if 0 < warmup_rounds < total_rounds:
        jump[warmup_rounds] = np.nan
    return {"first": first, "last": last, "jump": jump, "kernels": np.array(kernels)}


def compute_jumps(grid, cache_dir=None) -> tuple[dict, bool]:
    """Simulator jumps (full model, T rounds) and population jumps (two-stage), cached."""
    k, lr, t0 = schedule(grid)

    def compute():
        from simulations.engine import simulate
        from simulations.metrics import compute_metrics, mean_se

        settings = [grid_setting(grid, z, k, lr, warmup_rounds=(grid.total_rounds,))
                    for z in grid.heterogeneity]
        out = {}
        for st, res in zip(settings, simulate(settings, list(range(grid.seeds)))):
            jumps = compute_metrics(res).gradient_jump  # (S, T - 1): rounds 1..T-1
            mean, se = mean_se(jumps)
            two_stage = population_jumps(st.problem, st.start(), lr, k, grid.total_rounds, t0)
            full = population_jumps(st.problem, st.start(), lr, k, grid.total_rounds,
                                    grid.total_rounds)
            out[st.label] = {"heterogeneity": st.problem.knobs["kernel_heterogeneity"],
                             "sim_mean": mean.tolist(), "sim_se": se.tolist(),
                             "population_jump": two_stage["jump"].tolist(),
                             "population_jump_full": full["jump"].tolist()}
        return out

    config = cache_config(grid, schedule=[k, lr, t0],
                          code=source_digest(__file__, common.__file__))
    return cached("fig6_jumps", config, compute, cache_dir)


def make(result: dict, grid, out_dir=None, cache_dir=None) -> FigureOutput:
    data, hit = compute_jumps(grid, cache_dir)
    k, lr, t0 = schedule(grid)
    fig, axes = new_figure(ncols=2, width=3.9, height=3.3)
    for i, rec in enumerate(data.values()):
        style = series_style(i)
        rounds = np.arange(1, len(rec["sim_mean"]) + 1)
        mean, se = np.asarray(rec["sim_mean"]), np.asarray(rec["sim_se"])
        axes[0].plot(rounds, mean, ms=3, markevery=max(1, len(rounds) // 12),
                     label=rf"$\zeta$={rec['heterogeneity']:g}", **style)
        axes[0].fill_between(rounds, mean - 2 * se, mean + 2 * se, color=style["color"],
                             alpha=0.2, lw=0)
        full, frozen = _series(rec["population_jump_full"]), _series(rec["population_jump"])
        frozen[:t0] = np.nan
        x = np.arange(len(full))
        axes[1].plot(x, full, ms=3, markevery=max(1, len(x) // 12), **style)
        axes[1].plot(x, frozen, ms=3.5, markevery=max(1, len(x) // 12), mfc="white", **style)
    axes[0].set_title(f"simulator, full model (B={grid.batch_size}, K={k}, "
                      rf"$\eta$={lr:g})", fontsize=9)
    axes[1].axvline(t0, color="0.5", ls=":", lw=1)
    axes[1].text(t0, 0.02, rf" kernel frozen at $T_0$={t0}", fontsize=7, va="bottom",
                 transform=axes[1].get_xaxis_transform())
    axes[1].set_title(f"exact gradients, population (K={k}, " rf"$\eta$={lr:g})", fontsize=9)
    handles = [Line2D([], [], label=rf"$\zeta$={rec['heterogeneity']:g}", **series_style(i))
               for i, rec in enumerate(data.values())]
    handles += [Line2D([], [], color="0.3", marker="o", label="whole model trained throughout"),
                Line2D([], [], color="0.3", marker="o", mfc="white",
                       label=r"kernel frozen from $T_0$ (V only)")]
    top = axes[1].get_ylim()[1]
    axes[1].set_ylim(top=top + 0.45 * (top - axes[1].get_ylim()[0]))
    axes[1].legend(handles=handles, fontsize=7, loc="upper left", ncol=2)
    axes[0].legend(fontsize=7, loc="upper left")
    for ax in axes:
        ax.set_xlabel("round t")
        ax.set_ylabel(r"gradient-norm jump after aggregation")
    paths = save(fig, NAME, out_dir)
    return FigureOutput(6, NAME, tuple(paths), caption(result, grid, data),
                        cache_hits={"jumps": hit})


def _series(values) -> np.ndarray:
    return np.array([np.nan if v is None else v for v in values], dtype=float)


def stage_means(data: dict, grid) -> dict[str, tuple[float, float, float]]:
    """Per setting: the simulator's mean jump over all rounds, and the population's mean
    jump over the rounds after T0 with the whole model trained and with the kernel frozen."""
    _, _, t0 = schedule(grid)
    out = {}
    for label, rec in data.items():
        full, frozen = _series(rec["population_jump_full"]), _series(rec["population_jump"])
        out[label] = (float(np.mean(rec["sim_mean"])), float(np.nanmean(full[t0 + 1:])),
                      float(np.nanmean(frozen[t0 + 1:])))
    return out


def caption(result: dict, grid, data: dict) -> str:
    k, lr, t0 = schedule(grid)
    means = stage_means(data, grid)
    parts = "; ".join(f"zeta={data[label]['heterogeneity']:g}: simulator {fmt(sim)}, "
                      f"population full model {fmt(full)} vs frozen {fmt(frozen)}"
                      for label, (sim, full, frozen) in means.items())
    return (f"Gradient-norm jump after aggregation per round (K = {k}, eta = {lr:g}). Left: "
            f"simulator, whole-model minibatch gradients (B = {grid.batch_size}), mean +- 2 SE "
            f"over {grid.seeds} seeds (band). Right: exact client gradients along the "
            f"population dynamics, the whole model trained throughout (filled markers) or the "
            f"kernel frozen from T0 = {t0} on (open markers, value-block gradient). Mean jumps "
            f"(population: rounds after T0): {parts}.")


def main(argv=None) -> int:
    return run_standalone(make, __doc__, argv)


if __name__ == "__main__":
    raise SystemExit(main())
