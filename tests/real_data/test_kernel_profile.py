"""The kernel profile Phi(M) on a real network (real_data.profile; the run's own optimizer or
Adam, each against a plain torch loop), kernel bias and drift over
a study plan (real_data.study.profile_tables), the bootstrap interval of the chosen T0, and the
shipped P3 plan."""

from __future__ import annotations

import dataclasses
import json
import tarfile

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml
from scipy import stats

from linattn.cli import main as linattn_main
from linattn.errors import ConfigError, UserError
from real_data import study
from real_data.profile import (
    ADAM_LR,
    DEFAULT_EVAL_EVERY,
    PROFILE_STREAM,
    Budget,
    kernel_profile,
    run_setup,
)
from real_data.study.profile_tables import TRENDS, summarize

# a tiny run that holds out a validation split, trained with every part of the SGD rule the
# profile replays (momentum, weight decay, clipping)
RUN = ["model.dim=8", "model.mlp_dim=16", "model.depth=1", "model.heads=2",
       "train.batch_size=8", "train.local_steps=3", "run.progress=false", "run.plot=false",
       "eval.clients=false", "partition.validation_fraction=0.2", "train.optimizer=sgd",
       "train.lr=0.2", "train.momentum=0.5", "train.weight_decay=0.0001",
       "train.clip_grad_norm=1.0", "algorithm.name=fedavg", "train.rounds=3",
       "train.device=cpu"]
STEPS = 30


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    from real_data.config import load_config
    from real_data.runs import start_run

    out = tmp_path_factory.mktemp("profile") / "run"
    start_run(load_config("digits_vit", RUN), out=out, snapshot_rounds=(0, 3))
    return out


@pytest.fixture(scope="module")
def run64(tmp_path_factory):
    """The same run in float64 (Adam's budget checked to 1e-10)."""
    from real_data.config import load_config
    from real_data.runs import start_run

    out = tmp_path_factory.mktemp("profile64") / "run"
    start_run(load_config("digits_vit", [*RUN, "train.precision=fp64"]), out=out,
              snapshot_rounds=(0, 3))
    return out


def plain_phi(run_dir, snapshot, steps: int, cosine: bool = False, optimizer: str = "sgd",
              lr: float | None = None, read_at: tuple[int, ...] | None = None, qk_tensors=None):
    """Phi by hand, in the run's precision: the run's initial model, Q/K from the snapshot and
    frozen, torch's SGD with the run's momentum (or ``torch.optim.Adam``) with the run's weight
    decay and ``clip_grad_norm_`` on the pooled training samples in the documented order
    (``cosine``: step t at lr (1 + cos(pi t / steps)) / 2; ``lr``: default the run's), the
    validation loss and accuracy at the end. ``read_at``: the ``(step, loss, accuracy)`` after
    each of these steps instead; ``qk_tensors``: Q/K from this dict instead of the snapshot."""
    import math

    from linattn.configio import load_yaml
    from real_data.config import config_from_dict
    from real_data.data import load_partition
    from real_data.models import build_model, names_of_kind
    from real_data.runs import load_data

    cfg = config_from_dict(load_yaml(run_dir / "config.yaml"))
    dtype = torch.float64 if cfg.train.precision == "fp64" else torch.float32
    data = load_data(cfg)
    part = load_partition(run_dir / "partition.npz")
    model = build_model("vit", cfg.model.params, cfg.role_seed("training"), dtype)
    qk = set(names_of_kind(model.param_groups(), "qk"))
    snap = (torch.load(snapshot, weights_only=False)["global_params"] if qk_tensors is None
            else qk_tensors)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n in qk:
                p.copy_(snap[n])
                p.requires_grad_(False)
    rest = [p for n, p in model.named_parameters() if n not in qk]
    t = cfg.train
    lr = t.lr if lr is None else lr
    if optimizer == "adam":
        opt = torch.optim.Adam(rest, lr=lr, betas=(0.9, 0.999), eps=1e-8,
                               weight_decay=t.weight_decay)
    else:
        opt = torch.optim.SGD(rest, lr=lr, momentum=t.momentum, weight_decay=t.weight_decay)
    pooled = np.sort(np.concatenate(part.train))
    rng = np.random.default_rng([cfg.role_seed("training"), PROFILE_STREAM])
    batches = []
    while len(batches) < steps:
        perm = rng.permutation(len(pooled))
        whole = len(pooled) // t.batch_size
        batches += list(perm[: whole * t.batch_size].reshape(whole, t.batch_size))
    x, y = data.x_train.to(dtype), data.y_train

    def validate():
        with torch.no_grad():
            val = torch.as_tensor(part.val_pooled)
            logits = model(x[val])
            return (float(F.cross_entropy(logits, y[val])),
                    float((logits.argmax(1) == y[val]).double().mean()))

    curve = []
    for step, b in enumerate(batches[:steps]):
        if cosine:
            opt.param_groups[0]["lr"] = lr * 0.5 * (1 + math.cos(math.pi * step / steps))
        ix = torch.as_tensor(pooled[b])
        loss = F.cross_entropy(model(x[ix]), y[ix])
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(rest, t.clip_grad_norm)
        opt.step()
        if read_at is not None and step + 1 in read_at:
            curve.append((step + 1, *validate()))
    return validate() if read_at is None else curve


def test_phi_equals_a_plain_loop(run_dir):
    snap = run_dir / "checkpoints" / "round_3.pt"
    res = kernel_profile(run_setup(run_dir).cfg, snap, Budget(STEPS, check=False))
    phi, acc = plain_phi(run_dir, snap, STEPS)
    assert res["phi"] == pytest.approx(phi, rel=1e-5)  # fp32 on the CPU: round-off
    assert res["val_acc"] == pytest.approx(acc, abs=1e-12)
    assert res["steps"] == STEPS and res["lr"] == 0.2 and res["batch_size"] == 8
    assert res["phi_doubled"] is None and res["converged"] is None


def test_a_cosine_budget_equals_a_plain_loop_and_checks_with_a_training_of_its_own(run_dir):
    setup = run_setup(run_dir)
    snap = run_dir / "checkpoints" / "round_3.pt"
    res = setup.phi(snap, Budget(STEPS, schedule="cosine"))
    phi, acc = plain_phi(run_dir, snap, STEPS, cosine=True)
    assert res["phi"] == pytest.approx(phi, rel=1e-5)  # fp32 on the CPU: round-off
    assert res["val_acc"] == pytest.approx(acc, abs=1e-12)
    assert res["schedule"] == "cosine"
    # the check is a cosine over 2N steps from the start, not the N-step run continued
    phi2, _ = plain_phi(run_dir, snap, 2 * STEPS, cosine=True)
    assert res["phi_doubled"] == pytest.approx(phi2, rel=1e-5)
    alone = setup.phi(snap, Budget(2 * STEPS, check=False, schedule="cosine"))
    assert res["phi_doubled"] == pytest.approx(alone["phi"], rel=1e-12)
    constant = setup.phi(snap, Budget(STEPS, check=False))
    assert abs(constant["phi"] - res["phi"]) > 1e-4  # the schedule changes the training
    assert Budget(STEPS, schedule="cosine").tag() == f"steps{STEPS}_cosine"
    with pytest.raises(ConfigError, match="--schedule"):
        Budget(STEPS, schedule="linear")


def test_phi_depends_on_the_kernel_alone(run_dir, tmp_path):
    """A snapshot with other non-Q/K parameters (and another round) but the same Q/K gives
    the same Phi to the bit; another Q/K gives another Phi."""
    setup = run_setup(run_dir)
    snap = run_dir / "checkpoints" / "round_3.pt"
    payload = torch.load(snap, weights_only=False)
    gen = torch.Generator().manual_seed(1)
    payload["global_params"] = {
        n: t if n in setup.qk_names else t + torch.randn(t.shape, generator=gen)
        for n, t in payload["global_params"].items()}
    payload["round"] = 1
    other = tmp_path / "other.pt"
    torch.save(payload, other)
    budget = Budget(STEPS, check=False)
    a, b = setup.phi(snap, budget), setup.phi(other, budget)
    assert a["phi"] == b["phi"] and a["val_acc"] == b["val_acc"]
    assert (a["kernel_round"], b["kernel_round"]) == (3, 1)
    start = setup.phi(run_dir / "checkpoints" / "round_0.pt", budget)
    assert abs(start["phi"] - a["phi"]) > 1e-6
    # the same again through a fresh setup: nothing of one evaluation leaks into the next
    assert kernel_profile(setup.cfg, snap, budget)["phi"] == a["phi"]
    # trained side by side with other kernels: the same Phi up to round-off (fp32)
    many = setup.phi_many([("a", snap), ("0", run_dir / "checkpoints" / "round_0.pt"),
                           ("b", other)], budget, stack=3)
    assert many[0]["phi"] == pytest.approx(a["phi"], rel=1e-6)
    assert many[1]["phi"] == pytest.approx(start["phi"], rel=1e-6)
    assert many[2]["phi"] == many[0]["phi"] and many[0]["stacked"] == 3


