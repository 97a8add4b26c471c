"""Configs: YAML + dotted overrides, type checks, errors that name the key."""

from __future__ import annotations

import pytest

from linattn.errors import ConfigError
from real_data.config import (
    CONFIG_DIR,
    apply_overrides,
    config_from_dict,
    config_to_dict,
    load_config,
    parse_overrides,
)

SHIPPED = ["digits_vit", "fmnist_vit", "mnist_vit", "cifar10_vit", "shakespeare_transformer"]


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_configs_load_and_round_trip(name):
    assert (CONFIG_DIR / f"{name}.yaml").is_file()
    cfg = load_config(name)
    assert config_from_dict(config_to_dict(cfg)) == cfg


def test_overrides_are_typed_yaml_values():
    cfg = load_config("digits_vit", ["train.lr=0.5", "train.clip_grad_norm=null",
                                     "model.attention=linear", "eval.clients=false"])
    assert cfg.train.lr == 0.5 and cfg.train.clip_grad_norm is None
    assert cfg.model.params.attention == "linear" and cfg.eval.clients is False
    assert isinstance(load_config("digits_vit", ["train.lr=1"]).train.lr, float)


def test_switching_algorithm_drops_the_old_algorithm_keys():
    cfg = load_config("digits_vit", ["algorithm.name=fedprox", "algorithm.mu=0.1"])
    assert cfg.algorithm.name == "fedprox" and cfg.algorithm.params.mu == 0.1


@pytest.mark.parametrize("override, key", [
    ("train.lrr=0.1", "train.lrr"),
    ("partition.alpha=0", "partition.alpha"),
    ("partition.alpha=-1", "partition.alpha"),
    ("train.rounds=abc", "train.rounds"),
    ("train.rounds=2.5", "train.rounds"),
    ("train.optimizer=rmsprop", "train.optimizer"),
    ("eval.clients=1", "eval.clients"),
    ("model.attention=cosine", "model.attention"),
    ("model.depthh=2", "model.depthh"),
    ("algorithm.train=q", "algorithm.train"),
    ("algorithm.name=fedsgd", "algorithm.name"),
    ("model.name=resnet", "model.name"),
    ("train.clients_per_round=11", "train.clients_per_round"),
    ("train.local_epochs=1", "train.local_steps"),
    ("algorithm.warmup_rounds=-1", "algorithm.warmup_rounds"),
    ("bogus=1", "bogus"),
])
def test_bad_values_name_the_key(override, key):
    with pytest.raises(ConfigError) as err:
        load_config("digits_vit", [override])
    assert key in str(err.value)


def test_error_lists_allowed_values():
    with pytest.raises(ConfigError, match="'sgd', 'adam'"):
        load_config("digits_vit", ["train.optimizer=rmsprop"])
    with pytest.raises(ConfigError, match="valid keys in train: .*batch_size"):
        load_config("digits_vit", ["train.lrr=0.1"])


def test_override_syntax_errors():
    with pytest.raises(ConfigError, match="key=value"):
        parse_overrides(["train.lr"])
    with pytest.raises(ConfigError, match="not a section"):
        apply_overrides({"train": 3}, {"train.lr": 0.1})


def test_unknown_config_name_lists_shipped():
    with pytest.raises(ConfigError, match="digits_vit"):
        load_config("no_such_config")


def test_role_seeds_are_distinct_and_fixed_by_seed():
    cfg = load_config("digits_vit", ["seed=3"])
    seeds = [cfg.role_seed(r) for r in ("partition", "sampling", "training")]
    assert len(set(seeds)) == 3
    assert seeds == [load_config("digits_vit", ["seed=3"]).role_seed(r)
                     for r in ("partition", "sampling", "training")]
    assert load_config("digits_vit", ["seeds.training=5"]).role_seed("training") == 5
