"""`lab.fault HOST engine-stall`: one engine rank stops joining its collectives while every process keeps
running (issue 43, item 5), on the two stations (multinode_tp) with the stand-in engine: the rank's worker
is parked in a plainly named function (state S, never T), its group waits for it, /health answers 200, a
request stays running and gets no answer, the token counters stand still; heal lets it go on. The same
signal handler in the real engine's processes (sim/engine_site.py) is proven in test_lab_real_stations.py;
one stalled DP rank of dp_ep is in test_lab_stall_dp_ep.py."""

from __future__ import annotations

import re
import shutil
import time

import pytest

import railyard_lab as lab
from railyard_lab import faults
from railyard_lab.checkpoint import write_checkpoint

from .conftest import home, inv_cmd, on, remove_containers

pytestmark = pytest.mark.lab
NAME = "glm53-full"
PORT = 8000
# the container's API key (railyard renders one), then the request
CHAT = ("K=$(docker exec glm53-full cat /run/secrets/vllm-api-key); "
        "curl -s -m {t} -o /dev/null -w '%{{http_code}}' -H 'content-type: application/json' -H \"Authorization: Bearer $K\" "
        "-d '{{\"messages\": [{{\"role\": \"user\", \"content\": \"hi\"}}], \"max_tokens\": 4}}' "
        "http://127.0.0.1:{port}/v1/chat/completions")
TOKENS = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total")


def metrics(host: str, port: int) -> dict[tuple[str, str], float]:
    """/metrics as {(series, engine label): value}."""
    out = {}
    for ln in on(host, f"curl -s http://127.0.0.1:{port}/metrics").stdout.splitlines():
        m = re.match(r'^(vllm:\w+)\{(?:[^}]*,)?engine="(\d+)"[^}]*\} (\S+)$', ln)
        if m:
            out[(m.group(1), m.group(2))] = float(m.group(3))
    return out


def states(host: str) -> dict[int, str]:
    """The state letter (/proc/PID/stat) of every engine process of the host's containers."""
    h = lab.lab_host(lab.lab_dir(), host)
    out = {}
    for pid in faults._engine_processes(h, None):
        try:
            out[pid] = open(f"/proc/{pid}/stat").read().rsplit(") ", 1)[1][0]
        except OSError:
            pass
    return out


@pytest.fixture(scope="module")
def stations(lab_inventory):
    for h in ("A", "B"):
        write_checkpoint(home(h) / "models" / "tiny-qwen3", 0.002, 2)
    assert inv_cmd("env", "-i", str(lab_inventory)).returncode == 0
    yield lab_inventory
    faults.heal()
    remove_containers(NAME)
    for h in ("A", "B"):
        shutil.rmtree(home(h) / "models", ignore_errors=True)


@pytest.fixture
def serving(stations):
    faults.heal()
    remove_containers(NAME)
    r = inv_cmd("launch", "-i", str(stations), timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    yield stations
    faults.heal()
    remove_containers(NAME)


LONG = ("K=$(docker exec glm53-full cat /run/secrets/vllm-api-key); "
        "curl -s -N -m 60 -o /dev/null -H 'content-type: application/json' -H \"Authorization: Bearer $K\" "
        "-d '{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"max_tokens\": 20000, "
        "\"ignore_eos\": true, \"stream\": true}' http://127.0.0.1:8000/v1/chat/completions")


def test_a_stalled_rank_runs_on_while_its_group_waits_for_it(serving):
    assert on("A", CHAT.format(t=20, port=PORT)).stdout == "200"          # serving before the fault
    out = faults.fault("B", "engine-stall")
    assert re.fullmatch(r"B: engine-stall VLLM::Worker_TP1 \(pid \d+\)", out), out
    pid = int(re.search(r"pid (\d+)", out).group(1))
    time.sleep(1)
    before = metrics("A", PORT)
    # a request is accepted and never answered: curl gives up (no status)
    assert on("A", CHAT.format(t=6, port=PORT)).stdout == "000"
    during = metrics("A", PORT)
    assert all(during[(k, "0")] == before[(k, "0")] for k in TOKENS), (before, during)
    # sent to an idle engine, the request shows neither running nor waiting: the engine core is stuck in the
    # step that would have published it (the real engine in the lab showed running 0, waiting 0)
    assert during[("vllm:num_requests_running", "0")] == 0 and during[("vllm:num_requests_waiting", "0")] == 0
    # every process runs on: none stopped (T)
    for host in ("A", "B"):
        st = states(host)
        assert st and all(s in "SR" for s in st.values()), (host, st)
    assert pid in states("B")
    assert on("A", f"curl -s -o /dev/null -w '%{{http_code}}' http://127.0.0.1:{PORT}/health").stdout == "200"
    time.sleep(2)
    assert all(metrics("A", PORT)[(k, "0")] == before[(k, "0")] for k in TOKENS)
    faults.heal()
    assert on("A", CHAT.format(t=20, port=PORT)).stdout == "200"           # released: the group goes on


def test_a_stall_under_load_keeps_the_running_request_running(serving):
    """Under load the last stats the engine published have the request running: they stay so."""
    import subprocess
    import railyard_lab as lab_
    root = lab_.lab_dir()
    long = subprocess.Popen(lab_.ssh_argv(root, lab_.lab_host(root, "A"), [LONG]), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        for _ in range(50):
            if metrics("A", PORT).get(("vllm:num_requests_running", "0"), 0) >= 1:
                break
            time.sleep(0.2)
        out = faults.fault("B", "engine-stall", "TP1")                    # the rank by name: the same worker
        assert re.fullmatch(r"B: engine-stall VLLM::Worker_TP1 \(pid \d+\)", out), out
        time.sleep(1)
        before = metrics("A", PORT)
        assert on("A", CHAT.format(t=4, port=PORT)).stdout == "000"
        after = metrics("A", PORT)
        assert after[("vllm:num_requests_running", "0")] >= 1, after
        assert all(after[(k, "0")] == before[(k, "0")] for k in TOKENS), (before, after)
        assert long.poll() is None                                         # the stream waits too
    finally:
        long.kill()
        long.wait()


def test_a_stall_on_the_heads_host_and_the_value_forms(serving):
    out = faults.fault("A", "engine-stall", f"{NAME}:TP0")                 # the head's own worker, by name
    assert re.fullmatch(r"A: engine-stall VLLM::Worker_TP0 \(pid \d+\)", out), out
    time.sleep(1)
    assert on("A", CHAT.format(t=4, port=PORT)).stdout == "000"
    assert all(s in "SR" for s in states("A").values())
    faults.heal()
    assert on("A", CHAT.format(t=20, port=PORT)).stdout == "200"
    with pytest.raises(Exception, match="no engine worker on B in a container named 'nope'"):
        faults.fault("B", "engine-stall", "nope")
    with pytest.raises(Exception, match="with DP3 in its title"):
        faults.fault("B", "engine-stall", "DP3")
