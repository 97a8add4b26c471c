"""No text in the repository narrates how it was developed.

Code, help texts and docs state what holds and why; history lives in git and measurements in
``docs/bench`` with their JSON. This test reads every tracked text file (``git ls-files``; without
git, the tree less ``.git``, virtual environments, run outputs and caches) and fails with
``file:line`` for each line that matches one of :data:`PATTERNS`: references to numbered work
items or to the sittings in which the code was written, and phrases that tell of a former state
of the code instead of the present one.

Measurement data under ``docs/bench/``, ``docs/study/`` and ``docs/gpu_runs/`` (``.json``,
``.csv``, ``.txt``: written by the benchmarks and runs, with their provenance) are not read; the
Markdown pages there are. This file holds the patterns and their samples, so it is not read
either.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SELF = Path(__file__).resolve().relative_to(ROOT).as_posix()

SUFFIXES = (".py", ".md", ".sh", ".toml", ".yaml", ".yml", ".cfg", ".txt", ".cff")
DATA_DIRS = ("docs/bench/", "docs/study/", "docs/gpu_runs/")
DATA_SUFFIXES = (".json", ".csv", ".txt")
# walked without git: not part of the repository's text
SKIP_DIRS = {".git", "runs", "__pycache__", ".pytest_cache", ".ruff_cache", ".hypothesis",
             ".data", "data_cache", ".cache", "build", "dist", ".whl", ".carry"}

_ORDINAL = r"(first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|last|previous)"

# (pattern, a sentence it must match); every pattern is case-insensitive. The phrases are split
# with "~" in this file (removed when read), so that the file itself reads as what holds.
_PAIRS: list[tuple[str, str]] = [
    # a work item by number, with or without "#"
    (r"\biss~ues?[ -]?#?\d+", "Engine benchmark (iss~ue 7): the grid."),
    # a development sitting; a pytest fixture's scope="session" (quoted) is code
    (r"(?<![\"'])\bsess~ions?\b(?![\"'](?!s\b))", "Results of the sixth sess~ion's code."),
    (r"\bwork it~ems?\b", "The fix belongs to another work it~em."),
    (r"\brounds? of wo~rk\b", "Done in the last round of wo~rk."),
    (r"\b" + _ORDINAL + r" (pass|iteration) of (the )?wo~rk\b",
     "Made in the second pass of wo~rk."),
    # a former state of the code; "is used to compute" is fine
    (r"\b(it|this|that|which|they|we|there|he|she) us~ed to\b",
     "The Hessian, which us~ed to be a finite difference."),
    (r"\bus~ed to be\b", "The grid us~ed to be larger."),
    (r"\bno lon~ger\b", "The thread is no lon~ger started first."),
    (r"\bprevi~ously\b", "The flag previ~ously defaulted to true."),
    (r"\bform~erly\b", "The option form~erly called --fast."),
    (r"\bany~more\b", "The probe is not drawn any~more."),
    (r"\bbef~ore this (change|commit|patch|fix|session|rewrite|refactor|redesign|version)\b",
     "Bef~ore this change the round took 320 ms."),
    (r"\bwith~drawn\b", "The ceiling of the notes is with~drawn."),
    (r"\bsince[- ]rem~oved\b", "A since-rem~oved helper drew the plan."),
    (r"\bear~lier (version|draft|session|code|commit|engine|release)s?\b",
     "An ear~lier version copied the gradients."),
    (r"\bwe (chan~ged|rewrote|replaced|removed|renamed|moved|reverted|fixed|dropped)\b",
     "Then we chan~ged the kernel."),
    (r"\bthis (com~mit|patch|pull request)\b", "The kernel added in this com~mit."),
    # an old measurement told as a change, "(w-a-s 79.1)"
    (r"\(w~as \d[\d.,]*( ?\w+)?\)", "On an H100 it is 84.0 (w~as 79.1)."),
    # a dated anecdote
    (r"\b2~0\d\d-[01]\d-[0-3]\d\b", "Measured on 2~026-11-26 on the shared VM."),
]
PATTERNS: dict[str, str] = {p.replace("~", ""): t.replace("~", "") for p, t in _PAIRS}
COMPILED = [re.compile(p, re.IGNORECASE) for p in PATTERNS]

# sentences that state what holds; no pattern may match them
LEGITIMATE = [
    "The value is used to compute the bound.",
    "The seed used to draw the partition is recorded.",
    "Rounds before T0 train the whole model.",
    "@pytest.fixture(scope=\"session\")",
    "subprocess.Popen(cmd, start_new_session=True)",
    "One round of local steps per client; a federated round averages them.",
    "The workers count as finished only runs finished before this launch time.",
    "The GitHub issue tracker takes bug reports.",
    "Earlier positions are masked (causal attention).",
    "q2, k2, v2 = (ref[:, :, i] for i in range(3))",
    "The run records its date (datetime.now) in summary.json.",
    "No T0 is shorter than the probe, any more than the run itself.",
]


def _is_data(rel: str) -> bool:
    return rel.startswith(DATA_DIRS) and rel.endswith(DATA_SUFFIXES)


def _git_files() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                             check=True, timeout=60).stdout.decode()
    except (OSError, subprocess.SubprocessError):
        return []
    return [f for f in out.split("\0") if f]


def _walked_files() -> list[str]:
    files = []
    for top, dirs, names in os.walk(ROOT):
        rel_top = Path(top).relative_to(ROOT).as_posix()
        dirs[:] = [d for d in dirs
                   if d not in SKIP_DIRS and not d.startswith(".venv")
                   and not d.endswith(".egg-info")
                   and f"{rel_top}/{d}".removeprefix("./") != "figures/out"]
        files += [f"{rel_top}/{n}".removeprefix("./") for n in names]
    return files


def _candidates(files: list[str] | None = None) -> list[str]:
    """The text files to read: git's tracked files, else the walked tree (git unavailable)."""
    files = files if files is not None else (_git_files() or _walked_files())
    return sorted(f for f in files
                  if f.endswith(SUFFIXES) and not _is_data(f) and f != SELF
                  and (ROOT / f).is_file())


def _hits(text: str) -> list[tuple[int, str, str]]:
    return [(no, pat.pattern, line.strip())
            for no, line in enumerate(text.splitlines(), start=1)
            for pat in COMPILED if pat.search(line)]


@pytest.mark.parametrize(("pattern", "sample"), list(PATTERNS.items()))
def test_pattern_matches_its_sample(pattern, sample):
    assert re.search(pattern, sample, re.IGNORECASE), pattern


@pytest.mark.parametrize("sentence", LEGITIMATE)
def test_legitimate_sentence_matches_no_pattern(sentence):
    assert not _hits(sentence), _hits(sentence)


@pytest.mark.parametrize("source", ["git", "walk"])
def test_candidates_skip_outputs_and_data(source):
    if source == "git" and not _git_files():
        pytest.skip("not a git checkout")
    files = _candidates(_git_files() if source == "git" else _walked_files())
    assert "tests/test_no_history.py" not in files and "README.md" in files
    assert not [f for f in files if _is_data(f) or f.startswith(("runs/", "figures/out/", ".venv"))
                or ".egg-info/" in f]


def test_no_development_history_in_text_files():
    found = []
    for rel in _candidates():
        try:
            text = (ROOT / rel).read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        found += [f"{rel}:{no}: {line[:120]}  [{pat}]" for no, pat, line in _hits(text)]
    assert not found, ("text that narrates development history (state what holds instead):\n"
                       + "\n".join(found))
