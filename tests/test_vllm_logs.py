"""vLLM's own log lines, read on real captures (origins: tests/fixtures/real/vllm-cpu/ORIGINS.md and
vllm-gpu/ORIGINS.md): each engine core's KV cache line from both builds, and the bring-up milestones
with docker's timestamps against the container's StartedAt."""

from __future__ import annotations

import json

import pytest

from railyard.apply import executor as ops
from railyard.apply import timeline as T
from railyard.plan.spec import Gate
from railyard.engines import MILESTONES, by_name
from railyard.engines.vllm import KV_LINE, engine_kv, milestone_of, parse_kv_cache

from .conftest import real
from .test_plan import hgx_plan, station_plan

VLLM = by_name("vllm")


def started(name: str) -> str:
    return json.loads(real(f"vllm-cpu/{name}/state.json"))["StartedAt"]


# ---------------------------------------------------------------- the KV cache line, both builds

def test_the_cpu_builds_kv_line_is_read_like_the_gpu_builds():
    assert parse_kv_cache(real("vllm-cpu/timed-tp1/logs-t.txt")) == {0: 1_048_576}
    assert parse_kv_cache(real("vllm-cpu/tp2.log")) == {0: 2_097_152}  # TP=2: each rank holds one KV head
    e = engine_kv(real("vllm-cpu/tp2.log"))[0]
    assert e.device == "CPU" and "CPU KV cache size: 2,097,152 tokens" in e.line
    assert parse_kv_cache(real("vllm-gpu/pr29335-engine-dp0-excerpt.log")) == {0: 1_587_648}
    assert engine_kv(real("vllm-gpu/pr29335-engine-dp0-excerpt.log"))[0].device == "GPU"
    assert parse_kv_cache(real("vllm-gpu/pr20707-enginecore0-excerpt.log")) == {0: 922_496}  # older EngineCore_0
    assert parse_kv_cache(real("vllm-gpu/runai67-v1-no-process-prefix-excerpt.log")) == {0: 1_131_008}


def test_every_dp_engine_core_of_the_cpu_build_is_its_own_rank():
    assert parse_kv_cache(real("vllm-cpu/moe2.log")) == {0: 1_048_576, 1: 1_048_576}


def test_the_dp_gate_holds_on_the_cpu_builds_lines_as_grep_keeps_them():
    gate = Gate("kv_engines", pattern=KV_LINE, count=2)
    kept = [ln for ln in real("vllm-cpu/moe2.log").splitlines() if KV_LINE in ln]  # what `grep -F KV_LINE` keeps
    assert len(kept) == 2 and ops._holds(gate, kept, VLLM)
    assert not ops._holds(gate, kept[:1], VLLM)
    gpu = [ln for ln in real("vllm-gpu/pr29335-engine-dp0-excerpt.log").splitlines() if KV_LINE in ln]
    assert ops._holds(Gate("kv_engines", pattern=KV_LINE, count=1), gpu, VLLM)


def test_the_launch_gate_greps_a_pattern_both_builds_print():
    _, plan = hgx_plan("serve_layout=dp_ep")
    gate = next(g for g in plan.services()[0].ready if g.kind == "kv_engines")
    assert gate.pattern == "KV cache size:"
    assert gate.pattern in "CPU KV cache size: 1,048,576 tokens" and gate.pattern in "GPU KV cache size: 1 tokens"


# ---------------------------------------------------------------- milestones

