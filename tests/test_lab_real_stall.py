"""engine-stall on the real vLLM (its CPU build, the two stations, TP=2 over the lab rail): the signal
handler of the engines' sitecustomize (sim/engine_site.py) parks B's real `VLLM::Worker_TP1`; the process
stays in state S, py-spy shows its main thread in the lab's function, the head's real engine waits for it:
/health answers 200, a request gets no answer, the token counters stand still."""

from __future__ import annotations

import json
import re
import subprocess
import time

import pytest

from railyard_lab import faults

from .conftest import REAL_LIMIT_S, home, inv_cmd, on, real_lab

pytestmark = [pytest.mark.lab, pytest.mark.real, pytest.mark.timeout(REAL_LIMIT_S)]
TOKENS = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total")


def _key() -> str:
    return (home("A") / ".config" / "railyard" / "vllm-api-key").read_text().strip()


def chat(t: int) -> str:
    body = json.dumps({"model": "railyard-lab/tiny-qwen3", "max_tokens": 4, "temperature": 0,
                       "messages": [{"role": "user", "content": "hello there"}]})
    return on("A", f"curl -s -m {t} -o /dev/null -w '%{{http_code}}' -H 'Authorization: Bearer {_key()}' "
                   f"-H 'Content-Type: application/json' -d '{body}' http://127.0.0.1:8000/v1/chat/completions").stdout


def counters() -> dict[str, float]:
    out = {}
    for ln in on("A", "curl -s http://127.0.0.1:8000/metrics").stdout.splitlines():
        m = re.match(r'^(vllm:\w+)\{[^}]*\} (\S+)$', ln)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def test_a_real_worker_parked_by_engine_stall_runs_on_while_its_group_waits():
    with real_lab("multinode_tp") as inv:
        env = {"RAILYARD_INVENTORY": str(inv)}
        assert inv_cmd("env", env=env).returncode == 0
        r = inv_cmd("launch", env=env, timeout=420)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        assert chat(120) == "200"                                   # the first request compiles: warm
        out = faults.fault("B", "engine-stall")
        assert re.fullmatch(r"B: engine-stall VLLM::Worker_TP1 \(pid \d+\)", out), out
        pid = int(re.search(r"pid (\d+)", out).group(1))
        time.sleep(2)
        before = counters()
        assert chat(20) == "000"                                    # accepted, never answered
        after = counters()
        assert all(after[k] == before[k] for k in TOKENS), (before, after)
        state = open(f"/proc/{pid}/stat").read().rsplit(") ", 1)[1][0]
        assert state in "SR", state                                 # never T
        dump = subprocess.run(["py-spy", "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=60)
        assert "lab_fault_engine_stall" in dump.stdout, dump.stdout + dump.stderr
        assert on("A", "curl -s -o /dev/null -w '%{http_code}' http://127.0.0.1:8000/health").stdout == "200"
        print("metrics while stalled:", {k: v for k, v in after.items() if "requests" in k or "tokens" in k})
        print("py-spy of the stalled worker:\n" + dump.stdout)
        # the real engine's own words after its 60 s wait (vllm/distributed/device_communicators/shm_broadcast.py)
        time.sleep(70)
        logs = {h: on(h, "docker logs glm53-full 2>&1 | tail -40").stdout for h in ("A", "B")}
        print("logs after 70 s:\n" + "\n".join(f"--- {h}\n{t}" for h, t in logs.items()))
        print("metrics after 70 s:", {k: v for k, v in counters().items() if "requests" in k or "tokens" in k})
        faults.heal()
