"""The one-tile Triton softmax attention (real_data/engines/tiny_attention.py) against SDPA.

On a CPU the kernels run under Triton's interpreter (a subprocess with TRITON_INTERPRET=1;
skipped where Triton is not installed). The interpreter's ``tl.dot`` mishandles bf16, so bf16,
CUDA graphs and ``torch.compile`` are checked on a GPU (skipped elsewhere).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from real_data.engines import tiny_attention

needs_triton = pytest.mark.skipif(tiny_attention.triton is None, reason="needs Triton")
cuda = pytest.mark.skipif(not torch.cuda.is_available() or tiny_attention.triton is None,
                          reason="needs a CUDA device and Triton")

# (B, H, N, D, causal): the ViT's shape, the character model's (causal), odd sizes
SHAPES = [(3, 4, 50, 32, False), (2, 8, 80, 16, True), (2, 2, 7, 5, False), (1, 3, 128, 24, True)]

_SCRIPT = r"""
import json, os, sys
import torch, torch.nn.functional as F
from real_data.engines import tiny_attention as ta
torch.manual_seed(0)
out = []
for dt in (torch.float32, torch.float16):
    for B, H, N, D, causal in json.loads(sys.argv[1]):
        base = torch.randn(B, N, 3, H, D, dtype=torch.float64)
        qkv = base.to(dt).requires_grad_(True)  # q, k, v: strided views, as in the models
        q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
        o = ta.attention(q, k, v, causal)
        g = torch.randn(o.shape, dtype=torch.float64)
        o.backward(g.to(dt))
        ref = base.to(dt).double().requires_grad_(True)
        q2, k2, v2 = (ref[:, :, i].transpose(1, 2) for i in range(3))
        o2 = F.scaled_dot_product_attention(q2, k2, v2, is_causal=causal)
        o2.backward(g)
        rel = lambda a, b: float((a.double() - b).abs().max() / b.abs().max())
        out.append([str(dt), [B, H, N, D, causal], rel(o, o2), rel(qkv.grad, ref.grad),
                    list(o.stride())])
print(json.dumps(out))
"""


@needs_triton
def test_interpreted_kernels_match_sdpa_fp32_fp16():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-c", _SCRIPT, json.dumps(SHAPES)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(rows) == 2 * len(SHAPES)
    for dt, shape, e_out, e_grad, stride in rows:
        tol = 1e-5 if dt == "torch.float32" else 4e-3  # fp16 rounds inputs at 4.9e-4
        assert e_out < tol and e_grad < tol, (dt, shape, e_out, e_grad)
        b, h, n, d, _ = shape
        assert stride == [n * h * d, d, h * d, 1]  # laid out (B, N, H, D)


_PACKED = r"""
import json, sys
import torch, torch.nn.functional as F
from real_data.engines import tiny_attention as ta
from real_data.engines.stacked import stacked_forward
from real_data.models import CharTransformerConfig, ViTConfig, build_model
ta.DELTA_FROM_P = json.loads(sys.argv[2])  # the backward's row sums from P, or from O
torch.manual_seed(0)
rel = lambda a, r: float((a.detach().double() - r).abs().max() / r.abs().max())
out = {"packed": [], "qk_v": [], "models": [], "need_dqk": []}
_packed_bwd = ta._packed_bwd
def spy(*a, need_dqk=True):  # which shared-q/k backwards computed dq and dk
    out["need_dqk"].append(need_dqk)
    return _packed_bwd(*a, need_dqk)