def test_phi_from_a_packed_run_needs_only_its_config_and_qk(run_dir, tmp_path):
    """A study archive keeps a run's config.yaml and Q/K-only snapshots (pack_results): the
    partition is rebuilt from the config and the initial parameters from its seed, so Phi is
    the same as in the full run directory."""
    import shutil

    setup = run_setup(run_dir)
    packed = tmp_path / "packed"
    (packed / "checkpoints").mkdir(parents=True)
    shutil.copy(run_dir / "config.yaml", packed / "config.yaml")
    full = torch.load(run_dir / "checkpoints" / "round_3.pt", weights_only=False)
    torch.save({"global_params": {n: full["global_params"][n] for n in setup.qk_names}},
               packed / "checkpoints" / "round_3.pt")
    budget = Budget(STEPS, check=False)
    a = setup.phi(run_dir / "checkpoints" / "round_3.pt", budget)
    b = run_setup(packed).phi(packed / "checkpoints" / "round_3.pt", budget)
    assert a["phi"] == b["phi"] and b["kernel_round"] is None


def test_the_doubled_budget_check_is_reported(run_dir):
    setup = run_setup(run_dir)
    snap = run_dir / "checkpoints" / "round_3.pt"
    res = setup.phi(snap, Budget(STEPS))
    twice = setup.phi(snap, Budget(2 * STEPS, check=False))
    assert res["phi_doubled"] == pytest.approx(twice["phi"], rel=1e-12)  # the same run
    assert res["relative_change"] == pytest.approx(
        abs(res["phi_doubled"] - res["phi"]) / res["phi"], rel=1e-12)
    assert res["converged"] == (res["relative_change"] < 0.01)


PLAN = {
    "name": "tiny_profile",
    "seeds": [0],
    "sweeps": [{
        "name": "digits",
        "config": "digits_vit",
        "overrides": [o for o in RUN if not o.startswith(("algorithm.", "train.rounds"))]
        + ["train.rounds=3"],
        "alphas": [0.5],
        "arms": [
            {"name": "frozen", "overrides": ["algorithm.name=fedfrozen",
                                             "algorithm.train=all_but_qk"],
             "warmup_rounds": [0, 2, 3]},
            {"name": "reference_iid", "overrides": ["algorithm.name=fedavg",
                                                    "partition.scheme=iid"], "reference": True},
            {"name": "reference", "overrides": ["algorithm.name=fedavg", "partition.scheme=iid",
                                                "partition.num_clients=1"], "reference": True},
        ],
    }],
}


def test_bias_and_drift_of_a_tiny_plan(tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(PLAN))
    plan = study.load_plan(path, tmp_path / "out")
    study.run_study(plan, log=lambda *_: None)
    budget = Budget(20)
    records = study.profile_plan(plan, budget, log=lambda *_: None)
    assert len(records) == 3 * 3  # three T0 of the arm, three rounds of each reference
    phi = {(r["kind"], r["arm"], r["round"]): r["phi"] for r in records}
    rows = study.bias_drift(records)
    assert len(rows) == 3 * 2  # every T0 against both references
    best = phi[("ref", "reference", 3)]  # the pooled single client at its last snapshot
    for r in rows:
        t, ref = r["warmup_rounds"], r["reference"]
        assert r["phi_best"] == best and r["best_kernel"] == "reference@3"
        assert r["bias"] == pytest.approx(phi[("ref", ref, t)] - best, abs=1e-12)
        assert r["drift"] == pytest.approx(phi[("fed", "frozen", t)] - phi[("ref", ref, t)],
                                           abs=1e-12)
    # T0 = 0: every run starts from the seed's initial kernel, so no drift yet
    assert all(r["drift"] == 0.0 for r in rows if r["warmup_rounds"] == 0)
    # Phi is evaluated under the T0 family head's config
    head = plan.out_dir / "digits/frozen-T0=3/alpha=0.5/seed=0"
    direct = run_setup(head).phi(head / "checkpoints" / "round_2.pt", budget)
    assert direct["phi"] == pytest.approx(phi[("fed", "frozen", 2)], rel=1e-6)  # stacked
    # cached: read back without training anything
    again = study.profile_plan(plan, budget, log=lambda *_: None, compute=False)
    assert [r["phi"] for r in again] == [r["phi"] for r in records]
    sliced = study.profile_plan(plan, budget, compute=False, pattern=["digits/ref*/*/seed=0"])
    assert len(sliced) == len(records)  # a cell is kept when one of its runs matches
    with pytest.raises(UserError, match="no profile cell"):
        study.profile_plan(plan, budget, compute=False, pattern=["other/*"])
    # the study archive keeps what Phi reads (the Q/K weights and biases of every snapshot):
    # profiled from an unpacked copy of it, every kernel has the same Phi
    archive = tmp_path / "runs.tar.gz"
    assert study.pack_results(plan, archive)["snapshots"] > 0
    with tarfile.open(archive) as tar:  # every run's results before any snapshot
        names = tar.getnames()
    snap_at = [i for i, n in enumerate(names) if "/checkpoints/" in n]
    assert snap_at and min(snap_at) > max(i for i, n in enumerate(names)
                                          if n.endswith("summary.json"))
    copy = study.load_plan(path, tmp_path / "unpacked")
    with tarfile.open(archive) as tar:
        tar.extractall(copy.out_dir, filter="data")
    packed = study.profile_plan(copy, budget, log=lambda *_: None)
    assert [(r["kind"], r["arm"], r["round"]) for r in packed] == \
        [(r["kind"], r["arm"], r["round"]) for r in records]
    assert [r["phi"] for r in packed] == pytest.approx([r["phi"] for r in records], rel=1e-6)
    # --profile-split kernels: two processes share the cell, each with every 2nd kernel
    halves = study.load_plan(path, tmp_path / "halves")
    with tarfile.open(archive) as tar:
        tar.extractall(halves.out_dir, filter="data")
    with pytest.raises(UserError, match="--profile-split 'rows'"):
        study.profile_plan(halves, budget, shard=(0, 2), split="rows")
    first = study.profile_plan(halves, budget, log=lambda *_: None, shard=(0, 2),
                               split="kernels")
    kernels = [(r["kind"], r["arm"], r["round"]) for r in records]
    assert [(r["kind"], r["arm"], r["round"]) for r in first] == kernels[0::2]
    both = study.profile_plan(halves, budget, log=lambda *_: None, shard=(1, 2),
                              split="kernels")  # reads the first half's cache
    assert [(r["kind"], r["arm"], r["round"]) for r in both] == kernels
    assert [r["phi"] for r in both] == pytest.approx([r["phi"] for r in records], rel=1e-6)
    assert all(r["stacked"] in (4, 5) for r in both)  # 9 kernels over 2 processes
    assert all(r["device"]["type"] == "cpu" and r["seconds"] > 0 for r in first)
    paths = study.write_kernel_profile(rows, tmp_path / "tables", budget,
                                       study.chosen_t0(study.run_rows(plan)))
    data = json.loads(paths[1].read_text())
    assert len(data["rows"]) == 6 and data["budget"]["steps"] == 20
    assert data["summary"][0]["n_seeds"] == 1 and data["t0_choice"][0]["arm"] == "frozen"
    assert "| digits | 0.5 | frozen | 3 | reference |" in paths[2].read_text()
    # through the command line: reads the cache, writes the tables
    assert linattn_main(["study", "--plan", str(path), "--out", str(tmp_path / "out"),
                         "--profile", "--profile-steps", "20", "--aggregate-only"]) == 0
    assert (tmp_path / "out" / "tables" / "kernel_profile.md").is_file()
    # --profile-rounds: the kernels of those T0 and Phi_best's (the pooled reference at 3)
    fewer = study.load_plan(path, tmp_path / "fewer")
    with tarfile.open(archive) as tar:
        tar.extractall(fewer.out_dir, filter="data")
    some = study.profile_plan(fewer, budget, log=lambda *_: None, rounds=(0,))
    assert sorted((r["kind"], r["arm"], r["round"]) for r in some) == sorted(
        [k for k in kernels if k[2] == 0] + [("ref", "reference", 3)])
    by = {(r["kind"], r["arm"], r["round"]): r["phi"] for r in records}
    for r in some:
        assert r["phi"] == pytest.approx(by[(r["kind"], r["arm"], r["round"])], rel=1e-6)
    part = study.bias_drift(some)
    assert [r["warmup_rounds"] for r in part] == [0, 0]  # T0 = 0 against both references
    bad = ["study", "--plan", str(path), "--out", str(tmp_path / "fewer"), "--profile",
           "--profile-steps", "20", "--aggregate-only", "--profile-rounds"]
    assert linattn_main([*bad, "1"]) == 2  # not a T0 of the grid
    with pytest.raises(SystemExit) as exc:  # not a comma list of integers (argparse)
        linattn_main([*bad, "0,x"])
    assert exc.value.code == 2
    assert linattn_main(["study", "--plan", str(path), "--out", str(tmp_path / "fewer"),
                         "--profile-rounds", "0"]) == 2  # only with --profile


