"""`inv health`, from the launch plan's services, so it works for every layout.

health asks each service for its container and GPUs, then the plan's endpoint (with the key,
read on its host): /health, /v1/models, one short real chat completion at temperature 0 that
must generate at least one token (finish_reason "stop" or "length": a model that does not stop
within the probe's tokens, as a reasoning model thinking first, is healthy), and /metrics
summarised; under DP attention also the KV
cache of every DP rank (min, sum, spread) and every engine in /metrics. Every probe's latency
is shown.
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import asdict

from ..checks import FAIL, PASS, WARN, CheckResult
from ..errors import RailyardError, UsageError
from ..inventory import Inventory
from .hung import survey
from .serve import build_plan, uptime_text
from ..checks.probes import CHAT_PROBE, Probe, RankHealth, judge_answer
from ..facts.docker import inspect, log_tail, uptime
from ..transport.http import parse_metrics, request
from ..apply import lock
from ..apply.executor import describe
from ..transport.runner import Runner
from ..plan import layout as layouts
from ..facts.host import gpu_usage
from ..plan.spec import Endpoint, LaunchPlan, Service
from .. import engines
from ..engines import Engine
from ..transport import Session
from ..report import Report


def _curl(s: Session, ep: Endpoint, path: str, body: dict | None = None, timeout: int = 60) -> tuple[int, float, str]:
    """One HTTP request from the endpoint's host to its own API, the key read from its file there."""
    return request(s, ep, path, body, timeout)[:3]


def kv_summary(per_rank: dict[int, int]) -> dict:
    """KV tokens per DP rank -> min, sum and spread ((max - min) / max)."""
    if not per_rank:
        return {"per_rank": {}, "min": None, "sum": None, "spread": None}
    lo, hi = min(per_rank.values()), max(per_rank.values())
    return {"per_rank": {str(k): v for k, v in sorted(per_rank.items())}, "min": lo, "sum": sum(per_rank.values()),
            "spread": (hi - lo) / hi if hi else 0.0}


def service_health(s: Session, svc: Service) -> RankHealth:
    c = inspect(s, svc.spec.name)
    usage = gpu_usage(s, svc.spec.gpus.uuids)
    procs, used = usage.processes, usage.used_mib
    reasons = []
    if not c.exists or not c.running:
        reasons.append(f"container {svc.spec.name} is {c.status if c.exists else 'missing'}")
    serves_on_gpu = svc.spec.gpus.count and svc.expects("gpu_process", "required") == "required"
    if c.running and serves_on_gpu and not procs:
        reasons.append("no serving process on the GPU")
    stopped = [p for p in procs if usage.states.get(str(p.pid)) in ("T", "t")]
    if c.running and stopped:  # SIGSTOP, a debugger: alive, holding its GPU, and making no progress
        p = stopped[0]
        reasons.append(f"hung: {p.name} (pid {p.pid}) is stopped (state {usage.states[str(p.pid)]} in /proc/{p.pid}/stat)"
                       + (f", and {len(stopped) - 1} more of its GPU processes" if len(stopped) > 1 else ""))
    holding = {p.gpu_uuid for p in procs}
    idle = [u for u in svc.spec.gpus.uuids if u and u not in holding]
    if c.running and serves_on_gpu and procs and idle:
        reasons.append(f"{len(idle)} of its {len(svc.spec.gpus.uuids)} GPUs hold no serving process")
    if not serves_on_gpu:  # its GPUs are other services' (LMCache maps the replicas'): their memory is not its
        used, procs = None, []
    return RankHealth(svc.host, svc.rank, svc.name, c.status if c.exists else "missing",
                      uptime(c.started) if c.running else None, used, procs[0].name if procs else None,
                      not reasons, reasons)


def health(inv: Inventory, cache_proof: int = 0, canary: str = "") -> tuple[LaunchPlan, list[RankHealth], list[Probe],
                                                                          dict]:
    """Every service's container and GPUs, then the endpoint's API probes: the layout's own where it
    has them (its api_probes hook gives api_probes(runner, plan, ranks) -> (probes, metrics)), else
    the generic ones. cache_proof: the words of `--cache-proof`'s prompt, for a layout with a shared cache.
    canary: `check` or `record` (railyard.verbs.canary), its verdicts in metrics["canary"]."""
    layout = layouts.get(inv)
    if cache_proof and not layout.cache_proof:
        have = " or ".join(layouts.names_where(lambda cls: cls.cache_proof))
        raise UsageError(f"--cache-proof: layout {layout.name} has no shared cache (serve_layout {have} has)")
    with Runner(layout.hosts(inv)) as runner:
        plan = build_plan(inv, runner, strict=False)
        ranks, probes, metrics = _health(layout, plan, runner, cache_proof)
        if canary:
            metrics["canary"] = _canary(inv, layout, plan, runner, canary,
                                        all(r.ok for r in ranks) and all(p.ok for p in probes))
    return plan, ranks, probes, metrics


