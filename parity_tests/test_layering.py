"""The package's layering (DESIGN.md): each module of glm5_hal sits above what it uses, with no import cycle, and
glm5_hal imports nothing from backends/.

Every import statement counts, including those inside functions and under TYPE_CHECKING: a deferred import hides
a cycle from Python, not from the reader.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "glm5_hal"


def _modules(package: str, root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every module of `package` (a package is named by its __init__.py)."""
    modules = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _imported(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules `module` imports anywhere in its file: absolute names, relative ones resolved; `from pkg import
    name` counts as importing pkg.name where that is a module, else pkg itself."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in known else base)
    return found


def _import_graph() -> dict[str, set[str]]:
    known = _modules(PACKAGE)
    return {m: {t for t in _imported(m, p, known) if t in known and t != m} for m, p in known.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_relative_and_deferred_imports_are_seen(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("from pkg.low import VALUE\n")
    (package / "low.py").write_text("VALUE = 1\ndef f():\n    from . import high\n")
    type_only = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .low import VALUE\n"
    (package / "high.py").write_text(type_only)
    known = _modules("pkg", tmp_path)
    graph = {m: {t for t in _imported(m, p, known) if t in known and t != m} for m, p in known.items()}
    assert graph == {"pkg": {"pkg.low"}, "pkg.low": {"pkg.high"}, "pkg.high": {"pkg.low"}}
    assert _cycles(graph) == [["pkg.high", "pkg.low"]]


def test_glm5_hal_has_no_import_cycle() -> None:
    graph = _import_graph()
    assert len(graph) > 50 and "glm5_hal.ops.common" in graph  # the scan saw the package
    cycles = _cycles(graph)
    described = ["; ".join(f"{m} -> {sorted(graph[m] & set(c))}" for m in c) for c in cycles]
    assert not cycles, "import cycles in glm5_hal:\n" + "\n".join(described)


def test_glm5_hal_imports_nothing_from_backends() -> None:
    known = _modules(PACKAGE)
    offenders = {
        module: sorted(t for t in _imported(module, path, known) if t == "backends" or t.startswith("backends."))
        for module, path in known.items()
    }
    assert not {m: t for m, t in offenders.items() if t}
