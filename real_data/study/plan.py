"""A study plan: its YAML format (:mod:`real_data.study`), loading and checking it, its runs.

Every run of a plan has a fixed key ``<sweep>/<arm>[-T0=<t>]/(alpha=<a> | natural)/seed=<s>``
(:func:`run_key`), its directory under the plan's ``out_dir``, and a config: the sweep's config
with the sweep's, the arm's and the run's own overrides (:func:`run_config`).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

from linattn.configio import load_yaml
from linattn.errors import ConfigError
from real_data.config import Config, config_to_dict, load_config
from real_data.schema import check_name

SCORES = ("global", "personal")
# a personal score's metric per split, the fine-tuned models' where the run fine-tunes, else
# the run's own evaluation models' (real_data.federation records both)
PERSONAL_METRICS = {"test": ("local_ft_acc_micro", "local_acc_micro"),
                    "val": ("local_ft_val_acc_micro", "local_val_acc_micro")}


def higher_is_better(metric: str) -> bool:
    """An accuracy (``*acc``) or a personal score rises with quality; a loss falls."""
    return metric == "personal" or metric.endswith("acc")


@dataclass(frozen=True)
class Arm:
    """One algorithm setting of a sweep; ``warmup_rounds`` makes it a T0 sweep (FedFrozen)."""

    name: str
    overrides: tuple[str, ...] = ()
    warmup_rounds: tuple[int, ...] = ()
    reference: bool = False
    grid: tuple[tuple[str, tuple], ...] = ()  # tuned keys and their candidate values
    # the arm of the same sweep whose runs this arm's runs are (:func:`same_runs`): set by the
    # final stage where a chosen configuration trains exactly as another arm's; never read
    # from a plan file
    same_as: str | None = None


@dataclass(frozen=True)
class Tune:
    """A plan's tuning stage (:mod:`real_data.study.tuning`): every arm's grid on ``seed``
    scored on the validation split, then the chosen configurations over the plan's seeds."""

    seed: int = 0
    last: int = 5  # the score: mean of the last ``last`` evaluations
    validation_fraction: float = 0.1
    metric: str = "val_acc"


@dataclass(frozen=True)
class Sweep:
    name: str
    config: str
    overrides: tuple[str, ...]
    alphas: tuple[float | None, ...]
    arms: tuple[Arm, ...]
    seeds: tuple[int, ...]
    grid: tuple[tuple[str, tuple], ...] = ()  # tuned keys shared by every arm of the sweep
    reference_sweep: str | None = None  # the no-shift sweep FedAvg's difficulty is read against
    score: str = "global"  # "personal": tuned and scored on every client's own model


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
    tune: Tune | None = None

    def pretrained_path(self, job: PretrainJob) -> Path:
        return inside(self.out_dir, f"pretrained/{job.name}.pt")


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
    _require(isinstance(value, list) and all(isinstance(v, str) and "=" in v for v in value),
             where, "must be a list of key=value strings")
    return tuple(value)


def _ints(value, where: str, low: int) -> tuple[int, ...]:
    _require(isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool)
                                             and v >= low for v in value), where,
             f"must be a list of integers >= {low}, e.g. [0, 1, 2]")
    return tuple(value)


def _mapping(value, where: str, allowed: set[str], required: tuple[str, ...] = ()) -> dict:
    _require(isinstance(value, dict), where, f"must be a mapping with keys "
             f"{', '.join(sorted(allowed))}")
    bad = set(value) - allowed
    _require(not bad, where, f"unknown keys {sorted(bad)}; allowed: {', '.join(sorted(allowed))}")
    for key in required:
        _require(key in value, where, f"missing {key!r}")
    return value


def _grid(value, where: str) -> tuple[tuple[str, tuple], ...]:
    """A tuning grid ``{dotted.key: [value, ...]}`` as sorted (key, values) pairs."""
    _require(isinstance(value, dict), where, "must be a mapping {dotted.key: [values]}, e.g. "
             "{train.lr: [0.02, 0.05, 0.1]}")
    out = []
    for key, values in value.items():
        _require(isinstance(key, str) and key and "=" not in key, f"{where}", f"key {key!r} "
                 "must be a dotted config key such as train.lr")
        _require(isinstance(values, list) and len(values) > 0, f"{where}.{key}",
                 "must be a non-empty list of values")
        out.append((key, tuple(values)))
    return tuple(sorted(out))


