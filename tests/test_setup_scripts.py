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
