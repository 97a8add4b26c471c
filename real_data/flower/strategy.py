"""Flower strategies that run linattn's algorithms with linattn's round loop.

:class:`LinattnStrategy` is a Flower ``Strategy`` (a subclass of Flower's message-API FedAvg)
whose :meth:`~LinattnStrategy.start` runs a linattn run -- :func:`real_data.runs.start_run`
or :func:`~real_data.runs.resume_run`, so the same config, run directory, checkpoints and
resume -- with Flower as the transport: each round the strategy is the
:class:`~real_data.federation.Federation`'s trainer hook, sends one TRAIN message per sampled
client (:meth:`~LinattnStrategy.configure_train`) and turns the replies into the round's
client results (:meth:`~LinattnStrategy.aggregate_train`). The algorithm then updates the
global model exactly as in a native run: its ``server_update`` replaces the uploaded tensors by
their p-weighted average and keeps every other tensor at its previous global value, so partial
uploads (frozen Q/K, FedPart's inactive groups) are merged, never dropped -- unlike Flower's
own ``aggregate_arrayrecords``, whose result holds only the uploaded keys.

What travels: a client receives every tensor whose global value changed since it last received
one (everything the first time) -- what the algorithms' ``download_numel`` counts (FedFrozen's
Q/K once after T0, FedPart's changed groups) -- and uploads the plan's ``upload`` tensors.
Sampling, weights (p_m = n_m / sum n, from the replies' ``num-examples``), minibatches and
evaluation (centralized, on the server's test split) are the native runner's.

Algorithms: those whose client side needs only the global model and the round's plan; the
subclasses pin one each (:data:`STRATEGIES`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import ClassVar

import torch
import yaml
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg

from linattn.configio import load_yaml
from linattn.errors import ConfigError, UserError
from real_data.config import config_to_dict
from real_data.engines import ClientResults
from real_data.federation import TrainedRound
from real_data.flower.client import RESULTS


class LinattnStrategy(FedAvg):
    """Run one linattn config on a Flower grid (see the module docstring).

    Parameters
    ----------
    cfg : Config, optional
        A new run's config (``algorithm.name`` must be the subclass's ``algorithm``).
    out : Path, optional
        The new run's directory (default ``run.out_dir/<name>``).
    resume : Path, optional
        Continue this run directory instead (its config is used).
    timeout : float
        Seconds to wait for a round's replies.
    """

    algorithm: ClassVar[str | None] = None  # the linattn algorithm a subclass runs

    def __init__(self, cfg=None, out: Path | None = None, resume: Path | None = None,
                 timeout: float = 3600.0) -> None:
        super().__init__(fraction_evaluate=0.0)  # evaluation is the server's, as in native runs
        if (cfg is None) == (resume is None):
            raise UserError("give a config for a new run or a run directory to resume")
        name = cfg.algorithm.name if cfg is not None else _saved_algorithm(resume)
        if name != self.algorithm:
            raise ConfigError(f"algorithm.name={name} given to {type(self).__name__}; use "
                              f"strategy_for(cfg), which knows: {', '.join(STRATEGIES)}")
        self.cfg, self.out, self.resume, self.timeout = cfg, out, resume, timeout
        self.grid = None
        self.round_results: ClientResults | None = None
        self.round_weights: torch.Tensor | None = None  # p_m from the replies' num-examples
        self._round = None  # (state, plan, ids, fed) of the round being trained
        self._node_of: dict[int, int] = {}  # client id -> Flower node id
        self._stamp: dict[str, tuple[int, torch.Tensor]] = {}  # name -> (round, tensor)
        self._held: dict[int, dict[str, int]] = {}  # client -> name -> round it holds

    # -- the run --------------------------------------------------------------------------
    def start(self, grid, initial_arrays=None, num_rounds=None, timeout=None, **unused):
        """Run the config's rounds on ``grid``; returns the :class:`~real_data.runs.RunResult`.

        The config sets the initial model and the number of rounds, so ``initial_arrays`` and
        ``num_rounds`` must be left out.
        """
        from real_data.runs import resume_run, start_run

        if initial_arrays is not None or num_rounds is not None:
            raise UserError("the run config sets the initial model and train.rounds; call "
                            "start(grid) without initial_arrays or num_rounds")
        self.grid, self.timeout = grid, timeout or self.timeout
        if self.resume is not None:
            return resume_run(self.resume, trainer=self)
        return start_run(self.cfg, out=self.out, trainer=self)

    def __call__(self, fed, state, rnd, plan, ids, weights):
        """The Federation's trainer hook: one round of messages through the grid."""
        self._round = (state, plan, ids, fed)
        arrays = ArrayRecord({n: t.detach().cpu() for n, t in state.global_params.items()})
        messages = self.configure_train(rnd, arrays, ConfigRecord(), self.grid)
        replies = list(self.grid.send_and_receive(messages, timeout=self.timeout))
        self.aggregate_train(rnd, replies)
        return TrainedRound(self.round_results, self.round_weights)

    # -- Flower's per-round steps ---------------------------------------------------------
    def configure_train(self, server_round, arrays, config, grid):
        """One TRAIN message per sampled client: its stale tensors, the plan, the config."""
        state, plan, ids, fed = self._round
        nodes = self._nodes(grid, fed.partition.num_clients)
        for n, t in state.global_params.items():  # a new tensor object is a new global value
            if n not in self._stamp or self._stamp[n][1] is not t:
                self._stamp[n] = (server_round, t)
        text = yaml.safe_dump(config_to_dict(fed.cfg), sort_keys=False)
        messages = []
        for m in (int(i) for i in ids):
            held = self._held.setdefault(m, {})
            send = [n for n in state.global_params if held.get(n) != self._stamp[n][0]]
            held.update({n: self._stamp[n][0] for n in send})
            conf = ConfigRecord({**config, "server-round": server_round, "client-id": m,
                                 "trainable": list(plan.trainable),
                                 "upload": list(plan.upload), "linattn-config": text,
                                 **self.extra_config(fed)})
            content = RecordDict({"arrays": ArrayRecord({n: arrays[n] for n in send}),
                                  "config": conf})
            messages.append(Message(content, dst_node_id=nodes[m],
                                    message_type=MessageType.TRAIN))
        return messages

    def aggregate_train(self, server_round, replies):
        """The replies as the round's :class:`ClientResults` and weights (``round_*``).

        The global model is not aggregated here: the algorithm's ``server_update`` does that
        in the round loop, merging partial uploads into the previous global model. Returns
        ``(None, p-weighted training metrics)``.
        """
        state, plan, ids, fed = self._round
        failed = [r.error.reason for r in replies if r.has_error()]
        if failed or len(replies) != len(ids):
            raise RuntimeError(f"round {server_round}: {len(replies)} of {len(ids)} clients "
                               f"replied; errors: {failed[:3]}")
        by_client = {int(r.content["metrics"]["client-id"]): r.content for r in replies}
        ordered = [by_client[int(m)] for m in ids]
        params = {n: torch.stack([torch.from_numpy(c["arrays"][n].numpy()) for c in ordered])
                  .to(fed.device, fed.dtype) for n in plan.upload}
        column = {k: torch.tensor([float(c["metrics"][k]) for c in ordered],
                                  dtype=torch.float64, device=fed.device) for k in RESULTS}
        steps = torch.tensor([int(c["metrics"]["steps"]) for c in ordered], dtype=torch.int64)
        self.round_results = ClientResults(params=params, steps=steps, **column)
        n = torch.tensor([float(c["metrics"]["num-examples"]) for c in ordered],
                         dtype=torch.float64, device=fed.device)
        self.round_weights = n / n.sum()
        return None, MetricRecord({k: float(self.round_weights @ column[k]) for k in RESULTS})

    def extra_config(self, fed) -> dict:
        """Additional ConfigRecord entries of a subclass (FedProx's ``proximal-mu``)."""
        return {}

    def _nodes(self, grid, num_clients: int) -> dict[int, int]:
        """Client id -> node id, asked of every node once (QUERY), waiting for all to connect."""
        if len(self._node_of) == num_clients:
            return self._node_of
        deadline = time.time() + self.timeout
        while len(node_ids := list(grid.get_node_ids())) < num_clients:
            if time.time() > deadline:
                raise RuntimeError(f"{len(node_ids)} of {num_clients} Flower nodes connected")
            time.sleep(0.5)
        queries = [Message(RecordDict({}), dst_node_id=n, message_type=MessageType.QUERY)
                   for n in node_ids]
        for reply in grid.send_and_receive(queries, timeout=self.timeout):
            if reply.has_error():
                raise RuntimeError(f"node {reply.metadata.src_node_id}: {reply.error.reason}")
            m = int(reply.content["metrics"]["client-id"])
            self._node_of[m] = reply.metadata.src_node_id
        if sorted(self._node_of) != list(range(num_clients)):
            raise RuntimeError(f"nodes play clients {sorted(self._node_of)}; expected "
                               f"0..{num_clients - 1} once each")
        return self._node_of

    def summary(self) -> None:
        """Flower's start-up log line is not used (the run directory holds the settings)."""


