"""health: one look, or --watch as a live view (with --recover, the unattended loop)."""

from __future__ import annotations

import time

from rich.table import Table
from rich.text import Text

from ..errors import UsageError
from . import STYLE as STYLES, console, load, rtask


def _health_look(inv, cache_proof: int = 0, canary: str = ""):
    """One look: (plan, ranks, probes, metrics, report)."""
    from ..verbs.health import health as run, health_report
    plan, ranks, probes, metrics = run(inv, cache_proof, canary)
    return plan, ranks, probes, metrics, health_report(ranks, probes, metrics, plan.endpoint.host)


def _health_once(inv, json_out: bool, indent: int | None = 2, cache_proof: int = 0, canary: str = "") -> int:
    plan, ranks, probes, metrics, report = _health_look(inv, cache_proof, canary)
    if json_out:
        return report.print_json(indent)
    return _health_view(plan, ranks, probes, metrics, report)


def _health_view(plan, ranks, probes, metrics, report) -> int:
    ok = report.ok
    con = console()
    t = Table(title="health: ranks", title_justify="left")
    for c in ("rank", "host", "service", "container", "uptime", "GPU memory", "serving process", "problems"):
        t.add_column(c, overflow="fold")
    for r in ranks:
        t.add_row("-" if r.rank is None else str(r.rank), r.host, r.service, r.state, f"{r.uptime_s:.0f} s" if r.uptime_s is not None else "-",
                  f"{r.gpu_used_mib} MiB" if r.gpu_used_mib is not None else "-", r.serving_process or "-",
                  Text("; ".join(r.reasons), style="bold red") if r.reasons else Text("ok", style="green"))
    con.print(t)
    p = Table(title=f"health: API on {plan.endpoint.host} ({plan.endpoint.service})", title_justify="left")
    for c in ("probe", "result", "detail", "latency"):
        p.add_column(c, overflow="fold")
    for pr in probes:
        p.add_row(pr.name, Text("OK" if pr.ok else "FAIL", style="green" if pr.ok else "bold red"), pr.detail,
                  f"{pr.ms:.0f} ms" if pr.ms else "-")
    con.print(p)
    hung = [c for c in report.checks if c.check == "hung"]
    if hung:
        t = Table(title="health: hung verdict per engine process group", title_justify="left")
        for c in ("host", "verdict", "detail", "evidence from"):
            t.add_column(c, overflow="fold")
        for c in hung:
            t.add_row(c.host, Text(c.status.upper(), style=STYLES.get(c.status, "")), c.detail, c.evidence)
        con.print(t)
    if metrics and "running" in metrics:
        fmt = lambda v, pct=False: "-" if v is None else (f"{v * 100:.1f} %" if pct else f"{v:g}")
        con.print(f"metrics: running {fmt(metrics['running'])}, waiting {fmt(metrics['waiting'])}, KV cache "
                  f"{fmt(metrics['kv_cache_usage'], True)}, prefix-cache hit rate "
                  f"{fmt(metrics['prefix_cache_hit_rate'], True)}, speculative acceptance "
                  f"{fmt(metrics['spec_acceptance'], True)}")
    kv = metrics.get("kv_per_rank")
    if kv and kv["per_rank"]:
        con.print("KV tokens per DP rank: " + ", ".join(f"{r}: {n:,}" for r, n in kv["per_rank"].items()) +
                  f" (min {kv['min']:,}, sum {kv['sum']:,}, spread {kv['spread'] * 100:.1f} %)")
    canary = [c for c in report.checks if c.check == "canary"]
    if canary:
        t = Table(title=f"health: canary ({metrics['canary']['file']})", title_justify="left")
        for c in ("host", "result", "detail", "answers"):
            t.add_column(c, overflow="fold")
        for c in canary:
            t.add_row(c.host, Text(c.status.upper(), style="green" if c.status == "pass" else "bold red"),
                      c.detail + (f" (fix: {c.hint})" if c.hint else ""), c.evidence)
        con.print(t)
    con.print(Text("OK: healthy" if ok else "FAILED: see above", style="bold green" if ok else "bold red"))
    return report.exit_code