def test_bias_drift_arithmetic_on_synthetic_records():
    def rec(kind, arm, t, phi, seed=0):
        return {"sweep": "s", "alpha": 0.1, "seed": seed, "kind": kind, "arm": arm, "round": t,
                "phi": phi, "relative_change": 0.001, "converged": True,
                "best": ("pooled", 10)}

    records = [rec("fed", "ff", 0, 2.0), rec("fed", "ff", 10, 1.5),
               rec("ref", "pooled", 0, 2.0), rec("ref", "pooled", 10, 1.0),
               rec("ref", "iid", 0, 2.0), rec("ref", "iid", 10, 1.25)]
    rows = {(r["warmup_rounds"], r["reference"]): r for r in study.bias_drift(records)}
    assert rows[(10, "pooled")]["bias"] == 0.0 and rows[(10, "pooled")]["drift"] == 0.5
    assert rows[(10, "iid")]["bias"] == 0.25 and rows[(10, "iid")]["drift"] == 0.25
    assert rows[(0, "iid")]["bias"] == 1.0 and rows[(0, "iid")]["drift"] == 0.0
    # without Phi_best's kernel a cell has no rows
    assert study.bias_drift(records[:2] + records[4:]) == []
    # no doubled budget recorded: the 2N columns are empty
    assert rows[(10, "iid")]["bias_2n"] is None and rows[(10, "iid")]["drift_2n"] is None


def test_bias_drift_at_the_doubled_budget(tmp_path):
    def rec(kind, arm, t, phi, twice, seed):
        return {"sweep": "s", "alpha": 0.1, "seed": seed, "kind": kind, "arm": arm, "round": t,
                "phi": phi, "phi_doubled": twice, "relative_change": abs(twice - phi) / phi,
                "converged": False, "best": ("pooled", 10)}

    records = []
    for seed, shift in ((0, 0.0), (1, 0.5)):
        records += [rec("fed", "ff", 10, 2.0 + shift, 1.5 + shift, seed),
                    rec("ref", "pooled", 10, 1.0 + shift, 0.75 + shift, seed)]
    records[-1] = {**records[-1], "phi_doubled": float("nan")}  # seed 1: no finite 2N
    rows = {r["seed"]: r for r in study.bias_drift(records)}
    assert rows[0]["bias_2n"] == 0.0 and rows[0]["drift_2n"] == 0.75
    assert rows[0]["phi_fed_2n"] == 1.5 and rows[1]["drift_2n"] is None
    from real_data.study.profile_tables import summarize

    (summary,) = summarize(list(rows.values()))
    assert summary["drift_2n_n"] == 1 and summary["drift_2n_mean"] == 0.75
    assert summary["drift_mean"] == 1.0  # at N over both seeds
    paths = study.write_kernel_profile(list(rows.values()), tmp_path)
    row = [ln for ln in paths[2].read_text().splitlines() if ln.startswith("| s |")][0]
    assert "| 0.0000 +- 0.0000 | 0.7500 +- 0.0000 |" in row


def _runs(values: dict[int, list[float]], test: float = 0.5) -> list[dict]:
    return [{"sweep": "s", "alpha": 0.1, "arm": "ff", "warmup_rounds": t, "seed": s,
             "val_score": v, "score": test} for t, vs in values.items()
            for s, v in enumerate(vs)]


def test_chosen_t0_and_its_bootstrap_interval():
    # T0 = 20 is best on every seed: every resample picks it
    clear = study.chosen_t0(_runs({0: [0.5, 0.52, 0.51], 20: [0.7, 0.71, 0.69],
                                   200: [0.6, 0.6, 0.61]}))
    assert len(clear) == 1
    c = clear[0]
    assert (c["chosen_t0"], c["t0_low"], c["t0_high"], c["share_chosen"]) == (20, 20, 20, 1.0)
    assert c["chosen_mean"] == pytest.approx(0.7, abs=1e-12) and c["n_seeds"] == 3
    assert c["t0_grid"] == [0, 20, 200] and c["test_score"] == 0.5
    # seeds disagree: seed 0 prefers 0, seeds 1 and 2 prefer 200
    mixed = study.chosen_t0(_runs({0: [0.9, 0.5, 0.5], 200: [0.1, 0.6, 0.6]}), n_boot=4000)[0]
    assert mixed["chosen_t0"] == 0  # mean 0.633 against 0.433
    # a resample picks 200 only without seed 0 (0.8 k > 0.1 (3 - k) for k >= 1 copies of
    # it): probability (2/3)^3 = 8/27, so 0 is picked with 19/27 and both ends are in
    assert mixed["t0_low"] == 0 and mixed["t0_high"] == 200
    assert mixed["share_chosen"] == pytest.approx(19 / 27, abs=0.03)
    # the same seed, the same interval; a diverged run (NaN) is never picked
    assert study.chosen_t0(_runs({0: [0.9, 0.5, 0.5], 200: [0.1, 0.6, 0.6]}),
                           n_boot=4000)[0] == mixed
    # a row's interval does not move when another row joins the table (its own stream)
    other = [dict(r, sweep="a") for r in _runs({0: [0.4, 0.6, 0.5], 200: [0.5, 0.5, 0.55]})]
    both = study.chosen_t0(other + _runs({0: [0.9, 0.5, 0.5], 200: [0.1, 0.6, 0.6]}),
                           n_boot=4000)
    assert [r["sweep"] for r in both] == ["a", "s"] and both[1] == mixed
    nan = study.chosen_t0(_runs({0: [np.nan, 0.5, 0.5], 200: [0.1, 0.2, 0.2]}))[0]
    assert nan["chosen_t0"] == 200
    # a seed missing at some T0 leaves the comparison
    partial = _runs({0: [0.9, 0.5], 200: [0.1, 0.6, 0.6]})
    assert study.chosen_t0(partial)[0]["n_seeds"] == 2
    # one T0 per arm (a tuned plan's final stage): nothing to choose, no row
    assert study.chosen_t0(_runs({150: [0.7, 0.8, 0.75]})) == []


