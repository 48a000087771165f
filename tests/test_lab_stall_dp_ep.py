"""engine-stall on one DP rank of dp_ep (hgx8, DP=8, the stand-in engine): only that rank's engine waits.
A request routed to it (X-data-parallel-rank, as vLLM honours it) stays unanswered, its
series (engine="2") stand still, while the other ranks answer and their counters move: a sum over the
ranks would hide the stall (issue 43: one hung DP rank of four was masked)."""

from __future__ import annotations

import json
import re
import shutil
import time

import pytest

from railyard_lab import faults
from railyard_lab.checkpoint import write_checkpoint

from .conftest import home, inv_cmd, on
from .test_lab_stall import metrics, states

pytestmark = pytest.mark.lab
DPEP = "vllm-dp-ep"
ARGS = ("--set", "serve_layout=dp_ep")


@pytest.fixture(scope="module")
def dp_ep(hgx8_inventory):
    write_checkpoint(home("A") / "models" / "tiny-qwen3", 0.002, 2)
    on("A", f"docker rm -f {DPEP} >/dev/null 2>&1; true")
    assert inv_cmd("env", "-i", str(hgx8_inventory), *ARGS).returncode == 0
    r = inv_cmd("launch", "-i", str(hgx8_inventory), *ARGS, "--timeout", "60")
    assert r.returncode == 0, r.stdout + r.stderr
    yield hgx8_inventory
    faults.heal()
    on("A", f"docker rm -f {DPEP} >/dev/null 2>&1; true")
    shutil.rmtree(home("A") / "models", ignore_errors=True)


def chat(port: int, rank: int, t: int) -> str:
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    return on("A", f"K=$(docker exec {DPEP} cat /run/secrets/vllm-api-key); curl -s -m {t} -o /dev/null "
                   f"-w '%{{http_code}}' -H 'content-type: application/json' -H \"Authorization: Bearer $K\" "
                   f"-H 'X-data-parallel-rank: {rank}' -d '{body}' http://127.0.0.1:{port}/v1/chat/completions").stdout


def test_one_stalled_dp_rank_stops_only_its_own_counters(dp_ep):
    args = json.loads(on("A", f"docker inspect {DPEP}").stdout)[0]["Args"][-1]
    port = int(re.search(r"--port (\d+)", args).group(1))
    out = faults.fault("A", "engine-stall", "DP2")
    assert re.fullmatch(r"A: engine-stall VLLM::Worker_DP2_EP2 \(pid \d+\)", out), out
    before = metrics("A", port)
    assert chat(port, 2, 5) == "000"                                      # rank 2's request: no answer
    for rank in (0, 1, 3):
        assert chat(port, rank, 20) == "200"                              # the others serve
    time.sleep(1)
    after = metrics("A", port)
    gen = "vllm:generation_tokens_total"
    # stuck in the step that would have published it, rank 2 keeps its last stats (idle), as the real engine does
    assert after[("vllm:num_requests_running", "2")] == before[("vllm:num_requests_running", "2")] == 0, after
    assert after[(gen, "2")] == before[(gen, "2")] and after[("vllm:prompt_tokens_total", "2")] == \
        before[("vllm:prompt_tokens_total", "2")]
    assert all(after[(gen, str(r))] > before[(gen, str(r))] for r in (0, 1, 3)), (before, after)
    assert all(s in "SR" for s in states("A").values())
    faults.heal()
    assert chat(port, 2, 20) == "200"


def test_health_names_the_one_hung_dp_rank_and_recover_brings_the_engine_back(dp_ep):
    """The shared verdict (railyard.verbs.hung) sends a probe to each DP rank and judges each rank's own counters:
    rank 2 is named hung, the sum of the eight does not hide it, and recover restarts the engine."""
    faults.fault("A", "engine-stall", "DP2")
    r = inv_cmd("health", "--json", "-i", str(dp_ep), *ARGS, timeout=180)
    doc = json.loads(r.stdout)
    (v,) = [v for v in doc["data"]["metrics"]["hung"] if v["service"] != "router"]
    assert r.returncode == 1 and v["state"] == "hung" and v["target"].endswith("DP rank 2"), v
    assert v["evidence"][0].startswith("DP rank 2: its probe got no token in "), v
    rec = inv_cmd("recover", "--json", "-i", str(dp_ep), *ARGS, timeout=300)
    assert rec.returncode == 0, rec.stdout[-3000:]
    faults.heal()
    assert inv_cmd("health", "--json", "-i", str(dp_ep), *ARGS, timeout=180).returncode == 0
