"""Shared fixtures. Lab tests need root, `ip netns` and sshd; CI sets RAILYARD_REQUIRE_LAB=1
so that a missing prerequisite fails the run instead of skipping the lab tests.

Every test has a time limit (pytest-timeout): UNIT_LIMIT_S, LAB_LIMIT_S for the `lab` marker, or the
test's own `pytest.mark.timeout` (each real-engine module sets one that holds its bring-up). A failed lab
test's report names the lab host and command it was waiting on and the last lines of the lab logs
that moved while it ran (tests/evidence.py); the run's end repeats them beside the failed tests."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import railyard.layouts  # noqa: F401  (every layout registers: the registry never imports them itself)

from . import evidence

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures"
REAL = FIXTURES / "real"


def real(rel: str) -> str:
    return (REAL / rel).read_text()


UNIT_LIMIT_S = 60       # the slowest unit test takes 12 s on this 2-core machine
LAB_LIMIT_S = 300       # a lab test with a stand-in launch or a fault
REAL_LIMIT_S = 720      # a test of a real-engine module, the first with the module's bring-up
KEEP_LAB_ENV = "RAILYARD_TEST_KEEP_LAB"
_STARTED = pytest.StashKey[float]()
_FAILURES: list[tuple[str, list[str], list[str]]] = []   # (test and phase, assertion, lab lines)


def pytest_configure(config):
    # pytest-xdist's workers (the unit stage) get COLUMNS=80; railyard's output is read here as a pipe
    # without COLUMNS gets it (160 wide), as in a run without workers
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:
        os.environ.pop("COLUMNS", None)
        # each worker of the lab and real stages has a lab of its own (railyard_lab.INSTANCES: three at most); the
        # variable is set before any test module imports railyard_lab, and every `inv` a test runs inherits it
        os.environ["RAILYARD_LAB_INSTANCE"] = worker.removeprefix("gw")


def pytest_collection_modifyitems(config, items):
    if config.getoption("timeout", None) is not None:     # `--timeout S` on the command line: S for every test
        return
    for item in items:
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(LAB_LIMIT_S if item.get_closest_marker("lab") else UNIT_LIMIT_S))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    evidence.reset()
    item.stash[_STARTED] = time.time()
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed and item.get_closest_marker("lab"):
        import railyard_lab as lab
        wait = evidence.cut_wait()
        root = lab.lab_dir()
        tails = evidence.log_tails(root, item.stash.get(_STARTED, 0.0), evidence.cut_host()) if root.exists() else []
        lines = ([f"cut while {wait}"] if wait else []) + (tails or ["(no lab log written during the test)"])
        report.sections.append((f"lab ({report.when})", "\n".join(lines)))
    return report


def pytest_runtest_logreport(report):
    """Each failed report, as the process that prints the summary receives it (the unit stage runs in
    pytest-xdist's workers, whose reports reach the controller serialised: longrepr and sections only)."""
    if not report.failed:
        return
    crash = getattr(report.longrepr, "reprcrash", None)
    why = crash.message.splitlines()[:3] if crash else str(report.longrepr).splitlines()[-3:]
    lines = next((text.splitlines() for name, text in report.sections if name.startswith("lab (")), [])
    _FAILURES.append((f"{report.nodeid} ({report.when})", why, lines))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """At the run's end, before pytest's one-line summary: each failed test, its assertion whole, and for a
    lab test the wait it was cut in and the two newest lab logs."""
    if not _FAILURES:
        return
    terminalreporter.section("why the failed tests failed")
    for name, why, lines in _FAILURES:
        terminalreporter.write_line(name)
        for ln in why + lines[:1 + 2 * (evidence.TAIL_LINES + 1)]:
            terminalreporter.write_line("  " + ln[:300])


def _lab_possible() -> str | None:
    if os.geteuid() != 0:
        return "needs root"
    for tool in ("ip", "unshare", "nsenter", "ssh-keygen", "ping", "ethtool"):
        if shutil.which(tool) is None:
            return f"needs {tool}"
    if not Path("/usr/sbin/sshd").exists():
        return "needs sshd (openssh-server)"
    return None


def _need_lab() -> None:
    why = _lab_possible()
    if why:
        if os.environ.get("RAILYARD_REQUIRE_LAB"):
            pytest.fail(f"lab required but unavailable: {why}")
        pytest.skip(f"lab unavailable: {why}")


@pytest.fixture(scope="session")
def lab_inventory() -> Path:
    """A healthy two-host lab (A head, B worker) serving with the stand-in engine; every test leaves it
    healed. The stand-in is for the tests of railyard's own decisions that launch again and again (a
    fault each): it is up in about 2 s where the real engine takes about a minute. Modules that prove
    railyard against the real vLLM take `real_lab` instead."""
    _need_lab()
    import railyard_lab as lab
    from railyard_lab import faults
    path = lab.up(2, log=lambda *_: None, engine="stand-in")
    faults.heal()
    yield path
    faults.heal()


@pytest.fixture(scope="module")
def hgx8_inventory(lab_inventory) -> Path:
    """The lab as two hgx8 hosts (8 x H200 each, the stand-in engine) for one module; the station lab
    is back afterwards (lab.up rebuilds the hosts for another shape in about a second; same path)."""
    import railyard_lab as lab
    from railyard_lab import faults
    faults.heal()
    path = lab.up(2, log=lambda *_: None, shape="hgx8", engine="stand-in")
    yield path
    faults.heal()
    lab.up(2, log=lambda *_: None, engine="stand-in")  # the shape every other lab test expects
    faults.heal()


@pytest.fixture(scope="module")
def wide_lab(lab_inventory) -> Path:
    """The lab as 24 station hosts (the stand-in engine) for one module; the 2-host lab is back afterwards."""
    import railyard_lab as lab
    from railyard_lab import faults
    faults.heal()
    path = lab.up(24, log=lambda *_: None, engine="stand-in")
    yield path
    faults.heal()
    lab.up(2, log=lambda *_: None, engine="stand-in")  # the shape every other lab test expects
    faults.heal()


@contextlib.contextmanager
def real_lab(layout: str):
    """The lab as `inv lab.up --layout LAYOUT` makes it, serving with the real vLLM (its CPU build), the
    lab checkpoint on every host; afterwards every container removed and the stand-in station lab back.
    With RAILYARD_TEST_KEEP_LAB=1 (the inner loop: one module again and again) a lab already serving this
    layout on the real engine is taken as it is, the module's launch finds it running, and it is left up."""
    _need_lab()
    import railyard_lab as lab
    from railyard_lab import faults
    from railyard_lab.checkpoint import write_checkpoint
    keep = os.environ.get(KEEP_LAB_ENV) == "1"
    root = lab.lab_dir()
    reuse = keep and lab.lab_engine(root) == "vllm" and lab.lab_layout(root) == layout
    path = lab.up(log=lambda *_: None, engine="vllm", layout=layout)
    faults.heal()
    for h in [] if reuse else lab.hosts_of(root):   # a bring-up of its own: nothing an earlier one left
        on(h.name, "docker ps -a --format '{{.Names}}' | xargs -r docker rm -f >/dev/null 2>&1; true")
        write_checkpoint(home(h.name) / lab.lab_model_path(layout).removeprefix("~/"), 0.002, 2,
                         kind=lab.model_kind(layout))
    try:
        yield path
    finally:
        faults.heal()
        if not keep:
            for h in lab.hosts_of(root):
                on(h.name, "docker ps -a --format '{{.Names}}' | xargs -r docker rm -f >/dev/null 2>&1; "
                           "rm -rf ~/models; true")
            lab.up(2, log=lambda *_: None, engine="stand-in")
            faults.heal()


@pytest.fixture
def healthy_lab(lab_inventory):
    """The lab, healed again after the test whatever it did."""
    from railyard_lab import faults
    yield lab_inventory
    faults.heal()


def on(host: str, *argv: str) -> subprocess.CompletedProcess:
    """Run a command on a lab host over SSH; several words are quoted, one word is a shell line."""
    import shlex
    import railyard_lab as lab
    root = lab.lab_dir()
    line = argv[0] if len(argv) == 1 else shlex.join(argv)
    with evidence.waiting(host, line):
        return subprocess.run(lab.ssh_argv(root, lab.lab_host(root, host), [line]), capture_output=True,
                              text=True, timeout=60)


# a shell loop over the processes of the lab host it runs on: the hosts share this machine's PID space, so
# only the processes in the host's own network namespace are its own; $d is /proc/PID, $c its command line
HOST_PROCESSES = ("for d in /proc/[0-9]*; do [ $d/ns/net -ef /proc/self/ns/net ] || continue; "
                  "c=$(tr '\\0' ' ' < $d/cmdline 2>/dev/null); ")


def processes_of(host: str, needle: str) -> list[str]:
    """The command lines on a lab host that contain needle."""
    import shlex
    script = HOST_PROCESSES + "case \"$c\" in *" + shlex.quote(needle) + "*) echo \"$c\";; esac; done"
    return [ln for ln in on(host, script).stdout.splitlines() if HOST_PROCESSES not in ln]  # not itself


def remove_containers(*names: str, hosts=("A", "B")) -> None:
    """Remove these containers (if any) from the lab hosts."""
    for h in hosts:
        on(h, "docker rm -f " + " ".join(names) + " >/dev/null 2>&1; true")


def home(host: str) -> Path:
    """A lab host's home directory (its /root), seen from this machine."""
    import railyard_lab as lab
    return lab.lab_dir() / "hosts" / host / "home"


def as_a_terminal_job() -> None:
    """preexec_fn of a task a test interrupts: SIGINT with its default disposition, as a terminal's
    foreground job has it, even when the suite itself runs as a background job (a shell's `cmd &`
    ignores SIGINT in it, and an ignored signal stays ignored across exec)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def inv_cmd(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run `inv ARGS` from the repository root, the way a user does."""
    full_env = dict(os.environ)
    full_env.pop("RAILYARD_INVENTORY", None)
    full_env.update(env or {})
    with evidence.waiting("-", "inv " + " ".join(args)):
        return subprocess.run([sys.executable, "-m", "invoke", *args], cwd=ROOT, capture_output=True, text=True,
                              env=full_env, timeout=timeout)


def pd_inventory(lab_path, out, wide=False):
    """The 3-host hgx8 lab inventory as pools: prefill A and B (2 instances each), decode C; wide:
    prefill A, and one DP16 decode instance over B (its head) and C (headless)."""
    import yaml
    data = yaml.safe_load(open(lab_path).read())
    hosts = data["all"]["children"]["lab"]["hosts"]
    data["all"]["vars"]["serve_layout"] = "pd"
    data["all"]["children"] = {
        "prefill": {"vars": {"pd_instances_per_host": 2}, "hosts": {h: hosts[h] for h in ("A", "B")}},
        "decode": {"hosts": {"C": hosts["C"]}},
    }
    if wide:
        data["all"]["children"] = {
            "prefill": {"vars": {"pd_instances_per_host": 2}, "hosts": {"A": hosts["A"]}},
            "decode": {"vars": {"pd_hosts_per_instance": 2, "vllm_data_parallel_size": 16},
                       "hosts": {h: hosts[h] for h in ("B", "C")}},
        }
    out.write_text(yaml.safe_dump(data, sort_keys=False))
    return out


def wait_for(check, what, timeout=60.0):
    """check()'s first true result, polled every 0.3 s; fails naming what it waited for."""
    deadline = time.monotonic() + timeout
    with evidence.waiting("-", what):
        while time.monotonic() < deadline:
            got = check()
            if got:
                return got
            time.sleep(0.3)
        raise AssertionError(f"timed out waiting for {what}")


@contextlib.contextmanager
def station_ready(inv_path):
    """The station lab with the checkpoint on both hosts and the env files written, no container of
    the two-station layout; afterwards healed, the containers and checkpoints gone."""
    from railyard_lab import faults
    from railyard_lab.checkpoint import write_checkpoint
    faults.heal()
    remove_containers("glm53-full")
    for h in ("A", "B"):
        write_checkpoint(home(h) / "models" / "tiny-qwen3", 0.002, 2)
    r = inv_cmd("env", env={"RAILYARD_INVENTORY": str(inv_path)}, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    try:
        yield inv_path
    finally:
        faults.heal()
        remove_containers("glm53-full")
        for h in ("A", "B"):
            shutil.rmtree(home(h) / "models", ignore_errors=True)
