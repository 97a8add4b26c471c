"""``benchmarks/bench_engines.py``: the grid runs end to end on tiny workloads, writes its JSON."""

from __future__ import annotations

import json

import bench_engines as bench
import pytest

from real_data.models import CharTransformerConfig, ViTConfig


@pytest.fixture
def tiny(monkeypatch):
    monkeypatch.setitem(bench.WORKLOADS, "vit", bench.Workload(
        "vit", "vit", ViTConfig(patch=2, dim=8, depth=1, heads=2, mlp_dim=16, image_size=8,
                                channels=1, num_classes=5), 120, 4, 2))
    monkeypatch.setitem(bench.WORKLOADS, "char", bench.Workload(
        "char", "char_transformer", CharTransformerConfig(dim=8, depth=1, heads=2, mlp_dim=16,
                                                          vocab_size=11, seq_len=6), 120, 4, 2))


def test_bench_grid_writes_json(tiny, tmp_path, capsys):
    out = tmp_path / "b.json"
    rc = bench.main(["--clients", "2,4", "--precisions", "fp32", "--stages", "full,frozen_v",
                     "--engines", "fast,vmap,sequential", "--warmup", "1", "--repeats", "2",
                     "--seq-repeats", "1", "--seq-clients", "2", "--seq-direct",
                     "vit:fp32:full:4", "--device", "cpu", "--out", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    rows = data["results"]
    assert len(rows) == 2 * 2 * 2 * 3  # models x stages x clients x engines
    for r in rows:
        assert r["round_s"] > 0 and r["flops_per_round"] > 0 and r["tflops"] > 0
        assert r["client_samples_per_s"] > 0
    seq = {(r["model"], r["stage"], r["clients"]): r for r in rows if r["engine"] == "sequential"}
    assert seq[("vit", "full", 4)]["extrapolated"] is False  # timed whole (--seq-direct)
    assert seq[("char", "full", 4)]["extrapolated"] is True  # scaled from 2 clients
    assert seq[("char", "full", 4)]["measured_clients"] == 2
    # the frozen-v stage counts fewer FLOPs than the full model (no Q/K/MLP weight gradients)
    flops = {(r["model"], r["stage"]): r["flops_per_round"] for r in rows if r["clients"] == 4}
    assert flops[("vit", "frozen_v")] < flops[("vit", "full")]
    assert {"speedup", "frozen_vs_full", "ceiling"} <= set(data["summary"])
    assert "bench_engines.py" in data["source"] and data["config"]["clients"] == [2, 4]
    assert "engine benchmark on" in capsys.readouterr().out


def test_bench_rejects_unknown_names(tiny):
    from linattn.errors import UserError

    with pytest.raises(UserError, match="unknown"):
        bench.main(["--engines", "warp", "--device", "cpu"])


def test_profile_prints_kernel_table(tiny, capsys):
    assert bench.main(["--profile", "vit:fp32:full:2:fast", "--warmup", "1",
                       "--device", "cpu"]) == 0
    assert "Self CPU" in capsys.readouterr().out


def test_render_markdown_table(tiny, tmp_path, capsys):
    out = tmp_path / "b.json"
    bench.main(["--models", "vit", "--clients", "2", "--precisions", "fp32", "--stages",
                "full", "--engines", "fast,sequential", "--warmup", "1", "--repeats", "1",
                "--seq-repeats", "1", "--device", "cpu", "--out", str(out)])
    capsys.readouterr()
    assert bench.main(["--render", str(out)]) == 0
    table = capsys.readouterr().out.strip().splitlines()
    assert table[0].startswith("| model |") and len(table) == 3
    assert table[2].startswith("| vit | fp32 | full | 2 |")


def test_timeline_counts_idle_gaps_and_names_their_neighbours():
    timeline = bench.timeline
    ev = [{"cat": "kernel", "name": "a", "ts": 0, "dur": 10},
          {"cat": "kernel", "name": "b", "ts": 5, "dur": 10},  # overlaps a: no gap
          {"cat": "gpu_memcpy", "name": "copy", "ts": 100, "dur": 50},
          {"cat": "kernel", "name": "c", "ts": 160, "dur": 40},
          {"cat": "cpu_op", "name": "aten::slow", "ts": 20, "dur": 70}]
    text = timeline({"traceEvents": ev})
    # span 200 us, busy 15 + 50 + 40 = 105, idle 95 in two gaps (85 and 10 us)
    assert "GPU span 0.20 ms, kernels/copies 0.10 ms, idle 0.10 ms (2 gaps" in text
    lines = text.splitlines()
    assert "85.0" in lines[2] and "b -> copy" in lines[2] and "aten::slow" in lines[2]
    assert "10.0" in lines[3] and "copy -> c" in lines[3]
    assert timeline({"traceEvents": []}) == "timeline: no GPU events"
