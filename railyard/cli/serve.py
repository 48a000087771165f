"""The serving tasks: env, launch, launch-script, start, stop, status, logs, unlock, render."""

from __future__ import annotations

import sys

from rich.table import Table
from rich.text import Text

from ..errors import UsageError
from . import JSON, console, live_table, load, rtask

RANK_ORDER = "start order, e.g. B,A (default: workers first, then the head)"
TIMEOUT = "seconds to wait for `Application startup complete` and /health (default: vllm_start_timeout_s)"


@rtask(help={"check": "show the diff against the hosts and change nothing (exit 1 if any differ)"})
def env(inventory=None, check=False, set_=None):
    """Render one env file per service (GPUs, GID index, IPs from the hosts) into env/ and onto each host, 0600."""
    from ..verbs.serve import env as run
    inv = load(inventory, set_)
    con = console()
    files, written = run(inv, check)
    for f in files:
        if f.changed:
            con.print(f.diff(), highlight=False, markup=False, end="")
        else:
            con.print(f"{f.host}: {f.path} is current", style="green")
    if check:
        changed = [f.host for f in files if f.changed]
        con.print(f"--check: {len(changed)} file(s) would change ({', '.join(changed) or 'none'}); nothing written "
                  "to the hosts", style="bold")
        return 1 if changed else 0
    where = files[0].local
    assert where is not None  # plan_env gives each file its local path, and write_local wrote it there
    con.print(f"rendered {len(files)} env file(s) into {where.parent}/; written on: "
              f"{', '.join(written) or 'none (all current)'}")
    return 0


def _print_timeline(rep, con) -> None:
    if not rep.timeline:
        return
    con.print(timeline_table(rep.timeline))
    if rep.timeline_previous:
        con.print(f"previous launch: {rep.timeline_previous['written_at']} by {rep.timeline_previous['by']}",
                  style="dim", markup=False)
    if rep.timeline_file:
        con.print(f"kept for the next launch: {rep.timeline_file}", style="dim", markup=False)
    if rep.timeline_note:
        con.print(rep.timeline_note, style="yellow", markup=False)


def _print_launch(rep, con, what: str) -> int:
    _print_timeline(rep, con)
    if rep.failure:
        con.print(Text(f"FAILED: {rep.failure}", style="bold red"))
        for host, text in rep.logs.items():
            con.print(Text(f"--- last lines of {host}'s log ---", style="bold"))
            con.print(text.rstrip() or "(empty)", highlight=False, markup=False)
        if rep.rolled_back:
            con.print(f"rolled back (stopped and removed) on: {', '.join(rep.rolled_back)}")
        con.print(Text(f"fix: {rep.hint}", style="cyan"))
        return 1
    if rep.noop:
        con.print(Text(f"{what}: already running with this configuration on {', '.join(rep.order)}: nothing to do",
                       style="green"))
        return 0
    if rep.kept:
        con.print(f"kept, already running with this configuration: {', '.join(rep.kept)}")
    if rep.proof:
        con.print(Text(f"P->D path: {rep.proof}", style="green"))
    ep = rep.plan.endpoint
    key = f"the key is in {ep.api_key_file} on {ep.host}" if ep.api_key_file else "it takes no API key"
    con.print(Text(f"{what}: ready in {rep.ready_seconds:.1f} s ({' -> '.join(rep.order)}); API {rep.api} ({key})",
                   style="bold green"))
    if rep.canary:
        con.print(rep.canary, style="yellow" if "not recorded" in rep.canary else "dim", markup=False)
    return 0


@rtask(help={"rank-order": RANK_ORDER, "dry-run": "print the exact docker run per host; change nothing",
             "recreate": "replace containers that exist with another configuration (or stopped)",
             "timeout": TIMEOUT, "rollback": "on failure, stop and remove what this launch started"},
       json_help=JSON + " (the live table goes to stderr)", numbers={"timeout": float})
