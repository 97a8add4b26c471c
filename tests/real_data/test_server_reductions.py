"""The server's batched reductions against per-parameter float64 references: the weighted
average of the uploads, the update dispersion and the Q/K relative change, each with chunks
smaller than one parameter, than the model, and larger than the model."""

import numpy as np
import pytest
import torch

from real_data.algorithms.base import weighted_average, weighted_averages
from real_data.metrics import relative_change, update_dispersion

SHAPES = {"a": (3, 4), "b": (7,), "c": (2, 3, 5), "d": (1,)}
C = 6


def _params(seed: int, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    glob = {n: torch.randn(s, generator=g, dtype=dtype) for n, s in SHAPES.items()}
    clients = {n: torch.randn((C, *s), generator=g, dtype=dtype) for n, s in SHAPES.items()}
    w = torch.rand(C, generator=g, dtype=torch.float64) + 0.1
    return glob, clients, w / w.sum()


@pytest.mark.parametrize("chunk", [1, 10, 40, 1 << 26])
def test_weighted_averages_equal_per_parameter(chunk):
    _, clients, w = _params(0)
    got = weighted_averages(clients, w, chunk_numbers=chunk)
    assert list(got) == list(clients)
    for n, t in clients.items():
        assert got[n].shape == t.shape[1:]
        torch.testing.assert_close(got[n], weighted_average(t, w), rtol=0, atol=1e-14)
        ref = np.tensordot(w.numpy(), t.numpy(), axes=1)
        np.testing.assert_allclose(got[n].numpy(), ref, rtol=0, atol=1e-13)


def test_weighted_averages_mixed_dtypes():
    _, clients, w = _params(1)
    clients["b"] = clients["b"].float()
    got = weighted_averages(clients, w)
    assert got["b"].dtype == torch.float32 and got["a"].dtype == torch.float64
    torch.testing.assert_close(got["b"], weighted_average(clients["b"], w))


@pytest.mark.parametrize("chunk", [1, 10, 1 << 26])
def test_update_dispersion_matches_reference(chunk):
    glob, clients, w = _params(2)
    disp, norm = update_dispersion(glob, clients, w, chunk_numbers=chunk)
    d = np.concatenate([(clients[n] - glob[n]).reshape(C, -1).numpy() for n in SHAPES], 1)
    p = w.numpy()
    mean = p @ d
    ref_disp = np.sqrt(sum(p[m] * np.sum((d[m] - mean) ** 2) for m in range(C)))
    assert disp == pytest.approx(ref_disp, rel=1e-12)
    assert norm == pytest.approx(np.linalg.norm(mean), rel=1e-12)


def test_update_dispersion_zero_when_clients_agree():
    glob, clients, w = _params(3)
    same = {n: t[:1].expand_as(t).clone() for n, t in clients.items()}
    disp, norm = update_dispersion(glob, same, w)
    assert disp == pytest.approx(0.0, abs=1e-12) and norm > 0


def test_relative_change_matches_reference():
    old, _, _ = _params(4)
    new = {n: t + 0.01 * (i + 1) for i, (n, t) in enumerate(old.items())}
    names = ["a", "c"]
    num = sum(np.sum((new[n].numpy() - old[n].numpy()) ** 2) for n in names)
    den = sum(np.sum(old[n].numpy() ** 2) for n in names)
    assert relative_change(old, new, names) == pytest.approx(np.sqrt(num / den), rel=1e-12)
    assert relative_change(old, new, []) == 0.0
