"""Scale-out with torch.distributed: sharded rounds equal the one-process run (fp64, 1e-6).

Two checks of :mod:`real_data.distributed`: ranks simulated by threads (every algorithm, both
collectives, in-process and fast), and real gloo processes under torchrun through
``linattn run --distributed``, killed and resumed, plus the 2-GPU benchmark script on the CPU.
"""

from __future__ import annotations

import csv
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import REPO, TINY, digits_dataset, random_partition, tiny_config, train_rounds
from pause_run import command as pause_command
from pause_run import wait_paused

from linattn.cli import main as linattn_main
from real_data import distributed
from real_data.distributed import ShardTrainer
from real_data.federation import Federation
from real_data.runs import start_run

RTOL = 1e-6
# SGD: Adam divides by sqrt(v) + eps, so a gradient entry near zero turns an ulp of
# difference (the sums are taken in another order) into a visible one within a few rounds
SGD = ["train.optimizer=sgd", "train.lr=0.05", "train.precision=fp64"]


def assert_records_close(expected, actual, rtol=RTOL):
    """Same (round, client, metric) rows; values within ``rtol`` relative (1e-12 absolute)."""
    left = {(r, c, k): v for r, c, k, v in expected}
    right = {(r, c, k): v for r, c, k, v in actual}
    assert left.keys() == right.keys()
    errs = [abs(v - right[key]) / max(abs(v), abs(right[key]), 1e-12)
            for key, v in left.items()]
    assert not any(math.isnan(e) for e in errs), "NaN in compared metrics"
    worst = max(errs)
    assert worst <= rtol, worst
    return worst


class ThreadRanks:
    """``torch.distributed``'s all_reduce / all_gather for ranks that are threads of this
    process (``threading.current_thread().rank``)."""

    def __init__(self, world_size: int) -> None:
        self.barrier = threading.Barrier(world_size, timeout=120)
        self.slots: list = [None] * world_size

    def _exchange(self, tensor):
        self.slots[threading.current_thread().rank] = tensor.clone()
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()
        return out

    def all_reduce(self, buf):
        buf.copy_(sum(self._exchange(buf)))

    def all_gather(self, parts, local):
        for part, got in zip(parts, self._exchange(local)):
            part.copy_(got)


def sharded_records(cfg, dataset, partition, rounds, ranks: ThreadRanks, world_size=2):
    """Every rank's records of ``rounds`` rounds, ranks run as threads."""
    out, errors, feds = [None] * world_size, [], []
    for rank in range(world_size):  # built one after another: model init draws from torch's RNG
        trainer = ShardTrainer(rank, world_size, torch.device("cpu"))
        trainer.started = True  # every rank builds the same start state itself
        feds.append(Federation(cfg, dataset, partition, trainer=trainer))

    def rank_main(rank):
        try:
            out[rank] = train_rounds(feds[rank], rounds)[1]
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)
            ranks.barrier.abort()  # release the other rank

    threads = []
    for rank in range(world_size):
        t = threading.Thread(target=rank_main, args=(rank,))
        t.rank = rank
        threads.append(t)
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


@pytest.mark.parametrize("overrides, path", [
    (["algorithm.name=fedavg", "train.clients_per_round=5"], "reduce"),
    (["algorithm.name=fedprox", "algorithm.mu=0.1"], "reduce"),
    (["algorithm.warmup_rounds=2"], "reduce"),  # FedFrozen: warm-up, then Q/K frozen
    (["algorithm.name=fedpart", "algorithm.warmup_rounds=1", "algorithm.rounds_per_group=1",
      "algorithm.full_rounds_between=0"], "reduce"),
    (["algorithm.name=scaffold"], "gather"),
])
def test_sharded_rounds_equal_single_process(monkeypatch, overrides, path):
    cfg = tiny_config("train.rounds=4", "partition.num_clients=6", "eval.every=2", *SGD,
                      *overrides)
    dataset = digits_dataset(n_train=600, dtype=torch.float64)
    partition = random_partition(dataset, 6, seed=3, alpha=0.5)
    single = train_rounds(Federation(cfg, dataset, partition), 4)[1]
    fake = ThreadRanks(2)
    monkeypatch.setattr(distributed, "dist", SimpleNamespace(
        all_reduce=fake.all_reduce, all_gather=fake.all_gather))
    assert (distributed.REDUCIBLE.get(cfg.algorithm.name, lambda s: False)(
        SimpleNamespace(warmup_rounds=2)) is (path == "reduce"))
    rank0, rank1 = sharded_records(cfg, dataset, partition, 4, fake)
    assert rank0 == rank1  # every rank holds the same reduced round
    assert_records_close(single, rank0)


