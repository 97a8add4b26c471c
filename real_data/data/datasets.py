"""The data set registry: one explicit name -> loader table."""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable

from linattn.errors import DataError
from real_data.data.base import TensorDataset
from real_data.data.images import load_cifar10, load_cifar100, load_digits, load_fmnist, load_mnist
from real_data.data.shakespeare import load_shakespeare

LOADERS: dict[str, Callable[..., TensorDataset]] = {
    "fmnist": load_fmnist,
    "mnist": load_mnist,
    "digits": load_digits,
    "cifar10": load_cifar10,
    "cifar100": load_cifar100,
    "shakespeare": load_shakespeare,
}


def load_dataset(name: str, root: str | os.PathLike | None = None, **opts) -> TensorDataset:
    """Load a data set by registry name, on the CPU.

    Parameters
    ----------
    name : str
        One of ``LOADERS``: fmnist, mnist, digits, cifar10, cifar100, shakespeare.
    root : path, optional
        Cache root (default ``$LINATTN_DATA`` or ``~/.cache/linattn/data``).
    **opts
        The loader's options; every loader takes ``train_limit`` and ``test_limit`` (keep the
        first n samples of a split). An unknown option is an error that lists the valid ones.
    """
    if name not in LOADERS:
        raise DataError(f"unknown data set {name!r}; valid names: {', '.join(LOADERS)}")
    loader = LOADERS[name]
    valid = [p for p in inspect.signature(loader).parameters if p != "root"]
    unknown = sorted(set(opts) - set(valid))
    if unknown:
        raise DataError(f"unknown option(s) {', '.join(unknown)} for data set {name!r}; "
                        f"valid options: {', '.join(valid)}")
    return loader(root, **opts)
