"""dp_ep on the real vLLM (its CPU build): DP=2 with expert parallel over the lab's tiny Qwen3-MoE
(8 experts, 4 per rank), on two GPUs of an hgx8 lab host. This is as far as the CPU build goes: both
engine cores start, each prints its KV cache, /health answers, so railyard's launch gates pass; the
first request then kills the engine, because experts parallel across DP ranks dispatches tokens with
an all-gather (all2all backend allgather_reducescatter) that vLLM's CPU communicator does not have
(`NotImplementedError` in `all_gatherv`). `inv health` is what catches it. DP attention and EP
themselves are proven on the stand-in (test_lab_layouts.py)."""

from __future__ import annotations

import json
import time

import pytest

from .conftest import REAL_LIMIT_S, inv_cmd, on, real_lab

# bin/test's real stage; the module's bring-up counts in its first test's limit (launch's own: 420 s)
pytestmark = [pytest.mark.lab, pytest.mark.real, pytest.mark.timeout(REAL_LIMIT_S)]


def run(*args, inv, timeout=420):
    return inv_cmd(*args, env={"RAILYARD_INVENTORY": str(inv)}, timeout=timeout)


def test_both_dp_engines_start_and_the_first_request_kills_them_as_health_shows():
    with real_lab("dp_ep") as inv:
        assert run("env", inv=inv).returncode == 0
        r = run("launch", inv=inv)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        assert "2 engines logged their KV cache" in r.stdout
        h = run("health", "--json", inv=inv)
        doc = json.loads(h.stdout)
        assert h.returncode == 1 and not doc["ok"]
        chat = next(p for p in doc["data"]["probes"] if p["name"] == "chat completion")
        # the first request kills the engines (health's own, or the hung verdict's probes sent beside it): HTTP 500,
        # or no answer from the API server that its container's teardown took down with them
        assert not chat["ok"] and chat["detail"].startswith(("HTTP 500", "no answer")), chat
        logs = run("logs", "--lines", "3000", inv=inv).stdout
        assert "Expert parallelism is enabled" in logs and "all_gatherv" in logs and "NotImplementedError" in logs
        # the API server goes down with its engine cores a few seconds after the request (7 s here): the
        # container exits with 1, and health names it
        deadline = time.monotonic() + 90
        while "Exited" not in on("A", "docker ps -a --format '{{.Status}}'").stdout and time.monotonic() < deadline:
            time.sleep(2)
        again = json.loads(run("health", "--json", inv=inv).stdout)
        engine = again["data"]["ranks"][0]
        assert not engine["ok"] and "container vllm-dp-ep is exited" in engine["reasons"][0]
