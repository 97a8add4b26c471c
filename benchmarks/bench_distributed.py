"""Scale-out benchmark: rounds per second on 1 GPU and on N GPUs, and metric equality.

Run on one node under torchrun, one process per GPU (N = 2 for the table in ``docs/scaleout.md``)::

    python3 -m torch.distributed.run --standalone --nproc_per_node 2 \
        benchmarks/bench_distributed.py --out bench_distributed.json

1. Equality: the same fp64 run (``--eq-clients`` clients a round, ``--eq-rounds`` rounds,
   evaluated every round) once on rank 0 alone with the plain round loop and once sharded over
   every rank with :class:`real_data.distributed.ShardTrainer`; the largest relative
   difference over every metric row is reported (the criterion is <= 1e-6).
2. Scaling: for each ``--clients`` C, ``--warmup`` untimed then ``--rounds`` timed rounds of the
   config's precision (bf16 autocast for fmnist_vit), no evaluation, first on rank 0 alone
   (the others wait at a barrier), then sharded. Rounds per second = 1 / mean round time; the
   speedup is N-GPU over 1-GPU rounds per second and the efficiency that over N.

Data are synthetic Fashion-MNIST-shaped images (1 x 28 x 28, 10 classes, labels from a fixed
random linear map), so the script needs no download: cost per round does not depend on pixel
values. The model and training settings are those of ``--config`` (default fmnist_vit) with
``key=value`` overrides; every client takes ``train.local_steps`` steps of ``train.batch_size``.
The JSON holds the table, the equality error, the devices, the library versions, the resolved
config and this script's source.

Measured result: ``docs/scaleout.md#two-gpus-nccl`` (2 x NVIDIA H200,
``docs/bench/bench_distributed.json``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # runnable from a checkout without installing it
    sys.path.insert(0, str(ROOT))

from real_data.config import config_to_dict, load_config  # noqa: E402
from real_data.data.base import Partition, TensorDataset  # noqa: E402
from real_data.distributed import ShardTrainer, close_process_group, init_from_env  # noqa: E402
from real_data.federation import Federation  # noqa: E402

TINY = ["model.dim=8", "model.mlp_dim=16", "model.depth=1", "model.heads=2", "model.patch=7",
        "train.batch_size=8", "train.local_steps=2"]


def synthetic(n_train: int, n_test: int, seed: int = 0) -> TensorDataset:
    """Random 1 x 28 x 28 images; label = argmax of a fixed random linear map (learnable)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_train + n_test, 1, 28, 28, generator=g)
    y = (x.flatten(1) @ torch.randn(784, 10, generator=g)).argmax(1)
    return TensorDataset("synthetic", "image", x[:n_train], y[:n_train], x[n_train:],
                         y[n_train:], 10)


def iid_partition(dataset: TensorDataset, num_clients: int, seed: int = 0) -> Partition:
    rng = np.random.default_rng(seed)
    train = np.array_split(rng.permutation(len(dataset.y_train)), num_clients)
    test = np.array_split(rng.permutation(len(dataset.y_test)), num_clients)
    return Partition(tuple(np.sort(t) for t in train), tuple(np.sort(t) for t in test), "iid",
                     {}, seed)


def config(args, clients: int, *extra: str):
    over = ["algorithm.name=fedavg", *(TINY if args.tiny else []), *args.overrides,
            f"partition.num_clients={clients}", "train.clients_per_round=null", *extra]
    return load_config(args.config, over)


def rounds(fed: Federation, n: int) -> tuple[list[float], list]:
    """Run ``n`` rounds from the initial state; per-round seconds (synchronized) and records."""
    state, times, records = fed.initial_state(), [], []
    for rnd in range(1, n + 1):
        if fed.device.type == "cuda":
            torch.cuda.synchronize(fed.device)
        t0 = time.perf_counter()
        state, rec = fed.run_round(state, rnd)
        if fed.device.type == "cuda":
            torch.cuda.synchronize(fed.device)
        times.append(time.perf_counter() - t0)
        records += rec
    return times, records


def federation(cfg, dataset, partition, trainer: ShardTrainer, sharded: bool) -> Federation:
    _release()
    if sharded:
        trainer.started = True  # every rank builds the same start state itself
    return Federation(cfg, dataset, partition, device=trainer.device,
                      trainer=trainer if sharded else None)


