"""`inv recover` for the pd layout: one instance alone, while the others and the proxy serve on.

A prefill or decode instance on one host that is dead (its container not running, or no serving process
on its GPUs) or hung (a serving process stopped), or the one `--replica NAME` names (a planned restart):

    1. out of the proxy: vllm-router asks every instance's /health each pd_proxy_health_interval_s and
       takes one out after pd_proxy_health_failures failures. A hung instance still answers /health, so
       it is killed first (a stopped process never sees SIGTERM); a running one is stopped. recover waits
       until the proxy's own list (GET /workers) shows it unhealthy. vllm-router 0.1.17 can remove a PD
       worker over HTTP (POST /remove_worker) but adds none back ("PD router requires specific
       add_prefill_server or add_decode_server methods", seen in the lab): removing one would take a proxy
       restart to undo, so railyard leaves the proxy's list alone and lets its health check do both.
    2. started alone and gated as launch gates it (its startup line, the KV cache of every DP rank, /health);
    3. back in the proxy: until its /workers shows the instance healthy;
    4. its proof: one request through this instance and a healthy one of the other pool, as the proxy sends
       it (railyard.layouts.pd.canary.Pair), with a NIXL transfer counted on the decode side.

The proxy alone, dead: restarted alone and gated on /health. Anything else (a rank of an instance over
several hosts, every instance of both pools, the proxy with an instance, a host that did not answer)
takes the group path. An instance is proven with a serving one of the other pool: where one pool has
none left, its instances come back first.
"""

from __future__ import annotations

import json
import secrets
import time

from ...apply.executor import Show
from ...apply.recovery import Recovery, start_alone, take_down
from ...checks.hang import Verdict, fold
from ...checks.probes import RankHealth
from ...errors import LaunchError, UsageError
from ...facts.docker import inspect
from ...inventory import Inventory
from ...plan.spec import Endpoint, LaunchPlan, Service
from ...transport import Session
from ...transport.http import request
from ...transport.runner import Runner
from . import POOLS, serving, url_of
from .canary import Pair
from .proof import proof_prompt, xfer_count

TITLE = "instance path: restart it alone, the proxy's health check taking it out and back"


def decide(plan: LaunchPlan, healths: list[RankHealth], reached: dict[str, bool],
           target: str | None) -> Recovery | None:
    """What recover does, from every service's health; None: the group path. Pure."""
    down = [h for h in plan.report_hosts() if not reached.get(h, True)]
    if down:
        return None      # the group path says which host did not answer
    by_name = {h.service: h for h in healths}
    if target is not None:
        names = [s.name for s in plan.services()]
        if target not in names:
            raise UsageError(f"--replica {target}: no such instance (pd: {', '.join(names)})")
        svc = plan.service(target)
        if svc.group:
            raise UsageError(f"--replica {target}: a rank of {svc.group}, an instance over several hosts: its ranks "
                             "restart together with the group (inv recover without --replica)")
        bad = [by_name[target]] if target in by_name else []
        names_bad = [target]
    else:
        bad = [h for h in healths if not h.ok]
        names_bad = [h.service for h in bad]
    if not names_bad:
        return Recovery("none", [], [f"every instance and the proxy run ({', '.join(by_name)})"], [])
    svcs = [plan.service(n) for n in names_bad]
    proxy = plan.endpoint.service
    if any(s.group for s in svcs) or (proxy in names_bad and len(names_bad) > 1):
        return None
    left = {pool: [s.name for s in serving(plan) if s.role == pool and s.name not in names_bad] for pool in POOLS}
    if proxy not in names_bad and not any(left.values()):
        return None      # no instance serves on: the whole deployment restarts
    # an instance is proven with a serving one of the other pool: the pool with fewer left comes back first
    svcs.sort(key=lambda s: len(left.get(s.role, [])))
    names_bad = [s.name for s in svcs]
    hung = [h.service for h in bad if any(r.startswith("hung:") for r in h.reasons)]
    why = [f"{h.service} on {h.host}: {'; '.join(h.reasons)}" for h in bad if not h.ok]
    if target is not None and not why:
        why = [f"{target} runs: a planned restart"]
    if names_bad == [proxy]:
        running = proxy in by_name and by_name[proxy].state == "running"
        return Recovery("instance", [proxy], why, ([f"stop {proxy}"] if running else [])
                        + [f"start {proxy} alone and gate it (/health); the instances serve on"], title=TITLE)
    steps = []
    for s in svcs:
        running = s.name in by_name and by_name[s.name].state == "running"
        steps += ([f"kill {s.name} (hung: it never finishes what it waits in; a stopped process never sees SIGTERM)"]
                  if s.name in hung else
                  [f"stop {s.name}"] if running else [])
        steps += [f"wait until the proxy's health check lists {s.name} unhealthy",
                  f"start {s.name} alone and gate it (startup, KV cache, /health)",
                  f"wait until the proxy's health check lists {s.name} healthy",
                  f"prove it: one request through {s.name} and a serving instance of the other pool, with a NIXL "
                  "transfer"]
    why.append("the other instances and the proxy serve on")
    return Recovery("instance", names_bad, why, steps, hung=hung, title=TITLE)


