"""The models' forward pass for C clients at once, clients folded into the batch.

:func:`stacked_forward` computes, for a ViT or a CharTransformer, exactly the function of
``model.forward`` for every client, with each parameter either *stacked* ``(C, *shape)`` (one
value per client) or *shared* ``(*shape)`` (one value for all, e.g. frozen Q/K). Instead of
``vmap`` over a per-client model it calls batched kernels directly:

- a stacked linear is one ``baddbmm`` over clients, ``(C, T, in) @ (C, in, out)`` with T = B N
  tokens per client; q, k and v stacked together become one GEMM of width 3d;
- a shared linear is one plain GEMM over all C T tokens (frozen Q/K cost one large GEMM);
- a LayerNorm whose per-client affine feeds only the clients' own linears leaves the affine to
  be folded into their weights (``fold_norms``, :meth:`_Net.layer_norm`);
- softmax attention holds no weights, so clients and samples fold into one batch of
  ``(C B, h, N, d_h)``: on CUDA in fp16/bf16 with N <= 128 it is the one-tile Triton kernel of
  :mod:`real_data.engines.tiny_attention` (``attention="auto"``; reading the q/k/v GEMM output
  directly, whether all three are the clients' own or q/k are shared), otherwise (or with
  ``attention="sdpa"``) ``scaled_dot_product_attention`` (flash / memory-efficient kernels);
  linear attention is written out as in the model.

The agreement tests (float64, CPU) hold this to the reference engine, which runs the models'
own code, at 1e-6 relative; under bf16 autocast the two round differently (SDPA runs the
softmax in bf16 inside the kernel, the model in fp32).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from real_data.engines import tiny_attention
from real_data.models.char_transformer import CharTransformer
from real_data.models.layers import linear_feature_map
from real_data.models.vit import ViT

Params = dict[str, torch.Tensor]
Fold = tuple[torch.Tensor, torch.Tensor] | None  # a LayerNorm's (C, D) weight and bias
ATTENTION = ("auto", "sdpa", "triton")  # softmax attention kernel; see the module docstring


def supports(model: nn.Module) -> bool:
    """True for the models this module mirrors, without dropout."""
    if type(model) not in (ViT, CharTransformer):
        return False
    return float(getattr(model.cfg, "dropout", 0.0)) == 0.0 or not model.training


def _bias_bmm(b: torch.Tensor, x: torch.Tensor, wt: torch.Tensor) -> torch.Tensor:
    """``b + x @ wt`` per client. Eagerly one ``baddbmm``; under ``torch.compile`` a ``bmm``
    and an add, so the bias joins the next element-wise kernel instead of being broadcast into
    the output by a copy before the GEMM (``baddbmm``'s way, a full pass over the output)."""
    if torch.compiler.is_compiling():
        y = torch.bmm(x, wt)  # under autocast in the autocast type, as baddbmm's output
        return y + b.to(y.dtype)
    return torch.baddbmm(b, x, wt)


class _NormCast(torch.autograd.Function):
    """LayerNorm over the last axis without affine, its output cast to ``dtype``: what the
    next GEMM reads under autocast (the affine is folded into that GEMM's weights).

    The forward is ``F.layer_norm`` and the cast. The backward reads the cast output, which
    the GEMM keeps for its weight gradient anyway, instead of an fp32 copy of the normalized
    values, as the compiled graph otherwise keeps: per LayerNorm and step it spares writing
    and reading one fp32 copy of the activation. It rounds the backward's normalized values
    to ``dtype`` (bf16: 2^-9 relative); the gradient they multiply is the GEMM's, already in
    ``dtype``. The formula is ``native_layer_norm_backward``'s, written out because that op
    recomputes the normalized values from the fp32 input, which is what is not kept here.
    """

    @staticmethod
    def forward(ctx, x, eps, dtype):
        xh, _, rstd = torch.native_layer_norm(x, (x.shape[-1],), None, None, eps)
        y = xh.to(dtype)
        ctx.save_for_backward(y, rstd)
        ctx.in_dtype = x.dtype
        return y

    @staticmethod
    def backward(ctx, g):
        y, rstd = ctx.saved_tensors
        xh, g = y.to(rstd.dtype), g.to(rstd.dtype)  # the input's type (fp32 or wider)
        dx = rstd * (g - g.mean(-1, keepdim=True) - xh * (g * xh).mean(-1, keepdim=True))
        return dx.to(ctx.in_dtype), None, None


def _norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``F.layer_norm`` without affine, for the next GEMM: under ``torch.compile`` with
    autocast to a narrower type, :class:`_NormCast` (output already in that type)."""
    dev = x.device.type
    if (torch.compiler.is_compiling() and torch.is_autocast_enabled(dev)
            and torch.get_autocast_dtype(dev).itemsize < x.dtype.itemsize):
        return _NormCast.apply(x, eps, torch.get_autocast_dtype(dev))
    return F.layer_norm(x, (x.shape[-1],), None, None, eps)


class _Net:
    """Parameter access for one call: ``p(name)`` and whether it has a client axis."""

    def __init__(self, params: Params, stacked: frozenset[str], clients: int,
                 attention: str = "auto", fold_norms: bool = True) -> None:
        if attention not in ATTENTION:
            raise ValueError(f"attention must be one of {ATTENTION}, got {attention!r}")
        self.params, self.stacked, self.c, self.kernel = params, stacked, clients, attention
        self.fold_norms = fold_norms

    def p(self, name: str) -> torch.Tensor:
        return self.params[name]

    def own(self, name: str) -> bool:
        return name in self.stacked

    # -- building blocks, x is (C, T, features) ----------------------------------------------
    def folded(self, prefix: str, fold: Fold) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A linear's weight and bias, with a preceding LayerNorm's affine ``(w, b)`` folded
        in (per-client ``(C, in)`` or shared ``(in,)``): ``(y w + b) W^T + c = y (W diag(w))^T
        + (W b + c)``."""
        w, b = self.p(f"{prefix}.weight"), self.params.get(f"{prefix}.bias")
        if fold is None:
            return w, b
        # (C, in) each, or (in,) when shared; elementwise products, in fp32 under autocast
        lw, lb = fold[0].unsqueeze(-2), fold[1].unsqueeze(-2)
        return w * lw, b + (w * lb).sum(-1)

    def linear(self, x: torch.Tensor, prefix: str, fold: Fold = None) -> torch.Tensor:
        w, b = self.folded(prefix, fold)
        if not self.own(f"{prefix}.weight"):
            if b is None or not self.own(f"{prefix}.bias"):
                return F.linear(x, w, b)
            return F.linear(x, w) + b.unsqueeze(1)
        wt = w.transpose(1, 2)  # (C, in, out)
        if b is None:
            return torch.bmm(x, wt)
        return _bias_bmm(b.unsqueeze(1) if b.dim() == 2 else b, x, wt)

    def fused(self, prefixes: list[str], own: bool,
              fold: Fold = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Weights and biases of several linears side by side (along the output axis)."""
        dim = 1 if own else 0
        wb = [self.folded(q, fold) for q in prefixes]
        return torch.cat([w for w, _ in wb], dim=dim), torch.cat([b for _, b in wb], dim=dim)

    def linears(self, x: torch.Tensor, prefixes: list[str],
                fold: Fold = None) -> list[torch.Tensor]:
        """Several linears of one input, those with stacked (or with shared) weights fused."""
        out: dict[str, torch.Tensor] = {}
        for own in (True, False):
            grp = [q for q in prefixes if f"{q}.bias" in self.params
                   and self.own(f"{q}.weight") == own and self.own(f"{q}.bias") == own]
            if len(grp) < 2:
                continue
            w, b = self.fused(grp, own, fold)
            y = _bias_bmm(b.unsqueeze(1), x, w.transpose(1, 2)) if own else F.linear(x, w, b)
            out.update(zip(grp, y.split([self.p(f"{q}.bias").shape[-1] for q in grp], -1)))
        return [out[q] if q in out else self.linear(x, q, fold) for q in prefixes]

    def layer_norm(self, x: torch.Tensor, prefix: str, eps: float,
                   consumers: tuple[str, ...] = ()) -> tuple[torch.Tensor, Fold]:
        """LayerNorm of ``x`` and the affine left to fold into the next linears.

        When the affine and every consumer linear (``consumers``: those that read the output,
        with weight and bias) are the clients' own, the affine is not applied here: it is
        returned, to be folded into the consumers' weights (:meth:`folded`). So is a shared
        affine that takes no gradient (frozen, as in FedFrozen's value-only stage), whoever
        the consumers are. That is the same function, and it spares the affine's passes over
        the activations (forward, and for a per-client affine its gradient's reductions over
        every token); under bf16 autocast it rounds differently (the normalized values are
        cast, not the affine output).
        """
        w, b = self.p(f"{prefix}.weight"), self.p(f"{prefix}.bias")
        shape = (x.shape[-1],)
        names = [f"{q}.{t}" for q in consumers for t in ("weight", "bias")]
        affine = [f"{prefix}.weight", f"{prefix}.bias"]
        if self.fold_norms and consumers and all(nm in self.params for nm in names) and (
                all(self.own(nm) for nm in affine + names)  # all the clients' own
                or not any(self.own(nm) or self.p(nm).requires_grad for nm in affine)):
            return _norm(x, eps), (w, b)
        if not self.own(f"{prefix}.weight") and not self.own(f"{prefix}.bias"):
            return F.layer_norm(x, shape, w, b, eps), None
        y = F.layer_norm(x, shape, None, None, eps)
        w = w.unsqueeze(1) if self.own(f"{prefix}.weight") else w
        b = b.unsqueeze(1) if self.own(f"{prefix}.bias") else b
        return torch.addcmul(b, y, w), None

    def packed(self, x: torch.Tensor, prefix: str, mod, n: int) -> str | None:
        """Which packed Triton kernel takes q, k, v: ``"qkv"`` when every q/k/v weight and
        bias is the client's own (one stacked GEMM), ``"qk_v"`` when q and k are shared and v
        is the client's own (FedFrozen's frozen stages: one shared GEMM for q and k, a stacked
        one for v), else None; only for softmax attention with the kernel allowed and usable."""
        own = {q: [self.own(f"{prefix}.{q}.{w}") for w in ("weight", "bias")] for q in "qkv"}
        if mod.kind != "softmax" or self.kernel == "sdpa" or \
                not all(f"{prefix}.{q}.bias" in self.params for q in "qkv"):
            return None
        if all(own["q"] + own["k"] + own["v"]):
            kind = "qkv"
        elif not any(own["q"] + own["k"]) and all(own["v"]):
            kind = "qk_v"
        else:
            return None
        if self.kernel == "triton":
            return kind
        dt = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else x.dtype
        return kind if tiny_attention.packed_usable(x, dt, n, x.shape[-1] // mod.heads) else None

    def attention(self, x: torch.Tensor, prefix: str, mod, batch: int, n: int,
                  fold: Fold = None) -> torch.Tensor:
        c, _, d = x.shape
        h = mod.heads
        kind = self.packed(x, prefix, mod, n)
        if kind == "qkv":  # one GEMM, the bias added inside the kernel
            w, b = self.fused([f"{prefix}.{q}" for q in "qkv"], own=True, fold=fold)
            qkv = torch.bmm(x, w.transpose(1, 2))
            y = tiny_attention.qkv_attention(qkv, b.to(qkv.dtype), h, n, mod.causal)
            return self.linear(y, f"{prefix}.out")
        if kind == "qk_v":  # q, k from one shared GEMM; v's bias added inside the kernel
            w, b = self.fused([f"{prefix}.q", f"{prefix}.k"], own=False, fold=fold)
            qk = F.linear(x, w, b)
            wv, bv = self.folded(f"{prefix}.v", fold)
            v = torch.bmm(x, wv.transpose(1, 2))
            y = tiny_attention.qk_v_attention(qk, v, bv.to(v.dtype), h, n, mod.causal)
            return self.linear(y, f"{prefix}.out")
        q, k, v = self.linears(x, [f"{prefix}.q", f"{prefix}.k", f"{prefix}.v"], fold)

        def heads(t: torch.Tensor) -> torch.Tensor:  # (C, B N, D) -> (C B, h, N, D/h)
            return t.reshape(c * batch, n, h, d // h).transpose(1, 2)

        q, k, v = heads(q), heads(k), heads(v)
        if mod.kind == "softmax":
            if self.kernel == "triton" or (self.kernel == "auto"
                                           and tiny_attention.usable(q, k, v)):
                y = tiny_attention.attention(q, k, v, mod.causal)
            else:
                y = F.scaled_dot_product_attention(q, k, v, is_causal=mod.causal)
        else:
            fq, fk = linear_feature_map(q), linear_feature_map(k)
            if mod.causal:
                a = fq @ fk.transpose(-2, -1)  # (C B, h, N, N), nonnegative
                a = a * torch.ones(n, n, dtype=a.dtype, device=x.device).tril()
                y = (a @ v) / (a.sum(-1, keepdim=True) + 1e-6)
            else:
                kv = fk.transpose(-2, -1) @ v  # (C B, h, D/h, D/h)
                z = fq @ fk.sum(dim=-2, keepdim=True).transpose(-2, -1)  # (C B, h, N, 1)
                y = (fq @ kv) / (z + 1e-6)
        y = y.transpose(1, 2).reshape(c, batch * n, d)  # (C B, h, N, D/h) -> (C, B N, D)
        return self.linear(y, f"{prefix}.out")

    def block(self, x: torch.Tensor, i: int, blk, batch: int, n: int) -> torch.Tensor:
        pre = f"blocks.{i}"
        y, fold = self.layer_norm(x, f"{pre}.norm1", blk.norm1.eps,
                                  tuple(f"{pre}.attn.{q}" for q in "qkv"))
        x = x + self.attention(y, f"{pre}.attn", blk.attn, batch, n, fold)
        y, fold = self.layer_norm(x, f"{pre}.norm2", blk.norm2.eps, (f"{pre}.mlp.fc1",))
        hid = self.linear(y, f"{pre}.mlp.fc1", fold)
        hid = F.gelu(hid) if isinstance(blk.mlp.act, nn.GELU) else F.relu(hid)
        return x + self.linear(hid, f"{pre}.mlp.fc2")

    def per_client(self, name: str) -> torch.Tensor:
        """A parameter with a leading client axis (a broadcasting view when shared)."""
        t = self.p(name)
        return t if self.own(name) else t.unsqueeze(0)


def stacked_forward(model: nn.Module, params: Params, stacked: frozenset[str],
                    x: torch.Tensor, attention: str = "auto",
                    fold_norms: bool = True) -> torch.Tensor:
    """Logits of every client on its own minibatch.

    Parameters
    ----------
    model : ViT or CharTransformer
        Only its structure and config are used.
    params : dict
        Every parameter: ``(C, *shape)`` if its name is in ``stacked``, else ``(*shape)``.
    x : torch.Tensor
        ``(C, B, channels, H, W)`` images or ``(C, B, L)`` character ids.
    attention : {"auto", "sdpa", "triton"}
        Softmax attention kernel: the Triton one-tile kernel where it applies ("auto"),
        always SDPA, or always Triton (which then must be usable).
    fold_norms : bool
        Fold a LayerNorm's affine into the next linears' weights where it and all of them are
        the clients' own, or where it is shared and takes no gradient (:meth:`_Net.layer_norm`).

    Returns
    -------
    torch.Tensor
        ``(C, B, num_classes)`` (ViT) or ``(C, B, L, vocab)`` (CharTransformer).
    """
    c, b = x.shape[:2]
    net = _Net(params, stacked, c, attention, fold_norms)
    if isinstance(model, ViT):
        cfg = model.cfg
        _, _, ch, hh, ww = x.shape
        p = cfg.patch
        # (C, B, ch, H, W) -> (C B, H/p, W/p, ch, p, p) -> (C, B Np, ch p p)
        t = x.reshape(c * b, ch, hh // p, p, ww // p, p).permute(0, 2, 4, 1, 3, 5)
        n_patch = (hh // p) * (ww // p)
        t = t.reshape(c, b * n_patch, ch * p * p)
        t = net.linear(t, "patch_embed").reshape(c, b, n_patch, cfg.dim)  # (C, B, Np, D)
        cls = net.per_client("cls").reshape(-1, 1, 1, cfg.dim).expand(c, b, 1, cfg.dim)
        pos = net.per_client("pos")  # (C or 1, 1, N, D)
        t = torch.cat([cls, t], dim=2) + pos  # (C, B, N, D); autocast promotes as the model
        n = n_patch + 1
        h = t.reshape(c, b * n, cfg.dim)
    elif isinstance(model, CharTransformer):
        n = x.shape[2]
        tok = net.p("tok.weight")
        if net.own("tok.weight"):  # (C, V, D): client c's ids offset by c V into (C V, D)
            vocab = tok.shape[1]
            off = torch.arange(c, device=x.device).reshape(c, 1, 1) * vocab
            emb = F.embedding(x + off, tok.reshape(c * vocab, -1))
        else:
            emb = F.embedding(x, tok)
        h = (emb + net.per_client("pos")[:, :, :n]).reshape(c, b * n, -1)  # (C, B L, D)
    else:
        raise TypeError(f"stacked_forward does not support {type(model).__name__}")
    for i, blk in enumerate(model.blocks):
        h = net.block(h, i, blk, b, n)
    h, fold = net.layer_norm(h, "norm", model.norm.eps, ("head",))
    if isinstance(model, ViT):  # pooling is linear: the fold commutes with it
        h = h.reshape(c, b, n, -1)
        h = h[:, :, 0] if model.cfg.pool == "cls" else h[:, :, 1:].mean(dim=2)  # (C, B, D)
        return net.linear(h, "head", fold)
    return net.linear(h, "head", fold).reshape(c, b, n, -1)  # (C, B, L, V)