def test_distributed_needs_torchrun(capsys, monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    assert linattn_main(["run", "--distributed", "--config", "digits_vit"]) == 2
    assert "torchrun --nproc_per_node" in capsys.readouterr().err


def _torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
            "2", *args]


def _kill_torchrun(proc: subprocess.Popen) -> None:
    """SIGKILL torchrun's workers (each in its own process group) and then torchrun itself."""
    workers = [int(pid) for f in Path(f"/proc/{proc.pid}/task").glob("*/children")
               for pid in f.read_text().split()]
    for pid in workers:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.kill()
    proc.wait(timeout=30)
    for pid in workers:  # reaped by torchrun or gone with it; wait until they are
        deadline = time.time() + 30
        while Path(f"/proc/{pid}").exists() and time.time() < deadline:
            if "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]:
                break  # a zombie: dead, awaiting its (killed) parent's reaper
            time.sleep(0.1)


def _run_torchrun(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run a 2-process torchrun job to the end; on a timeout kill it whole and fail."""
    proc = subprocess.Popen(_torchrun(*args), cwd=REPO, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_torchrun(proc)
        pytest.fail(f"torchrun {' '.join(args[:3])} ... ran past {timeout} s")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _metrics(path: Path) -> list:
    return [(int(r["round"]), r["client"], r["metric"], float(r["value"]))
            for r in csv.DictReader(open(path))]


def test_gloo_run_killed_and_resumed_equals_single_process(tmp_path):
    over = [*TINY, "train.rounds=5", "partition.num_clients=4", "algorithm.warmup_rounds=2",
            *SGD]
    killed, marker = tmp_path / "killed", tmp_path / "paused"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    script = pause_command("--round", "3", "--marker", str(marker), "--out", str(killed),
                           "--distributed", *over)[1:]  # torchrun starts the interpreter
    proc = subprocess.Popen(_torchrun(*script), cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_paused(proc, marker, "the distributed run never reached round 3", poll=0.1)
    finally:
        _kill_torchrun(proc)
    assert torch.load(killed / "checkpoints" / "last.pt", weights_only=False)["round"] == 2
    res = _run_torchrun("-m", "linattn", "run", "--distributed", "--resume", str(killed))
    assert res.returncode == 0, res.stderr[-3000:]
    single = start_run(tiny_config(*over[len(TINY):]), out=tmp_path / "single")
    assert_records_close(_metrics(single.run_dir / "metrics.csv"), _metrics(killed /
                                                                            "metrics.csv"))
    summary = json.loads((killed / "summary.json").read_text())
    assert summary["rounds_completed"] == 5
    assert summary["distributed"] == {"world_size": 2, "backend": "gloo"}


def test_benchmark_script_on_cpu(tmp_path):
    out = tmp_path / "bench.json"
    res = _run_torchrun(str(REPO / "benchmarks" / "bench_distributed.py"), "--out",
                        str(out), "--tiny", "--clients", "4,8", "--rounds", "2", "--warmup",
                        "1", "--eq-clients", "4", "--eq-rounds", "2", "--samples-per-client",
                        "16")
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["equality"]["max_relative_error"] <= RTOL
    assert [c["clients_per_round"] for c in report["cases"]] == [4, 8]
    assert all(c["sharded"]["rounds_per_s"] > 0 for c in report["cases"])
    assert "speedup" in res.stdout