def survey(plan: LaunchPlan, runner: Runner, target: str | None, verdicts: list[Verdict]) -> Recovery | None:
    """Every service's health with the shared hung verdict folded in (railyard.checks.hang); then decide."""
    from ...verbs.health import service_health
    got = runner.each(lambda s: [service_health(s, svc) for svc in plan.on_host(s.host.name)])
    healths = fold([h for rows in got.ok.values() for h in rows], verdicts)
    return decide(plan, healths, {h: h in got.ok for h in plan.report_hosts()}, target)


def proxy_workers(s: Session, plan: LaunchPlan) -> tuple[dict[str, bool], str]:
    """The proxy's own view, GET /workers: {instance url: healthy}, or why it is not known."""
    code, _, text, _ = request(s, plan.endpoint, "/workers", timeout=10)
    try:
        if code == 200:
            return {str(w["url"]): bool(w["is_healthy"]) for w in json.loads(text)["workers"]}, ""
    except (ValueError, KeyError, TypeError):
        pass
    return {}, f"HTTP {code}: {text.strip()[:120]}" if code else f"no answer: {text.strip()[:120]}"


def ranks_of(seen: dict[str, bool], svc: Service) -> list[bool]:
    """The proxy's entries of one instance: its URL, or one per DP rank (`URL@rank`: vllm-router 0.1.17 asks a
    data-parallel instance its size and routes to each rank, as the lab's DP4 instances showed)."""
    url = url_of(svc)
    return [ok for name, ok in seen.items() if name == url or name.startswith(url + "@")]


def wait_proxy(s: Session, plan: LaunchPlan, svc: Service, healthy: bool, wait: float) -> None:
    """Until every entry of the instance in the proxy's list is healthy (or every one unhealthy)."""
    want = "healthy" if healthy else "unhealthy"
    deadline = time.monotonic() + wait
    while True:
        seen, why = proxy_workers(s, plan)
        ranks = ranks_of(seen, svc)
        if ranks and all(ok == healthy for ok in ranks):
            return
        if time.monotonic() > deadline:
            now = why or (f"{sum(ranks)} of its {len(ranks)} entries healthy" if ranks else
                          f"not in its list: {', '.join(seen) or 'none'}")
            raise LaunchError(f"the proxy's health check has not listed {svc.name} ({url_of(svc)}) {want} within "
                              f"{wait:.0f} s ({now})")
        time.sleep(1)


def prove(runner: Runner, plan: LaunchPlan, svc: Service, partner: Service, words: int) -> str:
    """One request through the restarted instance and a serving one of the other pool, as the proxy sends it;
    the decode side's NIXL transfers must grow."""
    model = plan.endpoint.model
    pre, dec = (svc, partner) if svc.role == "prefill" else (partner, svc)
    pair = Pair(Endpoint.of(pre, model), Endpoint.of(dec, model), plan.endpoint.host)
    s_dec = runner.session(dec.host)
    before = xfer_count(s_dec, dec)
    body = {"model": model, "max_tokens": 16, "temperature": 0,
            "messages": [{"role": "user", "content": proof_prompt(words, f"railyard-recover-{secrets.token_hex(6)}")}]}
    code, text = pair.complete(runner.session(plan.endpoint.host), body)
    after = xfer_count(s_dec, dec)
    if code != 200:
        raise LaunchError(f"{svc.name} serves again, but the request through {pair.service} failed: HTTP {code}: "
                          f"{text.strip()[:160]}")
    if not (after or 0) > (before or 0):
        raise LaunchError(f"{svc.name} serves again, but the request through {pair.service} moved no KV block over "
                          f"NIXL ({dec.name}'s transfers did not grow)")
    return f"a {words}-word request through {pair.service} answered, its KV blocks moved over NIXL"


def restore(inv: Inventory, runner: Runner, plan: LaunchPlan, rec: Recovery, timeout: float,
            show: Show | None) -> Recovery | None:
    if rec.path != "instance":
        return None      # the group path (the verb takes it)
    v = inv.host(plan.endpoint.host).vars
    # the failures that take an instance out, one more check, and the checks' own time
    wait = float(v["pd_proxy_health_interval_s"]) * (int(v["pd_proxy_health_failures"]) + 1) + 30
    s_proxy = runner.session(plan.endpoint.host)
    try:
        for name in rec.services:
            svc = plan.service(name)
            s = runner.session(svc.host)
            if inspect(s, svc.spec.name).running:
                take_down(s, svc, rec)
            if name == plan.endpoint.service:
                start_alone(plan, runner, [svc], rec, timeout, show)
                continue
            wait_proxy(s_proxy, plan, svc, False, wait)
            rec.done.append(f"the proxy's health check took {name} out")
            start_alone(plan, runner, [svc], rec, timeout, show)
            wait_proxy(s_proxy, plan, svc, True, wait)
            rec.done.append(f"the proxy's health check has {name} back")
            other = "decode" if svc.role == "prefill" else "prefill"
            pending = rec.services[rec.services.index(name) + 1:]
            partner = next(x for x in serving(plan) if x.role == other and x.name not in pending)
            rec.done.append(prove(runner, plan, svc, partner, int(v["pd_proof_words"])))
    except LaunchError as e:
        rec.failure = str(e)
    return rec
