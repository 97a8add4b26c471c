"""``algorithm.warmup=auto`` in the runner: the probe estimator (linattn_theory.probe, eq. 36).

On the tiny digits ViT (T = 16, a snapshot every 2 rounds, probes of 4 frozen rounds):

- the runner's curves, predictions and T0 equal a plain loop that loads the warm-up snapshots
  of a never-freezing run, trains freeze-now continuations with a fixed-T0 FedFrozen
  federation on the probes' common draws, and drives ProbeSelector by hand;
- the main trajectory is the never-freezing one up to the round warm-up stopped at (the kept
  and the discarded rows together);
- after the roll-back the run equals a fixed-T0 run with T0 = the chosen snapshot;
- a run killed in the middle of a probe, or after the roll-back, resumes to the same files;
- forking runs in a stacked group probe together and equal themselves trained alone;
- bad settings exit 2 naming the key and write nothing.

All runs are float32 on one CPU thread; the comparisons that follow one code path in one
process are exact (equal bytes), the plain loop (other code path) agrees within 1e-6.
"""

import json

import numpy as np
import pytest
import torch
from conftest import (
    TINY,
    assert_group_equals_alone,
    assert_rows_agree,
    assert_run_refused,
    tiny_config,
)
from pause_run import kill_when_paused
from pause_run import start as start_paused

from linattn.cli import main as linattn_main
from linattn.errors import ConfigError
from linattn_theory.probe import ProbeSelector
from real_data import probe_runs
from real_data.checkpoint import load_checkpoint
from real_data.data import load_partition
from real_data.engines import make_batches
from real_data.federation import Federation, RoundDraws, sample_clients
from real_data.probe_runs import DISCARDED_FILE, PROBE_METRICS, PROBE_STREAM
from real_data.runs import load_data, prepare_start, shifted, start_run
from real_data.stacked_runs import RunRequest, run_group

T, INTERVAL, R = 16, 2, 4
BASE = [f"train.rounds={T}", "partition.num_clients=4", "algorithm.name=fedfrozen",
        "partition.validation_fraction=0.2", "run.checkpoint_every=1"]
AUTO = [*BASE, "algorithm.warmup=auto", "algorithm.warmup_rounds=null",
        f"algorithm.probe_interval={INTERVAL}", f"algorithm.probe_rounds={R}",
        "algorithm.probe_patience=1", "algorithm.probe_margin=0"]


def fixed(t0: int) -> list[str]:
    return [*BASE, "algorithm.warmup=fixed", f"algorithm.warmup_rounds={t0}"]


def lines(path, keep_probe: bool = True) -> list[str]:
    """The rows of a CSV file (no header); without the probe rows unless ``keep_probe``."""
    rows = path.read_text().splitlines()[1:]
    return [r for r in rows if keep_probe or r.split(",")[2] not in PROBE_METRICS]


