"""verify-rdma and health against launched lab containers.

On the vLLM stand-in: verify-rdma judges NCCL logs, which only the GPU layer writes (the CPU engine
talks gloo), with a fault each."""

import json
import subprocess
import time

import pytest

from railyard.lab import faults

from .conftest import inv_cmd, on, station_ready

pytestmark = pytest.mark.lab
NAME = "glm53-full"


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
    import os
    import sys
    from .conftest import ROOT
    watch = subprocess.Popen([sys.executable, "-m", "invoke", "health", "--watch", "1"], cwd=ROOT, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             env=dict(os.environ, RAILYARD_INVENTORY=str(served)))
    time.sleep(6)
    watch.terminate()
    out, _ = watch.communicate(timeout=30)
    assert out.count("OK: healthy") >= 2  # it kept going: a live view


def test_health_names_the_rank_whose_container_died(served):
    assert run("launch", inv=served).returncode == 0
    pid = on("B", f"docker inspect --format '{{{{.State.Pid}}}}' {NAME}").stdout.strip()
    subprocess.run(["kill", "-9", pid], check=True)
    time.sleep(2)
    h = run("health", "--json", inv=served)
    doc = json.loads(h.stdout)
    assert h.returncode == 1 and not doc["ok"]
    b = next(r for r in doc["data"]["ranks"] if r["host"] == "B")
    assert not b["ok"] and "container glm53-full is exited" in b["reasons"][0]
    v = run("verify-rdma", inv=served)
    assert v.returncode == 1 and "container glm53-full is exited on B" in v.stdout