def tuned_arm_base(name: str) -> str:
    """The arm a tuning stage's arm tunes: ``fedavg`` for its grid point ``fedavg+1``
    (:mod:`~real_data.study.tuning` names them so); any other name as it is."""
    head, plus, index = name.rpartition("+")
    return head if head and plus and index.isdigit() else name


def _arm(arm, where: str) -> Arm:
    arm = _mapping(arm, where, {"name", "overrides", "warmup_rounds", "reference", "grid"},
                   ("name",))
    reference = arm.get("reference", False)
    _require(isinstance(reference, bool), f"{where}.reference", "must be true or false")
    t0s = _ints(arm.get("warmup_rounds", []), f"{where}.warmup_rounds", 0)
    name = check_name(arm["name"], f"{where}.name")
    head = tuned_arm_base(name)
    _require(head == name, f"{where}.name",
             f"{name!r} ends in '+' and a number, the tuning stage's name for grid point "
             f"{name[len(head) + 1:]} of arm {head!r}; rename it "
             f"(e.g. {name.replace('+', '_')!r})")
    return Arm(name,
               _strings(arm.get("overrides", []), f"{where}.overrides"),
               tuple(sorted(set(t0s), reverse=True)), reference,
               _grid(arm["grid"], f"{where}.grid") if "grid" in arm else ())


def _sweep(sw, where: str, seeds: tuple[int, ...]) -> Sweep:
    sw = _mapping(sw, where, {"name", "config", "overrides", "alphas", "arms", "seeds",
                              "grid", "reference_sweep", "score"}, ("name", "config", "arms"))
    _require(isinstance(sw["config"], str) and sw["config"], f"{where}.config",
             "must be a config name or a YAML path")
    alphas = sw.get("alphas", [None])
    _require(isinstance(alphas, list) and alphas and all(
        a is None or (isinstance(a, int | float) and not isinstance(a, bool)
                      and math.isfinite(a) and a > 0) for a in alphas),
             f"{where}.alphas", "must be a non-empty list of finite numbers > 0 (or null: the "
             "config's own partition)")
    _require(isinstance(sw["arms"], list) and sw["arms"], f"{where}.arms",
             "must be a non-empty list of arms ({name: ..., overrides: [...]})")
    arms = tuple(_arm(arm, f"{where}.arms[{j}]") for j, arm in enumerate(sw["arms"]))
    names = [a.name for a in arms]
    _require(len(set(names)) == len(names), f"{where}.arms", "arm names must be unique")
    if "seeds" in sw:
        seeds = _ints(sw["seeds"], f"{where}.seeds", 0)
        _require(bool(seeds), f"{where}.seeds", "must not be empty")
    ref = sw.get("reference_sweep")
    _require(ref is None or isinstance(ref, str) and ref, f"{where}.reference_sweep",
             "must be the name of another sweep of the plan")
    score = sw.get("score", "global")
    _require(score in SCORES, f"{where}.score", f"{score!r}: allowed {', '.join(SCORES)} "
             "(personal: every client's own model, a personalized method's or the global "
             "model after eval.finetune's local round)")
    return Sweep(check_name(sw["name"], f"{where}.name"), sw["config"],
                 _strings(sw.get("overrides", []), f"{where}.overrides"), tuple(alphas), arms,
                 seeds, _grid(sw["grid"], f"{where}.grid") if "grid" in sw else (), ref, score)


def _tune(raw, where: str = "tune") -> Tune:
    raw = _mapping(raw, where, {"seed", "last", "validation_fraction", "metric"})
    seed, last = raw.get("seed", 0), raw.get("last", 5)
    for key, value, low in (("seed", seed, 0), ("last", last, 1)):
        _require(isinstance(value, int) and not isinstance(value, bool) and value >= low,
                 f"{where}.{key}", f"must be an integer >= {low}")
    vf = raw.get("validation_fraction", 0.1)
    _require(isinstance(vf, int | float) and not isinstance(vf, bool) and 0 < vf <= 0.5,
             f"{where}.validation_fraction", "must be in (0, 0.5]")
    metric = raw.get("metric", "val_acc")
    _require(metric in ("val_acc", "val_loss"), f"{where}.metric",
             "must be val_acc or val_loss (tuning never reads the test set)")
    return Tune(int(seed), int(last), float(vf), metric)


