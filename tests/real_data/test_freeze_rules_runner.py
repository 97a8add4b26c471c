"""FedFrozen with an online freeze rule (``algorithm.warmup=<rule>``) on the tiny digits ViT:
the rule's firing round is T0 (the stage switches after it), its signal is in metrics.csv and
its decision in summary.json; a killed run resumes to byte-identical metrics; a stacked group
equals the runs trained alone; bad rules and missing inputs exit 2 naming the key."""

import json

import pytest
import torch
from conftest import (
    TINY,
    assert_group_equals_alone,
    assert_rows_agree,
    assert_run_refused,
    metric_rows,
    tiny_config,
)
from pause_run import kill_when_paused
from pause_run import start as start_paused

from linattn.cli import main as linattn_main
from real_data.models.layers import attention_scores
from real_data.runs import load_data, prepare_start, start_run

RULES = ["perturbation", "norm_change", "norm_change_median", "kernel_stability", "plateau",
         "fraction=0.5"]
BASE = ["train.rounds=14", "partition.num_clients=4", "algorithm.name=fedfrozen",
        "algorithm.warmup_rounds=null", "partition.validation_fraction=0.2",
        "run.checkpoint_every=1"]


def _stages(path):
    rows = metric_rows(path)
    return {int(k[0]): k[3] for k in rows if k[1] == "global" and k[2] == "train_loss"}


@pytest.mark.parametrize("rule", RULES)
def test_rule_decides_t0(tmp_path, rule):
    run = tmp_path / "run"
    result = start_run(tiny_config(*BASE, f"algorithm.warmup={rule}"), out=run)
    assert result.status == "completed"
    warm = json.loads((run / "summary.json").read_text())["warmup"]
    assert warm["rule"] == rule and warm["rule_seconds"] >= 0
    t0 = warm["warmup_rounds"]
    stages = _stages(run / "metrics.csv")
    assert stages == {r: ("warmup" if r <= t0 else "frozen") for r in range(1, 15)}
    fired = {int(k[0]): v for k, v in metric_rows(run / "metrics.csv").items()
             if k[2] == "freeze_rule_fired"}
    if warm["fired_at"] == "never":
        assert t0 == 14 and not any(fired.values())
    else:
        assert t0 == warm["fired_at"] and fired[t0] == 1.0
        assert all(v == 0.0 for r, v in fired.items() if r != t0)
        assert max(fired) == t0  # a fired rule observes no more
    if rule == "fraction=0.5":
        assert t0 == 7


def test_norm_change_fires_and_freezes(tmp_path):
    """On this run norm_change fires early (its first comparable interval): the stage after
    it is frozen, and Q/K stay at their round-T0 values to the end."""
    run = tmp_path / "run"
    start_run(tiny_config(*BASE, "algorithm.warmup=norm_change"), out=run,
              snapshot_rounds=tuple(range(1, 15)))
    t0 = json.loads((run / "summary.json").read_text())["warmup"]["fired_at"]
    assert isinstance(t0, int) and 2 <= t0 < 14
    assert json.loads((run / "summary.json").read_text())["warmup"]["warmup_rounds"] == t0
    last = torch.load(run / "checkpoints" / "last.pt", weights_only=False)
    at_t0 = torch.load(run / "checkpoints" / f"round_{t0}.pt", weights_only=False)
    for name, value in last["global_params"].items():
        if ".attn.q." in name or ".attn.k." in name:
            assert torch.equal(value, at_t0["global_params"][name]), name


def test_killed_rule_run_resumes_to_identical_metrics(tmp_path):
    over = [*TINY, *BASE, "algorithm.warmup=perturbation"]
    killed, marker = tmp_path / "killed", tmp_path / "paused"
    proc = start_paused(6, marker, killed, *over)
    kill_when_paused(proc, marker, "the run never reached round 6")
    assert linattn_main(["run", "--resume", str(killed)]) == 0
    whole = tmp_path / "whole"
    assert linattn_main(["run", "--config", "digits_vit", *over, "--out", str(whole)]) == 0
    assert (killed / "metrics.csv").read_bytes() == (whole / "metrics.csv").read_bytes()
    assert (json.loads((killed / "summary.json").read_text())["warmup"]["fired_at"]
            == json.loads((whole / "summary.json").read_text())["warmup"]["fired_at"])


def test_stacked_rule_runs_equal_runs_alone(tmp_path):
    cfgs = {r: tiny_config(*BASE, f"algorithm.warmup={r}", "train.rounds=10")
            for r in ("perturbation", "plateau", "kernel_stability")}
    assert_group_equals_alone(tmp_path, cfgs)


