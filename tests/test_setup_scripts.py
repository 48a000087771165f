"""The two README commands' set-up (bin/setup): refused with one line when not root, and a second
run on a set-up machine installs nothing."""

import os
import shutil
import subprocess

import pytest

from .conftest import ROOT


def test_setup_refuses_a_non_root_user_with_one_line():
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is not installed")
    r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "bash", str(ROOT / "bin" / "setup")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.startswith("error: run as root") and len(r.stderr.splitlines()) == 1


def test_a_second_setup_installs_nothing():
    if os.geteuid() != 0:
        pytest.skip("bin/setup runs as root")
    if not (ROOT / "build" / ".setup-stamp").exists():
        pytest.skip("this checkout was not set up by bin/setup (bin/test does it)")
    again = subprocess.run(["bash", str(ROOT / "bin" / "setup")], capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and again.stdout == "" and again.stderr == "", again.stdout + again.stderr


def test_the_python_the_scripts_run_imports_what_exists():
    """bin/lab-demo and bin/setup run Python inline (`python3 -c '...'`, or a `where='...'` snippet): each
    runs here without an error, so a moved or renamed module fails in the unit stage, not in the demo."""
    import re
    snippets = []
    for script in ("lab-demo", "setup"):
        text = (ROOT / "bin" / script).read_text()
        snippets += [(script, s) for s in re.findall(r"python3 -c '([^']+)'", text) + re.findall(r"where='([^']+)'", text)]
    assert any("railyard_lab" in s for _, s in snippets), snippets
    for script, snippet in snippets:
        r = subprocess.run(["python3", "-c", snippet], capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert r.returncode == 0, f"bin/{script}: {snippet}\n{r.stderr}"
