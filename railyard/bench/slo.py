"""SLOs of `inv bench --slo`: `METRIC<=VALUE` or `METRIC>=VALUE`, the metric one of railyard's names
(the suffix is the unit: `ttft_mean_s`, `tpot_mean_ms`, `per_user_tok_s`; see aiperf.METRICS).

    slos = parse_slos(["per_user_tok_s>=30", "ttft_p90_s<=4"])
    verdicts(points, slos)   # per concurrency: each SLO pass/fail with the measured value
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass

from ..errors import UsageError
from .aiperf import ALIASES, METRICS, Point, known_metric, value

_EXPR = re.compile(r"^\s*([a-z0-9_]+)\s*(<=|>=|<|>)\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*$")


@dataclass(frozen=True)
class Slo:
    metric: str
    op: str
    bound: float

    def __str__(self) -> str:
        return f"{self.metric}{self.op}{self.bound:g}"

    def met(self, v: float | None) -> bool:
        if v is None:
            return False  # nothing measured is no pass
        return {"<=": v <= self.bound, ">=": v >= self.bound, "<": v < self.bound, ">": v > self.bound}[self.op]


def parse_slo(text: str, where: str = "--slo") -> Slo:
    m = _EXPR.match(text or "")
    if not m:
        raise UsageError(f"{where} {text!r}: expected METRIC<=VALUE or METRIC>=VALUE (e.g. per_user_tok_s>=30)")
    name, op, bound = m.group(1), m.group(2), float(m.group(3))
    if not known_metric(name):
        near = difflib.get_close_matches(name, [*METRICS, *ALIASES], n=1)
        raise UsageError(f"{where} {text!r}: unknown metric {name!r}" + (f" (did you mean {near[0]}?)" if near else
                         f"; one of {', '.join(sorted([*METRICS, *ALIASES]))}"))
    return Slo(name, op, bound)


def parse_slos(texts, where: str = "--slo") -> list[Slo]:
    out = []
    for t in texts or ():
        for part in str(t).split(","):  # `a<=1,b>=2` in one flag, or one per flag
            if part.strip():
                out.append(parse_slo(part.strip(), where))
    return out


@dataclass
class Verdict:
    concurrency: int
    slo: str
    value: float | None
    ok: bool


def verdicts(points: list[Point], slos: list[Slo]) -> list[Verdict]:
    """Each SLO at each concurrency; a concurrency where requests failed fails every SLO."""
    return [Verdict(p.concurrency, str(s), value(p, s.metric), s.met(value(p, s.metric)) and not p.errors)
            for p in points for s in slos]


def best_concurrency(points: list[Point], slos: list[Slo]) -> int | None:
    """The highest concurrency that meets every SLO, or None."""
    good = [p.concurrency for p in points if all(v.ok for v in verdicts([p], slos))]
    return max(good) if good and slos else None
