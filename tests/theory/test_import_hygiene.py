"""``linattn_theory`` never imports torch or matplotlib.

Dynamic: a fresh interpreter imports every module of the package (pkgutil walk, derivations
included), runs ``linattn.theory_cli.main(['warmup', ...])`` on constants and on a problem file,
and the ``linattn`` router's ``warmup`` route; then neither torch nor matplotlib (nor any of
their submodules) may be in sys.modules.

Static: no ``import torch`` / ``import matplotlib`` (or ``from ... import``) anywhere in the
package's source, with no exception (``--png`` is drawn by ``figures.warmup_plot``).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import linattn_theory

FORBIDDEN = ("torch", "matplotlib")
PACKAGE_DIR = Path(linattn_theory.__file__).parent

SCRIPT = r"""
import importlib, json, pkgutil, sys
import linattn_theory
names = sorted(m.name for m in pkgutil.walk_packages(linattn_theory.__path__, "linattn_theory."))
for name in names:
    importlib.import_module(name)
from linattn import theory_cli as cli
codes = [cli.main(["warmup", "--heterogeneity", "0.5", "--local-steps", "10", "--lr", "0.05"]),
         cli.main(["warmup", "--problem", sys.argv[1], "--lr", "0.05", "--local-steps", "3",
                   "--total-rounds", "20", "--csv", sys.argv[2]])]
import linattn.cli
codes.append(linattn.cli.main(["warmup", "--heterogeneity", "0.5", "--local-steps", "10",
                               "--lr", "0.05"]))
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "matplotlib"))
print("RESULT" + json.dumps({"modules": names, "codes": codes, "loaded": loaded}))
"""


def test_no_torch_or_matplotlib_at_runtime(tmp_path):
    problem = tmp_path / "problem.json"
    problem.write_text(json.dumps({"make_problem": {"dim": 2, "num_clients": 2,
                                                    "context_length": 3, "seed": 0}}))
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(problem), str(tmp_path / "c.csv")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT"))
    result = json.loads(line[len("RESULT"):])
    assert result["codes"] == [0, 0, 0]
    assert result["loaded"] == [], result["loaded"]
    expected = {f"linattn_theory.{p.stem}" for p in PACKAGE_DIR.glob("*.py")
                if p.stem != "__init__"}
    assert expected <= set(result["modules"])
    if (PACKAGE_DIR / "derivations").is_dir():
        assert any(m.startswith("linattn_theory.derivations.") for m in result["modules"])
    assert (tmp_path / "c.csv").exists()


class _ImportFinder(ast.NodeVisitor):
    def __init__(self):
        self.stack, self.found = [], []

    def _function(self, node):
        self.stack.append(node.name)
        self.generic_visit(node)
        self.stack.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _function

    def _record(self, node, module):
        if module and module.split(".")[0] in FORBIDDEN:
            self.found.append((module, node.lineno, ".".join(self.stack)))

    def visit_Import(self, node):
        for alias in node.names:
            self._record(node, alias.name)

    def visit_ImportFrom(self, node):
        self._record(node, node.module if node.level == 0 else None)

    def visit_Call(self, node):  # importlib.import_module("torch") / __import__("torch")
        name = getattr(node.func, "attr", getattr(node.func, "id", ""))
        if name in ("import_module", "__import__") and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                self._record(node, arg.value)
        self.generic_visit(node)


def test_no_static_torch_or_matplotlib_imports():
    files = sorted(PACKAGE_DIR.rglob("*.py"))
    assert len(files) >= 10
    offending = []
    for path in files:
        finder = _ImportFinder()
        finder.visit(ast.parse(path.read_text(), filename=str(path)))
        for module, line, scope in finder.found:  # no exception anywhere in the package
            offending.append(f"{path.relative_to(PACKAGE_DIR)}:{line} imports {module}"
                             f" (scope: {scope or 'module'})")
    assert offending == []


def test_warmup_from_constants_imports_no_scipy():
    """``linattn warmup`` from constants alone needs numpy only: the theory package imports
    scipy where it is used (L-BFGS for Phi*, expm for covariate shift, the Lyapunov solve),
    which keeps the command's start-up at the interpreter's and numpy's."""
    script = ("import json, sys\n"
              "from linattn.cli import main\n"
              "code = main(['warmup', '--heterogeneity', '0.5', '--local-steps', '10',"
              " '--lr', '0.05'])\n"
              "print('RESULT' + json.dumps([code, sorted(m for m in sys.modules"
              " if m.split('.')[0] == 'scipy')]))\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT"))
    assert json.loads(line[len("RESULT"):]) == [0, []]


def test_png_is_drawn_outside_the_theory_package(tmp_path):
    """``linattn warmup --png`` works through the router; the theory package holds no I/O."""
    import subprocess
    import sys

    png = tmp_path / "curve.png"
    args = ["warmup", "--heterogeneity", "0.5", "--local-steps", "10", "--lr", "0.05",
            "--png", str(png)]
    done = subprocess.run([sys.executable, "-m", "linattn", *args], capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000
    assert not (PACKAGE_DIR / "cli.py").exists()
    import linattn.theory_cli

    assert linattn.theory_cli.main(args) == 0
