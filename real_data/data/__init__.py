"""Real data: loaders, the verified cache, partitioners and partition plots.

Public API (imported lazily, so ``linattn data list``/``fetch`` never import torch)::

    load_dataset(name, root=None, **opts) -> TensorDataset              # registry: LOADERS
    make_partition(dataset, scheme, num_clients, seed, **params) -> Partition  # SCHEMES
    iid / dirichlet / classes / natural, label_counts, label_skew
    save_partition, load_partition, check_partition, plot_partition
    fetch(name, root=None, force=False, from_path=None), pack(name, dest, root=None)
    data_root(root=None), SOURCES
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "TensorDataset": "base", "Partition": "base",
    "LOADERS": "datasets", "load_dataset": "datasets",
    "fetch": "fetchers", "pack": "fetchers",
    "SCHEMES": "partition", "make_partition": "partition", "iid": "partition",
    "dirichlet": "partition", "classes": "partition", "natural": "partition",
    "label_counts": "partition", "label_skew": "partition",
    "carve_validation": "partition", "check_validation_fraction": "partition",
    "save_partition": "partition_io", "load_partition": "partition_io",
    "check_partition": "partition_io", "plot_partition": "partition_io",
    "SOURCES": "store", "data_root": "store",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'real_data.data' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"real_data.data.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
