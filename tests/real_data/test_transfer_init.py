"""train.init_from: the same transfer initialization as FedSQ's, for every algorithm."""

from __future__ import annotations

import pytest
import torch
from conftest import federation, pretrain_target, pretrained_file, random_partition, tiny_config

from linattn.errors import ConfigError, UserError
from real_data.models import names_of_kind
from real_data.pretrain import load_pretrained


@pytest.mark.parametrize("algo", ["fedavg", "fedfrozen", "fedsq"])
def test_every_algorithm_starts_where_fedsq_starts(tmp_path, digits64, algo):
    path, _ = pretrained_file(tmp_path, digits64)
    data = pretrain_target(digits64)
    part = random_partition(data, 4, seed=0, alpha=0.5)
    common = ("model.activation=relu", "train.precision=fp64", "train.rounds=3")
    if algo == "fedsq":
        cfg = tiny_config("algorithm.name=fedsq", f"algorithm.pretrained={path}", *common)
    else:
        cfg = tiny_config(f"algorithm.name={algo}", "algorithm.warmup_rounds=1"
                          if algo == "fedfrozen" else "algorithm.name=fedavg",
                          f"train.init_from={path}", *common)
    fed = federation(cfg, data, part)
    loaded, _ = load_pretrained(path)
    fresh = dict(fed.model.named_parameters())
    head = set(names_of_kind(fed.groups, "head"))
    for n, p in fed.initial_state().global_params.items():
        # the pretrained parameters everywhere but the head, which keeps its fresh init
        assert torch.equal(p, fresh[n] if n in head else loaded[n].to(p.dtype)), n


def test_mismatches_name_the_key(tmp_path, digits64):
    path, _ = pretrained_file(tmp_path, digits64, activation="relu")
    data = pretrain_target(digits64)
    part = random_partition(data, 2, seed=0)
    fed = federation(tiny_config("algorithm.name=fedavg", f"train.init_from={path}",
                                 "model.activation=gelu"), data, part)
    with pytest.raises(UserError, match="train.init_from=.*model.activation"):
        fed.initial_state()
    with pytest.raises(UserError, match="pretrained model .* not found"):
        federation(tiny_config("algorithm.name=fedavg", "train.init_from=/nonexistent.pt"),
                   data, part).initial_state()
    with pytest.raises(ConfigError, match="train.init_from and algorithm.pretrained"):
        federation(tiny_config("algorithm.name=fedsq", f"algorithm.pretrained={path}",
                               f"train.init_from={path}", "model.activation=relu"), data, part)


def test_resume_does_not_need_the_pretrained_file(tmp_path, digits64):
    import shutil

    from real_data.runs import resume_run, start_run

    path, _ = pretrained_file(tmp_path, digits64)
    moved = tmp_path / "moved.pt"
    cfg = tiny_config("algorithm.name=fedavg", f"train.init_from={moved}",
                      "model.activation=relu", "train.rounds=2", "partition.num_clients=3")
    shutil.copy(path, moved)
    res = start_run(cfg, out=tmp_path / "run")
    (res.run_dir / "summary.json").unlink()  # as if killed after its last checkpoint
    moved.unlink()
    assert resume_run(res.run_dir).status == "completed"
