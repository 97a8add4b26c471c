"""The package layout: one dependency direction, no import cycles, no private names across
modules.

Every ``import`` statement counts, at module level or inside a function (a function-level import
that hides a cycle is still a cycle). The layers, bottom to top:

1. ``linattn.errors``, ``linattn.fileio``, ``linattn.configio``: shared leaves, import nothing
   of ours but each other;
2. ``linattn_theory``: imports only itself;
3. ``simulations`` and ``real_data``: the leaves and ``linattn_theory`` (not each other);
4. ``figures``: everything below;
5. the command line (``linattn.cli``, ``linattn.theory_cli``, ``linattn.__main__``): anything.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("linattn", "linattn_theory", "simulations", "real_data", "figures")
LEAVES = {"linattn", "linattn.errors", "linattn.fileio", "linattn.configio"}
COMMANDS = {"linattn.cli", "linattn.theory_cli", "linattn.__main__"}
ALLOWED = {  # layer -> the layers it may import
    "leaf": {"leaf"},
    "linattn_theory": {"linattn_theory"},
    "simulations": {"leaf", "linattn_theory", "simulations"},
    "real_data": {"leaf", "linattn_theory", "real_data"},
    "figures": {"leaf", "linattn_theory", "simulations", "real_data", "figures"},
    "commands": {"leaf", "linattn_theory", "simulations", "real_data", "figures", "commands"},
}


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


MODULES = _modules()


def _owner(name: str) -> str | None:
    """The module of ours that ``name`` (a dotted import target) lives in, if any."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _edges(module: str) -> list[tuple[str, str]]:
    """(target module, imported name or '') for every import statement of ``module``."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(t, "") for a in node.names if (t := _owner(a.name))]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                if full in MODULES:
                    out.append((full, ""))
                elif (t := _owner(base)):
                    out.append((t, alias.name))
    return out


GRAPH = {m: _edges(m) for m in MODULES}


def _layer(module: str) -> str:
    if module in LEAVES:
        return "leaf"
    if module in COMMANDS:
        return "commands"
    return module.split(".")[0]


def _cycles() -> list[list[str]]:
    """Strongly connected components with more than one module (or a self-import)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w, _ in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or any(t == v for t, _ in GRAPH[v]):
                found.append(sorted(comp))

    for v in GRAPH:
        if v not in index:
            visit(v)
    return found


def test_the_graph_is_read():
    assert len(MODULES) > 100
    assert ("linattn_theory.problem", "Problem") in GRAPH["linattn_theory.warmup"] or \
        ("linattn_theory.problem", "") in GRAPH["linattn_theory.warmup"]


def test_no_import_cycle():
    assert _cycles() == []


def test_a_planted_cycle_is_found(monkeypatch):
    monkeypatch.setitem(GRAPH, "linattn_theory.problem",
                        [*GRAPH["linattn_theory.problem"], ("linattn_theory.warmup", "")])
    assert any("linattn_theory.warmup" in c for c in _cycles())


def test_no_private_name_imported_across_modules():
    bad = [f"{m} imports {name} from {t}" for m, edges in GRAPH.items() for t, name in edges
           if name.startswith("_") and not name.startswith("__") and t != m]
    assert bad == []


def test_dependencies_point_one_way():
    bad = [f"{m} ({_layer(m)}) imports {t} ({_layer(t)})" for m, edges in GRAPH.items()
           for t, _ in edges if _layer(t) not in ALLOWED[_layer(m)]]
    assert bad == []
