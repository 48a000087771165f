"""`inv health` for the pd layout: every instance of both pools (/health, the KV cache of every DP
rank; a headless rank of a multi-host instance: its container and the KV cache of its ranks), the proxy, and a timed request through it: its time to the first token, its time per
output token and the instances that served it (by its request id in their logs); /metrics per
pool (TTFT and TPOT means from vLLM's histograms, the KV transfer time where exported,
speculative acceptance).

TTFT is the latency of a 1-token answer (prefill, the KV transfer and the first decode step);
TPOT is (a 33-token answer's latency - TTFT) / 32.
"""

from __future__ import annotations

import secrets

from ...facts.docker import inspect, log_tail
from ...transport.http import parse_metrics, request
from .proof import each_service, find_request, marker, proof_prompt
from ...transport.runner import Runner
from . import members
from ...plan.spec import Endpoint, LaunchPlan, Service
from ...engines.vllm import parse_kv_cache
from ...transport import Session
from ...checks.probes import Probe
from ...engines.vllm import summarize_metrics

TPOT_TOKENS = 33
HISTOGRAMS = {"ttft_mean_s": "vllm:time_to_first_token_seconds",
              "tpot_mean_s": ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
              "kv_transfer_mean_s": "vllm:nixl_xfer_time_seconds"}


def _mean(m: dict, names) -> float | None:
    for n in (names if isinstance(names, tuple) else (names,)):
        count = m.get(n + "_count")
        if count:
            return m.get(n + "_sum", 0.0) / count
    return None


def _kv_probe(s: Session, svc: Service) -> tuple[Probe, dict[int, int]]:
    """The KV cache of the service's own DP ranks (from `dp_start`: a multi-host instance's ranks run on several hosts)."""
    kv = parse_kv_cache(log_tail(s, svc.spec.name, None))
    start = int(svc.expects("dp_start", "0"))
    want = range(start, start + int(svc.expects("kv_engines", "1")))
    mine = {r: kv[r] for r in want if r in kv}
    missing = [r for r in want if r not in kv]
    return Probe(f"{svc.name} KV cache",
                 not missing, (f"{len(mine)} of {len(want)} DP ranks, min {min(mine.values()):,} tokens" if mine
                               else "no `KV cache size` line")
                 + (f"; none from rank(s) {', '.join(map(str, missing))}" if missing and mine else "")), mine


def _headless(s: Session, svc: Service) -> tuple[list[Probe], dict]:
    """A headless rank serves no API: its container runs and its engines sized their KV cache."""
    c = inspect(s, svc.spec.name)
    kv_probe, kv = _kv_probe(s, svc)
    state = c.status if c.exists else "missing"
    start, n = int(svc.expects("dp_start", "0")), int(svc.expects("kv_engines", "1"))
    return [Probe(f"{svc.name} container", c.exists and c.running,
                  f"{state}; DP ranks {start}-{start + n - 1} of {svc.group}, headless"),
            kv_probe], {"pool": svc.role, "headless": True, "state": state,
                        "kv_per_rank": {str(k): v for k, v in sorted(kv.items())}}


def _instance(s: Session, svc: Service) -> tuple[list[Probe], dict]:
    if svc.rank:
        return _headless(s, svc)
    ep = Endpoint.of(svc)
    code, ms, text, _ = request(s, ep, "/health", timeout=10)
    kv_probe, kv = _kv_probe(s, svc)
    mcode, _, mtext, _ = request(s, ep, "/metrics", timeout=10)
    m = parse_metrics(mtext) if mcode == 200 else {}
    data = {"pool": svc.role, "health": code, "kv_per_rank": {str(k): v for k, v in sorted(kv.items())},
            "metrics": {**summarize_metrics(m), **{k: _mean(m, n) for k, n in HISTOGRAMS.items()}} if m else None}
    return [Probe(f"{svc.name} /health", code == 200, f"HTTP {code}" if code else f"no answer: {text[:120]}", ms),
            kv_probe], data


def _timed(runner: Runner, plan: LaunchPlan, words: int) -> tuple[Probe, dict]:
    s = runner.session(plan.endpoint.host)
    out: dict = {}
    nonce, seed = f"railyard-health-{secrets.token_hex(6)}", marker()
    times = {}
    for n in (1, TPOT_TOKENS):
        body = {"model": plan.endpoint.model, "max_tokens": n, "temperature": 0, "ignore_eos": True,
                **({"seed": seed} if n == TPOT_TOKENS else {}),
                "messages": [{"role": "user", "content": proof_prompt(words, f"{nonce}-{n}")}]}
        code, ms, text, _ = request(s, plan.endpoint, "/v1/chat/completions", body, timeout=600)
        if code != 200:
            return Probe("request via proxy", False, f"HTTP {code}: {text.strip()[:160]}"), out
        times[n] = ms
    ttft, tpot = times[1] / 1000, (times[TPOT_TOKENS] - times[1]) / 1000 / (TPOT_TOKENS - 1)
    rid, pre, dec = find_request(runner, plan, seed)
    out.update(ttft_s=round(ttft, 4), tpot_ms=round(tpot * 1000, 2), request_id=rid or None, prefill=pre, decode=dec)
    both = bool(pre and dec)
    return Probe("request via proxy", both,
                 f"TTFT {ttft:.3f} s, TPOT {tpot * 1000:.1f} ms; served by "
                 + (", ".join(pre + dec) if rid else "no instance log (vLLM logs ids with --enable-log-requests)")
                 + ("" if both or not rid else "; not by both pools"), times[1]), out


def api_probes(words: int):
    """railyard.verbs.health's probes for the pd layout."""
    def run(runner: Runner, plan: LaunchPlan, ranks: list) -> tuple[list[Probe], dict]:
        instances = members(plan)
        probes: list[Probe] = []
        data: dict = {"instances": {}}
        got, unreachable = each_service(runner, instances, _instance)
        for host, why in unreachable.items():
            probes.append(Probe(f"{host} instances", False, why))
        for name, (more, d) in got.items():
            probes += more
            data["instances"][name] = d
        proxy = plan.service(plan.endpoint.service)
        ep = plan.endpoint
        code, ms, text, _ = request(runner.session(ep.host), ep,
                                    "/health", timeout=10)
        probes.append(Probe(f"{proxy.name} /health", code == 200, f"HTTP {code}" if code else f"no answer: {text[:120]}",
                            ms))
        probe, data["request"] = _timed(runner, plan, words)
        probes.append(probe)
        return probes, data
    return run
