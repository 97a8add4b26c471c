"""FedPart (Wang et al., NeurIPS 2024, "Why Go Full?"): train and send one layer group a round."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from linattn.errors import ConfigError
from real_data.algorithms.base import Algorithm, RoundPlan, ServerUpdate
from real_data.models.groups import ParamGroup


@dataclass(frozen=True)
class FedPartParams:
    """The schedule, in the paper's symbols (defaults: the original's constants).

    Attributes
    ----------
    warmup_rounds : int
        W: full-network FedAvg rounds before the first cycle.
    rounds_per_group : int
        R: rounds each layer group trains, groups taken shallow -> deep.
    full_rounds_between : int
        F: full-network rounds between two cycles.
    cycles : int or None
        C: number of cycles; then ``train.rounds`` must equal W + C R G + (C - 1) F.
        ``None`` repeats the cycle (R G partial rounds, then F full ones) until
        ``train.rounds`` is reached, so the schedule fits any budget.
    """

    warmup_rounds: int = 5
    rounds_per_group: int = 2
    full_rounds_between: int = 5
    cycles: int | None = None

    def __post_init__(self) -> None:
        for key in ("warmup_rounds", "full_rounds_between"):
            if getattr(self, key) < 0:
                raise ConfigError(f"algorithm.{key}={getattr(self, key)} must be >= 0")
        if self.rounds_per_group < 1:
            raise ConfigError(f"algorithm.rounds_per_group={self.rounds_per_group} must be >= 1")
        if self.cycles is not None and self.cycles < 1:
            raise ConfigError(f"algorithm.cycles={self.cycles} must be >= 1 or null")


def fedpart_groups(groups: tuple[ParamGroup, ...]) -> tuple[tuple[str, ...], ...]:
    """FedPart's layer groups from the model's declared groups, shallow to deep.

    G_0 = ``embed``; per block i, the attention sub-block (norm1 + q, k, v, out) and then the
    FFN sub-block (norm2 + MLP); last the ``head`` group (final norm + classifier), so
    G = 2 depth + 2. A block's ``norm`` group declares norm1's tensors before norm2's (pre-norm
    blocks: ``group(..., "norm", i, [norm1, norm2])``), so its first half goes with attention.
    """
    out: list[tuple[str, ...]] = []
    per_layer: dict[int, dict[str, tuple[str, ...]]] = {}
    for g in groups:
        if g.layer is None:
            out.append(g.params)  # embed (first) or head (last), in forward order
        else:
            per_layer.setdefault(g.layer, {})[g.kind] = g.params
    head = out.pop()
    for layer in sorted(per_layer):
        kinds = per_layer[layer]
        norm = kinds.get("norm", ())
        if len(norm) % 2:
            raise ValueError(f"layer {layer}: the norm group {norm} does not split into "
                             "norm1 and norm2 halves")
        half = len(norm) // 2
        out.append(norm[:half] + kinds.get("qk", ()) + kinds.get("v", ())
                   + kinds.get("attn_out", ()))
        out.append(norm[half:] + kinds.get("mlp", ()))
    out.append(head)
    return tuple(out)


def schedule_total(params: FedPartParams, num_groups: int, cycles: int) -> int:
    """T = W + C R G + (C - 1) F."""
    return (params.warmup_rounds + cycles * params.rounds_per_group * num_groups
            + (cycles - 1) * params.full_rounds_between)


def active_group(rnd: int, params: FedPartParams, num_groups: int) -> int | None:
    """Index of the layer group trained in round ``rnd`` (1-based), ``None`` for a full round.

    After W warm-up rounds, each cycle is R rounds of group 0, R of group 1, ..., R of group
    G - 1, followed by F full rounds (none after the last of C cycles: the total is
    :func:`schedule_total`).
    """
    if rnd <= params.warmup_rounds:
        return None
    s = rnd - params.warmup_rounds - 1  # 0-based position after the warm-up
    partial = params.rounds_per_group * num_groups
    pos = s % (partial + params.full_rounds_between)
    return pos // params.rounds_per_group if pos < partial else None


@dataclass
class FedPartState:
    """FedPart's server state: what each client last received.

    Attributes
    ----------
    changed : dict
        Parameter name -> the last round its global value changed at the server (0: never).
    synced : np.ndarray
        ``(num_clients,)`` int64: the round whose global model each client last received
        (-1: never sampled).
    """

    changed: dict[str, int]
    synced: np.ndarray


class FedPart(Algorithm):
    """Partial network updates: in most rounds one layer group trains, is averaged and is sent.

    Round t trains the group :func:`active_group` picks; everything else stays at its global
    value, bit for bit. Choices the paper leaves open, made here:

    - Groups (:func:`fedpart_groups`) follow BASELINES.md's pre-norm mapping of the authors'
      Transformer grouping (their "FFN-plus-norms" sub-block becomes norm2 + MLP; norm1 goes
      with the attention it feeds).
    - Backward stops below the active group: the engines differentiate only the trainable
      tensors, and the frozen shallow layers are computed without an autograd graph (the
      vectorized engine passes them unbatched outside ``torch.func.grad``, the sequential one
      as tensors without ``requires_grad``). Layers above the group still carry the activation
      gradient but compute no weight gradient. The authors' framework ran the full backward;
      here the saving is real and is logged as ``train_flops``.
    - The local optimizer (Adam in the native protocol) starts from zero state every round, as
      in the paper; that is how every engine of this runner works.
    - Communication: upload = the active group. Download = what changed at the server since the
      client last received the model (the whole model the first time a client is sampled), so
      with full participation a client receives the group trained in the previous round.
    - ``cycles=None`` repeats the cycle until ``train.rounds`` (the paper fixes C).
    """

    name = "fedpart"
    Params = FedPartParams

    def __init__(self, params, ctx) -> None:
        super().__init__(params, ctx)
        self.layer_groups = fedpart_groups(ctx.groups)
        g = len(self.layer_groups)
        if params.cycles is not None:
            need = schedule_total(params, g, params.cycles)
            if need != ctx.total_rounds:
                raise ConfigError(
                    f"algorithm.cycles={params.cycles}: the schedule W + C R G + (C - 1) F has "
                    f"{need} rounds for G={g} groups, but train.rounds={ctx.total_rounds}; set "
                    f"train.rounds={need} or algorithm.cycles=null")
        elif params.warmup_rounds > ctx.total_rounds:
            raise ConfigError(f"algorithm.warmup_rounds={params.warmup_rounds} exceeds "
                              f"train.rounds={ctx.total_rounds}")

    def group_of(self, rnd: int) -> int | None:
        """The active layer group of round ``rnd`` (``None``: full network)."""
        return active_group(rnd, self.params, len(self.layer_groups))

    def init_server_state(self, global_params) -> FedPartState:
        return FedPartState({n: 0 for n in self.ctx.names},
                            np.full(self.ctx.num_clients, -1, dtype=np.int64))

    def plan_round(self, rnd, server_state):
        g = self.group_of(rnd)
        if g is None:
            names = self.ctx.names
            return RoundPlan(names, names, names, stage="full")
        names = self.layer_groups[g]
        return RoundPlan(names, names, names, stage=f"group{g}")

    def download_numel(self, plan, client_ids, server_state):
        changed, synced = server_state.changed, server_state.synced
        total = 0
        for m in client_ids:
            total += sum(int(np.prod(self.ctx.shapes[n])) for n, t in changed.items()
                         if t > synced[m])
        return total

    def server_update(self, rnd, plan, client_ids, global_params, results, weights,
                      server_state):
        server_state.synced[client_ids] = rnd - 1  # they received the round-(t-1) model
        for n in plan.upload:
            server_state.changed[n] = rnd
        update = super().server_update(rnd, plan, client_ids, global_params, results, weights,
                                       server_state)
        g = self.group_of(rnd)
        return ServerUpdate(update.params, {"fedpart_group": -1.0 if g is None else float(g)})

    def tag(self) -> str:
        p = self.params
        c = "fill" if p.cycles is None else str(p.cycles)
        return (f"fedpart-W{p.warmup_rounds}R{p.rounds_per_group}F{p.full_rounds_between}"
                f"C{c}")
