"""The `railyard` console command is `inv` over the same namespace: every task `inv --list` lists in the checkout,
with `--version`; and it works installed from the wheel alone, in a fresh virtualenv, from an empty folder, as a
user who is not root."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from .conftest import ROOT


def names(listing: str) -> list[str]:
    """The task names of a `--list` (help continues on lines indented deeper)."""
    return re.findall(r"^  (\S+)", listing, re.M)


def inv_list() -> list[str]:
    r = subprocess.run([sys.executable, "-m", "invoke", "--list"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    return names(r.stdout)


def test_railyard_lists_every_task_inv_lists_in_the_checkout():
    r = subprocess.run([sys.executable, "-m", "railyard", "--list"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("Subcommands:")
    got, want = names(r.stdout), inv_list()
    assert got == want and {"discover", "preflight", "launch", "health"} <= set(got)


def test_a_task_behaves_as_under_inv_help_and_exit_code():
    for argv in (["--help", "discover"], ["discover", "--set", "nope=1"], ["status", "--inventory", "/nonexistent"]):
        a = subprocess.run([sys.executable, "-m", "railyard", *argv], cwd=ROOT, capture_output=True, text=True,
                           timeout=120)
        b = subprocess.run([sys.executable, "-m", "invoke", *argv], cwd=ROOT, capture_output=True, text=True,
                           timeout=120)
        assert a.returncode == b.returncode, argv
        assert a.stderr == b.stderr, argv
        assert a.stdout.replace("railyard", "inv[oke]") == b.stdout, argv
    assert b.returncode == 2


def _as_nobody(argv: list[str], cwd: str, env: dict) -> subprocess.CompletedProcess:
    """argv as uid/gid 65534 (nobody). This machine's interpreter and the dependencies installed with it may live
    under /root (0700, pyenv): then the user is given CAP_DAC_READ_SEARCH alone, to read them (it still writes
    nowhere it could not)."""
    base = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    probe = subprocess.run(base + [sys.executable, "-c", "import invoke"], cwd=cwd, env=env, capture_output=True,
                           timeout=60)
    if probe.returncode != 0:
        base += ["--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search"]
    return subprocess.run(base + argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_the_wheel_alone_gives_railyard_from_an_empty_folder_as_a_user(tmp_path):
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv (util-linux) to run as another user")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "-q", "-w", str(tmp_path / "dist")],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    (wheel,) = (tmp_path / "dist").glob("railyard-*.whl")
    top = Path(tempfile.mkdtemp(prefix="railyard-console-"))  # not under pytest's 0700 tmp_path: nobody reads it
    try:
        top.chmod(0o755)
        venv, empty = top / "venv", top / "empty"
        # the dependencies installed here are reused; nothing is downloaded
        r = subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        r = subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q",
                            "--no-deps", "--no-index", str(wheel)], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        empty.mkdir()
        os.chown(empty, 65534, 65534)
        env = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": str(empty), "LANG": "C.UTF-8"}
        where = _as_nobody([str(venv / "bin" / "python"), "-c", "import os, railyard; print(os.getuid(), "
                            "railyard.__file__)"], str(empty), env)
        assert where.returncode == 0, where.stderr
        uid, path = where.stdout.split()
        assert uid == "65534" and path.startswith(str(venv)), where.stdout   # the wheel's, not the checkout's
        listed = _as_nobody(["railyard", "--list"], str(empty), env)
        assert listed.returncode == 0, listed.stderr
        assert names(listed.stdout) == inv_list()
        version = _as_nobody(["railyard", "--version"], str(empty), env)
        assert version.returncode == 0 and version.stdout == "railyard 0.1.0\n", version.stdout + version.stderr
        done = _as_nobody(["railyard", "--print-completion-script", "bash"], str(empty), env)
        assert done.returncode == 0 and "complete -F" in done.stdout and "railyard" in done.stdout
        assert sorted(p.name for p in empty.iterdir()) == []   # it wrote nothing where it ran
    finally:
        shutil.rmtree(top, ignore_errors=True)
