"""Alive but hung: an engine whose /health answers 200 while it makes no progress. `inv health`'s probe
request that gets no token within `vllm_hung_after_s` (20 s) is judged on the engine's own token counters, read from
/metrics before the probe and after its limit: unchanged is `hung` (named, with the values and times),
moved is a busy engine asked again for the rest of the old limit; unread is no verdict of hung. A rank
whose serving process is stopped (state T) is named hung by `service_health` (its state read here from
real processes); `inv health --watch` prints its first look whole, then a line per changed check. These
tests drive the probes through a scripted session; the lab's `engine-hang` fault makes the same on the real vLLM
(test_lab_real_stations.py) and the stand-in (test_lab_verify.py)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time

from railyard.checks.health import Probe, RankHealth
from railyard.engines import by_name
from railyard.verbs import verify
from railyard.inventory import Host
from railyard.facts.host import PROC_STATES
from railyard.plan.spec import Endpoint
from railyard.testing import FakeSession

VLLM = by_name("vllm")

EP = Endpoint("head", "A", "127.0.0.1", 8000, "", "railyard-lab/tiny-qwen3")
ANSWER = ('{"choices": [{"finish_reason": "length", "message": {"content": "Ready ready ready"}}], '
          '"usage": {"completion_tokens": 16}}')


def exposition(prompt: float, generation: float) -> str:
    """The two counters as vLLM's /metrics labels them (one engine)."""
    labels = '{engine="0",model_name="railyard-lab/tiny-qwen3"}'
    return (f"# HELP vllm:prompt_tokens_total Number of prefill tokens processed.\n"
            f"# TYPE vllm:prompt_tokens_total counter\nvllm:prompt_tokens_total{labels} {prompt}\n"
            f"# HELP vllm:generation_tokens_total Number of generation tokens processed.\n"
            f"# TYPE vllm:generation_tokens_total counter\nvllm:generation_tokens_total{labels} {generation}\n")


def session(metrics: list[str], chats: list[tuple[int, str]], health: int = 200, hosts_vars=None) -> FakeSession:
    """curl's output as request() reads it: the body, then `@@CODE SECONDS`; 000 when no answer came."""
    reads = iter(metrics)
    answers = iter(chats)

    def curl(body: str, code: int, secs: float = 0.01):
        return (28 if code == 0 else 0, f"{body}\n@@{code:03d} {secs} ",
                "curl: (28) Operation timed out after 20001 milliseconds with 0 bytes received" if code == 0 else "")

    s = FakeSession(Host("A", 0, "198.18.0.11", 22, "root", "ssh", "", {}, hosts_vars or {}))
    s.on(re.compile(r"/metrics$"), lambda _: curl(next(reads), 200))
    s.on(re.compile(r"/health$"), lambda _: curl("", health))
    s.on(re.compile(r"/v1/models$"), lambda _: curl('{"data": [{"id": "railyard-lab/tiny-qwen3"}]}', 200))
    s.on(re.compile(r"/v1/chat/completions$"), lambda _: curl(*next(answers)[::-1], 20.0))
    return s


def by_name(probes):
    return {p.name: p for p in probes}


def test_no_token_and_unmoved_counters_while_health_answers_is_hung_with_the_evidence():
    s = session([exposition(812, 4096), exposition(812, 4096), exposition(812, 4096)], [(0, "")])
    probes = by_name(verify._api_probes(s, EP, VLLM)[0])
    assert probes["/health"].ok
    hung = probes["progress"]
    assert not hung.ok
    assert hung.detail.startswith("hung: no token for the probe in 20 s and its token counters did not move "
                                  "(prompt_tokens_total 812, generation_tokens_total 4,096 at ")
    assert hung.detail.endswith("while /health answers 200")
    assert not probes["chat completion"].ok
    assert sum("/v1/chat/completions" in c for c in s.calls) == 1        # a hung engine is not asked again


def test_no_token_but_moving_counters_is_busy_and_asked_again_for_the_rest_of_the_limit():
    s = session([exposition(812, 4096), exposition(9000, 5120), exposition(9100, 5136)], [(0, ""), (200, ANSWER)])
    probes = by_name(verify._api_probes(s, EP, VLLM)[0])
    assert "progress" not in probes and probes["chat completion"].ok
    chats = [c for c in s.calls if "/v1/chat/completions" in c]
    assert [re.search(r"--max-time (\d+)", c).group(1) for c in chats] == ["20", "100"]


def test_no_token_from_an_engine_whose_counters_are_still_zero_is_asked_again_not_hung():
    """A fresh engine's first request: its first step not done when the probe's 20 s ran out (the real CPU
    build's, TP=2 on two busy cores, in the lab's real stage), so both counters still read 0: no baseline,
    no verdict of hung; it is asked again for the rest of the limit, and its answer passes."""
    s = session([exposition(0, 0), exposition(0, 0), exposition(7, 16)], [(0, ""), (200, ANSWER)])
    probes = by_name(verify._api_probes(s, EP, VLLM)[0])
    assert "progress" not in probes and probes["chat completion"].ok
    assert sum("/v1/chat/completions" in c for c in s.calls) == 2


