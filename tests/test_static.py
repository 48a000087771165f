"""Static checks on the project's own Python: ruff's pyflakes rules (undefined names, unused or
shadowed imports), mypy on the package (so the quoted-shell type `Sh` is enforced where it is
declared), and an import graph without cycles. An undefined name in a lab test is otherwise found
only when that test runs, twenty minutes into the lab stage."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import ROOT

PACKAGE = "railyard"


def test_the_python_has_no_undefined_or_unused_names():
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.timeout(240)
def test_the_package_type_checks():
    # the configuration is pyproject.toml's [tool.mypy]; no cache: the run reads the tree as it is, writes nothing
    r = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", "/dev/null"],
                       cwd=ROOT, capture_output=True, text=True, timeout=230)
    assert r.returncode == 0, r.stdout + r.stderr


# ---------------------------------------------------------------- the import graph


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _module_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """The imports that run when the module is imported: at top level, or inside a top-level if/try/with
    (not under `if TYPE_CHECKING:`, which never runs). An import inside a function or a class body's method
    runs only when called: it cannot make an import-time cycle (it is how one is broken)."""
    out: list[ast.Import | ast.ImportFrom] = []

    def visit(stmts: list[ast.stmt]) -> None:
        for node in stmts:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                out.append(node)
            elif isinstance(node, ast.If):
                test = node.test
                if (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
                        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"):
                    visit(node.orelse)
                    continue
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for h in node.handlers:
                    visit(h.body)
                visit(node.orelse)
                visit(node.finalbody)
            elif isinstance(node, ast.With):
                visit(node.body)
    visit(tree.body)
    return out


def import_graph() -> dict[str, set[str]]:
    """{module: the package's modules it imports at module level}. `from X import name` counts X, or X.name
    where that is a module of the package; a package's __init__ is `railyard.pkg`."""
    files = {_module_name(p): p for p in sorted((ROOT / PACKAGE).rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        is_pkg = path.name == "__init__.py"
        deps: set[str] = set()
        for node in _module_level_imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                if node.level:
                    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base = base[:len(base) - (node.level - 1)]
                    where = ".".join(base + ([node.module] if node.module else []))
                else:
                    where = node.module or ""
                targets = [f"{where}.{a.name}" if f"{where}.{a.name}" in files else where for a in node.names]
            deps.update(t for t in targets if t in files and t != mod)
        graph[mod] = deps
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted; sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            strong(v)
    return sorted(found)


def _one_cycle(graph: dict[str, set[str]], comp: list[str]) -> list[str]:
    """A shortest closed path through the component's first module, for the message."""
    start, members = comp[0], set(comp)
    paths = {start: [start]}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(graph[v] & members):
            if w == start:
                return paths[v] + [start]
            if w not in paths:
                paths[w] = paths[v] + [w]
                queue.append(w)
    return comp


def test_the_import_graph_finder_sees_a_cycle():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_cycles(g) == [["a", "b", "c"]] and _one_cycle(g, ["a", "b", "c"]) == ["a", "b", "c", "a"]


def test_the_package_imports_have_no_cycle_at_module_level():
    graph = import_graph()
    cycles = import_cycles(graph)
    assert not cycles, "import cycles (module-level imports): " + "; ".join(
        " -> ".join(_one_cycle(graph, c)) + f" (component: {', '.join(c)})" for c in cycles)
