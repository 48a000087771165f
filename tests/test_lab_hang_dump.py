"""`inv hang-dump` on the two stations (multinode_tp) with the lab's stand-in engine, read from the hosts for
real (the containers' processes, py-spy or gdb on them, the engine logs, NCCL RAS's port): a healthy pair
says nothing is hung, exits 0, still shows every rank's stack and prints one JSON document; a rank stopped
with SIGSTOP (lab.fault engine-hang) and a rank parked while it keeps running (engine-stall) exit 1 with the
stack each one really gave, never one made up. The readers are tested on real captures in test_hang_dump.py."""

from __future__ import annotations

import json
import shutil

import pytest

from railyard_lab import faults
from railyard_lab.checkpoint import write_checkpoint

from .conftest import home, inv_cmd, remove_containers

pytestmark = pytest.mark.lab
NAME = "glm53-full"
DUMPS = home("A") / ".cache" / "railyard" / "serve" / NAME / "hang-dumps"


@pytest.fixture(scope="module")
def serving(lab_inventory):
    for h in ("A", "B"):
        write_checkpoint(home(h) / "models" / "tiny-qwen3", 0.002, 2)
    assert inv_cmd("env", "-i", str(lab_inventory)).returncode == 0
    faults.heal()
    remove_containers(NAME)
    r = inv_cmd("launch", "-i", str(lab_inventory), timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    yield lab_inventory
    faults.heal()
    remove_containers(NAME)
    shutil.rmtree(DUMPS, ignore_errors=True)
    for h in ("A", "B"):
        shutil.rmtree(home(h) / "models", ignore_errors=True)
        (home(h) / "glm53.env").unlink(missing_ok=True)


def dump(inv) -> tuple[int, dict]:
    r = inv_cmd("hang-dump", "--json", "-i", str(inv), timeout=280)
    return r.returncode, json.loads(r.stdout)          # exactly one document, whatever the outcome


def processes(doc: dict, host: str) -> list[dict]:
    return [p for sd in doc["data"]["hosts"][host]["services"] for p in sd["processes"]]


def test_a_healthy_pair_is_not_hung_exits_0_and_still_shows_each_ranks_stack(serving):
    rc, doc = dump(serving)
    assert rc == 0 and doc["ok"] and not doc["data"]["hung"], doc["data"]["verdict"]
    workers = {h: [p for p in processes(doc, h) if p["kind"] == "worker"] for h in ("A", "B")}
    notes = {h: [sd["notes"] for sd in doc["data"]["hosts"][h]["services"]] for h in ("A", "B")}
    assert [p["title"][:15] for p in workers["A"] + workers["B"]] == ["VLLM::Worker_TP"] * 2, (workers, notes)
    for p in workers["A"] + workers["B"]:
        assert p["stack"] and p["frame"] or p["failures"], p              # a stack, or why there is none
    assert doc["data"]["summary"]["line"]
    assert all(sd["log_tail"] for h in ("A", "B") for sd in doc["data"]["hosts"][h]["services"])
    assert doc["data"]["kept"].startswith("A:") and len(list(DUMPS.glob("*.json"))) >= 1
    status = inv_cmd("status", "-i", str(serving), timeout=120)
    assert "latest hang dump: A:" in status.stdout, status.stdout[-2000:]


def test_a_stopped_rank_exits_1_and_its_stack_is_the_one_it_really_gave(serving):
    faults.fault("B", "engine-hang")
    try:
        rc, doc = dump(serving)
    finally:
        faults.heal()
    assert rc == 1 and doc["data"]["hung"], doc["data"]["verdict"]
    assert doc["data"]["verdict"].startswith("HUNG: ") and "B/worker-1" in doc["data"]["verdict"]
    [worker] = [p for p in processes(doc, "B") if p["kind"] == "worker"]
    assert worker["state"].startswith("T"), worker
    if worker["stack"]:   # py-spy cannot pause a stopped process: --nonblocking or gdb read it, said so
        assert worker["tool"] in ("py-spy --nonblocking", "gdb"), worker
        assert any("Failed to" in f for f in worker["failures"]), worker
    else:
        assert worker["failures"] and worker["pid"] and str(worker["pid"]) in doc["data"]["summary"]["line"]


def test_a_rank_parked_while_it_runs_is_the_odd_one_out(serving):
    faults.fault("B", "engine-stall")
    try:
        rc, doc = dump(serving)
    finally:
        faults.heal()
    [worker] = [p for p in processes(doc, "B") if p["kind"] == "worker"]
    assert not worker["state"].startswith("T") and worker["stack"], worker    # running: py-spy pauses and reads it
    assert "lab_fault_engine_stall" in worker["frame"], worker
    odd = doc["data"]["summary"]["outliers"]
    assert odd and odd[0]["members"] == [f"B/worker-1 pid {worker['pid']} {worker['title']}"], doc["data"]["summary"]
    assert rc == 1 and doc["data"]["hung"], doc["data"]["verdicts"]   # the shared verdict: the group waits
