"""The Flower ClientApp: one node is one linattn client, trained with linattn's own engine.

A TRAIN message carries the round (``server-round``), the client id, the round's plan
(``trainable`` and ``upload`` parameter names), the run config as YAML, and the parameters the
node lacks or holds stale (:class:`~real_data.flower.strategy.LinattnStrategy` decides). The
node merges them into the model it keeps in ``context.state`` across rounds, trains with
:meth:`real_data.federation.Federation.train_clients` -- the engine, minibatches
(seed, round, client) and local objective of the native runner -- and replies with the
``upload`` tensors and its per-client results. A QUERY message asks which client a node is.

Data. ``data_fn(cfg) -> (dataset, partition)`` and ``client_id_fn(context) -> int``; the
defaults, for the simulation engine, load the config's data set, rebuild its partition from the
partition seed (the same partition as a native run) and take the node's
``node_config["partition-id"]``. A real deployment passes a ``data_fn`` that returns the node's
own data as a :class:`~real_data.data.base.Partition` in which its client id indexes the
node's samples (the other entries may be empty).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import yaml
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from real_data.algorithms import RoundPlan
from real_data.federation import FedState

HELD = "linattn-params"  # context.state key: the model this node holds between rounds
RESULTS = ("data_loss", "objective", "first_loss", "grad_norm_first", "grad_norm_last")
_FEDERATIONS: dict[str, object] = {}  # config YAML -> Federation (this process's last run)


def simulation_data(cfg):
    """The config's data set and its partition as a native run trains on them (under
    ``partition.shift`` the shifted data, rebuilt from the config as the server's run does)."""
    from real_data.runs import load_data, make_partition_for, shifted

    dataset = load_data(cfg)
    return shifted(cfg, dataset, make_partition_for(cfg, dataset))


def partition_id(context: Context) -> int:
    """The client a node plays: ``node_config["partition-id"]`` (set by the simulation)."""
    return int(context.node_config["partition-id"])


def make_client_app(data_fn: Callable | None = None,
                    client_id_fn: Callable[[Context], int] = partition_id) -> ClientApp:
    """A ClientApp that trains linattn clients; the arguments as in the module docstring."""
    data_fn = data_fn or simulation_data
    app = ClientApp()

    @app.query()
    def query(msg: Message, context: Context) -> Message:
        return Message(RecordDict({"metrics": MetricRecord({"client-id": client_id_fn(context)})}),
                       reply_to=msg)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        conf = msg.content["config"]
        fed, client_id = _federation(str(conf["linattn-config"]), data_fn), client_id_fn(context)
        if int(conf["client-id"]) != client_id:
            raise RuntimeError(f"message for client {conf['client-id']} reached client "
                               f"{client_id}")
        # 1. the model this node holds, updated with what the server sent
        held = context.state.array_records.get(HELD, ArrayRecord())
        for name, array in msg.content["arrays"].items():
            held[name] = array
        context.state[HELD] = held
        missing = [n for n, _ in fed.model.named_parameters() if n not in held]
        if missing:
            raise RuntimeError(f"client {client_id} holds no value for {missing[:5]}; the "
                               "server must send the whole model first")
        params = {n: torch.from_numpy(held[n].numpy()).to(fed.device, fed.dtype)
                  for n, _ in fed.model.named_parameters()}
        # 2. local training exactly as in the native runner
        rnd = int(conf["server-round"])
        plan = RoundPlan(tuple(conf["trainable"]), tuple(conf["upload"]), ())
        results = fed.train_clients(FedState(rnd - 1, params), rnd, plan,
                                    np.array([client_id]))
        # 3. reply: the uploaded tensors and this client's results
        arrays = ArrayRecord({n: results.params[n][0].detach().cpu() for n in plan.upload})
        metrics = {k: float(getattr(results, k)[0]) for k in RESULTS}
        metrics.update({"num-examples": int(fed.partition.sizes[client_id]),
                        "client-id": client_id, "steps": int(results.steps[0])})
        return Message(RecordDict({"arrays": arrays, "metrics": MetricRecord(metrics)}),
                       reply_to=msg)

    return app


def _federation(text: str, data_fn: Callable):
    """The Federation of a run config, built once per process (shared by its nodes)."""
    from real_data.config import config_from_dict
    from real_data.federation import Federation

    if text not in _FEDERATIONS:
        cfg = config_from_dict(yaml.safe_load(text))
        _FEDERATIONS.clear()  # one run at a time: free the previous run's data
        _FEDERATIONS[text] = Federation(cfg, *data_fn(cfg))
    return _FEDERATIONS[text]
