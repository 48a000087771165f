"""A host lost in the middle of a task, and Ctrl-C during a launch, on the two-station lab: the
management link of B goes down under a running preflight (no reset: its packets just stop), and a
launch is interrupted between its stages. (A rail dropped and Ctrl-C during sync-model are in
test_lab_sync.py.)

On the vLLM stand-in: a launch cut at a chosen stage, again and again (2 s a launch, not a minute)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

import railyard_lab as lab
from railyard_lab import faults

from .conftest import ROOT, as_a_terminal_job, inv_cmd, on, station_ready, wait_for

pytestmark = pytest.mark.lab
NAME = "glm53-full"


def comms(host):
    out = []
    for pid in subprocess.run(["ip", "netns", "pids", f"{lab.NS_PREFIX}{host}"], capture_output=True, text=True).stdout.split():
        try:
            out.append(open(f"/proc/{pid}/comm").read().strip())
        except OSError:
            pass
    return out


def start(inv_path, *args):
    return subprocess.Popen([sys.executable, "-m", "invoke", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, preexec_fn=as_a_terminal_job,
                            env=dict(os.environ, RAILYARD_INVENTORY=str(inv_path)))


def test_a_host_lost_under_a_running_preflight_is_named_and_the_other_finishes(lab_inventory):
    faults.heal()
    p = start(lab_inventory, "preflight", "--json", "--set", "preflight_ping_count=15")
    try:
        wait_for(lambda: "ping" in comms("B"), "B's probe under way")  # its pings take seconds
        faults.fault("B", "mgmt-down")
        t0 = time.monotonic()
        out, err = p.communicate(timeout=150)
    finally:
        faults.heal("B")
    doc = json.loads(out)
    checks = {(c["host"], c["check"]): c for c in doc["checks"]}
    assert p.returncode == 1 and "Traceback" not in err
    lost = checks[("B", "ssh")]
    assert lost["status"] == "fail" and "stopped answering during a command" in lost["detail"], lost
    assert "management network" in lost["hint"]
    assert all(c["status"] == "skip" for (h, k), c in checks.items() if h == "B" and k != "ssh")
    assert checks[("A", "mtu")]["status"] == "pass" and checks[("A", "gpu")]["status"] == "pass"
    # named once three SSH keepalives (5 s apart) went unanswered, not after the probe's own 70 s timeout
    assert "no reply to SSH keepalives for 15 s" in lost["detail"] and time.monotonic() - t0 < 40, lost


def test_ctrl_c_between_the_stages_of_a_launch_leaves_what_runs_and_the_next_launch_completes(lab_inventory):
    with station_ready(lab_inventory) as inv_path:
        p = start(inv_path, "launch")
        wait_for(lambda: on("B", f"docker inspect --format '{{{{.State.Running}}}}' {NAME}").stdout.strip() == "true",
                 "the worker (stage 1) running", timeout=120)
        os.killpg(p.pid, signal.SIGINT)
        t0 = time.monotonic()
        _, err = p.communicate(timeout=30)
        assert p.returncode == 130 and time.monotonic() - t0 < 5 and "interrupted" in err and "Traceback" not in err
        status = inv_cmd("status", "--json", env={"RAILYARD_INVENTORY": str(inv_path)})
        rows = {r["host"]: r for r in json.loads(status.stdout)["data"]["ranks"]}
        assert rows["B"]["state"] == "running", rows  # what had started is there, and said so
        again = inv_cmd("launch", env={"RAILYARD_INVENTORY": str(inv_path)}, timeout=300)
        assert again.returncode == 0, again.stdout[-3000:] + again.stderr
        assert "kept, already running with this configuration: B" in " ".join(again.stdout.split())
        assert inv_cmd("health", env={"RAILYARD_INVENTORY": str(inv_path)}, timeout=120).returncode == 0
