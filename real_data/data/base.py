"""The in-memory data contract shared by loaders, partitioners, engines and algorithms.

One tensor per split, held on one device, plus per-client index tensors: engines gather a
client's minibatch with ``x[idx]``; there is no per-client DataLoader.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass(frozen=True)
class TensorDataset:
    """A whole data set as tensors.

    Attributes
    ----------
    name : str
        Registry name (``fmnist``, ``mnist``, ``digits``, ``shakespeare``, ``cifar10``, ...).
    task : str
        ``"image"`` (x: float32 ``(N, C, H, W)`` normalized, y: int64 ``(N,)``) or ``"text"``
        (x: int64 ``(N, L)`` character ids, y: int64 ``(N, L)`` next-character ids).
    x_train, y_train, x_test, y_test : torch.Tensor
        The splits, on the CPU when loaded; ``to(device)`` moves all of them.
    num_classes : int
        Number of labels (images) or vocabulary size (text).
    groups_train, groups_test : tuple of np.ndarray or None
        Natural clients (Shakespeare: one per play and speaking role) as index arrays into
        the train and test splits; ``None`` for data sets without a natural split.
    group_names : tuple of str
        A name per natural client (for example ``"HAMLET/HAMLET"``), empty otherwise.
    """

    name: str
    task: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int
    groups_train: tuple[np.ndarray, ...] | None = None
    groups_test: tuple[np.ndarray, ...] | None = None
    group_names: tuple[str, ...] = field(default_factory=tuple)

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])

    def to(self, device: torch.device | str) -> TensorDataset:
        return TensorDataset(
            self.name,
            self.task,
            self.x_train.to(device),
            self.y_train.to(device),
            self.x_test.to(device),
            self.y_test.to(device),
            self.num_classes,
            self.groups_train,
            self.groups_test,
            self.group_names,
        )


@dataclass(frozen=True)
class Partition:
    """Which samples each client holds.

    Attributes
    ----------
    train : tuple of np.ndarray
        ``train[m]`` indexes client m's training samples in ``x_train``.
    test : tuple of np.ndarray
        ``test[m]`` indexes client m's local test split in ``x_test`` (its own label mix).
    scheme : str
        ``iid``, ``dirichlet``, ``classes`` or ``natural``.
    params : dict
        The scheme's parameters (``alpha``, ``classes_per_client``, ``min_size``, ...).
    seed : int
        The partition seed; the same seed gives the same partition.
    val : tuple of np.ndarray
        ``val[m]`` indexes client m's validation samples in ``x_train``, carved from its
        training data and disjoint from ``train[m]`` (``partition.validation_fraction``);
        empty when the partition has no validation split.
    """

    train: tuple[np.ndarray, ...]
    test: tuple[np.ndarray, ...]
    scheme: str
    params: dict
    seed: int
    val: tuple[np.ndarray, ...] = ()

    @property
    def has_validation(self) -> bool:
        return bool(self.val) and sum(len(v) for v in self.val) > 0

    @property
    def val_pooled(self) -> np.ndarray:
        """Every client's validation indices, concatenated in client order."""
        return (np.concatenate(self.val).astype(np.int64) if self.val
                else np.empty(0, np.int64))

    @property
    def num_clients(self) -> int:
        return len(self.train)

    @property
    def sizes(self) -> np.ndarray:
        return np.array([len(ix) for ix in self.train], dtype=np.int64)

    @property
    def weights(self) -> np.ndarray:
        """p_m = n_m / sum_j n_j, the FedAvg aggregation weights."""
        s = self.sizes.astype(np.float64)
        return s / s.sum()
