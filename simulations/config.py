"""Simulator configs: frozen dataclasses loaded from YAML with dotted overrides.

A config file has the sections ``problem``, ``training``, ``data``, ``simulation`` and an
optional ``sweep``: a mapping from dotted keys to lists of values, expanded as a cartesian
product into one config per combination. Unknown keys, wrong types and impossible values
raise :class:`ConfigError` naming the key (the CLI exits with status 2 and writes nothing):
numbers must be finite, seeds >= 0, the run's name one plain folder name, and the arrays a
sweep needs must fit in memory (:func:`check_memory`, a lower bound).
"""

from __future__ import annotations

import itertools
import math
import os
import re
import types
import typing
from dataclasses import asdict, dataclass, field, fields

from linattn.configio import load_yaml, parse_overrides
from linattn.errors import ConfigError
from linattn_theory.errors import ParameterError
from linattn_theory.schedules import step_size_sequence


def _check(condition: bool, key: str, value, allowed: str) -> None:
    if not condition:
        raise ConfigError(f"{key}={value!r} is not allowed; {key} must be {allowed}")


@dataclass(frozen=True)
class ProblemConfig:
    """Arguments of ``linattn_theory.problem.make_problem`` (d, C, n, d_y, zeta_K, zeta_V, rho,
    lambda, lambda_M, s, client weights, seed)."""

    dim: int = 6
    num_clients: int = 8
    context_length: int = 16
    out_dim: int = 1
    kernel_heterogeneity: float = 0.5
    value_heterogeneity: float = 0.5
    covariate_shift: float = 0.5
    ridge: float = 0.01
    kernel_ridge: float | None = None
    noise: float = 0.1
    weights: str = "uniform"
    seed: int = 0

    def __post_init__(self):
        for key in ("dim", "num_clients", "context_length", "out_dim"):
            _check(getattr(self, key) >= 1, f"problem.{key}", getattr(self, key), ">= 1")
        for key in ("kernel_heterogeneity", "value_heterogeneity", "covariate_shift", "ridge",
                    "noise"):
            _check(getattr(self, key) >= 0, f"problem.{key}", getattr(self, key), ">= 0")
        _check(self.kernel_ridge is None or self.kernel_ridge > 0, "problem.kernel_ridge",
               self.kernel_ridge, "> 0 or null (= ridge)")
        _check(self.weights in ("uniform", "random"), "problem.weights", self.weights,
               "'uniform' or 'random'")
        _check(self.seed >= 0, "problem.seed", self.seed, ">= 0")


@dataclass(frozen=True)
class TrainingConfig:
    """Two-stage FedAvg: eta, K, B, T, the T0 values, parametrization, attention, participation
    fraction, the start (scale, seed) of ``linattn_theory.dynamics.initial_point`` and the
    step-size schedule: ``lr_schedule`` is a kind name or a mapping of
    ``linattn_theory.schedules.LRSchedule`` fields (``{kind: step, milestones: [0.75],
    factor: 0.1}``); round t takes eta_t = lr * multiplier(t); null: eta in every round."""

    lr: float = 0.1
    local_steps: int = 5
    batch_size: int = 32
    total_rounds: int = 60
    warmup_rounds: list[int] = field(default_factory=lambda: [0, 4, 8, 16, 30, 60])
    parametrization: str = "merged"
    rank: int | None = None
    attention: str = "linear"
    participation: float = 1.0
    init_scale: float = 0.3
    init_seed: int = 1
    lr_schedule: dict | str | None = None

    def __post_init__(self):
        _check(self.lr > 0, "training.lr", self.lr, "> 0")
        for key in ("local_steps", "batch_size", "total_rounds"):
            _check(getattr(self, key) >= 1, f"training.{key}", getattr(self, key), ">= 1")
        _check(len(self.warmup_rounds) >= 1
               and all(0 <= t <= self.total_rounds for t in self.warmup_rounds),
               "training.warmup_rounds", self.warmup_rounds,
               f"a non-empty list of integers in [0, total_rounds={self.total_rounds}]")
        _check(self.parametrization in ("merged", "factored"), "training.parametrization",
               self.parametrization, "'merged' or 'factored'")
        _check(self.rank is None or self.rank >= 1, "training.rank", self.rank, ">= 1 or null")
        _check(self.attention in ("linear", "softmax"), "training.attention", self.attention,
               "'linear' or 'softmax'")
        _check(0 < self.participation <= 1, "training.participation", self.participation,
               "in (0, 1]")
        _check(self.init_scale > 0, "training.init_scale", self.init_scale,
               "> 0 (M = 0 is a stationary point)")
        _check(self.init_seed >= 0, "training.init_seed", self.init_seed, ">= 0")
        try:
            step_size_sequence(self.lr, self.total_rounds, self.lr_schedule,
                               key="training.lr_schedule")
        except ParameterError as exc:
            raise ConfigError(str(exc)) from None


