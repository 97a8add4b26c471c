"""Stacked groups against runs trained alone, and a killed group resumed.

A group of runs that differ in seed, lr, lr schedule, algorithm (FedAvg, FedFrozen's two
variants with a T0 branch, FedPart, SCAFFOLD and FedProx, whose local terms go into the shared
engine call as per-client data) must write, for every run, the metrics of that run trained alone:
every (round, client, metric, stage) row present in both (validation metrics of the runs
that share a partition evaluated in one stacked pass), values within 1e-6 (relative, with
an absolute floor of 1e-9) in float64. A group killed between a round's rows and its checkpoint
and resumed must end with every run's metrics.csv byte-identical to the uninterrupted group's.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch
from conftest import (
    KEY_BIAS_METRICS,
    REPO,
    TINY,
    assert_group_equals_alone,
    assert_rows_agree,
    metric_rows,
    tiny_config,
)
from pause_run import wait_paused

from real_data.runs import load_data, make_partition_for, prepare_start, start_run
from real_data.stacked_runs import Branch, RunRequest, run_group
from real_data.stacking import stack_jobs, stackable

BASE = ["train.rounds=4", "partition.num_clients=4", "train.precision=fp64",
        "train.clients_per_round=3"]
RUNS = {  # name -> overrides
    "fedavg": ["algorithm.name=fedavg", "partition.validation_fraction=0.2"],
    "fedavg_lr": ["algorithm.name=fedavg", "train.lr=0.03", "seed=1",
                  "train.lr_schedule={kind: step, milestones: [0.5], factor: 0.5}"],
    "frozen_v_T3": ["algorithm.name=fedfrozen", "algorithm.train=v",
                    "algorithm.warmup_rounds=3", "partition.validation_fraction=0.2"],
    "fedpart": ["algorithm.name=fedpart", "seed=2", "algorithm.warmup_rounds=1",
                "algorithm.rounds_per_group=1", "algorithm.full_rounds_between=0"],
    "scaffold": ["algorithm.name=scaffold"],
    "fedprox": ["algorithm.name=fedprox", "algorithm.mu=0.1", "seed=3"],
}
BRANCH = ("frozen_v_T1", "frozen_v_T3", 1)  # name, parent, T0


def _cfg(name: str):
    if name == BRANCH[0]:
        return tiny_config(*BASE, *RUNS[BRANCH[1]], f"algorithm.warmup_rounds={BRANCH[2]}")
    return tiny_config(*BASE, *RUNS[name])


def _requests(root, resume: bool = False) -> list[RunRequest]:
    out = []
    for name in RUNS:
        run_dir = root / name
        branches = ()
        snaps = ()
        if name == BRANCH[1]:
            branches = (Branch(BRANCH[2], _cfg(BRANCH[0]), root / BRANCH[0]),)
            snaps = (BRANCH[2],)
        out.append(RunRequest(run_dir, _cfg(name), resume and run_dir.exists(), snaps,
                              branches))
    return out


def test_stacked_group_equals_runs_trained_alone(tmp_path, monkeypatch):
    from real_data.engines import fast

    calls = []
    train_fast = fast.train_fast
    monkeypatch.setattr(fast, "train_fast",
                        lambda job, **kw: calls.append(len(job.client_ids)) or
                        train_fast(job, **kw))
    alone = tmp_path / "alone"
    for name in RUNS:
        snaps = (BRANCH[2],) if name == BRANCH[1] else ()
        start_run(_cfg(name), out=alone / name, snapshot_rounds=snaps)
    start_run(_cfg(BRANCH[0]), out=alone / BRANCH[0],
              branch=alone / BRANCH[1] / "checkpoints" / f"round_{BRANCH[2]}.pt")
    from real_data import metrics

    evals = []
    evaluate_stacked = metrics.evaluate_stacked
    monkeypatch.setattr(metrics, "evaluate_stacked",
                        lambda model, params, x, *a, **kw: evals.append(
                            (len(next(iter(params.values()))), len(x)))
                        or evaluate_stacked(model, params, x, *a, **kw))
    dataset = load_data(_cfg("fedavg"))
    calls.clear()
    results = run_group(_requests(tmp_path / "group"), dataset=dataset, log=lambda s: None)
    # the validation split of the runs on one partition (fedavg, frozen_v_T3 and its branch)
    # is evaluated in one stacked pass per round, like the shared test set
    n_val = len(make_partition_for(_cfg("fedavg"), dataset).val_pooled)
    assert (2, n_val) in evals and (3, n_val) in evals, evals
    # rounds 1: 6 runs of 3 clients in one call (SCAFFOLD's c - c_m as per-client gradient
    # offsets, FedProx's mu as a per-client proximal weight); 2-4: the branch joins (7 runs)
    assert calls == [18, 21, 21, 21], calls
    assert sorted(r.run_dir.name for _, r in results) == sorted([*RUNS, BRANCH[0]])
    assert all(r.status == "completed" for _, r in results)
    for name in [*RUNS, BRANCH[0]]:
        assert_rows_agree(alone / name / "metrics.csv", tmp_path / "group" / name / "metrics.csv",
                          KEY_BIAS_METRICS if name == "fedprox" else ())
    _same_but_key_bias(alone / "fedprox", tmp_path / "group" / "fedprox")
    stages = {k[3] for k in metric_rows(tmp_path / "group" / BRANCH[0] / "metrics.csv")}
    assert stages == {"warmup", "frozen"}
    lrs = {k[0]: v for k, v in metric_rows(tmp_path / "group" / "fedavg_lr" / "metrics.csv").items()
           if k[2] == "lr"}
    assert lrs == {"1": 0.03, "2": 0.03, "3": 0.015, "4": 0.015}


def test_live_padding_trains_the_same_runs_on_fewer_rows(tmp_path, monkeypatch):
    """``pad="live"`` (or ``LINATTN_STACK_PAD=live``): the engine calls carry only the
    round's clients, where ``"group"`` pads round 1 to the branch that joins at round 2; every
    run's metrics.csv is byte-identical either way (padding rows are discarded)."""
    from linattn.errors import UserError
    from real_data.engines import fast

    calls = []
    train_fast = fast.train_fast
    monkeypatch.setattr(fast, "train_fast", lambda job, **kw: calls.append(
        (len(job.client_ids), job.pad_clients)) or train_fast(job, **kw))
    dataset = load_data(_cfg("fedavg"))
    run_group(_requests(tmp_path / "group"), dataset=dataset, log=lambda s: None, pad="group")
    assert calls == [(18, 21), (21, 21), (21, 21), (21, 21)], calls
    calls.clear()
    monkeypatch.setenv("LINATTN_STACK_PAD", "live")
    lines = []
    run_group(_requests(tmp_path / "live"), dataset=dataset, log=lines.append)
    assert calls == [(18, None), (21, None), (21, None), (21, None)], calls
    assert any("calls padded to the round" in line for line in lines), lines
    for name in [*RUNS, BRANCH[0]]:
        assert ((tmp_path / "live" / name / "metrics.csv").read_bytes()
                == (tmp_path / "group" / name / "metrics.csv").read_bytes()), name
    monkeypatch.setenv("LINATTN_STACK_PAD", "tight")
    with pytest.raises(UserError, match="LINATTN_STACK_PAD='tight': one of group, live"):
        run_group(_requests(tmp_path / "bad"), dataset=dataset, log=lambda s: None)
    assert not (tmp_path / "bad").exists()  # nothing written
    from real_data.sweep import run_sweep

    with pytest.raises(UserError, match="LINATTN_STACK_PAD='tight'"):
        run_sweep(_cfg("fedavg"), tmp_path / "sweep", algorithms=["fedavg"], seeds=[0])
    assert not (tmp_path / "sweep").exists()