def params_of(run_dir) -> dict:
    return torch.load(run_dir / "checkpoints" / "last.pt", weights_only=False)["global_params"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The auto run, the never-freezing run (T0 = T, snapshots at every probe round) and the
    fixed-T0 run at the chosen T0."""
    root = tmp_path_factory.mktemp("auto")
    out = {"auto": root / "auto", "never": root / "never"}
    assert start_run(tiny_config(*AUTO), out=out["auto"]).status == "completed"
    start_run(tiny_config(*fixed(T)), out=out["never"],
              snapshot_rounds=tuple(range(0, T, INTERVAL)))
    warm = json.loads((out["auto"] / "summary.json").read_text())["warmup"]
    out["fixed"] = root / "fixed"
    start_run(tiny_config(*fixed(warm["warmup_rounds"])), out=out["fixed"])
    return out, warm


def test_summary_reports_the_decision_and_the_compute(runs):
    dirs, warm = runs
    t0, stopped = warm["warmup_rounds"], warm["stopped_at"]
    # this setting stops early: the roll-back path is the one under test
    assert warm["rule"] == "auto" and 0 <= t0 < stopped < T
    assert warm["snapshots"] == list(range(0, stopped + 1, INTERVAL))
    assert len(warm["predictions"]) == len(warm["snapshots"])
    assert warm["probe_rounds_used"] == R * len(warm["snapshots"])
    used = warm["rounds_computed"]
    assert used == {"warmup": stopped, "probe": R * len(warm["snapshots"]), "frozen": T - t0,
                    "discarded": stopped - t0,
                    "fedavg_equivalent": pytest.approx((stopped + used["probe"] + T - t0) / T)}
    assert warm["probe_seconds"] > 0 and 0.0 <= warm["rate"] <= 1.0
    # the recorded curves replay the decision: a selector fed them predicts the same values
    sel = ProbeSelector(T, patience=1, margin=0.0)
    assert len(warm["curves"]) == len(warm["snapshots"])
    for t, curve in zip(warm["snapshots"], warm["curves"]):
        assert len(curve) == R + 1
        sel.add(t, curve)
    assert sel.predictions == pytest.approx(warm["predictions"], rel=1e-12)
    # metrics.csv: the stages of a fixed-T0 run, probe rows at the kept snapshots only
    rows = lines(dirs["auto"] / "metrics.csv")
    stages = {int(r.split(",")[0]): r.split(",")[4] for r in rows}
    assert stages == {r: "warmup" if r <= t0 else "frozen" for r in range(1, T + 1)} | (
        {0: "warmup"} if 0 in stages else {})
    pred = {int(r.split(",")[0]): float(r.split(",")[3]) for r in rows
            if ",global,probe_prediction," in r}
    assert pred == {t: p for t, p in zip(warm["snapshots"], warm["predictions"]) if t <= t0}
    # every snapshot file is gone once T0 is decided
    assert sorted(p.name for p in (dirs["auto"] / "checkpoints").iterdir()) == ["last.pt"]


def test_choice_equals_a_plain_loop_over_fixed_t0_continuations(runs):
    """The reference: the never-freezing run's snapshots, each continued for R frozen rounds
    by a FedFrozen federation with warmup_rounds = t, on the draws the probes use (round s:
    clients from the probe's sampling stream, minibatches from its training stream, both
    keyed by s), the validation loss from Federation.evaluate, ProbeSelector driven by
    hand."""
    dirs, warm = runs
    never = dirs["never"]
    cfg0 = tiny_config(*fixed(T))
    dataset = load_data(cfg0)
    partition = load_partition(never / "partition.npz")
    record = torch.load(dirs["auto"] / "checkpoints" / "last.pt",
                        weights_only=False)["server_state"].probe
    selector = ProbeSelector(T, patience=1, window=4, margin=0.0)
    curves, stopped = [], T
    for t in range(0, T, INTERVAL):
        cfg = tiny_config(*fixed(t))
        fed = Federation(cfg, *shifted(cfg, dataset, partition))
        state, _, _ = load_checkpoint(never / "checkpoints" / f"round_{t}.pt", fed.device)
        assert state.round == t
        sampling = int(np.random.SeedSequence([cfg.role_seed("sampling"), PROBE_STREAM])
                       .generate_state(1)[0])
        training = int(np.random.SeedSequence([cfg.role_seed("training"), PROBE_STREAM])
                       .generate_state(1)[0])
        curve = [fed.evaluate(state)[0]["val_loss"]]
        for s in range(1, R + 1):
            ids = sample_clients(sampling, s, 4, cfg.train.clients_per_round)
            tr = cfg.train
            draws = RoundDraws(ids, make_batches(partition.train, ids, training, s,
                                                 tr.batch_size, tr.local_steps,
                                                 tr.local_epochs),
                               int(np.random.SeedSequence(
                                   [cfg.role_seed("training"), PROBE_STREAM, s])
                                   .generate_state(1)[0]))
            rnd = min(t + s, T)
            work = fed.begin_round(state, rnd, draws=draws)
            assert work.plan.stage == "frozen"
            state, _ = fed.update_round(state, rnd, work, fed.train_job(work.job))
            curve.append(fed.evaluate(state)[0]["val_loss"])
        curves.append(curve)
        if selector.add(t, curve):
            stopped = t
            break
    continuing = None
    if stopped == T:
        final, _, _ = load_checkpoint(never / "checkpoints" / "last.pt", torch.device("cpu"))
        continuing = fed.evaluate(final)[0]["val_loss"]
    choice = selector.choose(stopped, continuing)
    np.testing.assert_allclose(np.array(record["curves"]), np.array(curves), rtol=1e-6)
    np.testing.assert_allclose(warm["predictions"], choice.predictions, rtol=1e-6)
    assert (choice.warmup_rounds, choice.stopped_at) == (warm["warmup_rounds"],
                                                         warm["stopped_at"])


def test_main_trajectory_is_the_never_freezing_one_until_the_stop(runs):
    dirs, warm = runs
    stopped = warm["stopped_at"]
    kept = lines(dirs["auto"] / "metrics.csv", keep_probe=False)
    discarded = lines(dirs["auto"] / DISCARDED_FILE, keep_probe=False)
    t0 = warm["warmup_rounds"]
    assert {int(r.split(",")[0]) for r in discarded} == set(range(t0 + 1, stopped + 1))
    before = [r for r in kept if int(r.split(",")[0]) <= t0]
    never = [r for r in lines(dirs["never"] / "metrics.csv")
             if int(r.split(",")[0]) <= stopped]
    assert before + discarded == never
    # the discarded rows keep the probe rows of their snapshots
    assert {int(r.split(",")[0]) for r in lines(dirs["auto"] / DISCARDED_FILE)
            if ",probe_prediction," in r} == {t for t in warm["snapshots"] if t > t0}


def test_rolled_back_run_equals_the_fixed_t0_run(runs):
    dirs, _ = runs
    assert lines(dirs["auto"] / "metrics.csv", keep_probe=False) == \
        lines(dirs["fixed"] / "metrics.csv")
    auto, ref = params_of(dirs["auto"]), params_of(dirs["fixed"])
    assert auto.keys() == ref.keys()
    for name in auto:
        assert torch.equal(auto[name], ref[name]), name


@pytest.mark.parametrize("flags", [(), ("--probe-call", "10"), ("--rolled-back",)],
                         ids=["warm-up", "mid-probe", "after-rollback"])
def test_killed_auto_run_resumes_to_identical_files(runs, tmp_path, flags):
    """Warm-up: killed after round 4's rows, before its checkpoint and its probe. Probe round
    10 is the third probe's second frozen round. After the roll-back: killed after the
    second frozen round's rows."""
    dirs, warm = runs
    killed, marker = tmp_path / "killed", tmp_path / "paused"
    pause_round = {(): 4, ("--rolled-back",): warm["warmup_rounds"] + 2}.get(flags, 999)
    proc = start_paused(pause_round, marker, killed, *TINY, *AUTO, flags=flags)
    kill_when_paused(proc, marker, f"the run never paused ({flags})")
    if flags[:1] == ("--probe-call",):  # killed mid-probe: its snapshot is on disk
        assert (killed / "checkpoints" / "probe_4.pt").is_file()
        assert not (killed / "summary.json").exists()
    elif flags:
        assert (killed / DISCARDED_FILE).is_file()
    else:
        assert not (killed / "checkpoints" / "probe_4.pt").exists()
    assert linattn_main(["run", "--resume", str(killed)]) == 0
    for name in ("metrics.csv", DISCARDED_FILE):
        assert (killed / name).read_bytes() == (dirs["auto"] / name).read_bytes(), name
    a, b = params_of(killed), params_of(dirs["auto"])
    assert all(torch.equal(a[n], b[n]) for n in a)
    got = json.loads((killed / "summary.json").read_text())["warmup"]
    assert {k: v for k, v in got.items() if k != "probe_seconds"} == \
        {k: v for k, v in warm.items() if k != "probe_seconds"}
    assert sorted(p.name for p in (killed / "checkpoints").iterdir()) == ["last.pt"]


def test_stacked_group_probes_together_and_equals_the_runs_alone(runs, tmp_path):
    """Two auto runs (one stops early and rolls back, one at another lr) and a fixed-T0 run in
    one group: the auto runs' probes train together, and every run's metrics, discarded rows
    and decision agree with the run trained alone (the same T0; values within 1e-6)."""
    dirs, warm = runs
    cfgs = {"auto": tiny_config(*AUTO), "auto_lr": tiny_config(*AUTO, "train.lr=0.02"),
            "fixed": tiny_config(*fixed(6))}
    calls = []
    real = probe_runs.probe_step

    def counted(jobs, *args, **kwargs):
        calls.append(len(jobs))
        return real(jobs, *args, **kwargs)

    probe_runs.probe_step = counted
    try:
        assert_group_equals_alone(tmp_path, cfgs)
    finally:
        probe_runs.probe_step = real
    assert max(calls) == 2  # both continuations in one engine call where both probe
    for name in ("auto", "auto_lr"):
        alone = json.loads((tmp_path / "alone" / name / "summary.json").read_text())["warmup"]
        group = json.loads((tmp_path / "group" / name / "summary.json").read_text())["warmup"]
        for key in ("warmup_rounds", "stopped_at", "snapshots", "rounds_computed"):
            assert group[key] == alone[key], (name, key)
        np.testing.assert_allclose(np.array(group["curves"]), np.array(alone["curves"]),
                                   rtol=1e-6)
        if (tmp_path / "alone" / name / DISCARDED_FILE).is_file():
            assert_rows_agree(tmp_path / "alone" / name / DISCARDED_FILE,
                              tmp_path / "group" / name / DISCARDED_FILE)
        assert sorted(p.name for p in (tmp_path / "group" / name / "checkpoints").iterdir()) \
            == ["last.pt"]
    # the first auto run is the module's run: it stopped early and rolled back in the group too
    assert warm["warmup_rounds"] < warm["stopped_at"] < T


def test_group_killed_mid_probe_resumes_to_identical_files(tmp_path):
    """An auto run and a fixed-T0 partner in one group, killed in the middle of the third
    probe (probe round 10 of the group): resumed as a group, both runs' files equal those of
    the group trained without a stop, byte for byte."""
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    cfg = tiny_config(*AUTO)
    partner = tiny_config(*fixed(6))
    run_group([RunRequest(whole / "auto", cfg), RunRequest(whole / "partner", partner)],
              dataset=load_data(cfg), log=lambda s: None)
    marker = tmp_path / "paused"
    proc = start_paused(999, marker, killed / "auto", *TINY, *AUTO,
                        flags=("--probe-call", "10", "--group"))
    kill_when_paused(proc, marker, "the group never paused in a probe")
    # in a group a snapshot is written with its probe's curve: the third is not there yet
    snaps = sorted(p.name for p in (killed / "auto" / "checkpoints").glob("probe_*.pt"))
    assert snaps == ["probe_0.pt", "probe_2.pt"]
    assert not (killed / "auto" / "summary.json").exists()
    run_group([RunRequest(killed / "auto", resume=True),
               RunRequest(killed / "partner", resume=True)],
              dataset=load_data(cfg), log=lambda s: None)
    for run in ("auto", "partner"):
        for name in ("metrics.csv", DISCARDED_FILE):
            if (whole / run / name).is_file():
                assert (killed / run / name).read_bytes() == (whole / run / name).read_bytes()
        a, b = params_of(killed / run), params_of(whole / run)
        assert all(torch.equal(a[n], b[n]) for n in a)
    got = json.loads((killed / "auto" / "summary.json").read_text())["warmup"]
    want = json.loads((whole / "auto" / "summary.json").read_text())["warmup"]
    assert {k: v for k, v in got.items() if k != "probe_seconds"} == \
        {k: v for k, v in want.items() if k != "probe_seconds"}


KILL_BETWEEN = """
import os, sys
from pathlib import Path
sys.path[:0] = [sys.argv[1], sys.argv[1] + '/tests/real_data']
from conftest import tiny_config
from real_data import probe_runs
from real_data.runs import load_data
from real_data.stacked_runs import RunRequest, run_group
out, kill_round, overrides = Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
before = probe_runs.ProbeDriver.before_round
def exit_after_a(self, state, probed=None):
    got = before(self, state, probed)
    if probed is not None and self.run_dir.name == 'a' and state.round == kill_round:
        os._exit(9)  # a's probe is recorded, b's is not
    return got
probe_runs.ProbeDriver.before_round = exit_after_a
cfgs = {'a': tiny_config(*overrides), 'b': tiny_config(*overrides, 'train.lr=0.02')}
run_group([RunRequest(out / n, c) for n, c in cfgs.items()], dataset=load_data(cfgs['a']),
          log=lambda s: None)
"""


@pytest.mark.parametrize("kill_round", [2, 4])
def test_group_killed_between_two_runs_probe_records_resumes_identically(tmp_path,
                                                                          kill_round):
    """Two auto runs probe together; the process dies after the first run's probe at a round
    is recorded and before the second's. Resumed, the second probes again beside the first
    (whose repeated continuation is dropped), so both runs' files equal the uninterrupted
    group's byte for byte."""
    import subprocess
    import sys

    from pause_run import REPO

    cfgs = {"a": tiny_config(*AUTO), "b": tiny_config(*AUTO, "train.lr=0.02")}
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    run_group([RunRequest(whole / n, c) for n, c in cfgs.items()],
              dataset=load_data(cfgs["a"]), log=lambda s: None)
    proc = subprocess.run([sys.executable, "-c", KILL_BETWEEN, str(REPO), str(killed),
                           str(kill_round), *TINY, *AUTO], capture_output=True, timeout=300)
    assert proc.returncode == 9, proc.stderr.decode()[-2000:]
    rows = {n: (killed / n / "metrics.csv").read_text() for n in cfgs}
    probe_row = f"\n{kill_round},global,probe_prediction,"
    assert probe_row in rows["a"] and probe_row not in rows["b"]
    run_group([RunRequest(killed / n, resume=True) for n in cfgs],
              dataset=load_data(cfgs["a"]), log=lambda s: None)
    for n in cfgs:
        for name in ("metrics.csv", DISCARDED_FILE):
            if (whole / n / name).is_file():
                assert (killed / n / name).read_bytes() == (whole / n / name).read_bytes(), \
                    (n, name)
        a, b = params_of(killed / n), params_of(whole / n)
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_study_stacks_the_auto_arm_with_the_others(tmp_path):
    import yaml

    from real_data import study
    from real_data.study.runner import _stack_batches

    arm = [o for o in AUTO if not o.startswith(("train.rounds", "partition.num_clients"))]
    data = {"name": "tiny", "seeds": [0], "sweeps": [{
        "name": "digits", "config": "digits_vit",
        "overrides": [*TINY, "train.rounds=6", "partition.num_clients=4"], "alphas": [1.0],
        "arms": [{"name": "fedavg", "overrides": ["algorithm.name=fedavg"]},
                 {"name": "auto", "overrides": arm},
                 {"name": "fedavg2", "overrides": ["algorithm.name=fedavg", "train.lr=0.02"]}]}]}
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(data))
    plan = study.load_plan(path, tmp_path / "out")
    specs = study.plan_runs(plan)
    families = [[s] for s in specs]
    batches = _stack_batches(families, 64)
    assert [len(b) for b in batches] == [3]  # the auto run stacks with the FedAvg runs
    counts = study.run_study(plan, log=lambda *_: None)
    assert counts["started"] == 3 and counts["failed"] == 0
    auto = next(s for s in specs if s.arm.name == "auto").run_dir
    warm = json.loads((auto / "summary.json").read_text())["warmup"]
    assert warm["rule"] == "auto" and warm["snapshots"][0] == 0


def test_scale_out_trainers_refuse_a_forking_run(tmp_path):
    with pytest.raises(ConfigError, match="algorithm.warmup"):
        prepare_start(tiny_config(*AUTO), out=tmp_path / "r", trainer=object())
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("override, text", [
    (["algorithm.probe_rounds=1"], "algorithm.probe_rounds=1"),
    (["algorithm.probe_interval=0"], "algorithm.probe_interval=0"),
    ([f"algorithm.probe_interval={T + 1}"], f"algorithm.probe_interval={T + 1}"),
    (["algorithm.probe_patience=0"], "algorithm.probe_patience=0"),
    (["algorithm.probe_window=0"], "algorithm.probe_window=0"),
    (["algorithm.probe_margin=-1"], "algorithm.probe_margin=-1"),
    (["partition.validation_fraction=null"], "partition.validation_fraction"),
])
def test_bad_settings_exit_2_and_write_nothing(tmp_path, capsys, override, text):
    assert_run_refused(tmp_path, capsys, [*TINY, *AUTO, *override], text)