def _canary(inv: Inventory, layout, plan: LaunchPlan, runner: Runner, mode: str, healthy: bool) -> dict:
    """`--canary` (mode check) or `--canary record`: the verdicts, and where the record is kept (the deployment's
    first host, beside the launch timeline). A deployment that is not healthy is not recorded."""
    from . import canary
    host = lock.lock_host(inv)
    path = canary.path_for(host.vars["vllm_state_dir"], plan.deployment)
    where = f"{host.name}:{path}"
    targets = layout.canary_targets(plan) or [plan.endpoint]
    s = runner.session(host)
    if mode == "record":
        verdicts = (canary.record(inv, plan, runner, targets, s, path) if healthy else
                    [canary.Verdict("-", plan.endpoint.host, FAIL, "not recorded: the health checks above fail; "
                                    "record answers only of a deployment that is healthy", [])])
    else:
        verdicts = canary.check(inv, plan, runner, targets, canary.load(s, path), where)
    return {"mode": mode, "file": where, "verdicts": [asdict(v) for v in verdicts]}


def _health(layout, plan: LaunchPlan, runner: Runner, cache_proof: int) -> tuple[list[RankHealth], list[Probe], dict]:
    got = runner.each(lambda s: [service_health(s, svc) for svc in plan.on_host(s.host.name)])
    ranks = []
    for h in plan.report_hosts():
        ranks += got.ok[h] if h in got.ok else [
            RankHealth(h, svc.rank, svc.name, "unreachable", None, None, None, False, [str(got.failed[h].error)])
            for svc in plan.on_host(h)]
    box: dict = {}

    def probe() -> None:
        try:
            box["got"] = _endpoint_probes(layout, plan, runner, ranks, cache_proof)
        except Exception as e:  # raised again below, in the caller's thread
            box["error"] = e

    t = threading.Thread(target=probe, daemon=True)
    t.start()
    found = survey(runner, plan)
    t.join(HUNG_GRACE_S if found.bad else None)
    if "error" in box:
        raise box["error"]
    if "got" in box:
        probes, metrics = box["got"]
    else:
        bad = "; ".join(v.line() for v in found.bad)
        probes, metrics = [Probe("API probes", False, f"not waited for: the hung verdict is in ({bad})")], {}
    metrics["hung"] = [v.as_dict() for v in found.verdicts]
    return ranks, probes, metrics


def _endpoint_probes(layout, plan: LaunchPlan, runner: Runner, ranks: list[RankHealth],
                     cache_proof: int) -> tuple[list[Probe], dict]:
    """The layout's own API probes (its api_probes hook), else the endpoint's generic ones."""
    api_probes = layout.api_probes(plan, cache_proof)
    if api_probes is not None:
        return api_probes(runner, plan, ranks)
    ep = plan.endpoint
    s = runner.session(ep.host)
    svc = plan.service(ep.service)
    engine = engines.of(svc)
    if engine is None:  # a layout whose endpoint is a proxy brings its own probes (api_probes)
        raise RailyardError(f"health: the endpoint {svc.name} runs no engine and layout {layout.name} "
                            "has no probes of its own")
    probes, metrics = _api_probes(s, ep, engine)
    text = metrics.pop("_text", "")
    if "kv_engines" in plan.verifiers:
        more, metrics["kv_per_rank"] = _engine_probes(s, svc, text, engine)
        probes += more
    return probes, metrics


# vLLM's /health answers 200 unless the engine is dead (EngineDeadError), so a wedged engine stays "healthy"
# (vllm-project/vllm #36451, #39863): whether it moves is the shared hung verdict's (railyard.verbs.hung, run beside
# these probes). The endpoint's own chat probe waits up to CHAT_LIMIT_S for an engine the verdict calls busy or cold
# (the CPU build's first step took more than 20 s in the lab, two cores shared by its TP workers); once the verdict
# names something hung or dead, health does not wait for the probes still out (HUNG_GRACE_S)
CHAT_LIMIT_S = 120
HUNG_GRACE_S = 3


def _api_probes(s: Session, ep: Endpoint, engine: Engine) -> tuple[list[Probe], dict]:
    probes: list[Probe] = []
    metrics: dict = {}
    served = ep.model
    code, ms, text = _curl(s, ep, "/health", timeout=10)
    probes.append(Probe("/health", code == 200, f"HTTP {code}" if code else f"no answer: {text[:120]}", ms))
    code, ms, text = _curl(s, ep, "/v1/models", timeout=10)
    try:
        ids = [m["id"] for m in json.loads(text).get("data", [])] if code == 200 else []
    except (ValueError, AttributeError):
        ids = []
    probes.append(Probe("/v1/models", code == 200 and served in ids,
                        (f"HTTP {code}; serves {', '.join(ids) or 'nothing'}" if code else f"no answer: {text[:120]}")
                        + ("" if served in ids else f" (expected {served})"), ms))
    body = CHAT_PROBE | {"model": served}
    code, ms, text = _curl(s, ep, "/v1/chat/completions", body, timeout=CHAT_LIMIT_S)
    ok, detail = judge_answer(code, text)
    probes.append(Probe("chat completion", ok, detail, ms))
    code, ms, text = _curl(s, ep, "/metrics", timeout=10)
    if code == 200:
        metrics = engine.summarize_metrics(parse_metrics(text))
        metrics["_text"] = text
    probes.append(Probe("/metrics", code == 200, f"HTTP {code}", ms))
    return probes, metrics


