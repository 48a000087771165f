"""`inv health --canary`: does every engine still give the answers it gave when the deployment was known good?

`--canary record` asks each of the layout's canary targets (the endpoint, or the layout's own list: every
replica and the router in front of them; each prefill/decode pair as the proxy asks it, and the proxy) a
few fixed prompts at temperature 0 and keeps the answers on the deployment's first host, beside the launch
timeline (`<vllm_state_dir>/<deployment>/canary.json`).
`--canary` asks again and fails a target whose answer differs, naming it, the prompt and both answers; a
differing answer is asked twice more first (greedy decoding can differ with the batch an engine runs), and
only an answer that differs every time fails. A record of another model, revision, layout or set of targets
is invalidated, not judged: a changed deployment is no wrong answer.
"""

from __future__ import annotations

import getpass
import json
import socket
import time
from dataclasses import dataclass
from typing import Protocol, Union

from ..checks import FAIL, PASS, WARN, CheckResult
from ..inventory import Inventory
from ..plan.spec import Endpoint, LaunchPlan
from ..transport import Session, read_remote, write_remote
from ..transport.http import request
from ..transport.runner import Runner

FILE_NAME = "canary.json"
# each longer than one KV block (16 tokens in vLLM's tokenizers and the lab's, without a chat template), so
# that where the prompt's KV is computed on one engine and moved to another, the answer depends on it
PROMPTS = ("Complete the sentence with the words that most often follow it in plain English prose: the slow "
           "brown river runs past the",
           "Name three colours that a child would learn first, in the order a picture book would list them, "
           "separated by commas:",
           "Repeat after me exactly, word for word, and add nothing before or after the words themselves: "
           "copper lantern orbit")
MAX_TOKENS = 8
ASKS = 3        # a differing answer is asked this many times in all before it fails


class Asked(Protocol):
    """A target that is more than one API (a layout's own, from its canary_targets hook): `complete`
    sends the chat completion its own way from `host` and returns the final answer's HTTP code (0: none)
    and body, or why there is none."""

    @property
    def service(self) -> str: ...

    @property
    def host(self) -> str: ...

    @property
    def model(self) -> str: ...

    def complete(self, s: Session, body: dict) -> tuple[int, str]: ...


Target = Union[Endpoint, Asked]


def path_for(state_dir: str, deployment: str) -> str:
    return f"{state_dir.rstrip('/')}/{deployment}/{FILE_NAME}"


def identity(inv: Inventory, plan: LaunchPlan, targets: list[Target]) -> dict:
    """What a record is of: a change in any of these invalidates it."""
    v = inv.head.vars
    return {"deployment": plan.deployment, "layout": plan.layout, "model": plan.endpoint.model,
            "model_path": str(v.get("model_path", "")), "model_revision": str(v.get("model_revision", "")),
            "targets": [t.service for t in targets]}


def ask(s: Session, target: Target, prompt: str) -> tuple[str | None, str]:
    """(the answer's text, or None, and why not) for one prompt at temperature 0."""
    body = {"model": target.model, "temperature": 0, "seed": 0, "max_tokens": MAX_TOKENS,
            "messages": [{"role": "user", "content": prompt}]}
    if isinstance(target, Endpoint):
        code, _, text, _ = request(s, target, "/v1/chat/completions", body, timeout=120)
    else:
        code, text = target.complete(s, body)
    if code != 200:
        return None, f"HTTP {code}: {text.strip()[:120]}" if code else f"no answer: {text.strip()[:120]}"
    try:
        return str(json.loads(text)["choices"][0]["message"]["content"] or ""), ""
    except (ValueError, KeyError, IndexError, TypeError):
        return None, f"HTTP 200 but not a chat completion: {text.strip()[:120]}"


def _shown(answer: str) -> str:
    return json.dumps(answer[:60] + ("..." if len(answer) > 60 else ""))


@dataclass
class Verdict:
    """One target's canary: status (pass, fail, warn), what was seen, and the answers asked now."""
    target: str
    host: str
    status: str
    detail: str
    answers: list[str | None]


def judge(target: Target, recorded: list[str], asked) -> Verdict:
    """A target's answers against its record; asked(prompt) -> (answer or None, why): called again for a
    prompt whose answer differs, up to ASKS times in all. Pure but for asked."""
    now: list[str | None] = []
    for i, (prompt, want) in enumerate(zip(PROMPTS, recorded), 1):
        tries = []
        for _ in range(ASKS):
            got, why = asked(prompt)
            if got is None:
                return Verdict(target.service, target.host, FAIL,
                               f"{target.service}: no answer to canary prompt {i}: {why}", now + [None])
            tries.append(got)
            if got == want:
                break
        now.append(tries[-1])
        if tries[-1] != want:
            return Verdict(target.service, target.host, FAIL,
                           f"{target.service}: the answer to canary prompt {i} ({prompt!r}) differs from the record "
                           f"in {len(tries)} asks of {len(tries)}: {_shown(tries[-1])}, recorded {_shown(want)}", now)
    return Verdict(target.service, target.host, PASS,
                   f"{target.service}: the {len(PROMPTS)} canary answers are the recorded ones", now)


