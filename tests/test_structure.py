"""The layout of the code: a layout is one folder under railyard/layouts/, found by one registry, and
the generic folders name no layout (what a layout knows beyond its plan is one of its hooks) and import no
engine (what they read from an engine is railyard.engines' contract, asked of the service's engine)."""

import ast
import io
import re
import tokenize

from railyard import engines
from railyard.plan import layout as layouts

from .conftest import ROOT
from .test_static import _module_name, _one_cycle, import_cycles

PKG = ROOT / "railyard"
GENERIC = ("transport", "facts", "checks", "plan", "render", "apply", "verbs", "cli", "bench")
# a word that is also a layout's name, where it means something else
NOT_A_LAYOUT = {
    ("render/lws.py", "replicas"): "the Kubernetes field (a LeaderWorkerSet's or a Deployment's replica count)",
    ("cli/recover.py", "replicas"): "the recover report's field (the replicas it restarted)",
    ("cli/health.py", "replicas"): "--cache-proof's help",
    ("cli/capacity.py", "dp_ep"): "--dp-reserve-gib's help (a task's help is read before any layout is imported)",
}


def generic_files():
    for d in GENERIC + ("inventory",):
        yield from sorted((PKG / d).rglob("*.py"))
    for f in ("report.py", "errors.py"):
        yield PKG / f


def layout_words(path):
    """(line, word, how) for every layout name in the file's code: imports of a layout's package,
    names, and words inside string literals; docstrings and comments are prose, not code."""
    text = path.read_text()
    tree = ast.parse(text)
    prose = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) \
                and ast.get_docstring(node, clean=False) is not None:
            prose |= set(range(node.body[0].lineno, node.body[0].end_lineno + 1))
        if isinstance(node, ast.ImportFrom) and node.module and re.search(r"(^|\.)layouts\.", node.module):
            yield node.lineno, node.module, "import"
    names = set(layouts.names())
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.start[0] in prose:
            continue
        if tok.type == tokenize.NAME and tok.string in names:
            yield tok.start[0], tok.string, "name"
        elif tok.type == tokenize.STRING:
            for w in set(re.findall(r"[A-Za-z_]+", tok.string)) & names:
                yield tok.start[0], w, "string"


def test_every_layout_is_one_package_found_by_the_registry():
    names = layouts.names()
    assert set(names) == {"multinode_tp", "single_node_tp", "dp_ep", "replicas", "pd"}
    for name in names:
        module = type(layouts.by_name(name)).__module__
        assert re.fullmatch(r"railyard\.layouts\.\w+", module), (name, module)
    # what an error names as the layouts able to do something comes from the classes' own hooks
    assert layouts.names_where(lambda cls: cls.cache_proof) == ("replicas",)
    assert layouts.names_where(lambda cls: cls.recovery is not layouts.Layout.recovery) == ("replicas", "pd")
    assert layouts.names_where(lambda cls: cls.kv_plan is not None) == ("single_node_tp", "dp_ep")
    packages = {p.parent.name for p in (PKG / "layouts").glob("*/__init__.py")}
    assert packages == {type(layouts.by_name(n)).__module__.rsplit(".", 1)[1] for n in names}


def test_the_generic_folders_name_no_layout():
    seen = []
    for path in generic_files():
        rel = str(path.relative_to(PKG))
        for line, word, how in layout_words(path):
            if how != "import" and (rel, word) in NOT_A_LAYOUT:
                continue
            seen.append(f"railyard/{rel}:{line}: {how} {word}")
    assert not seen, "a generic module names a layout (make it the layout's hook):\n" + "\n".join(seen)


def test_the_check_sees_a_layout_named_in_generic_code(tmp_path):
    """The grep above is not blind: it finds each way a layout can be named."""
    f = tmp_path / "m.py"
    f.write_text('"""pd in prose is fine."""\nfrom ..layouts.pd import proof  # pd\n'
                 'if plan.layout == "replicas":\n    dp_ep = 1\n')
    assert sorted((how, w) for _, w, how in layout_words(f)) == [
        ("import", "layouts.pd"), ("name", "dp_ep"), ("name", "pd"), ("string", "replicas")]


