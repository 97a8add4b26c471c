"""A study plan: its YAML format (:mod:`real_data.study`), loading and checking it, its runs.

Every run of a plan has a fixed key ``<sweep>/<arm>[-T0=<t>]/(alpha=<a> | natural)/seed=<s>``
(:func:`run_key`), its directory under the plan's ``out_dir``, and a config: the sweep's config
with the sweep's, the arm's and the run's own overrides (:func:`run_config`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import yaml

from linattn.configio import load_yaml
from linattn.errors import ConfigError
from real_data.config import Config, load_config


@dataclass(frozen=True)
class Arm:
    """One algorithm setting of a sweep; ``warmup_rounds`` makes it a T0 sweep (FedFrozen)."""

    name: str
    overrides: tuple[str, ...] = ()
    warmup_rounds: tuple[int, ...] = ()
    reference: bool = False


@dataclass(frozen=True)
class Sweep:
    name: str
    config: str
    overrides: tuple[str, ...]
    alphas: tuple[float | None, ...]
    arms: tuple[Arm, ...]
    seeds: tuple[int, ...]


@dataclass(frozen=True)
class PretrainJob:
    """One central pretraining (``linattn pretrain``) the plan's runs load."""

    name: str
    config: str
    source: str
    overrides: tuple[str, ...] = ()
    epochs: int = 3
    exclude_largest_groups: int = 0
    seed: int = 0


@dataclass(frozen=True)
class Plan:
    name: str
    out_dir: Path
    sweeps: tuple[Sweep, ...]
    pretrain: tuple[PretrainJob, ...] = ()

    def pretrained_path(self, job: PretrainJob) -> Path:
        return self.out_dir / "pretrained" / f"{job.name}.pt"


@dataclass(frozen=True)
class RunSpec:
    """One run of the plan (T0 sweeps: one spec per T0, the largest first)."""

    key: str
    sweep: Sweep
    arm: Arm
    alpha: float | None
    seed: int
    warmup_rounds: int | None
    run_dir: Path


def _require(cond: bool, where: str, message: str) -> None:
    if not cond:
        raise ConfigError(f"{where}: {message}")


def _strings(value, where: str) -> tuple[str, ...]:
    _require(isinstance(value, list) and all(isinstance(v, str) for v in value), where,
             "must be a list of key=value strings")
    return tuple(value)


