"""Softmax attention for short sequences: one Triton program per (sample, head).

The federated models here attend over few tokens (the ViT: 50, the character Transformer: 80)
with narrow heads (32 and 16). The library's flash kernels are built for long sequences and
tile them in large blocks, so at N = 50 much of each tile is padding; the profile of a
500-client ViT round put the cuDNN flash forward and backward at about 15% of the GPU time
(``docs/bench/engines_profile.txt``). Here the whole sequence fits one tile, so a program loads
q, k and v of one (sample, head) once, forms the N x N scores in registers, and writes the
output and the row log-sum-exp; the backward recomputes the scores from them (as flash does)
and writes dq, dk and dv. No online softmax is needed, and nothing of size N^2 reaches memory.

It computes what ``F.scaled_dot_product_attention(q, k, v, is_causal=causal)`` computes, with
the default scale ``1 / sqrt(D)``: scores and softmax in fp32, the probabilities cast to the
input type for the product with v (as the flash kernels do). It is a ``torch.library`` custom
op with its own backward, so it runs under autograd, CUDA graphs and ``torch.compile``.

Used by :mod:`real_data.engines.stacked` on CUDA for fp16/bf16 inputs with N <= 128 and
D <= 128 when Triton is importable (:func:`usable`); everything else runs SDPA. On a CPU the
kernels run only under Triton's interpreter (``TRITON_INTERPRET=1``), which the tests use.
The kernels themselves are in :mod:`real_data.engines.tiny_attention_kernels`; this module
chooses their launch parameters and wraps them as custom ops.
"""

from __future__ import annotations

import math

import torch

from real_data.engines import tiny_attention_kernels as kernels
from real_data.engines.tiny_attention_kernels import triton

MAX_N = 128
MAX_D = 128


def usable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """True when :func:`attention` applies: CUDA, fp16/bf16, N <= 128, D <= 128, Triton."""
    return (triton is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
            and q.dim() == 4 and q.shape == k.shape == v.shape
            and q.dtype == k.dtype == v.dtype
            and q.shape[2] <= MAX_N and q.shape[3] <= MAX_D)


def packed_usable(x: torch.Tensor, dtype: torch.dtype, n: int, d: int) -> bool:
    """True when :func:`qkv_attention` applies to a projection of ``x`` computed in ``dtype``
    (samples of ``n`` tokens, heads of width ``d``)."""
    return (triton is not None and x.is_cuda and dtype in (torch.float16, torch.bfloat16)
            and n <= MAX_N and d <= MAX_D)


# warps per program by tile size (BN), forward and backward; the best of 1-16 measured by
# benchmarks/bench_attention.py on an H200 (docs/bench/attention.json): the ViT's tile
# (64) forward 2, backward 4; the character model's (128) forward 4, backward 2
WARPS = {16: 4, 32: 4, 64: 2, 128: 4}
BWD_WARPS = {16: 4, 32: 4, 64: 4, 128: 2}
# the backward's row sums delta = rowsum(dO * O) taken as rowsum(P * dP) (equal in exact
# arithmetic: both are dO . sum_j P_j v_j), so O is not read
DELTA_FROM_P = True


def _blocks(n: int, d: int, backward: bool = False) -> tuple[int, int, int]:
    bn = max(16, triton.next_power_of_2(n))
    bd = max(16, triton.next_power_of_2(d))
    return bn, bd, (BWD_WARPS if backward else WARPS)[bn]


def _out_like(q: torch.Tensor) -> torch.Tensor:
    """A (B, H, N, D) tensor laid out as (B, N, H, D): the models' next reshape is a view."""
    b, h, n, d = q.shape
    return q.new_empty(b, n, h, d).transpose(1, 2)


def _prec(q: torch.Tensor) -> str:
    return "ieee" if q.dtype in (torch.float32, torch.float64) else "tf32"


def _s3(t: torch.Tensor) -> tuple[int, int, int]:
    """Strides of a (B, H, N, D) tensor over B, H, N (its last axis must have stride 1)."""
    return t.stride(0), t.stride(1), t.stride(2)


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _launch_fwd(q, k, v, bq, bk, bv, sbc, bpc, o, causal):
    b, h, n, d = q.shape
    lse = torch.empty(b, h, n, dtype=torch.float32, device=q.device)
    bn, bd, warps = _blocks(n, d)
    kernels.fwd_kernel[(b * h,)](q, k, v, bq, bk, bv, o, lse, *_s3(q), *_s3(k), *_s3(v), sbc,
                                 *_s3(o), h, n, d, bpc, 1.0 / math.sqrt(d), CAUSAL=causal,
                                 HAS_BIAS=bq is not None, BN=bn, BD=bd, PREC=_prec(q),
                                 num_warps=warps)
    return lse


