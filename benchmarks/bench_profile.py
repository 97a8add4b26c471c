"""Benchmark of the kernel profile's training step (``linattn profile``), side by side.

Phi(M) trains every parameter but Q/K of a stack of C kernels on one minibatch per step
(:func:`real_data.profile.kernel_grads`). Rows: the gradient path (``vmap``: ``vmap`` of
``grad`` over the model's own forward; ``stacked``: the engines' stacked forward, one backward
of the summed losses), the stack size C, the batch B and the matmul precision (``fp32``;
``tf32``: ``torch.backends.cuda.matmul.allow_tf32``, CUDA only; ``bf16``: the gradients under
bf16 autocast, as ``linattn profile --precision``), each timing one whole step
(gradients, per-kernel clipping, the Adam update) as the median of ``--steps`` steps after
``--warmup`` untimed ones (CUDA synchronized), and one evaluation of the validation split for
the stack (``_evaluate_each``). Throughput is samples a second (C B per step) and TFLOP/s:
C times one kernel's step FLOPs (forward and the backward to every parameter but Q/K, counted
by :func:`real_data.metrics.step_flops` on a minibatch of B) over the step's time. The JSON
(``--output``) holds every row, the run, the device and the torch version.

Usage: python benchmarks/bench_profile.py --run RUN_DIR [--device cuda] [--stacks 3,27]
       [--batches 256,2048] [--steps 20] [--output docs/bench/profile_step.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from real_data.engines import optim
from real_data.engines.base import OptimizerSpec
from real_data.metrics import step_flops
from real_data.profile import _evaluate_each, kernel_grads, load_kernel, run_setup, update


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _kernels(run: Path, setup, c: int, device, dtype) -> dict[str, torch.Tensor]:
    """C kernels: the run's snapshots in turn (repeated when C exceeds them)."""
    shapes = {n: tuple(t.shape) for n, t in setup.init.items()}
    files = sorted((run / "checkpoints").glob("round_*.pt"))
    if not files:
        raise SystemExit(f"{run}/checkpoints: no round_<t>.pt snapshot; give a T0 family's run")
    loaded = [load_kernel(f, setup.qk_names, shapes)[0] for f in files]
    return {n: torch.stack([loaded[i % len(loaded)][n].to(device, dtype) for i in range(c)])
            for n in setup.qk_names}


def time_row(setup, run: Path, path: str, c: int, b: int, steps: int, warmup: int,
             bf16: bool = False) -> dict:
    fed, model = setup.fed, setup.fed.model
    device = fed.device
    dtype = next(iter(setup.init.values())).dtype
    qk = _kernels(run, setup, c, device, dtype)
    own = {n: p.to(device).unsqueeze(0).repeat(c, *([1] * p.dim()))
           for n, p in setup.init.items() if n not in setup.qk_names}
    spec = OptimizerSpec(name="adam", lr=1e-3, momentum=0.0, weight_decay=0.0,
                         clip_grad_norm=setup.cfg.train.clip_grad_norm)
    state = optim.init_state(spec, own)
    count = torch.zeros(c, dtype=torch.int64, device=device)
    grads_of = kernel_grads(model, qk, path)
    g = torch.Generator().manual_seed(0)
    pooled = torch.as_tensor(setup.pooled)
    times = []
    model.eval()
    for i in range(warmup + steps):
        ix = pooled[torch.randint(len(pooled), (b,), generator=g)].to(device)
        _sync(device)
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            grads = grads_of(own, fed.x_train[ix], fed.y_train[ix])
        own = update(spec, own, grads, state, count)
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    evals = []
    for _ in range(2):
        _sync(device)
        t0 = time.perf_counter()
        _evaluate_each(model, own, qk, fed, setup.cfg, path)
        _sync(device)
        evals.append(time.perf_counter() - t0)
    med = statistics.median(times)
    params = {n: p.detach() for n, p in model.named_parameters()}
    ix = pooled[:b].to(device)
    flops = step_flops(lambda ps, xb: torch.func.functional_call(model, ps, (xb,)), params,
                       [n for n in params if n not in setup.qk_names],
                       fed.x_train[ix], fed.y_train[ix])
    return {"path": path, "stack": c, "batch": b, "step_s": med,
            "step_flops": c * flops, "tflops": c * flops / med / 1e12,
            "step_s_mean": statistics.fmean(times), "step_s_std": statistics.pstdev(times),
            "samples_per_s": c * b / med, "eval_s": min(evals),
            "val_samples": int(len(fed.y_val))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", type=Path, required=True)
    ap.add_argument("--device", default=None)
    ap.add_argument("--stacks", default="3,27")
    ap.add_argument("--batches", default="256,2048")
    ap.add_argument("--paths", default="vmap,stacked")
    ap.add_argument("--precisions", default=None,
                    help="fp32,tf32,bf16 on CUDA (default), fp32 elsewhere (bf16: the "
                    "gradients under bf16 autocast, as linattn profile --precision bf16)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--output", type=Path, default=None)
    args = ap.parse_args(argv)
    setup = run_setup(args.run, args.device)
    device = setup.fed.device
    precisions = (args.precisions or ("fp32,tf32,bf16" if device.type == "cuda" else "fp32"))
    rows = []
    print(f"{'path':8} {'prec':5} {'C':>3} {'B':>5} {'step ms':>9} {'samples/s':>11} "
          f"{'TFLOP/s':>8} {'eval s':>7}")
    for prec in precisions.split(","):
        torch.backends.cuda.matmul.allow_tf32 = prec == "tf32"
        torch.backends.cudnn.allow_tf32 = prec == "tf32"
        for c in (int(v) for v in args.stacks.split(",")):
            for b in (int(v) for v in args.batches.split(",")):
                for path in args.paths.split(","):
                    r = {"precision": prec, **time_row(setup, args.run, path, c, b,
                                                       args.steps, args.warmup,
                                                       bf16=prec == "bf16")}
                    rows.append(r)
                    print(f"{path:8} {prec:5} {c:3d} {b:5d} {1e3 * r['step_s']:9.2f} "
                          f"{r['samples_per_s']:11.0f} {r['tflops']:8.3f} {r['eval_s']:7.3f}",
                          flush=True)
                    _write(args, device, rows)  # after every row: a killed call keeps them
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = True  # torch's default
    if args.output is not None:
        print(f"wrote {args.output}")
    return 0


def _write(args, device, rows: list[dict]) -> None:
    if args.output is None:
        return
    where = {"type": device.type, "name": torch.cuda.get_device_name(device)
             if device.type == "cuda" else platform.machine(),
             "torch": torch.__version__, "threads": torch.get_num_threads()}
    out = {"run": str(args.run), "device": where, "steps": args.steps,
           "warmup": args.warmup, "rows": rows}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    raise SystemExit(main())
