"""The lab's docker as real docker is: a container's processes die with its first process.

Real docker runs a container in its own PID namespace; when the first process exits, the kernel SIGKILLs
every other process of that namespace, and docker records the exit once they are gone. The lab's shim is
its processes' subreaper and kills what is left the same way (issue 43: an orphaned vLLM API server kept
answering after its container had exited).
"""

import os
import shlex
import signal
import time

import pytest
import railyard_lab as lab

from .conftest import on, wait_for

pytestmark = pytest.mark.lab

# a first process (bash) that starts a child in a session of its own (out of the container's process group,
# as a daemon does) and a grandchild under another such child, then waits; their pids where the test reads them
TREE = ("setsid sleep 600 & echo $! > /tmp/child; "
        "setsid sh -c 'sleep 600 & echo $! > /tmp/grand; wait' & wait")


def _pid(name: str, what: str) -> int:
    out = on("A", f"docker exec {name} cat /tmp/{what}").stdout.strip()
    return int(out) if out.isdigit() else 0


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


def _main_pid(name: str) -> int:
    return int(on("A", f"docker inspect --format '{{{{.State.Pid}}}}' {name}").stdout.strip() or 0)


@pytest.mark.parametrize("how", ["main-killed", "docker-kill", "docker-stop"])
def test_a_container_takes_its_processes_with_its_first(healthy_lab, how):
    name = f"teardown-{how}"
    img = lab.LAB_IMAGE_NAME
    try:
        run = on("A", f"docker run -d --name {name} --entrypoint bash {img} -c {shlex.quote(TREE)}")
        assert run.returncode == 0, run.stderr
        wait_for(lambda: _pid(name, "child") and _pid(name, "grand"), "the container's children", timeout=20)
        child, grand = _pid(name, "child"), _pid(name, "grand")
        main = _main_pid(name)
        assert _alive(child) and _alive(grand) and _alive(main)
        if how == "main-killed":     # the first process dies of itself (OOM, a crash): SIGKILL from outside
            os.kill(main, signal.SIGKILL)
        elif how == "docker-kill":
            assert on("A", f"docker kill {name}").returncode == 0
        else:                        # sh ignores nothing: SIGTERM ends it, the rest goes with it
            assert on("A", f"docker stop -t 5 {name}").returncode == 0
        wait_for(lambda: on("A", f"docker inspect --format '{{{{.State.Status}}}}' {name}").stdout.strip() == "exited",
                 "the container's exit", timeout=20)
        # by the time docker says exited, every process of the container is gone
        assert not _alive(child) and not _alive(grand) and not _alive(main)
        code = on("A", f"docker inspect --format '{{{{.State.ExitCode}}}} {{{{.State.Running}}}}' {name}").stdout.split()
        assert code == (["143", "false"] if how == "docker-stop" else ["137", "false"]), code
    finally:
        on("A", f"docker rm -f {name}")


def test_a_container_restarts_clean(healthy_lab):
    """`docker start` after the teardown: a new first process and children of its own; the old ones are gone."""
    name = "teardown-restart"
    try:
        assert on("A", f"docker run -d --name {name} --entrypoint bash {lab.LAB_IMAGE_NAME} -c "
                       f"'sleep 600 & echo $! > /tmp/child; wait'").returncode == 0
        wait_for(lambda: _pid(name, "child"), "the child", timeout=20)
        old = _pid(name, "child")
        assert on("A", f"docker kill {name}").returncode == 0
        assert not _alive(old)
        assert on("A", f"docker start {name}").returncode == 0
        wait_for(lambda: _pid(name, "child") not in (0, old), "the new child", timeout=20)
        assert _alive(_pid(name, "child"))
        time.sleep(0.5)
        assert on("A", f"docker inspect --format '{{{{.State.Running}}}}' {name}").stdout.strip() == "true"
    finally:
        on("A", f"docker rm -f {name}")
