"""Engine benchmark: seconds per round of each engine on one config.

Timing: one untimed warm-up round, then ``rounds`` timed rounds (CUDA synchronized), mean and
standard deviation reported with the device.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import torch

from real_data.config import Config
from real_data.federation import Federation
from real_data.runs import load_data, make_partition_for


def bench_engines(cfg: Config, engines: list[str], rounds: int = 3) -> list[dict]:
    """``[{"engine", "seconds_per_round", "std", "device"}, ...]``."""
    dataset = load_data(cfg)
    partition = make_partition_for(cfg, dataset)
    rows = []
    for name in engines:
        c = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, engine=name))
        fed = Federation(c, dataset, partition)
        state = fed.initial_state()
        times = []
        for rnd in range(1, rounds + 2):
            t0 = time.perf_counter()
            state, _ = fed.run_round(state, rnd)
            if fed.device.type == "cuda":
                torch.cuda.synchronize(fed.device)
            if rnd > 1:
                times.append(time.perf_counter() - t0)
        dev = torch.cuda.get_device_name(fed.device) if fed.device.type == "cuda" else "cpu"
        rows.append({"engine": name, "seconds_per_round": float(np.mean(times)),
                     "std": float(np.std(times)), "device": dev})
    return rows
