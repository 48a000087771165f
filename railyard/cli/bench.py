"""inv bench: AIPerf against the endpoint. The view: the results table (one per series, like the
two-station guide's), the SLO verdicts, deltas against a compared run; and the `--json` document
(railyard.report's shape).

Checks: `aiperf` per series and concurrency (warn when some requests failed), `slo` per SLO and
concurrency (fail with --require, else warn: shown, exit 0), `restore` after a sweep.
"""

from __future__ import annotations

from pathlib import Path

from rich.table import Table
from rich.text import Text

from ..checks import FAIL, PASS, WARN, CheckResult
from ..errors import InventoryError, UsageError
from ..report import NO_HOST, Report
from . import console, live_table, load, rtask

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


@rtask(help={"concurrency": "concurrencies, comma-separated (default 1,8,16,32)",
             "isl": "synthetic prompt length in tokens (default 128)", "osl": "output length in tokens (default 64)",
             "isl-stddev": "spread of the prompt length (default 0)", "osl-stddev": "spread of the output length (default 0)",
             "dataset": "a JSONL file of prompts ({\"text\": ...} per line) instead of synthetic ones",
             "prefix-prompts": "shared prefixes to draw from (with --prefix-length)",
             "prefix-length": "tokens of each shared prefix",
             "warmup": "warm-up requests per unit of concurrency, excluded (default 3: 3 x C)",
             "requests": "measured requests per unit of concurrency (default 10: 10 x C)",
             "seed": "AIPerf's random seed (default 1)",
             "slo": "METRIC<=V or METRIC>=V, e.g. per_user_tok_s>=30, ttft_mean_s<=2.5, tpot_mean_ms<=20 (repeatable)",
             "require": "a failed SLO exits 1 (without it: shown, exit 0)",
             "sweep": "FLAG=V1,V2,...: relaunch with each value of one launch flag (e.g. max_num_batched_tokens=2048,8192), "
                      "benchmark each, then restore the original",
             "compare": "an earlier run's directory (or its summary.json): deltas in the table, both on the plots",
             "out": "results root (default ./bench): OUT/<deployment>/<stamp>/",
             "tokenizer": "a local tokenizer directory (default: the checkpoint's own files, fetched from the host)",
             "timeout": "seconds to wait for each relaunch of a sweep (default vllm_start_timeout_s)",
             "where": "where AIPerf runs: control (this machine, the default) or head (the endpoint's host, "
                      "its AIPerf at bench_aiperf_venv)"},
       iterable=["slo"],
       numbers={"isl": int, "osl": int, "isl_stddev": int, "osl_stddev": int, "prefix_prompts": int,
                "prefix_length": int, "warmup": int, "requests": int, "seed": int, "timeout": float})
def bench(inventory=None, concurrency=None, isl=None, osl=None, isl_stddev=0, osl_stddev=0, dataset=None,
          prefix_prompts=0, prefix_length=0, warmup=3, requests=10, seed=1, slo=None, require=False, sweep=None,
          compare=None, out=None, tokenizer=None, timeout=None, json=False, set_=None, where=None):
    """Benchmark the endpoint with AIPerf: a table per concurrency, SLO verdicts, PNG plots, sweeps of launch flags."""
    from ..bench.aiperf import Load, check_usage
    from ..bench.slo import parse_slos
    from ..bench.run import Options, bench as run, load_compare, parse_concurrency, parse_sweep
    inv = load(inventory, set_)
    slos = parse_slos(slo or [])
    if not slos:  # a deployment's own SLOs from its variables (bench_slos), when the command line gives none
        slos = parse_slos(inv.head.vars.get("bench_slos") or [], "bench_slos")
    if dataset and (isl or prefix_prompts):
        raise UsageError("--dataset FILE takes its prompts from the file: leave out --isl and --prefix-prompts")
    load_ = Load(isl=128 if isl is None else isl, osl=64 if osl is None else osl, isl_stddev=isl_stddev,
                 osl_stddev=osl_stddev, dataset=dataset, prefix_prompts=prefix_prompts, prefix_length=prefix_length,
                 warmup_per_c=warmup, requests_per_c=requests, seed=seed)
    check_usage(load_)
    where = where or inv.head.vars.get("bench_where") or "control"
    if where not in ("control", "head"):
        raise UsageError(f"--where {where!r}: control (this machine) or head (the endpoint's host)")
    if tokenizer and not Path(tokenizer).is_dir() and where == "control":
        raise UsageError(f"--tokenizer {tokenizer}: no such directory")
    swept = parse_sweep(sweep, inv) if sweep else None
    if swept:  # every value checked as `inv launch` would, before the first relaunch (exit 2, no host touched)
        from ..plan import layout as layouts
        for v in swept[1]:
            try:
                layouts.validated(load(inventory, list(set_ or []) + [f"{swept[0]}={v}"]))
            except InventoryError as e:
                raise UsageError(f"--sweep {sweep}: {swept[0]}={v}: " + "; ".join(
                    p.message for p in e.problems))
    opts = Options(concurrency=parse_concurrency(concurrency or "1,8,16,32"), load=load_, slos=slos,
                   sweep=swept, compare=load_compare(compare) if compare else None,
                   out=Path(out or "bench"), tokenizer=tokenizer, start_timeout=timeout, where=where)
    err = console(stderr=True)
    summary = run(inv, opts, set_, live_table(err, "bench") if not json else None, log=lambda m: err.print(m, style="dim",
                                                                                      highlight=False))
    rep = report(summary, require)
    if json:
        return rep.print_json()
    con = console()
    for t in tables(summary):
        con.print(t)
    for line in verdict_lines(summary):
        con.print(line)
    con.print(Text(f"results: {summary['dir']} (summary.json, {', '.join(summary['plots'])}, AIPerf's exports per "
                   "c<C>/)", style="dim"), highlight=False)
    if summary.get("restored") is False:
        con.print(Text("FAILED: the original configuration is not back: inv launch --recreate", style="bold red"))
    return rep.exit_code