def _engine_probes(s: Session, svc: Service, metrics_text: str, engine: Engine) -> tuple[list[Probe], dict]:
    """DP attention: one KV cache per engine core in the log, and every engine in /metrics."""
    want = int(svc.expects("kv_engines", "1"))
    per_rank = engine.kv_cache(log_tail(s, svc.spec.name, None))
    kv = kv_summary(per_rank)
    missing = [r for r in range(want) if r not in per_rank]
    detail = (f"{len(per_rank)} of {want} DP ranks: min {kv['min']:,} tokens, sum {kv['sum']:,}, spread "
              f"{kv['spread'] * 100:.1f} %" if per_rank else f"no `KV cache size` line from {describe(svc)}")
    if missing and per_rank:
        detail += f"; no KV line from rank(s) {', '.join(map(str, missing))}"
    labels = engine.metric_engines(metrics_text)
    absent = [str(r) for r in range(want) if str(r) not in labels]
    return [Probe("KV cache per DP rank", not missing, detail),
            Probe("engines in /metrics", bool(metrics_text) and not absent,
                  (f"engine labels {', '.join(sorted(labels)) or 'none'}" if metrics_text else "no /metrics")
                  + (f"; missing {', '.join(absent)}" if absent and metrics_text else ""))], kv


PROBE_CHECKS = {"/health": "api_health", "/v1/models": "api_models", "chat completion": "api_chat",
                "/metrics": "api_metrics", "KV cache per DP rank": "kv_per_dp_rank",
                "engines in /metrics": "metrics_engines"}


def _slug(name: str) -> str:
    return PROBE_CHECKS.get(name) or re.sub(r"\W+", "_", name).strip("_").lower()


def health_report(ranks: list, probes: list, metrics: dict, endpoint_host: str) -> Report:
    """One `service` check per service (running, on its GPUs), one per API probe of the endpoint."""
    checks = []
    for r in ranks:
        ev = f"state {r.state}, up {uptime_text(r.uptime_s)}" + (
            f", GPU memory {r.gpu_used_mib} MiB" if r.gpu_used_mib is not None else "")
        if r.ok:
            checks.append(CheckResult(r.host, "service", PASS, f"{r.service}: {r.state}" + (
                f", {r.serving_process} on its GPU" if r.serving_process else ""), ev))
        elif any(x.startswith("hung:") for x in r.reasons):
            checks.append(CheckResult(r.host, "service", FAIL, f"{r.service}: " + "; ".join(r.reasons), ev,
                                      f"on {r.host}, ps -o pid,stat,cmd -p PID shows it; kill -CONT PID resumes "
                                      "what was stopped; otherwise inv stop and inv launch --recreate"))
        else:
            checks.append(CheckResult(r.host, "service", FAIL, f"{r.service}: " + "; ".join(r.reasons), ev,
                                      f"inv logs --rank {r.host} --lines 50 says why; then inv stop and "
                                      "inv launch --recreate"))
    for p in probes:
        ev = f"{p.name}" + (f" in {p.ms:.0f} ms" if p.ms else "")
        checks.append(CheckResult(endpoint_host, _slug(p.name), PASS if p.ok else FAIL, p.detail, ev,
                                  "" if p.ok else f"inv status, then inv logs --rank {endpoint_host} --lines 50"))
    checks += hung_checks(metrics.get("hung", []))
    if "canary" in metrics:
        from .canary import Verdict, checks as canary_checks
        c = metrics["canary"]
        checks += canary_checks([Verdict(**v) for v in c["verdicts"]], c["mode"] == "record")
    return Report(checks, {"ranks": [asdict(r) for r in ranks], "probes": [asdict(p) for p in probes],
                           "metrics": metrics})


def hung_checks(verdicts: list[dict]) -> list[CheckResult]:
    """A `hung` check per engine process group judged (railyard.checks.hang): pass on evidence that it moves or
    idles, fail when hung or dead, warn when its evidence could not be read (never a pass)."""
    out = []
    for v in verdicts:
        status = {"ok": PASS, "hung": FAIL, "dead": FAIL}.get(v["state"], WARN)
        hint = ("" if status == PASS else
                "inv hang-dump shows where each rank waits; inv recover kills and restarts it" if v["state"] == "hung"
                else "inv recover restarts it" if v["state"] == "dead" else "inv status; inv preflight")
        out.append(CheckResult(v["host"], "hung", status, f"{v['target']}: {v['state']}: " + "; ".join(v["evidence"]),
                               v["source"], hint))
    return out
