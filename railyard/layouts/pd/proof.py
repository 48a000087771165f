"""The P->D proof of the pd layout: a pool's /health says nothing about the path between the
pools (the connection details travel in each request's kv_transfer_params), so the launch's last
gate is one real request through the proxy, with a prompt longer than one KV block (vLLM's 16
tokens; a shorter prompt moves no block), that returns text and whose id a prefill log and the
decode log both show, the decode side with one more NIXL transfer. A failure is named by what the
logs say, with its fix.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field

from ...transport.runner import Runner
from . import members, serving
from ...plan.spec import Endpoint, LaunchPlan, Service
from ...transport import Session, cmd
from ...transport.http import parse_metrics, request

# What vLLM logs (with --enable-log-requests) and exports. vllm-router makes the request id
# (`___prefill_addr_<P>___decode_addr_<D>_<hex>`, the same on both sides) and ignores the client's;
# vLLM 0.32 logs the id and the SamplingParams at INFO, never the prompt
# (tests/fixtures/real/vllm-cpu/pd-request-log.txt), so a request is found by a seed of its own: the
# router passes it to both pools, and with temperature 0 it changes no answer.
RECEIVED = "Received request "
XFERS = "vllm:nixl_xfer_time_seconds_count"   # one sample per successful transfer (NixlPromMetrics)
HANDSHAKE_TIMEOUT = "zmq.error.Again"   # decode's NIXL handshake got no answer from the side channel in 5 s
KNOWN_FAILURES = (
    ("NIXL compatibility hash mismatch",
     "prefill and decode differ in what the NIXL handshake compares (image, model, KV cache dtype, attention "
     "backend, speculative method): make the pools' settings equal and relaunch"),
    (HANDSHAKE_TIMEOUT,
     "decode could not reach the prefill instance's NIXL side channel: VLLM_NIXL_SIDE_CHANNEL_HOST must be that "
     "host's rail address, not localhost (railyard sets it; check vllm_extra_env) and its port open"),
    ("Remote NIXL agent engine ID mismatch",
     "decode reached another NIXL agent than the prefill instance that served the request (a side channel on "
     "localhost leads decode to its own host): VLLM_NIXL_SIDE_CHANNEL_HOST must be that host's rail address, not "
     "localhost (railyard sets it; check vllm_extra_env)"),
    ("Releasing expired KV blocks",
     "prefill released KV blocks no decode worker read in time: decode is overloaded or cannot reach the prefill "
     "host's side channel (inv verify-rdma); pd_kv_lease_s (vLLM's kv_lease_duration, 30 s) is how long it waits"),
    ("NIXL_ERR_BACKEND",
     "NIXL could not start its UCX backend or found no transport to the peer: /dev/infiniband, IPC_LOCK, memlock and "
     "UCX_TLS/UCX_NET_DEVICES (inv verify-rdma); a UCX from a pip wheel can also conflict with the image's"),
)


@dataclass
class Proof:
    ok: bool
    detail: str
    request_id: str = ""
    ms: float | None = None
    prefill: list[str] = field(default_factory=list)   # instances whose log shows the request
    decode: list[str] = field(default_factory=list)
    fix: str = ""


def marker() -> int:
    """A seed no other request carries: the request's mark in both pools' logs."""
    return 1 + secrets.randbelow(2 ** 31 - 1)


def proof_prompt(words: int, nonce: str = "") -> str:
    """About `words` words (each one token in vLLM's tokenizers and the lab's), the nonce first."""
    body = [f"w{i % 97}" for i in range(words - (1 if nonce else 0))]
    return " ".join(([nonce] if nonce else []) + body)


def grep_log(s: Session, svc: Service, needles: list[str]) -> list[str]:
    pats = [a for n in needles for a in ("-e", n)]
    r = s.run(cmd("docker", "logs", svc.spec.name) + " 2>&1 | " + cmd("grep", "-F", *pats) + " | tail -n 200",
              timeout=60)
    return r.stdout.splitlines() if not r.error else []


def each_service(runner: Runner, services: list[Service], fn) -> tuple[dict, dict]:
    """fn(session, service) for every service, one session per host, the hosts in parallel:
    ({service name: result}, {host: why it could not be reached})."""
    got = runner.each(lambda s: {x.name: fn(s, x) for x in services if x.host == s.host.name},
                      [runner.session(h).host for h in dict.fromkeys(x.host for x in services)])
    out: dict = {}
    for res in got.ok.values():
        out.update(res)
    return out, {host: str(r.error) for host, r in got.failed.items()}


def xfer_count(s: Session, svc: Service) -> float | None:
    code, _, text, _ = request(s, Endpoint.of(svc), "/metrics",
                               timeout=10)
    return parse_metrics(text).get(XFERS, 0.0) if code == 200 else None


def find_request(runner: Runner, plan: LaunchPlan, seed: int) -> tuple[str, list[str], list[str]]:
    """The request id vLLM logged for the request of this seed (marker()), and the instances of each pool
    that logged it."""
    instances = members(plan)
    first = each_service(runner, instances, lambda s, x: grep_log(s, x, [f" seed={seed},"]))[0]
    rid = ""
    for lines in first.values():
        for ln in lines:
            if RECEIVED in ln:
                rid = ln.split(RECEIVED, 1)[1].split(":", 1)[0].strip()
                break
        if rid:
            break
    if not rid:
        return "", [], []
    seen = each_service(runner, instances, lambda s, x: any(rid in ln for ln in grep_log(s, x, [rid])))[0]
    return rid, [n for n, hit in seen.items() if hit and n.startswith("prefill")], \
        [n for n, hit in seen.items() if hit and n.startswith("decode")]


def exercise(plan: LaunchPlan, runner: Runner, words: int) -> int:
    """Requests through the proxy, two per DP rank of the larger pool (vllm-router round-robins over the
    instances, each instance over its ranks), so that every P->D path carries a transfer; the number
    that answered 200."""
    ranks = max(sum(int(x.expects("kv_engines", "1")) for x in members(plan) if x.role == pool)
                for pool in ("prefill", "decode"))
    s = runner.session(plan.endpoint.host)
    ok = 0
    for i in range(2 * ranks):
        body = {"model": plan.endpoint.model, "max_tokens": 1, "temperature": 0,
                "messages": [{"role": "user", "content": proof_prompt(words, f"railyard-verify-{i}")}]}
        ok += request(s, plan.endpoint, "/v1/chat/completions", body, timeout=600)[0] == 200
    return ok


def prove(plan: LaunchPlan, runner: Runner, words: int) -> Proof:
    """One request through the proxy, prefilled in one pool and decoded in the other with a NIXL transfer.
    A handshake that timed out is not a verdict: vLLM waits 5 s for the prefill's side channel, which a
    loaded host can miss (the lab's 2 cores did, once in three launches); the request is sent once more, and the
    second answer is judged (a side channel that is really unreachable times out again)."""
    first = _attempt(plan, runner, words)
    if first.ok or HANDSHAKE_TIMEOUT not in first.detail:
        return first
    second = _attempt(plan, runner, words)
    note = f"the first request's NIXL handshake timed out ({HANDSHAKE_TIMEOUT}: no answer within vLLM's 5 s)"
    second.detail += f" ({note}; this was the second request)" if second.ok else f"; twice: {note}, and again"
    return second


def _attempt(plan: LaunchPlan, runner: Runner, words: int) -> Proof:
    nonce, seed = f"railyard-proof-{secrets.token_hex(6)}", marker()   # a new prompt: no prefix cache hit
    body = {"model": plan.endpoint.model, "max_tokens": 16, "temperature": 0, "seed": seed,
            "messages": [{"role": "user", "content": proof_prompt(words, nonce)}]}
    instances = members(plan)
    decodes = [x for x in serving(plan) if x.role == "decode"]  # a multi-host one counts every rank's transfers
    before = each_service(runner, decodes, xfer_count)[0]
    code, ms, text, _ = request(runner.session(plan.endpoint.host), plan.endpoint, "/v1/chat/completions", body,
                                timeout=600)
    try:
        answer = json.loads(text)["choices"][0]["message"]["content"] if code == 200 else ""
    except (ValueError, KeyError, IndexError, TypeError):
        answer = ""
    rid, pre, dec = find_request(runner, plan, seed)
    after = each_service(runner, decodes, xfer_count)[0]
    heads = {x.name: plan.group(x.group)[0].name if x.group else x.name for x in instances}
    moved = [n for n in dict.fromkeys(heads[d] for d in dec) if (after.get(n) or 0) > (before.get(n) or 0)]
    proof = Proof(False, "", rid, ms, pre, dec)
    if code == 200 and answer and pre and moved:
        proof.ok = True
        proof.detail = (f"a {words}-word prompt through the proxy answered in {ms / 1000:.2f} s; request {rid} was "
                        f"prefilled on {', '.join(pre)} and its KV blocks moved to {', '.join(moved)} over NIXL")
        return proof
    why = []
    if code != 200:
        why.append(f"the proxy answered HTTP {code}" + (f": {text.strip()[:160]}" if text.strip() else ""))
    elif not answer:
        why.append("the answer had no text")
    if not rid:
        why.append("no instance logged the request (vLLM logs ids with --enable-log-requests)")
    else:
        if not pre:
            why.append(f"no prefill log shows request {rid}")
        if not dec:
            why.append(f"the decode log does not show request {rid}")
        elif not moved:
            why.append(f"{', '.join(dec)} served request {rid} without a NIXL transfer ({XFERS} did not grow)"
                       + (f"; a {words}-word prompt fills no 16-token block, so nothing moves" if words <= 16 else ""))
    logs = each_service(runner, instances, lambda s, x: grep_log(s, x, [f for f, _ in KNOWN_FAILURES]))[0]
    for pattern, fix in KNOWN_FAILURES:
        hit = next((f"{n}: {ln.strip()[:220]}" for n, ls in logs.items() for ln in ls if pattern in ln), None)
        if hit:
            why.append(f"log: {hit}")
            proof.fix = fix
            break
    proof.detail = "; ".join(why)
    return proof
