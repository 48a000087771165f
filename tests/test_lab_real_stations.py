"""The two-station bring-up served by the real vLLM (its CPU build, the lab's engine venv): railyard's
rendered `docker run`, flags and environment are what the real `vllm serve` parses, TP=2 over the lab
rail, worker first. One real bring-up is shared by the module's tests (a start takes about a minute
on two cores); what only a GPU adds is the lab's GPU layer (the memory nvidia-smi shows, the NCCL
log). Also `inv bench` against the real scheduler: AIPerf's numbers. `--sweep` (a relaunch per value and
one to put the inventory's configuration back: about a minute each here) is shown on the stand-in
(test_lab_bench.py); what it relaunches with is the same `launch` this module runs for real."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from railyard_lab import components

from .conftest import REAL_LIMIT_S, home, inv_cmd, on, processes_of, real_lab
from .test_bench import _png_text

# bin/test's real stage; the module's bring-up counts in its first test's limit (launch's own: 420 s)
pytestmark = [pytest.mark.lab, pytest.mark.real, pytest.mark.timeout(REAL_LIMIT_S)]
NAME = "glm53-full"
SMALL = ("--isl", "64", "--osl", "16", "--requests", "2", "--warmup", "1")


def run(*args, inv, timeout=420):
    return inv_cmd(*args, env={"RAILYARD_INVENTORY": str(inv)}, timeout=timeout)


@pytest.fixture(scope="module")
def served():
    with real_lab("multinode_tp") as inv:
        assert run("env", inv=inv).returncode == 0
        r = run("launch", "--json", inv=inv)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        yield inv, json.loads(r.stdout)


def _key() -> str:
    return (home("A") / ".config" / "railyard" / "vllm-api-key").read_text().strip()


def test_the_serving_processes_are_the_real_vllm_and_it_answers_through_both_ranks(served):
    inv, _ = served
    exe = str(components.program("vllm"))
    for h, headless in (("A", False), ("B", True)):
        real = processes_of(h, f"{exe} serve /model")
        assert real                          # the venv's own `vllm serve`, not the stand-in
        assert all(("--headless" in p) == headless for p in real) and "--tensor-parallel-size 2" in real[0]
    body = json.dumps({"model": "railyard-lab/tiny-qwen3", "max_tokens": 4, "temperature": 0,
                       "messages": [{"role": "user", "content": "hello there"}]})
    r = on("A", f"curl -s -H 'Authorization: Bearer {_key()}' -H 'Content-Type: application/json' -d '{body}' "
                "http://127.0.0.1:8000/v1/chat/completions")
    doc = json.loads(r.stdout)
    # the real engine's fingerprint names its version and the tensor-parallel pair that answered
    assert doc["system_fingerprint"].startswith("vllm-0.32.0-tp2-"), doc
    assert doc["usage"]["completion_tokens"] == 4


def test_launch_reports_every_milestone_from_the_real_log_and_relaunch_is_a_noop(served):
    inv, doc = served
    t = {e["service"]: e for e in doc["data"]["timeline"]}
    head, worker = t["head"], t["worker-1"]
    assert all(head["seconds"][k] > 0 for k in ("weights_loaded", "kv_cache_allocated", "engine_initialised",
                                                 "api_ready")), head
    assert head["seconds"]["weights_loaded"] <= head["seconds"]["kv_cache_allocated"] <= head["seconds"]["api_ready"]
    assert worker["seconds"]["weights_loaded"] > 0 and worker["not_applicable"] == ["engine_initialised", "api_ready"]
    again = run("launch", "--json", inv=inv)
    assert again.returncode == 0 and json.loads(again.stdout)["data"]["noop"] is True


def test_health_passes_the_real_engine_and_its_gpu_layer(served):
    inv, _ = served
    r = run("health", "--json", inv=inv)
    doc = json.loads(r.stdout)
    assert r.returncode == 0 and doc["ok"], r.stdout
    chat = next(p for p in doc["data"]["probes"] if p["name"] == "chat completion")
    assert "finish_reason length; 16 token(s)" in chat["detail"]   # a random model never stops: still healthy
    # the GPU layer: each real worker holds its station's GB300, by the title the engine gave it
    assert [x["serving_process"] for x in doc["data"]["ranks"]] == ["VLLM::Worker_TP0", "VLLM::Worker_TP1"]
    assert all(x["gpu_used_mib"] > 200_000 for x in doc["data"]["ranks"])
    v = run("verify-rdma", "--json", inv=inv)
    assert v.returncode == 0 and json.loads(v.stdout)["ok"]       # the layer's NCCL log, from the container


def test_plan_against_the_engine_matches_its_kv_cache_exactly(served):
    inv, _ = served
    r = run("plan", "--against-engine", "--json", inv=inv)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = json.loads(r.stdout)["data"]["engines"]
    assert [(x["service"], x["planned_tokens"], x["engine_tokens"], x["difference_pct"]) for x in rows] == [
        ("head", 2_097_152, 2_097_152, 0.0)]    # 1 GiB per rank / (2 layers x K,V x 1 KV head of 64 x 2 bytes)


def test_logs_and_status_show_the_real_engine(served):
    inv, _ = served
    r = run("logs", "--rank", "B", "--lines", "400", inv=inv)
    assert r.returncode == 0 and "Launching vLLM (v0.32.0) headless multiproc executor" in r.stdout
    st = json.loads(run("status", "--json", inv=inv).stdout)
    assert st["ok"] and [x["state"] for x in st["data"]["ranks"]] == ["running", "running"]


def test_bench_c_1_2_measures_the_real_scheduler_and_keeps_the_key_out(served, tmp_path):
    inv, _ = served
    r = run("bench", "--concurrency", "1,2", *SMALL, "--out", str(tmp_path),
            "--slo", "per_user_tok_s>=0.001", "--slo", "ttft_p90_s<=0.000001", inv=inv)
    assert r.returncode == 0, r.stdout + r.stderr          # a failed SLO without --require: shown, exit 0
    s = json.loads(sorted(tmp_path.glob(f"{NAME}/*/summary.json"))[-1].read_text())
    pts = s["series"][0]["points"]
    assert [p["concurrency"] for p in pts] == [1, 2] and all(p["errors"] == 0 for p in pts)
    assert [p["requests"] for p in pts] == [4, 4]         # 2 x C, at least 4
    assert all(p["metrics"]["output_tok_s"] > 0 and p["metrics"]["ttft_mean_s"] > 0 for p in pts)
    assert all(p["units"]["time_to_first_token"] == "ms" for p in pts)
    assert s["aiperf_version"] == "0.13.0" and s["endpoint"]["host"] == "A"
    run_dir = Path(s["dir"])
    for p in pts:
        assert (run_dir / p["dir"] / "profile_export_aiperf.json").is_file()
        assert (run_dir / p["dir"] / "server_metrics_export.json").is_file()   # the engine's own /metrics, scraped
    text = " ".join(r.stdout.split())
    assert "overall tok/s" in text and "fail: ttft_p90_s<=1e-06" in text
    assert "SLOs per_user_tok_s>=0.001, ttft_p90_s<=1e-06: met at no concurrency" in text
    lat = json.loads(_png_text(run_dir / "latency.png")["railyard:series"])
    assert [x["concurrency"] for x in lat["this run"]["ttft_mean_s"]] == [1, 2]
    assert lat["_slos"] == {"ttft_mean_s": ["ttft_p90_s<=1e-06"]}
    # the key: in no file of the run, and AIPerf's own record of its command line has it redacted
    assert not [f for f in run_dir.rglob("*") if f.is_file() and _key().encode() in f.read_bytes()]
    doc = json.loads((run_dir / "c1" / "profile_export_aiperf.json").read_text())
    assert "--api-key='<redacted>'" in doc["run_info"]["cli_command"]
    assert _key() not in r.stdout + r.stderr

    # --compare: the same table with deltas, both runs on the plots; --require makes the failed SLO exit 1
    r2 = run("bench", "--concurrency", "1", *SMALL, "--out", str(tmp_path), "--compare", str(run_dir),
             "--slo", "ttft_p90_s<=0.000001", "--require", inv=inv)
    assert r2.returncode == 1, r2.stdout + r2.stderr
    assert " %)" in r2.stdout                                  # a delta against the earlier C=1
    s2 = json.loads(sorted(tmp_path.glob(f"{NAME}/*/summary.json"))[-1].read_text())
    assert s2["compare"] == str(run_dir) and s2["dir"] != s["dir"]
    thr2 = json.loads(_png_text(Path(s2["dir"]) / "throughput.png")["railyard:series"])
    assert len(thr2) == 2 and any(s["stamp"] in label for label in thr2)


def test_a_stopped_worker_is_named_hung_within_18_s_while_health_answers_and_recover_restarts_the_group(served):
    """`lab.fault B engine-hang` stops B's real worker (SIGSTOP): the head's engine waits on it in the
    tensor-parallel step, so the probe gets no token and vLLM's token counters stand still, while its
    /health answers 200; B's rank is named from its process state (the probe waits vllm_hung_after_s, 8 s
    here). `inv recover` takes the group down (the head stopped, the hung rank killed) and up in stage
    order, the worker first, each gated, and the real engine serves again."""
    import time

    from railyard_lab import faults
    inv, _ = served
    try:
        assert run("lab.fault", "B", "engine-hang", inv=inv).returncode == 0
        t0 = time.monotonic()
        r = run("health", "--json", "--set", "vllm_hung_after_s=8", inv=inv)
        took = time.monotonic() - t0
        doc = json.loads(r.stdout)
        b = next(x for x in doc["data"]["ranks"] if x["host"] == "B")
        v = {x["service"]: x for x in doc["data"]["metrics"]["hung"]}
        assert r.returncode == 1 and took < 18, (took, r.stdout[-2000:])
        assert b["reasons"][0].startswith("hung: VLLM::Worker_TP1 (pid ") and "is stopped (state T" in b["reasons"][0]
        assert v["worker-1"]["state"] == "hung" and v["worker-1"]["evidence"][0].startswith(
            "stopped: VLLM::Worker_TP1 (pid "), v
        assert v["head"]["state"] == "hung" and v["head"]["evidence"][0].startswith(
            "its probe got no token in 8 s and its token counters did not move (prompt_tokens_total "), v
        r = run("recover", inv=inv, timeout=600)
        done = [ln.strip() for ln in r.stdout.splitlines() if ln.strip().startswith("done: ")]
        assert r.returncode == 0 and "OK: head, worker-1 recovered" in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]
        assert done[:2] == ["done: killed head", "done: killed worker-1"], done   # both hung: neither sees SIGTERM
        assert "done: started worker-1, head in stage order: ready" in done, done
    finally:
        faults.heal()
    r = run("health", "--json", inv=inv)
    assert r.returncode == 0, r.stdout[-2000:]


def test_stop_frees_the_gpus_and_start_head_first_brings_the_pair_back(served):
    """launch started the worker first (B -> A); start, head first, has the head wait for its worker."""
    inv, _ = served
    r = run("stop", inv=inv)
    assert r.returncode == 0, r.stdout + r.stderr
    for h in ("A", "B"):                 # the real workers are gone, and with them the GPU memory they held
        assert "VLLM::Worker" not in on(h, "nvidia-smi --query-compute-apps=pid,name --format=csv").stdout
        assert not processes_of(h, f"{components.program('vllm')} serve")
    r = run("start", "--rank-order", "A,B", inv=inv)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr
    assert "(A -> B)" in r.stdout, r.stdout
    assert run("health", inv=inv).returncode == 0


def test_a_roll_to_another_image_is_a_planned_restart_of_the_real_pair_and_health_passes_after(served):
    """issue 45 on the real engine: `roll --image` (the lab image's second tag, the same engine) says before it starts
    that the two stations serve as one group, restarts both ranks on the new image (worker first, as launch does),
    measures the downtime from the first container removed to the head's gate, and health passes on it."""
    import railyard_lab as lab
    inv, _ = served
    nxt = f"{lab.LAB_IMAGE_NEXT}@{lab.LAB_IMAGE_NEXT_DIGEST}"
    dry = run("roll", "--image", nxt, "--dry-run", inv=inv)
    assert dry.returncode == 0 and "planned restart: multinode_tp serves as one group" in dry.stdout, dry.stdout
    r = run("roll", "--image", nxt, "--json", inv=inv, timeout=600)
    d = json.loads(r.stdout)["data"]
    print(f"roll --image on the real stations: {d['seconds']} s, downtime {d['downtime_s']} s")
    assert r.returncode == 0 and d["path"] == "planned restart" and 0 < d["downtime_s"] <= d["seconds"], d
    for host in ("A", "B"):
        assert nxt in on(host, f"docker inspect {NAME}").stdout, host
    h = run("health", "--set", f"vllm_image={nxt}", inv=inv)
    assert h.returncode == 0, h.stdout[-3000:]
