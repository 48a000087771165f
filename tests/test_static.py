"""Static checks on the project's own Python: ruff's pyflakes rules (undefined names, unused or
shadowed imports). An undefined name in a lab test is otherwise found only when that test runs, twenty
minutes into the lab stage."""

import subprocess
import sys

from .conftest import ROOT


def test_the_python_has_no_undefined_or_unused_names():
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
