"""Reports: a rich table for people, one JSON document for machines."""

from __future__ import annotations

import json
import os
import sys
from collections import Counter

from rich.console import Console
from rich.table import Table
from rich.text import Text

from .checks import CheckResult

STYLE = {"pass": "green", "warn": "yellow", "fail": "bold red", "skip": "dim"}


def console(stderr: bool = False) -> Console:
    stream = sys.stderr if stderr else sys.stdout
    # piped into a file or a pager: don't squeeze fingerprints and evidence into 80 columns
    width = None if stream.isatty() or os.environ.get("COLUMNS") else 160
    return Console(stderr=stderr, highlight=False, soft_wrap=False, width=width)


def checks_json(results: list[CheckResult]) -> str:
    ok = not any(r.status == "fail" for r in results)
    return json.dumps({"ok": ok, "checks": [r.as_dict() for r in results]}, indent=2)


def checks_table(results: list[CheckResult], title: str) -> Table:
    t = Table(title=title, title_justify="left", show_lines=False, expand=False)
    t.add_column("host", style="bold", no_wrap=True)
    t.add_column("check", no_wrap=True)
    t.add_column("status", no_wrap=True)
    t.add_column("evidence", overflow="fold")
    needs_fix = any(r.status in ("fail", "warn") for r in results)
    if needs_fix:
        t.add_column("fix", overflow="fold")
    last = None
    for r in results:
        if last is not None and r.host != last:
            t.add_section()
        last = r.host
        ev = Text(r.detail)
        if r.evidence:
            ev.append("\n" + r.evidence, style="dim")
        row = [r.host, r.check, Text(r.status.upper(), style=STYLE.get(r.status, "")), ev]
        if needs_fix:
            row.append(Text(r.hint, style="cyan") if r.status in ("fail", "warn") else "")
        t.add_row(*row)
    return t


def summary(results: list[CheckResult]) -> str:
    c = Counter(r.status for r in results)
    hosts = len({r.host for r in results})
    parts = [f"{c[s]} {s}" for s in ("pass", "warn", "fail", "skip") if c[s]]
    verdict = "FAILED" if c["fail"] else "OK"
    return f"{verdict}: {', '.join(parts)} across {hosts} host(s)"


def print_checks(results: list[CheckResult], as_json: bool, title: str) -> None:
    if as_json:
        sys.stdout.write(checks_json(results) + "\n")
        return
    con = console()
    con.print(checks_table(results, title))
    failed = [r for r in results if r.status == "fail"]
    style = "bold red" if failed else "bold green"
    con.print(Text(summary(results), style=style))
