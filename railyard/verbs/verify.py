"""`inv verify-rdma` and `inv health`.

Both work from the launch plan's services, so they work for every layout.

verify-rdma collects the NCCL logs from every service whose traffic crosses the rails and
judges them with railyard.checks.nccl, adding what only the running container can show: memlock
unlimited, /dev/infiniband present, IPC_LOCK granted, and the NCCL library the image carries.
A one-host layout has nothing to verify there, and says so.

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
from pathlib import Path

from ..checks import FAIL, PASS, SKIP, WARN, CheckResult, split_fixes
from ..errors import RailyardError, UsageError
from ..inventory import Inventory
from .hung import survey
from .serve import build_plan, uptime_text
from ..checks.health import CHAT_PROBE, Probe, RankHealth, judge_answer
from ..checks.nccl import RankVerdict, judge
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
from ..transport import Session, Sh, cmd, q
from ..report import NO_HOST, Report, host_of

NCCL_LIB_PY = ("import os, nvidia.nccl as n; p = os.path.join(list(n.__path__)[0], 'lib', 'libnccl.so.2'); "
               "print(p if os.path.exists(p) else 'missing ' + p)")
MIN_NCCL = (2, 30, 7)  # older NCCL can deadlock cross-node CUDA graph replays over RoCE (vLLM issue #52504)


def cuda_graphs(svc: Service) -> bool:
    """Does this vLLM capture CUDA graphs: not with --enforce-eager, nor with a cudagraph_mode of NONE."""
    words = [w for w in svc.spec.command if isinstance(w, str)]
    if "--enforce-eager" in words:
        return False
    config = None   # the last one given wins, as vLLM's parser takes it: `--compilation-config J` or `...=J`
    for i, w in enumerate(words):
        if w == "--compilation-config" and i + 1 < len(words):
            config = words[i + 1]
        elif w.startswith("--compilation-config="):
            config = w.split("=", 1)[1]
    try:
        mode = json.loads(config).get("cudagraph_mode") if config else None
    except (ValueError, AttributeError):
        mode = None
    return str(mode).upper() != "NONE"


def old_nccl_reason(v: RankVerdict, svc: Service) -> str | None:
    """MIN_NCCL where its reason applies: channels between nodes, over RoCE, inside captured CUDA graphs
    (vLLM #52504: the same setup serves with --enforce-eager; NCCL 2.30.4 fixed it)."""
    if not (v.nccl_version and _version_tuple(v.nccl_version) < MIN_NCCL):
        return None
    if not (v.net_transport and v.roce and cuda_graphs(svc)):
        return None
    return (f"NCCL {v.nccl_version} is older than {'.'.join(map(str, MIN_NCCL))}, which can deadlock cross-node CUDA "
            "graph replays over RoCE (fix: load the image's own libnccl via VLLM_NCCL_SO_PATH, or serve with "
            "--enforce-eager)")


def judge_files(paths: list[str]) -> list[RankVerdict]:
    out = []
    for p in paths:
        try:
            text = Path(p).read_text(errors="replace")
        except OSError as e:
            raise UsageError(f"--log {p}: {e.strerror}")
        out.append(judge(text, p))
    return out


def nccl_log_glob(svc: Service) -> Sh:
    """The container's NCCL_DEBUG_FILE as a shell glob: %h and %p become `*`, every other character is
    quoted (a value from the inventory stays a value inside the container's `sh -c`)."""
    path = re.sub(r"%[hp]", "*", str(dict(svc.spec.env).get("NCCL_DEBUG_FILE", "/tmp/nccl_%h_%p.log")))
    return Sh("*".join(q(part) if part else "" for part in path.split("*")))


def _version_tuple(v: str | None) -> tuple:
    try:
        return tuple(int(x) for x in (v or "").split("."))
    except ValueError:
        return ()


def verify_rank(s: Session, svc: Service) -> list[RankVerdict]:
    name = svc.spec.name
    host = svc.host
    c = inspect(s, name)
    src = f"{host}:{name}"
    if not c.exists or not c.running:
        return [RankVerdict(src, "fail", None, False, [], None, [],
                            [f"container {name} is {c.status if c.exists else 'missing'} on {host} "
                             "(fix: inv launch / inv start)"])]
    pattern = nccl_log_glob(svc)
    script = (f'for f in {pattern}; do [ -e "$f" ] || continue; printf "@@file %s\\n" "$f"; cat "$f"; done; '
              'printf "@@memlock %s\\n" "$(ulimit -l)"; '
              'if [ -d /dev/infiniband ]; then printf "@@ib %s\\n" "$(ls /dev/infiniband | tr "\\n" " ")"; fi')
    r = s.run(cmd("docker", "exec", name, "sh", "-c", script), timeout=60)
    caps = s.run(cmd("docker", "inspect", "--format", "{{json .HostConfig.CapAdd}}", name), timeout=30)  # as granted
    lib = s.run(cmd("docker", "exec", name, "python3", "-c", NCCL_LIB_PY), timeout=60)  # as the entrypoint finds it
    nccl_lib = lib.stdout.strip() if lib.ok else None
    if r.error:
        return [RankVerdict(src, "fail", None, False, [], None, [], [f"{r.error.kind}: {r.error.message}"])]
    files: dict[str, list[str]] = {}
    memlock = ib = None
    current = None
    for line in r.stdout.splitlines():
        if line.startswith("@@file "):
            current = line[7:]
            files[current] = []
        elif line.startswith("@@memlock "):
            memlock, current = line[10:].strip(), None
        elif line.startswith("@@ib "):
            ib, current = line[5:].strip(), None
        elif current is not None:
            files[current].append(line)
    container = []
    if memlock != "unlimited":
        container.append(f"memlock inside the container is {memlock or '?'} KiB, not unlimited "
                         "(fix: docker run --ulimit memlock=-1)")
    if not ib:
        container.append("/dev/infiniband is missing inside the container (fix: docker run --device /dev/infiniband)")
    try:
        cap_add = json.loads(caps.stdout.strip() or "null") or []
    except ValueError:
        cap_add = []
    if "IPC_LOCK" not in cap_add and "CAP_IPC_LOCK" not in cap_add:
        container.append("IPC_LOCK not granted (fix: docker run --cap-add IPC_LOCK)")
    if not nccl_lib or nccl_lib.startswith("missing"):
        container.append(f"the image's own NCCL library was not found ({nccl_lib or 'no nvidia.nccl'}) "
                         "(fix: use the pinned image; the entrypoint sets VLLM_NCCL_SO_PATH from it)")
    if not files:
        return [RankVerdict(src, "fail", None, False, [], None, [],
                            [f"no NCCL log matching {pattern} in the container (fix: NCCL_DEBUG=INFO and "
                             "NCCL_DEBUG_FILE must be set, and the ranks must have connected)"] + container)]
    out = []
    for path, lines in sorted(files.items()):
        v = judge("\n".join(lines), f"{host}:{path}", list(svc.spec.rdma.hcas if svc.spec.rdma else ()))
        if why := old_nccl_reason(v, svc):
            v.reasons.append(why)
        v.reasons.extend(container)
        v.verdict = "fail" if v.reasons else "pass"
        out.append(v)
    return out


def verify_rdma(inv: Inventory) -> tuple[LaunchPlan, list]:
    """Every service of a layout whose NCCL traffic crosses the rails (RankVerdicts); none for a one-host
    layout; a layout with its own verify-rdma (its hook) gives its own verdicts."""
    with Runner(layouts.get(inv).hosts(inv)) as runner:
        plan = build_plan(inv, runner, strict=False)
        own = layouts.by_name(plan.layout).verify_rdma(inv, runner, plan)
        if own is not None:
            return plan, own
        if "rdma" not in plan.verifiers:
            return plan, []
        got = runner.each(lambda s: [v for svc in plan.on_host(s.host.name) for v in verify_rank(s, svc)])
    out = []
    for h in plan.report_hosts():
        out.extend(got.ok[h] if h in got.ok else
                   [RankVerdict(h, "fail", None, False, [], None, [], [str(got.failed[h].error)])])
    return plan, out


# ---------------------------------------------------------------- health

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


def verdict_checks(verdicts: list, host_of=host_of) -> list[CheckResult]:
    """An `rdma` check per judged NCCL log: pass only on IB channels with GDRDMA on the rail's HCA."""
    out = []
    for v in verdicts:
        ev = (f"{v.source}: transport {v.net_transport or 'none seen'}, GDRDMA {'yes' if v.gdrdma else 'no'}, "
              f"HCAs {', '.join(v.hcas) or '-'}, NCCL {v.nccl_version or '?'}")
        if v.verdict == PASS:
            out.append(CheckResult(host_of(v.source), "rdma", PASS,
                                   f"inter-node channels over {v.net_transport} with GPUDirect RDMA on "
                                   f"{', '.join(v.hcas) or 'the rail'}", ev))
            if v.notes:  # what no channel runs over yet: a warning beside the pass
                detail, hint = split_fixes(v.notes)
                out.append(CheckResult(host_of(v.source), "rdma", WARN, detail, ev, hint))
            continue
        detail, hint = split_fixes(v.reasons)
        out.append(CheckResult(host_of(v.source), "rdma", FAIL, detail, ev, hint))
    return out


def rdma_report(verdicts: list, skipped: str | None = None, skip_host: str = NO_HOST, layout: str | None = None,
                host_of=host_of) -> Report:
    """verify-rdma: a check per rank verdict; a one-host layout is one `skip` (nothing crossed a rail)."""
    if skipped is not None:
        return Report([CheckResult(skip_host, "rdma", SKIP, skipped)],
                      {"ranks": [], "skipped": skipped, "layout": layout})
    checks = verdict_checks(verdicts, host_of)
    if not checks:  # nothing judged is never a pass
        checks = [CheckResult(NO_HOST, "rdma", FAIL, "no NCCL log was judged")]
    return Report(checks, {"ranks": [v.as_dict() for v in verdicts]})