def _pretrain_job(job, where: str) -> PretrainJob:
    fields = {"name", "config", "source", "overrides", "epochs", "exclude_largest_groups", "seed"}
    job = _mapping(job, where, fields)
    for key in ("name", "config", "source"):
        _require(isinstance(job.get(key), str), where, f"missing {key!r} (a string)")
    for key, low in (("epochs", 1), ("exclude_largest_groups", 0), ("seed", 0)):
        value = job.get(key, low)
        _require(isinstance(value, int) and not isinstance(value, bool) and value >= low,
                 f"{where}.{key}", f"must be an integer >= {low}")
    return PretrainJob(check_name(job["name"], f"{where}.name"), job["config"], job["source"],
                       _strings(job.get("overrides", []), f"{where}.overrides"),
                       int(job.get("epochs", 3)), int(job.get("exclude_largest_groups", 0)),
                       int(job.get("seed", 0)))


def load_plan(path: Path | str, out_dir: Path | str | None = None) -> Plan:
    """Read and check a plan file; every error names the key and the allowed values.

    Sweep, arm and pretraining names become folder and file names under ``out_dir``: each
    must be one plain name (no path separator, not ``..``), so no run lands outside it.
    """
    path = Path(path)
    if not path.is_file():
        shipped = Path(__file__).parents[1] / "studies" / (path.name if path.suffix else
                                                       f"{path}.yaml")
        _require(shipped.is_file(), "--plan", f"{path} not found (nor {shipped})")
        path = shipped
    raw = load_yaml(path)
    raw = {} if raw is None else raw
    try:
        return _plan(raw, path, out_dir)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def _plan(raw, path: Path, out_dir) -> Plan:
    raw = _mapping(raw, "the plan", {"name", "out_dir", "seeds", "sweeps", "pretrain",
                                     "common_arms", "tune"})
    name = raw.get("name", path.stem)
    _require(isinstance(name, str) and name, "name", "must be a string")
    seeds = _ints(raw.get("seeds", [0]), "seeds", 0)
    _require(bool(seeds), "seeds", "must be a non-empty list of integers >= 0")
    _require(isinstance(raw.get("sweeps"), list) and raw["sweeps"], "sweeps",
             "must be a non-empty list")
    sweeps = tuple(_sweep(sw, f"sweeps[{i}]", seeds) for i, sw in enumerate(raw["sweeps"]))
    names = [sw.name for sw in sweeps]
    _require(len(set(names)) == len(names), "sweeps", "sweep names must be unique")
    for i, sw in enumerate(sweeps):  # a personal score needs a personal metric in every arm
        if sw.score != "personal":
            continue
        for arm in sw.arms:
            t0 = [f"algorithm.warmup_rounds={max(arm.warmup_rounds)}", "algorithm.warmup=fixed"
                  ] if arm.warmup_rounds else []
            cfg = load_config(sw.config, [*sw.overrides, *arm.overrides, *t0])
            _require(cfg.eval.clients or cfg.eval.finetune, f"sweeps[{i}].score", "personal "
                     f"needs every client's own model evaluated: arm {arm.name} sets neither "
                     "eval.clients=true nor eval.finetune=true")
    by_name = {sw.name: sw for sw in sweeps}
    for i, sw in enumerate(sweeps):
        if sw.reference_sweep is None:
            continue
        ref = by_name.get(sw.reference_sweep)
        where = f"sweeps[{i}].reference_sweep"
        _require(ref is not None and ref is not sw, where, f"{sw.reference_sweep!r} is not "
                 f"another sweep of the plan; allowed: "
                 f"{', '.join(n for n in names if n != sw.name)}")
        for s_ in (sw, ref):
            _require(any(a.name == "fedavg" and not a.reference for a in s_.arms), where,
                     f"sweep {s_.name} has no (non-reference) arm named fedavg (difficulty is "
                     "FedAvg's gap to the reference)")
        _require(ref.reference_sweep is None, where, f"{ref.name} has a reference_sweep of "
                 "its own; the reference must be the data without a shift")
        _require(set(sw.alphas) <= set(ref.alphas) and set(sw.seeds) <= set(ref.seeds), where,
                 f"{ref.name} must run every alpha and seed of {sw.name} (alphas "
                 f"{list(sw.alphas)}, seeds {list(sw.seeds)})")
        _require(ref.score == sw.score, where, f"{ref.name} has score: {ref.score} and "
                 f"{sw.name} score: {sw.score}; the gap compares one score")
    _require(isinstance(raw.get("pretrain", []), list), "pretrain", "must be a list")
    jobs = tuple(_pretrain_job(job, f"pretrain[{i}]")
                 for i, job in enumerate(raw.get("pretrain", [])))
    names = [j.name for j in jobs]
    _require(len(set(names)) == len(names), "pretrain", "job names must be unique")
    given = out_dir if out_dir is not None else raw.get("out_dir", f"runs/study-{name}")
    _require(isinstance(given, str | Path) and str(given), "out_dir", "must be a folder path")
    tune = _tune(raw["tune"]) if "tune" in raw else None
    if tune is not None:
        for sw in sweeps:
            _require(tune.seed not in sw.seeds, "tune.seed", f"{tune.seed} is one of sweep "
                     f"{sw.name}'s final seeds; tune on a seed the final runs do not use")
    if tune is None:
        for sw in sweeps:
            _require(not sw.grid and not any(a.grid for a in sw.arms), f"sweep {sw.name}",
                     "has a tuning grid but the plan has no 'tune' section; add "
                     "tune: {seed: 0, last: 5, validation_fraction: 0.1}")
        for i, sw in enumerate(sweeps):  # a tuned plan holds out validation for every run
            for arm in sw.arms:
                if arm.warmup_rounds:
                    continue  # fixed T0s
                try:
                    cfg = load_config(sw.config, [o.replace("{out_dir}", str(given))
                                                  for o in (*sw.overrides, *arm.overrides)])
                except ConfigError:
                    continue  # a bad override stops the run's own start, naming the key
                params = cfg.algorithm.params
                if (getattr(params, "needs_validation", False)
                        and cfg.partition.validation_fraction is None):
                    _require(False, f"sweeps[{i}] arm {arm.name}",
                             f"algorithm.warmup={params.warmup} reads the validation split; "
                             "add partition.validation_fraction=0.1 to its overrides, or give "
                             "it a T0 (warmup_rounds)")
    return Plan(name, Path(given), sweeps, jobs, tune)


