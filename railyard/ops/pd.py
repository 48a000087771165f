"""The P->D proof of the pd layout: a pool's /health says nothing about the path between the
pools (the connection details travel in each request's kv_transfer_params), so the launch's last
gate is one real request through the proxy, with a prompt longer than one KV block (vLLM's 16
tokens; a shorter prompt moves no block), that returns text and whose id a prefill log and the
decode log both show, the decode side with a completed transfer. A failure is named by what the
logs say, with its fix.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field

from ..runner import Runner
from ..serving.spec import LaunchPlan, Service
from ..transport import Session, cmd
from .http import request

# what the instances log (vLLM's NixlConnector, and the lab's stand-in in its formats)
TRANSFER_DONE = "KV transfer complete"
KNOWN_FAILURES = (
    ("NIXL compatibility hash mismatch",
     "prefill and decode differ in what the NIXL handshake compares (image, model, KV cache dtype, attention "
     "backend, speculative method): make the pools' settings equal and relaunch"),
    ("localhost",
     "an instance's NIXL side channel is on localhost, which the other host cannot reach: set "
     "VLLM_NIXL_SIDE_CHANNEL_HOST to its rail address (railyard does; check vllm_extra_env)"),
    ("Releasing expired KV blocks",
     "prefill released KV blocks no decode worker read in time: decode is overloaded or cannot reach the prefill "
     "host's side channel (inv verify-rdma; VLLM_NIXL_ABORT_REQUEST_TIMEOUT)"),
    ("NIXL_ERR_BACKEND",
     "NIXL could not start its UCX backend: a UCX from a pip wheel conflicts with the image's (see the instance's "
     "log; use the image's UCX)"),
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


def proof_prompt(words: int) -> str:
    return " ".join(f"w{i % 97}" for i in range(words))


def grep_log(s: Session, svc: Service, needles: list[str]) -> list[str]:
    pats = [a for n in needles for a in ("-e", n)]
    r = s.run(cmd("docker", "logs", svc.spec.name) + " 2>&1 | " + cmd("grep", "-F", *pats) + " | tail -n 40",
              timeout=60)
    return r.stdout.splitlines() if not r.error else []


def prove(plan: LaunchPlan, runner: Runner, words: int) -> Proof:
    rid = f"railyard-proof-{secrets.token_hex(6)}"
    body = {"model": plan.endpoint.model, "max_tokens": 16, "temperature": 0,
            "messages": [{"role": "user", "content": proof_prompt(words)}]}
    code, ms, text, _ = request(runner.session(plan.endpoint.host), plan.endpoint, "/v1/chat/completions", body,
                                timeout=600, headers=(("X-Request-Id", rid),))
    try:
        answer = json.loads(text)["choices"][0]["message"]["content"] if code == 200 else ""
    except (ValueError, KeyError, IndexError, TypeError):
        answer = ""
    instances = [s for s in plan.services() if s.role in ("prefill", "decode")]
    needles = [rid] + [f for f, _ in KNOWN_FAILURES]
    logs = runner.each(lambda s: {svc.name: grep_log(s, svc, needles) for svc in instances if svc.host == s.host.name},
                       [runner.session(h).host for h in dict.fromkeys(s.host for s in instances)])
    lines: dict[str, list[str]] = {}
    for got in logs.values():
        if isinstance(got, dict):
            lines.update(got)
    seen = {n: [ln for ln in ls if rid in ln] for n, ls in lines.items()}
    pre = [n for n in seen if n.startswith("prefill") and seen[n]]
    dec = [n for n in seen if n.startswith("decode") and seen[n]]
    moved = [n for n in dec if any(TRANSFER_DONE in ln for ln in seen[n])]
    proof = Proof(False, "", rid, ms, pre, dec)
    if code == 200 and answer and pre and moved:
        proof.ok = True
        proof.detail = (f"{words}-word prompt through the proxy answered in {ms / 1000:.2f} s; request {rid} prefilled "
                        f"on {', '.join(pre)}, its KV blocks moved to {', '.join(moved)}")
        return proof
    why = []
    if code != 200:
        why.append(f"the proxy answered HTTP {code}" + (f": {text.strip()[:160]}" if text.strip() else ""))
    elif not answer:
        why.append("the answer had no text")
    if not pre:
        why.append(f"no prefill log shows request {rid}")
    if not dec:
        why.append(f"the decode log does not show request {rid}")
    elif not moved:
        why.append(f"decode shows request {rid} but no completed KV transfer"
                   + (f" (a {words}-word prompt fills no 16-token block: nothing moves)" if words <= 16 else ""))
    for pattern, fix in KNOWN_FAILURES:
        hit = next((f"{n}: {ln.strip()[:200]}" for n, ls in lines.items() for ln in ls
                    if pattern in ln and (pattern != "localhost" or "side" in ln.lower() or "connect" in ln.lower())),
                   None)
        if hit:
            why.append(f"log: {hit}")
            proof.fix = fix
            break
    proof.detail = "; ".join(why)
    return proof
