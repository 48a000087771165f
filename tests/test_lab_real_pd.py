"""serve_layout pd on the real vLLM (its CPU build) and the real NIXL 1.5.1: one prefill instance on
hgx8 host A, one decode instance on B, the real vllm-router on A. NIXL moves the prompt's KV blocks
between the hosts' rail addresses over UCX's TCP transport (the lab has no RDMA device), staged in
host memory (pd_kv_buffer_device: cpu). One real bring-up for the module: the launch's own P->D
proof, health's timed request through both pools with the canary recorded on the prefill/decode pair and the
proxy, then judged against that record, and verify-rdma giving the TCP path no pass."""

from __future__ import annotations

import json
import re
import time

import pytest

from .conftest import HOST_PROCESSES, REAL_LIMIT_S, inv_cmd, on, real_lab

# bin/test's real stage; the module's bring-up counts in its first test's limit (launch's own: 420 s)
pytestmark = [pytest.mark.lab, pytest.mark.real, pytest.mark.timeout(REAL_LIMIT_S)]
DEP = "vllm-pd"


def run(*args, inv, timeout=420):
    return inv_cmd(*args, env={"RAILYARD_INVENTORY": str(inv)}, timeout=timeout)


@pytest.fixture(scope="module")
def pd():
    with real_lab("pd") as inv:
        assert run("env", inv=inv).returncode == 0
        r = run("launch", inv=inv)
        assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-3000:]
        yield inv, r.stdout


def test_the_launch_proves_the_kv_moved_from_prefill_to_decode_over_nixl(pd):
    inv, out = pd
    assert "P->D path: a 64-word prompt through the proxy" in out and "moved to decode-0 over NIXL" in out
    logs = on("B", f"docker logs {DEP}-decode-0 2>&1").stdout
    assert "NIXL compatibility check passed" in logs       # the real handshake between the two engines
    assert "Backend UCX was instantiated" in on("A", f"docker logs {DEP}-prefill-0 2>&1").stdout


def test_health_times_a_request_through_both_pools_of_real_engines_and_records_the_pairs_canary(pd):
    """The canary's pair requests (the prefill kept for a remote decode, then the decode reading its KV over the
    real NIXL) are what the real engines take from vllm-router: every one answered, and was recorded."""
    inv, _ = pd
    r = run("health", "--canary", "record", "--json", inv=inv)
    doc = json.loads(r.stdout)
    assert r.returncode == 0, [c for c in doc["checks"] if c["status"] != "pass"]
    canary = [c["detail"] for c in doc["checks"] if c["check"] == "canary"]
    assert canary == [f"{t}: 3 answers recorded" for t in ("prefill-0>decode-0", "proxy")], doc["checks"]
    req = doc["data"]["metrics"]["request"]
    assert req["prefill"] == ["prefill-0"] and req["decode"] == ["decode-0"] and req["ttft_s"] > 0
    kv = doc["data"]["metrics"]["instances"]
    assert kv["prefill-0"]["kv_per_rank"] == {"0": 1_048_576} == kv["decode-0"]["kv_per_rank"]


def test_the_pairs_canary_is_judged_equal_to_its_record_on_the_real_engines(pd):
    """Asked again, the pair and the proxy answer as recorded: temperature 0 on the real engines, the decode's
    answer made from the KV blocks it read over NIXL each time (the prompts are longer than one block)."""
    inv, _ = pd
    r = run("health", "--canary", "--json", inv=inv)
    doc = json.loads(r.stdout)
    assert r.returncode == 0, [c for c in doc["checks"] if c["status"] != "pass"]
    canary = [c["detail"] for c in doc["checks"] if c["check"] == "canary"]
    assert canary == [f"{t}: the 3 canary answers are the recorded ones" for t in ("prefill-0>decode-0", "proxy")], \
        doc["checks"]


def test_verify_rdma_gives_no_pass_to_nixl_over_tcp(pd):
    """No RDMA device here: UCX_NET_DEVICES names the serve rail's netdev, no HCA, and the real UCX of
    the nixl 1.5.1 wheel (1.23) printed no endpoint line at UCX_LOG_LEVEL=info in the lab: railyard's
    judge has no positive evidence of RDMA and must not pass; each reason names only what it read."""
    inv, _ = pd
    r = run("verify-rdma", "--json", inv=inv)
    doc = json.loads(r.stdout)
    assert r.returncode == 1 and not doc["ok"], r.stdout
    nixl = [c for c in doc["checks"] if c["check"] == "nixl"]
    assert nixl and all(c["status"] == "fail" for c in nixl), nixl
    assert all("UCX_NET_DEVICES=enp24s0np0 names no rail HCA" in c["detail"] for c in nixl), nixl