@dataclass(frozen=True)
class DataConfig:
    """Finite data: N training sequences per client, and the fresh test set size."""

    samples_per_client: int = 2048
    test_samples: int = 128

    def __post_init__(self):
        for key in ("samples_per_client", "test_samples"):
            _check(getattr(self, key) >= 1, f"data.{key}", getattr(self, key), ">= 1")


_NAME = re.compile(r"[A-Za-z0-9_.+=-]+")


@dataclass(frozen=True)
class MonteCarloConfig:
    """Seeds ``first_seed .. first_seed + seeds - 1``; ``name`` names the run directory."""

    seeds: int = 4
    first_seed: int = 0
    name: str = "sim"

    def __post_init__(self):
        _check(self.seeds >= 1, "simulation.seeds", self.seeds, ">= 1")
        _check(self.first_seed >= 0, "simulation.first_seed", self.first_seed, ">= 0")
        _check(bool(_NAME.fullmatch(self.name)) and self.name not in (".", ".."),
               "simulation.name", self.name,
               "a plain folder name (letters, digits, _ . + = -; no path separators)")


@dataclass(frozen=True)
class SimConfig:
    problem: ProblemConfig = field(default_factory=ProblemConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    simulation: MonteCarloConfig = field(default_factory=MonteCarloConfig)

    def to_dict(self) -> dict:
        return asdict(self)


_SECTIONS = {f.name: f.type for f in fields(SimConfig)}
_CLASSES = {"problem": ProblemConfig, "training": TrainingConfig, "data": DataConfig,
            "simulation": MonteCarloConfig}


def _coerce(key: str, value, annotation):
    """Check ``value`` against a field annotation (as a string); returns the coerced value."""
    if annotation == "dict | str | None":  # a schedule: checked by its section
        _check(value is None or isinstance(value, dict | str), key, value,
               "a kind name, a mapping or null")
        return value
    hint = {"int": int, "float": float, "str": str, "list[int]": list[int],
            "int | None": int | None, "float | None": float | None}[annotation]
    if isinstance(hint, types.UnionType):
        if value is None:
            return None
        hint = typing.get_args(hint)[0]
    if hint is int:
        _check(isinstance(value, int) and not isinstance(value, bool), key, value, "an integer")
        return value
    if hint is float:
        _check(isinstance(value, int | float) and not isinstance(value, bool), key, value,
               "a number")
        _check(math.isfinite(value), key, value, "a finite number")
        return float(value)
    if hint is str:
        _check(isinstance(value, str), key, value, "a string")
        return value
    _check(isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool)
                                           for v in value), key, value, "a list of integers")
    return sorted(set(value))


def _section(name: str, raw) -> object:
    cls = _CLASSES[name]
    if raw is None:
        return cls()
    _check(isinstance(raw, dict), name, raw, "a mapping")
    known = {f.name: f.type for f in fields(cls)}
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise ConfigError(f"unknown key {name}.{unknown[0]}; valid keys of {name}: "
                          f"{sorted(known)}")
    values = {k: _coerce(f"{name}.{k}", v, known[k]) for k, v in raw.items()}
    return cls(**values)


def config_from_dict(raw: dict) -> tuple[SimConfig, dict]:
    """(config, sweep) from a parsed YAML mapping; the sweep maps dotted keys to value lists.

    Every combination of the sweep is built and checked here, so a bad sweep value fails
    before anything runs.
    """
    _check(isinstance(raw, dict), "config", type(raw).__name__, "a mapping")
    unknown = sorted(set(raw) - set(_SECTIONS) - {"sweep"})
    if unknown:
        raise ConfigError(f"unknown key {unknown[0]}; valid top-level keys: "
                          f"{sorted([*_SECTIONS, 'sweep'])}")
    cfg = SimConfig(**{name: _section(name, raw.get(name)) for name in _SECTIONS})
    sweep = raw.get("sweep") or {}
    _check(isinstance(sweep, dict), "sweep", sweep, "a mapping from dotted keys to lists")
    for key, values in sweep.items():
        _check(isinstance(values, list) and len(values) >= 1, f"sweep.{key}", values,
               "a non-empty list")
    return cfg, sweep


