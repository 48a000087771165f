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
import re
import subprocess
import threading
import time
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


def started_at(*names: str) -> dict[str, str]:
    """Each container's State.StartedAt on A: a restarted one has a new one."""
    return {n: on("A", f"docker inspect --format '{{{{.State.StartedAt}}}}' {DEP}-{n}").stdout.strip() for n in names}


class SteadyLoad(threading.Thread):
    """Sequential chat completions through the router (LiteLLM on A, with its master key), each recorded as (start s,
    HTTP status, seconds). Each carries LiteLLM's own per-request `timeout` (30 s, where a request takes about a
    second here): an attempt on a replica that does not answer ends there and LiteLLM retries it (its num_retries,
    railyard's filter sending the retry to a replica that has not failed it); curl's own bound is far above that."""
    BODY = json.dumps({"model": "railyard-lab/tiny-qwen3", "max_tokens": 4, "temperature": 0, "timeout": 30,
                       "messages": [{"role": "user", "content": "count to three"}]})

    def __init__(self):
        super().__init__(daemon=True)
        import railyard_lab as lab
        root = lab.lab_dir()
        key = (home("A") / ".config" / "railyard" / "litellm-master-key").read_text().strip()
        line = (f"curl -s -m 180 -o /dev/null -w '%{{http_code}}' -H 'Authorization: Bearer {key}' "
                f"-H 'Content-Type: application/json' -d '{self.BODY}' http://127.0.0.1:4000/v1/chat/completions")
        self.argv = lab.ssh_argv(root, lab.lab_host(root, "A"), [line])
        self.sent: list[tuple[float, str, float]] = []
        self.stop = threading.Event()
        self.t0 = time.monotonic()

    def run(self):
        while not self.stop.is_set():
            began = time.monotonic()
            try:
                code = subprocess.run(self.argv, capture_output=True, text=True, timeout=200).stdout.strip() or "none"
            except subprocess.TimeoutExpired:
                code = "ssh timeout"
            self.sent.append((round(began - self.t0, 1), code, round(time.monotonic() - began, 1)))
            self.stop.wait(0.2)


def test_a_stalled_replica_is_named_hung_and_restarted_alone_while_the_router_keeps_serving(deployed):
    """issue 43: engine-stall parks r1's real engine rank (its one VLLM::Worker) while every process runs: /health stays
    200. Under a steady load through LiteLLM, `health --json` names r1 hung and r0 ok; `recover` takes the short
    path for r1 alone (out of routing, killed, started, gated, back in): r0, LMCache and the router keep their
    StartedAt; health passes after, and every request of the load was answered 200."""
    from railyard_lab import faults
    # r1 has made tokens since it last started (a cold engine is never judged hung): a request straight to it
    assert on("A", "curl -s -m 120 -o /dev/null -w '%{http_code}' -H 'Content-Type: application/json' -d "
                   "'{\"model\": \"railyard-lab/tiny-qwen3\", \"max_tokens\": 4, \"messages\": [{\"role\": "
                   "\"user\", \"content\": \"hi\"}]}' http://127.0.0.1:8002/v1/chat/completions").stdout == "200"
    before = started_at("r0", "r1", "lmcache", "router")
    load = SteadyLoad()
    load.start()
    try:
        time.sleep(5)
        out = faults.fault("A", "engine-stall", "r1")
        assert re.fullmatch(r"A: engine-stall VLLM::(?:Worker|EngineCore)\S* \(pid \d+\)", out), out
        print(out)
        began = time.monotonic()
        h = run("health", "--json", inv=deployed)
        took = time.monotonic() - began
        doc = json.loads(h.stdout)
        verdicts = {v["service"]: v for v in doc["data"]["metrics"]["hung"]}
        print(f"health --json with r1 stalled: exit {h.returncode} in {took:.1f} s")
        print("hung verdicts:", json.dumps(verdicts, indent=1))
        assert h.returncode == 1 and verdicts["r1"]["state"] == "hung" and verdicts["r0"]["state"] == "ok", verdicts
        assert "did not move" in " ".join(verdicts["r1"]["evidence"]), verdicts["r1"]
        began = time.monotonic()
        r = run("recover", "--json", inv=deployed, timeout=600)
        took = time.monotonic() - began
        rec = json.loads(r.stdout)
        print(f"recover --json: exit {r.returncode} in {took:.1f} s:", json.dumps(rec["data"], indent=1))
        assert r.returncode == 0 and rec["data"]["path"] == "short" and rec["data"]["services"] == ["r1"], \
            r.stdout[-3000:] + r.stderr[-2000:]
        assert "killed r1" in rec["data"]["done"] and "put r1 back into routing" in rec["data"]["done"], rec["data"]
    finally:
        faults.heal("A")
    after = started_at("r0", "r1", "lmcache", "router")
    assert after["r1"] != before["r1"] and {k: after[k] for k in ("r0", "lmcache", "router")} == \
        {k: before[k] for k in ("r0", "lmcache", "router")}, (before, after)
    again = run("health", "--json", inv=deployed)
    try:
        assert again.returncode == 0, [c for c in json.loads(again.stdout)["checks"] if c["status"] != "pass"]
    finally:
        load.stop.set()
        load.join(240)
    codes = [c for _, c, _ in load.sent]
    slow = [x for x in load.sent if x[2] > 5 or x[1] != "200"]
    print(f"steady load: {len(codes)} requests, {sum(c != '200' for c in codes)} not 200; the slow or failed ones "
          f"(start s, status, s): {slow}")
    assert len(codes) >= 20 and set(codes) == {"200"}, load.sent


