"""The fast engine's SGD step over its flat ``(Cc, P)`` buffers in two Triton kernels.

After the backward of a local step every client's gradient sits in one tensor per parameter
(``(Cc, *shape)``), while parameters and momentum live in flat ``(Cc, P)`` buffers. The step
needs each client's gradient norm before it can clip, so the generic path concatenates the
gradients into a ``(Cc, P)`` copy, reduces it and updates from it; compiled, that was a
concatenation kernel and one row-wise reduction-and-update kernel, 2.4 ms per step of a
500-client ViT round on an H200 (a quarter above the bytes the step must move).

Here the gradients are read where they are, through a table of their addresses:

1. ``_sumsq_kernel``: one program per (block of one parameter, client) writes the sum of
   squares of its block; the blocks' sums are added in a fixed order (deterministic).
2. ``_sgd_kernel``: one program per (block, client) scales the gradient by the client's clipping
   coefficient, adds weight decay, updates momentum and parameters in place (``torch.optim.SGD``
   with heavy-ball momentum, dampening 0); idle clients (``on`` false) keep theirs.

So the step reads each gradient twice and the parameters and momentum once, and writes the
last two once: the fewest bytes for a clipped step. The address table is filled once per
runner: under CUDA graphs every replay writes the gradients to the same addresses, and an eager
step refills it. Adam and the CPU keep the generic path (:mod:`real_data.engines.fast`).
"""

from __future__ import annotations

import torch

try:  # Triton ships with the CUDA builds of torch; the CPU wheel has none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installation
    triton = None

BLOCK = 4096  # elements of one parameter per program


def usable(flat: torch.Tensor, spec) -> bool:
    """True for SGD (with or without momentum) on a CUDA fp32 buffer with Triton present."""
    return (triton is not None and flat.is_cuda and flat.dtype == torch.float32
            and spec.name == "sgd")


if triton is not None:
    @triton.jit
    def _sumsq_kernel(G, BSEG, BSTART, NUMEL, GSTRIDE, OUT, NB, BLOCK: tl.constexpr):
        blk = tl.program_id(0)
        c = tl.program_id(1).to(tl.int64)
        seg = tl.load(BSEG + blk)
        start = tl.load(BSTART + blk)
        n = tl.load(NUMEL + seg)
        g_ptr = tl.load(G + seg).to(tl.pointer_type(tl.float32))
        i = start + tl.arange(0, BLOCK)
        g = tl.load(g_ptr + c * tl.load(GSTRIDE + seg) + i, mask=i < n, other=0.0)
        tl.store(OUT + c * NB + blk, tl.sum(g * g, 0))

    @triton.jit
    def _sgd_kernel(G, BSEG, BSTART, NUMEL, GSTRIDE, COL, P, M, COEF, ON, P_STRIDE, lr, mu, wd,
                    HAS_COEF: tl.constexpr, HAS_MOMENTUM: tl.constexpr, HAS_WD: tl.constexpr,
                    RAGGED: tl.constexpr, BLOCK: tl.constexpr):
        blk = tl.program_id(0)
        c = tl.program_id(1).to(tl.int64)
        if RAGGED:
            if tl.load(ON + c) == 0:  # an idle client keeps parameters and momentum
                return
        seg = tl.load(BSEG + blk)
        start = tl.load(BSTART + blk)
        n = tl.load(NUMEL + seg)
        g_ptr = tl.load(G + seg).to(tl.pointer_type(tl.float32))
        i = start + tl.arange(0, BLOCK)
        mask = i < n
        g = tl.load(g_ptr + c * tl.load(GSTRIDE + seg) + i, mask=mask, other=0.0)
        off = c * P_STRIDE + tl.load(COL + seg) + i
        p = tl.load(P + off, mask=mask, other=0.0)
        if HAS_COEF:
            g = g * tl.load(COEF + c)
        if HAS_WD:
            g = g + wd * p
        if HAS_MOMENTUM:
            m = tl.load(M + off, mask=mask, other=0.0)
            m = m * mu
            m = m + g
            tl.store(M + off, m, mask=mask)
            g = m
        tl.store(P + off, p - lr * g, mask=mask)


