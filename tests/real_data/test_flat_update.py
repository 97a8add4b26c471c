"""The flat SGD step's Triton kernels (real_data/engines/flat_update.py) against the generic
path's formulas, under Triton's interpreter on a CPU (a subprocess with TRITON_INTERPRET=1;
skipped where Triton is not installed). On a GPU the fast engine's CUDA tests run them inside
the captured step (tests/real_data/test_engine_fast.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from real_data.engines import flat_update

_SCRIPT = r"""
import json, sys
import torch
from real_data.engines.base import OptimizerSpec
from real_data.engines.flat_update import FlatSGD
torch.manual_seed(0)
out = []
shapes = [(5000,), (7, 3), (4, 6, 2), (1,)]
cc = 3
numel = [torch.Size(s).numel() for s in shapes]
SPECS = [(OptimizerSpec("sgd", lr=0.1, momentum=0.9, weight_decay=0.01, clip_grad_norm=2.0),
          True),
         (OptimizerSpec("sgd", lr=0.05), False),
         (OptimizerSpec("sgd", lr=0.05, momentum=0.5, clip_grad_norm=1e9), False)]
for spec, ragged in SPECS:
    flat = torch.randn(cc, sum(numel))
    m = torch.randn(cc, sum(numel)) if spec.momentum else None
    grads = [torch.randn(cc, *s) for s in shapes]
    grads[1] = torch.randn(cc, 3, 7).transpose(1, 2)  # transposed, as a GEMM's weight grad
    grads[2] = torch.randn(cc, 4, 6, 4)[..., ::2]  # another layout: copied first
    on = torch.tensor([True, False, True]) if ragged else torch.ones(cc, dtype=torch.bool)
    # reference: the generic path's formulas
    g = torch.cat([t.reshape(cc, -1) for t in grads], 1).double()
    norms_ref = g.norm(dim=1)
    p_ref, m_ref = flat.double().clone(), (m.double().clone() if m is not None else None)
    if spec.clip_grad_norm is not None:
        g = g * (spec.clip_grad_norm / (norms_ref + 1e-6)).clamp(max=1.0).unsqueeze(1)
    if spec.weight_decay:
        g = g + spec.weight_decay * p_ref
    if spec.momentum:
        m_new = m_ref * spec.momentum + g
        m_ref = torch.where(on.unsqueeze(1), m_new, m_ref)
        g = m_new
    lr = torch.tensor([spec.lr, 2 * spec.lr, 0.5 * spec.lr])  # each client its own lr
    p_ref = torch.where(on.unsqueeze(1), p_ref - lr.double().unsqueeze(1) * g, p_ref)
    sgd = FlatSGD(numel, flat, m, spec, ragged, lr)
    norms, _ = sgd.step(grads, on)
    rel = lambda a, b: float((a.double() - b).abs().max() / b.abs().max())
    out.append([rel(norms, norms_ref), rel(flat, p_ref), rel(m, m_ref) if m is not None else 0.0,
                sgd.nb, len(sgd.tseg), list(sgd._layouts)])
print(json.dumps(out))
"""


@pytest.mark.skipif(flat_update.triton is None, reason="needs Triton")
def test_interpreted_flat_sgd_matches_the_formulas():
    """Clipping, weight decay, momentum and idle clients (ragged); without momentum; with a
    clip that never binds. A 5000-element parameter spans two blocks of 4096; one gradient is
    stored transposed, as a GEMM's weight gradient may be (read in place by the tile kernel),
    one in another strided layout (copied row-major first)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(rows) == 3
    for e_norm, e_param, e_mom, blocks, tiles, layouts in rows:
        assert blocks == 5 and tiles == 1  # 2 + 1 + 1 + 1 blocks; the 7 x 3 one in a tile
        assert layouts == ["rows", "t", "rows", "rows"]
        assert max(e_norm, e_param, e_mom) < 1e-6, (e_norm, e_param, e_mom)