def _launch_bwd(q, k, v, bq, bk, bv, sbc, bpc, o, do, lse, dq, dk, dv, db, causal,
                need_dqk=True):
    b, h, n, d = q.shape
    bn, bd, warps = _blocks(n, d, backward=True)
    kernels.bwd_kernel[(b * h,)](q, k, v, bq, bk, bv, o, do, lse, dq, dk, dv, db,
                                 *_s3(q), *_s3(k), *_s3(v), sbc, *_s3(o), *_s3(do), *_s3(dq),
                                 *_s3(dv), 0 if db is None else db.stride(0), h, n, d, bpc,
                                 1.0 / math.sqrt(d), CAUSAL=causal, HAS_BIAS=bq is not None,
                                 BN=bn, BD=bd, PREC=_prec(q), DELTA_FROM_P=DELTA_FROM_P,
                                 NEED_DQK=need_dqk, num_warps=warps)


# -- separate q, k, v ------------------------------------------------------------------------
@torch.library.custom_op("linattn::tiny_attention", mutates_args=())
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
    o = _out_like(q)
    lse = _launch_fwd(q, k, v, None, None, None, 0, 1, o, causal)
    return o, lse


@_attention_op.register_fake
def _(q, k, v, causal):
    b, h, n, _ = q.shape
    return _out_like(q), q.new_empty(b, h, n, dtype=torch.float32)


@torch.library.custom_op("linattn::tiny_attention_backward", mutates_args=())
def _backward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                 do: torch.Tensor, lse: torch.Tensor,
                 causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q, k, v, o, do = (_unit_last(t) for t in (q, k, v, o, do))
    dq, dk, dv = _out_like(q), _out_like(q), _out_like(q)
    _launch_bwd(q, k, v, None, None, None, 0, 1, o, do, lse, dq, dk, dv, None, causal)
    return dq, dk, dv


@_backward_op.register_fake
def _(q, k, v, o, do, lse, causal):
    return _out_like(q), _out_like(q), _out_like(q)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, causal = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse)
    ctx.causal = causal


def _backward(ctx, do, _dlse):
    q, k, v, o, lse = ctx.saved_tensors
    dq, dk, dv = _backward_op(q, k, v, o, do, lse, ctx.causal)
    return dq, dk, dv, None


_attention_op.register_autograd(_backward, setup_context=_setup_context)


