"""``linattn reproduce``: every figure and the report are written, and the report's numbers
are the simulator's validation JSON's."""

from __future__ import annotations

import json
import math
import re

import pytest
from figure_checks import assert_image_files

from figures.cli import MODULES


def _report(quick_run) -> str:
    return (quick_run["out"] / "report.md").read_text()


def _validation(quick_run) -> dict:
    return json.loads((quick_run["out"] / "validation" / "validation.json").read_text())


def test_every_figure_and_the_report_are_written(quick_run):
    out = quick_run["out"]
    report = _report(quick_run)
    for number, name in MODULES.items():
        assert_image_files([out / f"{name}.png", out / f"{name}.pdf"])
        assert f"![Figure {number}]({name}.png)" in report
        assert re.search(rf"^\*Figure {number}\.\* \S", report, re.M), f"no caption {number}"
    assert (out / "validation" / "validation.md").is_file()
    assert "Wall time" in report and "CPU time" in report and "load average" in report


def _parse_value(text: str):
    text = text.strip()
    if text.startswith("["):
        return [_parse_value(t) for t in text[1:-1].split(",") if t.strip()]
    if text in ("True", "False"):
        return text == "True"
    if text == "n/a":
        return None
    return float(text)


def _same(reported, expected) -> bool:
    """A reported number equals the JSON's to the 4 significant digits printed."""
    if isinstance(expected, list):
        return len(reported) == len(expected) and all(map(_same, reported, expected))
    if expected is None or isinstance(expected, bool):
        return reported == expected
    return math.isclose(reported, expected, rel_tol=5e-4, abs_tol=1e-300)


def test_report_numbers_equal_the_validation_json(quick_run):
    report, result = _report(quick_run), _validation(quick_run)
    rows = {line.split("|")[1].strip(): line for line in report.splitlines()
            if re.match(r"^\| P\d \|", line)}
    assert set(rows) == set(result["checks"])
    for name, check in result["checks"].items():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", rows[name])[1:-1]]
        measured, verdict = cells[3], cells[4]
        assert verdict == {True: "**PASS**", False: "**FAIL**", None: "report"}[check["pass"]]
        pairs = dict(part.split(" = ", 1) for part in measured.split("; "))
        assert set(pairs) == set(check["measured"])
        for key, value in check["measured"].items():
            assert _same(_parse_value(pairs[key]), value), (name, key, pairs[key], value)
    # the per-point tables too: P2 rows and P4 rows, every number
    for check, keys in (("P2", ["predicted_T0", "closed_form_T0", "empirical_T0", "factor"]),
                        ("P4", ["measured_floor", "D_frozen", "noise_term", "predicted"])):
        for point in result["checks"][check]["points"]:
            line = next(ln for ln in report.splitlines()
                        if ln.startswith(f"| {point['setting']} |") and len(ln.split("|")) > 6)
            header = next(ln for ln in report.splitlines()
                          if ln.startswith("| setting |") and keys[0] in ln)
            columns = [c.strip() for c in header.split("|")[1:-1]]
            cells = [c.strip() for c in line.split("|")[1:-1]]
            for key in keys:
                assert _same(float(cells[columns.index(key)]), point[key]), (check, key)


def test_a_refuted_prediction_is_reported_as_fail(quick_run):
    result = _validation(quick_run)
    failed = [k for k, c in result["checks"].items() if c["pass"] is False]
    assert "P1" in failed  # docs/results/validation.md: "drift increases" is refuted
    summary = next(ln for ln in _report(quick_run).splitlines() if ln.startswith("**Summary"))
    for name in failed:
        assert f"{name} FAIL" in summary


def test_real_data_figure_reads_the_study(quick_run):
    report = _report(quick_run)
    assert "recommended T0 = 3" in report
    assert "fedfrozen_v best T0 = 4" in report
    assert "status running, skipped" in report  # the unfinished run is named, not drawn


@pytest.mark.parametrize("argv, message", [
    (["reproduce", "--real-data", "/no/such/folder"], "--real-data"),
    (["figure", "7"], "--real-data"),
    (["figure", "15"], "invalid choice"),
    (["figure", "14"], "--real-data"),
    (["figure", "13"], "--real-data"),
    (["figure", "12"], "--real-data"),
    (["figure", "12", "--real-data", "/no/such/folder"], "no such folder"),
    (["figure", "11"], "--real-data"),
    (["figure", "11", "--real-data", "/no/such/folder"], "no such folder"),
    (["reproduce", "--threads", "0", "--quick"], "--threads"),
])
def test_bad_input_exits_2(tmp_path, capsys, argv, message):
    from linattn.cli import main

    assert main([*argv, "--out", str(tmp_path / "out")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out" / "report.md").exists()


def _numbers(x, path=""):
    """Every leaf of a JSON tree as (path, value)."""
    if isinstance(x, dict):
        for k, v in x.items():
            yield from _numbers(v, f"{path}/{k}")
    elif isinstance(x, list):
        for i, v in enumerate(x):
            yield from _numbers(v, f"{path}/{i}")
    else:
        yield path, x


def test_reproduce_validation_json_equals_a_standalone_simulator_run(quick_run, tmp_path):
    """``linattn simulate validate --quick`` gives the checks that reproduce reported (so the
    cached result is the simulator's, not a stale or re-implemented one)."""
    from linattn.cli import main

    assert main(["simulate", "validate", "--quick", "--out", str(tmp_path)]) == 0
    alone = json.loads((tmp_path / "validation.json").read_text())["checks"]
    ours = _validation(quick_run)["checks"]
    a, b = list(_numbers(alone)), list(_numbers(ours))
    assert len(a) == len(b) > 100
    pairs = list(zip(a, b))
    for (path_a, a), (path_b, b) in pairs:
        assert path_a == path_b
        if isinstance(a, float) and isinstance(b, float):
            assert math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-15), (path_a, a, b)
        else:
            assert a == b, (path_a, a, b)
