"""The LayerNorm whose backward reads its cast output (``stacked._NormCast``, ``_norm``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from real_data.engines.stacked import _norm, _NormCast


def _grad(fn, x, g):
    x = x.clone().requires_grad_(True)
    y = fn(x)
    y.backward(g.to(y.dtype))
    return y.detach(), x.grad


@pytest.mark.parametrize("affine", [False, True])
def test_norm_cast_is_layer_norm_in_float64(affine):
    """Cast to the input's own type nothing is rounded: value and input gradient are
    ``F.layer_norm``'s (the affine fixed, as in the frozen stages) to float64 rounding."""
    torch.manual_seed(0)
    x = torch.randn(3, 7, 16, dtype=torch.float64) * 3 + 1
    g = torch.randn(3, 7, 16, dtype=torch.float64)
    w, b = (torch.randn(16, dtype=torch.float64), torch.randn(16, dtype=torch.float64)) \
        if affine else (None, None)
    y, dx = _grad(lambda t: _NormCast.apply(t, w, b, 1e-5, torch.float64), x, g)
    y_ref, dx_ref = _grad(lambda t: F.layer_norm(t, (16,), w, b, 1e-5), x, g)
    assert float((y - y_ref).abs().max()) < 1e-14
    assert float((dx - dx_ref).abs().max() / dx_ref.abs().max()) < 1e-13


@pytest.mark.parametrize("affine", [False, True])
def test_compiled_norm_under_bf16_autocast(affine):
    """Under ``torch.compile`` and bf16 autocast ``_norm`` returns bf16 (the value the next
    GEMM would cast to, within one bf16 rounding) and an input gradient within 1e-2 of the
    fp32 one (its normalized values and incoming gradient are bf16: 2^-9 relative each)."""
    torch.manual_seed(1)
    x = torch.randn(4, 9, 32) * 2 - 1
    g = torch.randn(4, 9, 32)
    w, b = (torch.rand(32) + 0.5, torch.randn(32)) if affine else (None, None)

    def run(t):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return _norm(t, 1e-5, w, b)

    y, dx = _grad(torch.compile(run, fullgraph=True), x, g)
    y_ref, dx_ref = _grad(lambda t: F.layer_norm(t, (32,), w, b, 1e-5), x, g)
    assert y.dtype == torch.bfloat16
    assert float((y.float() - y_ref).abs().max() / y_ref.abs().max()) < 8e-3
    assert float((dx - dx_ref).abs().max() / dx_ref.abs().max()) < 1e-2
    # eagerly it is F.layer_norm itself
    assert run(x).dtype == torch.float32
    assert _norm(x, 1e-5, w, b).dtype == torch.float32


def test_compiled_norm_with_a_trained_affine_is_layer_norm():
    """An affine that takes a gradient is left to ``F.layer_norm`` under compile and autocast
    too (``_NormCast`` gives it none): its gradients are ``F.layer_norm``'s."""
    torch.manual_seed(2)
    x = torch.randn(4, 9, 32)
    g = torch.randn(4, 9, 32)
    grads = []
    for compiled in (True, False):
        w = (torch.rand(32) + 0.5).requires_grad_()
        b = torch.randn(32).requires_grad_()

        def run(t, w=w, b=b):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return _norm(t, 1e-5, w, b)

        fn = torch.compile(run, fullgraph=True) if compiled else \
            (lambda t, w=w, b=b: F.layer_norm(t, (32,), w, b, 1e-5))
        y = fn(x)
        assert y.dtype == torch.float32
        y.backward(g)
        grads.append((w.grad, b.grad))
    for a, r in zip(grads[0], grads[1]):
        assert a is not None and torch.allclose(a, r, rtol=1e-4, atol=1e-5)
