"""The task layer: each task declared once (railyard.cli.rtask, beside its view), the shared flags' help
once, tasks.py only the namespace, the lab's tasks only where the lab is installed."""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys

from railyard import cli
from railyard.cli import RTask

from .conftest import ROOT

BLOCK_LAB = """
import sys
class NoLab:
    def find_spec(self, name, path=None, target=None):
        if name == "railyard_lab" or name.startswith("railyard_lab."):
            raise ImportError(f"blocked: {name}")
sys.meta_path.insert(0, NoLab())
from invoke.main import program
sys.argv = ["invoke", "--list"]
program.run()
"""


def namespace():
    spec = importlib.util.spec_from_file_location("railyard_tasks_under_test", ROOT / "tasks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ns


def every_task(ns, prefix=""):
    for name, t in ns.tasks.items():
        yield prefix + name, t
    for name, sub in ns.collections.items():
        yield from every_task(sub, f"{prefix}{name}.")


def test_every_task_is_declared_once_with_the_shared_flags_help():
    tasks = dict(every_task(namespace()))
    assert {"preflight", "sync-model", "launch", "bench", "plan", "health", "recover", "trust-hosts"} <= set(tasks)
    for name, t in tasks.items():
        assert isinstance(t, RTask), name
        module = t.body.__module__
        assert module.startswith("railyard.cli.") or module == "railyard_lab.tasks", (name, module)
        args = {a.name: a for a in t.get_arguments()}
        if name.startswith("lab.") or name == "discover":  # discover writes the inventory the others read
            continue
        assert args["inventory"].help == cli.INVENTORY, name
        assert args["set_"].help == cli.SET and args["set_"].kind is list, name
        if "json" in args:
            assert args["json"].help.startswith(cli.JSON), name
    # a second parse (invoke pops each help text as it uses it) still has them
    assert {a.name: a.help for a in tasks["status"].get_arguments()}["inventory"] == cli.INVENTORY


def test_tasks_py_is_composition_only_and_the_product_names_no_lab_module():
    tree = ast.parse((ROOT / "tasks.py").read_text())
    assert not [n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.Lambda))]
    for path in (ROOT / "railyard" / "cli").rglob("*.py"):
        assert "railyard_lab" not in path.read_text(), path


def test_without_the_lab_no_lab_task_is_listed():
    r = subprocess.run([sys.executable, "-c", BLOCK_LAB], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "preflight" in r.stdout and "lab." not in r.stdout and r.stderr == ""
    if importlib.util.find_spec("railyard_lab") is not None:  # and with it, they are
        r = subprocess.run([sys.executable, "-m", "invoke", "--list"], cwd=ROOT, capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0 and "lab.fault" in r.stdout and "lab.up" in r.stdout, r.stderr


def test_a_bad_number_is_one_line_and_exit_2_whichever_flag():
    for args, line in ((["logs", "--lines", "x"], "error: --lines 'x': not a number"),
                       (["bench", "--warmup", "abc"], "error: --warmup 'abc': not a number"),  # invoke casts it
                       (["recover", "--drain-timeout", "soon"], "error: --drain-timeout 'soon': not a number")):
        r = subprocess.run([sys.executable, "-m", "invoke", *args, "-i", "inventory/dgx-stations.yml"], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
        assert (r.returncode, r.stdout, r.stderr) == (2, "", line + "\n"), args


def test_a_task_called_directly_takes_its_flags_without_a_context(capsys):
    from invoke import Context

    from railyard.cli import serve
    for call in (lambda: serve.launch_script(None, None), lambda: serve.launch_script(Context(), None, None)):
        try:
            call()
        except Exception as e:  # invoke's Exit
            assert getattr(e, "code", None) == 2
        assert capsys.readouterr().err == "error: --out DIR: where to write launch_server.sh\n"
