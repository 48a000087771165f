"""What `inv bench` shows: the results table (one per series, like the two-station guide's), the SLO
verdicts, deltas against a compared run; and the `--json` document (railyard.report's shape).

Checks: `aiperf` per series and concurrency (warn when some requests failed), `slo` per SLO and
concurrency (fail with --require, else warn: shown, exit 0), `restore` after a sweep.
"""

from __future__ import annotations

from rich.table import Table
from rich.text import Text

from ..checks import FAIL, PASS, WARN, CheckResult
from ..report import NO_HOST, Report

COLUMNS = (  # header, metric, format
    ("overall tok/s", "output_tok_s", "{:.1f}"),
    ("per-user tok/s", "per_user_tok_s", "{:.1f}"),
    ("mean TTFT s", "ttft_mean_s", "{:.3f}"),
    ("P90 TTFT s", "ttft_p90_s", "{:.3f}"),
    ("mean ITL/TPOT ms", "itl_mean_ms", "{:.2f}"),
    ("mean latency s", "latency_mean_s", "{:.3f}"),
)


def _earlier(summary: dict, label: str) -> dict[int, dict]:
    doc = summary.get("_compare_doc")
    if not doc:
        return {}
    series = [s for s in doc["series"] if s["label"] == label] or doc["series"][:1]
    return {p["concurrency"]: p for p in series[0]["points"]} if series else {}


def _cell(fmt: str, v, old) -> Text:
    if v is None:
        return Text("-")
    t = Text(fmt.format(v))
    if old is not None and old != 0:
        d = (v - old) / abs(old) * 100
        t.append(f" ({d:+.1f} %)", style="dim")
    return t


def tables(summary: dict) -> list[Table]:
    out = []
    for s in summary["series"]:
        earlier = _earlier(summary, s["label"])
        title = f"bench: {summary['deployment']} ({summary['layout']})" + (f", {s['label']}" if s["label"] else "")
        if earlier:
            title += f", vs {summary['compare']}"
        t = Table(title=title, title_justify="left")
        t.add_column("C", justify="right")
        for head, _, _ in COLUMNS:
            t.add_column(head, justify="right")
        t.add_column("errors", justify="right")
        if summary["slos"]:
            t.add_column("SLOs")
        by_c: dict[int, list[dict]] = {}
        for v in s["verdicts"]:
            by_c.setdefault(v["concurrency"], []).append(v)
        for p in s["points"]:
            old = earlier.get(p["concurrency"], {}).get("metrics", {})
            row = [str(p["concurrency"])] + [_cell(fmt, p["metrics"].get(m), old.get(m)) for _, m, fmt in COLUMNS]
            row.append(Text(str(p["errors"]), style="red" if p["errors"] else ""))
            if summary["slos"]:
                vs = by_c.get(p["concurrency"], [])
                bad = [v["slo"] for v in vs if not v["ok"]]
                row.append(Text("pass" if not bad else "fail: " + ", ".join(bad), style="green" if not bad else "red"))
            t.add_row(*row)
        out.append(t)
    return out


def verdict_lines(summary: dict) -> list[Text]:
    lines: list[Text] = []
    if not summary["slos"]:
        return lines
    for s in summary["series"]:
        prefix = f"{s['label']}: " if s["label"] else ""
        best = s["best_concurrency"]
        lines.append(Text(f"{prefix}SLOs {', '.join(summary['slos'])}: " +
                          (f"met up to C={best}" if best is not None else "met at no concurrency"),
                          style="green" if best is not None else "red"))
    return lines


def report(summary: dict, require: bool) -> Report:
    checks = []
    for s in summary["series"]:
        tag = f"{s['label']} " if s["label"] else ""
        for p in s["points"]:
            ev = f"{p['dir']}: {p['requests']} requests, {p['errors']} errors"
            checks.append(CheckResult(NO_HOST, "aiperf", WARN if p["errors"] else PASS,
                                      f"{tag}C={p['concurrency']}: {p['requests']} requests measured"
                                      + (f", {p['errors']} failed" if p["errors"] else ""), ev,
                                      "the failed requests are in the c<C>/profile_export.jsonl" if p["errors"] else ""))
        for v in s["verdicts"]:
            shown = "nothing measured" if v["value"] is None else f"{v['value']:.4g}"
            checks.append(CheckResult(NO_HOST, "slo", PASS if v["ok"] else (FAIL if require else WARN),
                                      f"{tag}C={v['concurrency']}: {v['slo']} ({shown})", f"{s['label'] or 'run'}"))
    if summary.get("restored") is not None:
        checks.append(CheckResult(NO_HOST, "restore", PASS if summary["restored"] else FAIL,
                                  "the original configuration is launched again" if summary["restored"] else
                                  "the original configuration could not be launched again",
                                  hint="" if summary["restored"] else "inv launch --recreate"))
    data = {k: v for k, v in summary.items() if not k.startswith("_")}
    return Report(checks, data)