def override_value(overrides, key: str):
    """The value an override list gives ``key`` (``key=value``, value parsed as JSON where it
    is JSON), or None; the last override that names ``key`` wins, as in a run's config."""
    for o in reversed(list(overrides)):
        k, _, v = o.partition("=")
        if k == key:
            try:
                return json.loads(v)
            except ValueError:
                return v
    return None


def run_key(sweep: str, arm: str, t0, alpha, seed) -> str:
    """``<sweep>/<arm>[-T0=<t>]/(alpha=<a> | natural)/seed=<s>``: a run's directory under
    the plan's ``out_dir``."""
    arm_part = arm if t0 is None else f"{arm}-T0={t0}"
    alpha_part = "natural" if alpha is None else f"alpha={alpha:g}"
    return f"{sweep}/{arm_part}/{alpha_part}/seed={seed}"


def stage_runs(plans: Plan | list[Plan]) -> tuple[Path, list[RunSpec]]:
    """The out_dir and runs of one plan, or of a tuned plan's stages (one out_dir; a run in
    two stages counted once, in stage order)."""
    plans = [plans] if isinstance(plans, Plan) else list(plans)
    out_dirs = {p.out_dir for p in plans}
    if len(out_dirs) > 1:
        raise ValueError(f"plans of one out_dir expected, got {sorted(map(str, out_dirs))}")
    if not plans:  # no stage selected: nothing to pack or restore
        return Path("."), []
    seen, specs = set(), []
    for p in plans:
        for s in plan_runs(p):
            if s.run_dir not in seen:
                seen.add(s.run_dir)
                specs.append(s)
    return out_dirs.pop(), specs


