"""Property-based fuzzing of every config schema: each invalid value exits 2, names its key and
writes nothing.

Four schemas, each through the ``linattn`` router in this process: the runner's run config
(``linattn run``), the simulator's config (``linattn simulate run``), a study plan
(``linattn study``) and a warm-up problem file (``linattn warmup --problem``). Hypothesis draws a
key of the schema and a value that is invalid for it (wrong type, NaN or infinity, out of range,
a size that cannot fit in memory, an unknown key, a path that escapes the output folder); every
case must exit 2 with ``error: ...`` naming the dotted key, and leave the output folder empty.
The examples are derandomized (the same cases on every machine) and counted; each test prints
its count.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from linattn.cli import main as linattn_main

ROOT = Path(__file__).resolve().parents[1]
SIM_DEFAULT = ROOT / "simulations" / "configs" / "default.yaml"
FUZZ = settings(max_examples=200, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])

# a run that would finish in a second if a bad value got through
RUN_BASE = ["model.dim=8", "model.mlp_dim=16", "model.depth=1", "model.heads=2",
            "train.batch_size=8", "train.local_steps=2", "train.rounds=1",
            "partition.num_clients=3", "algorithm.name=fedavg", "run.progress=false",
            "run.plot=false"]
SIM_BASE = ["problem.dim=3", "problem.num_clients=3", "problem.context_length=4",
            "training.total_rounds=4", "training.warmup_rounds=[0,2,4]",
            "training.batch_size=4", "data.samples_per_client=32", "data.test_samples=8",
            "simulation.seeds=2"]


def yaml_value(value) -> str:
    """``value`` as the YAML text of a ``key=value`` override."""
    if isinstance(value, float) and not math.isfinite(value):
        return ".nan" if math.isnan(value) else (".inf" if value > 0 else "-.inf")
    return json.dumps(value)


NON_FINITE = st.sampled_from([math.nan, math.inf, -math.inf])
WRONG = st.one_of(st.text(alphabet="abcxyz_", min_size=1, max_size=6),
                  st.lists(st.integers(0, 3), max_size=2),
                  st.dictionaries(st.sampled_from(["a", "b"]), st.integers(0, 3), max_size=1))
NOT_INT = st.one_of(WRONG, st.floats(0.1, 5.9).filter(lambda v: not v.is_integer()),
                    NON_FINITE, st.booleans())
NOT_NUMBER = st.one_of(WRONG, NON_FINITE, st.booleans())
BIG = st.integers(10**9, 10**12)


def _below(low: int):
    return st.integers(-10**6, low - 1)


def _run_cases():
    """(key, invalid value) pairs of the run config, by kind."""
    ints = {"seed": 0, "seeds.partition": 0, "seeds.sampling": 0, "seeds.training": 0,
            "partition.num_clients": 1, "partition.min_size": 1,
            "partition.classes_per_client": 1, "train.rounds": 1, "train.clients_per_round": 1,
            "train.local_steps": 1, "train.batch_size": 1, "eval.every": 1, "eval.batch_size": 1,
            "run.checkpoint_every": 1, "model.patch": 1, "model.dim": 1, "model.depth": 1,
            "model.heads": 1, "model.mlp_dim": 1, "data.train_limit": 1, "data.test_limit": 1}
    floats = {"train.lr": st.floats(-1e3, 0), "train.momentum": st.floats(1, 1e3),
              "train.weight_decay": st.floats(-1e3, -1e-9), "partition.alpha": st.floats(-1e3, 0),
              "model.dropout": st.floats(1, 1e3), "train.clip_grad_norm": st.floats(-1e3, 0)}
    literals = ["train.optimizer", "train.engine", "train.precision", "partition.scheme",
                "model.attention", "model.activation", "model.pool"]
    strings = ["data.name", "train.device", "run.out_dir", "name", "model.name",
               "algorithm.name"]
    bools = ["eval.clients", "run.progress", "run.tensorboard", "run.plot"]
    return st.one_of(
        st.tuples(st.sampled_from(sorted(ints)), NOT_INT),
        st.sampled_from(sorted(ints)).flatmap(lambda k: st.tuples(st.just(k), _below(ints[k]))),
        st.tuples(st.sampled_from(sorted(floats)), NOT_NUMBER),
        st.sampled_from(sorted(floats)).flatmap(lambda k: st.tuples(st.just(k), floats[k])),
        st.tuples(st.sampled_from(literals), st.text(alphabet="qwz", min_size=1, max_size=5)),
        st.tuples(st.sampled_from(strings), st.one_of(st.integers(), st.lists(st.integers(),
                                                                               max_size=2))),
        st.tuples(st.sampled_from(bools), st.one_of(st.integers(2, 9), st.text("xyz", min_size=1,
                                                                                max_size=3))),
        st.tuples(st.just("train.batch_size"), BIG),
        st.tuples(st.just("eval.batch_size"), st.just(0)),
        st.tuples(st.just("model.dim"), st.integers(10**6, 10**8).map(lambda v: 2 * v)),
        st.tuples(st.sampled_from(["train.device"]), st.sampled_from(["gpu", "tpu", "cuda:99",
                                                                       "npu", "cuda:x"])),
        st.tuples(st.sampled_from(["name"]), st.sampled_from(["../up", "a/b", "..", "/abs"])),
        st.tuples(st.sampled_from(["train.local_epochs"]), NON_FINITE),
        st.tuples(st.sampled_from(["train.zzz", "model.zzz", "eval.zzz", "zzz"]), st.integers()),
    )


COUNTS: dict[str, int] = {}


def _report(capsys, schema: str, floor: int) -> None:
    n = COUNTS.get(schema, 0)
    with capsys.disabled():
        print(f"\n[fuzz] {schema}: {n} generated invalid cases, each exit 2, key named, "
              "nothing written", file=sys.stderr)
    assert n >= floor, (schema, n)


def _check(capsys, code: int, key: str, out: Path) -> None:
    err = capsys.readouterr().err
    assert code == 2, (key, code, err)
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in err, err  # one line, no traceback
    assert key in errors[0], (key, err)
    assert not out.exists() or not any(out.iterdir()), (key, sorted(out.rglob("*")))


def test_run_config_fuzz(tmp_path, capsys):
    @FUZZ
    @given(_run_cases())
    def case(kv):
        key, value = kv
        COUNTS["run config"] = COUNTS.get("run config", 0) + 1
        out = tmp_path / f"out{COUNTS['run config']}"
        extra = ["train.local_steps=null"] if key == "train.local_epochs" else []
        # the key's override comes last, so that a bad run.out_dir replaces the good one
        code = linattn_main(["run", "--config", "digits_vit", *RUN_BASE, *extra,
                             f"run.out_dir={out}", f"{key}={yaml_value(value)}"])
        _check(capsys, code, key, out)

    case()
    _report(capsys, "run config", 200)


def _sim_cases():
    ints = {"problem.dim": 1, "problem.num_clients": 1, "problem.context_length": 1,
            "problem.out_dim": 1, "problem.seed": 0, "training.local_steps": 1,
            "training.batch_size": 1, "training.total_rounds": 1, "training.init_seed": 0,
            "data.samples_per_client": 1, "data.test_samples": 1, "simulation.seeds": 1,
            "simulation.first_seed": 0}
    floats = {"problem.kernel_heterogeneity": st.floats(-1e3, -1e-9),
              "problem.ridge": st.floats(-1e3, -1e-9), "problem.noise": st.floats(-1e3, -1e-9),
              "training.lr": st.floats(-1e3, 0), "training.participation": st.floats(1.01, 1e3),
              "training.init_scale": st.floats(-1e3, 0)}
    return st.one_of(
        st.tuples(st.sampled_from(sorted(ints)), NOT_INT),
        st.sampled_from(sorted(ints)).flatmap(lambda k: st.tuples(st.just(k), _below(ints[k]))),
        st.tuples(st.sampled_from(sorted(floats)), NOT_NUMBER),
        st.sampled_from(sorted(floats)).flatmap(lambda k: st.tuples(st.just(k), floats[k])),
        st.tuples(st.sampled_from(["data.samples_per_client"]), st.integers(10**9, 10**12)),
        st.tuples(st.sampled_from(["simulation.name"]), st.sampled_from(["../x", "a/b", ".."])),
        st.tuples(st.sampled_from(["training.attention", "training.parametrization",
                                   "problem.weights"]), st.text("qwz", min_size=1, max_size=4)),
        st.tuples(st.sampled_from(["training.warmup_rounds"]),
                  st.one_of(st.just([]), st.lists(st.integers(5, 99), min_size=1, max_size=3),
                            st.lists(st.integers(-9, -1), min_size=1, max_size=2))),
        st.tuples(st.sampled_from(["training.zzz", "data.zzz"]), st.integers()),
    )


def test_simulator_config_fuzz(tmp_path, capsys):
    @FUZZ
    @given(_sim_cases())
    def case(kv):
        key, value = kv
        COUNTS["simulator config"] = COUNTS.get("simulator config", 0) + 1
        out = tmp_path / f"out{COUNTS['simulator config']}"
        code = linattn_main(["simulate", "run", "--config", str(SIM_DEFAULT), "--out",
                             str(out), *SIM_BASE, f"{key}={yaml_value(value)}"])
        _check(capsys, code, key, out)

    case()
    _report(capsys, "simulator config", 200)


def _plan(**sweep) -> dict:
    base = {"name": "digits", "config": "digits_vit",
            "overrides": RUN_BASE, "alphas": [0.5],
            "arms": [{"name": "fedavg", "overrides": ["algorithm.name=fedavg"]}]}
    return {"name": "fuzz", "seeds": [0], "sweeps": [{**base, **sweep}]}


def _plan_cases():
    """(plan mapping, the key its error must name)."""
    bad_names = st.sampled_from(["../escaped", "/abs", "a/b", "..", ".", "", "a\\b", "x y"])
    return st.one_of(
        bad_names.map(lambda n: (_plan(name=n), "sweeps[0].name")),
        bad_names.map(lambda n: (_plan(arms=[{"name": n}]), "sweeps[0].arms[0].name")),
        st.one_of(st.integers(), st.text("ab", max_size=3), st.just([])).map(
            lambda v: (_plan(arms=v), "sweeps[0].arms")),
        st.one_of(st.integers(), st.just([]), st.lists(st.integers(-9, -1), min_size=1,
                                                        max_size=2)).map(
            lambda v: (_plan(seeds=v), "sweeps[0].seeds")),
        st.one_of(NON_FINITE, st.floats(-1e3, 0), st.text("ab", min_size=1, max_size=2)).map(
            lambda a: (_plan(alphas=[a]), "sweeps[0].alphas")),
        st.one_of(st.integers(), st.lists(st.integers(-9, -1), min_size=1, max_size=2)).map(
            lambda v: (_plan(arms=[{"name": "f", "warmup_rounds": v}]),
                       "sweeps[0].arms[0].warmup_rounds")),
        st.sampled_from([5, "x", [1], ["noequals"]]).map(
            lambda v: (_plan(overrides=v), "sweeps[0].overrides")),
        st.sampled_from(["train.lr=-1", "train.lr=.nan", "model.heads=0", "data.name=3",
                         "train.batch_size=0", "model.dropout=1.5"]).map(
            lambda o: (_plan(arms=[{"name": "a", "overrides": [o]}]), o.split("=")[0])),
        bad_names.map(lambda n: ({**_plan(), "pretrain": [{"name": n, "config": "digits_vit",
                                                           "source": "digits"}]},
                                 "pretrain[0].name")),
        st.sampled_from([5, "x", [-1]]).map(lambda v: ({**_plan(), "seeds": v}, "seeds")),
        st.sampled_from(["zzz", "extra"]).map(lambda k: ({**_plan(), k: 1}, k)),
    )


def test_study_plan_fuzz(tmp_path, capsys):
    @FUZZ
    @given(_plan_cases())
    def case(plan_key):
        plan, key = plan_key
        COUNTS["study plan"] = COUNTS.get("study plan", 0) + 1
        out = tmp_path / f"out{COUNTS['study plan']}"
        path = tmp_path / "plan.yaml"
        path.write_text(yaml.safe_dump(plan))
        code = linattn_main(["study", "--plan", str(path), "--out", str(out), "--no-tables"])
        _check(capsys, code, key, out)
        assert not (tmp_path / "escaped").exists() and not Path("/abs").exists()

    case()
    _report(capsys, "study plan", 200)


GOOD_PROBLEM = {"dim": 2, "out_dim": 1, "context_length": 3, "weights": [0.5, 0.5],
                "covariances": [[[1.0, 0.0], [0.0, 1.0]]] * 2,
                "kernel_teachers": [[[0.5, 0.1], [0.0, 0.4]]] * 2,
                "value_teachers": [[[1.0], [0.5]]] * 2, "ridge": 0.01, "noise": 0.1}


def _problem_cases():
    arrays = ["weights", "covariances", "kernel_teachers", "value_teachers"]

    def poison(key, value):
        data = json.loads(json.dumps(GOOD_PROBLEM))
        if key in arrays and not isinstance(value, list):  # one entry NaN/inf/a string
            flat = data[key]
            while isinstance(flat[0], list):
                flat = flat[0]
            flat[0] = value
        else:
            data[key] = value
        return data, key

    return st.one_of(
        st.tuples(st.sampled_from(["dim", "out_dim", "context_length"]),
                  st.one_of(WRONG, st.integers(-9, 0), st.floats(0.5, 9.5).filter(
                      lambda v: not v.is_integer()))).map(lambda kv: poison(*kv)),
        st.tuples(st.sampled_from(arrays), st.one_of(NON_FINITE, st.text("ab", min_size=1,
                                                                          max_size=2))).map(
            lambda kv: poison(*kv)),
        st.tuples(st.sampled_from(arrays), st.just([[1.0, 2.0], [3.0]])).map(
            lambda kv: poison(*kv)),
        st.tuples(st.sampled_from(["ridge", "noise", "kernel_ridge"]),
                  st.one_of(NON_FINITE, st.floats(-1e3, -1e-9), st.text("ab", min_size=1,
                                                                          max_size=2))).map(
            lambda kv: poison(*kv)),
        st.tuples(st.sampled_from(["dim", "num_clients", "context_length", "seed"]),
                  st.one_of(st.integers(-9, -1), st.text("ab", min_size=1, max_size=2))).map(
            lambda kv: ({"make_problem": {kv[0]: kv[1]}}, kv[0])),
        st.tuples(st.sampled_from(["kernel_heterogeneity", "covariate_shift", "noise"]),
                  st.one_of(NON_FINITE, st.floats(-9, -1e-6))).map(
            lambda kv: ({"make_problem": {kv[0]: kv[1]}}, kv[0])),
        st.tuples(st.sampled_from(["lr", "local_steps", "total_rounds", "init_seed"]),
                  st.one_of(NON_FINITE, st.integers(-9, -1), st.text("ab", min_size=1,
                                                                     max_size=2))).map(
            lambda kv: ({"make_problem": {"dim": 2, "num_clients": 2},
                         "schedule": {"lr": 0.05, "local_steps": 2, kv[0]: kv[1]}}, kv[0])),
    )


def _problem_yaml(data) -> str:
    text = json.dumps(data)  # JSON is YAML, except for NaN and infinities
    return text.replace("NaN", ".nan").replace("-Infinity", "-.inf").replace("Infinity", ".inf")


def test_problem_file_fuzz(tmp_path, capsys):
    @FUZZ
    @given(_problem_cases())
    def case(data_key):
        data, key = data_key
        COUNTS["problem file"] = COUNTS.get("problem file", 0) + 1
        out = tmp_path / f"out{COUNTS['problem file']}"
        out.mkdir()
        path = tmp_path / "problem.yaml"
        path.write_text(_problem_yaml(data))
        flags = [] if "schedule" in data else ["--lr", "0.05", "--local-steps", "2",
                                                "--total-rounds", "20"]
        code = linattn_main(["warmup", "--problem", str(path), *flags,
                             "--json", str(out / "t0.json"), "--csv", str(out / "t0.csv")])
        _check(capsys, code, key, out)

    case()
    _report(capsys, "problem file", 200)

