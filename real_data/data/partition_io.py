"""Saving, loading, checking and plotting partitions.

File format: one ``.npz`` (no pickles) holding the concatenated train and test indices, their
offsets, and the scheme, seed and parameters as a JSON string; a ``.json`` copy of that metadata
(with the client sizes) is written beside it for people to read.
"""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path

import numpy as np

from linattn.errors import DataError
from linattn.fileio import atomic_path, atomic_write_text
from real_data.data.base import Partition, TensorDataset
from real_data.data.partition import label_counts

FORMAT = "linattn.partition/1"


def _pack(parts: tuple[np.ndarray, ...]) -> tuple[np.ndarray, np.ndarray]:
    offsets = np.concatenate([[0], np.cumsum([len(p) for p in parts])]).astype(np.int64)
    flat = np.concatenate(parts).astype(np.int64) if parts else np.empty(0, np.int64)
    return flat, offsets


def _unpack(flat: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, ...]:
    return tuple(flat[a:b] for a, b in zip(offsets[:-1], offsets[1:]))


def save_partition(partition: Partition, path: str | os.PathLike) -> Path:
    """Write ``path`` (``.npz`` added if missing) and a readable ``.json`` beside it."""
    path = Path(path)
    if path.suffix != ".npz":
        path = path.with_name(path.name + ".npz")
    meta = {"format": FORMAT, "scheme": partition.scheme, "seed": partition.seed,
            "params": partition.params, "num_clients": partition.num_clients}
    try:
        meta_json = json.dumps(meta, sort_keys=True)
    except TypeError as exc:
        raise DataError(f"partition params must be JSON values ({exc})") from exc
    train, train_offsets = _pack(partition.train)
    test, test_offsets = _pack(partition.test)
    val = {}
    if partition.val:
        val["val"], val["val_offsets"] = _pack(partition.val)
    with atomic_path(path) as part:
        np.savez(part, train=train, train_offsets=train_offsets, test=test,
                            test_offsets=test_offsets, meta=np.array(meta_json), **val)
    readable = {**meta, "train_sizes": partition.sizes.tolist(),
                "test_sizes": [len(t) for t in partition.test]}
    if partition.val:
        readable["val_sizes"] = [len(v) for v in partition.val]
    atomic_write_text(path.with_suffix(".json"),
                      json.dumps(readable, indent=1, sort_keys=True) + "\n")
    return path


def load_partition(path: str | os.PathLike) -> Partition:
    """Read a partition written by ``save_partition``.

    Raises
    ------
    DataError
        Naming the file if it is missing, not a partition file, or inconsistent.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"partition file {path} does not exist")
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in ("train", "train_offsets", "test", "test_offsets")
                      + (("val", "val_offsets") if "val" in z.files else ())}
            meta = json.loads(str(z["meta"]))
    except (OSError, KeyError, ValueError, zipfile.BadZipFile) as exc:
        raise DataError(f"{path} is not a partition file ({exc})") from exc
    if meta.get("format") != FORMAT:
        raise DataError(f"{path}: format {meta.get('format')!r}, expected {FORMAT!r}")
    for split in ("train", "test") + (("val",) if "val" in arrays else ()):
        offsets = arrays[f"{split}_offsets"]
        if len(offsets) != meta["num_clients"] + 1 or offsets[-1] != len(arrays[split]) \
                or np.any(np.diff(offsets) < 0):
            raise DataError(f"{path}: {split} offsets do not match {meta['num_clients']} clients")
    val = _unpack(arrays["val"], arrays["val_offsets"]) if "val" in arrays else ()
    return Partition(_unpack(arrays["train"], arrays["train_offsets"]),
                     _unpack(arrays["test"], arrays["test_offsets"]),
                     meta["scheme"], meta["params"], int(meta["seed"]), val)


def check_partition(partition: Partition, dataset: TensorDataset) -> None:
    """Raise DataError unless every index is valid for ``dataset`` and every client has data."""
    for split, parts, n in (("train", partition.train, len(dataset.x_train)),
                            ("test", partition.test, len(dataset.x_test)),
                            ("validation", partition.val, len(dataset.x_train))):
        for m, idx in enumerate(parts):
            if len(idx) and (idx.min() < 0 or idx.max() >= n):
                raise DataError(f"partition client {m} has {split} indices outside "
                                f"[0, {n}) of {dataset.name}; was it made for another data set "
                                f"(params: {partition.params.get('dataset')!r})?")
    empty = [m for m, idx in enumerate(partition.train) if len(idx) == 0]
    if empty:
        raise DataError(f"partition clients {empty[:10]} have no training samples")
    if len(np.unique(np.concatenate(partition.train))) != int(partition.sizes.sum()):
        raise DataError("partition clients share training samples")
    if partition.val:
        if len(partition.val) != partition.num_clients:
            raise DataError(f"partition has {len(partition.val)} validation splits for "
                            f"{partition.num_clients} clients")
        held = np.concatenate([*partition.train, *partition.val])
        if len(np.unique(held)) != len(held):
            raise DataError("partition validation samples overlap training samples")


def plot_partition(partition: Partition, labels, num_classes: int | None = None, *,
                   path: str | os.PathLike | None = None, max_clients: int = 100,
                   title: str | None = None):
    """Stacked bars of each client's training label counts (one colour per class).

    ``labels`` are the training labels (tensor or array); for text data (labels of shape
    ``(N, L)``) the bars show sample counts only. At most ``max_clients`` clients are drawn, the
    first ones. Returns the matplotlib ``Figure``; with ``path``, also saves it there.
    """
    from matplotlib.figure import Figure  # lazy: matplotlib is only needed for plots
    from matplotlib.ticker import MaxNLocator

    labels = np.asarray(labels.cpu() if hasattr(labels, "cpu") else labels)
    parts = partition.train[:max_clients]
    shown = len(parts)
    fig = Figure(figsize=(max(6.0, 0.12 * shown + 2.0), 4.0), layout="constrained")
    ax = fig.subplots()
    x = np.arange(shown)
    if labels.ndim == 1:
        num_classes = int(labels.max()) + 1 if num_classes is None else num_classes
        counts = label_counts(parts, labels, num_classes)
        cmap = _colours(num_classes)
        bottom = np.zeros(shown)
        for c in range(num_classes):
            ax.bar(x, counts[:, c], bottom=bottom, width=0.9, color=cmap[c], label=str(c))
            bottom += counts[:, c]
        if num_classes <= 20:
            ax.legend(title="class", fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    else:
        ax.bar(x, [len(p) for p in parts], width=0.9, color="C0")
    ax.set_xlabel(f"client (first {shown} of {partition.num_clients})"
                  if shown < partition.num_clients else "client")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("training samples")
    params = ", ".join(f"{k}={v}" for k, v in partition.params.items()
                       if k in ("alpha", "classes_per_client", "min_size", "select"))
    shift = partition.params.get("shift")
    if shift:
        params += (", " if params else "") + " ".join(f"{k}={v}" for k, v in shift.items())
    ax.set_title(title or f"{partition.scheme} ({params}) seed={partition.seed}".replace(" ()", ""))
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig


def _colours(n: int) -> list:
    from matplotlib import colormaps

    cmap = colormaps["tab10" if n <= 10 else "tab20" if n <= 20 else "viridis"]
    return [cmap(i if n <= 20 else i / max(n - 1, 1)) for i in range(n)]
