"""recover: bring a dead or hung deployment back (`inv health --watch S --recover` runs it from its loop)."""

from __future__ import annotations

from rich.text import Text

from . import console, live_table, load, rtask


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
        con.print(Text("FAILED: blocked: nothing was changed (why: above)", style="bold red"))
    elif not dry_run and rec.path != "none":
        con.print(Text(f"OK: {', '.join(rec.services)} recovered", style="bold green"))
    return 0 if rec.ok else 1