def marked(text: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in text.splitlines():
        m = milestone_of(line)
        if m:
            out[m] = out.get(m, 0) + 1
    return out


def test_each_milestone_line_of_a_cpu_engine():
    got = marked(real("vllm-cpu/timed-tp1/logs-t.txt"))
    # the KV cache: the worker's `Explicitly set (1.0/12.59) GiB for KV cache` and the engine's size line
    assert got == {"weights_loaded": 1, "kv_cache_allocated": 2, "engine_initialised": 1, "api_ready": 1}


def test_a_headless_tp_rank_shows_its_weights_and_kv_memory_but_no_engine_or_api():
    assert marked(real("vllm-cpu/tpB.log")) == {"weights_loaded": 1, "kv_cache_allocated": 1}
    assert marked(real("vllm-cpu/tpA.log")) == {"weights_loaded": 1, "kv_cache_allocated": 2,
                                                "engine_initialised": 1, "api_ready": 1}


def test_two_dp_engines_and_two_api_servers_each_mark_their_milestones():
    assert marked(real("vllm-cpu/moe2.log")) == {"weights_loaded": 2, "kv_cache_allocated": 4,
                                                 "engine_initialised": 2, "api_ready": 2}


def test_the_gpu_builds_lines_mark_the_same_milestones():
    assert marked(real("vllm-gpu/pr29335-engine-dp0-excerpt.log")) == {"weights_loaded": 1, "kv_cache_allocated": 2}
    assert marked(real("vllm-gpu/pr20707-enginecore0-excerpt.log")) == {"kv_cache_allocated": 2,
                                                                        "engine_initialised": 1}
    assert marked(real("vllm-gpu/pr12569-v1-loading-model-weights-excerpt.log")) == {"weights_loaded": 1}
    assert marked(real("vllm-gpu/runai67-v1-no-process-prefix-excerpt.log")) == {"kv_cache_allocated": 1,
                                                                                 "engine_initialised": 1}


def test_lines_that_only_look_alike_mark_nothing():
    for line in ("(EngineCore pid=1) INFO 12-02 03:03:14 [utils.py:347] Using LBHNC KV cache layout.",
                 "(Worker pid=4555) INFO 12-02 03:03:13 [cpu_model_runner.py:68] Starting to load model /tmp/exp/tiny...",
                 "INFO:     Waiting for application startup.",
                 "(APIServer pid=1) INFO 12-02 03:03:16 [entry.py:140] Starting vLLM server on http://127.0.0.1:18000"):
        assert milestone_of(line) is None, line


# ---------------------------------------------------------------- docker's time against StartedAt

def test_the_timeline_of_a_real_cpu_engine_from_dockers_timestamps():
    secs, lines = T.timeline_of(real("vllm-cpu/timed-tp1/logs-t.txt"), started("timed-tp1"), MILESTONES, VLLM)
    assert secs == {"weights_loaded": 78.19, "kv_cache_allocated": 79.41, "engine_initialised": 82.21, "api_ready": 84.07}
    assert lines["kv_cache_allocated"].endswith("CPU KV cache size: 1,048,576 tokens, Maximum concurrency for 2,048 "
                                                "tokens per request: 512.00x")
    assert lines["api_ready"] == "INFO:     Application startup complete."
    secs, _ = T.timeline_of(real("vllm-cpu/timed-tp2/logs-t.txt"), started("timed-tp2"), MILESTONES, VLLM)
    assert secs == {"weights_loaded": 40.75, "kv_cache_allocated": 42.08, "engine_initialised": 44.63, "api_ready": 46.43}


def test_an_earlier_run_of_the_container_in_the_same_log_is_not_this_run():
    earlier, later = real("vllm-cpu/timed-tp1/logs-t.txt"), real("vllm-cpu/timed-tp2/logs-t.txt")
    # `docker start` appends to the log: the earlier run's lines stay, before this run's StartedAt
    cut = later[:later.index("Application startup complete.")].rsplit("\n", 1)[0] + "\n"
    secs, _ = T.timeline_of(earlier + cut, started("timed-tp2"), MILESTONES, VLLM)
    assert secs["api_ready"] is None  # the earlier run's ready line is not this run's
    assert secs["engine_initialised"] == 44.63


def test_a_milestone_not_in_the_log_is_not_seen_never_guessed():
    log = real("vllm-cpu/timed-tp1/logs-t.txt")
    cut = log[:log.index("init engine")].rsplit("\n", 1)[0]
    secs, lines = T.timeline_of(cut, started("timed-tp1"), MILESTONES, VLLM)
    assert secs["engine_initialised"] is None and secs["api_ready"] is None and "api_ready" not in lines
    # lines without docker's time (a log read without --timestamps) give no time at all
    secs, _ = T.timeline_of(real("vllm-cpu/tpA.log"), "2026-12-02T03:06:00Z", MILESTONES, VLLM)
    assert secs == {m: None for m in MILESTONES}
    secs, _ = T.timeline_of(log, "", MILESTONES, VLLM)  # no StartedAt: nothing to measure from
    assert set(secs.values()) == {None}


@pytest.mark.parametrize("stamp, want", [
    ("2026-12-02T03:43:23.570115758Z", 1796183003.570115758),   # docker logs -t: nine digits
    ("2026-12-02T03:43:23.5701Z", 1796183003.5701),             # Go's RFC3339Nano: zeros trimmed (StartedAt)
    ("2026-12-02T03:43:23Z", 1796183003.0),
    ("2026-12-02T04:43:23.5+01:00", 1796183003.5),
])
def test_rfc3339_stamps(stamp, want):
    assert T.parse_stamp(stamp) == pytest.approx(want, abs=1e-6)


def test_not_a_stamp():
    assert T.parse_stamp("(APIServer") is None and T.parse_stamp("0001-01-01") is None


def test_which_milestones_a_rank_can_show():
    _, plan, _ = station_plan()
    assert T.applicable(plan.service("head")) == MILESTONES
    assert T.applicable(plan.service("worker-1")) == ("weights_loaded", "kv_cache_allocated")  # headless TP rank
    _, plan = hgx_plan("serve_layout=dp_ep")
    assert T.applicable(plan.services()[0]) == MILESTONES
