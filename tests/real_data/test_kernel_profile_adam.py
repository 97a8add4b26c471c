"""The kernel profile's Adam budget (``Budget.optimizer="adam"``, ``linattn profile
--optimizer adam``): Phi equals a plain torch loop with ``torch.optim.Adam`` in float64, and the
default budget (``"run"``: the run's own optimizer) is the one it always was."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml

from linattn.cli import main as linattn_main
from linattn.errors import ConfigError
from real_data.profile import ADAM_LR, PROFILE_STREAM, Budget, run_setup

# a tiny float64 run that holds out a validation split, with weight decay and clipping (both
# apply to Adam's budget too)
RUN = ["model.dim=8", "model.mlp_dim=16", "model.depth=1", "model.heads=2",
       "train.batch_size=8", "train.local_steps=3", "run.progress=false", "run.plot=false",
       "eval.clients=false", "partition.validation_fraction=0.2", "train.optimizer=sgd",
       "train.lr=0.2", "train.momentum=0.5", "train.weight_decay=0.0001",
       "train.clip_grad_norm=1.0", "algorithm.name=fedavg", "train.rounds=3",
       "train.device=cpu", "train.precision=fp64"]
STEPS = 30


@pytest.fixture(scope="module")
def run64(tmp_path_factory):
    from real_data.config import load_config
    from real_data.runs import start_run

    out = tmp_path_factory.mktemp("profile_adam") / "run"
    start_run(load_config("digits_vit", RUN), out=out, snapshot_rounds=(0, 3))
    return out


def plain_phi(run_dir, snapshot, steps: int, optimizer: str, lr: float,
              cosine: bool = False) -> tuple[float, float]:
    """Phi by hand in float64: the run's initial model, Q/K from the snapshot and frozen,
    ``torch.optim.Adam`` (or the run's SGD) with the run's weight decay and
    ``clip_grad_norm_`` on the pooled training samples in the documented order (``cosine``:
    step t at lr (1 + cos(pi t / steps)) / 2), the validation loss and accuracy at the end."""
    from linattn.configio import load_yaml
    from real_data.config import config_from_dict
    from real_data.data import load_partition
    from real_data.models import build_model, names_of_kind
    from real_data.runs import load_data

    cfg = config_from_dict(load_yaml(run_dir / "config.yaml"))
    data = load_data(cfg)
    part = load_partition(run_dir / "partition.npz")
    model = build_model("vit", cfg.model.params, cfg.role_seed("training"), torch.float64)
    qk = set(names_of_kind(model.param_groups(), "qk"))
    snap = torch.load(snapshot, weights_only=False)["global_params"]
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n in qk:
                p.copy_(snap[n])
                p.requires_grad_(False)
    rest = [p for n, p in model.named_parameters() if n not in qk]
    t = cfg.train
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
    x, y = data.x_train.double(), data.y_train
    for step, b in enumerate(batches[:steps]):
        if cosine:
            opt.param_groups[0]["lr"] = lr * 0.5 * (1 + math.cos(math.pi * step / steps))
        ix = torch.as_tensor(pooled[b])
        loss = F.cross_entropy(model(x[ix]), y[ix])
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(rest, t.clip_grad_norm)
        opt.step()
    with torch.no_grad():
        val = torch.as_tensor(part.val_pooled)
        logits = model(x[val])
        return (float(F.cross_entropy(logits, y[val])),
                float((logits.argmax(1) == y[val]).double().mean()))


@pytest.mark.parametrize("schedule", ["constant", "cosine"])
def test_adam_phi_equals_a_plain_torch_adam_loop(run64, schedule):
    setup = run_setup(run64)
    assert setup.fed.dtype == torch.float64
    snap = run64 / "checkpoints" / "round_3.pt"
    cosine = schedule == "cosine"
    res = setup.phi(snap, Budget(STEPS, schedule=schedule, optimizer="adam"))
    phi, acc = plain_phi(run64, snap, STEPS, "adam", ADAM_LR, cosine=cosine)
    assert res["phi"] == pytest.approx(phi, rel=1e-10, abs=1e-10)
    assert res["val_acc"] == pytest.approx(acc, abs=1e-12)
    assert res["optimizer"] == "adam" and res["lr"] == ADAM_LR == 1e-3
    assert res["momentum"] == 0.0 and res["weight_decay"] == 0.0001
    assert res["betas"] == [0.9, 0.999] and res["eps"] == 1e-8
    assert res["clip_grad_norm"] == 1.0 and res["schedule"] == schedule
    # the check: the same training continued (constant) or a cosine over 2N of its own
    phi2, acc2 = plain_phi(run64, snap, 2 * STEPS, "adam", ADAM_LR, cosine=cosine)
    assert res["phi_doubled"] == pytest.approx(phi2, rel=1e-10, abs=1e-10)
    assert res["val_acc_doubled"] == pytest.approx(acc2, abs=1e-12)
    assert res["relative_change"] == pytest.approx(abs(phi2 - phi) / phi, rel=1e-8)
    # a step size of its own; Adam's Phi is not SGD's
    other = setup.phi(snap, Budget(STEPS, lr=0.01, check=False, schedule=schedule,
                                   optimizer="adam"))
    assert other["lr"] == 0.01
    assert other["phi"] == pytest.approx(
        plain_phi(run64, snap, STEPS, "adam", 0.01, cosine=cosine)[0], rel=1e-10, abs=1e-10)
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
    phi, acc = plain_phi(run64, snap, STEPS, "sgd", 0.2)
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
    plan = {"name": "tiny_adam", "seeds": [0], "sweeps": [{
        "name": "digits", "config": "digits_vit", "overrides": RUN[:-1], "alphas": [0.5],
        "arms": [{"name": "frozen", "overrides": ["algorithm.name=fedfrozen",
                                                   "algorithm.train=all_but_qk"],
                  "warmup_rounds": [0, 3]},
                 {"name": "reference", "overrides": ["partition.num_clients=1"],
                  "reference": True}]}]}
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(plan))
    for bad, flag in ((["--profile-optimizer", "sgdm"], "--profile-optimizer"),
                      (["--profile-optimizer", "adam", "--profile-lr", "0"], "--profile-lr")):
        code = linattn_main(["study", "--plan", str(path), "--out", str(tmp_path / "o"),
                             "--profile", *bad])
        assert code == 2 and flag in capsys.readouterr().err
        assert not (tmp_path / "o").exists()
