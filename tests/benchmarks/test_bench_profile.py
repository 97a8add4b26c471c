"""The kernel-profile step benchmark (``benchmarks/bench_profile.py``) on a tiny CPU run: one
row per gradient path, stack and batch, each with a positive step time, the samples a second
it implies, the FLOPs counted for the stack and an evaluation time; the JSON holds them."""

from __future__ import annotations

import json

import pytest
from bench_profile import main as bench_main

RUN = ["model.dim=8", "model.mlp_dim=16", "model.depth=1", "model.heads=2",
       "train.batch_size=8", "train.local_steps=2", "run.progress=false", "run.plot=false",
       "eval.clients=false", "partition.validation_fraction=0.2", "algorithm.name=fedavg",
       "train.rounds=2", "train.device=cpu", "train.clip_grad_norm=1.0"]


def test_bench_profile_writes_a_row_per_path_stack_and_batch(tmp_path):
    from real_data.config import load_config
    from real_data.runs import start_run

    run = tmp_path / "run"
    start_run(load_config("digits_vit", RUN), out=run, snapshot_rounds=(0, 2))
    out = tmp_path / "bench.json"
    assert bench_main(["--run", str(run), "--device", "cpu", "--stacks", "1,3",
                       "--batches", "4", "--steps", "2", "--warmup", "1",
                       "--output", str(out)]) == 0
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert [(r["path"], r["stack"], r["batch"]) for r in rows] == [
        ("vmap", 1, 4), ("stacked", 1, 4), ("vmap", 3, 4), ("stacked", 3, 4)]
    for r in rows:
        assert r["precision"] == "fp32" and r["step_s"] > 0 and r["eval_s"] > 0
        assert r["samples_per_s"] == pytest.approx(r["stack"] * r["batch"] / r["step_s"])
        assert r["step_flops"] > 0 and r["tflops"] > 0
    one, three = rows[0]["step_flops"], rows[2]["step_flops"]
    assert three == 3 * one  # a stack's FLOPs are its kernels'
    assert data["device"]["type"] == "cpu" and data["steps"] == 2