def test_bad_inputs_exit_2_and_write_nothing(run_dir, tmp_path, capsys):
    out = tmp_path / "phi.json"

    def cli(*args):
        code = linattn_main(["profile", "--run", str(run_dir), "--json", str(out), *args])
        return code, capsys.readouterr().err

    code, err = cli("--rounds", "0,2")  # round 2 was not kept
    assert code == 2 and "round_2.pt" in err and not out.exists()
    code, err = cli("--rounds", "0", "--steps", "0")
    assert code == 2 and "--steps" in err and not out.exists()
    code, err = cli("--rounds", "0", "--schedule", "linear")
    assert code == 2 and "--schedule" in err and not out.exists()
    code, err = cli("--kernel", str(tmp_path / "none.pt"))
    assert code == 2 and "none.pt" in err and not out.exists()
    bare = tmp_path / "bare.pt"  # a file without the model's Q/K
    torch.save({"round": 0, "global_params": {"head.weight": torch.zeros(1)}}, bare)
    code, err = cli("--kernel", str(bare), "--steps", "1")
    assert code == 2 and "bare.pt" in err and "Q/K" in err and not out.exists()
    code = linattn_main(["profile", "--run", str(tmp_path), "--rounds", "0"])
    assert code == 2 and "config.yaml" in capsys.readouterr().err
    # a run without a validation split: Phi has nothing to be read on
    from real_data.config import load_config
    from real_data.runs import start_run

    plain = tmp_path / "noval"
    start_run(load_config("digits_vit", [o for o in RUN if "validation" not in o]), out=plain,
              snapshot_rounds=(0,))
    code = linattn_main(["profile", "--run", str(plain), "--rounds", "0", "--json", str(out)])
    assert code == 2 and "partition.validation_fraction" in capsys.readouterr().err
    assert not out.exists()
    # the whole command works
    assert linattn_main(["profile", "--run", str(run_dir), "--rounds", "0,3", "--steps", "5",
                         "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [k["kernel_round"] for k in data["kernels"]] == [0, 3]
    assert all(k["relative_change"] is not None for k in data["kernels"])
    # a plan without a reference arm has nothing to compare
    plan = yaml.safe_load(yaml.safe_dump(PLAN))
    plan["sweeps"][0]["arms"] = plan["sweeps"][0]["arms"][:1]
    (tmp_path / "plan.yaml").write_text(yaml.safe_dump(plan))
    code = linattn_main(["study", "--plan", str(tmp_path / "plan.yaml"), "--out",
                         str(tmp_path / "o"), "--profile"])
    assert code == 2 and "reference" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_shipped_p3_plan_expands(capsys):
    plan = study.load_plan("p3")
    specs = study.plan_runs(plan)
    assert {s.seed for s in specs} == {0, 1, 2}
    for spec in specs[::53]:  # a sample of configs resolves
        cfg = study.run_config(spec, spec.warmup_rounds)
        assert cfg.partition.validation_fraction == 0.1 and cfg.train.rounds == 200
    for sw in plan.sweeps:  # every sweep has the T0 grid and both references
        grid = {t for a in sw.arms for t in a.warmup_rounds}
        assert grid == {0, 5, 10, 20, 40, 80, 120, 160, 200}, sw.name
        assert len([a for a in sw.arms if a.reference]) >= 1, sw.name
    assert len(study.profile_cells(plan)) == sum(len(sw.alphas) * len(sw.seeds)
                                                 for sw in plan.sweeps)
    assert linattn_main(["study", "--plan", "p3", "--list"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == len(specs)


@pytest.mark.parametrize("schedule", ["constant", "cosine"])
def test_adam_phi_equals_a_plain_torch_adam_loop(run64, schedule):
    setup = run_setup(run64)
    assert setup.fed.dtype == torch.float64
    snap = run64 / "checkpoints" / "round_3.pt"
    cosine = schedule == "cosine"
    res = setup.phi(snap, Budget(STEPS, schedule=schedule, optimizer="adam"))
    phi, acc = plain_phi(run64, snap, STEPS, cosine, "adam", ADAM_LR)
    assert res["phi"] == pytest.approx(phi, rel=1e-10, abs=1e-10)
    assert res["val_acc"] == pytest.approx(acc, abs=1e-12)
    assert res["optimizer"] == "adam" and res["lr"] == ADAM_LR == 1e-3
    assert res["momentum"] == 0.0 and res["weight_decay"] == 0.0001
    assert res["betas"] == [0.9, 0.999] and res["eps"] == 1e-8
    assert res["clip_grad_norm"] == 1.0 and res["schedule"] == schedule
    # the check: the same training continued (constant) or a cosine over 2N of its own
    phi2, acc2 = plain_phi(run64, snap, 2 * STEPS, cosine, "adam", ADAM_LR)
    assert res["phi_doubled"] == pytest.approx(phi2, rel=1e-10, abs=1e-10)
    assert res["val_acc_doubled"] == pytest.approx(acc2, abs=1e-12)
    assert res["relative_change"] == pytest.approx(abs(phi2 - phi) / phi, rel=1e-8)
    # a step size of its own; Adam's Phi is not SGD's
    other = setup.phi(snap, Budget(STEPS, lr=0.01, check=False, schedule=schedule,
                                   optimizer="adam"))
    assert other["lr"] == 0.01
    assert other["phi"] == pytest.approx(
        plain_phi(run64, snap, STEPS, cosine, "adam", 0.01)[0], rel=1e-10, abs=1e-10)
    sgd = setup.phi(snap, Budget(STEPS, check=False, schedule=schedule))
    assert abs(sgd["phi"] - res["phi"]) > 1e-4


def test_the_default_budget_is_the_runs_optimizer_unchanged(run64):
    setup = run_setup(run64)
    snap = run64 / "checkpoints" / "round_3.pt"
    assert Budget().optimizer == "run"
    default = setup.phi(snap, Budget(STEPS))
    named = setup.phi(snap, Budget(STEPS, optimizer="run"))
    assert {k: v for k, v in default.items() if k != "seconds"} == \
        {k: v for k, v in named.items() if k != "seconds"}
    assert "betas" not in default and default["optimizer"] == "sgd"
    assert default["lr"] == 0.2 and default["momentum"] == 0.5
    phi, acc = plain_phi(run64, snap, STEPS)
    assert default["phi"] == pytest.approx(phi, rel=1e-10, abs=1e-10)
    assert default["val_acc"] == pytest.approx(acc, abs=1e-12)
    # the profile cache's key is the one it was for the default; Adam's is its own
    assert Budget(STEPS).tag() == Budget(STEPS, optimizer="run").tag() == f"steps{STEPS}"
    assert Budget(STEPS, schedule="cosine", optimizer="adam").tag() == \
        f"steps{STEPS}_cosine_adam"
    with pytest.raises(ConfigError, match="--optimizer"):
        Budget(STEPS, optimizer="rmsprop")
    with pytest.raises(ConfigError, match="--lr"):
        Budget(STEPS, lr=0.0, optimizer="adam")


def test_bad_optimizer_inputs_exit_2_and_write_nothing(run64, tmp_path, capsys):
    out = tmp_path / "phi.json"

    def cli(*args):
        code = linattn_main(["profile", "--run", str(run64), "--rounds", "0,3", "--json",
                             str(out), *args])
        return code, capsys.readouterr().err

    code, err = cli("--optimizer", "rmsprop")
    assert code == 2 and "--optimizer" in err and "rmsprop" in err and not out.exists()
    code, err = cli("--optimizer", "adam", "--lr", "0")
    assert code == 2 and "--lr" in err and not out.exists()
    code, err = cli("--optimizer", "adam", "--lr", "-0.001")
    assert code == 2 and "--lr" in err and not out.exists()
    # the whole command works
    assert cli("--optimizer", "adam", "--schedule", "cosine", "--steps", "4")[0] == 0
    data = json.loads(out.read_text())
    assert [k["kernel_round"] for k in data["kernels"]] == [0, 3]
    assert all(k["optimizer"] == "adam" and k["lr"] == 1e-3 and k["schedule"] == "cosine"
               and k["relative_change"] is not None for k in data["kernels"])
    # linattn study --profile: --profile-optimizer is checked before anything is written
    _study_refuses(tmp_path, capsys, [(["--profile-optimizer", "sgdm"], "--profile-optimizer"),
                                      (["--profile-optimizer", "adam", "--profile-lr", "0"],
                                       "--profile-lr")])


def _study_refuses(tmp_path, capsys, cases, profile: bool = True) -> None:
    """``linattn study --plan <tiny T0 plan> [--profile] ARGS`` exits 2 naming FLAG, for each
    (ARGS, FLAG) of ``cases``, and writes nothing."""
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump({"name": "tiny_profile", "seeds": [0], "sweeps": [{
        "name": "digits", "config": "digits_vit", "overrides": RUN, "alphas": [0.5],
        "arms": [{"name": "frozen", "overrides": ["algorithm.name=fedfrozen",
                                                   "algorithm.train=all_but_qk"],
                  "warmup_rounds": [0, 3]},
                 {"name": "reference", "overrides": ["partition.num_clients=1"],
                  "reference": True}]}]}))
    for bad, flag in cases:
        code = linattn_main(["study", "--plan", str(path), "--out", str(tmp_path / "o"),
                             *(["--profile"] if profile else []), *bad])
        assert code == 2 and flag in capsys.readouterr().err, bad
        assert not (tmp_path / "o").exists()


# --- the min rule: Phi = the minimum of the validation loss over checkpoints every E steps

EVERY = 7  # checkpoints of a 30-step budget: 7, 14, 21, 28 and 30; of 60: 7 .. 56 and 60


def plain_min(curve) -> tuple[float, float, int]:
    """The minimum over a plain loop's ``(step, loss, acc)`` checkpoints, by hand: (loss, acc
    there, step), the earliest step on a tie."""
    best = None
    for step, loss, acc in curve:
        if best is None or loss < best[0]:
            best = (loss, acc, step)
    return best


def checkpoints(steps: int, every: int) -> tuple[int, ...]:
    return tuple(sorted(set(range(every, steps + 1, every)) | {steps}))


@pytest.mark.parametrize("optimizer,lr,schedule", [("sgd", None, "cosine"),
                                                   ("adam", 0.02, "constant")])
def test_min_rule_equals_a_plain_float64_loop(run64, optimizer, lr, schedule):
    """Phi under the min rule is the minimum of a plain torch loop's validation loss over the
    checkpoints every E steps and after the last (float64: to 1e-10), with the step, the
    accuracy there and the last step's loss and accuracy; the doubled budget the same over
    its own checkpoints (constant: the same training continued; cosine: one of its own). In
    both settings the validation loss turns up inside the budget, so the minimum is not the
    last step's loss."""
    setup = run_setup(run64)
    snap = run64 / "checkpoints" / "round_3.pt"
    cosine = schedule == "cosine"
    budget = Budget(STEPS, lr=lr, schedule=schedule, optimizer="adam" if lr else "run",
                    phi_rule="min", eval_every=EVERY)
    res = setup.phi(snap, budget)
    curve = plain_phi(run64, snap, STEPS, cosine, optimizer, lr,
                      read_at=checkpoints(STEPS, EVERY))
    phi, acc, at = plain_min(curve)
    assert [c[0] for c in curve] == [7, 14, 21, 28, 30]
    assert res["phi_rule"] == "min" and res["eval_every"] == EVERY
    assert res["phi"] == pytest.approx(phi, rel=1e-10, abs=1e-10)
    assert res["phi_step"] == at < STEPS  # the loss turns up: the minimum is inside
    assert res["val_acc"] == pytest.approx(acc, abs=1e-12)
    assert res["val_loss_last"] == pytest.approx(curve[-1][1], rel=1e-10, abs=1e-10)
    assert res["val_acc_last"] == pytest.approx(curve[-1][2], abs=1e-12)
    assert res["phi"] < res["val_loss_last"] - 1e-4
    assert [s for s, *_ in res["val_curve"]] == [7, 14, 21, 28, 30]
    for (s, loss, a), (s0, loss0, a0) in zip(res["val_curve"], curve, strict=True):
        assert s == s0 and loss == pytest.approx(loss0, rel=1e-10, abs=1e-10)
        assert a == pytest.approx(a0, abs=1e-12)
    # the check: the minimum over the doubled budget's own checkpoints (every 7 to 56, 60)
    curve2 = plain_phi(run64, snap, 2 * STEPS, cosine, optimizer, lr,
                       read_at=checkpoints(2 * STEPS, EVERY))
    phi2, acc2, at2 = plain_min(curve2)
    assert res["phi_doubled"] == pytest.approx(phi2, rel=1e-10, abs=1e-10)
    assert res["phi_step_doubled"] == at2
    assert res["val_acc_doubled"] == pytest.approx(acc2, abs=1e-12)
    assert res["val_loss_last_doubled"] == pytest.approx(curve2[-1][1], rel=1e-10, abs=1e-10)
    assert res["relative_change"] == pytest.approx(abs(phi2 - phi) / phi, rel=1e-8)
    assert res["converged"] == (res["relative_change"] < 0.01)
    # the doubled budget alone reads the same value: one definition of Phi at 2N
    alone = setup.phi(snap, dataclasses.replace(budget, steps=2 * STEPS, check=False))
    assert alone["phi"] == pytest.approx(res["phi_doubled"], rel=1e-12)
    assert alone["phi_step"] == res["phi_step_doubled"]
    # evaluating changes nothing in the training: the last step is the last rule's Phi, to
    # the bit (the rule the old records and caches hold)
    last = setup.phi(snap, dataclasses.replace(budget, phi_rule="last", eval_every=None))
    assert last["phi_rule"] == "last" and last["eval_every"] is None
    assert last["phi"] == res["val_loss_last"] and last["val_acc"] == res["val_acc_last"]
    assert last["phi_doubled"] == res["val_loss_last_doubled"]
    assert last["phi_step"] == STEPS and "val_curve" not in last


def test_stacked_kernels_track_the_minimum_each(run64):
    """phi_many: each kernel of a stack keeps its own minimum (its own step), equal to its
    plain loop's and to the kernel profiled alone."""
    setup = run_setup(run64)
    snap = run64 / "checkpoints" / "round_3.pt"
    own = torch.load(snap, weights_only=False)["global_params"]
    gen = torch.Generator().manual_seed(0)
    other = {n: 3.0 * own[n] + torch.randn(own[n].shape, generator=gen, dtype=own[n].dtype)
             for n in setup.qk_names}
    budget = Budget(STEPS, lr=0.02, optimizer="adam", phi_rule="min", eval_every=EVERY,
                    check=False)
    many = setup.phi_many([("snap", snap), ("other", other)], budget, stack=2)
    assert [r["stacked"] for r in many] == [2, 2]
    steps = []
    for rec, kernel in zip(many, ({n: own[n] for n in setup.qk_names}, other), strict=True):
        curve = plain_phi(run64, snap, STEPS, False, "adam", 0.02,
                          read_at=checkpoints(STEPS, EVERY), qk_tensors=kernel)
        phi, acc, at = plain_min(curve)
        assert rec["phi"] == pytest.approx(phi, rel=1e-10, abs=1e-10)
        assert rec["phi_step"] == at and rec["val_acc"] == pytest.approx(acc, abs=1e-12)
        alone = setup.phi(kernel, budget)
        assert alone["phi"] == pytest.approx(rec["phi"], rel=1e-10)
        assert alone["phi_step"] == rec["phi_step"]
        steps.append(at)
    assert steps[0] != steps[1]  # the two minima lie at different steps


def test_the_stacked_and_vmap_gradient_paths_agree(run64):
    """The two gradient paths of a kernel stack (kernel_grads) are one function: in float64
    their gradients agree to 1e-12 and a whole min-rule Phi with its check to 1e-10; a model
    the stacked forward mirrors takes the stacked path unless it trains with dropout."""
    from real_data.profile import _profile_many, grad_path, kernel_grads

    setup = run_setup(run64)
    model = setup.fed.model
    assert grad_path(model, dropout=False) == "stacked"
    assert grad_path(model, dropout=True) == "vmap"
    own = torch.load(run64 / "checkpoints" / "round_3.pt", weights_only=False)["global_params"]
    gen = torch.Generator().manual_seed(1)
    qk = {n: torch.stack([own[n], own[n] + torch.randn(own[n].shape, generator=gen,
                                                        dtype=own[n].dtype)])
          for n in setup.qk_names}
    rest = {n: torch.stack([p, p + 0.1 * torch.randn(p.shape, generator=gen, dtype=p.dtype)])
            for n, p in setup.init.items() if n not in setup.qk_names}
    ix = torch.as_tensor(setup.pooled[:16])
    xb, yb = setup.fed.x_train[ix], setup.fed.y_train[ix]
    a = kernel_grads(model, qk, "vmap")(rest, xb, yb)
    b = kernel_grads(model, qk, "stacked")(rest, xb, yb)
    assert set(a) == set(b) == set(rest)
    for n in a:
        assert a[n].dtype == torch.float64 and a[n].shape == rest[n].shape
        assert torch.allclose(a[n], b[n], rtol=1e-12, atol=1e-12), n
    snap = run64 / "checkpoints" / "round_3.pt"
    budget = Budget(STEPS, lr=0.02, optimizer="adam", phi_rule="min", eval_every=EVERY)
    kernels = [("a", snap), ("b", run64 / "checkpoints" / "round_0.pt")]
    via = {p: _profile_many(setup, kernels, budget, path=p) for p in ("vmap", "stacked")}
    for r, s in zip(via["vmap"], via["stacked"], strict=True):
        assert r["grad_path"] == "vmap" and s["grad_path"] == "stacked"
        for key in ("phi", "phi_doubled", "val_loss_last"):
            assert s[key] == pytest.approx(r[key], rel=1e-10, abs=1e-10), key
        assert s["phi_step"] == r["phi_step"] and s["val_acc"] == r["val_acc"]
    assert setup.phi(snap, budget)["grad_path"] == "stacked"  # the default for this ViT
    with pytest.raises(ConfigError, match="gradient path"):
        kernel_grads(model, qk, "loop")


@pytest.mark.parametrize("attention", ["softmax", "linear"])
def test_the_gradient_paths_agree_on_the_character_model(attention):
    """The character Transformer (causal attention, text targets): the stacked path's
    gradients equal the vmap path's in float64 (1e-12), for three kernels."""
    from real_data.models.char_transformer import CharTransformer, CharTransformerConfig
    from real_data.profile import grad_path, kernel_grads

    torch.manual_seed(0)
    model = CharTransformer(CharTransformerConfig(
        dim=8, depth=2, heads=2, mlp_dim=16, attention=attention, vocab_size=12,
        seq_len=6)).double()
    model.eval()
    assert grad_path(model, dropout=False) == "stacked"
    params = {n: p.detach() for n, p in model.named_parameters()}
    names = [n for n in params if ".attn.q." in n or ".attn.k." in n]
    gen = torch.Generator().manual_seed(2)

    def stack(p):
        return torch.stack([p + 0.1 * i * torch.randn(p.shape, generator=gen, dtype=p.dtype)
                            for i in range(3)])

    qk = {n: stack(params[n]) for n in names}
    own = {n: stack(p) for n, p in params.items() if n not in names}
    xb = torch.randint(0, 12, (5, 6), generator=gen)
    yb = torch.randint(0, 12, (5, 6), generator=gen)
    a = kernel_grads(model, qk, "vmap")(own, xb, yb)
    b = kernel_grads(model, qk, "stacked")(own, xb, yb)
    assert set(a) == set(b) == set(own)
    for n in a:
        assert torch.allclose(a[n], b[n], rtol=1e-12, atol=1e-12), n
        assert a[n].abs().max() > 0, n  # every parameter takes a gradient


def _count_steps(monkeypatch) -> list:
    """A list that grows by one at every gradient step a profile stack takes from now on."""
    import real_data.profile as prof

    steps: list = []
    real = prof.kernel_grads

    def counting(*a, **kw):
        f = real(*a, **kw)

        def g(*b):
            steps.append(1)
            return f(*b)
        return g

    monkeypatch.setattr(prof, "kernel_grads", counting)
    return steps


@pytest.mark.parametrize("schedule,halt", [("constant", 17), ("cosine", 2 * STEPS - 7)])
def test_a_killed_stack_resumes_to_the_records_of_an_uninterrupted_one(run64, tmp_path,
                                                                       schedule, halt,
                                                                       monkeypatch):
    """A stack saves its progress (the partial file) and a later call resumes it: halted
    mid-training (the constant budget's one training; the cosine's second, its first already
    finished), the resumed call takes only the steps left, its records equal the
    uninterrupted stack's to the bit, the partial file is gone, and a file of another stack
    is not resumed."""
    from real_data.profile import ProfileHalted, _profile_many, partial_file

    steps = _count_steps(monkeypatch)
    setup = run_setup(run64)
    kernels = [("a", run64 / "checkpoints" / "round_3.pt"),
               ("b", run64 / "checkpoints" / "round_0.pt")]
    budget = Budget(STEPS, lr=0.02, optimizer="adam", schedule=schedule, phi_rule="min",
                    eval_every=EVERY)
    whole = _profile_many(setup, kernels, budget)
    part = partial_file(tmp_path, kernels, budget)
    with pytest.raises(ProfileHalted):
        _profile_many(setup, kernels, budget, partial=part, halt_at=halt)
    saved = torch.load(part, weights_only=False)
    assert saved["current"]["step"] == halt
    assert list(saved["done"]) == ([STEPS] if schedule == "cosine" else [])
    other = partial_file(tmp_path, kernels[:1], budget)
    assert other != part
    part.rename(other)  # another stack's progress: not resumed, replaced
    alone = _profile_many(setup, kernels[:1], budget, partial=other)
    assert alone[0]["phi"] == pytest.approx(whole[0]["phi"], rel=1e-10)
    with pytest.raises(ProfileHalted):
        _profile_many(setup, kernels, budget, partial=part, halt_at=halt)
    steps.clear()
    resumed = _profile_many(setup, kernels, budget, partial=part, save_every=0.0)
    assert len(steps) == 2 * STEPS - halt  # the last training's steps from the saved one on
    assert not part.is_file() and not other.is_file()
    for a, b in zip(whole, resumed, strict=True):
        assert {k: v for k, v in a.items() if k != "seconds"} == \
            {k: v for k, v in b.items() if k != "seconds"}
        assert b["seconds"] > 0


def test_the_profile_command_keeps_its_progress_beside_its_json(run_dir, tmp_path,
                                                                monkeypatch):
    """`linattn profile --json OUT` gives each stack a progress file in OUT's folder (the
    resume itself: the test above) and leaves none behind once it ends."""
    import real_data.profile as prof

    seen = []
    real = prof._profile_many

    def spy(*a, **kw):
        seen.append(kw.get("partial"))
        return real(*a, **kw)

    monkeypatch.setattr(prof, "_profile_many", spy)
    out = tmp_path / "phi.json"
    args = ["profile", "--run", str(run_dir), "--rounds", "0,3", "--steps", "6",
            "--optimizer", "adam", "--json", str(out)]
    assert linattn_main(args) == 0
    assert seen and seen[0] is not None and seen[0].parent == tmp_path
    assert seen[0].name.startswith("partial_") and not list(tmp_path.glob("partial_*"))
    assert len(json.loads(out.read_text())["kernels"]) == 2


def test_the_training_precision_is_in_the_budget_its_key_and_the_record(run_dir, run64,
                                                                        tmp_path, capsys):
    """--precision: bf16 autocast trains the same Phi within bf16's round-off on a float32
    run (read in float32), TF32 changes nothing on the CPU, the budget's key names a
    precision other than fp32, and a float64 run or an unknown precision is refused (exit 2,
    nothing written)."""
    setup = run_setup(run_dir)
    snap = run_dir / "checkpoints" / "round_3.pt"
    base = dict(lr=0.02, optimizer="adam", phi_rule="min", eval_every=EVERY)
    fp32 = setup.phi(snap, Budget(STEPS, **base))
    bf16 = setup.phi(snap, Budget(STEPS, precision="bf16", **base))
    tf32 = setup.phi(snap, Budget(STEPS, precision="tf32", **base))
    assert fp32["precision"] == "fp32" and bf16["precision"] == "bf16"
    assert bf16["phi"] != fp32["phi"]  # the autocast did run
    # measured on this tiny run: 0.015% at N, 1.2% at 2N (bf16 keeps 8 bits of mantissa)
    assert bf16["phi"] == pytest.approx(fp32["phi"], rel=0.02)
    assert bf16["phi_doubled"] == pytest.approx(fp32["phi_doubled"], rel=0.02)
    assert tf32["phi"] == fp32["phi"] and tf32["phi_doubled"] == fp32["phi_doubled"]
    assert Budget(STEPS, **base).tag() == f"steps{STEPS}_lr0.02_adam_min{EVERY}"
    assert Budget(STEPS, precision="bf16", **base).tag().endswith("_adam_bf16_min7")
    with pytest.raises(ConfigError, match="trains in float64"):
        run_setup(run64).phi(snap, Budget(STEPS, precision="bf16", **base))
    out = tmp_path / "phi.json"
    for bad in (["--precision", "fp8"], ["--precision", "bf16"]):
        run = run64 if bad[1] == "bf16" else run_dir
        assert linattn_main(["profile", "--run", str(run), "--rounds", "3", "--steps", "5",
                             *bad, "--json", str(out)]) == 2
        assert "--precision" in capsys.readouterr().err and not out.exists()
    assert not list(tmp_path.iterdir())


def test_the_rule_and_cadence_are_in_the_budget_and_its_key():
    assert Budget().phi_rule == "last" and Budget().eval_every is None
    assert Budget(STEPS).tag() == f"steps{STEPS}"  # old caches keep their names
    assert Budget(4000, phi_rule="min").eval_every == DEFAULT_EVAL_EVERY == 250
    assert Budget(100, phi_rule="min").eval_every == 100  # a budget shorter than the cadence
    assert Budget(4000, phi_rule="min").tag() == "steps4000_min250"
    assert Budget(4000, phi_rule="min", eval_every=500).tag() == "steps4000_min500"
    assert Budget(8000, schedule="cosine", optimizer="adam", phi_rule="min").tag() == \
        "steps8000_cosine_adam_min250"
    assert Budget(4000, phi_rule="min").checkpoints(1000) == (250, 500, 750, 1000)
    assert Budget(30, phi_rule="min", eval_every=7).checkpoints(30) == (7, 14, 21, 28, 30)
    assert Budget(30).checkpoints(30) == (30,)
    for kwargs, flag in (({"phi_rule": "median"}, "--phi-rule"),
                         ({"phi_rule": "min", "eval_every": 0}, "--eval-every"),
                         ({"phi_rule": "min", "eval_every": -3}, "--eval-every"),
                         ({"phi_rule": "min", "eval_every": STEPS + 1}, "--eval-every"),
                         ({"phi_rule": "min", "eval_every": 2.5}, "--eval-every"),
                         ({"eval_every": 5}, "--eval-every")):
        with pytest.raises(ConfigError, match=flag):
            Budget(STEPS, **kwargs)


def test_bad_rule_inputs_exit_2_and_write_nothing(run_dir, tmp_path, capsys):
    out = tmp_path / "phi.json"

    def cli(*args):
        code = linattn_main(["profile", "--run", str(run_dir), "--rounds", "0,3", "--json",
                             str(out), "--steps", "20", *args])
        return code, capsys.readouterr().err

    for args, flag in ((["--eval-every", "0"], "--eval-every"),
                       (["--eval-every", "-5"], "--eval-every"),
                       (["--eval-every", "21"], "--eval-every"),  # above the 20-step budget
                       (["--phi-rule", "median"], "--phi-rule"),
                       (["--phi-rule", "last", "--eval-every", "5"], "--eval-every")):
        code, err = cli(*args)
        assert code == 2 and flag in err and not out.exists(), args
    # the command's default is the min rule every 250 steps, or every N below that
    assert cli("--steps", "6")[0] == 0
    data = json.loads(out.read_text())["kernels"]
    assert all(k["phi_rule"] == "min" and k["eval_every"] == 6 and k["phi_step"] == 6
               and k["val_curve"][0][0] == 6 for k in data)
    assert cli("--steps", "6", "--eval-every", "4")[0] == 0
    data = json.loads(out.read_text())["kernels"]
    assert all(k["eval_every"] == 4 and [c[0] for c in k["val_curve"]] == [4, 6] and
               [c[0] for c in k["val_curve_doubled"]] == [4, 8, 12] for k in data)
    assert cli("--steps", "6", "--phi-rule", "last")[0] == 0
    data = json.loads(out.read_text())["kernels"]
    assert all(k["phi_rule"] == "last" and k["eval_every"] is None for k in data)
    # linattn study --profile: checked before anything is written
    _study_refuses(tmp_path, capsys, [(["--profile-eval-every", "0"], "--profile-eval-every"),
                                      (["--profile-steps", "10", "--profile-eval-every", "11"],
                                       "--profile-eval-every"),
                                      (["--profile-phi-rule", "best"], "--profile-phi-rule"),
                                      (["--profile-split", "rows", "--shard", "0/2"],
                                       "--profile-split")])
    _study_refuses(tmp_path, capsys, [(["--profile-phi-rule", "min"], "--profile-phi-rule"),
                                      (["--profile-eval-every", "5"], "--profile-eval-every"),
                                      (["--profile-split", "kernels"], "--profile-split")],
                   profile=False)  # only with --profile


def test_study_caches_each_rule_apart_and_labels_old_records(tmp_path):
    """The profile cache's key holds the rule and cadence: a min-rule Phi is never read from a
    last-rule cache file or the other way round; a cached record written without a phi_rule
    field (before the rule was recorded) reads back labelled last; the tables name the rule."""
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(PLAN))
    plan = study.load_plan(path, tmp_path / "out")
    study.run_study(plan, log=lambda *_: None)
    last, best = Budget(12), Budget(12, phi_rule="min", eval_every=4)
    old = study.profile_plan(plan, last, log=lambda *_: None)
    files = sorted((plan.out_dir / "profiles").rglob("*.json"))
    assert files and all(f.name.endswith("__steps12.json") for f in files)
    for f in files:  # as an old cache holds them: no rule recorded
        rec = json.loads(f.read_text())
        for key in ("phi_rule", "eval_every", "phi_step", "val_loss_last", "val_acc_last",
                    "phi_step_doubled", "val_loss_last_doubled", "val_acc_last_doubled"):
            rec.pop(key)
        f.write_text(json.dumps(rec))
    back = study.profile_plan(plan, last, compute=False)
    assert [r["phi"] for r in back] == [r["phi"] for r in old]
    assert all(r["phi_rule"] == "last" for r in back)
    assert study.profile_plan(plan, best, compute=False) == []  # not read from the old files
    new = study.profile_plan(plan, best, log=lambda *_: None)
    assert len(new) == len(old) and all(r["phi_rule"] == "min" for r in new)
    assert len(list((plan.out_dir / "profiles").rglob("*__steps12_min4.json"))) == len(files)
    for a, b in zip(old, new, strict=True):  # the same trainings, read two ways
        assert b["phi"] <= b["val_loss_last"]
        assert b["val_loss_last"] == pytest.approx(a["phi"], rel=1e-6)  # stacked apart
    rows = study.bias_drift(new)
    assert rows and all(r["phi_rule"] == "min" and r["eval_every"] == 4 for r in rows)
    assert all(r["phi_rule"] == "last" for r in study.bias_drift(back))
    paths = study.write_kernel_profile(rows, tmp_path / "tables", best)
    meta = json.loads(paths[1].read_text())
    assert meta["budget"]["phi_rule"] == "min" and meta["budget"]["eval_every"] == 4
    assert "minimum of the validation loss over the budget, read every 4 steps" in \
        paths[2].read_text()
    assert meta["budget"]["precision"] == "fp32" and "arithmetic" not in paths[2].read_text()
    # the tables name the arithmetic a budget other than fp32 trains in (it moves Phi)
    paths = study.write_kernel_profile(rows, tmp_path / "bf16",
                                       dataclasses.replace(best, precision="bf16"))
    assert json.loads(paths[1].read_text())["budget"]["precision"] == "bf16"
    assert ", bf16 arithmetic." in paths[2].read_text()


@pytest.mark.parametrize("schedule", ["constant", "cosine"])
def test_a_budget_without_the_check_reads_the_same_phi_at_half_the_training(run_dir, tmp_path,
                                                                             schedule):
    """``check=False`` (--no-check) trains N steps, not 2N: Phi at N equals the checked
    budget's (the same training, to the bit on the CPU), the record gives no verdict, and the
    cache key says so."""
    setup = run_setup(run_dir)
    snap = run_dir / "checkpoints" / "round_3.pt"
    base = dict(lr=0.02, optimizer="adam", phi_rule="min", eval_every=EVERY, schedule=schedule)
    checked = setup.phi(snap, Budget(STEPS, **base))
    bare = setup.phi(snap, Budget(STEPS, check=False, **base))
    assert bare["phi"] == checked["phi"] and bare["phi_step"] == checked["phi_step"]
    assert bare["val_curve"] == checked["val_curve"]
    assert bare["check"] is False and checked["check"] is True
    assert bare["converged"] is None and bare["relative_change"] is None
    assert bare["phi_doubled"] is None and checked["converged"] is not None
    assert Budget(STEPS, check=False, **base).tag() == \
        Budget(STEPS, **base).tag() + "_nocheck"
    if schedule == "constant":  # the command's flag
        out = tmp_path / "phi.json"
        assert linattn_main(["profile", "--run", str(run_dir), "--rounds", "3", "--steps",
                             "6", "--eval-every", "3", "--no-check", "--json", str(out)]) == 0
        rec = json.loads(out.read_text())["kernels"][0]
        assert rec["check"] is False and rec["converged"] is None and rec["steps"] == 6


def test_study_without_the_check_reads_checked_records_and_counts_them_apart(tmp_path, capsys):
    """--profile-no-check: a kernel with a checked record of the same budget is read from it
    (nothing trains again); the others train without the check into files of their own; the
    tables count the unchecked seeds apart; the option needs --profile."""
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(PLAN))
    plan = study.load_plan(path, tmp_path / "out")
    study.run_study(plan, log=lambda *_: None)
    checked = Budget(12, phi_rule="min", eval_every=4)
    bare = dataclasses.replace(checked, check=False)
    first = study.profile_plan(plan, checked, log=lambda *_: None)
    files = sorted((plan.out_dir / "profiles").rglob("*.json"))
    assert len(files) == len(first) >= 4
    files[0].unlink()  # one kernel without a checked record
    lines = []
    second = study.profile_plan(plan, bare, log=lines.append)
    assert len(lines) == 1 and "(2N change" not in lines[0]  # only the missing kernel trained
    made = sorted((plan.out_dir / "profiles").rglob("*_nocheck.json"))
    assert [f.name for f in made] == [files[0].name.replace(".json", "_nocheck.json")]
    assert [r["phi"] for r in second] == [r["phi"] for r in first]
    rows = study.bias_drift(second)
    assert any(not r["checked"] for r in rows) and any(r["checked"] for r in rows)
    summary = summarize(rows)
    assert {(r["n_seeds"], r["n_checked"]) for r in summary} >= {(1, 0), (1, 1)}
    text = study.write_kernel_profile(rows, tmp_path / "tables", bare)[2].read_text()
    assert "(1 unchecked)" in text and "| 1/1 |" in text and "(no check run;" in text
    # the checked budget does not read the unchecked file: that kernel is missing there
    assert len(study.profile_plan(plan, checked, compute=False)) == len(first) - 1
    assert linattn_main(["study", "--plan", str(path), "--profile-no-check"]) == 2
    assert "--profile-no-check: only with --profile" in capsys.readouterr().err


def test_a_budget_without_the_check_resumes_a_checked_stacks_progress(run64, tmp_path,
                                                                      monkeypatch):
    """A checked stack halted within its first N steps is the same training as the unchecked
    budget's: the unchecked call resumes it (only the steps left
    to N), its records equal an uninterrupted unchecked stack's to the bit; progress past N
    is not taken; under the cosine the check's first training is the unchecked one."""
    from real_data.profile import ProfileHalted, _profile_many, partial_file

    steps = _count_steps(monkeypatch)
    setup = run_setup(run64)
    kernels = [("a", run64 / "checkpoints" / "round_3.pt"),
               ("b", run64 / "checkpoints" / "round_0.pt")]
    base = dict(lr=0.02, optimizer="adam", phi_rule="min", eval_every=EVERY)
    checked, bare = Budget(STEPS, **base), Budget(STEPS, check=False, **base)
    whole = _profile_many(setup, kernels, bare)
    with pytest.raises(ProfileHalted):
        _profile_many(setup, kernels, checked, partial=partial_file(tmp_path, kernels, checked),
                      halt_at=17)
    steps.clear()
    resumed = _profile_many(setup, kernels, bare, partial=partial_file(tmp_path, kernels, bare))
    assert len(steps) == STEPS - 17
    for a, b in zip(whole, resumed, strict=True):
        assert {k: v for k, v in a.items() if k != "seconds"} == \
            {k: v for k, v in b.items() if k != "seconds"}
    # past N the checked state is ahead of the unchecked budget's end: trained from the start
    with pytest.raises(ProfileHalted):
        _profile_many(setup, kernels, checked, partial=partial_file(tmp_path, kernels, checked),
                      halt_at=STEPS + 3)
    steps.clear()
    again = _profile_many(setup, kernels, bare, partial=partial_file(tmp_path, kernels, bare))
    assert len(steps) == STEPS and [r["phi"] for r in again] == [r["phi"] for r in whole]
    cosine = dict(base, schedule="cosine")
    checked_cos, bare_cos = Budget(STEPS, **cosine), Budget(STEPS, check=False, **cosine)
    whole_cos = _profile_many(setup, kernels, bare_cos)
    # the cosine's first training (over N) is the unchecked budget's one: stopped in it, or
    # finished and stopped in the check's own training, the checked progress is resumed
    for halt, left in ((17, STEPS - 17), (2 * STEPS - 7, 0)):
        with pytest.raises(ProfileHalted):
            _profile_many(setup, kernels, checked_cos, halt_at=halt,
                          partial=partial_file(tmp_path, kernels, checked_cos))
        steps.clear()
        got = _profile_many(setup, kernels, bare_cos,
                            partial=partial_file(tmp_path, kernels, bare_cos))
        assert len(steps) == left
        assert [r["val_curve"] for r in got] == [r["val_curve"] for r in whole_cos]


def _trend_rows(bias: dict[int, list[float]], drift: dict[int, list[float]],
                grid=(0, 10, 20, 30)) -> list[dict]:
    """bias_drift-shaped rows of one cell and reference, ``bias[seed]`` and ``drift[seed]``
    along ``grid``; Phi(M_T0) = 1 + bias + drift."""
    return [{"sweep": "s", "alpha": 0.1, "arm": "ff", "reference": "pooled", "seed": seed,
             "warmup_rounds": t, "bias": b, "drift": d, "phi_fed": 1.0 + b + d}
            for seed in bias for t, b, d in zip(grid, bias[seed], drift[seed], strict=True)]


def test_p1_trends_per_seed_and_their_intervals_over_seeds():
    # bias falls and drift rises on every seed: P1 as predicted
    bias = {0: [0.4, 0.3, 0.1, 0.0], 1: [0.5, 0.3, 0.2, 0.0], 2: [0.3, 0.2, 0.1, 0.0]}
    drift = {0: [0.0, 0.1, 0.2, 0.3], 1: [0.0, 0.05, 0.1, 0.2], 2: [0.0, 0.2, 0.2, 0.4]}
    got = {r["statistic"]: r for r in study.trends(_trend_rows(bias, drift))}
    b = got["bias_change"]
    assert b["early_t0"] == [0, 10] and b["late_t0"] == [20, 30] and b["seeds"] == [0, 1, 2]
    # late minus early per seed: 0.05 - 0.35, 0.1 - 0.4, 0.05 - 0.25
    assert np.allclose(b["per_seed"], [-0.3, -0.3, -0.2], atol=1e-12)
    vals = np.array([-0.3, -0.3, -0.2])
    half = stats.t.ppf(0.975, 2) * vals.std(ddof=1) / np.sqrt(3)
    assert b["mean"] == pytest.approx(vals.mean(), abs=1e-12)
    assert (b["low"], b["high"]) == pytest.approx((vals.mean() - half, vals.mean() + half),
                                                  abs=1e-12)
    assert b["verdict"] == "as P1 predicts" and b["p1_predicts"] == "< 0"
    assert got["rho_bias"]["per_seed"] == pytest.approx([-1.0, -1.0, -1.0])
    assert got["rho_bias"]["high"] <= 1.0 and got["rho_bias"]["low"] >= -1.0
    assert got["drift_mean"]["per_seed"] == pytest.approx([0.2, 0.35 / 3, 0.8 / 3])
    assert got["drift_mean"]["verdict"] == "as P1 predicts"
    assert got["rho_phi_fed"]["verdict"] == "no prediction"
    # the signs flipped: against P1
    flip = {r["statistic"]: r["verdict"] for r in study.trends(_trend_rows(
        {s: [-v for v in b_] for s, b_ in bias.items()},
        {s: [-v for v in d] for s, d in drift.items()}))}
    assert flip["bias_change"] == flip["drift_mean"] == flip["drift_change"] == "against P1"
    # seeds that disagree: the interval holds 0
    mixed = dict(bias)
    mixed[2] = [0.0, 0.1, 0.3, 0.6]
    assert {r["statistic"]: r["verdict"] for r in study.trends(
        _trend_rows(mixed, drift))}["bias_change"] == "not resolved"
    # one seed: a mean, no interval, nothing resolved
    one = {r["statistic"]: r for r in study.trends(_trend_rows({0: bias[0]}, {0: drift[0]}))}
    assert one["bias_change"]["low"] is None and one["bias_change"]["verdict"] == "not resolved"
    # a flat drift has no correlation; it counts no seed
    flat = {r["statistic"]: r for r in study.trends(
        _trend_rows(bias, {s: [0.0] * 4 for s in drift}))}
    assert flat["rho_drift"]["n"] == 0 and flat["rho_drift"]["verdict"] == "not resolved"
    # a seed whose Phi is not finite (a kernel that diverged) counts in no statistic of it
    broken = dict(bias)
    broken[2] = [0.3, float("nan"), 0.1, 0.0]
    got = {r["statistic"]: r for r in study.trends(_trend_rows(broken, drift))}
    assert got["bias_change"]["n"] == 2 and got["bias_change"]["per_seed"][2] is None
    assert got["rho_bias"]["n"] == 2 and got["drift_mean"]["n"] == 3  # its drift is finite
    # a seed with an extra T0 is read on the T0 every seed has: the same halves for all
    rows = _trend_rows(bias, drift) + [{"sweep": "s", "alpha": 0.1, "arm": "ff",
                                        "reference": "pooled", "seed": 0, "warmup_rounds": 40,
                                        "bias": -5.0, "drift": 5.0, "phi_fed": 1.0}]
    got = {r["statistic"]: r for r in study.trends(rows)}
    assert got["bias_change"]["late_t0"] == [20, 30] and not got["bias_change"]["same_grid"]
    assert got["bias_change"]["per_seed"] == pytest.approx([-0.3, -0.3, -0.2])
    with pytest.raises(ValueError, match="two rows of one T0"):
        study.trends(_trend_rows(bias, drift) + _trend_rows({0: bias[0]}, {0: drift[0]}))


def test_the_kernel_profile_tables_carry_the_trends(tmp_path):
    bias = {0: [0.4, 0.3, 0.1, 0.0], 1: [0.5, 0.3, 0.2, 0.0]}
    drift = {0: [0.0, 0.1, 0.2, 0.3], 1: [0.0, 0.05, 0.1, 0.2]}
    rows = [{**r, "phi_ref": 1.0 + r["bias"], "phi_best": 1.0, "converged": True,
             "checked": True, "rel_change_fed": 0.0, "rel_change_ref": 0.0,
             "rel_change_best": 0.0, "bias_2n": None, "drift_2n": None}
            for r in _trend_rows(bias, drift)]
    paths = study.write_kernel_profile(rows, tmp_path)
    meta = json.loads(paths[1].read_text())
    assert [r["statistic"] for r in meta["trends"]] == [n for n, *_ in TRENDS]
    text = paths[2].read_text()
    assert "P1 along T0" in text
    line = [ln for ln in text.splitlines() if "| bias_change |" in ln][0]
    assert "| 0,10 | 20,30 |" in line and "| -0.3000 -0.3000 |" in line