def launch(inventory=None, rank_order=None, dry_run=False, recreate=False, timeout=None, rollback=False, json=False,
           set_=None):
    """Start the layout's services stage by stage, gated, until its endpoint serves /health; then each vLLM
    container's bring-up timeline (weights, KV cache, engine, API) beside the previous launch's."""
    from ..verbs.serve import launch as run
    inv = load(inventory, set_)
    con = console(stderr=json)  # --json: the live table on stderr, the one document on stdout
    rep = run(inv, rank_order, dry_run, recreate, timeout, rollback, live_table(con, "launch"))
    if json:
        from ..verbs.serve import launch_report
        return launch_report(rep, dry_run).print_json()
    for note in rep.plan.notes if rep.plan else ():   # what vLLM will do other than asked, without failing
        con.print(f"note: {note}", style="yellow", markup=False)
    if dry_run:
        from ..apply.executor import describe
        assert rep.plan is not None  # a dry run's report always carries its plan
        for svc in rep.plan.services():
            con.print(f"# {describe(svc)}", style="bold")
            con.print(rep.commands[svc.name], highlight=False, markup=False, soft_wrap=True)
        if rep.hint:
            con.print(rep.hint, style="yellow")
        con.print("dry run: nothing was changed", style="bold")
        return 0
    return _print_launch(rep, con, "launch")


@rtask(help={"out": "write DIR/launch_server.sh (created if missing)"})
def launch_script(inventory=None, out=None, set_=None):
    """Write a self-contained launch_server.sh for a one-host layout (reads PORT and MODEL_PATH); no SSH."""
    from ..verbs.serve import launch_script as run
    if not out:
        raise UsageError("--out DIR: where to write launch_server.sh")
    path = run(load(inventory, set_), out)
    console().print(f"wrote {path}: run it with PORT and MODEL_PATH set (e.g. PORT=8000 MODEL_PATH=/models/m {path})")
    return 0


@rtask()
def unlock(inventory=None, set_=None):
    """Remove the operator lock on the head (launch, start, stop and sync-model take it), naming its owner."""
    from ..apply.lock import lock_host
    from ..verbs.serve import unlock as run
    inv = load(inventory, set_)
    holder = run(inv)
    host = lock_host(inv).name
    console().print(f"{host}: removed the lock of {holder.describe()}" if holder else f"{host}: no lock was held")
    return 0


@rtask()
def stop(inventory=None, set_=None):
    """Stop the services in reverse start order (the head first; docker stop --timeout 60); confirm the GPUs are free."""
    from ..verbs.serve import stop as run
    inv = load(inventory, set_)
    con = console()
    res = run(inv)
    for r in res:
        ok = r.status in ("exited", "missing") and r.gpu_free
        con.print(f"{r.host} ({r.service}): {r.detail}", style="green" if ok else "bold red")
    return 0 if all(r.status in ("exited", "missing") and r.gpu_free for r in res) else 1


@rtask(help={"rank-order": RANK_ORDER, "timeout": TIMEOUT}, numbers={"timeout": float})
def start(inventory=None, rank_order=None, timeout=None, set_=None):
    """Resume the stopped containers in start order, with the same gates as launch."""
    from ..verbs.serve import start as run
    inv = load(inventory, set_)
    con = console()
    return _print_launch(run(inv, rank_order, timeout, live_table(con, "start")), con, "start")


@rtask()
def status(inventory=None, json=False, set_=None):
    """Per service: container state, uptime, image digest, GPU memory used."""
    from ..verbs.serve import status as run, status_report
    inv = load(inventory, set_)
    rows, recoveries = run(inv)
    report = status_report(rows, recoveries)
    if json:
        return report.print_json()
    t = Table(title="status", title_justify="left")
    for c in ("rank", "host", "service", "container", "state", "uptime", "image", "GPU memory"):
        t.add_column(c, overflow="fold")
    for r in rows:
        mem = r.get("gpu_memory")
        t.add_row("-" if r["rank"] is None else str(r["rank"]), r["host"], r["service"], r.get("container", ""),
                  r["state"] + ("" if r.get("config_current", True) or not r.get("running") else
                                " (another configuration: launch --recreate)"),
                  f"{r['uptime_s']:.0f} s" if r.get("uptime_s") is not None else "-",
                  ("pinned digest" if r.get("pinned_digest_ok") else "NOT the pinned digest") if r.get("image_id") else "-",
                  f"{mem['used_mib']} / {mem['total_mib']} MiB" if mem else "-")
    con = console()
    con.print(t)
    show_recoveries(con, recoveries)
    bad = [f"{c.host}: {c.detail}" for c in report.checks if c.status == "fail"]
    con.print(Text("OK: every service runs with the current configuration" if report.ok else
                   "FAILED: " + "; ".join(bad), style="bold green" if report.ok else "bold red"))
    return report.exit_code


