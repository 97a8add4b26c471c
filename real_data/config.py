"""Run configuration: frozen dataclasses loaded from YAML with dotted ``key=value`` overrides.

Every key is type-checked against its dataclass field; unknown keys, wrong types and impossible
values raise :class:`~linattn.errors.ConfigError` naming the key and the allowed values. The
``model`` and ``algorithm`` sections hold a ``name`` plus the fields of that model's or
algorithm's own parameter dataclass (looked up in the registries).

Example YAML::

    name: digits_vit
    seed: 0
    data: {name: digits}
    partition: {scheme: dirichlet, num_clients: 10, alpha: 0.5}
    model: {name: vit, patch: 2, dim: 32, depth: 2, heads: 2, mlp_dim: 64}
    algorithm: {name: fedfrozen, warmup_rounds: 5, train: all_but_qk}
    train: {rounds: 20, local_steps: 5, batch_size: 32, lr: 0.1}
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from linattn.configio import load_yaml, parse_overrides
from linattn.errors import ConfigError
from linattn_theory.errors import ParameterError
from linattn_theory.schedules import LRSchedule, schedule_from_dict
from real_data.schema import build_dataclass, check_name, check_value

CONFIG_DIR = Path(__file__).parent / "configs"


@dataclass(frozen=True)
class SeedsConfig:
    """Seeds by role; ``None`` derives each from the top-level ``seed``."""

    partition: int | None = None
    sampling: int | None = None
    training: int | None = None

    def __post_init__(self) -> None:
        for role in ("partition", "sampling", "training"):
            value = getattr(self, role)
            if value is not None and value < 0:
                raise ConfigError(f"seeds.{role}={value} must be >= 0 or null (derived from "
                                  "seed)")


@dataclass(frozen=True)
class DataConfig:
    """Which data set (``real_data.data.load_dataset`` names) and loader options."""

    name: str = "digits"
    root: str | None = None
    train_limit: int | None = None
    test_limit: int | None = None
    seq_len: int | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise ConfigError("data.name must name a data set (e.g. digits)")
        for key in ("train_limit", "test_limit", "seq_len"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ConfigError(f"data.{key}={value} must be >= 1 or null")


@dataclass(frozen=True)
class PartitionConfig:
    """How the training data are split over clients (``real_data.data.make_partition``)."""

    scheme: Literal["iid", "dirichlet", "classes", "natural"] = "dirichlet"
    num_clients: int = 10
    alpha: float = 0.5
    min_size: int = 10
    classes_per_client: int = 2
    validation_fraction: float | None = None  # share of each client's samples held out
    # concept or covariate shift on top of the scheme (real_data.data.shift), e.g.
    # {kind: concept, classes: 4, groups: 2} or {kind: covariate, transform: rotation, spread: 45}
    shift: dict | None = None

    def __post_init__(self) -> None:
        from linattn.errors import DataError
        from real_data.data.shift import shift_from_dict

        try:
            shift_from_dict(self.shift)
        except DataError as exc:
            raise ConfigError(str(exc)) from None
        vf = self.validation_fraction
        if vf is not None and (isinstance(vf, bool) or not isinstance(vf, (int, float))
                               or not 0 < vf <= 0.5):
            raise ConfigError(f"partition.validation_fraction={vf!r} must be in (0, 0.5] (the "
                              "share of each client's training samples held out for "
                              "validation), or null for no validation split")
        if self.alpha <= 0:
            raise ConfigError(f"partition.alpha={self.alpha} must be > 0")
        if self.num_clients < 1:
            raise ConfigError(f"partition.num_clients={self.num_clients} must be >= 1")
        if self.min_size < 1:
            raise ConfigError(f"partition.min_size={self.min_size} must be >= 1")
        if self.classes_per_client < 1:
            raise ConfigError(f"partition.classes_per_client={self.classes_per_client} "
                              "must be >= 1")

    def scheme_params(self) -> dict[str, Any]:
        """The parameters of the chosen scheme only."""
        return {"dirichlet": {"alpha": self.alpha, "min_size": self.min_size},
                "classes": {"classes_per_client": self.classes_per_client}}.get(self.scheme, {})


@dataclass(frozen=True)
class TrainConfig:
    """Rounds, participation, local training and the compute device.

    Exactly one of ``local_steps`` (K) and ``local_epochs`` (E) is set; see
    :mod:`real_data.engines.base` for clients of different sizes.
    """

    rounds: int = 50
    clients_per_round: int | None = None
    local_steps: int | None = 10
    local_epochs: float | None = None
    batch_size: int = 32
    optimizer: Literal["sgd", "adam"] = "sgd"
    lr: float = 0.05
    momentum: float = 0.0
    weight_decay: float = 0.0
    clip_grad_norm: float | None = None
    engine: Literal["vectorized", "vectorized_compiled", "sequential"] = "vectorized"
    precision: Literal["fp32", "fp64", "bf16"] = "fp32"
    device: str = "auto"
    # the round's lr = lr * multiplier(round): a kind (constant, step, cosine, exponential,
    # plateau) or a mapping of linattn_theory.schedules.LRSchedule's fields
    lr_schedule: str | dict = "constant"
    # transfer initialization for any algorithm: a file written by `linattn pretrain`; the
    # initial global model takes its parameters (the head stays freshly initialized unless
    # init_reset_head is false), as FedSQ's algorithm.pretrained does
    init_from: str | None = None
    init_reset_head: bool = True

    @property
    def schedule(self) -> LRSchedule:
        """``lr_schedule`` as a checked :class:`~linattn_theory.schedules.LRSchedule`."""
        return schedule_from_dict(self.lr_schedule, "train.lr_schedule")

    def __post_init__(self) -> None:
        checks = [
            (self.rounds >= 1, "train.rounds", self.rounds, ">= 1"),
            (self.batch_size >= 1, "train.batch_size", self.batch_size, ">= 1"),
            (self.lr > 0, "train.lr", self.lr, "> 0"),
            (0 <= self.momentum < 1, "train.momentum", self.momentum, "in [0, 1)"),
            (self.weight_decay >= 0, "train.weight_decay", self.weight_decay, ">= 0"),
            (self.clip_grad_norm is None or self.clip_grad_norm > 0, "train.clip_grad_norm",
             self.clip_grad_norm, "> 0 or null"),
            (self.clients_per_round is None or self.clients_per_round >= 1,
             "train.clients_per_round", self.clients_per_round, ">= 1 or null (all)"),
        ]
        for ok, key, value, allowed in checks:
            if not ok:
                raise ConfigError(f"{key}={value} must be {allowed}")
        if (self.local_steps is None) == (self.local_epochs is None):
            raise ConfigError("set exactly one of train.local_steps and train.local_epochs "
                              "(the other null)")
        if self.local_steps is not None and self.local_steps < 1:
            raise ConfigError(f"train.local_steps={self.local_steps} must be >= 1")
        if self.local_epochs is not None and self.local_epochs <= 0:
            raise ConfigError(f"train.local_epochs={self.local_epochs} must be > 0")
        try:
            self.schedule.check(self.lr, self.rounds, "train.lr_schedule")
        except ParameterError as exc:
            raise ConfigError(str(exc)) from None


@dataclass(frozen=True)
class EvalConfig:
    """Evaluation schedule; ``clients`` adds per-client local-test metrics; ``test: false``
    evaluates the validation split only (tuning runs never read the test set);
    ``finetune: true`` adds, at the last round, every client's local test accuracy after it
    fine-tunes the global model for one local round at ``train.lr`` (``local_ft_acc_*``), and
    with a validation split the fine-tuned models' accuracy on every client's own validation
    samples (``local_ft_val_acc_micro``). ``finetune_lr_factors`` (default ``[1.0]``): the
    fine-tuning step sizes tried, as factors of ``train.lr``; with more than one, each is
    tried on the same minibatches, the one whose fine-tuned models score best on the clients'
    own validation samples is kept (``local_ft_lr``; ties to the first listed) and only it is
    scored on the test set, so it needs ``partition.validation_fraction``. With
    ``clients: true`` and a validation split every
    evaluation also records ``local_val_acc_micro``: each client's evaluation model (its own
    under a personalized method) on its own validation samples."""

    every: int = 1
    batch_size: int = 1024
    clients: bool = True
    test: bool = True
    finetune: bool = False
    finetune_lr_factors: tuple[float, ...] = (1.0,)

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ConfigError(f"eval.every={self.every} must be >= 1")
        factors = self.finetune_lr_factors
        if not factors or any(f <= 0 for f in factors) or len(set(factors)) < len(factors):
            raise ConfigError(f"eval.finetune_lr_factors={list(factors)} must be a non-empty "
                              "list of distinct factors > 0 of train.lr, e.g. [0.1, 0.3, 1.0]")
        if self.batch_size < 1:
            raise ConfigError(f"eval.batch_size={self.batch_size} must be >= 1")


@dataclass(frozen=True)
class OutputConfig:
    """Where and how a run is written."""

    out_dir: str = "runs"
    checkpoint_every: int = 1
    progress: bool = True
    tensorboard: bool = False
    plot: bool = True

    def __post_init__(self) -> None:
        if self.checkpoint_every < 1:
            raise ConfigError(f"run.checkpoint_every={self.checkpoint_every} must be >= 1")
        if not self.out_dir or "\0" in self.out_dir:
            raise ConfigError(f"run.out_dir={self.out_dir!r} must be a folder name")


@dataclass(frozen=True)
class Named:
    """A registry name plus that entry's own parameter dataclass."""

    name: str
    params: Any


