"""`inv recover` on the two stations (multinode_tp, the group path), the lab's stand-in engine: a rank
whose engine is stopped for real (SIGSTOP, lab.fault engine-hang) takes the whole group down and back
in stage order, recorded and shown by `inv status`; an engine killed on every start for real (a watcher
SIGKILLs it, lab.fault engine-crash) stops at the restart budget with one line. What railyard decides
from what it reads (the paths, the budget's arithmetic) is tested on fake hosts in
test_unit_recover_decisions.py; the group path on the real vLLM is in test_lab_real_stations.py."""

from __future__ import annotations

import json
import shutil

import pytest

from railyard_lab import faults
from railyard_lab.checkpoint import write_checkpoint

from .conftest import home, inv_cmd, remove_containers, wait_for

pytestmark = pytest.mark.lab
NAME = "glm53-full"
RECORD = home("A") / ".cache" / "railyard" / "serve" / NAME / "recoveries.json"


@pytest.fixture(scope="module")
def stations(lab_inventory):
    for h in ("A", "B"):
        write_checkpoint(home(h) / "models" / "tiny-qwen3", 0.002, 2)
    assert inv_cmd("env", "-i", str(lab_inventory)).returncode == 0
    yield lab_inventory
    faults.heal()
    remove_containers(NAME)
    RECORD.unlink(missing_ok=True)
    for h in ("A", "B"):
        shutil.rmtree(home(h) / "models", ignore_errors=True)
        (home(h) / "glm53.env").unlink(missing_ok=True)


@pytest.fixture
def serving(stations):
    """The pair launched afresh and healthy, no recovery recorded before the test."""
    faults.heal()
    remove_containers(NAME)
    RECORD.unlink(missing_ok=True)
    r = inv_cmd("launch", "-i", str(stations), timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    yield stations
    faults.heal()


def run(inv, *args, timeout=300):
    return inv_cmd(*args, "-i", str(inv), timeout=timeout)


def test_a_hung_rank_takes_the_group_down_and_back_in_stage_order_and_status_shows_the_record(serving):
    faults.fault("B", "engine-hang")
    dry = json.loads(run(serving, "recover", "--dry-run", "--json").stdout)
    assert dry["data"]["path"] == "group" and dry["data"]["services"] == ["head", "worker-1"], dry
    assert dry["data"]["why"][0].startswith("worker-1 on B: hung: VLLM::Worker_TP1 (pid "), dry
    assert not RECORD.exists()                                          # a dry run changes nothing
    r = run(serving, "recover")
    assert r.returncode == 0 and "OK: head, worker-1 recovered" in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]
    done = [ln.strip() for ln in r.stdout.splitlines() if ln.strip().startswith("done: ")]
    assert done[:2] == ["done: stopped head", "done: killed worker-1"], done        # the head first; the hung rank killed
    assert "done: started worker-1, head in stage order: ready" in done, done      # the worker first, each gated
    assert run(serving, "health").returncode == 0
    st = json.loads(run(serving, "status", "--json").stdout)
    rec = st["data"]["recoveries"]
    assert [(x["path"], x["services"], x["ok"]) for x in rec["recent"]] == [("group", ["head", "worker-1"], True)]
    assert rec["left"] == {"head": 2, "worker-1": 2} and st["ok"], st


def test_an_engine_killed_on_every_start_stops_at_the_restart_budget_with_one_line(serving):
    budget = ("--set", "recover_restart_budget=1")
    faults.fault("B", "engine-crash")
    wait_for(lambda: json.loads(run(serving, "recover", "--dry-run", "--json").stdout)["data"]["path"] == "group",
             "recover to see B's engine gone", 30)
    r = run(serving, "recover", *budget)                       # the one restart the budget allows: it dies again
    assert r.returncode == 1 and "FAILED: B (rank 1): the container exited with code 137" in r.stdout, r.stdout[-3000:]
    r = run(serving, "recover", *budget)
    failed = [ln for ln in r.stdout.splitlines() if ln.startswith("FAILED")]
    assert r.returncode == 1 and "recover (glm53-full): restart budget spent" in r.stdout, r.stdout[-3000:]
    assert len(failed) == 1 and failed[0].startswith("FAILED: restart budget spent: head was restarted 1 times in "
                                                     "the last 30 min (budget 1; last "), r.stdout
    assert "done:" not in r.stdout                             # nothing stopped, nothing started
    doc = json.loads(run(serving, "status", "--json", *budget).stdout)
    warn = [c for c in doc["checks"] if c["check"] == "restarts"]
    assert [c["status"] for c in warn] == ["warn", "warn"] and "restart budget spent" in warn[0]["detail"], warn
    assert [x["ok"] for x in doc["data"]["recoveries"]["recent"]] == [False]
