"""Engine benchmark: the vectorized engine against the sequential reference engine, in one
process on one GPU, on the same rounds.

Measured results: ``docs/results/performance.md`` (the tables, each with its card and command)
and the JSON under ``docs/bench/`` (``docs/bench/NOTES.md`` says what each file measures).

Workloads (random tensors shaped like the real data; no data files needed):

- ``vit``: Fashion-MNIST shape (1x28x28, patch 4: 50 tokens), width 128, depth 4, 4 heads,
  MLP 256: 540,170 parameters; K = 10 local steps of B = 32 images.
- ``char``: Shakespeare shape (80 characters, vocabulary 100), width 128, depth 2, 8 heads,
  MLP 512: 432,740 parameters; K = 10 local steps of B = 16 windows (1,280 characters).

Both with the shipped configs' optimizer: SGD, lr 0.05, heavy-ball momentum 0.9, per-client
gradient clipping at 5. Stages: ``full`` (FedAvg round, everything trains), ``frozen``
(FedFrozen after T0: Q/K shared and frozen, everything else trains) and ``frozen_v``
(FedFrozen ``train=v``: the value projections alone train).

A round is what :class:`~real_data.federation.Federation` does around local training: draw the
minibatch plan (:class:`~real_data.engines.BatchPlanner`: drawn ahead on a CPU thread while the
previous round trains, as the federation does; ``--no-prefetch`` draws it inside the round), run the
engine, average the uploaded parameters. Timing: CUDA events around each round, after ``warmup``
untimed rounds; the median of ``repeats`` rounds (the inter-quartile range is kept). The sequential
engine costs the same per client whatever the round's size, so by default it is timed on
``seq_clients`` clients and scaled for larger rounds (``extrapolated: true`` in the JSON);
``--seq-direct`` names cells timed on the full round. FLOPs are counted by
``torch.utils.flop_counter`` on one client step of the model's own code
(:func:`real_data.metrics.step_flops`; frozen parameters get no weight gradient) and multiplied by
the round's steps; effective TFLOP/s = counted FLOPs / median round time.

Usage: ``python benchmarks/bench_engines.py [--clients 10,50,100,500]
[--engines fast,vmap,sequential] ... [--out docs/bench/engines.json]`` (``--help`` lists
everything). The JSON holds the config, the device, library versions, the code version, the
results and this file's source.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from linattn.fileio import atomic_write_json
from real_data.algorithms import AlgorithmContext, FedAvg, FedAvgParams, weighted_average
from real_data.engines import (
    BatchPlanner,
    LocalJob,
    OptimizerSpec,
    fast,
    make_batches,
    train_sequential,
)
from real_data.engines.vectorized import train_vmap
from real_data.metrics import step_flops
from real_data.models import CharTransformerConfig, ViTConfig, build_model, names_of_kind

OPTIMIZER = OptimizerSpec("sgd", lr=0.05, momentum=0.9, clip_grad_norm=5.0)
ENGINES: dict[str, Callable] = {
    "sequential": train_sequential,
    "vmap": train_vmap,  # the general vectorized path (vmap(grad) over stacked clients)
    "fast": functools.partial(fast.train_fast, graphs=True),  # what train_vectorized runs
    "fast_eager": functools.partial(fast.train_fast, graphs=False),
    "fast_compile": functools.partial(fast.train_fast, graphs=True, compile=True),
    # the same with SDPA's flash kernels in place of the one-tile Triton attention
    "fast_sdpa": functools.partial(fast.train_fast, graphs=True, attention="sdpa"),
    # the same without folding the LayerNorms' per-client affine into the next linears
    "fast_compile_nofold": functools.partial(fast.train_fast, graphs=True, compile=True,
                                             fold_norms=False),
    # the same with the update over the concatenated gradients (no flat_update.FlatSGD)
    "fast_compile_torchupdate": functools.partial(fast.train_fast, graphs=True, compile=True,
                                                  triton_update=False),
    "fast_compile_sdpa": functools.partial(fast.train_fast, graphs=True, compile=True,
                                           attention="sdpa"),
    # Triton GEMMs with fused epilogues where inductor's autotuning finds them faster
    "fast_autotune": functools.partial(fast.train_fast, graphs=True,
                                       compile="max-autotune-no-cudagraphs"),
}


@dataclass(frozen=True)
class Workload:
    """One model and its data shape; ``samples`` is the size of the synthetic training set."""

    name: str
    model: str
    config: object
    samples: int
    batch_size: int
    local_steps: int


WORKLOADS = {
    "vit": Workload("vit", "vit", ViTConfig(patch=4, dim=128, depth=4, heads=4, mlp_dim=256,
                                            image_size=28, channels=1, num_classes=10),
                    60_000, 32, 10),
    "char": Workload("char", "char_transformer",
                     CharTransformerConfig(dim=128, depth=2, heads=8, mlp_dim=512,
                                           vocab_size=100, seq_len=80), 41_212, 16, 10),
}
STAGES = ("full", "frozen", "frozen_v")


class Bench:
    """A workload on a device: model, data, partition into ``max_clients`` equal clients."""

    def __init__(self, work: Workload, max_clients: int, device: torch.device, seed: int = 0,
                 prefetch: bool = True):
        self.work, self.device, self.prefetch = work, device, prefetch
        self.model = build_model(work.model, work.config, seed).to(device).eval()
        self.params = {n: p.detach().clone() for n, p in self.model.named_parameters()}
        g = torch.Generator().manual_seed(seed)
        cfg = work.config
        if work.model == "vit":  # images in [0, 1), as the loaders give them
            x = torch.rand(work.samples, cfg.channels, cfg.image_size, cfg.image_size,
                           generator=g)
            y = torch.randint(cfg.num_classes, (work.samples,), generator=g)
        else:
            x = torch.randint(cfg.vocab_size, (work.samples, cfg.seq_len), generator=g)
            y = torch.randint(cfg.vocab_size, (work.samples, cfg.seq_len), generator=g)
        self.x, self.y = x.to(device), y.to(device)
        order = np.random.default_rng(seed).permutation(work.samples)
        self.train_idx = tuple(np.array_split(order, max_clients))
        self.groups = self.model.param_groups()
        shapes = {n: tuple(p.shape) for n, p in self.params.items()}
        ctx = AlgorithmContext(self.groups, shapes, max_clients, 100, max_clients,
                               work.local_steps, OPTIMIZER)
        self.algorithm = FedAvg(FedAvgParams(), ctx)
        self.planner = BatchPlanner(self.train_idx, 0, work.batch_size, work.local_steps, None,
                                    device)

    def trainable(self, stage: str) -> tuple[str, ...]:
        """FedFrozen's trainable set in each stage (``full``: every parameter)."""
        if stage == "full":
            return tuple(self.params)
        if stage == "frozen_v":
            return names_of_kind(self.groups, "v")
        qk = set(names_of_kind(self.groups, "qk"))
        return tuple(n for n in self.params if n not in qk)

    def flops_per_client_step(self, stage: str) -> int:
        b = self.work.batch_size
        return step_flops(lambda ps, xb: self.algorithm.forward(self.model, ps, xb),
                          self.params, self.trainable(stage), self.x[:b], self.y[:b])

    def round(self, engine: Callable, clients: int, stage: str, precision: str,
              rnd: int) -> dict[str, torch.Tensor]:
        """One round: batch plan, local training of ``clients`` clients, FedAvg aggregation."""
        ids = np.arange(clients)
        w = self.work
        if self.prefetch:  # as Federation: the next round's plan drawn while this one trains
            batches = self.planner.plan(ids, rnd)
        else:
            batches = make_batches(self.train_idx, ids, 0, rnd, w.batch_size, w.local_steps,
                                   None, self.device)
        autocast = torch.bfloat16 if precision == "bf16" and self.device.type == "cuda" else None
        trainable = self.trainable(stage)
        job = LocalJob(model=self.model, algorithm=self.algorithm, global_params=self.params,
                       trainable=trainable, batches=batches, x=self.x, y=self.y,
                       optimizer=OPTIMIZER, client_ids=ids, autocast=autocast)
        # the weights before the engine, as the federation has them: a host-to-device copy
        # after it would wait for the queued training before the averaging could be queued
        sizes = torch.tensor([len(self.train_idx[m]) for m in ids], dtype=torch.float64)
        weights = (sizes / sizes.sum()).to(self.device)
        results = engine(job)
        if self.prefetch:  # after the engine has queued its work (the launches need the GIL)
            self.planner.prefetch(ids, rnd + 1)
        return {n: weighted_average(results.params[n], weights) for n in trainable}


