"""`inv health` for the replicas layout, and `inv health --cache-proof`.

Probes, each from the host itself (the replicas and LMCache listen on 127.0.0.1 there):
- each replica: /health, its KV cache size, and its LMCache connector's registration line;
- LMCache: /healthcheck, and /status: one registered worker per GPU of every live replica (a GPU id
  for a CUDA engine; an engine-driven context, of its world size, for a CPU engine);
- the router: /health/readiness (the proxy is up), its authenticated /health (which replicas it
  sees healthy, and why not the others), and a real chat completion through it, with the replica
  that answered (LiteLLM's x-litellm-model-id header).

The cache proof sends one long prompt, new each time, to r0 and then to r1 directly: LMCache must
have retrieved tokens for r1 and r1's engine counted them as external prefix-cache hits; otherwise
the cache is not shared (a PYTHONHASHSEED mismatch, say). Both times are shown, with a note when
r1 was not clearly faster (< PROOF_RATIO x r0's time): the reuse is the verdict, the speed a figure.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import replace

from ...errors import UsageError
from ...facts.docker import log_tail
from ...transport.http import parse_metrics, request
from ...transport.runner import Runner
from ...engines.lmcache import HEALTH_PATH, REGISTERED_LINE, STATUS_PATH, ServerStatus, parse_status
from ...engines.litellm import READY_PATH, parse_health
from ...plan.spec import Endpoint, LaunchPlan, Service
from ...engines.vllm import parse_kv_cache
from ...transport import Session, cmd
from ...checks.probes import CHAT_PROBE, Probe, judge_answer
from ...plan.layout import CACHE_PROOF_AUTO

PROOF_RATIO = 0.8
PROOF_WORDS = 16384     # the proof prompt's length when the engine's context holds it
_RETRIEVED = re.compile(r"Retrieved (\d+) tokens")
WORDS = ("river", "signal", "copper", "lantern", "orbit", "meadow", "harbor", "ember", "quartz", "willow", "canyon",
         "falcon", "marble", "tundra", "violet", "summit")


def _replica_probes(s: Session, plan: LaunchPlan, svc: Service) -> tuple[list[Probe], dict]:
    code, ms, text, _ = request(s, Endpoint.of(svc, plan.endpoint.model), "/health", timeout=10)
    log = log_tail(s, svc.spec.name, None)
    kv = parse_kv_cache(log)
    registered = REGISTERED_LINE in log
    data = {"health": code, "kv_tokens": kv.get(0), "gpus": list(svc.spec.gpus.uuids), "lmcache_registered": registered}
    return [Probe(f"{svc.name} /health", code == 200, f"HTTP {code}" if code else f"no answer: {text[:120]}", ms),
            Probe(f"{svc.name} KV cache", bool(kv) and registered,
                  (f"{kv[0]:,} tokens" if kv else "no `KV cache size` line") + "; " +
                  ("its LMCache connector registered its KV caches" if registered else
                   f"no `{REGISTERED_LINE}` line: it is not connected to LMCache"))], data


def judge_registrations(st: ServerStatus, want: int, replicas: int) -> tuple[bool, str]:
    """LMCache's registered workers against the live replicas' GPUs. Fewer: a live replica is not
    registered. More engine-driven contexts than live workers, with LMCache's liveness reaper on: a
    restarted CPU engine registers a new instance id and the old one stays until its heartbeat has been
    missing for the reap timeout (real LMCache 0.5.6: 120 s, reaped within 30 s more): shown, not
    failed. More GPU ids: a crashed CUDA replica LMCache still holds (recover's long path)."""
    n = st.workers
    what = " and ".join(x for x in (f"{len(st.registered_gpu_ids)} GPU ids" if st.registered_gpu_ids else "",
                                    f"{len(st.engine_instances)} engine-driven (non-CUDA) contexts of "
                                    f"{n - len(st.registered_gpu_ids)} workers" if st.engine_instances else "") if x)
    detail = f"{what or 'nothing'} registered, {want} workers expected (one per GPU of {replicas} live replicas)"
    if n == want:
        return True, detail
    if n < want:
        return False, detail + "; a live replica is not registered with LMCache"
    if len(st.registered_gpu_ids) <= want and st.reap_timeout_s is not None:
        return True, (detail + f"; {n - want} more: a restarted engine's old context, which LMCache drops once it has "
                      f"been silent for over {st.reap_timeout_s:.0f} s")
    return False, detail + "; a stale one is a crashed replica LMCache has not reaped"


def _lmcache_probes(s: Session, plan: LaunchPlan, live: list[Service]) -> tuple[list[Probe], dict]:
    svc = plan.service("lmcache")
    ep = Endpoint.of(svc)
    code, ms, text, _ = request(s, ep, HEALTH_PATH, timeout=10)
    out = [Probe("lmcache /healthcheck", code == 200 and '"healthy"' in text,
                 f"HTTP {code}: {text.strip()[:120]}" if code else f"no answer: {text[:120]}", ms)]
    code, ms, text, _ = request(s, ep, STATUS_PATH, timeout=10)
    data: dict = {"healthcheck": out[0].ok}
    want = sum(r.spec.gpus.count for r in live)
    try:
        st = parse_status(text) if code == 200 else None
    except ValueError:
        st = None
    if st is None:
        out.append(Probe("lmcache registrations", False, f"/status: HTTP {code}: {text.strip()[:120]}", ms))
        return out, data
    data.update(registered_gpu_ids=list(st.registered_gpu_ids), engine_instances=[i for i, _ in st.engine_instances],
                l1_used_bytes=st.l1_used_bytes, l1_total_bytes=st.l1_total_bytes)
    ok, detail = judge_registrations(st, want, len(live))
    out.append(Probe("lmcache registrations", ok, detail, ms))
    return out, data


def _router_probes(s: Session, plan: LaunchPlan, live: list[Service]) -> tuple[list[Probe], dict]:
    ep = plan.endpoint
    out = []
    code, ms, text, _ = request(s, replace(ep, api_key_file=""), READY_PATH, timeout=10)
    out.append(Probe("router /health/readiness", code == 200, f"HTTP {code}" if code else f"no answer: {text[:120]}", ms))
    code, ms, text, _ = request(s, ep, "/health", timeout=120)
    data: dict = {}
    try:
        rh = parse_health(text) if code == 200 else None
    except ValueError:
        rh = None
    if rh is None:
        out.append(Probe("router sees replicas", False, f"/health: HTTP {code}: {text.strip()[:120]}", ms))
    else:
        data.update(healthy=list(rh.healthy), unhealthy=rh.unhealthy)
        missing = [r.name for r in live if r.name not in rh.healthy]
        detail = f"healthy: {', '.join(rh.healthy) or 'none'}" + (
            "; unhealthy: " + "; ".join(f"{k} ({v})" if v else k for k, v in rh.unhealthy.items()) if rh.unhealthy else "")
        out.append(Probe("router sees replicas", bool(rh.healthy) and not missing,
                         detail + (f"; not healthy there: {', '.join(missing)}" if missing else ""), ms))
    code, ms, text, who = request(s, ep, "/v1/chat/completions", CHAT_PROBE | {"model": ep.model}, timeout=120,
                                  header="x-litellm-model-id")
    data["answered_by"] = who or None
    ok, detail = judge_answer(code, text)
    out.append(Probe("chat completion via router", ok and bool(who),
                     detail + (f"; answered by {who}" if who else "; no x-litellm-model-id header"), ms))
    return out, data


def api_probes(cache_proof_words: int = 0):
    """railyard.verbs.health's probes for this layout (and the cache proof with a prompt of that many words)."""
    def run(runner: Runner, plan: LaunchPlan, ranks: list) -> tuple[list[Probe], dict]:
        probes, data = health_probes(runner, plan, [r.service for r in ranks if r.state == "running"])
        if cache_proof_words:
            proof, data["cache_proof"] = cache_proof(runner, plan, cache_proof_words)
            probes.append(proof)
        return probes, data
    return run


def health_probes(runner: Runner, plan: LaunchPlan, live: list[str]) -> tuple[list[Probe], dict]:
    """Every probe of the layout; live: the replicas whose containers run."""
    s = runner.session(plan.endpoint.host)
    replicas = [x for x in plan.services() if x.role == "replica"]
    probes: list[Probe] = []
    data: dict = {"replicas": {}}
    for svc in replicas:
        more, data["replicas"][svc.name] = _replica_probes(s, plan, svc)
        probes += more
    running = [r for r in replicas if r.name in live]
    more, data["lmcache"] = _lmcache_probes(s, plan, running)
    probes += more
    more, data["router"] = _router_probes(s, plan, running)
    probes += more
    return probes, data


# ---------------------------------------------------------------- the cache proof

def proof_prompt(tokens: int) -> str:
    """About `tokens` words, new each call (a random first word), so the first request is always cold."""
    words = [secrets.token_hex(8)] + [WORDS[(i * 7 + i // 16) % len(WORDS)] for i in range(tokens - 1)]
    return " ".join(words)


def _retrieved(s: Session, name: str) -> int:
    r = s.run(cmd("docker", "logs", name) + " 2>&1 | grep -o 'Retrieved [0-9]* tokens'", timeout=60)
    return sum(int(m) for m in _RETRIEVED.findall(r.stdout))


def context_length(text: str) -> int | None:
    """The engine's own context length from its GET /v1/models (vLLM lists max_model_len per model)."""
    try:
        got = [m.get("max_model_len") for m in json.loads(text).get("data", [])]
    except (ValueError, AttributeError, TypeError):
        return None
    return next((n for n in got if isinstance(n, int) and n > 0), None)


def _context_of(s: Session, svc: Service, plan: LaunchPlan) -> int | None:
    code, _, text, _ = request(s, Endpoint.of(svc, plan.endpoint.model), "/v1/models", timeout=10)
    return context_length(text) if code == 200 else None


def proof_length(words: int, context: int | None) -> int:
    """The proof prompt's words: CACHE_PROOF_AUTO takes PROOF_WORDS, or half the engine's context when that
    is shorter (a word is a token or more); a length the context cannot hold is a usage error, before any
    request."""
    if words == CACHE_PROOF_AUTO:
        return min(PROOF_WORDS, context // 2) if context else PROOF_WORDS
    if context and words > context // 2:
        raise UsageError(f"--proof-words {words}: longer than the engine's context can hold ({context:,} tokens, "
                         f"max_model_len in r0's /v1/models): at most {context // 2}")
    return words


def _external_hits(s: Session, svc: Service, plan: LaunchPlan) -> float | None:
    m = parse_metrics(request(s, Endpoint.of(svc, plan.endpoint.model), "/metrics", timeout=10)[2])
    return m.get("vllm:external_prefix_cache_hits_total")


def cache_proof(runner: Runner, plan: LaunchPlan, tokens: int) -> tuple[Probe, dict]:
    replicas = [x for x in plan.services() if x.role == "replica"]
    if len(replicas) < 2:
        return Probe("cache proof", False, "needs two replicas (vllm_replicas >= 2)"), {}
    s = runner.session(plan.endpoint.host)
    first, second = replicas[0], replicas[1]
    lmc = plan.service("lmcache").spec.name
    tokens = proof_length(tokens, _context_of(s, first, plan))
    prompt = proof_prompt(tokens)
    body = {"model": plan.endpoint.model, "temperature": 0, "max_tokens": 1,
            "messages": [{"role": "user", "content": prompt}]}
    out: dict = {"prompt_words": tokens}
    before, hits_before = _retrieved(s, lmc), _external_hits(s, second, plan)
    for svc in (first, second):
        code, ms, text, _ = request(s, Endpoint.of(svc, plan.endpoint.model), "/v1/chat/completions", body,
                                    timeout=1800)
        if code != 200:
            return Probe("cache proof", False, f"{svc.name} answered HTTP {code}: {text.strip()[:160]}"), out
        out[f"{svc.name}_ms"] = round(ms, 1)
        if svc is first:
            mid = _retrieved(s, lmc)
    after, hits_after = _retrieved(s, lmc), _external_hits(s, second, plan)
    out["retrieved_tokens"] = after - mid
    out["retrieved_tokens_first"] = mid - before
    hits = None if hits_before is None or hits_after is None else hits_after - hits_before
    out["external_prefix_cache_hits"] = hits
    t0, t1 = out[f"{first.name}_ms"], out[f"{second.name}_ms"]
    # the verdict is the reuse, read on both sides: LMCache logged the tokens it retrieved for the second
    # replica, whose engine counted them as external prefix-cache hits. The speed-up is a figure: on a
    # small model (the lab's real engine on a CPU) fetching the KV costs about what computing it does
    ok = out["retrieved_tokens"] > 0 and (hits is None or hits > 0)
    detail = (f"{tokens:,}-word prompt: {first.name} {t0 / 1000:.2f} s, then {second.name} {t1 / 1000:.2f} s "
              f"({t1 / t0:.2f}x); LMCache retrieved {out['retrieved_tokens']:,} tokens for {second.name} (summed over its "
              f"{second.spec.gpus.count} workers)"
              + ("" if hits is None else f", its engine counted {hits:,.0f} external prefix-cache hits")
              + ("" if hits is not None else " (its /metrics has no vllm:external_prefix_cache_hits_total)"))
    if ok and t1 >= PROOF_RATIO * t0:
        detail += (f"; reused but not faster (under {PROOF_RATIO}x): fetching this model's KV costs about what "
                   "computing it does")
    if not ok:
        detail += ("; the second replica did not reuse the first one's KV blocks: check that every replica and "
                   "LMCache run with one PYTHONHASHSEED (inv env --check) and that both registered with LMCache")
    return Probe("cache proof", ok, detail, t1), out