def load_plan(path: Path | str, out_dir: Path | str | None = None) -> Plan:
    """Read and check a plan file; every error names the key and the allowed values."""
    path = Path(path)
    if not path.is_file():
        shipped = Path(__file__).parents[1] / "studies" / (path.name if path.suffix else
                                                       f"{path}.yaml")
        _require(shipped.is_file(), "--plan", f"{path} not found (nor {shipped})")
        path = shipped
    try:
        raw = load_yaml(path) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({exc})") from None
    _require(isinstance(raw, dict), str(path), "must be a mapping")
    unknown = set(raw) - {"name", "out_dir", "seeds", "sweeps", "pretrain", "common_arms"}
    _require(not unknown, str(path), f"unknown keys {sorted(unknown)}; allowed: name, out_dir, "
             "seeds, sweeps, pretrain, common_arms (YAML anchors only)")
    seeds = raw.get("seeds", [0])
    _require(isinstance(seeds, list) and seeds and all(isinstance(s, int) for s in seeds),
             "seeds", "must be a non-empty list of integers")
    sweeps = []
    _require(isinstance(raw.get("sweeps"), list) and raw["sweeps"], "sweeps",
             "must be a non-empty list")
    for i, sw in enumerate(raw["sweeps"]):
        where = f"sweeps[{i}]"
        _require(isinstance(sw, dict), where, "must be a mapping")
        bad = set(sw) - {"name", "config", "overrides", "alphas", "arms", "seeds"}
        _require(not bad, where, f"unknown keys {sorted(bad)}; allowed: name, config, "
                 "overrides, alphas, arms, seeds")
        for key in ("name", "config", "arms"):
            _require(key in sw, where, f"missing {key!r}")
        alphas = sw.get("alphas", [None])
        _require(isinstance(alphas, list) and all(a is None or (isinstance(a, int | float)
                                                               and a > 0) for a in alphas),
                 f"{where}.alphas", "must be a list of positive numbers")
        arms = []
        for j, arm in enumerate(sw["arms"]):
            aw = f"{where}.arms[{j}]"
            _require(isinstance(arm, dict) and "name" in arm, aw, "must be a mapping with a name")
            bad = set(arm) - {"name", "overrides", "warmup_rounds", "reference"}
            _require(not bad, aw, f"unknown keys {sorted(bad)}; allowed: name, overrides, "
                     "warmup_rounds, reference")
            t0s = arm.get("warmup_rounds", [])
            _require(isinstance(t0s, list) and all(isinstance(t, int) and t >= 0 for t in t0s),
                     f"{aw}.warmup_rounds", "must be a list of integers >= 0")
            arms.append(Arm(arm["name"], _strings(arm.get("overrides", []), f"{aw}.overrides"),
                            tuple(sorted(set(t0s), reverse=True)), bool(arm.get("reference"))))
        names = [a.name for a in arms]
        _require(len(set(names)) == len(names), f"{where}.arms", "arm names must be unique")
        sweeps.append(Sweep(sw["name"], str(sw["config"]),
                            _strings(sw.get("overrides", []), f"{where}.overrides"),
                            tuple(alphas), tuple(arms), tuple(sw.get("seeds", seeds))))
    jobs = []
    _require(isinstance(raw.get("pretrain", []), list), "pretrain", "must be a list")
    fields = {"name", "config", "source", "overrides", "epochs", "exclude_largest_groups", "seed"}
    for i, job in enumerate(raw.get("pretrain", [])):
        where = f"pretrain[{i}]"
        _require(isinstance(job, dict), where, "must be a mapping")
        bad = set(job) - fields
        _require(not bad, where,
                 f"unknown keys {sorted(bad)}; allowed: {', '.join(sorted(fields))}")
        for key in ("name", "config", "source"):
            _require(isinstance(job.get(key), str), where, f"missing {key!r} (a string)")
        for key, low in (("epochs", 1), ("exclude_largest_groups", 0), ("seed", 0)):
            value = job.get(key, low)
            _require(isinstance(value, int) and value >= low, f"{where}.{key}",
                     f"must be an integer >= {low}")
        jobs.append(PretrainJob(job["name"], job["config"], job["source"],
                                _strings(job.get("overrides", []), f"{where}.overrides"),
                                int(job.get("epochs", 3)),
                                int(job.get("exclude_largest_groups", 0)), int(job.get("seed", 0))))
    names = [j.name for j in jobs]
    _require(len(set(names)) == len(names), "pretrain", "job names must be unique")
    out = Path(out_dir or raw.get("out_dir", f"runs/study-{raw.get('name', path.stem)}"))
    return Plan(str(raw.get("name", path.stem)), out, tuple(sweeps), tuple(jobs))


def run_key(sweep: str, arm: str, t0, alpha, seed) -> str:
    """``<sweep>/<arm>[-T0=<t>]/(alpha=<a> | natural)/seed=<s>``: a run's directory under
    the plan's ``out_dir``."""
    arm_part = arm if t0 is None else f"{arm}-T0={t0}"
    alpha_part = "natural" if alpha is None else f"alpha={alpha:g}"
    return f"{sweep}/{arm_part}/{alpha_part}/seed={seed}"


def plan_runs(plan: Plan) -> list[RunSpec]:
    """Every run of the plan, in plan order (a T0 family's largest T0 first)."""
    specs = []
    for sw in plan.sweeps:
        for arm in sw.arms:
            for alpha in sw.alphas:
                for seed in sw.seeds:
                    for t0 in arm.warmup_rounds or (None,):
                        key = run_key(sw.name, arm.name, t0, alpha, seed)
                        specs.append(RunSpec(key, sw, arm, alpha, seed, t0, plan.out_dir / key))
    return specs


def run_overrides(spec: RunSpec, t0: int | None) -> list[str]:
    """The dotted overrides of ``spec``'s run: its sweep's and arm's, then seed, alpha and T0;
    ``{out_dir}`` replaced by the plan's output folder."""
    extra = [f"seed={spec.seed}", "run.progress=false"]
    if spec.alpha is not None:
        extra.append(f"partition.alpha={spec.alpha}")
    if t0 is not None:
        extra += [f"algorithm.warmup_rounds={t0}", "algorithm.warmup=fixed"]
    out_dir = str(spec.run_dir.parents[3])  # run_dir = out_dir/<sweep>/<arm>/<alpha>/<seed>
    return [o.replace("{out_dir}", out_dir)
            for o in (*spec.sweep.overrides, *spec.arm.overrides, *extra)]


def run_config(spec: RunSpec, t0: int | None) -> Config:
    """The resolved config of ``spec``'s run (a T0 branch with ``t0``, else ``None``)."""
    return load_config(spec.sweep.config, run_overrides(spec, t0))



def replace_out(plan: Plan, out_dir: Path) -> Plan:
    """``plan`` with its runs under ``out_dir``."""
    return dataclasses.replace(plan, out_dir=Path(out_dir))