def test_vllm_hung_after_s_sets_how_long_the_probe_waits_before_the_counters_are_read_again():
    s = session([exposition(812, 4096), exposition(9000, 5120), exposition(9100, 5136)], [(0, ""), (200, ANSWER)],
                hosts_vars={"vllm_hung_after_s": 5})
    verify._api_probes(s, EP, VLLM)
    chats = [c for c in s.calls if "/v1/chat/completions" in c]
    assert [re.search(r"--max-time (\d+)", c).group(1) for c in chats] == ["5", "115"]   # the two minutes kept


def test_counters_that_cannot_be_read_give_no_hung_verdict():
    s = session([], [(0, "")])
    s.rules.insert(0, (re.compile(r"/metrics$"), _metrics_then_error()))
    probes = by_name(verify._api_probes(s, EP, VLLM)[0])
    assert not probes["progress"].ok and "hung" not in probes["progress"].detail
    assert probes["progress"].detail == "its token counters could not be read twice from /metrics"


def _metrics_then_error():
    calls = iter([(0, exposition(812, 4096) + "\n@@200 0.01 "), (7, "\n@@000 0.0 ", "curl: (7) Failed to connect"),
                  (7, "\n@@000 0.0 ", "curl: (7) Failed to connect")])
    return lambda _: next(calls)


def test_the_judge_needs_both_reads_the_same_counters_and_health_for_hung():
    before = {"vllm:prompt_tokens_total": 10.0, "vllm:generation_tokens_total": 20.0}
    reads = (time.mktime((2026, 12, 5, 8, 1, 2, 0, 0, -1)), time.mktime((2026, 12, 5, 8, 1, 24, 0, 0, -1)))
    assert verify.judge_progress(before, dict(before), reads, 20.0, True)[0] == "hung"
    assert verify.judge_progress(before, dict(before), reads, 20.0, False)[0] == "unknown"     # down, not hung
    assert verify.judge_progress(before, None, reads, 20.0, True)[0] == "unknown"
    zero = dict.fromkeys(before, 0.0)
    assert verify.judge_progress(zero, dict(zero), reads, 20.0, True) == (
        "cold", "no answer in 20 s from an engine that has made no token since it started (prompt_tokens_total 0, "
                "generation_tokens_total 0 at 08:01:02 and 08:01:24): its first step may still be running")
    busy = verify.judge_progress(before, {**before, "vllm:generation_tokens_total": 36.0}, reads, 20.0, True)
    assert busy == ("busy", "no answer in 20 s, but it made progress between 08:01:02 and 08:01:24 "
                            "(generation_tokens_total +16)")


class _Enough(Exception):
    pass


def test_watch_prints_the_first_look_whole_then_a_stamped_line_per_changed_check(monkeypatch, capsys):
    from railyard import cli
    from railyard.cli import verify as health_cli
    from railyard.verbs.verify import health_report

    def look(b_hung: bool):
        b = RankHealth("B", 1, "worker-1", "running", 60.0, 1000, "VLLM::Worker_TP1", not b_hung,
                              ["hung: VLLM::Worker_TP1 (pid 4242) is stopped (state T in /proc/4242/stat)"] if b_hung else [])
        a = RankHealth("A", 0, "head", "running", 60.0, 1000, "VLLM::Worker_TP0", True, [])
        probes = [Probe("/health", True, "HTTP 200", 2.0)]
        return None, [a, b], probes, {}, health_report([a, b], probes, {}, "A")

    looks = iter([look(False), look(False), look(True), look(True), look(False)])
    monkeypatch.setattr(cli, "load_inventory", lambda *a: None)
    monkeypatch.setattr(health_cli, "_health_look", lambda inv: next(looks))
    monkeypatch.setattr(health_cli, "_health_view", lambda *a: print("THE WHOLE VIEW"))
    rounds = iter(range(4))

    def sleep(_seconds):  # the fifth look's sleep ends the watch, as Ctrl-C would
        if next(rounds, None) is None:
            raise _Enough
    monkeypatch.setattr(time, "sleep", sleep)
    try:
        health_cli.health(watch=1)
    except _Enough:
        pass
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "THE WHOLE VIEW" and len(out) == 3, out            # rounds 2 and 4 changed nothing
    assert re.fullmatch(r"\d\d:\d\d:\d\d B service: pass -> fail: worker-1: hung: VLLM::Worker_TP1 \(pid 4242\) "
                        r"is stopped \(state T in /proc/4242/stat\)", out[1]), out[1]
    assert re.fullmatch(r"\d\d:\d\d:\d\d B service: fail -> pass: worker-1: running, VLLM::Worker_TP1 on its GPU",
                        out[2]), out[2]


def test_the_state_of_each_gpu_process_is_read_after_its_name_whatever_the_name_holds(tmp_path):
    odd = tmp_path / "VLLM) Work(er"          # a process name with a space and parentheses, as /proc shows it
    shutil.copy(shutil.which("sleep"), odd)
    stopped, running = subprocess.Popen([str(odd), "30"]), subprocess.Popen(["sleep", "30"])
    try:
        os.kill(stopped.pid, signal.SIGSTOP)
        line = PROC_STATES.replace("$(nvidia-smi --query-compute-apps=pid --format=csv,noheader)",
                                   f"{stopped.pid} {running.pid} 999999999")      # the last one is gone
        out = subprocess.run(["bash", "-c", line], capture_output=True, text=True, timeout=30).stdout
        assert re.fullmatch(rf"{stopped.pid} T\n{running.pid} [RS]\n", out), out    # R while it is still starting
    finally:
        for p in (stopped, running):
            p.kill()
            p.wait()