def _timed(fn: Callable[[int], object], warmup: int, repeats: int,
           device: torch.device) -> tuple[list[float], float]:
    """Round times in seconds (CUDA events on a GPU) and the peak memory in GiB."""
    for r in range(warmup):
        fn(r)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for r in range(warmup, warmup + repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(r)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn(r)
            times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else float("nan")
    return times, peak


def _release(device: torch.device) -> None:
    fast.clear_cache()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def _rate(device: torch.device, fn: Callable[[], object], work: float, repeats: int) -> float:
    """``work`` per second of ``fn`` (median of ``repeats`` timed calls after 3 warm-ups)."""
    times, _ = _timed(lambda r: fn(), 3, repeats, device)
    return work / statistics.median(times)


def measure_ceilings(device: torch.device, repeats: int = 20) -> dict[str, float]:
    """The card's rates: large GEMMs (bf16, fp32), device copy, and GEMMs of the ViT's shapes.

    The copy moves 1 GiB (read plus write counted); the ViT GEMM is one client-stacked
    projection of a 500-client round: ``(500, 1600, 128) @ (500, 128, 128)``.
    """
    if device.type != "cuda":
        return {}
    out = {}
    for dt, tag in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
        n = 8192
        a, b = (torch.randn(n, n, device=device, dtype=dt) for _ in range(2))
        out[f"matmul_{tag}_tflops"] = _rate(device, functools.partial(torch.mm, a, b), 2 * n**3,
                                             repeats) / 1e12
        xa = torch.randn(500, 1600, 128, device=device, dtype=dt)
        wa = torch.randn(500, 128, 128, device=device, dtype=dt)
        out[f"bmm_vit_{tag}_tflops"] = _rate(device, functools.partial(torch.bmm, xa, wa),
                                             2 * 500 * 1600 * 128**2, repeats) / 1e12
    src = torch.randn(2**28, device=device)  # 1 GiB of fp32
    dst = torch.empty_like(src)
    out["copy_gbps"] = _rate(device, lambda: dst.copy_(src), 2 * src.numel() * 4, repeats) / 1e9
    return out


def _sequential_times(bench: Bench, cell: str, clients: int, stage: str, precision: str,
                      args: argparse.Namespace, device: torch.device,
                      cache: dict) -> tuple[list[float], float, int]:
    """Sequential round times for ``clients``: timed whole, or scaled from ``seq_clients``.

    The reference engine trains one client after another, so its round time is the per-client
    time times the round's size; the per-client times of the first timed round are kept in
    ``cache`` for the larger rounds of the same workload, precision and stage.
    """
    whole = cell in args.seq_direct
    if whole or "per_client" not in cache:
        n = clients if whole else min(clients, args.seq_clients)
        def one(r: int) -> None:  # warm-up (r = 0): a round of two clients
            bench.round(train_sequential, n if r else min(n, 2), stage, precision, r)

        times, peak = _timed(one, 1, args.seq_repeats, device)
        per_client = [t / n for t in times]
        if not whole:
            cache.update(per_client=per_client, peak=peak, n=n)
    else:
        per_client, peak, n = cache["per_client"], cache["peak"], cache["n"]
    return [t * clients for t in per_client], peak, n


def _runs(engine: str, stage: str, clients: int, args: argparse.Namespace) -> bool:
    """Engines other than fast and sequential run only at the baseline sizes and stages."""
    if engine in ("fast", "sequential"):
        return True
    return (not args.baseline_clients or clients in args.baseline_clients) and \
        (not args.baseline_stages or stage in args.baseline_stages)


def run_grid(args: argparse.Namespace, device: torch.device,
             on_row: Callable[[list[dict]], None] = lambda rows: None) -> list[dict]:
    """Every requested cell; returns one row per (workload, precision, stage, clients, engine).

    A cell that fails is recorded with its error and the grid goes on; ``on_row`` sees the
    rows so far after each cell (the JSON is rewritten as the grid runs).
    """
    rows: list[dict] = []
    for wname in args.models:
        bench = Bench(WORKLOADS[wname], max(args.clients), device, prefetch=args.prefetch)
        w = bench.work
        for precision in args.precisions:
            for stage in args.stages:
                flops = bench.flops_per_client_step(stage)
                seq_cache: dict = {}
                for clients, engine in ((c, e) for c in sorted(args.clients)
                                        for e in args.engines if _runs(e, stage, c, args)):
                    cell = f"{wname}:{precision}:{stage}:{clients}"
                    row = {"model": wname, "precision": precision, "stage": stage,
                           "clients": clients, "engine": engine, "extrapolated": False,
                           "measured_clients": clients}
                    try:
                        if engine == "sequential":
                            times, peak, n = _sequential_times(bench, cell, clients, stage,
                                                               precision, args, device, seq_cache)
                            row.update(extrapolated=n != clients, measured_clients=n)
                        else:
                            times, peak = _timed(
                                functools.partial(bench.round, ENGINES[engine], clients, stage,
                                                  precision), args.warmup, args.repeats, device)
                            if fast._CHUNK:
                                row["max_chunk"] = int(min(fast._CHUNK.values()))
                    except Exception as exc:  # noqa: BLE001 - recorded, the grid goes on
                        row["error"] = f"{type(exc).__name__}: {exc}"
                        print(f"{cell} {engine}: FAILED {row['error']}", flush=True)
                    _release(device)
                    if "error" not in row:
                        med = statistics.median(times)
                        total_flops = flops * clients * w.local_steps
                        row.update(round_s=med, round_s_iqr=np.percentile(times, [25, 75])
                                   .tolist(), times_s=times, peak_mem_gib=peak,
                                   client_samples_per_s=clients * w.local_steps * w.batch_size
                                   / med, flops_per_round=total_flops,
                                   tflops=total_flops / med / 1e12)
                        print(_format(row), flush=True)
                    rows.append(row)
                    on_row(rows)
    return rows


def _format(r: dict) -> str:
    tag = "*" if r["extrapolated"] else " "
    return (f"{r['model']:5s} {r['precision']:5s} {r['stage']:9s} {r['clients']:5d} "
            f"{r['engine']:12s} {r['round_s'] * 1e3:10.2f}{tag} {r['client_samples_per_s']:12.0f} "
            f"{r['tflops']:8.2f} {r['peak_mem_gib']:7.2f}")


HEADER = (f"{'model':5s} {'prec':5s} {'stage':9s} {'C':>5s} {'engine':12s} {'round ms':>11s} "
          f"{'samples/s':>12s} {'TFLOP/s':>8s} {'peakGiB':>7s}")


def summarize(rows: list[dict], ceilings: dict) -> dict:
    """Speed-ups over the sequential and vmap engines, frozen/full ratios, ceiling fractions."""
    by = {(r["model"], r["precision"], r["stage"], r["clients"], r["engine"]): r for r in rows}
    out: dict[str, list] = {"speedup": [], "frozen_vs_full": [], "ceiling": []}
    for (m, p, s, c, e), r in by.items():
        if e not in ("fast", "fast_compile"):
            continue
        for base in ("sequential", "vmap", "fast_sdpa"):
            if (m, p, s, c, base) in by:
                b = by[(m, p, s, c, base)]
                out["speedup"].append({"model": m, "precision": p, "stage": s, "clients": c,
                                       "engine": e, "over": base,
                                       "ratio": b["round_s"] / r["round_s"],
                                       "baseline_extrapolated": b["extrapolated"]})
        if s != "full" and (m, p, "full", c, e) in by:
            out["frozen_vs_full"].append({"model": m, "precision": p, "stage": s, "clients": c,
                                          "engine": e,
                                          "ratio": by[(m, p, "full", c, e)]["round_s"]
                                          / r["round_s"]})
        key = "matmul_bf16_tflops" if p == "bf16" else "matmul_fp32_tflops"
        if key in ceilings:
            w = WORKLOADS[m]
            t_flop = r["flops_per_round"] / (ceilings[key] * 1e12)
            out["ceiling"].append({"model": m, "precision": p, "stage": s, "clients": c,
                                   "engine": e, "compute_floor_s": t_flop,
                                   "fraction_of_matmul_peak": t_flop / r["round_s"],
                                   "local_steps": w.local_steps})
    return out


def profile_cell(cell: str, device: torch.device, warmup: int,
                 trace: Path | None = None) -> int:
    """Print the kernels of one round, most device time first (a look, not a timing), and
    where the GPU sat idle in it (``timeline``); ``trace`` keeps the Chrome trace."""
    from torch.profiler import ProfilerActivity, profile

    model, precision, stage, clients, engine = cell.split(":")
    bench = Bench(WORKLOADS[model], int(clients), device)
    fn = ENGINES[engine]
    for r in range(warmup):
        bench.round(fn, int(clients), stage, precision, r)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        bench.round(fn, int(clients), stage, precision, warmup)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    key = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=40, max_name_column_width=70))
    if device.type == "cuda":
        path = trace or Path(f"/tmp/linattn-trace-{time.time_ns()}.json")
        prof.export_chrome_trace(str(path))
        print(timeline(json.loads(path.read_text())))
        if trace is None:
            path.unlink()
    return 0