def test_each_engines_nixl_progress_thread_sleeps_between_ucx_events(pd):
    """The lab's accommodation for its two cores (sim/engine_site.py): NIXL's Python API pins the UCX
    progress thread's poll delay at 0, a poll that returns at once, and a pd pair kept both cores busy for
    as long as it lived. In the lab each engine worker's progress thread waits in poll() on its workers'
    event fds with a 1 ms timeout. Read from /proc: poll is syscall 7 on x86-64, its third argument the
    timeout in ms; a thread that spins is seen running, never waiting there."""
    script = ("pids=; " + HOST_PROCESSES + "case \"$c\" in VLLM::Worker*) pids=\"$pids ${d#/proc/}\";; esac; done; "
              "for i in 1 2 3 4 5 6 7 8 9 10; do for p in $pids; do for t in /proc/$p/task/*; do "
              "read -r s < $t/syscall && echo \"$p $s\"; done; done; sleep 0.1; done")
    for host in ("A", "B"):
        lines = [ln.split() for ln in on(host, script).stdout.splitlines()]
        workers = {ln[0] for ln in lines}
        waiting = {ln[0] for ln in lines if ln[1:2] == ["7"] and ln[3:5] == ["0x2", "0x1"]}
        assert workers and waiting == workers, (host, workers, waiting)


def test_a_stalled_prefill_instance_is_named_hung_and_restarted_alone(pd):
    """issue 43: engine-stall parks prefill-0's real engine rank (its one VLLM::Worker) while every process runs: its
    /health stays 200, so vllm-router keeps it. `health --json` names prefill-0 hung (and decode-0 ok); `recover`
    takes the instance path for it alone (killed, out of the proxy, started, gated, back in, proven with a NIXL
    transfer): decode-0 and the proxy keep their StartedAt; health passes after. Last: it restarts prefill-0."""
    from railyard_lab import faults
    inv, _ = pd
    where = {"prefill-0": "A", "decode-0": "B", "proxy": "A"}

    def started_at() -> dict[str, str]:
        return {n: on(h, f"docker inspect --format '{{{{.State.StartedAt}}}}' {DEP}-{n}").stdout.strip()
                for n, h in where.items()}

    before = started_at()
    try:
        out = faults.fault("A", "engine-stall", "prefill-0")
        assert re.fullmatch(r"A: engine-stall VLLM::(?:Worker|EngineCore)\S* \(pid \d+\)", out), out
        print(out)
        began = time.monotonic()
        h = run("health", "--json", inv=inv)
        took = time.monotonic() - began
        doc = json.loads(h.stdout)
        verdicts = {v["service"]: v for v in doc["data"]["metrics"]["hung"]}
        print(f"health --json with prefill-0 stalled: exit {h.returncode} in {took:.1f} s")
        print("hung verdicts:", json.dumps(verdicts, indent=1))
        assert h.returncode == 1 and verdicts["prefill-0"]["state"] == "hung", verdicts
        assert verdicts["decode-0"]["state"] == "ok", verdicts
        assert "did not move" in " ".join(verdicts["prefill-0"]["evidence"]), verdicts["prefill-0"]
        began = time.monotonic()
        r = run("recover", "--json", inv=inv, timeout=600)
        took = time.monotonic() - began
        rec = json.loads(r.stdout)
        print(f"recover --json: exit {r.returncode} in {took:.1f} s:", json.dumps(rec["data"], indent=1))
        assert r.returncode == 0 and rec["data"]["path"] == "instance" and rec["data"]["services"] == ["prefill-0"], \
            r.stdout[-3000:] + r.stderr[-2000:]
        assert "killed prefill-0" in rec["data"]["done"], rec["data"]
    finally:
        faults.heal("A")
    after = started_at()
    assert after["prefill-0"] != before["prefill-0"] and \
        {n: after[n] for n in ("decode-0", "proxy")} == {n: before[n] for n in ("decode-0", "proxy")}, (before, after)
    again = run("health", "--json", inv=inv)
    assert again.returncode == 0, [c for c in json.loads(again.stdout)["checks"] if c["status"] != "pass"]
