"""serve_layout replicas on the real vLLM (its CPU build), the real LMCache 0.5.6 server and the real
LiteLLM 1.108.7 proxy, on one hgx8 lab host: two replicas of TP=1 on two GPUs, sharing LMCache over
its engine-driven transfers (lmcache_transfer_mode auto: the CPU engine's connector asks for them).
One real bring-up for the module: health through the router, the cache proof on the real engines
(the second replica retrieves the first one's KV blocks from LMCache, and its engine counts them), AIPerf
through the router with its master key, the correctness canary (a replica restarted on another seed of
the lab model answers otherwise, and is named alone), and a planned restart of that replica after which
health and the canary pass.

What stays on the stand-in (test_lab_replicas.py): a killed replica and recover's long path. On a
GPU host LMCache keeps a dead replica's KV memory mapped over CUDA IPC, so nvidia-smi shows its
PID on that replica's GPUs until it lets go; the CPU engine registers host memory instead, and only
the stand-in models that GPU state."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .conftest import REAL_LIMIT_S, home, inv_cmd, on, real_lab, wait_for

# bin/test's real stage; the module's bring-up counts in its first test's limit (launch's own: 420 s)
pytestmark = [pytest.mark.lab, pytest.mark.real, pytest.mark.timeout(REAL_LIMIT_S)]
DEP = "vllm-replicas"


def run(*args, inv, timeout=420):
    return inv_cmd(*args, env={"RAILYARD_INVENTORY": str(inv)}, timeout=timeout)


@pytest.fixture(scope="module")
def deployed():
    with real_lab("replicas") as inv:
        assert run("env", inv=inv).returncode == 0
        r = run("launch", inv=inv)
        assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-3000:]
        yield inv


def test_health_sees_both_real_replicas_registered_with_lmcache_and_the_router(deployed):
    r = run("health", "--json", inv=deployed)
    doc = json.loads(r.stdout)
    assert r.returncode == 0, [c for c in doc["checks"] if c["status"] != "pass"]
    m = doc["data"]["metrics"]
    # the CPU engine registers engine-driven contexts, one per replica, not GPU ids
    assert m["lmcache"]["registered_gpu_ids"] == [] and len(m["lmcache"]["engine_instances"]) == 2
    assert sorted(m["router"]["healthy"]) == ["r0", "r1"] and m["router"]["answered_by"] in ("r0", "r1")
    status = on("A", "curl -s 127.0.0.1:8080/status").stdout
    assert json.loads(status)["registered_non_cuda_instance_ids"], status


def test_the_cache_proof_on_the_real_engines(deployed):
    r = run("health", "--json", "--cache-proof", "--proof-words", "3000", inv=deployed)
    doc = json.loads(r.stdout)
    proof = next(c for c in doc["checks"] if c["check"] == "cache_proof")
    assert r.returncode == 0 and proof["status"] == "pass", proof
    got = doc["data"]["metrics"]["cache_proof"]
    # reused, as LMCache and r1's engine count it: at least 2,048 of the prompt's tokens (LMCache's chunks
    # of 256); the real engine on this CPU is not reliably faster (0.37 s, then 0.43 s: fetching the KV of
    # this 2-layer model costs what computing it does), and the verdict does not ask it to be
    assert got["retrieved_tokens"] >= 2048 and got["external_prefix_cache_hits"] >= 2048, got
    assert f"then r1 {got['r1_ms'] / 1000:.2f} s" in proof["detail"], proof


def test_bench_through_the_router_with_the_master_key(deployed, tmp_path):
    r = run("bench", "--concurrency", "2", "--isl", "64", "--osl", "16", "--requests", "2", "--warmup", "1",
            "--out", str(tmp_path), inv=deployed)
    assert r.returncode == 0, r.stdout + r.stderr
    s = json.loads(sorted(tmp_path.glob(f"{DEP}/*/summary.json"))[-1].read_text())
    assert s["endpoint"]["service"] == "router" and s["endpoint"]["port"] == 4000
    p = s["series"][0]["points"][0]
    assert p["errors"] == 0 and p["requests"] == 4 and p["metrics"]["output_tok_s"] > 0
    assert not (Path(s["dir"]) / "c2" / "server_metrics_export.json").exists()   # LiteLLM's /metrics wants the key
    key = (home("A") / ".config" / "railyard" / "litellm-master-key").read_text().strip()
    assert key and not [f for f in Path(s["dir"]).rglob("*") if f.is_file() and key.encode() in f.read_bytes()]


def test_the_canary_names_the_replica_on_other_weights_and_a_planned_restart_brings_it_back(deployed):
    """`health --canary record` keeps each real replica's answers and the router's. `lab.fault A wrong-weights
    --value r1` puts seed 1 of the lab model (the same config and tokenizer, other weights) in r1's checkpoint on
    disk and restarts r1: `health --canary` fails r1 alone, naming the prompt and both answers, and passes r0
    (through the router an answer comes from r0 or r1 as LiteLLM picks: that verdict is printed, not asserted).
    With the weights back on disk, a planned restart of r1 (`recover --replica r1`: out of routing first) loads
    them: health and the canary pass. The restarted engine registers a new LMCache context; the old one stays
    until LMCache reaps it (120 s silent): health shows it and passes (under load: test_lab_replicas.py)."""
    from railyard_lab import faults
    rec = run("health", "--canary", "record", "--json", inv=deployed)
    doc = json.loads(rec.stdout)
    canary = [c["detail"] for c in doc["checks"] if c["check"] == "canary"]
    assert rec.returncode == 0 and canary == [f"{t}: 3 answers recorded" for t in ("r0", "r1", "router")], doc["checks"]
    try:
        f = run("lab.fault", "A", "wrong-weights", "--value", "r1", inv=deployed)
        assert f.returncode == 0, f.stdout + f.stderr
        wait_for(lambda: on("A", "curl -sf 127.0.0.1:8002/health").returncode == 0, "r1 serving seed 1", 300)
        bad = run("health", "--canary", "--json", inv=deployed)
        got = {c["detail"].split(":")[0]: c for c in json.loads(bad.stdout)["checks"] if c["check"] == "canary"}
        assert bad.returncode == 1 and got["r0"]["status"] == "pass", got
        assert got["r1"]["status"] == "fail" and "differs from the record in 3 asks of 3" in got["r1"]["detail"], got
        print("through the router:", got["router"]["status"], got["router"]["detail"])
    finally:
        faults.heal("A")                 # seed 0 back on disk; r1 runs seed 1 until it restarts
    r = run("recover", "--replica", "r1", inv=deployed, timeout=600)
    assert r.returncode == 0 and "took r1 out of routing" in r.stdout and "put r1 back into routing" in r.stdout, \
        r.stdout[-3000:] + r.stderr
    assert on("A", f"cat ~/.cache/railyard/serve/{DEP}/router/drained").stdout == ""
    key = (home("A") / ".config" / "railyard" / "litellm-master-key").read_text().strip()
    assert key and key not in r.stdout + r.stderr
    again = run("health", "--canary", inv=deployed)
    assert again.returncode == 0, again.stdout[-4000:]