@pytest.mark.parametrize("models", [1, 3, 5])
def test_compiled_evaluation_passes_equal_one_pass(tmp_path, monkeypatch, models):
    """The compiled evaluation's passes (models in fixed-size passes, the last padded; samples
    in equal minibatches, the last padded) give what one eager pass gives, in float64; the
    forward is the eager one here, so the test checks the padding and the slicing."""
    from real_data import metrics
    from real_data.engines.stacked import stacked_forward

    cfg = _cfg("fedavg")
    dataset = load_data(cfg)
    fed = prepare_start(cfg, out=tmp_path / "run", dataset=dataset).fed
    g = torch.Generator().manual_seed(models)
    params = {n: p.detach().unsqueeze(0).repeat(models, *[1] * p.dim())
              + 0.05 * torch.randn((models, *p.shape), generator=g, dtype=p.dtype)
              for n, p in fed.model.named_parameters()}
    shapes = []

    def eager(model, names):
        def forward(ps, xb, r):
            shapes.append((len(next(iter(ps.values()))), len(xb), r))
            return stacked_forward(model, ps, names, xb.unsqueeze(0).expand(r, *xb.shape))
        return forward

    monkeypatch.setattr(metrics, "_compiled_eval", eager)
    monkeypatch.setattr(metrics, "EVAL_MODELS_PER_PASS", 2)
    x, y = fed.x_test[:23], fed.y_test[:23]
    ref = metrics.evaluate_stacked(fed.model, params, x, y, 10)
    got = metrics.evaluate_stacked(fed.model, params, x, y, 10, compiled=True)
    assert got[0].shape == (models, 23)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got[1], ref[1], rtol=0, atol=0)
    assert set(shapes) == {(2, 10, 2)}  # one shape: padded models and samples
    assert len(shapes) == 3 * -(-models // 2)


def test_group_compile_choice_is_checked():
    with pytest.raises(ValueError, match="compile='sometimes'"):
        run_group([], compile="sometimes")


def _same_but_key_bias(alone, group):
    """Every final global parameter but the attention key biases within 1e-9."""
    a = torch.load(alone / "checkpoints" / "last.pt", weights_only=False)["global_params"]
    g = torch.load(group / "checkpoints" / "last.pt", weights_only=False)["global_params"]
    for n, t in a.items():
        if not n.endswith("attn.k.bias"):
            torch.testing.assert_close(g[n], t, rtol=0, atol=1e-9, msg=n)


def test_stacked_adam_scaffold_and_fedprox_equal_runs_alone(tmp_path):
    """Under Adam SCAFFOLD's correction is applied after each step (a per-client correction
    in the stacked call); FedProx beside it; each run's metrics within 1e-6 of it alone."""
    cfgs = {name: tiny_config(*BASE, "train.optimizer=adam", "train.lr=0.01", *over)
            for name, over in [("scaffold", ["algorithm.name=scaffold"]),
                               ("fedprox", ["algorithm.name=fedprox", "algorithm.mu=0.5",
                                            "seed=1"]),
                               ("fedavg", ["algorithm.name=fedavg", "seed=2"])]}
    assert_group_equals_alone(tmp_path, cfgs, {"fedprox": KEY_BIAS_METRICS})
    _same_but_key_bias(tmp_path / "alone" / "fedprox", tmp_path / "group" / "fedprox")


def test_stack_jobs_masks_and_rates():
    """The stacked job carries each run's lr and masks the parameters a run keeps frozen."""
    from real_data.federation import Federation

    dataset = load_data(_cfg("fedavg"))
    feds, jobs = [], []
    for name in ("fedavg", "frozen_v_T3", "fedavg_lr"):
        cfg = _cfg(name)
        from real_data.runs import make_partition_for, resolve

        fed = Federation(resolve(cfg, dataset), dataset, make_partition_for(cfg, dataset))
        state = fed.initial_state()
        rnd = 4 if name == "frozen_v_T3" else 1  # the frozen stage
        jobs.append(fed.begin_round(state, rnd).job)
        feds.append(fed)
    assert all(stackable(j) for j in jobs) and jobs[0].x is jobs[1].x
    job = stack_jobs(jobs, pad_clients=12)
    assert job.lr.tolist() == [0.01] * 3 + [0.01] * 3 + [0.03] * 3
    qk = [n for n in job.trainable if n.endswith(("attn.q.weight", "attn.k.weight"))]
    assert qk and all(job.train_mask[n].tolist() == [1] * 3 + [0] * 3 + [1] * 3 for n in qk)
    assert job.overrides[qk[0]].shape[0] == 9 and job.pad_clients == 12
    assert torch.equal(job.overrides[qk[0]][3], jobs[1].global_params[qk[0]])
    # no run brings a local term: none, and the first run's regularizer is not read either
    assert job.stacked_terms and not job.grad_offset and job.prox_mu is None
    assert job.correction is None


def test_memory_probe_of_a_padded_call_with_fewer_clients_than_it_probes():
    """A stacked group pads its engine calls to its largest membership: when its last runs (2
    clients here, padded to 12) make the first call of a new setup, the memory probe steps 8
    clients. It repeats the job's last client instead of indexing past its minibatch plans (on
    CUDA a device-side assert that poisons the process and fails every later run of it)."""
    from real_data.engines import fast
    from real_data.engines.fast_setup import make_setup
    from real_data.federation import Federation
    from real_data.runs import resolve

    cfg = tiny_config(*BASE[:-1], "train.clients_per_round=2", *RUNS["fedavg"])
    dataset = load_data(cfg)
    fed = Federation(resolve(cfg, dataset), dataset, make_partition_for(cfg, dataset))
    job = stack_jobs([fed.begin_round(fed.initial_state(), 1).job], pad_clients=12)
    assert len(job.client_ids) == 2 < fast.PROBE_CLIENTS
    fast.probe_step(job, make_setup(job, graphs=False, compile=False), fast.PROBE_CLIENTS)
    # the padded call itself: its two clients' results, the padding dropped
    res = fast.train_fast(job)
    assert res.params[job.trainable[0]].shape[0] == 2
    assert torch.isfinite(res.data_loss).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_padded_call_of_a_new_setup_on_the_gpu():
    """On CUDA the probe runs (the CPU has none): a 2-client call padded to 12, of a setup no
    earlier call had, trains and gives its two clients' results."""
    from real_data.engines import fast
    from real_data.federation import Federation
    from real_data.runs import resolve

    cfg = tiny_config(*BASE[:-1], "train.clients_per_round=2", "train.device=cuda",
                      "train.precision=fp32", *RUNS["fedavg"])
    dataset = load_data(cfg)
    fed = Federation(resolve(cfg, dataset), dataset, make_partition_for(cfg, dataset))
    job = stack_jobs([fed.begin_round(fed.initial_state(), 1).job], pad_clients=12)
    fast.clear_cache()
    res = fast.train_fast(job)
    torch.cuda.synchronize()
    assert res.params[job.trainable[0]].shape[0] == 2
    assert torch.isfinite(res.data_loss).all()


def test_stacking_takes_local_terms_of_their_own_class_only():
    """FedProx (also at mu = 0) and SCAFFOLD stack; a subclass that changes the regularizer
    does not inherit its parent's terms."""
    from real_data.algorithms.fedprox import FedProx
    from real_data.federation import Federation
    from real_data.runs import make_partition_for, resolve

    dataset = load_data(_cfg("fedavg"))
    cfg = tiny_config(*BASE, "algorithm.name=fedprox", "algorithm.mu=0")
    fed = Federation(resolve(cfg, dataset), dataset, make_partition_for(cfg, dataset))
    job = fed.begin_round(fed.initial_state(), 1).job
    assert stackable(job)
    assert stack_jobs([job, job]).stacked_terms

    class Changed(FedProx):
        def regularizer(self, params, anchor, client_state, server_state):
            return 2 * super().regularizer(params, anchor, client_state, server_state)

    fed.algorithm.__class__ = Changed
    assert not stackable(fed.begin_round(fed.initial_state(), 1).job)


_SCRIPT = r"""
import sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[3])
from test_stacking import _requests
from real_data.runs import load_data
from real_data.stacked_runs import run_group
from test_stacking import _cfg
root, kill_round = Path(sys.argv[1]), int(sys.argv[2])
marker = root.parent / "paused"
def hook(rnd, run_dir):
    if kill_round and rnd == kill_round and run_dir.name == "frozen_v_T3":
        marker.write_text(str(rnd))
        while True:
            time.sleep(1)
run_group(_requests(root, resume=True), dataset=load_data(_cfg("fedavg")), log=print,
          on_round_end=hook)
"""


def _group_process(root, kill_round: int) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-c", _SCRIPT, str(root), str(kill_round),
                             str(REPO / "tests" / "real_data")], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_killed_group_resumes_to_identical_metrics(tmp_path):
    whole = _group_process(tmp_path / "whole" / "runs", 0)
    assert whole.wait(timeout=600) == 0, whole.stderr.read()[-3000:]
    root = tmp_path / "killed" / "runs"
    proc = _group_process(root, 3)
    marker = root.parent / "paused"
    wait_paused(proc, marker, "the group never reached round 3", timeout=600, poll=0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (root / "frozen_v_T3" / "summary.json").exists()
    again = _group_process(root, 0)
    assert again.wait(timeout=600) == 0, again.stderr.read()[-3000:]
    for name in [*RUNS, BRANCH[0]]:
        assert (root / name / "metrics.csv").read_bytes() == \
            (tmp_path / "whole" / "runs" / name / "metrics.csv").read_bytes(), name


@pytest.mark.parametrize("bad", ["train.lr_schedule=weekly",
                                 "train.lr_schedule={kind: step, milestones: [0.8, 0.4]}",
                                 "train.lr_schedule={kind: step, milestones: [9]}",
                                 "train.lr_schedule={kind: step, milestones: [0.5], "
                                 "factor: 1.5}",
                                 "train.lr_schedule={kind: cosine, floor: 0.5}"])
def test_bad_schedules_name_the_key(bad):
    from linattn.errors import ConfigError

    with pytest.raises(ConfigError, match="train.lr_schedule"):
        tiny_config(*TINY, *BASE, bad)


def test_stacked_sweep_equals_the_sweep_run_by_run(tmp_path):
    """``linattn sweep`` stacks by default; in float64 its runs equal the unstacked sweep's."""
    from real_data.sweep import run_sweep

    cfg = tiny_config(*BASE, "algorithm.warmup_rounds=1")
    kw = dict(algorithms=["fedavg", "fedfrozen"], warmup_rounds=[1, 3], seeds=[0, 1])
    alone = run_sweep(cfg, tmp_path / "alone", stack=False, **kw)
    stacked = run_sweep(cfg, tmp_path / "stacked", **kw)
    assert [r.run_dir.name for r in stacked] == [r.run_dir.name for r in alone]
    assert len(stacked) == 6 and all(r.status == "completed" for r in stacked)
    for a, s in zip(alone, stacked):
        ra, rs = metric_rows(a.run_dir / "metrics.csv"), metric_rows(s.run_dir / "metrics.csv")
        assert ra.keys() == rs.keys()
        assert all(abs(ra[k] - rs[k]) <= 1e-6 * abs(ra[k]) + 1e-9 for k in ra), a.run_dir.name
    def index(folder):  # run, algorithm, seed, alpha, T0, status of each row
        lines = (tmp_path / folder / "sweep.csv").read_text().splitlines()[1:]
        return [line.split(",")[:6] for line in lines]

    assert len(index("stacked")) == 6 and index("stacked") == index("alone")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_stacked_round_on_the_gpu_agrees_with_runs_alone(tmp_path):
    """One round in fp32 on CUDA (CUDA graphs; alone, FlatSGD's Triton update reads each
    client's lr; stacked, the masked update with FedProx's and SCAFFOLD's terms as per-client
    data): each run's stacked update equals its run alone
    within 1e-4 of its norm plus 1e-6, its loss within 1e-5. The key bias is left out: under
    softmax its gradient is exactly zero (each query's score shift is the same for every key),
    so its update is the attention kernel's TF32 rounding noise in either path. (bf16
    agreement over whole runs: benchmarks/bench_stacking.py.)"""
    from real_data.federation import Federation
    from real_data.runs import make_partition_for, resolve
    from real_data.stacking import train_jobs

    gpu = ["train.precision=fp32", "train.device=cuda", "train.rounds=4",
           "partition.num_clients=6", "train.clients_per_round=4"]
    names = {"fedavg": ["algorithm.name=fedavg"],
             "frozen_v": ["algorithm.name=fedfrozen", "algorithm.train=v",
                          "algorithm.warmup_rounds=0"],
             "lr": ["algorithm.name=fedavg", "train.lr=0.03", "seed=1"],
             # local terms as per-client data in the captured step (alone: the regularizer)
             "fedprox": ["algorithm.name=fedprox", "algorithm.mu=0.5", "seed=2"],
             "scaffold": ["algorithm.name=scaffold", "seed=3"]}
    dataset = load_data(tiny_config(*gpu))
    feds = []
    for over in names.values():
        cfg = resolve(tiny_config(*gpu, *over), dataset)
        feds.append(Federation(cfg, dataset, make_partition_for(cfg, dataset)))
    states = [f.initial_state() for f in feds]
    works = [f.begin_round(s, 1) for f, s in zip(feds, states)]
    stacked = train_jobs([w.job for w in works], [f.engine for f in feds])
    for f, s, got in zip(feds, states, stacked):
        alone = f.train_job(f.begin_round(s, 1).job)
        for n in got.params:
            if n.endswith("attn.k.bias"):
                continue
            delta = (got.params[n] - s.global_params[n]).double()
            ref = (alone.params[n] - s.global_params[n]).double()
            err = float((delta - ref).norm())
            assert err <= 1e-4 * float(ref.norm()) + 1e-6, (n, err, float(ref.norm()))
        assert torch.allclose(got.data_loss, alone.data_loss, rtol=1e-5)


def test_groups_split_by_architecture_and_memory(tmp_path):
    """Runs of two model sizes go to two groups (never an error); a memory budget splits a
    group; a run that cannot fit alone is refused naming it and its estimate."""
    from linattn.errors import UserError
    from real_data.stacked_runs import estimate_run_bytes, plan_groups

    small = [RunRequest(tmp_path / f"s{i}", _cfg("fedavg")) for i in range(4)]
    wide = [RunRequest(tmp_path / f"w{i}", tiny_config(*BASE, "model.dim=16", "model.heads=2"))
            for i in range(2)]
    params = {8: 1000, 16: 3000}

    def num(cfg):
        return params[cfg.model.params.dim]

    one = estimate_run_bytes(small[0].cfg, 1000)
    groups = plan_groups([*small, *wide], num, free_bytes=10**12)
    assert [[r.run_dir.name for r in g] for g in groups] == [["s0", "s1", "s2", "s3"],
                                                             ["w0", "w1"]]
    tight = plan_groups(small, num, free_bytes=int(2 * 2.5 * one))  # room for 2 runs at 50%
    assert [len(g) for g in tight] == [2, 2]
    assert [len(g) for g in plan_groups(small, num, free_bytes=10**12, max_runs=3)] == [3, 1]
    with pytest.raises(UserError, match=r"run .*s0 needs about .* GiB"):
        plan_groups(small, num, free_bytes=one)