ta._packed_bwd = spy
for dt in (torch.float32, torch.float16):
    for C, B, n, H, D, causal in json.loads(sys.argv[1]):
        qkv0 = torch.randn(C, B * n, 3 * H * D, dtype=torch.float64)
        b0 = torch.randn(C, 3 * H * D, dtype=torch.float64)
        g = torch.randn(C, B * n, H * D, dtype=torch.float64)
        qkv, b = qkv0.to(dt).requires_grad_(), b0.to(dt).requires_grad_()
        o = ta.qkv_attention(qkv, b, H, n, causal)
        o.backward(g.to(dt))
        qr, br = qkv0.to(dt).double().requires_grad_(), b0.to(dt).double().requires_grad_()
        y = qr + br.unsqueeze(1)
        q, k, v = (y[..., i * H * D:(i + 1) * H * D].reshape(C * B, n, H, D).transpose(1, 2)
                   for i in range(3))
        o2 = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        o2 = o2.transpose(1, 2).reshape(C, B * n, H * D)
        o2.backward(g)
        out["packed"].append([str(dt), rel(o, o2), rel(qkv.grad, qr.grad),
                              rel(b.grad, br.grad), list(o.stride())])
        # shared q/k (bias included), the clients' own v and its bias (FedFrozen's frozen stage)
        hd = H * D
        qk = qkv0[..., :2 * hd].to(dt).requires_grad_()
        v = qkv0[..., 2 * hd:].to(dt).requires_grad_()
        bv = b0[:, 2 * hd:].to(dt).requires_grad_()
        o = ta.qk_v_attention(qk, v, bv, H, n, causal)
        o.backward(g.to(dt))
        qkr = qkv0[..., :2 * hd].to(dt).double().requires_grad_()
        vr = qkv0[..., 2 * hd:].to(dt).double().requires_grad_()
        bvr = b0[:, 2 * hd:].to(dt).double().requires_grad_()
        y = torch.cat([qkr, vr + bvr.unsqueeze(1)], -1)
        q, k, vv = (y[..., i * hd:(i + 1) * hd].reshape(C * B, n, H, D).transpose(1, 2)
                    for i in range(3))
        o2 = F.scaled_dot_product_attention(q, k, vv, is_causal=causal)
        o2.transpose(1, 2).reshape(C, B * n, hd).backward(g)
        out["qk_v"].append([str(dt), rel(o, o2.transpose(1, 2).reshape(C, B * n, hd)),
                            rel(qk.grad, qkr.grad), rel(v.grad, vr.grad), rel(bv.grad, bvr.grad)])
vit = build_model("vit", ViTConfig(patch=2, dim=16, depth=2, heads=2, mlp_dim=16, image_size=8,
                                   channels=1, num_classes=5), seed=3)
char = build_model("char_transformer", CharTransformerConfig(dim=16, depth=2, heads=2,
                   mlp_dim=16, vocab_size=11, seq_len=6), seed=3)
for m, x in ((vit, torch.rand(3, 4, 1, 8, 8)), (char, torch.randint(11, (3, 4, 6)))):
    # all stacked: the packed kernel; Q/K shared: the other one; only V stacked (FedFrozen's
    # value-only stage): the other one, the shared LayerNorm affines folded into the linears
    for frozen in ("none", "qk", "all_but_v"):
        base = {k: p.detach() + 0.01 * torch.randn(3, *p.shape) for k, p in m.named_parameters()}
        stacked = frozenset(k for k in base if {"none": True, "all_but_v": ".v." in k,
                                               "qk": not (".q." in k or ".k." in k)}[frozen])
        base = {k: (v if k in stacked else v[0]) for k, v in base.items()}
        res = []
        for kernel in ("sdpa", "triton"):
            # value-only: the shared parameters frozen (no gradient), as the fast engine has them
            ps = {k: v.clone().requires_grad_(frozen != "all_but_v" or k in stacked)
                  for k, v in base.items()}
            y = stacked_forward(m, ps, stacked, x, kernel)
            y.square().sum().backward()
            res.append((y.detach(), torch.cat([ps[k].grad.flatten() for k in sorted(ps)
                                               if ps[k].requires_grad])))
        out["models"].append([type(m).__name__, frozen, rel(res[1][0], res[0][0]),
                              rel(res[1][1], res[0][1])])
