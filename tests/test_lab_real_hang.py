"""The incident loop on the real vLLM (its CPU build, the two stations, TP=2 over the lab rail): a rank that hangs
without SIGSTOP (engine-stall: the handler of the engines' sitecustomize, sim/engine_site.py, parks B's real
`VLLM::Worker_TP1`; its process stays in state S and the head's real engine waits for it in its real all_reduce),
the head's API server stopped, and killed. Each time `inv health` names it from the shared hung verdict,
`inv hang-dump` (py-spy of the real processes) names the odd rank, `inv recover` brings the group back in rank
order, and health passes after. Then `inv health --watch 5 --recover` alone: a stalled rank back with no command
typed, and a crash loop stopped at the restart budget with one line and exit 1."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest

from railyard.checks.hang import PS, parse_ps, tree
from railyard_lab import faults

from .conftest import REAL_LIMIT_S, ROOT, home, inv_cmd, on, real_lab

pytestmark = [pytest.mark.lab, pytest.mark.real, pytest.mark.timeout(REAL_LIMIT_S)]
NAME = "glm53-full"


def run(*args, inv, timeout=420):
    return inv_cmd(*args, env={"RAILYARD_INVENTORY": str(inv)}, timeout=timeout)


def _key() -> str:
    return (home("A") / ".config" / "railyard" / "vllm-api-key").read_text().strip()


def chat(t: int) -> str:
    body = json.dumps({"model": "railyard-lab/tiny-qwen3", "max_tokens": 4, "temperature": 0,
                       "messages": [{"role": "user", "content": "hello there"}]})
    return on("A", f"curl -s -m {t} -o /dev/null -w '%{{http_code}}' -H 'Authorization: Bearer {_key()}' "
                   f"-H 'Content-Type: application/json' -d '{body}' http://127.0.0.1:8000/v1/chat/completions").stdout


@pytest.fixture(scope="module")
def served():
    with real_lab("multinode_tp") as inv:
        assert run("env", inv=inv).returncode == 0
        r = run("launch", inv=inv)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        assert chat(180) == "200"            # the first request compiles: warm before any judgment
        on("A", f"rm -f ~/.cache/railyard/serve/{NAME}/recoveries.json")   # an earlier run's restarts are not ours
        yield inv


def verdicts(doc: dict) -> dict[str, dict]:
    return {v["service"]: v for v in doc["data"]["metrics"]["hung"]}


def api_server(host: str) -> int:
    """The real `vllm serve` (the API server) of the host's container: the child of the image's main process (the
    lab hosts share one PID namespace, so `ps -e` lists every host's processes)."""
    main = on(host, f"docker inspect --format '{{{{.State.Pid}}}}' {NAME}").stdout.strip()
    out = on(host, f"ps -o pid=,args= --ppid {main}").stdout
    return int(next(ln.split()[0] for ln in out.splitlines() if "venvs/vllm/bin/vllm serve" in ln))


def recovered(inv) -> dict:
    r = run("recover", "--json", inv=inv)
    doc = json.loads(r.stdout)
    assert r.returncode == 0 and doc["data"]["path"] == "group", r.stdout[-3000:]
    assert doc["data"]["done"][-2].startswith("started worker-1, head in stage order: ready"), doc["data"]["done"]
    h = run("health", "--json", inv=inv)
    assert h.returncode == 0, h.stdout[-3000:]
    assert chat(120) == "200"
    return doc


def test_a_stalled_rank_is_named_hung_explained_by_hang_dump_and_recovered(served):
    inv = served
    out = faults.fault("B", "engine-stall")
    pid = int(re.search(r"pid (\d+)", out).group(1))
    started = time.monotonic()
    r = run("health", "--json", inv=inv)
    took = time.monotonic() - started
    print(f"health named the stalled rank in {took:.1f} s")
    doc = json.loads(r.stdout)
    v = verdicts(doc)
    assert r.returncode == 1 and took < 30, (took, r.stdout[-2000:])
    assert v["head"]["state"] == "hung" and v["head"]["source"] == "counters", v
    assert v["head"]["evidence"][0].startswith("its probe got no token in "), v["head"]
    assert v["worker-1"]["state"] == "hung" and v["worker-1"]["target"] == "worker-1 (rank 1)", v
    state = open(f"/proc/{pid}/stat").read().rsplit(") ", 1)[1][0]
    assert state in "SR"                          # a running rank, never a stopped one
    d = run("hang-dump", "--json", inv=inv, timeout=300)
    dump = json.loads(d.stdout)                  # one document
    text = json.dumps(dump)
    assert d.returncode == 1, d.stdout[-3000:]
    assert "lab_fault_engine_stall" in text and "all_reduce" in text, text[-3000:]
    odd = next(c["detail"] for c in dump["checks"] if "lab_fault_engine_stall" in c["detail"])
    assert "B/worker-1" in odd and "VLLM::Worker_TP1" in odd, odd
    recovered(inv)


def test_a_stopped_and_a_killed_api_server_are_named_and_recovered(served):
    inv = served
    pid = api_server("A")
    on("A", f"kill -STOP {pid}")
    try:
        started = time.monotonic()
        r = run("health", "--json", inv=inv)
        took = time.monotonic() - started
        head = verdicts(json.loads(r.stdout))["head"]
        assert r.returncode == 1 and took < 30, (took, r.stdout[-2000:])
        assert head["state"] == "hung" and head["evidence"] == [f"stopped: API server (pid {pid}, state Tl)"], head
    finally:
        recovered(inv)
    pid = api_server("A")
    main = int(on("A", f"docker inspect --format '{{{{.State.Pid}}}}' {NAME}").stdout)
    container = [p.pid for p in tree(parse_ps(on("A", PS).stdout), main)]
    assert len(container) >= 4            # the image's main process, the API server, the engine core, the worker
    on("A", f"kill -9 {pid}")
    for _ in range(100):   # the image's main process exits with it, and the container with every process in it
        if on("A", f"docker inspect --format '{{{{.State.Running}}}}' {NAME}").stdout.strip() == "false":
            break
        time.sleep(0.1)
    alive = set(parse_ps(on("A", PS).stdout))
    assert not alive & set(container), alive & set(container)
    r = run("health", "--json", inv=inv)
    head = verdicts(json.loads(r.stdout))["head"]
    assert r.returncode == 1 and head["state"] == "dead" and head["source"] == "container", head
    recovered(inv)


def test_the_watch_recovers_a_stalled_rank_alone_and_stops_at_the_budget_on_a_crash_loop(served):
    inv = served
    on("A", f"rm -f ~/.cache/railyard/serve/{NAME}/recoveries.json")   # the tests above spent restarts of their own
    watch = subprocess.Popen([sys.executable, "-m", "invoke", "health", "--watch", "5", "--recover", "--json",
                              "--set", "recover_restart_budget=2"], cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=_env(inv))
    try:
        docs = _Docs(watch)
        first = docs.next(120)
        assert first["ok"], first
        faults.fault("B", "engine-stall")
        rec = docs.until(lambda d: d["data"].get("path") == "group", 240)
        assert rec["ok"] and rec["data"]["done"], rec
        back = docs.until(lambda d: "ranks" in d["data"], 240)
        assert back["ok"], back                      # the next look: serving, no command typed
        assert chat(120) == "200"
        faults.fault("B", "engine-crash")            # dies on every start: the budget (2, one spent above) ends it
        assert watch.wait(600) == 1
        tail = watch.stderr.read() + docs.rest()
        assert "restart budget spent" in tail, tail[-3000:]
    finally:
        watch.kill()
        faults.heal()
    r = run("launch", "--recreate", inv=inv)                 # past the budget, a person relaunches
    assert r.returncode == 0, r.stdout[-3000:]


def _env(inv) -> dict:
    import os
    return {**os.environ, "RAILYARD_INVENTORY": str(inv)}


class _Docs:
    """The watch's --json: one document per line, read as they come."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self.seen: list[str] = []

    def next(self, timeout: float) -> dict:
        import select
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        assert ready, f"no document in {timeout} s: " + "".join(self.seen[-3:])
        line = self.proc.stdout.readline()
        assert line, "the watch ended: " + (self.proc.stderr.read() if self.proc.stderr else "")
        self.seen.append(line)
        return json.loads(line)

    def until(self, want, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            doc = self.next(max(1.0, deadline - time.monotonic()))
            if want(doc):
                return doc

    def rest(self) -> str:
        assert self.proc.stdout is not None
        return "".join(self.seen) + self.proc.stdout.read()
