"""The health judgments the verbs and the layouts share: a probe's verdict (`Probe`), a service's
(`RankHealth`), and the chat completion that proves an engine generates (`CHAT_PROBE`, judged by
`judge_answer`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field


@dataclass
class Probe:
    name: str
    ok: bool
    detail: str
    ms: float | None = None


@dataclass
class RankHealth:
    host: str
    rank: int | None
    service: str
    state: str
    uptime_s: float | None
    gpu_used_mib: int | None
    serving_process: str | None
    ok: bool
    reasons: list[str] = field(default_factory=list)


# the probe's question; 16 tokens: enough for any model's first words, and a CPU's or a busy
# engine's few seconds, not a whole answer's
CHAT_PROBE = {"temperature": 0, "max_tokens": 16,
              "messages": [{"role": "user", "content": "Reply with the single word: ready."}]}
FINISHED = ("stop", "length")  # generated until it stopped, or until the probe's max_tokens


def judge_answer(code: int | None, text: str) -> tuple[bool, str]:
    """A chat completion's verdict: HTTP 200, a finish_reason of stop or length, and at least one
    generated token (usage.completion_tokens); the detail shows the start of the answer.

        HTTP 200; finish_reason length; 16 tokens: "NORTHUMBERLAND played ..."
    """
    if code != 200:
        return False, f"HTTP {code}: {text.strip()[:160]}" if code else f"no answer: {text.strip()[:120]}"
    try:
        doc = json.loads(text)
        choice = doc["choices"][0]
        finish, content = choice.get("finish_reason"), (choice.get("message") or {}).get("content") or ""
        tokens = (doc.get("usage") or {}).get("completion_tokens")
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        return False, f"HTTP 200 but not a chat completion: {text.strip()[:120]}"
    shown = " ".join(content.split())
    detail = (f"HTTP 200; finish_reason {finish}; {tokens if tokens is not None else 'no'} token(s)"
              + (f': "{shown[:60]}{"..." if len(shown) > 60 else ""}"' if shown else ""))
    if finish not in FINISHED:
        return False, detail + f" (expected {' or '.join(FINISHED)})"
    if not isinstance(tokens, int) or tokens < 1:
        return False, detail + " (no generated token)"
    return True, detail
