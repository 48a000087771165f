"""`inv roll` for the replicas layout: one replica at a time, while the others serve (railyard.verbs.roll
stages the new revision or image first and records the roll).

For each replica, in order:
    1. out of routing (the router's drain file: LiteLLM's filter reads it on every request), then its
       requests in flight finished, within the drain timeout;
    2. its container removed and started on the new plan, gated as launch gates it (its startup line,
       its LMCache registration, /health);
    3. proven: one chat completion answered by that replica alone;
    4. back into routing, until the router's own health check lists it healthy.
The next replica only after that. A replica whose gate or proof fails is put back on the old plan (gated,
back into routing) and the roll stops there: the deployment serves what it served, and the record says
which replica stopped it.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from typing import Any

from ...apply.executor import Show, run_stages
from ...errors import LaunchError
from ...plan.spec import Endpoint, LaunchPlan, Service, Stage
from ...render.docker import run_line
from ...transport import cmd
from ...transport.http import request
from ...transport.runner import Runner
from .recover import _wait_idle, describe_holder, foreign_holders, gpu_state, router_healthy, set_drained, \
    short_of_memory

FREE_WAIT_S = 60.0   # a stopped replica's GPU memory is free again within this (LMCache lets it go)
PROBE = {"messages": [{"role": "user", "content": "Say the word ready."}], "max_tokens": 4, "temperature": 0}


def replicas(plan: LaunchPlan) -> list[Service]:
    return [s for s in plan.services() if s.role == "replica"]


def steps(plan: LaunchPlan) -> list[str]:
    out = []
    for svc in replicas(plan):
        out += [f"{svc.name}: out of routing, its requests in flight finished (within the drain timeout)",
                f"{svc.name}: removed and started on the new plan, gated (startup, LMCache, /health)",
                f"{svc.name}: one request answered by it alone",
                f"{svc.name}: back into routing, until the router's health check lists it healthy"]
    return out + ["a replica whose gate or request fails goes back on the old plan, and the roll stops there"]


def _start(plan: LaunchPlan, runner: Runner, svc: Service, util: float, timeout: float, show: Show | None) -> str:
    """svc's container replaced by plan's and gated; '' or why it did not pass."""
    s = runner.session(svc.host)
    # stopped (SIGTERM) before it is removed: a replica killed leaves its GPU memory mapped by LMCache
    # (railyard.layouts.replicas.recover's long path), one that exits lets LMCache release it
    s.run(cmd("docker", "stop", "--timeout", "60", svc.spec.name), timeout=120)
    s.run(cmd("docker", "rm", "-f", svc.spec.name), timeout=120)
    deadline = time.monotonic() + FREE_WAIT_S
    while short_of_memory(state := gpu_state(s), svc, util):   # LMCache lets the exited replica's memory go
        if time.monotonic() > deadline:
            held = "; ".join(describe_holder(h, state) for h in foreign_holders(state, svc))
            return (f"its GPUs are not free {FREE_WAIT_S:.0f} s after it stopped: "
                    + ", ".join(short_of_memory(state, svc, util)) + (f" (held by {held})" if held else ""))
        time.sleep(1)

    def start_one(one: Service) -> str | None:
        r = runner.session(one.host).run(run_line(plan, one), timeout=300)
        if r.error:
            return f"{r.error.kind}: {r.error.message}"
        return None if r.rc == 0 else ((r.stderr or r.stdout).strip().splitlines() or [f"exit {r.rc}"])[-1]

    rep = run_stages(replace(plan, stages=(Stage((svc,), wait="ready"),)), runner, timeout, show, start_one)
    return rep.failure or ""


def _answers(runner: Runner, plan: LaunchPlan, svc: Service) -> str:
    """'' when the replica alone answers a chat completion, else why not."""
    ep = Endpoint.of(svc, plan.endpoint.model)
    code, _, text, _ = request(runner.session(svc.host), ep, "/v1/chat/completions", PROBE | {"model": ep.model},
                               timeout=120)
    if code != 200:
        return f"HTTP {code}: {' '.join(text.split())[:160]}"
    try:
        json.loads(text)["choices"][0]["message"]
    except (ValueError, KeyError, IndexError, TypeError):
        return f"an answer without a message: {text[:160]}"
    return ""


def roll(inv: Any, runner: Runner, old: LaunchPlan, new: LaunchPlan, record: Any, timeout: float,
         drain_timeout: float, show: Show | None) -> None:
    s = runner.session(new.endpoint.host)
    model = new.endpoint.model
    v = inv.host(new.endpoint.host).vars
    router_wait = 2 * float(v["litellm_health_check_interval_s"]) + 30
    util = float(v["vllm_gpu_memory_utilization"])

    def back_in(svc: Service) -> None:
        set_drained(s, new, [])
        deadline = time.monotonic() + router_wait
        while True:
            seen, why = router_healthy(s, new)
            if svc.name in seen:
                return
            if time.monotonic() > deadline:
                raise LaunchError(f"{svc.name} serves, but the router's health check has not listed it healthy within "
                                  f"{router_wait:.0f} s" + (f" ({why})" if why else ""))
            time.sleep(1)

    def move(svc: Service, plan: LaunchPlan) -> str:
        """Out of routing, drained, started on plan and proven, back in: '' or why it is not on plan."""
        began = time.monotonic()
        set_drained(s, new, [svc.name])
        why = _wait_idle(s, svc, model, drain_timeout)
        record.did(f"{svc.name}: out of routing, no request in flight" + (f" ({why})" if why else ""), began)
        began = time.monotonic()
        failed = _start(plan, runner, plan.service(svc.name), util, timeout, show) or \
            _answers(runner, plan, plan.service(svc.name))
        if failed:
            return failed
        record.did(f"{svc.name}: started on the {'new' if plan is new else 'old'} plan, gated, and answered a request",
                   began)
        began = time.monotonic()
        back_in(svc)
        record.did(f"{svc.name}: back in routing (the router sees it healthy)", began)
        return ""

    rolled: list[Service] = []
    for svc in replicas(new):
        failed = move(svc, new)
        if not failed:
            rolled.append(svc)
            continue
        # the roll stops: this replica and those already rolled go back on the old plan, one at a time
        back = _start(old, runner, old.service(svc.name), util, timeout, show)
        if not back:
            back_in(svc)
        undone = [x.name for x in rolled if not move(x, old)]
        raise LaunchError(f"{svc.name} on the new plan: {failed}; the roll stopped there; " + (
            f"{svc.name} is back on the old plan and in routing" if not back else
            f"{svc.name} did not come back on the old plan either ({back}): it stays out of routing")
            + (f"; {', '.join(x.name for x in rolled)} went back to the old plan" if rolled and not undone else "")
            + (f"; {', '.join(undone)} did not go back to the old plan" if undone else ""))