def test_attention_scores_order_keys_like_the_attention(tmp_path):
    cfg = tiny_config(*BASE, "algorithm.warmup=kernel_stability", "model.depth=2")
    fed = prepare_start(cfg, out=tmp_path / "r", dataset=load_data(cfg)).fed
    params = {n: p.detach() for n, p in fed.model.named_parameters()}
    x = fed.x_val[:5]
    scores = attention_scores(fed.model, params, x)
    n = scores.shape[1]
    heads, depth = fed.model.cfg.heads, 2
    assert scores.shape == (depth * 5 * heads * n, n)
    # the first layer's rows recomputed by hand from the model's own modules
    blk = fed.model.blocks[0]
    captured = {}
    h = blk.register_forward_pre_hook(lambda m, a: captured.setdefault("x", a[0]))
    with torch.no_grad():
        fed.model(x)
    h.remove()
    y = blk.norm1(captured["x"])
    b, n_tok, d = y.shape
    q = blk.attn.q(y).view(b, n_tok, heads, d // heads).transpose(1, 2)
    k = blk.attn.k(y).view(b, n_tok, heads, d // heads).transpose(1, 2)
    ref = (q @ k.transpose(-2, -1) / (d // heads) ** 0.5).reshape(-1, n_tok)
    torch.testing.assert_close(scores[:len(ref)], ref, rtol=1e-5, atol=1e-6)


def test_attention_probe_gives_float32_rows_under_bf16_autocast(tmp_path):
    """On a GPU the federation evaluates under bf16 autocast; the rows kernel_stability reads
    stay float32 (numpy has no bfloat16), equal to the fp32 rows to bf16's precision."""
    cfg = tiny_config(*BASE, "algorithm.warmup=kernel_stability", "model.depth=2")
    prep = prepare_start(cfg, out=tmp_path / "r", dataset=load_data(cfg))
    fed, state = prep.fed, prep.state
    plain = fed._attention_probe(state)
    fed.autocast = torch.bfloat16  # as train.precision=bf16 sets it on CUDA
    rows = fed._attention_probe(state)
    assert rows.dtype == torch.float32 and rows.cpu().numpy().dtype.name == "float32"
    torch.testing.assert_close(rows, plain, rtol=0.05, atol=0.05)
    assert not torch.equal(rows, plain)  # the projections did run in bf16


@pytest.mark.parametrize("override, text", [
    (["algorithm.warmup=freeze_soon"], "algorithm.warmup='freeze_soon'"),
    (["algorithm.warmup=fraction=1.5"], "algorithm.warmup='fraction=1.5'"),
    (["algorithm.warmup=plateau", "partition.validation_fraction=0"],
     "partition.validation_fraction"),
    (["algorithm.warmup=kernel_stability", "algorithm.probe_batch=4000"],
     "algorithm.probe_batch=4000"),
])
def test_bad_rules_exit_2_and_write_nothing(tmp_path, capsys, override, text):
    assert_run_refused(tmp_path, capsys, [*TINY, *BASE, *override], text)


def test_a_rule_reading_attention_rows_on_a_model_without_attention_exits_2(
        tmp_path, capsys, monkeypatch):
    """kernel_stability reads attention rows: on a model with no attention layer (here the
    ViT's module listing leaves its attention layers out) the run stops before writing
    anything."""
    from real_data.models.layers import Attention
    from real_data.models.vit import ViT

    listed = ViT.modules
    monkeypatch.setattr(ViT, "modules", lambda self: (
        m for m in listed(self) if not isinstance(m, Attention)))
    assert_run_refused(tmp_path, capsys, [*TINY, *BASE, "algorithm.warmup=kernel_stability"],
                       "has no attention layers")


def test_the_default_warmup_is_a_given_t0_else_the_probe_estimator(tmp_path, capsys):
    """``algorithm.warmup`` unset: ``fixed`` where ``warmup_rounds`` is given, else ``auto``
    (the lowest-regret choice); without a validation split that default exits 2 naming both
    ways out, and writes nothing."""
    from real_data.algorithms import FedFrozenParams
    from real_data.algorithms.fedfrozen import DEFAULT_RULE

    assert DEFAULT_RULE == "auto"
    assert FedFrozenParams().warmup == "auto"
    assert FedFrozenParams(warmup_rounds=7).warmup == "fixed"
    assert FedFrozenParams(warmup="plateau").warmup == "plateau"
    assert tiny_config(*BASE).algorithm.params.warmup == "auto"
    assert tiny_config(*BASE, "algorithm.warmup_rounds=3").algorithm.params.warmup == "fixed"
    assert_run_refused(tmp_path, capsys, [*TINY, *BASE, "partition.validation_fraction=null"],
                       "or give algorithm.warmup_rounds")


def test_a_run_whose_round_observation_breaks_leaves_the_group_and_the_others_finish(
        tmp_path, monkeypatch):
    """A freeze rule that raises while observing a round (here kernel_stability's attention
    probe) takes only its own run out of a stacked group: the group's other runs finish with
    the metrics they have alone (within the stacked tolerance), the broken run is reported by
    its label and its run directory's lock is released at once."""
    from real_data.federation import Federation
    from real_data.lock import holder
    from real_data.stacked_runs import RunRequest, run_group

    cfgs = {r: tiny_config(*BASE, f"algorithm.warmup={r}", "train.rounds=6")
            for r in ("perturbation", "kernel_stability", "plateau")}
    for name in ("perturbation", "plateau"):
        start_run(cfgs[name], out=tmp_path / "alone" / name)

    def broken(self, state):
        raise TypeError("Got unsupported ScalarType BFloat16")
    monkeypatch.setattr(Federation, "_attention_probe", broken)
    errors, held = [], []
    broken_dir = tmp_path / "group" / "kernel_stability"

    def round_end(rnd, run_dir):  # while the others train on, the broken run's lock is free
        if errors:
            held.append(holder(broken_dir))
    done = run_group([RunRequest(tmp_path / "group" / n, c, label=n) for n, c in cfgs.items()],
                     dataset=load_data(cfgs["plateau"]), log=lambda s: None,
                     on_round_end=round_end,
                     on_error=lambda label, exc: errors.append((label, type(exc).__name__)))
    assert errors == [("kernel_stability", "TypeError")]
    assert held and set(held) == {None}
    assert sorted(label for label, r in done if r.status == "completed") == ["perturbation",
                                                                             "plateau"]
    for name in ("perturbation", "plateau"):
        assert_rows_agree(tmp_path / "alone" / name / "metrics.csv",
                          tmp_path / "group" / name / "metrics.csv")
