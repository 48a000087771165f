"""The suite's own guard rails: a test that hangs is cut at its time limit, a failed lab test's report
names the lab host and command it was waiting on and the last lines of the lab logs that moved while it
ran, and bin/test's stages end with their times and stop at the first that fails. Run here as a user
meets them: pytest on a small test file with this suite's conftest, and bin/test on the unit stage."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest

from . import evidence
from .conftest import ROOT

HANGS = '''
import json, os, subprocess, pytest
from tests import evidence

pytestmark = pytest.mark.lab

@pytest.mark.timeout(2)
def test_waits_on_a_host_that_never_answers():
    with open(os.environ["ENGINE_LOG"], "a") as f:       # the engine writes while the test runs
        f.write(json.dumps({"log": "INFO line 20\\n", "stream": "stdout"}) + "\\n")
    with evidence.waiting("B", "curl -sf 127.0.0.1:8000/health"):
        subprocess.run(["sleep", "30"])

def test_fails_after_its_wait():
    with evidence.waiting("A", "true"):
        pass
    assert 1 == 2, "the answer differs"
'''


def _pytest(tmp_path, lab_dir):
    (tmp_path / "test_inner.py").write_text(HANGS)
    env = {**os.environ, "RAILYARD_LAB_DIR": str(lab_dir),
           "ENGINE_LOG": str(lab_dir / "hosts" / "B" / "docker" / "containers" / "vllm-r0" / "log")}
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p", "no:cacheprovider",
                        "--rootdir", str(tmp_path), str(tmp_path / "test_inner.py")],
                       cwd=ROOT, capture_output=True, text=True, env=env, timeout=120)
    return r, time.monotonic() - t0


def test_a_hung_lab_test_is_cut_at_its_limit_naming_the_host_and_command_it_waited_on(tmp_path):
    lab_dir = tmp_path / "lab"
    log = lab_dir / "hosts" / "B" / "docker" / "containers" / "vllm-r0" / "log"
    log.parent.mkdir(parents=True)
    log.write_text("".join(json.dumps({"log": f"INFO line {i}\n", "stream": "stdout"}) + "\n" for i in range(20)))
    (lab_dir / "hosts" / "A").mkdir()
    old = time.time() - 60                                           # written before the test: not shown
    os.utime(log, (old, old))
    r, took = _pytest(tmp_path, lab_dir)
    out = r.stdout
    assert r.returncode == 1 and took < 30, (took, out[-3000:])       # cut at 2 s, not after sleep's 30
    assert "2 failed" in out
    tail = out[out.index("why the failed tests failed"):]             # the run's last lines
    first, second = tail.split("test_inner.py::test_fails_after_its_wait (call)")
    assert "test_inner.py::test_waits_on_a_host_that_never_answers (call)\n  Failed: Timeout (>2.0s)" in first
    assert "cut while waiting on lab host B: curl -sf 127.0.0.1:8000/health (2 s)" in first
    assert "B: docker logs vllm-r0 (last 8 lines)" in first and "INFO line 20" in first and "INFO line 12" not in first
    # an assertion after a wait that ended: no wait named; the assertion whole; B's log is not A's
    assert "\n  AssertionError: the answer differs\n  assert 1 == 2\n" in second
    assert "cut while" not in second and "vllm-r0" not in second


def test_the_unit_stages_workers_report_their_failures_in_the_runs_last_lines(tmp_path):
    """The unit stage runs in pytest-xdist's workers: a failure there reaches the summary all the same."""
    (tmp_path / "test_inner.py").write_text(
        "import time\ndef test_passes():\n    pass\n\n"
        "def test_slow_then_wrong():\n    time.sleep(0.5)\n    assert 'plan' == 'engine', 'the figures differ'\n")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p", "no:cacheprovider",
                        "--rootdir", str(tmp_path), "-n", "2", str(tmp_path / "test_inner.py")],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "1 failed, 1 passed" in r.stdout, r.stdout[-2000:]
    tail = r.stdout[r.stdout.index("why the failed tests failed"):]
    assert "test_inner.py::test_slow_then_wrong (call)\n  AssertionError: the figures differ\n" in tail, tail
    assert "test_passes" not in tail.split("short test summary info")[0]


def test_log_tails_take_only_logs_written_during_the_test_and_only_the_waited_on_hosts(tmp_path):
    for host, text in (("A", "sshd: error: old"), ("B", "sshd: error: Bind to port 22 failed")):
        d = tmp_path / "hosts" / host
        d.mkdir(parents=True)
        (d / "sshd.log").write_text(text + "\n")
    old = time.time() - 3600
    os.utime(tmp_path / "hosts" / "A" / "sshd.log", (old, old))
    since = time.time() - 60
    assert evidence.log_tails(tmp_path, since) == ["--- B: sshd (last 1 lines)", "    sshd: error: Bind to port 22 failed"]
    assert evidence.log_tails(tmp_path, since, "A") == []
    assert evidence.log_tails(tmp_path, 0, "A") == ["--- A: sshd (last 1 lines)", "    sshd: error: old"]


def _bin_test(*args):
    if os.geteuid() != 0:
        pytest.skip("bin/test sets up as root")
    return subprocess.run([str(ROOT / "bin" / "test"), *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_one_stage_runs_alone_and_ends_with_its_time():
    r = _bin_test("unit", "tests/test_time_limits.py", "-k", "log_tails")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    last = r.stdout.splitlines()[-1]
    assert re.fullmatch(r"bin/test: stage times: unit \d+ s", last), last
    assert "=== bin/test: stage unit (pytest -m 'not lab')" in r.stdout and "slowest 20 durations" in r.stdout


def test_a_failed_stage_stops_the_run_and_says_which_in_its_last_lines():
    r = _bin_test("unit", "tests/test_time_limits.py", "-k", "no_test_has_this_name")
    assert r.returncode == 5, r.stdout[-2000:] + r.stderr[-2000:]        # pytest's own: nothing was selected
    last = r.stdout.splitlines()[-2:]
    assert last[0].startswith("bin/test: stage unit failed (pytest exit 5); the stages after it did not run.")
    assert re.fullmatch(r"bin/test: stage times: unit \d+ s FAILED", last[1]), last