# -- packed: one (C, T, 3 H D) GEMM output and its per-client bias ----------------------------
def _heads(x: torch.Tensor, heads: int, n: int, parts: int) -> list[torch.Tensor]:
    """``parts`` (C T / n, H, n, D) views of a (C, T, parts H D) tensor."""
    c, t, width = x.shape
    y = x.view(c * t // n, n, parts, heads, width // (parts * heads))
    return [y[:, :, i].transpose(1, 2) for i in range(parts)]


def _split(qkv: torch.Tensor, heads: int, n: int) -> list[torch.Tensor]:
    """q, k, v of a (C, T, 3 H D) tensor as (C T / n, H, n, D) views."""
    return _heads(qkv, heads, n, 3)


def _packed_fwd(q, k, v, bias: torch.Tensor, out: torch.Tensor, heads: int, n: int,
                causal: bool) -> torch.Tensor:
    """Forward of the packed ops: q, k, v as (C T / n, H, n, D) views, ``bias`` (C, 3 H D)
    added in the kernel, the output written into ``out`` (C, T, H D); returns the lse."""
    c, t, hd = out.shape
    (o,) = _heads(out, heads, n, 1)
    return _launch_fwd(q, k, v, bias, bias[:, hd:], bias[:, 2 * hd:], bias.stride(0), t // n,
                       o, causal)


def _packed_bwd(q, k, v, dq, dk, dv, bias: torch.Tensor, out: torch.Tensor,
                dout: torch.Tensor, lse: torch.Tensor, heads: int, n: int,
                causal: bool, need_dqk: bool = True) -> torch.Tensor:
    """Backward of the packed ops into the views dq, dk, dv (without ``need_dqk`` dv alone:
    dq and dk are not written, and the q/k part of the bias gradient is zero); returns the
    bias gradient."""
    c, t, hd = out.shape
    part = torch.empty(c * t // n, 3 * hd, dtype=torch.float32, device=out.device)
    _launch_bwd(q, k, v, bias, bias[:, hd:], bias[:, 2 * hd:], bias.stride(0), t // n,
                _heads(out, heads, n, 1)[0], _heads(dout, heads, n, 1)[0], lse, dq, dk, dv,
                part, causal, need_dqk)
    return part.view(c, t // n, 3 * hd).sum(1).to(bias.dtype)


@torch.library.custom_op("linattn::tiny_qkv_attention", mutates_args=())
def _qkv_op(qkv: torch.Tensor, bias: torch.Tensor, heads: int, n: int,
            causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    qkv, bias = qkv.contiguous(), bias.contiguous()
    c, t, three_hd = qkv.shape
    out = qkv.new_empty(c, t, three_hd // 3)
    return out, _packed_fwd(*_split(qkv, heads, n), bias, out, heads, n, causal)


@_qkv_op.register_fake
def _(qkv, bias, heads, n, causal):
    c, t, three_hd = qkv.shape
    return qkv.new_empty(c, t, three_hd // 3), qkv.new_empty(c * t // n, heads, n,
                                                             dtype=torch.float32)


@torch.library.custom_op("linattn::tiny_qkv_attention_backward", mutates_args=())
def _qkv_backward_op(qkv: torch.Tensor, bias: torch.Tensor, out: torch.Tensor,
                     dout: torch.Tensor, lse: torch.Tensor, heads: int, n: int,
                     causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    qkv, bias, out, dout = (t.contiguous() for t in (qkv, bias, out, dout))
    dqkv = torch.empty_like(qkv)
    dbias = _packed_bwd(*_split(qkv, heads, n), *_split(dqkv, heads, n), bias, out, dout, lse,
                        heads, n, causal)
    return dqkv, dbias


@_qkv_backward_op.register_fake
def _(qkv, bias, out, dout, lse, heads, n, causal):
    return torch.empty_like(qkv), torch.empty_like(bias)


def _qkv_setup_context(ctx, inputs, output) -> None:
    qkv, bias, heads, n, causal = inputs
    out, lse = output
    ctx.save_for_backward(qkv, bias, out, lse)
    ctx.heads, ctx.n, ctx.causal = heads, n, causal


def _qkv_backward(ctx, dout, _dlse):
    qkv, bias, out, lse = ctx.saved_tensors
    dqkv, dbias = _qkv_backward_op(qkv, bias, out, dout, lse, ctx.heads, ctx.n, ctx.causal)
    return dqkv, dbias, None, None, None


_qkv_op.register_autograd(_qkv_backward, setup_context=_qkv_setup_context)


# -- shared q/k, the clients' own v: FedFrozen's frozen stages --------------------------------
@torch.library.custom_op("linattn::tiny_qk_v_attention", mutates_args=())
def _qk_v_op(qk: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, heads: int, n: int,
             causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    qk, v, bias = qk.contiguous(), v.contiguous(), bias.contiguous()
    out = torch.empty_like(v)
    return out, _packed_fwd(*_heads(qk, heads, n, 2), *_heads(v, heads, n, 1), bias, out,
                            heads, n, causal)


@_qk_v_op.register_fake
def _(qk, v, bias, heads, n, causal):
    c, t, hd = v.shape
    return v.new_empty(c, t, hd), v.new_empty(c * t // n, heads, n, dtype=torch.float32)


@torch.library.custom_op("linattn::tiny_qk_v_attention_backward", mutates_args=())
def _qk_v_backward_op(qk: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, out: torch.Tensor,
                      dout: torch.Tensor, lse: torch.Tensor, heads: int, n: int,
                      causal: bool, need_dqk: bool
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """d(qk) (empty without ``need_dqk``: in the first block of the value-only stage nothing
    below q and k takes a gradient), dv and the bias gradient."""
    qk, v, bias, out, dout = (t.contiguous() for t in (qk, v, bias, out, dout))
    dqk = torch.empty_like(qk) if need_dqk else qk.new_empty(0)
    dv = torch.empty_like(v)
    # without need_dqk the kernel writes no dq/dk: dv's views only fill the arguments
    dq, dk = _heads(dqk, heads, n, 2) if need_dqk else _heads(dv, heads, n, 1) * 2
    dbias = _packed_bwd(*_heads(qk, heads, n, 2), *_heads(v, heads, n, 1), dq, dk,
                        *_heads(dv, heads, n, 1), bias, out, dout, lse, heads, n, causal,
                        need_dqk=need_dqk)
    return dqk, dv, dbias


@_qk_v_backward_op.register_fake
def _(qk, v, bias, out, dout, lse, heads, n, causal, need_dqk):
    dqk = torch.empty_like(qk) if need_dqk else qk.new_empty(0)
    return dqk, torch.empty_like(v), torch.empty_like(bias)


def _qk_v_setup_context(ctx, inputs, output) -> None:
    qk, v, bias, heads, n, causal = inputs
    out, lse = output
    ctx.save_for_backward(qk, v, bias, out, lse)
    ctx.heads, ctx.n, ctx.causal = heads, n, causal


def _qk_v_backward(ctx, dout, _dlse):
    qk, v, bias, out, lse = ctx.saved_tensors
    need_dqk = ctx.needs_input_grad[0]
    dqk, dv, dbias = _qk_v_backward_op(qk, v, bias, out, dout, lse, ctx.heads, ctx.n,
                                       ctx.causal, need_dqk)
    return (dqk if need_dqk else None), dv, dbias, None, None, None


_qk_v_op.register_autograd(_qk_v_backward, setup_context=_qk_v_setup_context)


def qk_v_attention(qk: torch.Tensor, v: torch.Tensor, v_bias: torch.Tensor, heads: int, n: int,
                   causal: bool = False) -> torch.Tensor:
    """Attention with q and k from one projection shared by the clients (``qk``: ``(C, T,
    2 H D)``, its bias included) and v from each client's own (``v``: ``(C, T, H D)`` without
    its bias ``v_bias``: ``(C, H D)``), as in FedFrozen's frozen stages. Returns ``(C, T, H D)``.

    As :func:`qkv_attention`: v's bias is added inside the kernel, its gradient comes out of
    the backward, and d(qk) is written in the layout of ``qk`` (no concatenation pass).
    """
    c, t, hd = v.shape
    if hd % heads or t % n or qk.shape != (c, t, 2 * hd) or v_bias.shape != (c, hd):
        raise ValueError(f"qk_v_attention: qk {tuple(qk.shape)}, v {tuple(v.shape)} and bias "
                         f"{tuple(v_bias.shape)} do not fit {heads} heads over samples of "
                         f"{n} tokens")
    _check(n, hd // heads)
    bias = torch.cat([v_bias.new_zeros(c, 2 * hd), v_bias], dim=1)  # q and k have theirs
    return _qk_v_op(qk, v, bias, heads, n, causal)[0]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              causal: bool = False) -> torch.Tensor:
    """``softmax(q k^T / sqrt(D)) v`` of ``(B, H, N, D)`` tensors (causal: keys <= query).

    Returns a ``(B, H, N, D)`` tensor laid out as ``(B, N, H, D)``. Requires Triton, and (outside
    its interpreter) CUDA tensors; see :func:`usable`.
    """
    _check(q.shape[2], q.shape[3])
    return _attention_op(q, k, v, causal)[0]


def qkv_attention(qkv: torch.Tensor, bias: torch.Tensor, heads: int, n: int,
                  causal: bool = False) -> torch.Tensor:
    """Attention of a fused projection: ``qkv`` is ``(C, T, 3 H D)`` without its bias (T = B n
    tokens of B samples of n tokens per client; q, k, v side by side along the last axis, as
    the stacked q/k/v GEMM writes them), ``bias`` is ``(C, 3 H D)``. Returns ``(C, T, H D)``,
    each sample's heads side by side (the input layout of the output projection).

    The bias is added inside the kernel and its gradient (the sum of d(qkv) over each
    client's tokens) comes out of the backward kernel, so no pass over the ``(C, T, 3 H D)``
    activation is spent on it.
    """
    c, t, three_hd = qkv.shape
    if three_hd % (3 * heads) or t % n or bias.shape != (c, three_hd):
        raise ValueError(f"qkv_attention: qkv {tuple(qkv.shape)} and bias {tuple(bias.shape)} "
                         f"do not fit {heads} heads over samples of {n} tokens")
    _check(n, three_hd // (3 * heads))
    return _qkv_op(qkv, bias, heads, n, causal)[0]


def _check(n: int, d: int) -> None:
    if triton is None:
        raise RuntimeError("tiny_attention needs Triton (it ships with torch's CUDA builds)")
    if n > MAX_N or d > MAX_D:
        raise ValueError(f"tiny_attention takes N <= {MAX_N} and D <= {MAX_D}, got "
                         f"N = {n}, D = {d}")