@rtask(help={"watch": "repeat every N seconds as a live view",
             "recover": "with --watch: recover what the hung verdict calls dead or hung, on every look, within the "
                        "restart budget; past it, stop and exit 1 with one line (a pager's or a person's turn)",
             "cache-proof": "replicas layout: one long new prompt to r0, then to r1; r1 must reuse r0's KV from LMCache",
             "proof-words": "length of that prompt in words (default 16384, or half the engine's max_model_len when "
                            "shorter)",
             "canary": "ask every engine (each replica, and the router) fixed prompts at temperature 0 and fail one "
                       "whose answers differ from the record; `--canary record` keeps this deployment's answers"},
       numbers={"watch": float, "proof_words": int}, optional=("canary",))
def health(inventory=None, json=False, watch=None, cache_proof=False, proof_words=None, canary=None, recover=False,
           set_=None):
    """Services up and on their GPUs; the endpoint's /health, /v1/models, a real chat completion, /metrics."""
    proof = 0
    if cache_proof:
        from ..plan.layout import CACHE_PROOF_AUTO
        proof = CACHE_PROOF_AUTO if proof_words is None else proof_words
    if canary not in (None, True, "record"):
        raise UsageError(f"--canary {canary}: `--canary` judges the answers against the record, `--canary record` "
                         "keeps them")
    if canary and watch:
        raise UsageError("--canary with --watch: ask the canary once (inv health --canary), watch without it")
    if recover and not watch:
        raise UsageError("--recover: only with --watch S (once: inv recover)")
    inv = load(inventory, set_)
    if not watch:
        return _health_once(inv, json, cache_proof=proof,
                            canary="" if not canary else "record" if canary == "record" else "check")
    if watch < 1:
        raise UsageError(f"--watch {watch}: at least 1 second")
    seen: dict | None = None
    while True:  # a look every WATCH seconds until Ctrl-C (exit 130); only what changed is printed
        plan, ranks, probes, metrics, report = _health_look(inv)
        now = {(c.host, c.check): c for c in report.checks}
        if seen is None and json:
            report.print_json(None)
        elif seen is None:
            _health_view(plan, ranks, probes, metrics, report)
        elif {k: c.status for k, c in now.items()} != {k: c.status for k, c in seen.items()}:
            if json:  # one document per change, one line each (for a pager)
                report.print_json(None)
            else:
                stamp = time.strftime("%H:%M:%S")
                for k in sorted(set(now) | set(seen)):
                    was, got = seen.get(k), now.get(k)
                    if was is None or got is None or was.status != got.status:
                        c = got or was
                        assert c is not None  # k is in now or in seen
                        console().print(f"{stamp} {c.host} {c.check}: {was.status if was else '-'} -> "
                                        f"{got.status if got else 'gone'}: {c.detail}", soft_wrap=True, markup=False)
        seen = now
        if recover and _needs_recovery(report):
            code = _recover_tick(inv, json)
            if code is not None:
                return code
            seen = None   # the next look is printed whole: what the recovery left
        time.sleep(watch)


def _needs_recovery(report) -> bool:
    """What the shared hung verdict calls dead or hung, or a service not running on its GPUs."""
    return any(c.status == "fail" and c.check in ("hung", "service") for c in report.checks)


def _recover_tick(inv, json_out: bool) -> int | None:
    """One `inv recover` from the watch: None to go on watching; past the restart budget, 1 after one line."""
    from ..verbs.recover import recover as run
    plan, rec = run(inv, None, False, None, 300.0, None)
    stamp = time.strftime("%H:%M:%S")
    if json_out:
        rec.as_report(plan, False).print_json(None)
    elif rec.path != "none":
        console().print(f"{stamp} recover: {rec.describe()}: {', '.join(rec.services) or '-'}: "
                        + (f"FAILED: {rec.failure}" if rec.failure else "; ".join(rec.why) if not rec.ok else
                           "recovered"), soft_wrap=True, markup=False)
    if rec.path == "budget":
        if not json_out:
            console().print(f"{stamp} health --watch --recover: stopped acting: {rec.failure}", soft_wrap=True,
                            markup=False)
        return 1
    return None