@dataclass(frozen=True)
class Config:
    """A whole run. ``model`` and ``algorithm`` are :class:`Named` sections."""

    name: str
    model: Named
    algorithm: Named
    seed: int = 0
    seeds: SeedsConfig = field(default_factory=SeedsConfig)
    data: DataConfig = field(default_factory=DataConfig)
    partition: PartitionConfig = field(default_factory=PartitionConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    run: OutputConfig = field(default_factory=OutputConfig)

    def role_seed(self, role: str) -> int:
        """The seed of one role (``partition``, ``sampling``, ``training``)."""
        given = getattr(self.seeds, role)
        if given is not None:
            return given
        index = ("partition", "sampling", "training").index(role)
        return int(np.random.SeedSequence([self.seed, index]).generate_state(1)[0])


def _named(section: dict | None, key: str, lookup) -> Named:
    if not isinstance(section, dict) or "name" not in section:
        raise ConfigError(f"{key}.name is required")
    body = dict(section)
    name = check_value(body.pop("name"), str, f"{key}.name")
    return Named(name, build_dataclass(lookup(name), body, key,
                                       whose=f"{key}.name={name}; besides name"))


def config_from_dict(data: dict, source: str | Path | None = None) -> Config:
    """Build and check a :class:`Config` from a plain mapping (as read from YAML).

    ``source``: the file the mapping came from; every error then starts with its name.
    """
    if source is None:
        return _config_from_dict(data)
    try:
        return _config_from_dict(data)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None


def _config_from_dict(data: dict) -> Config:
    from real_data.algorithms import get_algorithm
    from real_data.models import model_config_class

    if not isinstance(data, dict):
        raise ConfigError("a config file must hold a mapping of sections (name, model, "
                          f"algorithm, train, ...), not {type(data).__name__}")
    data = dict(data)
    sections = {
        "model": _named(data.pop("model", None), "model", model_config_class),
        "algorithm": _named(data.pop("algorithm", None), "algorithm",
                            lambda n: get_algorithm(n).Params),
    }
    for key, cls in [("seeds", SeedsConfig), ("data", DataConfig), ("partition", PartitionConfig),
                     ("train", TrainConfig), ("eval", EvalConfig), ("run", OutputConfig)]:
        if key in data:
            sections[key] = build_dataclass(cls, data.pop(key), key)
    if "name" not in data:
        raise ConfigError("name is required (a label for the run)")
    unknown = sorted(set(data) - {"name", "seed"})
    if unknown:
        raise ConfigError(f"unknown key(s) {', '.join(unknown)}; valid top-level keys: "
                          "name, seed, seeds, data, partition, model, algorithm, train, eval, run")
    seed = check_value(data.get("seed", 0), int, "seed")
    if seed < 0:
        raise ConfigError(f"seed={seed} must be >= 0")
    cfg = Config(name=check_name(check_value(data["name"], str, "name"), "name"), seed=seed,
                 **sections)
    t = cfg.train
    if t.clients_per_round is not None and t.clients_per_round > cfg.partition.num_clients:
        raise ConfigError(f"train.clients_per_round={t.clients_per_round} exceeds "
                          f"partition.num_clients={cfg.partition.num_clients}")
    return cfg


def config_to_dict(cfg: Config) -> dict:
    """The plain mapping that :func:`config_from_dict` reads back to an equal config."""
    out: dict[str, Any] = {"name": cfg.name, "seed": cfg.seed}
    for key in ("seeds", "data", "partition"):
        out[key] = dataclasses.asdict(getattr(cfg, key))
    for key in ("model", "algorithm"):
        sec = getattr(cfg, key)
        out[key] = {"name": sec.name, **dataclasses.asdict(sec.params)}
    for key in ("train", "eval", "run"):
        out[key] = dataclasses.asdict(getattr(cfg, key))
    return _plain(out)


def _plain(x):
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_plain(v) for v in x]
    return x


