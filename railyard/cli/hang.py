"""inv hang-dump: every rank's stack, NCCL RAS's status, the flight recorder and the log's tail; the odd rank named."""

from __future__ import annotations

from rich.text import Text

from . import console, load, rtask


@rtask(help={"lines": "the engine log's last N lines per service (default 50)"}, numbers={"lines": int})
def hang_dump(inventory=None, json=False, lines=None, set_=None):
    """Each engine process's stack (py-spy, gdb) on every rank, NCCL RAS, the flight recorder; the odd rank named.

    Exit 0 when the hung verdict finds nothing hung (the stacks are still shown), 1 when a rank is hung or dead."""
    from ..verbs.hang_dump import LOG_LINES, hang_dump as run
    inv = load(inventory, set_)
    report = run(inv, lines or LOG_LINES)
    if json:
        return report.print_json()
    con = console()
    d = report.data
    for host, hd in d["hosts"].items():
        for note in hd["notes"]:
            con.print(Text(f"{host}: {note}", style="dim"))
        for sd in hd["services"]:
            con.print(Text(f"{host}/{sd['service']} ({sd['container']})", style="bold"))
            for note in sd["notes"]:
                con.print(Text(f"  {note}", style="yellow"))
            for p in sd["processes"]:
                head = f"  pid {p['pid']} {p['title']} (state {p['state']})"
                if p["stack"]:
                    con.print(f"{head}: {p['frame'] or '?'}  [{p['tool']}]")
                    main = next((t for t in p["stack"]["threads"] if t["name"] == "MainThread"), None) or \
                        (p["stack"]["threads"] or [None])[0]
                    for f in (main or {}).get("frames", [])[:12]:
                        con.print(Text(f"      {f['func']} ({f['where']})", style="dim"))
                else:
                    con.print(Text(f"{head}: no stack: " + "; ".join(p["failures"]), style="yellow"))
            if sd["ras"] and sd["ras"].get("line"):
                con.print(f"  {sd['ras']['line']}")
            for fr in sd["flight_recorder"]:
                con.print(f"  {fr['file']}: {fr.get('line') or fr.get('error')}")
            if sd["log_tail"].strip():
                tail = sd["log_tail"].rstrip().splitlines()[-5:]
                con.print(Text("  log: " + "\n       ".join(tail), style="dim"))
    for h, err in d["failed"].items():
        con.print(Text(f"{h}: not read: {err}", style="bold red"))
    con.print(f"ranks: {d['summary']['line']}")
    if d.get("kept"):
        con.print(Text(f"kept: {d['kept']}", style="dim"))
    for c in report.checks:
        if c.check == "kept":
            con.print(Text(c.detail, style="yellow"))
    if d["hung"]:
        con.print(Text(d["verdict"], style="bold red"))
    elif not report.ok:
        con.print(Text("FAILED: " + "; ".join(f"{c.host}: {c.detail}" for c in report.checks if c.status == "fail"),
                       style="bold red"))
    else:
        con.print(Text(f"OK: nothing is hung ({len(d['verdicts'])} services judged by the hung verdict)",
                       style="bold green"))
    return report.exit_code
