"""The one-host layouts served by the real vLLM (its CPU build) on an hgx8 lab host: single_node_tp
with TP=2 over two of its eight GPUs (each GPU is an engine worker process on this machine's two
cores), one real bring-up shared by the module, and its launch_server.sh run by hand on the GPUs a stop
freed. dp_ep on the real engine: test_lab_real_dp_ep.py; AIPerf against it: test_lab_real_stations.py."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time

import pytest

from railyard_lab import components, lab_dir, lab_host, ssh_argv

from .conftest import REAL_LIMIT_S, home, inv_cmd, on, processes_of, real_lab

# bin/test's real stage; the module's bring-up counts in its first test's limit (launch's own: 420 s)
pytestmark = [pytest.mark.lab, pytest.mark.real, pytest.mark.timeout(REAL_LIMIT_S)]
TP = "vllm-tp8"   # the layout's container name (its reference runs TP=8)


def run(*args, inv, timeout=420):
    return inv_cmd(*args, env={"RAILYARD_INVENTORY": str(inv)}, timeout=timeout)


@pytest.fixture(scope="module")
def served():
    with real_lab("single_node_tp") as inv:
        assert run("env", inv=inv).returncode == 0
        r = run("launch", inv=inv)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        yield inv


def test_two_real_workers_hold_the_two_gpus_the_plan_gave_them(served):
    doc = json.loads(on("A", f"docker inspect {TP}").stdout)[0]
    given = doc["HostConfig"]["DeviceRequests"][0]["DeviceIDs"]
    uuids = on("A", "nvidia-smi --query-gpu=uuid --format=csv,noheader").stdout.split()
    assert given == uuids[:2]                       # the first two GPUs, by UUID
    apps = dict(line.split(", ") for line in on(
        "A", "nvidia-smi --query-compute-apps=gpu_uuid,process_name --format=csv,noheader").stdout.splitlines())
    assert apps == {uuids[0]: "VLLM::Worker_TP0", uuids[1]: "VLLM::Worker_TP1"}
    assert any("--tensor-parallel-size 2" in p for p in processes_of("A", f"{components.program('vllm')} serve /model"))


def test_health_plan_logs_and_a_noop_relaunch(served):
    h = run("health", "--json", inv=served)
    assert h.returncode == 0 and json.loads(h.stdout)["ok"], h.stdout
    p = json.loads(run("plan", "--against-engine", "--json", inv=served).stdout)
    assert [(x["planned_tokens"], x["engine_tokens"]) for x in p["data"]["engines"]] == [(2_097_152, 2_097_152)]
    logs = run("logs", "--lines", "400", inv=served).stdout
    assert "CPU KV cache size: 2,097,152 tokens" in logs
    again = run("launch", inv=served)
    assert again.returncode == 0 and "already running with this configuration" in again.stdout
    v = run("verify-rdma", inv=served)
    assert v.returncode == 0 and "SKIP" in v.stdout


def test_a_stalled_tp_worker_is_named_hung_and_the_group_path_brings_it_back(served):
    """issue 43: engine-stall parks the TP group's highest-ranked real worker (VLLM::Worker_TP1) while every
    process keeps running: /health stays 200, so only the shared hung verdict can see it. `health --json` fails
    within its probe limit (20 s) and names the engine service hung on its counters; `recover` takes the group
    path (kills the hung container, starts it, gates it); health passes after. Before the stop test: it leaves
    the deployment serving."""
    from railyard_lab import faults
    warm = run("health", "--json", inv=served)          # serving and warm before the fault
    assert warm.returncode == 0, warm.stdout[-3000:]
    try:
        out = faults.fault("A", "engine-stall")
        assert re.fullmatch(r"A: engine-stall VLLM::Worker_TP1 \(pid \d+\)", out), out
        started = time.monotonic()
        h = run("health", "--json", inv=served)
        took = time.monotonic() - started
        print(f"health --json with a stalled worker: exit {h.returncode} in {took:.1f} s")
        doc = json.loads(h.stdout)
        verdicts = doc["data"]["metrics"]["hung"]
        print("hung verdicts:", json.dumps(verdicts, indent=1))
        assert h.returncode == 1 and not doc["ok"], [c for c in doc["checks"] if c["status"] != "pass"]
        assert took < 45, f"the hung verdict took {took:.1f} s"
        mine = [v for v in verdicts if v["service"] == "engine"]
        assert [v["state"] for v in mine] == ["hung"] and mine[0]["host"] == "A", verdicts
        why = " ".join(mine[0]["evidence"])
        assert mine[0]["source"] == "counters" and "got no token" in why and "did not move" in why, mine[0]
        assert any(c["check"] == "hung" and c["status"] == "fail" for c in doc["checks"]), doc["checks"]
        started = time.monotonic()
        r = run("recover", "--json", inv=served, timeout=600)
        took = time.monotonic() - started
        print(f"recover --json: exit {r.returncode} in {took:.1f} s")
        rec = json.loads(r.stdout)
        print("recover:", json.dumps(rec["data"], indent=1))
        assert r.returncode == 0 and rec["data"]["path"] == "group", r.stdout[-3000:] + r.stderr[-2000:]
        assert any(d.startswith("killed ") for d in rec["data"]["done"]), rec["data"]
    finally:
        faults.heal()      # the parked process is gone with its container: only the lab's record is left
    after = run("health", "--json", inv=served)
    assert after.returncode == 0, [c for c in json.loads(after.stdout)["checks"] if c["status"] != "pass"]


def test_stop_frees_both_gpus_and_launch_server_sh_serves_on_them(served):
    """stop, then the layout's launch_server.sh by hand on the freed GPUs (as a submission is run). `start`
    bringing the stopped containers back is shown on the real engine by test_lab_real_stations.py."""
    assert run("stop", inv=served).returncode == 0
    assert on("A", "nvidia-smi --query-compute-apps=pid --format=csv,noheader").stdout == ""
    out = home("A") / "submission"
    r = run("launch-script", "--out", str(out), inv=served)
    assert r.returncode == 0, r.stderr
    root = lab_dir()
    line = ("cd ~/submission; PORT=8123 MODEL_PATH=~/models/tiny-qwen3 SERVE_HOST=127.0.0.1 "
            "setsid nohup ./launch_server.sh > ~/submission.log 2>&1 < /dev/null & echo $!")
    pid = subprocess.run(ssh_argv(root, lab_host(root, "A"), [line]), capture_output=True, text=True,
                         timeout=60).stdout.strip()
    try:
        code = ""
        for _ in range(300):
            code = on("A", "curl -s -o /dev/null -w '%{http_code}' http://127.0.0.1:8123/health").stdout
            if code == "200" or on("A", f"kill -0 -- -{pid}").returncode:   # serving, or its engine is gone
                break
            time.sleep(1)
        assert code == "200", (home("A") / "submission.log").read_text()[-3000:]
        models = on("A", "curl -s http://127.0.0.1:8123/v1/models").stdout
        assert "railyard-lab/tiny-qwen3" in models, models
        assert "Application startup complete" in (home("A") / "submission.log").read_text()
    finally:
        on("A", f"kill -- -{pid} 2>/dev/null; sleep 5; kill -9 -- -{pid} 2>/dev/null; true")
        shutil.rmtree(out, ignore_errors=True)