def apply_overrides(data: dict, overrides: dict[str, Any]) -> dict:
    """Set dotted keys in a nested mapping (copying it).

    Changing ``model.name`` or ``algorithm.name`` drops that section's other keys from the file
    (they belong to the old entry); keys given as overrides are kept.
    """
    data = _plain(data)
    for section in ("model", "algorithm"):
        new = overrides.get(f"{section}.name")
        if new is not None and isinstance(data.get(section), dict) and \
                data[section].get("name") != new:
            data[section] = {"name": new}
    for key, value in overrides.items():
        parts = key.split(".")
        node = data
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {key}: {part} is not a section")
            node = child
        node[parts[-1]] = value
    return data


def find_config(path_or_name: str) -> Path:
    """A YAML path, or the name of a shipped config (``digits_vit``)."""
    p = Path(path_or_name)
    if p.is_file():
        return p
    shipped = CONFIG_DIR / f"{path_or_name}.yaml"
    if shipped.is_file():
        return shipped
    names = sorted(q.stem for q in CONFIG_DIR.glob("*.yaml"))
    raise ConfigError(f"config {path_or_name!r} not found; shipped configs: {', '.join(names)}")


def load_config(path_or_name: str, overrides: list[str] | None = None) -> Config:
    """Read a YAML config, apply dotted overrides, check everything."""
    path = find_config(path_or_name)
    data = load_yaml(path)
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a config file must hold a mapping of sections (name, model, "
                          f"algorithm, train, ...), not {type(data).__name__}")
    return config_from_dict(apply_overrides(data, dict(parse_overrides(overrides or []))))