def _saved_algorithm(run_dir: Path) -> str:
    path = Path(run_dir) / "config.yaml"
    if not path.exists():
        raise UserError(f"{run_dir} is not a run directory (no config.yaml)")
    return load_yaml(path)["algorithm"]["name"]


class FedAvgStrategy(LinattnStrategy):
    """FedAvg: every tensor trains, is uploaded and averaged."""

    algorithm = "fedavg"


class FedProxStrategy(LinattnStrategy):
    """FedProx: FedAvg plus the proximal term in the local objective (the algorithm's own
    regularizer); ``proximal-mu`` also goes in the config, as Flower's FedProx sends it."""

    algorithm = "fedprox"

    def extra_config(self, fed) -> dict:
        return {"proximal-mu": float(fed.algorithm.params.mu)}


class FedFrozenStrategy(LinattnStrategy):
    """FedFrozen: after T0 the clients neither train nor upload Q/K; the server keeps the
    round-T0 Q/K in the global model, and a client receives them once."""

    algorithm = "fedfrozen"


class FedPartStrategy(LinattnStrategy):
    """FedPart: each partial round one layer group trains and is uploaded; the other groups
    keep their global values, and a client receives whatever changed since it last synced."""

    algorithm = "fedpart"


STRATEGIES: dict[str, type[LinattnStrategy]] = {
    cls.algorithm: cls for cls in (FedAvgStrategy, FedProxStrategy, FedFrozenStrategy,
                                   FedPartStrategy)
}


def strategy_for(cfg=None, out: Path | None = None, resume: Path | None = None,
                 timeout: float = 3600.0) -> LinattnStrategy:
    """The strategy registered for the config's algorithm; unknown names list the valid ones."""
    name = cfg.algorithm.name if cfg is not None else _saved_algorithm(resume)
    if name not in STRATEGIES:
        raise ConfigError(f"algorithm.name={name} has no Flower strategy; valid: "
                          f"{', '.join(STRATEGIES)}")
    return STRATEGIES[name](cfg, out=out, resume=resume, timeout=timeout)
