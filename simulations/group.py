"""The data store of one simulated group: every run's data sets and per-run constants.

:func:`simulations.engine.simulate` groups settings by shape; a :class:`RunGroup` holds, for
each run (setting x seed) of a group, its clients' training and test sets, packed so that a
minibatch of every run is one gather, and the per-run constants (FedAvg weights, step size,
ridges) as tensors over the run axis R.
"""

from __future__ import annotations

import numpy as np
import torch

from linattn_theory.problem import Problem
from simulations.data import ROLE_DATA, ROLE_TEST, sample_client_data


def float64_tensor(x) -> torch.Tensor:
    """``x`` (array-like) as a contiguous float64 tensor."""
    return torch.as_tensor(np.ascontiguousarray(x), dtype=torch.float64)


class RunGroup:
    """Data and per-run constants of one group of settings (runs = setting x seed).

    ``settings`` are :class:`simulations.engine.Setting` of one group (equal
    :meth:`~simulations.engine.Setting.group_key`). Data sets are stored flat,
    (rows * C * N, ...), one row per (distinct problem, seed), so that a minibatch of every
    run is one ``index_select``.
    """

    def __init__(self, settings: list, seeds: list[int]):
        first = settings[0]
        self.settings, self.seeds = settings, list(seeds)
        self.attention = first.attention
        self.clients = first.problem.num_clients
        s_count = len(seeds)
        self.run_setting = np.repeat(np.arange(len(settings)), s_count)
        self.run_seed = np.tile(np.arange(s_count), len(settings))
        problems: list[Problem] = []
        prob_of = []
        for s in settings:  # settings sharing a problem object share its data sets
            found = next((i for i, p in enumerate(problems) if p is s.problem), None)
            if found is None:
                problems.append(s.problem)
                found = len(problems) - 1
            prob_of.append(found)
        self.data_row = torch.as_tensor(np.asarray(prob_of)[self.run_setting] * s_count
                                        + self.run_seed)
        self._rows = len(problems)
        keep = first.attention == "softmax"
        self.train = self._stack(problems, first.samples_per_client, ROLE_DATA, keep)
        self.test = self._stack(problems, first.test_samples, ROLE_TEST, keep)
        self.n_train, self.n_test = first.samples_per_client, first.test_samples
        probs = [settings[i].problem for i in self.run_setting]
        self.weights = float64_tensor(np.stack([p.weights for p in probs]))  # (R, C)
        self.lr = float64_tensor([settings[i].lr for i in self.run_setting])
        self.ridge = float64_tensor([p.ridge for p in probs])
        self.kernel_ridge = float64_tensor([p.kernel_ridge for p in probs])

    def _stack(self, problems, size, role, keep_tokens) -> dict:
        sets = [sample_client_data(p, size, seed, role=role, keep_tokens=keep_tokens)
                for p in problems for seed in self.seeds]
        out = {"sigma_hat": np.stack([s.sigma_hat for s in sets]),
               "query": np.stack([s.query for s in sets]),
               "target": np.stack([s.target for s in sets])}
        if keep_tokens:
            out["tokens"] = np.stack([s.tokens for s in sets])
        if self.attention != "linear":
            out.pop("sigma_hat")
        # (rows, C, N, ...) -> one packed (rows * C * N, F) store: one gather per minibatch
        layout = [(k, v.shape[3:]) for k, v in out.items()]
        packed = np.concatenate([v.reshape(v.shape[0] * v.shape[1] * v.shape[2], -1)
                                 for v in out.values()], axis=1)
        return {"packed": float64_tensor(packed), "layout": layout}

    def flat_index(self, index: torch.Tensor, size: int) -> torch.Tensor:
        """Sample indices (..., R, C, B) of each run's own data -> rows of the flat store."""
        c = torch.arange(self.clients)
        base = (self.data_row[:, None] * self.clients + c[None, :]) * size  # (R, C)
        return base[:, :, None] + index

    def gather(self, store: dict, flat: torch.Tensor) -> dict:
        """Tensors (*flat.shape, ...) of the samples at the flat store rows ``flat``."""
        shape = tuple(flat.shape)
        rows = store["packed"].index_select(0, flat.reshape(-1))
        out, col = {}, 0
        for key, tail in store["layout"]:
            width = int(np.prod(tail))
            out[key] = rows[:, col:col + width].reshape(*shape, *tail)
            col += width
        return out

    def rows(self, store: dict, data_rows: torch.Tensor) -> dict:
        """Whole data sets (len(data_rows), C, N, ...) of the given data rows (contiguous)."""
        per_row = store["packed"].shape[0] // (self._rows * len(self.seeds))  # C * N
        block = store["packed"].view(-1, per_row, store["packed"].shape[1])[data_rows]
        out, col = {}, 0
        for key, tail in store["layout"]:
            width = int(np.prod(tail))
            out[key] = block[..., col:col + width].reshape(len(data_rows), self.clients, -1,
                                                           *tail)
            col += width
        return out

    def test_set(self) -> dict:
        return self.rows(self.test, self.data_row)