def record(inv: Inventory, plan: LaunchPlan, runner: Runner, targets: list[Target], s_state: Session,
           state_path: str) -> list[Verdict]:
    """Ask every target and keep the answers, unless one of them gives none (nothing is kept then)."""
    verdicts, answers = [], {}
    for t in targets:
        s = runner.session(t.host)
        got = [ask(s, t, p) for p in PROMPTS]
        missing = [(i, why) for i, (a, why) in enumerate(got, 1) if a is None]
        if missing:
            i, why = missing[0]
            verdicts.append(Verdict(t.service, t.host, FAIL, f"{t.service}: no answer to canary prompt {i}: {why}",
                                    [a for a, _ in got]))
        else:
            answers[t.service] = [a for a, _ in got]
            verdicts.append(Verdict(t.service, t.host, PASS, f"{t.service}: {len(PROMPTS)} answers recorded",
                                    answers[t.service]))
    if all(v.status == PASS for v in verdicts):
        doc = identity(inv, plan, targets) | {
            "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "by": f"{getpass.getuser()}@{socket.gethostname()}", "prompts": list(PROMPTS), "answers": answers}
        write_remote(s_state, state_path, json.dumps(doc, indent=2) + "\n", mode="644")
    return verdicts


def at_launch(inv: Inventory, plan: LaunchPlan, runner: Runner, targets: list[Target], s_state: Session,
              state_path: str, where: str) -> str:
    """After a launch that brought the deployment up: record its answers unless a record of this same
    deployment is kept (a relaunch keeps the known-good answers to judge the new engines by). One line."""
    doc = load(s_state, state_path)
    if doc is not None and current(inv, plan, targets, doc):
        return f"canary: the record at {where} is of this deployment: kept (inv health --canary judges against it)"
    verdicts = record(inv, plan, runner, targets, s_state, state_path)
    failed = [v for v in verdicts if v.status != PASS]
    if failed:
        return f"canary: not recorded ({failed[0].detail}); record it once it answers: inv health --canary record"
    return (f"canary: {len(PROMPTS)} answers of {', '.join(v.target for v in verdicts)} recorded at {where} "
            "(inv health --canary judges against them)")


def current(inv: Inventory, plan: LaunchPlan, targets: list[Target], doc: dict) -> bool:
    """Whether a record is of this deployment: its model, revision, layout, targets and prompts."""
    now = identity(inv, plan, targets)
    return all(doc.get(k) == now[k] for k in now) and list(doc.get("prompts") or []) == list(PROMPTS)


def load(s: Session, path: str) -> dict | None:
    text = read_remote(s, path)
    try:
        doc = json.loads(text) if text else None
    except ValueError:
        return None
    return doc if isinstance(doc, dict) and isinstance(doc.get("answers"), dict) else None


def check(inv: Inventory, plan: LaunchPlan, runner: Runner, targets: list[Target], doc: dict | None,
          where: str) -> list[Verdict]:
    """Every target against the record at `where` (host:path): no record, or a record of another
    deployment, is a verdict on the record (fail, warn), not on the engines."""
    head = plan.endpoint.host
    if doc is None:
        return [Verdict("-", head, FAIL, f"no canary record at {where}: record one on a deployment known to answer "
                                         "right (inv health --canary record)", [])]
    if not current(inv, plan, targets, doc):
        now = identity(inv, plan, targets)
        what = "; ".join(f"{k} {doc.get(k)!r} -> {now[k]!r}" for k in now if doc.get(k) != now[k]) \
            or "the canary prompts changed"
        return [Verdict("-", head, WARN, f"the canary record at {where} is of another deployment ({what}): "
                                         "invalidated, not judged; record again (inv health --canary record)", [])]
    out = []
    for t in targets:
        s = runner.session(t.host)
        out.append(judge(t, list(doc["answers"].get(t.service) or []), lambda p, s=s, t=t: ask(s, t, p)))
    return out


def checks(verdicts: list[Verdict], recording: bool) -> list[CheckResult]:
    hint = {FAIL: "inv logs for that service; a wrong checkpoint or revision: inv sync-model --verify content, "
                  "then restart it (inv recover)" if not recording else "inv health says why it does not answer",
            WARN: "inv health --canary record, once the deployment answers right"}
    return [CheckResult(v.host, "canary", v.status, v.detail,
                        "answers now: " + "; ".join(_shown(a) if a is not None else "none" for a in v.answers)
                        if v.answers else "", hint.get(v.status, "")) for v in verdicts]
