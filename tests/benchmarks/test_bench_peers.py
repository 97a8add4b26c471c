"""The peer benchmark runs the same FedAvg workload on pfl-research as on linattn.

pfl's simulator (its own local loop, FederatedAveraging, data-point weighting, central SGD with
learning rate 1) and linattn's sequential engine, from the same initial model, on the same
sampled clients and minibatches, must end the rounds with the same global model up to float32
rounding: largest per-tensor relative difference at most 1e-5 (measured: 2-3e-7).
Skipped when pfl is not installed (it is no dependency of any extra; see
``benchmarks/bench_peers.py`` for the install line).
"""

from __future__ import annotations

import pytest
import torch
from bench_peers import (
    bench_config,
    load_workload,
    relative_difference,
    render_markdown,
    run_native,
    run_pfl,
)

TINY = ["model.dim=8", "model.mlp_dim=16", "model.depth=1", "model.heads=2",
        "partition.num_clients=6", "train.optimizer=sgd", "train.lr=0.05",
        "train.momentum=0.9", "train.clip_grad_norm=1.0"]


def test_pfl_fedavg_rounds_equal_the_native_sequential_engine():
    pytest.importorskip("pfl", reason="pfl-research is not installed (it is in the dev extra)")
    cfg = bench_config("digits_vit", clients_per_round=3, local_steps=3, batch_size=8,
                       rounds=2, overrides=TINY)
    cfg, dataset, partition = load_workload(cfg)
    assert len(set(partition.sizes.tolist())) > 1  # unequal clients: the weighting matters
    native = run_native(cfg, dataset, partition, "sequential", rounds=2)
    peer = run_pfl(cfg, dataset, partition, rounds=2)
    assert len(peer["times_s"]) == 2
    from real_data.federation import Federation

    start = Federation(cfg, dataset, partition).initial_state().global_params
    assert relative_difference(native["params"], start) > 1e-3  # training moved the model
    diff = relative_difference(peer["params"], native["params"])
    assert diff <= 1e-5, diff


def test_relative_difference_and_table_with_an_engine_not_run():
    a = {"w": torch.tensor([3.0, 4.0])}
    assert relative_difference({"w": torch.tensor([3.0, 4.5])}, a) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="names differ"):
        relative_difference({"v": a["w"]}, a)
    row = {"engine": "linattn-vectorized", "how": "h", "threads": "2", "status": "ok",
           "round_s": 2.0, "round_s_iqr": [1.9, 2.1], "client_samples_per_s": 1600.0, "gflops": 3.0,
           "time_vs_vectorized": 1.0, "test_acc": 0.5, "param_rel_diff_vs_sequential": 1e-6}
    missing = {"engine": "pfl", "how": "h", "threads": "2", "status": "not run",
               "reason": "ModuleNotFoundError: No module named 'pfl'"}
    table = render_markdown({"results": [row, missing]})
    assert "| 2.000 (1.900-2.100) | 1,600 | 3.0 | 1.00 | 0.5000 | 1.0e-06 |" in table
    assert "not run: ModuleNotFoundError: No module named 'pfl'" in table
