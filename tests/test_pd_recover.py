"""`inv recover` under pd, its decision on every service's health (pure): one instance alone while the others
and the proxy serve on, the proxy alone, the pool with none left first, and the group path where nothing
would serve on or an instance spans hosts. The instance path against the real vllm-router and stand-in
engines: test_lab_pd.py."""

from __future__ import annotations

import pytest

from railyard.checks.probes import RankHealth
from railyard.errors import UsageError
from railyard.layouts.pd import recover as R

from .test_pd_plan import pd_plan


def healths(plan, **bad):
    """Every service running and healthy, but those named: name=(state, reason)."""
    out = []
    for svc in plan.services():
        state, reason = bad.get(svc.name.replace("-", "_"), ("running", ""))
        out.append(RankHealth(svc.host, svc.rank, svc.name, state, 60.0, None, None, not reason,
                              [reason] if reason else []))
    return out


def reached(plan, *down):
    return {h: h not in down for h in plan.report_hosts()}


EXITED = ("exited", "container vllm-pd-x is exited")
HUNG = ("running", "hung: VLLM::Worker (pid 4242) is stopped (state T in /proc/4242/stat)")


def test_a_dead_prefill_instance_comes_back_alone_taken_out_and_back_by_the_proxys_health_check():
    _, plan = pd_plan()
    rec = R.decide(plan, healths(plan, prefill_2=EXITED), reached(plan), None)
    assert rec.path == "instance" and rec.services == ["prefill-2"] and rec.hung == []
    assert rec.steps == ["wait until the proxy's health check lists prefill-2 unhealthy",
                         "start prefill-2 alone and gate it (startup, KV cache, /health)",
                         "wait until the proxy's health check lists prefill-2 healthy",
                         "prove it: one request through prefill-2 and a serving instance of the other pool, with a "
                         "NIXL transfer"]
    assert rec.why == ["prefill-2 on P2: container vllm-pd-x is exited", "the other instances and the proxy serve on"]


def test_a_hung_instance_is_killed_first():
    _, plan = pd_plan()
    rec = R.decide(plan, healths(plan, prefill_1=HUNG), reached(plan), None)
    assert rec.hung == ["prefill-1"] and rec.steps[0] == ("kill prefill-1 (hung: it never finishes what it waits in; a stopped process "
                                                            "never sees SIGTERM)")


def test_where_a_pool_has_none_left_its_instance_comes_back_first_to_prove_the_other():
    _, plan = pd_plan()
    rec = R.decide(plan, healths(plan, prefill_0=EXITED, decode_0=EXITED), reached(plan), None)
    assert rec.path == "instance" and rec.services == ["decode-0", "prefill-0"]


def test_nothing_serving_on_a_dead_proxy_with_an_instance_or_a_silent_host_is_the_group_path():
    _, plan = pd_plan()
    every = {s.name.replace("-", "_"): EXITED for s in plan.services() if s.role in ("prefill", "decode")}
    assert R.decide(plan, healths(plan, **every), reached(plan), None) is None
    assert R.decide(plan, healths(plan, proxy=EXITED, prefill_1=EXITED), reached(plan), None) is None
    assert R.decide(plan, healths(plan), reached(plan, "P2"), None) is None


def test_the_proxy_alone_is_restarted_alone():
    _, plan = pd_plan()
    rec = R.decide(plan, healths(plan, proxy=EXITED), reached(plan), None)
    assert rec.path == "instance" and rec.services == ["proxy"]
    assert rec.steps == ["start proxy alone and gate it (/health); the instances serve on"]


def test_a_named_instance_is_a_planned_restart_and_a_wrong_name_is_a_usage_error():
    _, plan = pd_plan()
    rec = R.decide(plan, healths(plan), reached(plan), "prefill-3")
    assert rec.services == ["prefill-3"] and rec.steps[0] == "stop prefill-3"
    assert rec.why == ["prefill-3 runs: a planned restart", "the other instances and the proxy serve on"]
    assert R.decide(plan, healths(plan), reached(plan), None).path == "none"
    with pytest.raises(UsageError, match=r"--replica prefill-9: no such instance \(pd: prefill-0, "):
        R.decide(plan, healths(plan), reached(plan), "prefill-9")


def test_the_proxys_list_names_a_data_parallel_instance_once_per_rank():
    """vllm-router 0.1.17's GET /workers in the lab: a DP4 prefill instance is four entries, `URL@0` to `URL@3`
    (a decode's URL is a prefix of none of them)."""
    _, plan = pd_plan()
    p1, d0 = plan.service("prefill-1"), plan.service("decode-0")
    url = R.url_of(p1)
    seen = {f"{url}@{i}": i != 2 for i in range(4)} | {f"{R.url_of(d0)}@0": True}
    assert R.ranks_of(seen, p1) == [True, True, False, True] and R.ranks_of(seen, d0) == [True]
    assert R.ranks_of({url + "0@0": True}, p1) == []