def _set(raw: dict, key: str, value) -> dict:
    """A copy of the raw mapping with the dotted ``key`` (``section.field``) set."""
    parts = key.split(".")
    if len(parts) != 2 or parts[0] not in _CLASSES:
        raise ConfigError(f"unknown key {key}; keys are section.field with section in "
                          f"{sorted(_CLASSES)}")
    section = dict(raw.get(parts[0]) or {})
    section[parts[1]] = value
    return {**raw, parts[0]: section}


def expand(raw: dict, overrides: list[str] = ()) -> tuple[list[SimConfig], dict]:
    """Apply ``key=value`` overrides (``sweep.KEY=[...]`` sets a sweep list) to a raw mapping
    and expand the sweep; returns (configs, sweep). All configs are checked."""
    _check(isinstance(raw, dict), "config", type(raw).__name__, "a mapping")
    raw = dict(raw)
    for key, value in parse_overrides(list(overrides), example="training.lr=0.05"):
        if key.startswith("sweep."):
            raw["sweep"] = {**(raw.get("sweep") or {}), key[len("sweep."):]: value}
        else:
            raw = _set(raw, key, value)
    _, sweep = config_from_dict(raw)
    base = {k: v for k, v in raw.items() if k != "sweep"}
    keys = list(sweep)
    configs = []
    for combo in itertools.product(*(sweep[k] for k in keys)):
        one = base
        for k, v in zip(keys, combo):
            one = _set(one, k, v)
        configs.append(config_from_dict(one)[0])
    check_memory(configs)
    return configs, sweep


def memory_bytes(cfg: SimConfig) -> dict[str, tuple[int, str]]:
    """Lower bounds in bytes of the arrays one setting holds at once (float64), by part ->
    (bytes, the keys that set it)."""
    p, t, d = cfg.problem, cfg.training, cfg.data
    seeds, c, n, dim, dy = cfg.simulation.seeds, p.num_clients, p.context_length, p.dim, p.out_dim
    per_sample = dim * dim + dim + dy + (n * dim if t.attention == "softmax" else 0)
    return {
        "the clients' training sets": (
            8 * c * d.samples_per_client * (seeds * per_sample + 2 * (n + 1) * dim),
            "data.samples_per_client (or simulation.seeds, problem.num_clients, "
            "problem.context_length)"),
        "the test sets": (8 * seeds * c * d.test_samples * per_sample, "data.test_samples"),
        "the minibatch indices": (
            8 * t.total_rounds * seeds * t.local_steps * c * t.batch_size,
            "training.batch_size (or training.local_steps, training.total_rounds)"),
        "the frozen-stage paths": (
            8 * seeds * len(t.warmup_rounds) * (t.total_rounds + 1) * dim * dy,
            "training.warmup_rounds (or training.total_rounds)"),
    }


def physical_memory() -> int:
    """Bytes of physical memory (the cgroup limit when lower)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(limit) as fh:
                total = min(total, int(fh.read().strip()))
        except (OSError, ValueError):
            continue
    return int(total)


def check_memory(configs: list[SimConfig]) -> None:
    """Refuse a sweep whose largest setting cannot fit in memory, naming the key to lower."""
    have = physical_memory()
    for cfg in configs:
        parts = memory_bytes(cfg)
        need = sum(b for b, _ in parts.values())
        if need > have:
            name, (size, keys) = max(parts.items(), key=lambda kv: kv[1][0])
            raise ConfigError(f"a setting needs at least {need / 2**30:.3g} GiB ({name}: "
                              f"{size / 2**30:.3g} GiB) but this machine has "
                              f"{have / 2**30:.3g} GiB; lower {keys}")


def load_config(path, overrides: list[str] = ()) -> tuple[list[SimConfig], dict]:
    """Read a YAML config, apply overrides, expand the sweep; returns (configs, sweep)."""
    return expand(load_yaml(path) or {}, overrides)