def engine_imports(path):
    """(line, module) for every import of one engine's module (railyard.engines.<name>) in the file."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if re.search(r"(^|\.)engines\.\w+", mod):
                yield node.lineno, mod
            elif re.search(r"(^|\.)engines$", mod) or (node.level and not mod):
                yield from ((node.lineno, f"{mod}.{a.name}") for a in node.names if a.name in engines.names())
        elif isinstance(node, ast.Import):
            yield from ((node.lineno, a.name) for a in node.names if re.search(r"(^|\.)engines\.\w+", a.name))


def test_the_generic_folders_import_no_engine():
    assert engines.names() == ("vllm",)
    seen = [f"railyard/{path.relative_to(PKG)}:{line}: imports {mod}"
            for path in generic_files()
            for line, mod in engine_imports(path)]
    assert not seen, "a generic module imports an engine (ask railyard.engines.of(service)):\n" + "\n".join(seen)


def test_the_check_sees_an_engine_imported_in_generic_code(tmp_path):
    """The check above is not blind: it finds each way of importing an engine, and lets the contract pass."""
    f = tmp_path / "m.py"
    f.write_text("from .. import engines\nfrom ..engines import MILESTONES\nfrom ..engines.vllm import KV_LINE\n"
                 "from ..engines import vllm\nimport railyard.engines.vllm\n")
    assert sorted(engine_imports(f)) == [(3, "engines.vllm"), (4, "engines.vllm"), (5, "railyard.engines.vllm")]


def test_only_the_cli_renders():
    """Verbs return their report and take a view for what they show while they work; only railyard/cli
    imports rich (a view, a table, a progress bar)."""
    seen = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG)
        if rel.parts[0] == "cli":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            mods = ([node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                    else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            seen += [f"railyard/{rel}:{node.lineno}: imports {m}" for m in mods if m.split(".")[0] == "rich"]
    assert not seen, "rendering outside railyard/cli:\n" + "\n".join(seen)


def _is_type_checking(node) -> bool:
    return isinstance(node, ast.If) and ((isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING") or
                                        (isinstance(node.test, ast.Attribute) and node.test.attr == "TYPE_CHECKING"))


def imports_at_any_depth(files: dict[str, "object"]) -> dict[str, set[str]]:
    """{module: the package's modules it imports}, counting what runs only when called: an import inside a
    function, and importlib.import_module("railyard...") with a literal name; not `if TYPE_CHECKING:`."""
    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        is_pkg = path.name == "__init__.py"
        tree = ast.parse(path.read_text())
        skip = {id(n) for node in ast.walk(tree) if _is_type_checking(node) for b in node.body for n in ast.walk(b)}
        deps: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base = base[:len(base) - (node.level - 1)]
                    where = ".".join(base + ([node.module] if node.module else []))
                else:
                    where = node.module or ""
                targets = [f"{where}.{a.name}" if f"{where}.{a.name}" in files else where for a in node.names]
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == \
                    "import_module" and node.args and isinstance(node.args[0], ast.Constant):
                targets = [str(node.args[0].value)]
            else:
                continue
            deps.update(x for x in targets if x in files and x != mod)
        graph[mod] = deps
    return graph


def _folder(mod: str) -> str:
    return ".".join(mod.split(".")[:2])


def test_no_import_circle_between_the_folders():
    """test_static forbids a cycle of module-level imports; an import deferred into a function (or made by
    importlib) only hides one. Counting those too, a cycle may only stay inside one folder (a module and its
    helper, the helper importing back when called); none runs between folders: the layout registry
    (railyard.plan.layout) and the inventory never reach up to the layouts that build on them."""
    files = {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}
    graph = imports_at_any_depth(files)
    across = [c for c in import_cycles(graph) if len({_folder(m) for m in c}) > 1]
    assert not across, "import circles between folders (imports at any depth): " + "; ".join(
        " -> ".join(_one_cycle(graph, c)) for c in across)
    assert not {m for m in graph["railyard.plan.layout"] if m.startswith("railyard.layouts")}
    assert not {m for m in graph["railyard.inventory.validate"] if not m.startswith(("railyard.inventory",
                                                                                    "railyard.errors"))}


def test_the_circle_check_sees_a_deferred_import(tmp_path):
    """The check above is not blind: an import inside a function, and importlib's, count."""
    pkg = tmp_path / "railyard"
    (pkg / "plan").mkdir(parents=True)
    (pkg / "layouts").mkdir()
    for f in ("__init__.py", "plan/__init__.py"):
        (pkg / f).write_text("")
    (pkg / "layouts" / "__init__.py").write_text("from . import one\n")
    (pkg / "plan" / "layout.py").write_text("import importlib\ndef f():\n    importlib.import_module('railyard.layouts')\n")
    (pkg / "layouts" / "one.py").write_text("def g():\n    from ..plan import layout\n")
    files = {".".join(p.relative_to(tmp_path).with_suffix("").parts).removesuffix(".__init__"): p
             for p in sorted(pkg.rglob("*.py"))}
    graph = imports_at_any_depth(files)
    assert graph["railyard.plan.layout"] == {"railyard.layouts"} and graph["railyard.layouts.one"] == {
        "railyard.plan.layout"}
    assert import_cycles(graph) == [["railyard.layouts", "railyard.layouts.one", "railyard.plan.layout"]]