def timeline(trace: dict, top: int = 12) -> str:
    """GPU busy and idle time of a Chrome trace: the span from the first kernel (or copy) to
    the last, the time covered by kernels, and the longest idle gaps with the kernels around
    them and the CPU ops running during them."""
    ev = trace["traceEvents"]
    gpu = sorted((e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
                  and "dur" in e), key=lambda e: e["ts"])
    if not gpu:
        return "timeline: no GPU events"
    cpu = [e for e in ev if e.get("cat") in ("cpu_op", "python_function", "cuda_runtime",
                                             "cuda_driver") and "dur" in e]
    span = gpu[-1]["ts"] + gpu[-1]["dur"] - gpu[0]["ts"]
    gaps, busy, end = [], 0.0, gpu[0]["ts"]
    prev = gpu[0]
    for e in gpu:
        if e["ts"] > end:
            gaps.append((e["ts"] - end, end, prev["name"], e["name"]))
        busy += max(0.0, e["ts"] + e["dur"] - max(end, e["ts"]))
        if e["ts"] + e["dur"] > end:
            end, prev = e["ts"] + e["dur"], e
    idle = span - busy
    small = sum(g[0] for g in gaps if g[0] < 20)
    lines = [f"timeline: GPU span {span / 1e3:.2f} ms, kernels/copies {busy / 1e3:.2f} ms, "
             f"idle {idle / 1e3:.2f} ms ({len(gaps)} gaps; {small / 1e3:.2f} ms in gaps "
             "< 20 us)", "longest idle gaps (us, after -> before, CPU ops then):"]
    for dur, t0, a, b in sorted(gaps, reverse=True)[:top]:
        during = sorted({c["name"][:40] for c in cpu
                         if c["ts"] < t0 + dur and c["ts"] + c["dur"] > t0
                         and c["dur"] < 10 * dur + 1e5})[:6]
        lines.append(f"  {dur:9.1f}  {a[:45]} -> {b[:45]}  [{'; '.join(during)}]")
    return "\n".join(lines)


