"""The LayerNorm whose backward reads its cast output (``stacked._NormCast``, ``_norm``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from real_data.engines.stacked import _norm, _NormCast


def _grad(fn, x, g):
    x = x.clone().requires_grad_(True)
    y = fn(x)
    y.backward(g.to(y.dtype))
    return y.detach(), x.grad


def test_norm_cast_is_layer_norm_in_float64():
    """Cast to the input's own type nothing is rounded: value and input gradient are
    ``F.layer_norm``'s to float64 rounding."""
    torch.manual_seed(0)
    x = torch.randn(3, 7, 16, dtype=torch.float64) * 3 + 1
    g = torch.randn(3, 7, 16, dtype=torch.float64)
    y, dx = _grad(lambda t: _NormCast.apply(t, 1e-5, torch.float64), x, g)
    y_ref, dx_ref = _grad(lambda t: F.layer_norm(t, (16,), None, None, 1e-5), x, g)
    assert float((y - y_ref).abs().max()) < 1e-14
    assert float((dx - dx_ref).abs().max() / dx_ref.abs().max()) < 1e-13


def test_compiled_norm_under_bf16_autocast():
    """Under ``torch.compile`` and bf16 autocast ``_norm`` returns bf16 (the value the next
    GEMM would cast to, within one bf16 rounding) and an input gradient within 1e-2 of the
    fp32 one (its normalized values and incoming gradient are bf16: 2^-9 relative each)."""
    torch.manual_seed(1)
    x = torch.randn(4, 9, 32) * 2 - 1
    g = torch.randn(4, 9, 32)

    def run(t):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return _norm(t, 1e-5)

    y, dx = _grad(torch.compile(run, fullgraph=True), x, g)
    y_ref, dx_ref = _grad(lambda t: F.layer_norm(t, (32,), None, None, 1e-5), x, g)
    assert y.dtype == torch.bfloat16
    assert float((y.float() - y_ref).abs().max() / y_ref.abs().max()) < 8e-3
    assert float((dx - dx_ref).abs().max() / dx_ref.abs().max()) < 1e-2
    # eagerly, and without autocast, it is F.layer_norm itself
    assert run(x).dtype == torch.float32
    assert torch.equal(_norm(x, 1e-5), F.layer_norm(x, (32,), None, None, 1e-5))
