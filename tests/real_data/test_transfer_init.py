"""train.init_from: the same transfer initialization as FedSQ's, for every algorithm."""

from __future__ import annotations

import pytest
import torch
from conftest import federation, random_partition, tiny_config

from linattn.errors import ConfigError, UserError
from real_data.data.base import TensorDataset
from real_data.models import build_model, complete_model_config, names_of_kind
from real_data.pretrain import (
    PretrainSettings,
    load_pretrained,
    pretrain_model,
    save_pretrained,
)

TARGET = 1000  # the federation uses digits samples 0..999, the pretraining the rest


def pretrained_file(tmp_path, dataset, activation="relu"):
    cfg = tiny_config("algorithm.name=fedavg", f"model.activation={activation}")
    mcfg = complete_model_config("vit", cfg.model.params, dataset.input_shape, 10)
    model = build_model("vit", mcfg, 5, dataset.x_train.dtype)
    res = pretrain_model(model, dataset, PretrainSettings("digits", skip=TARGET, epochs=1,
                                                          batch_size=32, lr=1e-2),
                         torch.device("cpu"))
    path = tmp_path / "pretrained.pt"
    save_pretrained(path, res, {"source": "digits", "model_config": {"activation": activation}})
    return path


def target(dataset):
    return TensorDataset(dataset.name, dataset.task, dataset.x_train[:TARGET],
                         dataset.y_train[:TARGET], dataset.x_test, dataset.y_test, 10)


@pytest.mark.parametrize("algo", ["fedavg", "fedfrozen", "fedsq"])
def test_every_algorithm_starts_where_fedsq_starts(tmp_path, digits64, algo):
    path = pretrained_file(tmp_path, digits64)
    data = target(digits64)
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
    path = pretrained_file(tmp_path, digits64, activation="relu")
    data = target(digits64)
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

    path = pretrained_file(tmp_path, digits64)
    moved = tmp_path / "moved.pt"
    cfg = tiny_config("algorithm.name=fedavg", f"train.init_from={moved}",
                      "model.activation=relu", "train.rounds=2", "partition.num_clients=3")
    shutil.copy(path, moved)
    res = start_run(cfg, out=tmp_path / "run")
    (res.run_dir / "summary.json").unlink()  # as if killed after its last checkpoint
    moved.unlink()
    assert resume_run(res.run_dir).status == "completed"