def _release() -> None:
    """Free the previous case's cached engine buffers, so each case sizes its chunks alike."""
    import gc

    try:
        from real_data.engines.fast import clear_cache
    except ImportError:  # an engine without a cache
        pass
    else:
        clear_cache()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def max_relative_error(a: list, b: list) -> float:
    left = {(r, c, k): v for r, c, k, v in a}
    right = {(r, c, k): v for r, c, k, v in b}
    if left.keys() != right.keys():
        return float("inf")
    return max(abs(v - right[key]) / max(abs(v), abs(right[key]), 1e-300)
               if v != right[key] else 0.0 for key, v in left.items())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="JSON file written by rank 0")
    ap.add_argument("--config", default="fmnist_vit")
    ap.add_argument("--clients", default="100,500", help="clients per round, comma list")
    ap.add_argument("--rounds", type=int, default=10, help="timed rounds per case")
    ap.add_argument("--warmup", type=int, default=3, help="untimed rounds per case")
    ap.add_argument("--eq-clients", type=int, default=100)
    ap.add_argument("--eq-rounds", type=int, default=3)
    ap.add_argument("--samples-per-client", type=int, default=120)
    ap.add_argument("--tiny", action="store_true", help="tiny model (CPU smoke test)")
    ap.add_argument("overrides", nargs="*", metavar="key=value")
    args = ap.parse_args()
    trainer = init_from_env(timeout=timedelta(minutes=30))  # rank 0 alone runs the baselines
    rank, world = trainer.rank, trainer.world_size
    clients = [int(c) for c in args.clients.split(",") if c]
    out = {"world_size": world, "torch": torch.__version__, "backend": dist.get_backend(),
           "devices": [None] * world, "cases": [], "args": vars(args) | {"out": str(args.out)}}
    name = torch.cuda.get_device_name(trainer.device) if trainer.device.type == "cuda" else "cpu"
    dist.all_gather_object(out["devices"], name)

    # 1. equality, fp64, evaluated every round
    cfg = config(args, args.eq_clients, "train.precision=fp64", "eval.every=1",
                 f"train.rounds={args.eq_rounds}")
    data = synthetic(args.eq_clients * args.samples_per_client, 2000)
    part = iid_partition(data, args.eq_clients)
    single = None
    if rank == 0:
        single = rounds(federation(cfg, data, part, trainer, False), args.eq_rounds)[1]
    dist.barrier()
    sharded = rounds(federation(cfg, data, part, trainer, True), args.eq_rounds)[1]
    if rank == 0:
        err = max_relative_error(single, sharded)
        out["equality"] = {"clients": args.eq_clients, "rounds": args.eq_rounds,
                           "max_relative_error": err, "passed": err <= 1e-6,
                           "rows": len(single)}

    # 2. scaling, the config's precision, no evaluation
    n_timed = args.warmup + args.rounds
    for c in clients:
        cfg = config(args, c, f"train.rounds={10**6}", f"eval.every={10**6}")
        data = synthetic(c * args.samples_per_client, 100)
        part = iid_partition(data, c)
        case = {"clients_per_round": c}
        if rank == 0:
            t = rounds(federation(cfg, data, part, trainer, False), n_timed)[0]
            case["one"] = _stats(t[args.warmup:])
        dist.barrier()
        t = rounds(federation(cfg, data, part, trainer, True), n_timed)[0]
        case["sharded"] = _stats(t[args.warmup:])
        if rank == 0:
            case["speedup"] = case["one"]["seconds"] / case["sharded"]["seconds"]
            case["efficiency"] = case["speedup"] / world
            out["cases"].append(case)
        dist.barrier()
    if rank == 0:
        out["config"] = config_to_dict(cfg)
        out["source"] = Path(__file__).read_text()
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1))
        _print(out)
    close_process_group()


def _stats(times: list[float]) -> dict:
    t = np.asarray(times)
    return {"seconds": float(t.mean()), "std": float(t.std()), "rounds_per_s": float(1 / t.mean()),
            "n": len(t)}


def _print(out: dict) -> None:
    eq = out["equality"]
    n = out["world_size"]
    print(f"devices: {', '.join(out['devices'])}; torch {out['torch']}, {out['backend']}")
    print(f"equality (fp64, {eq['clients']} clients, {eq['rounds']} rounds, {eq['rows']} rows): "
          f"max relative error {eq['max_relative_error']:.2e} "
          f"({'PASS' if eq['passed'] else 'FAIL'}: <= 1e-6)")
    print(f"{'clients/round':>13} | {'1 proc rounds/s':>16} | {f'{n} proc rounds/s':>16} | "
          f"{'speedup':>7} | efficiency")
    for c in out["cases"]:
        one, sh = c["one"], c["sharded"]
        print(f"{c['clients_per_round']:>13} | {one['rounds_per_s']:>8.2f} +- {one['std']:.3f}s"
              f" | {sh['rounds_per_s']:>8.2f} +- {sh['std']:.3f}s | {c['speedup']:>7.2f} | "
              f"{c['efficiency']:.2f}")


if __name__ == "__main__":
    main()