def show_recoveries(con, rec: dict) -> None:
    """The recoveries inside the restart budget's window, and the restarts each service has left."""
    if rec.get("error"):
        con.print(Text(rec["error"], style="yellow"))
        return
    window = f"{rec['window_s'] / 60:g} min"
    if not rec["recent"]:
        con.print(f"recoveries: none in the last {window} ({rec['file']})")
    else:
        con.print(f"recoveries in the last {window} ({rec['file']}):")
        for r in rec["recent"]:
            outcome = "ok" if r.get("ok") else f"FAILED: {r.get('failure')}"
            con.print(f"  {r.get('at')} {r.get('path')} {', '.join(r.get('services', []))} in {r.get('seconds')} s, "
                      f"{outcome}; why: {'; '.join(r.get('why', []))}", soft_wrap=True, markup=False)
    con.print("restart budget left: " + ", ".join(f"{k} {n} of {rec['budget']}" for k, n in rec["left"].items())
              + f" (in {window})")
    if rec.get("hang_dump"):
        con.print(f"latest hang dump: {rec['hang_dump']} (inv hang-dump takes another)", markup=False)
    roll = rec.get("last_roll")
    if roll:
        c = roll.get("change") or {}
        con.print(f"last roll: {roll.get('at')} {c.get('what')} {c.get('from')} -> {c.get('to')}, {roll.get('path')}, "
                  f"{roll.get('seconds')} s" + (f", downtime {roll['downtime_s']} s" if roll.get("downtime_s") is not None
                                                else "") + (", ok" if roll.get("ok") else f", FAILED: {roll.get('failure')}"),
                  soft_wrap=True, markup=False)


@rtask(help={"rank": "host name (B), rank number (1) or service name", "follow": "keep following",
             "lines": "only the last N lines"}, numbers={"lines": int})
def logs(inventory=None, rank=None, follow=False, lines=None, set_=None):
    """Show one service's container log (a one-host layout needs no --rank)."""
    from ..verbs.serve import logs as run
    inv = load(inventory, set_)
    return run(inv, rank, follow, lines, lambda text: (sys.stdout.write(text), sys.stdout.flush()))


@rtask(help={"compose": "write DIR/docker-compose.yml and the files it mounts"})
def render(inventory=None, compose=None, set_=None):
    """Write the deployment in another form (a Docker Compose project), rendered from the same plan."""
    from ..verbs.serve import render_compose
    if not compose:
        raise UsageError("--compose DIR: where to write docker-compose.yml")
    paths = render_compose(load(inventory, set_), compose)
    console().print(f"wrote {', '.join(str(p) for p in paths)}; run `docker compose up -d` in {compose} on the host")
    return 0


def _secs(v) -> str:
    return "not seen" if v is None else f"{v:.1f} s"


def timeline_table(timelines: list, title: str = "bring-up: seconds from the container's start "
                                                 "(the previous launch's in brackets)") -> Table:
    """One row per vLLM container: each milestone's time, `not seen`, or `n/a` where that rank has none."""
    from ..engines import MILESTONE_LABELS, MILESTONES
    t = Table(title=title, title_justify="left")
    for c in ("rank", "host", "service"):
        t.add_column(c, no_wrap=True)
    for m in MILESTONES:
        t.add_column(MILESTONE_LABELS[m], justify="right", no_wrap=True)
    t.add_column("notes", overflow="fold")
    for tl in timelines:
        cells = []
        for m in MILESTONES:
            if m in tl.not_applicable:
                cells.append(Text("n/a", style="dim"))
                continue
            v = tl.seconds.get(m)
            cell = Text(_secs(v), style="yellow" if v is None else "")
            if tl.previous is not None:
                cell.append(f" ({_secs(tl.previous.get(m)) if m in tl.previous else '-'})", style="dim")
            cells.append(cell)
        t.add_row("-" if tl.rank is None else str(tl.rank), tl.host, tl.service, *cells,
                  Text(tl.error, style="yellow") if tl.error else "")
    return t