NEW_REV = "c" * 40


def test_a_new_revision_rolls_through_the_real_replicas_under_load_with_no_request_lost(deployed):
    """issue 45 on the real engines: the lab model's other seed beside the running checkpoint as a new revision;
    under a steady load through LiteLLM, `inv roll --revision` moves r0, then r1, to it (out of routing, drained,
    stopped, started on the new checkpoint, gated, one request, back in). Every request of the load is counted and
    answered 200; the canary is recorded for the new revision and passes; `inv status` shows the roll."""
    import railyard_lab as lab
    from railyard_lab.checkpoint import write_checkpoint
    from railyard_lab.faults import WRONG_SEED
    base = lab.lab_model_path("replicas").removeprefix("~/")
    write_checkpoint(home("A") / f"{base}-{NEW_REV[:12]}", 0.002, 2, kind=lab.model_kind("replicas"),
                     model_seed=WRONG_SEED)
    assert run("health", "--canary", "record", inv=deployed).returncode == 0
    before = json.loads(on("A", f"cat ~/.cache/railyard/serve/{DEP}/canary.json").stdout)
    kept = started_at("lmcache", "router")
    load = SteadyLoad()
    load.start()
    try:
        time.sleep(5)
        began = time.monotonic()
        r = run("roll", "--revision", NEW_REV, "--json", inv=deployed, timeout=900)
        took = time.monotonic() - began
        time.sleep(5)
    finally:
        load.stop.set()
        load.join(240)
    doc = json.loads(r.stdout)
    print(f"roll --json: exit {r.returncode} in {took:.1f} s:", json.dumps(doc["data"], indent=1))
    failed = [x for x in load.sent if x[1] != "200"]
    print(f"steady load: {len(load.sent)} requests, {len(failed)} not 200: {failed}; the slow ones "
          f"(start s, status, s): {[x for x in load.sent if x[2] > 5]}")
    if failed:   # what each component said while the load failed: the router, both replicas, LMCache
        for name in ("router", "r0", "r1", "lmcache"):
            lines = on("A", f"docker logs --timestamps {DEP}-{name} 2>&1 | grep -iE 'error|exception|traceback|"
                            f" 500 ' | grep -v 'No deployments available' | tail -n 30").stdout
            print(f"--- {name}:\n{lines}")
    assert r.returncode == 0, doc["data"].get("failure")
    assert len(load.sent) >= 20 and not failed, load.sent
    assert started_at("lmcache", "router") == kept                       # only the replicas restarted
    for name in ("r0", "r1"):
        assert f"{base.rpartition('/')[2]}-{NEW_REV[:12]}" in on("A", f"docker inspect {DEP}-{name}").stdout
    record = json.loads(on("A", f"cat ~/.cache/railyard/serve/{DEP}/canary.json").stdout)
    assert record["model_revision"] == NEW_REV and record["answers"] != before["answers"]
    h = run("health", "--canary", "--json", inv=deployed)
    assert h.returncode == 0, [c for c in json.loads(h.stdout)["checks"] if c["status"] != "pass"]
    last = json.loads(run("status", "--json", inv=deployed).stdout)["data"]["recoveries"]["last_roll"]
    assert last["ok"] and last["change"]["to"] == NEW_REV and last["path"] == "one replica at a time"
