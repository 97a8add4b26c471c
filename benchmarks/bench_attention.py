"""Attention kernels of a 500-client round, forward + backward, side by side on one GPU.

For the ViT (C B = 500 x 32 samples of 50 tokens, 4 heads of 32) and the character model
(500 x 16 samples of 80 tokens, 8 heads of 16, causal), bf16, from the packed (C, T, 3 H D)
output of the q/k/v GEMM and its bias, as the stacked forward has them:

- ``sdpa``: bias add, then ``scaled_dot_product_attention`` on the strided q, k, v views
  (cuDNN / flash kernels), the fast engine's ``attention="sdpa"`` path;
- ``tiny``: bias add, then the one-tile Triton kernel on the same views;
- ``packed``: :func:`~real_data.engines.tiny_attention.qkv_attention` (bias inside the kernel,
  bias gradient out of the backward), at each number of warps per program in ``--warps`` (the
  same in both kernels), and at the defaults (``packed_default``: ``WARPS`` forward,
  ``BWD_WARPS`` backward);
- ``packed_delta_from_o``: the defaults, with the backward's row sums read from O (as flash
  attention does) instead of taken from P (``tiny_attention.DELTA_FROM_P``).

Median of CUDA-event timings after warm-up; one JSON row per (model, variant).
Usage: ``python benchmarks/bench_attention.py [--warps 2,4,8] [--out FILE]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

from real_data.engines import tiny_attention

SHAPES = {"vit": (500, 32, 50, 4, 32, False), "char": (500, 16, 80, 8, 16, True)}


def _time(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def _bench(name: str, shape: tuple, warps_list: list[int], repeats: int) -> list[dict]:
    c, b, n, h, d, causal = shape
    dev = torch.device("cuda")
    qkv = torch.randn(c, b * n, 3 * h * d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    bias = torch.randn(c, 3 * h * d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(c, b * n, h * d, device=dev, dtype=torch.bfloat16)

    def views(fn):
        y = qkv + bias.unsqueeze(1)
        q, k, v = (y[..., i * h * d:(i + 1) * h * d].reshape(c * b, n, h, d).transpose(1, 2)
                   for i in range(3))
        return fn(q, k, v).transpose(1, 2).reshape(c, b * n, h * d)

    def sdpa():
        return views(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal))

    def tiny():
        return views(lambda q, k, v: tiny_attention.attention(q, k, v, causal))

    def packed():
        return tiny_attention.qkv_attention(qkv, bias, h, n, causal)

    bn = max(16, 1 << (n - 1).bit_length())
    fwd_default, bwd_default = tiny_attention.WARPS[bn], tiny_attention.BWD_WARPS[bn]
    variants = [("sdpa", sdpa, fwd_default, bwd_default),
                ("tiny", tiny, fwd_default, bwd_default)]
    variants += [(f"packed_w{w}", packed, w, w)
                 for w in sorted(set(warps_list) | {fwd_default, bwd_default})]
    variants.append(("packed_default", packed, fwd_default, bwd_default))
    variants.append(("packed_delta_from_o", packed, fwd_default, bwd_default))
    rows = []
    delta_default = tiny_attention.DELTA_FROM_P
    for vname, fn, wf, wb in variants:
        tiny_attention.WARPS[bn], tiny_attention.BWD_WARPS[bn] = wf, wb
        tiny_attention.DELTA_FROM_P = delta_default and vname != "packed_delta_from_o"
        try:
            fwd = _time(fn, repeats)
            both = _time(lambda fn=fn: fn().backward(g), repeats)
        finally:
            tiny_attention.WARPS[bn], tiny_attention.BWD_WARPS[bn] = fwd_default, bwd_default
            tiny_attention.DELTA_FROM_P = delta_default
        rows.append({"model": name, "variant": vname, "warps": wf, "bwd_warps": wb,
                     "shape": list(shape), "fwd_ms": fwd * 1e3, "fwd_bwd_ms": both * 1e3})
        print(f"{name:5s} {vname:14s} fwd {fwd * 1e3:7.3f} ms  fwd+bwd {both * 1e3:7.3f} ms",
              flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--warps", default="2,4,8")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    warps = [int(x) for x in args.warps.split(",")]
    rows = [r for name, shape in SHAPES.items() for r in _bench(name, shape, warps, args.repeats)]
    if args.out:
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                        "torch": torch.__version__, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
