"""FedFrozen on top of FedProx and SCAFFOLD (``algorithm.base``).

1. Against a plain per-client loop in float64 (plain SGD; ``conftest.plain_loop``): each client
   of round t starts from x and takes K steps y <- y - eta (g_m(y) + mu (y - x) + c - c_m) on
   the parameters that train (every parameter for t <= T0, all but Q/K after); FedProx is mu > 0
   without control variates, SCAFFOLD mu = 0 with option II, c_m+ = c_m - c + (x - y) / (K eta)
   and c <- c + (1/N) sum Delta c_m on the trained parameters only, x <- x + eta_g sum p_m (y_m
   - x). The global model and both control variates within 1e-9 after every round, whatever
   engine, with the frozen block and its control variates unchanged after T0.
2. T0 = T is the base algorithm itself: the same global model and variates as a FedProx or
   SCAFFOLD run, to round-off.
3. In a stacked group each run writes the metrics it writes alone (within 1e-6, float64).
4. A bad ``base``, ``mu`` or ``server_lr`` exits 2 naming the key.
"""

from __future__ import annotations

import pytest
import torch
from conftest import (
    KEY_BIAS_METRICS,
    assert_group_equals_alone,
    federation,
    max_abs_error,
    plain_loop,
    random_partition,
    run_cli,
    tiny_config,
)

from real_data.models.groups import names_of_kind

ROUNDS, T0 = 4, 2


COMMON = ["train.precision=fp64", f"train.rounds={ROUNDS}", "eval.every=100",
          "eval.clients=false", "train.optimizer=sgd", "train.lr=0.3", "train.momentum=0",
          "train.clip_grad_norm=null", "train.clients_per_round=3"]
BASES = {
    "fedprox": (["algorithm.base=fedprox", "algorithm.mu=0.5"], 0.5, False),
    "scaffold": (["algorithm.base=scaffold"], 0.0, True),
    "scaffold_lrg": (["algorithm.base=scaffold", "algorithm.server_lr=0.5"], 0.0, True),
}


@pytest.mark.parametrize("engine", ["sequential", "vectorized"])
@pytest.mark.parametrize("base", list(BASES))
def test_matches_a_plain_loop(digits64, base, engine):
    """Measured: at most 4.4e-16 (float64) on both engines."""
    over, mu, scaffold = BASES[base]
    part = random_partition(digits64, 5, seed=7, alpha=0.5)
    cfg = tiny_config("algorithm.name=fedfrozen", f"algorithm.warmup_rounds={T0}",
                      f"train.engine={engine}", *COMMON, *over)
    fed = federation(cfg, digits64, part)
    ref = plain_loop(fed, part, ROUNDS, scaffold=scaffold, mu=mu,
                     frozen=names_of_kind(fed.algorithm.ctx.groups, "qk"), t0=T0)
    qk = names_of_kind(fed.algorithm.ctx.groups, "qk")
    state = fed.initial_state()
    errors, qk_at_t0 = [], None
    for rnd in range(1, ROUNDS + 1):
        state, _ = fed.run_round(state, rnd)
        x, c, ci = ref[rnd - 1]
        err = max_abs_error(state.global_params, x)
        if scaffold:
            cm = {n: torch.stack([ci[m][n] for m in range(part.num_clients)]) for n in x}
            err = max(err, max_abs_error(state.server_state.base.c, c),
                      max_abs_error(state.client_state, cm))
        errors.append(err)
        if rnd == T0:
            qk_at_t0 = {n: state.global_params[n].clone() for n in qk}
            c_at_t0 = ({n: state.server_state.base.c[n].clone() for n in qk}
                       if scaffold else None)
    assert max(errors) <= 1e-9, errors
    for n in qk:  # the frozen kernel and its control variate stay at their round-T0 values
        assert torch.equal(state.global_params[n], qk_at_t0[n])
        if scaffold:
            assert torch.equal(state.server_state.base.c[n], c_at_t0[n])
    if scaffold:  # the variates are not trivially zero
        assert max(float(v.abs().max()) for v in state.server_state.base.c.values()) > 1e-3


@pytest.mark.parametrize("base", ["fedprox", "scaffold_lrg"])
def test_never_freezing_is_the_base_algorithm(digits64, base):
    over, *_ = BASES[base]
    part = random_partition(digits64, 5, seed=3, alpha=0.5)
    plain = [o.replace("algorithm.base=", "algorithm.name=") for o in over]
    runs = {}
    for name, cfg_over in (("frozen", ["algorithm.name=fedfrozen",
                                       f"algorithm.warmup_rounds={ROUNDS}", *over]),
                           ("base", plain)):
        fed = federation(tiny_config(*COMMON, "train.momentum=0.9", *cfg_over), digits64, part)
        state = fed.initial_state()
        for rnd in range(1, ROUNDS + 1):
            state, _ = fed.run_round(state, rnd)
        runs[name] = state
    frozen, plain = runs["frozen"], runs["base"]
    assert max_abs_error(frozen.global_params, plain.global_params) <= 1e-12
    if "scaffold" in base:
        assert max_abs_error(frozen.server_state.base.c, plain.server_state.c) <= 1e-12
        assert max_abs_error(frozen.client_state, plain.client_state) <= 1e-12


def test_stacked_group_equals_runs_alone(tmp_path):
    """FedFrozen on FedProx and on SCAFFOLD (momentum 0.9) beside FedAvg in one group."""
    base = ["train.rounds=4", "partition.num_clients=4", "train.precision=fp64",
            "train.clients_per_round=3", "train.momentum=0.9"]
    cfgs = {
        "frozen_prox": tiny_config(*base, "algorithm.name=fedfrozen",
                                   "algorithm.warmup_rounds=2", "algorithm.base=fedprox",
                                   "algorithm.mu=0.3"),
        "frozen_scaffold": tiny_config(*base, "algorithm.name=fedfrozen",
                                       "algorithm.warmup_rounds=1", "algorithm.base=scaffold",
                                       "seed=1"),
        "fedavg": tiny_config(*base, "algorithm.name=fedavg", "seed=2"),
    }
    assert_group_equals_alone(tmp_path, cfgs, {"frozen_prox": KEY_BIAS_METRICS})


@pytest.mark.parametrize("override, key", [
    ("algorithm.base=fedsgd", "algorithm.base"),
    ("algorithm.mu=-0.1", "algorithm.mu"),
    ("algorithm.server_lr=0", "algorithm.server_lr"),
])
def test_bad_base_settings_name_the_key(tmp_path, override, key):
    out = tmp_path / "run"
    res = run_cli("run", "--config", "digits_vit", "--out", str(out), "train.rounds=1",
                  "algorithm.name=fedfrozen", "algorithm.warmup_rounds=1", override)
    assert res.returncode == 2 and key in res.stderr, res.stderr[-1000:]
    assert not out.exists()
