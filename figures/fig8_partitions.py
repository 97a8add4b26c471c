"""Figure 8: partition plots, the label mix of each client under the partitioners of real_data.

One panel per scheme (IID, Dirichlet(alpha) for three alphas, two classes per client), each a
client x class map of the fraction of the client's training samples in the class (grey
level, the colour bar in the sixth panel is the legend), with the client's sample count beside
its row and the label skew (mean total-variation distance of the clients' label mixes from the
pooled mix, ``real_data.data.label_skew``) in the title. The partitions are those
``linattn run`` would make (``real_data.data.make_partition``, seed 0) on sklearn's digits,
which ship with scikit-learn (no download); without scikit-learn, on generated balanced labels
(10 classes, 1,500 samples).

    python -m figures.fig8_partitions [--out DIR] [--clients 10]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from figures.common import FigureOutput, fmt
from figures.style import new_figure, save

NAME = "fig8_partitions"
SCHEMES = (("iid", {}), ("dirichlet", {"alpha": 1.0}), ("dirichlet", {"alpha": 0.3}),
           ("dirichlet", {"alpha": 0.1}), ("classes", {"classes_per_client": 2}))


def dataset():
    """sklearn digits when scikit-learn is installed, else generated balanced labels."""
    from linattn.errors import DataError

    try:
        from real_data.data import load_dataset

        return load_dataset("digits")
    except (DataError, ImportError):
        return generated_dataset()


def generated_dataset(samples: int = 1500, num_classes: int = 10, seed: int = 0):
    """Balanced labels in a :class:`TensorDataset` with empty (1x1) images."""
    import torch

    from real_data.data import TensorDataset

    rng = np.random.default_rng(seed)
    y = torch.from_numpy(rng.permutation(np.arange(samples) % num_classes))
    yt = torch.from_numpy(rng.permutation(np.arange(samples // 4) % num_classes))
    return TensorDataset("generated", "image", torch.zeros(samples, 1, 1, 1), y,
                         torch.zeros(len(yt), 1, 1, 1), yt, num_classes)


def partitions(data, num_clients: int = 10, seed: int = 0) -> list:
    from real_data.data import make_partition

    return [make_partition(data, scheme, num_clients, seed, **params)
            for scheme, params in SCHEMES]


def _ticks(n: int, most: int) -> list[int]:
    """At most ``most`` evenly spaced tick positions in 0..n-1 (the last one included)."""
    step = max(1, -(-n // most))
    return list(range(0, n, step))


def make(out_dir=None, num_clients: int = 10) -> FigureOutput:
    from real_data.data import label_counts, label_skew

    data = dataset()
    labels = data.y_train.numpy()
    parts = partitions(data, num_clients)
    # 2 x 3 panels at about page width (7.5 in), so 8-point labels stay 8 points in print;
    # the sixth panel holds the colour bar and the key
    fig, grid = new_figure(ncols=3, nrows=2, width=2.5, height=2.6, constrained=True)
    axes = list(grid.flat)
    skews = []
    for ax, part in zip(axes, parts):
        counts = label_counts(part.train, labels, data.num_classes)
        mix = counts / counts.sum(axis=1, keepdims=True)
        image = ax.imshow(mix, cmap="Greys", vmin=0.0, vmax=1.0, aspect="auto")
        ax.grid(False)
        xt, yt = _ticks(data.num_classes, 10), _ticks(part.num_clients, 10)
        ax.set_xticks(xt)
        ax.set_yticks(yt)
        ax.set_yticklabels([f"{m} ({part.sizes[m]})" for m in yt])
        ax.tick_params(labelsize=8, length=2, pad=2)
        ax.set_xlabel("class label", fontsize=8, labelpad=2)
        skew = label_skew(part.train, labels, data.num_classes)
        skews.append(skew)
        ax.set_title(f"{_describe(part)}\nlabel skew {skew:.2f}", fontsize=9)
    for ax in grid[:, 0]:
        ax.set_ylabel("client (training samples)", fontsize=8)
    key = axes[len(parts)]
    key.axis("off")
    bar_ax = key.inset_axes((0.08, 0.62, 0.84, 0.09))
    bar = fig.colorbar(image, cax=bar_ax, orientation="horizontal")
    bar.set_label("fraction of the client's samples\nin the class (grey level)", fontsize=8)
    bar.ax.tick_params(labelsize=8)
    bar.ax.grid(False)
    key.text(0.5, 0.18, f"rows: client id (training samples)\n{len(labels)} samples, "
             f"{parts[0].num_clients} clients, seed 0", transform=key.transAxes, ha="center",
             va="center", fontsize=8)
    for ax in axes[len(parts) + 1:]:
        ax.axis("off")
    paths = save(fig, NAME, out_dir, tight=False)
    return FigureOutput(8, NAME, tuple(paths), caption(data, parts, skews))


def _describe(part) -> str:
    if part.scheme == "dirichlet":
        return rf"Dirichlet $\alpha$={part.params['alpha']:g}"
    if part.scheme == "classes":
        return f"{part.params['classes_per_client']} classes per client"
    return part.scheme.upper() if part.scheme == "iid" else part.scheme


def caption(data, parts, skews) -> str:
    source = ("sklearn digits" if data.name == "digits"
              else "generated balanced labels (scikit-learn not installed)")
    desc = ", ".join(f"{_describe(p).replace('$', '').replace(chr(92), '')}: {fmt(s)}"
                     for p, s in zip(parts, skews))
    return (f"Label mix per client ({parts[0].num_clients} clients, seed 0) of {source}, "
            f"{len(data.y_train)} training samples, under each partitioner; grey level = "
            f"fraction of the client's samples in the class. Label skew (mean TV distance "
            f"from the pooled mix): {desc}.")


def main(argv=None) -> int:
    top = argparse.ArgumentParser(
        prog="python -m figures.fig8_partitions",
        description="Figure 8: the label mix of each client under the partitioners (IID, "
        "Dirichlet for three alphas, two classes per client) on sklearn's digits.")
    top.add_argument("--out", type=Path, default=None, metavar="DIR",
                     help="output folder (default: figures/out under the current directory)")
    top.add_argument("--clients", type=int, default=10, help="number of clients (default 10)")
    args = top.parse_args(argv)
    fig = make(args.out, args.clients)
    print("\n".join(str(p) for p in fig.paths))
    print(fig.caption)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
