"""FedFrozen's equal-size control: freezing V and the attention output instead of Q/K."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import federation, random_partition, tiny_config

from linattn.errors import ConfigError
from real_data.models import names_of_kind


def test_control_freezes_as_many_parameters_elsewhere(digits):
    t0, rounds = 2, 4
    part = random_partition(digits, 4, seed=3, alpha=0.5)
    cfg = tiny_config("algorithm.name=fedfrozen", f"algorithm.warmup_rounds={t0}",
                      "algorithm.freeze=v_attn_out", "train.clients_per_round=2")
    fed = federation(cfg, digits, part)
    qk = names_of_kind(fed.groups, "qk")
    control = names_of_kind(fed.groups, "v", "attn_out")
    shapes = fed.algorithm.ctx.shapes
    size = {k: sum(int(np.prod(shapes[n])) for n in names)
            for k, names in (("qk", qk), ("control", control))}
    assert size["qk"] == size["control"] > 0  # the same number of frozen parameters
    state = fed.initial_state()
    for rnd in range(1, rounds + 1):
        state, records = fed.run_round(state, rnd)
        if rnd == t0:
            at_t0 = {n: v.clone() for n, v in state.global_params.items()}
        stage = {k: v for r, c, k, v in records if c == "global"}
    for n in control:  # frozen: bit-identical to round T0
        assert torch.equal(state.global_params[n], at_t0[n]), n
    # Q/K keep training after T0
    assert any(not torch.equal(state.global_params[n], at_t0[n]) for n in qk)
    assert stage["qk_change"] > 0
    assert "freeze_v_attn_out" in fed.algorithm.tag()


def test_control_needs_a_trainable_rest(digits):
    with pytest.raises(ConfigError, match="algorithm.freeze=v_attn_out"):
        tiny_config("algorithm.name=fedfrozen", "algorithm.warmup_rounds=1",
                    "algorithm.freeze=v_attn_out", "algorithm.train=v")
