"""The verifying tasks: verify-rdma (NCCL or NIXL over the rails), health (one look or --watch), recover."""

from __future__ import annotations

import time

from rich.table import Table
from rich.text import Text

from ..errors import UsageError
from ..report import NO_HOST
from . import STYLE as STYLES, console, live_table, load, rtask, verdict_table


@rtask(help={"log": "judge this NCCL log file instead (repeatable; no SSH)"}, iterable=["log"])
def verify_rdma(inventory=None, log=None, json=False, set_=None):
    """Prove NCCL uses GPUDirect RDMA over the rail on every rank (not a silent TCP fallback)."""
    from ..checks.nccl import passed_line
    from ..checks.nixl import NixlVerdict
    from ..verbs.verify import judge_files, rdma_report, verify_rdma as run
    if log:
        results = judge_files(list(log))
        report = rdma_report(results, host_of=lambda source: NO_HOST)  # files on this machine: no host
    else:
        plan, results = run(load(inventory, set_))
        if results and isinstance(results[0], NixlVerdict):  # the layout's own: KV blocks over NIXL, no NCCL
            return _nixl_verdicts(plan, results, json)
        if not results:  # a one-host layout: no rail carries NCCL traffic
            msg = f"SKIP: layout {plan.layout} runs on one host; NCCL stays inside it, no rail to verify"
            report = rdma_report([], skipped=msg, skip_host=plan.hosts()[0], layout=plan.layout)
            if json:
                return report.print_json()
            console().print(Text(msg, style="yellow"))
            return report.exit_code
        report = rdma_report(results)
    if json:
        return report.print_json()
    con = console()
    con.print(verdict_table(results, "verify-rdma: NCCL transport per rank"))
    con.print(Text(passed_line(results, on_the_rail=not log) if report.ok else
                   "FAILED: see the reasons; a socket fallback makes a multi-node model several times slower",
                   style="bold green" if report.ok else "bold red"))
    return report.exit_code


def _nixl_verdicts(plan, verdicts: list, json_out: bool) -> int:
    from ..plan import layout as layouts
    report = layouts.by_name(plan.layout).rdma_report(verdicts)
    assert report is not None  # a layout with its own verify_rdma has its own report of them
    if json_out:
        return report.print_json()
    con = console()
    t = Table(title="verify-rdma: NIXL (UCX) transport per instance", title_justify="left")
    for c in ("source", "verdict", "transport", "devices", "reasons"):
        t.add_column(c, overflow="fold")
    for v in verdicts:
        t.add_row(v.source, Text(v.verdict.upper(), style="green" if v.verdict == "pass" else "bold red"),
                  v.transport or "none seen", ", ".join(v.devices) or "-",
                  Text("\n".join(v.reasons), style="red") if v.reasons else "")
    con.print(t)
    con.print(Text("OK: KV blocks move over RDMA on the rails" if report.ok else
                   "FAILED: see the reasons; KV over TCP makes every request's TTFT pay for it",
                   style="bold green" if report.ok else "bold red"))
    return report.exit_code


def _health_look(inv, cache_proof: int = 0, canary: str = ""):
    """One look: (plan, ranks, probes, metrics, report)."""
    from ..verbs.verify import health as run, health_report
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


@rtask(help={"replica": "restart this service even if healthy, a planned restart: a replica (r0, r1, ...), an "
                        "instance (prefill-0, decode-0, ...) or the proxy",
             "dry-run": "print the path recover would take, why, and the restart budget left; change nothing",
             "timeout": "seconds each start may take to pass its gates (default: vllm_start_timeout_s)",
             "drain-timeout": "seconds to wait for a drained replica's requests in flight (default 300)"},
       numbers={"timeout": float, "drain_timeout": float})
def recover(inventory=None, replica=None, dry_run=False, timeout=None, drain_timeout=None, json=False, set_=None):
    """Bring a dead or hung deployment back: a replica alone (replicas), an instance alone (pd), else the group
    in stage order; a restart budget stops a crash loop, and every recovery is recorded (inv status shows it)."""
    from ..verbs.recover import recover as run
    con = console()
    plan, rec = run(load(inventory, set_), replica, dry_run, timeout, 300.0 if drain_timeout is None else drain_timeout,
                    None if json else live_table(con, "recover"))
    if json:
        return rec.as_report(plan, dry_run).print_json()
    con.print(Text(f"recover ({plan.deployment}): {rec.describe()}", style="bold"))
    for w in rec.why:
        con.print(f"  why: {w}")
    if dry_run or rec.path in ("none", "blocked"):
        for i, st in enumerate(rec.steps, 1):
            con.print(f"  {'would' if dry_run and rec.path != 'blocked' else 'do'} {i}. {st}")
    for d in rec.done:
        con.print(Text(f"  done: {d}", style="green"))
    if rec.failure:
        con.print(Text(f"FAILED: {rec.failure}", style="bold red"))
    elif rec.path == "blocked":
        con.print(Text("FAILED: recover does not touch a process it did not start", style="bold red"))
    elif not dry_run and rec.path != "none":
        con.print(Text(f"OK: {', '.join(rec.services)} recovered", style="bold green"))
    return 0 if rec.ok else 1