print(json.dumps(out))
"""


@needs_triton
@pytest.mark.parametrize("delta_from_p", [True, False])
def test_interpreted_packed_kernel_and_models_match_sdpa(delta_from_p):
    """The packed q/k/v kernel (bias inside, bias gradient out of the backward) and the
    shared-q/k, own-v kernel against SDPA on the biased projections; and the models' stacked
    forward and every parameter's gradient with ``attention="triton"`` against ``"sdpa"``
    (fp32), full (the packed kernel), with Q/K shared and with only V the clients' own (the
    shared-q/k kernel; then the frozen LayerNorm affines are folded); with the
    backward's row sums taken from P (the default) and read from O."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    shapes = [[2, 3, 50, 4, 32, False], [3, 2, 80, 8, 16, True], [2, 2, 7, 2, 5, False]]
    run = subprocess.run([sys.executable, "-c", _PACKED, json.dumps(shapes),
                          json.dumps(delta_from_p)],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(out["packed"]) == 6 and len(out["qk_v"]) == 6 and len(out["models"]) == 6
    # dv alone exactly in the value-only models' first blocks (one per model), where nothing
    # below q and k takes a gradient
    assert out["need_dqk"].count(False) == 2 and True in out["need_dqk"]
    for dt, e_out, e_qkv, e_bias, stride in out["packed"]:
        tol = 1e-5 if dt == "torch.float32" else 4e-3
        assert max(e_out, e_qkv, e_bias) < tol, (dt, e_out, e_qkv, e_bias)
        assert stride[-1] == 1  # (C, T, H D) with each token's heads side by side
    for dt, *errs in out["qk_v"]:
        assert max(errs) < (1e-5 if dt == "torch.float32" else 4e-3), (dt, errs)
    for name, frozen, e_out, e_grad in out["models"]:
        assert e_out < 1e-5 and e_grad < 1e-5, (name, frozen, e_out, e_grad)


def test_usable_only_on_cuda_half_precision_short_sequences():
    q = torch.zeros(2, 4, 50, 32, dtype=torch.bfloat16)
    assert not tiny_attention.usable(q, q, q)  # a CPU tensor
    if torch.cuda.is_available() and tiny_attention.triton is not None:
        assert tiny_attention.usable(q.cuda(), q.cuda(), q.cuda())
        assert not tiny_attention.usable(q.float().cuda(), q.float().cuda(), q.float().cuda())
        long = torch.zeros(2, 4, 129, 32, dtype=torch.bfloat16, device="cuda")
        assert not tiny_attention.usable(long, long, long)


@needs_triton
def test_rejects_long_sequences_with_a_clear_error():
    q = torch.zeros(1, 1, 129, 8)
    with pytest.raises(ValueError, match="N <= 128"):
        tiny_attention.attention(q, q, q)


def _assert_like_flash(ours, flash, exact, names) -> None:
    """Each of ours within 3e-2 of the float64 result (relative to its largest entry) and at
    most twice flash attention's error on the same bf16 inputs."""
    for name, o, f, e in zip(names, ours, flash, exact):
        scale = e.abs().max()
        e_ours = float((o - e).abs().max() / scale)
        e_flash = float((f - e).abs().max() / scale)
        assert e_ours < 3e-2 and e_ours <= 2 * e_flash + 1e-3, (name, e_ours, e_flash)


def _grads(fn, qkv, g, causal):
    qkv = qkv.detach().requires_grad_(True)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    o = fn(q, k, v, causal)
    o.backward(g)
    return o.detach().double(), qkv.grad.double()


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("shape", SHAPES)
def test_cuda_bf16_matches_sdpa(shape):
    """bf16 inputs: the kernel and SDPA's flash kernel both stay within bf16 accuracy of the
    float64 result; the kernel's error is no more than twice flash's."""
    torch.manual_seed(1)
    b, h, n, d, causal = shape
    base = torch.randn(b, n, 3, h, d, device="cuda", dtype=torch.float64)
    g = torch.randn(b, h, n, d, device="cuda", dtype=torch.float64)
    exact = _grads(lambda q, k, v, c: F.scaled_dot_product_attention(q, k, v, is_causal=c),
                   base, g, causal)
    ours = _grads(tiny_attention.attention, base.bfloat16(), g.bfloat16(), causal)
    flash = _grads(lambda q, k, v, c: F.scaled_dot_product_attention(q, k, v, is_causal=c),
                   base.bfloat16(), g.bfloat16(), causal)
    _assert_like_flash(ours, flash, exact, ("output", "grad"))


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("shape", [(50, 3, 50, 4, 32, False), (20, 16, 80, 8, 16, True)])
def test_cuda_bf16_packed_matches_sdpa(shape):
    """The packed kernel in bf16 (C, B, n, H, D, causal): within bf16 accuracy of float64,
    its error at most twice that of flash attention on the same bf16 inputs."""
    torch.manual_seed(3)
    c, b, n, h, d, causal = shape
    qkv = torch.randn(c, b * n, 3 * h * d, device="cuda", dtype=torch.float64)
    bias = torch.randn(c, 3 * h * d, device="cuda", dtype=torch.float64)
    g = torch.randn(c, b * n, h * d, device="cuda", dtype=torch.float64)

    def sdpa(qkv, bias):
        y = qkv + bias.unsqueeze(1)
        q, k, v = (y[..., i * h * d:(i + 1) * h * d].reshape(c * b, n, h, d).transpose(1, 2)
                   for i in range(3))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return o.transpose(1, 2).reshape(c, b * n, h * d)

    def run(fn, dt):
        x = qkv.detach().to(dt).requires_grad_()
        bb = bias.detach().to(dt).requires_grad_()
        fn(x, bb).backward(g.to(dt))
        return [t.detach().double() for t in (fn(x, bb), x.grad, bb.grad)]

    exact = run(sdpa, torch.float64)
    ours = run(lambda x, bb: tiny_attention.qkv_attention(x, bb, h, n, causal), torch.bfloat16)
    flash = run(sdpa, torch.bfloat16)
    _assert_like_flash(ours, flash, exact, ("output", "d qkv", "d bias"))
    # shared q/k with their bias, the clients' own v with its bias in the kernel: the q/k bias
    # is zero for the comparison (it sits in the shared GEMM's output)
    hd = h * d
    bias[:, :2 * hd] = 0

    def qk_v(x, bb):
        return tiny_attention.qk_v_attention(x[..., :2 * hd], x[..., 2 * hd:], bb[:, 2 * hd:],
                                             h, n, causal)

    exact = run(sdpa, torch.float64)
    ours, flash = run(qk_v, torch.bfloat16), run(sdpa, torch.bfloat16)
    ours[2], flash[2], exact[2] = (t[:, 2 * hd:] for t in (ours[2], flash[2], exact[2]))
    _assert_like_flash(ours, flash, exact, ("qk_v output", "qk_v d qkv", "qk_v d v bias"))


@pytest.mark.gpu
@cuda
def test_cuda_graph_and_compile_give_the_eager_result():
    torch.manual_seed(2)
    base = torch.randn(64, 50, 3, 4, 32, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(64, 4, 50, 32, device="cuda", dtype=torch.bfloat16)
    eager = _grads(tiny_attention.attention, base, g, False)
    compiled = _grads(torch.compile(tiny_attention.attention, fullgraph=True), base, g, False)
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)
    qkv = base.clone().requires_grad_(True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            qkv.grad = None
            q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
            tiny_attention.attention(q, k, v).backward(g)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    qkv.grad = None
    with torch.cuda.graph(graph):
        q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
        o = tiny_attention.attention(q, k, v)
        o.backward(g)
    qkv.grad.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(o.double(), eager[0]) and torch.equal(qkv.grad.double(), eager[1])
