"""The Triton kernels of :mod:`real_data.engines.tiny_attention`: one program per (sample, head).

A program loads q, k and v of one (sample, head) (with a client's bias added when the q/k/v
GEMM output comes without it), forms the N x N scores in registers and writes the output and
the row log-sum-exp (:func:`fwd_kernel`), or recomputes the scores from them and writes dq, dk,
dv and the bias gradient (:func:`bwd_kernel`). The launch parameters (tile sizes, warps,
strides) are chosen by :mod:`real_data.engines.tiny_attention`.
"""

from __future__ import annotations

try:  # Triton ships with the CUDA builds of torch; the CPU wheel has none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installation
    triton = None

if triton is not None:
    @triton.jit
    def _load_qkv(Q, K, V, BQ, BK, BV, sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sbc,
                  b, h, n, d, m2, md, BPC, D, HAS_BIAS: tl.constexpr):
        """q, k, v of sample b, head h (the last axis has stride 1); with HAS_BIAS, plus the
        bias of b's client (b // BPC), rounded to the input type as a GEMM's output is."""
        q = tl.load(Q + b * sqb + h * sqh + n[:, None] * sqn + d[None, :], mask=m2, other=0.0)
        k = tl.load(K + b * skb + h * skh + n[:, None] * skn + d[None, :], mask=m2, other=0.0)
        v = tl.load(V + b * svb + h * svh + n[:, None] * svn + d[None, :], mask=m2, other=0.0)
        if HAS_BIAS:
            ob = (b // BPC) * sbc + h * D + d
            q = (q.to(tl.float32) + tl.load(BQ + ob, mask=md, other=0.0)[None, :]).to(q.dtype)
            k = (k.to(tl.float32) + tl.load(BK + ob, mask=md, other=0.0)[None, :]).to(k.dtype)
            v = (v.to(tl.float32) + tl.load(BV + ob, mask=md, other=0.0)[None, :]).to(v.dtype)
            q = tl.where(m2, q, 0.0)
            k = tl.where(m2, k, 0.0)
            v = tl.where(m2, v, 0.0)
        return q, k, v

    @triton.jit
    def _tile(Q, K, V, BQ, BK, BV, sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sbc, H, N, D,
              BPC, scale, CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, BN: tl.constexpr,
              BD: tl.constexpr, PREC: tl.constexpr):
        """This program's (sample b, head h), its row/column indices and masks, q, k, v, the
        scaled scores q k^T and which of them count."""
        pid = tl.program_id(0).to(tl.int64)
        b = pid // H
        h = pid % H
        n = tl.arange(0, BN)
        d = tl.arange(0, BD)
        mn = n < N
        md = d < D
        m2 = mn[:, None] & md[None, :]
        q, k, v = _load_qkv(Q, K, V, BQ, BK, BV, sqb, sqh, sqn, skb, skh, skn, svb, svh, svn,
                            sbc, b, h, n, d, m2, md, BPC, D, HAS_BIAS)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale
        valid = mn[None, :] & (n[:, None] >= 0)
        if CAUSAL:
            valid = valid & (n[None, :] <= n[:, None])
        return pid, b, h, n, d, mn, md, m2, q, k, v, s, valid

    @triton.jit
    def fwd_kernel(Q, K, V, BQ, BK, BV, O, L,
                    sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sbc, sob, soh, son,
                    H, N, D, BPC, scale,
                    CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, BN: tl.constexpr,
                    BD: tl.constexpr, PREC: tl.constexpr):
        pid, b, h, n, d, mn, md, m2, q, k, v, s, valid = _tile(
            Q, K, V, BQ, BK, BV, sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sbc, H, N, D, BPC,
            scale, CAUSAL, HAS_BIAS, BN, BD, PREC)
        s = tl.where(valid, s, float("-inf"))
        mx = tl.max(s, 1)
        p = tl.exp(s - mx[:, None])
        den = tl.sum(p, 1)
        p = p / den[:, None]
        o = tl.dot(p.to(v.dtype), v, input_precision=PREC)
        tl.store(O + b * sob + h * soh + n[:, None] * son + d[None, :],
                 o.to(O.dtype.element_ty), mask=m2)
        tl.store(L + pid * N + n, mx + tl.log(den), mask=mn)

    @triton.jit
    def bwd_kernel(Q, K, V, BQ, BK, BV, O, DO, L, DQ, DK, DV, DB,
                    sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sbc, sob, soh, son,
                    sgb, sgh, sgn, srb, srh, srn, swb, swh, swn, sdb,
                    H, N, D, BPC, scale,
                    CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, BN: tl.constexpr,
                    BD: tl.constexpr, PREC: tl.constexpr, DELTA_FROM_P: tl.constexpr,
                    NEED_DQK: tl.constexpr):
        # DO has strides sg*; DQ and DK share the strides sr*, DV has sw*; with HAS_BIAS, DB
        # gets the sample's bias gradient (dq, dk, dv summed over its tokens), one row of
        # 3 H D per sample; with DELTA_FROM_P, O is not read; without NEED_DQK only dv is
        # computed (and zeros for the q/k bias gradient)
        pid, b, h, n, d, mn, md, m2, q, k, v, s, valid = _tile(
            Q, K, V, BQ, BK, BV, sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sbc, H, N, D, BPC,
            scale, CAUSAL, HAS_BIAS, BN, BD, PREC)
        do = tl.load(DO + b * sgb + h * sgh + n[:, None] * sgn + d[None, :], mask=m2,
                     other=0.0)
        lse = tl.load(L + pid * N + n, mask=mn, other=0.0)
        p = tl.where(valid, tl.exp(s - lse[:, None]), 0.0)
        dv = tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PREC)
        tl.store(DV + b * swb + h * swh + n[:, None] * swn + d[None, :],
                 dv.to(DV.dtype.element_ty), mask=m2)
        ob = b * sdb + h * D + d
        if HAS_BIAS:  # the stored (rounded) values, as a bias gradient of the GEMM output
            tl.store(DB + ob + 2 * H * D,
                     tl.sum(dv.to(DV.dtype.element_ty).to(tl.float32), 0), mask=md)
        if NEED_DQK:
            dp = tl.dot(do, tl.trans(v), input_precision=PREC)
            if DELTA_FROM_P:
                delta = tl.sum(p * dp, 1)
            else:
                o = tl.load(O + b * sob + h * soh + n[:, None] * son + d[None, :], mask=m2,
                            other=0.0)
                delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)
            ds = p * (dp - delta[:, None])
            dq = tl.dot(ds.to(k.dtype), k, input_precision=PREC) * scale
            dk = tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PREC) * scale
            offr = b * srb + h * srh + n[:, None] * srn + d[None, :]
            tl.store(DQ + offr, dq.to(DQ.dtype.element_ty), mask=m2)
            tl.store(DK + offr, dk.to(DK.dtype.element_ty), mask=m2)
            if HAS_BIAS:
                tl.store(DB + ob, tl.sum(dq.to(DQ.dtype.element_ty).to(tl.float32), 0),
                         mask=md)
                tl.store(DB + ob + H * D,
                         tl.sum(dk.to(DK.dtype.element_ty).to(tl.float32), 0), mask=md)
        elif HAS_BIAS:
            zero = tl.zeros([BD], dtype=tl.float32)
            tl.store(DB + ob, zero, mask=md)
            tl.store(DB + ob + H * D, zero, mask=md)
