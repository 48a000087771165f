"""verify-rdma and health against launched lab containers.

On the vLLM stand-in: verify-rdma judges NCCL logs, which only the GPU layer writes (the CPU engine
talks gloo). A rank whose container died is judged on a fake session (test_unit_health_decisions.py)
and on the lab by the runbook's section "NCCL timeouts after start (a rank died)"."""

import json
import os
import re
import subprocess
import sys
import threading
import time

import pytest

from railyard_lab import faults

from .conftest import ROOT, inv_cmd, station_ready, wait_for

pytestmark = pytest.mark.lab
NAME = "glm53-full"
HUNG_AFTER = ("--set", "vllm_hung_after_s=8")  # the probe's wait before the counters are read again


def run(*args, inv):
    return inv_cmd(*args, env={"RAILYARD_INVENTORY": str(inv)}, timeout=180)


@pytest.fixture
def served(lab_inventory):
    with station_ready(lab_inventory) as inv:
        yield inv


def test_a_correct_launch_verifies_and_is_healthy(served):
    assert run("launch", inv=served).returncode == 0
    r = run("verify-rdma", "--json", inv=served)
    doc = json.loads(r.stdout)
    assert r.returncode == 0 and doc["ok"] and len(doc["data"]["ranks"]) == 2
    assert all(x["net_transport"] == "IB" and x["gdrdma"] and x["hcas"] == ["mlx5_1"] for x in doc["data"]["ranks"])
    h = run("health", "--json", inv=served)
    hd = json.loads(h.stdout)
    assert h.returncode == 0 and hd["ok"]
    assert [p["name"] for p in hd["data"]["probes"]] == ["/health", "/v1/models", "chat completion", "/metrics"]
    assert all(p["ok"] and p["ms"] is not None for p in hd["data"]["probes"])
    assert "finish_reason stop" in hd["data"]["probes"][2]["detail"]
    assert [r_["serving_process"] for r_ in hd["data"]["ranks"]] == ["VLLM::Worker_TP0", "VLLM::Worker_TP1"]
    assert hd["data"]["metrics"]["spec_acceptance"] == pytest.approx(0.75)
    table = run("health", inv=served)
    assert "prefix-cache hit rate" in table.stdout and "OK: healthy" in table.stdout
    watch = subprocess.Popen([sys.executable, "-m", "invoke", "health", "--watch", "1", *HUNG_AFTER], cwd=ROOT, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             env=dict(os.environ, RAILYARD_INVENTORY=str(served)))
    time.sleep(6)
    assert watch.poll() is None               # it keeps looking
    watch.terminate()
    out, _ = watch.communicate(timeout=30)
    assert out.count("OK: healthy") == 1      # the first look in full, then only changes: none here


def test_a_stopped_engine_is_hung_while_its_health_answers_and_heal_brings_it_back(served):
    """`lab.fault HOST engine-hang` stops the engine processes (SIGSTOP): on B the worker of rank 1, named
    hung from its process state; on A the head's engine core and worker, whose API still answers /health
    while the probe gets no token and the token counters stand still (the stand-in's engine, as vLLM's,
    reads no request while stopped)."""
    assert run("launch", inv=served).returncode == 0
    watch = subprocess.Popen([sys.executable, "-m", "invoke", "health", "--watch", "1", *HUNG_AFTER], cwd=ROOT, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                             env=dict(os.environ, RAILYARD_INVENTORY=str(served)))
    lines: list[str] = []

    def read():
        for ln in watch.stdout:
            lines.append(ln)
    threading.Thread(target=read, daemon=True).start()
    try:
        wait_for(lambda: any("OK: healthy" in ln for ln in lines), "the watch's first look")
        assert run("lab.fault", "B", "engine-hang", inv=served).returncode == 0
        doc = json.loads(run("health", "--json", *HUNG_AFTER, inv=served).stdout)
        b = next(r for r in doc["data"]["ranks"] if r["host"] == "B")
        assert not doc["ok"] and not b["ok"], b
        assert b["reasons"][0].startswith("hung: VLLM::Worker_TP1 (pid ") and "is stopped (state T in /proc/" in b["reasons"][0]
        # the watch prints the change alone, stamped: B's service from pass to fail, and back after the heal
        wait_for(lambda: any(" B service: pass -> fail: " in ln and ": hung: VLLM::Worker_TP1" in ln for ln in lines),
                 "the watch's line for B")
        faults.heal()
        wait_for(lambda: any(" B service: fail -> pass: " in ln for ln in lines), "the watch's line back")
        watch.terminate()
        assert sum("OK: healthy" in ln for ln in lines) == 1, lines
        assert run("lab.fault", "A", "engine-hang", "--value", NAME, inv=served).returncode == 0
        t0 = time.monotonic()
        h = run("health", "--json", *HUNG_AFTER, inv=served)
        took = time.monotonic() - t0
        doc = json.loads(h.stdout)
        head = next(v for v in doc["data"]["metrics"]["hung"] if v["host"] == "A")
        # the shared verdict reads the stopped processes of the head's container, whatever its /health answers,
        # and health waits for no probe once it is in (a running rank that stands still: test_lab_stall.py)
        assert h.returncode == 1 and head["state"] == "hung" and head["source"] == "stopped", head
        assert re.fullmatch(r"stopped: VLLM::EngineCor\w* \(pid \d+, state T\w*\), VLLM::Worker_TP\w* \(pid \d+, "
                            r"state T\w*\)", head["evidence"][0]), head   # the stand-in names itself in comm only
        assert took < 18, took
    finally:
        watch.kill()
        faults.heal()
    assert run("health", inv=served).returncode == 0  # continued: the queued probe and the new one answer
