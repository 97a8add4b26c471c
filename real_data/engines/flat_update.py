"""The fast engine's SGD step over its flat ``(Cc, P)`` buffers in two Triton kernels.

After the backward of a local step every client's gradient sits in one tensor per parameter
(``(Cc, *shape)``), while parameters and momentum live in flat ``(Cc, P)`` buffers. The step
needs each client's gradient norm before it can clip, so the generic path concatenates the
gradients into a ``(Cc, P)`` copy, reduces it and updates from it (compiled: a concatenation
kernel and one row-wise reduction-and-update kernel). The kernels here spare that copy; their
cost against it is in docs/bench/NOTES.md (``v3_steps/6_variants_*.json``).

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
        # a block of one gradient's per-client elements in memory order (the sum of squares
        # does not depend on the order, so a transposed block is read as it lies)
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
    def _apply(g, P, M, off, mask, c, COEF, LR, mu, wd, HAS_COEF: tl.constexpr,
               HAS_MOMENTUM: tl.constexpr, HAS_WD: tl.constexpr):
        """Clip, weight decay, momentum and the step on one tile (torch.optim.SGD's order);
        the learning rate is client ``c``'s entry of ``LR`` (data, so a schedule never
        recaptures)."""
        lr = tl.load(LR + c)
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

    @triton.jit
    def _sgd_kernel(G, BSEG, BSTART, NUMEL, GSTRIDE, COL, P, M, COEF, ON, P_STRIDE, LR, mu, wd,
                    HAS_COEF: tl.constexpr, HAS_MOMENTUM: tl.constexpr, HAS_WD: tl.constexpr,
                    RAGGED: tl.constexpr, BLOCK: tl.constexpr):
        # a block of a row-major gradient: the same offsets in the flat buffers
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
        _apply(g, P, M, c * P_STRIDE + tl.load(COL + seg) + i, mask, c, COEF, LR, mu, wd,
               HAS_COEF, HAS_MOMENTUM, HAS_WD)

    @triton.jit
    def _sgd_t_kernel(G, TSEG, TR0, TC0, ROWS, COLS, GSTRIDE, COL, P, M, COEF, ON, P_STRIDE,
                      LR, mu, wd, HAS_COEF: tl.constexpr, HAS_MOMENTUM: tl.constexpr,
                      HAS_WD: tl.constexpr, RAGGED: tl.constexpr, BR: tl.constexpr,
                      BC: tl.constexpr):
        # a (BR, BC) tile of a transposed gradient (element (r, k) at r + k rows, as a GEMM
        # writes a weight gradient): read along r, written row-major along k
        t = tl.program_id(0)
        c = tl.program_id(1).to(tl.int64)
        if RAGGED:
            if tl.load(ON + c) == 0:
                return
        seg = tl.load(TSEG + t)
        rows = tl.load(ROWS + seg)
        cols = tl.load(COLS + seg)
        r = tl.load(TR0 + t) + tl.arange(0, BR)[:, None]
        k = tl.load(TC0 + t) + tl.arange(0, BC)[None, :]
        mask = (r < rows) & (k < cols)
        g_ptr = tl.load(G + seg).to(tl.pointer_type(tl.float32))
        g = tl.load(g_ptr + c * tl.load(GSTRIDE + seg) + r + k * rows, mask=mask, other=0.0)
        _apply(g, P, M, c * P_STRIDE + tl.load(COL + seg) + r * cols + k, mask, c, COEF, LR, mu,
               wd, HAS_COEF, HAS_MOMENTUM, HAS_WD)


def _layout(g: torch.Tensor) -> str:
    """``"rows"``: each client's block row-major; ``"t"``: a 2-d block stored transposed;
    ``"copy"``: anything else (copied row-major first)."""
    if g.dim() >= 2 and g[0].is_contiguous():
        return "rows"
    if g.dim() == 3 and g.stride(1) == 1 and g.stride(2) == g.shape[1]:
        return "t"
    return "copy"


class FlatSGD:
    """Clipped SGD of one runner's flat buffers, reading the per-parameter gradients in place.

    Parameters
    ----------
    numel : list of int
        Elements per client of each parameter, in the flat buffer's column order.
    flat, momentum : torch.Tensor
        ``(Cc, P)`` fp32 parameters and momentum (``None`` without momentum), updated in place.
    spec : OptimizerSpec
        ``sgd`` with its momentum, weight decay and clipping.
    ragged : bool
        Whether some clients may be idle in a step (then ``on`` masks them).
    lr : torch.Tensor
        ``(Cc,)`` fp32 learning rate of each client, read at every step.

    The block tables follow the gradients' layouts, seen at the first step (a warm-up step,
    before a graph is captured); a row-major gradient goes in blocks of ``BLOCK``, a
    transposed one in tiles of ``TILE`` x ``TILE``.
    """

    TILE = 64

    def __init__(self, numel: list[int], flat: torch.Tensor, momentum: torch.Tensor | None,
                 spec, ragged: bool, lr: torch.Tensor) -> None:
        self.flat, self.momentum_buffer, self.lr = flat, momentum, lr
        self.spec, self.ragged = spec, ragged
        self.numel_list = list(numel)
        self.cols_list = torch.tensor([0] + numel[:-1], dtype=torch.int64).cumsum(0).tolist()
        dev = flat.device
        self.ptrs = torch.zeros(len(numel), dtype=torch.int64, device=dev)
        self.gstride = torch.zeros(len(numel), dtype=torch.int64, device=dev)
        # pinned host copies: copying them in is a capturable (asynchronous) copy
        self._host = torch.zeros(2, len(numel), dtype=torch.int64,
                                 pin_memory=dev.type == "cuda")
        self._layouts: tuple[str, ...] | None = None

    def _build(self, grads: list[torch.Tensor], layouts: tuple[str, ...]) -> None:
        """Block tables for the row-major gradients and tile tables for the transposed ones."""
        dev, t = self.flat.device, self.TILE
        blocks = [(s, b) for s, n in enumerate(self.numel_list) for b in range(0, n, BLOCK)]
        tiles = [(s, r, k) for s, (g, lay) in enumerate(zip(grads, layouts)) if lay == "t"
                 for r in range(0, g.shape[1], t) for k in range(0, g.shape[2], t)]
        rows = [g.shape[1] if lay == "t" else 1 for g, lay in zip(grads, layouts)]
        cols = [g.shape[2] if lay == "t" else 1 for g, lay in zip(grads, layouts)]
        i64 = dict(dtype=torch.int64, device=dev)
        self.nb = len(blocks)
        self.bseg = torch.tensor([s for s, _ in blocks], **i64)
        self.bstart = torch.tensor([b for _, b in blocks], **i64)
        self.numel = torch.tensor(self.numel_list, **i64)
        self.cols = torch.tensor(self.cols_list, **i64)
        # the sum of squares covers every gradient; the row-major kernel updates only those
        # not stored transposed (their blocks are listed first, then the others' for sumsq)
        upd = [i for i, (s, _) in enumerate(blocks) if layouts[s] != "t"]
        self.bseg_u = self.bseg[upd] if upd else self.bseg[:0]
        self.bstart_u = self.bstart[upd] if upd else self.bstart[:0]
        self.tseg = torch.tensor([s for s, _, _ in tiles], **i64)
        self.tr0 = torch.tensor([r for _, r, _ in tiles], **i64)
        self.tc0 = torch.tensor([k for _, _, k in tiles], **i64)
        self.trows = torch.tensor(rows, **i64)
        self.tcols = torch.tensor(cols, **i64)
        self.partial = torch.empty(self.flat.shape[0], self.nb, dtype=torch.float32,
                                   device=dev)
        self._layouts = layouts

    def _table(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """The gradients as read (row-major copies of odd layouts), their addresses copied in;
        tables (re)built when the layouts change, which must happen before a capture."""
        layouts = tuple(_layout(g) for g in grads)
        grads = [g.contiguous() if lay == "copy" else g for g, lay in zip(grads, layouts)]
        layouts = tuple("rows" if lay == "copy" else lay for lay in layouts)
        if layouts != self._layouts:
            self._build(grads, layouts)
        self._host[0] = torch.tensor([g.data_ptr() for g in grads], dtype=torch.int64)
        self._host[1] = torch.tensor([g.stride(0) for g in grads], dtype=torch.int64)
        # captured, the copy is a graph node that reads the (then fixed) host table at every
        # replay; eagerly it must finish before the next step rewrites the table
        capturing = self.flat.is_cuda and torch.cuda.is_current_stream_capturing()
        self.ptrs.copy_(self._host[0], non_blocking=capturing)
        self.gstride.copy_(self._host[1], non_blocking=capturing)
        return grads  # kept alive by the caller until the kernels have read them

    def step(self, grads: list[torch.Tensor], on: torch.Tensor) -> tuple[torch.Tensor, list]:
        """One update; returns every client's gradient norm before clipping (fp32) and the
        gradients as read (keep them alive until the kernels ran, as a graph does)."""
        rows = self._table(grads)
        cc = self.flat.shape[0]
        _sumsq_kernel[(self.nb, cc)](self.ptrs, self.bseg, self.bstart, self.numel,
                                     self.gstride, self.partial, self.nb, BLOCK=BLOCK)
        norms = self.partial.sum(1).sqrt()
        spec = self.spec
        coef = None
        if spec.clip_grad_norm is not None:
            coef = (spec.clip_grad_norm / (norms.double() + 1e-6)).clamp(max=1.0).float()
        m = self.momentum_buffer if spec.momentum else self.flat  # M unused without momentum
        common = dict(HAS_COEF=coef is not None, HAS_MOMENTUM=bool(spec.momentum),
                      HAS_WD=bool(spec.weight_decay), RAGGED=self.ragged)
        args = (self.cols, self.flat, m, coef if coef is not None else norms, on,
                self.flat.stride(0), self.lr, float(spec.momentum),
                float(spec.weight_decay))
        if len(self.bseg_u):
            _sgd_kernel[(len(self.bseg_u), cc)](self.ptrs, self.bseg_u, self.bstart_u,
                                                self.numel, self.gstride, *args, **common,
                                                BLOCK=BLOCK)
        if len(self.tseg):
            _sgd_t_kernel[(len(self.tseg), cc)](self.ptrs, self.tseg, self.tr0, self.tc0,
                                                self.trows, self.tcols, self.gstride, *args,
                                                **common, BR=self.TILE, BC=self.TILE)
        return norms, rows