def _ms(r: dict | None) -> str:
    if r is None:
        return "-"
    return f"{r['round_s'] * 1e3:.1f}" + ("*" if r["extrapolated"] else "")


def _ratio(slow: dict | None, quick: dict) -> str:
    return "-" if slow is None else f"{slow['round_s'] / quick['round_s']:.1f}x"


def render_markdown(data: dict) -> str:
    """The JSON's results as the markdown table of docs/results/performance.md (one line per
    cell): the fast engine eager and compiled (``fast_compile``, where timed), the vmap and
    sequential engines and the fast engine with SDPA attention (``fast_sdpa``, where timed)."""
    rows = [r for r in data["results"] if "error" not in r]
    by = {(r["model"], r["precision"], r["stage"], r["clients"], r["engine"]): r for r in rows}
    cells = sorted({k[:4] for k in by}, key=lambda k: (k[0] != "vit", k[1] != "bf16",
                                                      STAGES.index(k[2]), k[3]))
    out = ["| model | prec | stage | C | fast ms | TFLOP/s | compiled ms | TFLOP/s | "
           "client-samples/s (best) | peak GiB | SDPA ms | vmap ms | sequential ms | "
           "best / seq | best / vmap | best / SDPA |",
           "|---|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for cell in cells:
        f, fc, sd, v, q = (by.get((*cell, e)) for e in ("fast", "fast_compile", "fast_sdpa",
                                                         "vmap", "sequential"))
        if f is None:
            continue
        best = fc if fc is not None and fc["round_s"] < f["round_s"] else f
        tf = "-" if fc is None else f"{fc['tflops']:.1f}"
        out.append(f"| {cell[0]} | {cell[1]} | {cell[2]} | {cell[3]} | {_ms(f)} | "
                   f"{f['tflops']:.1f} | {_ms(fc)} | {tf} | "
                   f"{best['client_samples_per_s']:,.0f} | {best['peak_mem_gib']:.2f} | "
                   f"{_ms(sd)} | {_ms(v)} | {_ms(q)} | {_ratio(q, best)} | {_ratio(v, best)} | "
                   f"{_ratio(sd, best)} |")
    return "\n".join(out)


def cpu_name() -> str:
    """The CPU's model name (from /proc/cpuinfo where there is one)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def provenance(device: torch.device) -> dict:
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent, timeout=10).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain"], capture_output=True,
                                    text=True, cwd=Path(__file__).parent, timeout=10).stdout)
    except (OSError, subprocess.SubprocessError):
        commit, dirty = "", None
    dev = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    return {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "device": dev, "torch": torch.__version__, "cuda": torch.version.cuda,
            "python": platform.python_version(), "git_commit": commit, "git_dirty": dirty}


def _parser() -> argparse.ArgumentParser:
    ints = lambda s: [int(v) for v in s.split(",") if v]  # noqa: E731
    names = lambda s: [v for v in s.split(",") if v]  # noqa: E731
    ap = argparse.ArgumentParser(prog="bench_engines.py", description=__doc__.split("\n")[0])
    ap.add_argument("--models", type=names, default=list(WORKLOADS))
    ap.add_argument("--precisions", type=names, default=["bf16", "fp32"])
    ap.add_argument("--stages", type=names, default=list(STAGES))
    ap.add_argument("--clients", type=ints, default=[10, 50, 100, 500])
    ap.add_argument("--engines", type=names, default=["fast", "vmap", "sequential"],
                    help=f"any of {', '.join(ENGINES)}")
    ap.add_argument("--warmup", type=int, default=2, help="untimed rounds per cell")
    ap.add_argument("--repeats", type=int, default=5, help="timed rounds per cell (median)")
    ap.add_argument("--baseline-clients", type=ints, default=[],
                    help="round sizes at which the engines other than fast and sequential "
                         "run (default: all)")
    ap.add_argument("--baseline-stages", type=names, default=[],
                    help="stages at which the engines other than fast run (default: all)")
    ap.add_argument("--seq-clients", type=int, default=10,
                    help="clients of the timed sequential rounds that others scale from")
    ap.add_argument("--seq-repeats", type=int, default=3)
    ap.add_argument("--seq-direct", type=names, default=["vit:bf16:full:100"],
                    help="cells model:precision:stage:clients whose sequential round is timed "
                         "whole")
    ap.add_argument("--no-ceilings", action="store_true", help="skip the card's rates")
    ap.add_argument("--no-prefetch", dest="prefetch", action="store_false",
                    help="draw each round's minibatch plan in the round, not ahead on a thread")
    ap.add_argument("--profile", metavar="CELL",
                    help="instead of the grid: kernel-time table of one round of "
                         "model:precision:stage:clients:engine (torch.profiler)")
    ap.add_argument("--trace", type=Path, metavar="JSON",
                    help="with --profile: also write the round's Chrome trace here")
    ap.add_argument("--render", type=Path, metavar="JSON", nargs="+",
                    help="instead of the grid: print result files as one markdown table")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", type=Path, help="JSON file (the source goes in it too)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from linattn.errors import UserError

    bad = [e for e in args.engines if e not in ENGINES] + \
        [m for m in args.models if m not in WORKLOADS] + \
        [s for s in args.stages if s not in STAGES] + \
        [p for p in args.precisions if p not in ("bf16", "fp32")]
    if bad:
        raise UserError(f"bench_engines.py: unknown {bad}; engines {list(ENGINES)}, models "
                        f"{list(WORKLOADS)}, stages {list(STAGES)}, precisions bf16, fp32")
    if args.render:
        files = [json.loads(p.read_text()) for p in args.render]
        print(render_markdown({"results": [r for f in files for r in f["results"]]}))
        return 0
    device = torch.device(args.device)
    if args.profile:
        return profile_cell(args.profile, device, args.warmup, args.trace)
    started = time.perf_counter()
    prov = provenance(device)
    print(f"engine benchmark on {prov['device']} (torch {prov['torch']})", flush=True)
    ceilings = {} if args.no_ceilings else measure_ceilings(device)
    if ceilings:
        print("ceilings: " + ", ".join(f"{k} {v:.1f}" for k, v in ceilings.items()), flush=True)
    print(HEADER + "   (* = sequential scaled from a smaller round)", flush=True)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}

    def write(rows: list[dict], summary: dict | None = None) -> None:
        if not args.out:
            return
        payload = {"benchmark": "engines", **prov, "config": config,
                   "workloads": {k: {**asdict(v), "config": asdict(v.config)}
                                 for k, v in WORKLOADS.items()},
                   "optimizer": asdict(OPTIMIZER), "ceilings": ceilings, "results": rows,
                   "summary": summary, "total_wall_s": time.perf_counter() - started,
                   "source": {p.name: p.read_text() for p in source_files()}}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(args.out, payload, indent=1)

    rows = run_grid(args, device, write)
    summary = summarize([r for r in rows if "error" not in r], ceilings)
    for s in summary["speedup"]:
        if s["clients"] in (100, 500) and s["model"] == "vit" and s["stage"] == "full":
            how = ", sequential scaled" if s["baseline_extrapolated"] else ""
            print(f"{s['engine']} over {s['over']}: {s['ratio']:.1f}x (vit {s['precision']} "
                  f"full, {s['clients']} clients{how})")
    for f in summary["frozen_vs_full"]:
        if f["clients"] == 500:
            print(f"full / {f['stage']} round time: {f['ratio']:.2f} ({f['engine']}, "
                  f"{f['model']} {f['precision']}, 500 clients)")
    write(rows, summary)
    if args.out:
        print(f"wrote {args.out}")
    return 0


def source_files() -> list[Path]:
    engines = Path(__file__).resolve().parents[1] / "real_data" / "engines"
    return [Path(__file__).resolve()] + [engines / f"{m}.py" for m in
                                  ("fast", "stacked", "tiny_attention", "flat_update")]


if __name__ == "__main__":
    raise SystemExit(main())
