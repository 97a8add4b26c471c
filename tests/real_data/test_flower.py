"""The Flower adapter: linattn's algorithms on Flower, the same results as the native runner.

An in-process grid (the ClientApp called directly, no Ray) holds metrics, traffic and resume to
the native runner; the Ray simulation engine with 4 clients runs FedAvg and FedFrozen to the
native accuracy. Skipped when the ``flower`` extra (flwr[simulation]) is not installed.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
import torch
from conftest import tiny_config

flwr = pytest.importorskip("flwr")

from flwr.app import Context, RecordDict  # noqa: E402

from real_data.flower import make_client_app, simulate, strategy_for  # noqa: E402
from real_data.runs import start_run  # noqa: E402

SGD = ["train.optimizer=sgd", "train.lr=0.05", "train.precision=fp64"]


class InProcessGrid:
    """Flower's Grid for ClientApp nodes called in this process; counts what travels."""

    def __init__(self, num_nodes: int, fail_in_round: int | None = None) -> None:
        from flwr.supercore.task_identity import TaskIdentity

        TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 1  # a SuperLink
        self.app = make_client_app()
        self.contexts = {100 + i: Context(run_id=1, node_id=100 + i,
                                          node_config={"partition-id": i}, state=RecordDict(),
                                          run_config={}) for i in range(num_nodes)}
        self.fail_in_round = fail_in_round
        self.down: dict[int, int] = {}  # round -> numbers sent to clients
        self.up: dict[int, int] = {}  # round -> numbers received from clients
        self.sent: dict[tuple[int, int], set[str]] = {}  # (round, client) -> tensor names

    def get_node_ids(self):
        return list(self.contexts)

    def send_and_receive(self, messages, timeout=None):
        replies = []
        for msg in messages:
            if msg.metadata.message_type == "train":
                conf = msg.content["config"]
                rnd, arrays = int(conf["server-round"]), msg.content["arrays"]
                if rnd == self.fail_in_round:
                    raise ConnectionError(f"grid lost in round {rnd}")
                self.sent[rnd, int(conf["client-id"])] = set(arrays)
                self.down[rnd] = self.down.get(rnd, 0) + sum(a.numpy().size
                                                             for a in arrays.values())
            reply = self.app(msg, self.contexts[msg.metadata.dst_node_id])
            if msg.metadata.message_type == "train":
                self.up[rnd] = self.up.get(rnd, 0) + sum(
                    a.numpy().size for a in reply.content["arrays"].values())
            replies.append(reply)
        return replies


def _metrics(run_dir: Path) -> dict:
    return {(int(r["round"]), r["client"], r["metric"]): float(r["value"])
            for r in csv.DictReader(open(run_dir / "metrics.csv"))}


def _assert_close(expected: dict, actual: dict, rtol: float = 1e-6) -> None:
    assert expected.keys() == actual.keys()
    errs = [abs(v - actual[k]) / max(abs(v), 1e-12) for k, v in expected.items()]
    assert not any(math.isnan(e) for e in errs), "NaN in compared metrics"
    worst = max(errs)
    assert worst <= rtol, worst


@pytest.mark.parametrize("overrides", [
    ["algorithm.warmup_rounds=2"],  # FedFrozen: Q/K neither trained nor sent after T0
    ["algorithm.name=fedpart", "algorithm.warmup_rounds=1", "algorithm.rounds_per_group=1",
     "algorithm.full_rounds_between=0"],
    ["algorithm.name=fedprox", "algorithm.mu=0.1", "train.clients_per_round=3"],
])
def test_flower_rounds_equal_native_and_send_what_the_algorithm_counts(tmp_path, overrides):
    cfg = tiny_config("train.rounds=4", "partition.num_clients=4", *SGD, *overrides)
    native = start_run(cfg, out=tmp_path / "native")
    grid = InProcessGrid(4)
    flower = strategy_for(cfg, out=tmp_path / "flower").start(grid)
    assert flower.status == "completed"
    expected, got = _metrics(native.run_dir), _metrics(flower.run_dir)
    _assert_close(expected, got)
    for rnd in range(1, 5):  # the traffic the algorithm reports is the traffic that happened
        assert 4 * grid.down[rnd] == got[rnd, "global", "bytes_down"]
        assert 4 * grid.up[rnd] == got[rnd, "global", "bytes_up"]
    final_native = torch.load(native.run_dir / "checkpoints" / "last.pt", weights_only=False)
    final_flower = torch.load(flower.run_dir / "checkpoints" / "last.pt", weights_only=False)
    for name, value in final_native["global_params"].items():  # nothing dropped
        torch.testing.assert_close(final_flower["global_params"][name], value, rtol=1e-9,
                                   atol=1e-12)
    if cfg.algorithm.name == "fedfrozen":  # after T0 = 2: Q/K sent once, then never
        names = set(final_native["global_params"])
        qk = names - grid.sent[4, 0]
        assert qk and all(grid.sent[4, m] == names - qk for m in range(4))
        assert all(grid.sent[3, m] == names for m in range(4))
        assert got[3, "global", "qk_change"] == got[4, "global", "qk_change"] == 0.0


def test_flower_run_resumes_to_the_uninterrupted_result(tmp_path):
    cfg = tiny_config("train.rounds=4", "partition.num_clients=4", *SGD,
                      "algorithm.warmup_rounds=2")
    out = tmp_path / "flower"
    with pytest.raises(ConnectionError):
        strategy_for(cfg, out=out).start(InProcessGrid(4, fail_in_round=3))
    assert torch.load(out / "checkpoints" / "last.pt", weights_only=False)["round"] == 2
    grid = InProcessGrid(4)  # fresh nodes: they hold nothing, so they get the whole model
    resumed = strategy_for(resume=out).start(grid)
    assert resumed.rounds_completed == 4
    assert grid.down[3] == sum(p.numel() for p in torch.load(
        out / "checkpoints" / "last.pt", weights_only=False)["global_params"].values()) * 4
    native = start_run(cfg, out=tmp_path / "native")
    _assert_close(_metrics(native.run_dir), _metrics(out))


def test_unsupported_algorithm_lists_the_strategies():
    from linattn.errors import ConfigError

    with pytest.raises(ConfigError, match="fedavg, fedprox, fedfrozen, fedpart"):
        strategy_for(tiny_config("algorithm.name=scaffold"))


def test_ray_simulation_reaches_native_accuracy(tmp_path, monkeypatch):
    pytest.importorskip("ray")
    monkeypatch.setenv("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")  # Ray's FutureWarning
    over = ["partition.num_clients=4", "train.rounds=6", "run.progress=false", "run.plot=false"]
    configs = {"fedavg": tiny_config(*over, "algorithm.name=fedavg"),
               "fedfrozen": tiny_config(*over, "algorithm.warmup_rounds=3")}
    backend = {"init_args": {"num_cpus": 2, "include_dashboard": False},
               "client_resources": {"num_cpus": 1, "num_gpus": 0.0}}
    results = simulate([(c, tmp_path / f"flower_{k}") for k, c in configs.items()],
                       backend_config=backend)
    for (name, cfg), flower in zip(configs.items(), results):
        native = start_run(cfg, out=tmp_path / f"native_{name}")
        acc_native = native.summary["final"]["test_acc"]
        acc_flower = flower.summary["final"]["test_acc"]
        assert abs(acc_flower - acc_native) <= 0.01, (name, acc_native, acc_flower)