class FlatSGD:
    """Clipped SGD of one runner's flat buffers, reading the per-parameter gradients in place.

    Parameters
    ----------
    numel : list of int
        Elements per client of each parameter, in the flat buffer's column order.
    flat, momentum : torch.Tensor
        ``(Cc, P)`` fp32 parameters and momentum (``None`` without momentum), updated in place.
    spec : OptimizerSpec
        ``sgd`` with its lr, momentum, weight decay and clipping.
    ragged : bool
        Whether some clients may be idle in a step (then ``on`` masks them).
    """

    def __init__(self, numel: list[int], flat: torch.Tensor, momentum: torch.Tensor | None,
                 spec, ragged: bool) -> None:
        dev = flat.device
        self.flat, self.m, self.spec, self.ragged = flat, momentum, spec, ragged
        cols = torch.tensor([0] + numel[:-1], dtype=torch.int64).cumsum(0)
        seg = [(s, start) for s, n in enumerate(numel) for start in range(0, n, BLOCK)]
        self.bseg = torch.tensor([s for s, _ in seg], dtype=torch.int64, device=dev)
        self.bstart = torch.tensor([b for _, b in seg], dtype=torch.int64, device=dev)
        self.numel = torch.tensor(numel, dtype=torch.int64, device=dev)
        self.cols = cols.to(dev)
        self.nb = len(seg)
        self.ptrs = torch.zeros(len(numel), dtype=torch.int64, device=dev)
        self.gstride = torch.zeros(len(numel), dtype=torch.int64, device=dev)
        # pinned host copies: copying them in is a capturable (asynchronous) copy
        self._host = torch.zeros(2, len(numel), dtype=torch.int64,
                                 pin_memory=dev.type == "cuda")
        self.partial = torch.empty(flat.shape[0], self.nb, dtype=torch.float32, device=dev)

    def _table(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each gradient as a ``(Cc, numel)`` row-major tensor, and their addresses copied in."""
        rows = []
        for g in grads:
            g = g.reshape(g.shape[0], -1)
            if g.stride(1) != 1:
                g = g.contiguous()
            rows.append(g)
        self._host[0] = torch.tensor([g.data_ptr() for g in rows], dtype=torch.int64)
        self._host[1] = torch.tensor([g.stride(0) for g in rows], dtype=torch.int64)
        # captured, the copy is a graph node that reads the (then fixed) host table at every
        # replay; eagerly it must finish before the next step rewrites the table
        capturing = self.flat.is_cuda and torch.cuda.is_current_stream_capturing()
        self.ptrs.copy_(self._host[0], non_blocking=capturing)
        self.gstride.copy_(self._host[1], non_blocking=capturing)
        return rows  # kept alive by the caller until the kernels have read them

    def step(self, grads: list[torch.Tensor], on: torch.Tensor) -> tuple[torch.Tensor, list]:
        """One update; returns every client's gradient norm before clipping (fp32) and the
        gradients as read (keep them alive until the kernels ran, as a graph does)."""
        rows = self._table(grads)
        cc = self.flat.shape[0]
        grid = (self.nb, cc)
        _sumsq_kernel[grid](self.ptrs, self.bseg, self.bstart, self.numel, self.gstride,
                            self.partial, self.nb, BLOCK=BLOCK)
        norms = self.partial.sum(1).sqrt()
        spec = self.spec
        coef = None
        if spec.clip_grad_norm is not None:
            coef = (spec.clip_grad_norm / (norms.double() + 1e-6)).clamp(max=1.0).float()
        m = self.m if spec.momentum else self.flat  # M unused without momentum
        _sgd_kernel[grid](self.ptrs, self.bseg, self.bstart, self.numel, self.gstride, self.cols,
                          self.flat, m, coef if coef is not None else norms, on,
                          self.flat.stride(0), float(spec.lr), float(spec.momentum),
                          float(spec.weight_decay), HAS_COEF=coef is not None,
                          HAS_MOMENTUM=bool(spec.momentum), HAS_WD=bool(spec.weight_decay),
                          RAGGED=self.ragged, BLOCK=BLOCK)
        return norms, rows
