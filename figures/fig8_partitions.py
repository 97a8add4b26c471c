"""Figure 8: partition plots, the label mix of each client under the partitioners of real_data.

One panel per scheme (IID, Dirichlet(alpha) for three alphas, two classes per client), each a
client x class map of the fraction of the client's training samples in the class (grey
level, the colour bar is the legend), with the client's sample count beside its row and the
label skew (mean total-variation distance of the clients' label mixes from the pooled mix,
``real_data.data.label_skew``) in the title. The partitions are those ``linattn run`` would
make (``real_data.data.make_partition``, seed 0) on sklearn's digits, which ship with
scikit-learn (no download); without scikit-learn, on generated balanced labels (10 classes,
1,500 samples).

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


def make(out_dir=None, num_clients: int = 10) -> FigureOutput:
    from real_data.data import label_counts, label_skew

    data = dataset()
    labels = data.y_train.numpy()
    parts = partitions(data, num_clients)
    fig, axes = new_figure(ncols=len(parts), width=2.9, height=3.4, constrained=True)
    skews = []
    for ax, part in zip(axes, parts):
        counts = label_counts(part.train, labels, data.num_classes)
        mix = counts / counts.sum(axis=1, keepdims=True)
        image = ax.imshow(mix, cmap="Greys", vmin=0.0, vmax=1.0, aspect="auto")
        ax.grid(False)
        ax.set_xticks(range(data.num_classes))
        ax.set_yticks(range(part.num_clients))
        ax.set_yticklabels([f"{m} (n={n})" for m, n in enumerate(part.sizes)], fontsize=6)
        ax.tick_params(axis="x", labelsize=6)
        ax.set_xlabel("class label")
        if ax is axes[0]:
            ax.set_ylabel("client (training samples)")
        skew = label_skew(part.train, labels, data.num_classes)
        skews.append(skew)
        ax.set_title(f"{_describe(part)}\nlabel skew {skew:.2f}", fontsize=8)
    bar = fig.colorbar(image, ax=list(axes), fraction=0.02, pad=0.01, aspect=30)
    bar.set_label("fraction of the client's samples")
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
    top = argparse.ArgumentParser(description=__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    top.add_argument("--out", type=Path, default=None, help="output folder (default figures/out)")
    top.add_argument("--clients", type=int, default=10, help="number of clients (default 10)")
    args = top.parse_args(argv)
    fig = make(args.out, args.clients)
    print("\n".join(str(p) for p in fig.paths))
    print(fig.caption)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