def plan_runs(plan: Plan) -> list[RunSpec]:
    """Every run of the plan that trains, in plan order (a T0 family's largest T0 first); an
    arm whose runs are another arm's (``same_as``) has none (:func:`same_runs`)."""
    specs = []
    for sw in plan.sweeps:
        for arm in sw.arms:
            if arm.same_as is not None:
                continue
            for alpha in sw.alphas:
                for seed in sw.seeds:
                    for t0 in arm.warmup_rounds or (None,):
                        key = run_key(sw.name, arm.name, t0, alpha, seed)
                        specs.append(RunSpec(key, sw, arm, alpha, seed, t0,
                                             inside(plan.out_dir, key)))
    return specs


def same_runs(plan: Plan) -> list[tuple[RunSpec, RunSpec]]:
    """``(run, source)`` for every run of an arm with ``same_as``: the run as the plan names it
    (its directory is not written) and the run of the arm it trains as, same alpha and seed."""
    out = []
    for sw in plan.sweeps:
        for arm in sw.arms:
            if arm.same_as is None:
                continue
            src = next(a for a in sw.arms if a.name == arm.same_as)
            src_t0 = src.warmup_rounds[0] if src.warmup_rounds else None
            for alpha in sw.alphas:
                for seed in sw.seeds:
                    for t0 in arm.warmup_rounds or (None,):
                        key = run_key(sw.name, arm.name, t0, alpha, seed)
                        skey = run_key(sw.name, src.name, src_t0, alpha, seed)
                        out.append((RunSpec(key, sw, arm, alpha, seed, t0,
                                            inside(plan.out_dir, key)),
                                    RunSpec(skey, sw, src, alpha, seed, src_t0,
                                            inside(plan.out_dir, skey))))
    return out


# FedFrozen whose fixed T0 is the horizon never freezes: every round is its base algorithm's,
# and its metrics equal that algorithm's run to the bit for these bases (SCAFFOLD's control
# variates enter FedFrozen's update in another order: equal up to round-off, not counted)
SAME_RUN_BASES = ("fedavg", "fedprox")


def training_identity(cfg: Config) -> dict:
    """``cfg`` as a plain mapping, with a FedFrozen run that never freezes (fixed T0 at least
    the horizon, base in :data:`SAME_RUN_BASES`) written as its base algorithm: two runs
    whose identities are equal train the same way, round for round."""
    d = config_to_dict(cfg)
    a = d["algorithm"]
    if (a["name"] == "fedfrozen" and a.get("warmup") == "fixed"
            and a.get("warmup_rounds") is not None
            and a["warmup_rounds"] >= d["train"]["rounds"] and a.get("base") in SAME_RUN_BASES):
        d["algorithm"] = {"name": a["base"], **({"mu": a["mu"]} if a["base"] == "fedprox"
                                                 else {})}
    return d


def with_same_runs(sweep: Sweep, out_dir: Path) -> Sweep:
    """``sweep`` with ``same_as`` set on every arm whose runs train exactly as an earlier
    arm's (:func:`training_identity` of its first alpha and seed; reference arms aside), so
    the run trains once and both arms read it."""
    alpha, seed = sweep.alphas[0], sweep.seeds[0]
    seen: list[tuple[dict, str]] = []
    arms = []
    for arm in sweep.arms:
        if arm.reference or len(arm.warmup_rounds) > 1:
            arms.append(arm)
            continue
        t0 = arm.warmup_rounds[0] if arm.warmup_rounds else None
        key = run_key(sweep.name, arm.name, t0, alpha, seed)
        ident = training_identity(run_config(
            RunSpec(key, sweep, arm, alpha, seed, t0, inside(out_dir, key)), t0))
        source = next((name for other, name in seen if other == ident), None)
        if source is None:
            seen.append((ident, arm.name))
            arms.append(arm)
        else:
            arms.append(dataclasses.replace(arm, same_as=source))
    return dataclasses.replace(sweep, arms=tuple(arms))


def inside(root: Path, relative: str) -> Path:
    """``root / relative``, refused unless it stays inside ``root`` (names are checked when the
    plan is read; this holds the line for any path built later)."""
    path = root / relative
    base = root.resolve()
    if Path(relative).is_absolute() or not path.resolve().is_relative_to(base):
        raise ConfigError(f"{relative!r} would be written outside the plan's out_dir {root}; "
                          "use plain sweep and arm names")
    return path


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
