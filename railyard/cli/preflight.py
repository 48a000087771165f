"""inv preflight: every host checked before launch, the verdicts as a table or one JSON document."""

from __future__ import annotations

from collections import Counter

from rich.text import Text

from ..checks import CheckResult
from . import checks_table, console, load, rtask


@rtask()
def preflight(inventory=None, json=False, set_=None):
    """Check every host before launch: rails, MTU, jumbo ping, GID, clocks, disk, GPU, Docker, image, SSH."""
    from ..verbs.preflight import run_preflight
    inv = load(inventory, set_)
    if json:
        return print_checks(run_preflight(inv), True, "")
    err = console(stderr=True)
    err.print(f"preflight: {len(inv.hosts)} host(s) from {inv.path}", style="dim")
    waiting = [h.name for h in inv.hosts]
    with err.status(f"probing {len(waiting)} host(s)") as status:
        def landed(name: str, probe) -> None:
            waiting.remove(name)
            ssh = getattr(probe, "ssh", None)
            if ssh is not None and ssh.status != "pass":  # say it now; the other hosts' probes go on
                err.print(f"preflight: {name}: {ssh.detail}", style="red", markup=False)
            status.update(f"probed {len(inv.hosts) - len(waiting)} of {len(inv.hosts)} host(s); "
                          + ("waiting for " + ", ".join(waiting[:8]) + (" ..." if len(waiting) > 8 else "")
                             if waiting else "judging"))
        results = run_preflight(inv, landed)
    return print_checks(results, False, f"railyard preflight — {inv.path.name}")


def summary(results: list[CheckResult]) -> str:
    c = Counter(r.status for r in results)
    hosts = len({r.host for r in results})
    parts = [f"{c[s]} {s}" for s in ("pass", "warn", "fail", "skip") if c[s]]
    verdict = "FAILED" if c["fail"] else "OK"
    return f"{verdict}: {', '.join(parts)} across {hosts} host(s)"


def print_checks(results: list[CheckResult], as_json: bool, title: str) -> int:
    """preflight's output: the document, or the table and a summary line; returns the exit code."""
    from ..verbs.preflight import preflight_report
    rep = preflight_report(results)
    if as_json:
        return rep.print_json()
    con = console()
    con.print(checks_table(results, title))
    con.print(Text(summary(results), style="bold green" if rep.ok else "bold red"))
    return rep.exit_code
