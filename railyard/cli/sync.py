"""inv sync-model: the checkpoint from the head to every other rank, the copies proven equal."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.table import Table
from rich.text import Text

from ..checks import PASS
from ..verbs.sync import staged_checks
from . import console, load, rtask

if TYPE_CHECKING:
    from ..verbs.sync import CopyPlan, SyncReport


@rtask(help={"source": "copy from this host (default: the head)",
             "to": "copy to these hosts, comma-separated (default: every other host)",
             "verify": "content (sha256 of every file, the default) or size (names and sizes only)",
             "streams": "parallel rsync streams per target (default: sync_streams)",
             "dry-run": "show the plan and the exact commands; change nothing",
             "repair": "re-send only the files that differ (and remove extra ones), then verify again",
             "rehash": "ignore the hosts' digest caches and hash every file again",
             "bwlimit": "limit each rsync stream to this many MB/s",
             "transport": "ssh (rsync over SSH, the default: sync_transport) or rsyncd (a one-time rsync daemon "
                          "on each target's rail address, unencrypted: for public weights on direct links)"},
       numbers={"streams": int, "bwlimit": float})
def sync_model(inventory=None, source=None, to=None, verify=None, streams=None, dry_run=False, repair=False,
               json=False, rehash=False, bwlimit=None, set_=None, transport=None):
    """Copy the checkpoint from the head to every other rank with rsync and prove the copies equal."""
    from ..verbs.sync import SyncOptions
    from ..verbs.sync import sync_model as run, sync_report
    inv = load(inventory, set_)
    con = console(stderr=json)
    opts = SyncOptions(source, to, verify, streams, dry_run, repair, rehash, bwlimit, transport)
    rep = run(inv, opts, View(con))
    report = sync_report(rep)
    if json:
        return report.print_json()
    print_report(rep, console())
    return report.exit_code


class View:
    """What sync-model shows while it works: its steps dim, a download's own output, the copies' bars."""

    def __init__(self, console):
        self.console = console

    def say(self, message: str) -> None:
        self.console.print(message, style="dim")

    def out(self, text: str) -> None:
        self.console.out(text, end="")

    def bars(self, plans: dict[str, CopyPlan]) -> "Bars":
        return Bars(self.console, plans)


class Bars:
    """One rich progress display: a bar per target and one overall, fed with the bytes each target has."""

    def __init__(self, console, plans: dict[str, CopyPlan]):
        from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                                   TransferSpeedColumn)
        self.rich = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                             TransferSpeedColumn(), TimeRemainingColumn(), console=console, transient=False)
        self.done: dict[str, int] = {}
        self.tasks = {t: self.rich.add_task(f"-> {t}", total=p.bytes) for t, p in plans.items() if not p.empty}
        total = sum(p.bytes for p in plans.values())
        self.overall = self.rich.add_task("all targets", total=total) if len(self.tasks) > 1 else None

    def update(self, target: str, completed: int) -> None:
        self.done[target] = completed
        self.rich.update(self.tasks[target], completed=completed)
        if self.overall is not None:
            self.rich.update(self.overall, completed=sum(self.done.values()))

    def __enter__(self) -> "Bars":
        self.rich.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.rich.stop()


def print_report(rep: SyncReport, console) -> None:
    """The copy's table (or the dry run's plan, or the failure with its commands) and the verdict line."""
    if rep.failure:
        console.print(Text(f"FAILED: {rep.failure}", style="bold red"))
        if rep.hint:
            console.print(Text(f"fix: {rep.hint}", style="cyan"))
        for host, cmds in rep.commands.items():
            for line in cmds:
                console.print(f"{host}$ {line}", soft_wrap=True)
        return
    if rep.dry_run:
        for note in rep.notes:
            console.print(note)
        for name, planned in rep.copies.items():
            p = planned.plan
            assert p is not None  # a dry run's copies are its plans
            console.print(f"{name}: would send {len(p.send)} file(s), resume {len(p.resume)}, "
                          f"{p.equal} already equal, {_gb(p.bytes)} to transfer"
                          + (f"; {len(p.extra)} extra file(s) on {name}" if p.extra else ""))
        for host, cmds in rep.commands.items():
            for line in cmds:
                console.print(f"{host}$ {line}", soft_wrap=True, highlight=False)
        console.print("dry run: nothing was changed", style="bold")
        return
    over = "" if rep.transport == "ssh" else f", over {rep.transport}: unencrypted on the rail"
    t = Table(title=f"sync-model: {rep.source} -> {', '.join(rep.targets)} (verify: {rep.verify}{over})",
              title_justify="left")
    for col in ("host", "files", "size", "copy", "verify", "model"):
        t.add_column(col, overflow="fold")
    for name in [rep.source] + rep.targets:
        m = rep.manifests.get(name)
        c = rep.copies.get(name)
        copy: str | Text = "source"
        if c is not None and c.plan is not None:
            copy = "nothing to send" if c.plan.empty and not rep.repaired.get(name) else \
                f"{_gb(c.bytes_sent)} sent in {c.seconds:.1f} s" + (f" ({_gb(c.bytes_sent / c.seconds)}/s)" if c.seconds > 0.5 else "")
            if c.errors:
                copy = Text("; ".join(c.errors), style="bold red")
        diffs = rep.differences.get(name, [])
        verify = Text("equal", style="green") if name != rep.source and not diffs else \
            Text("\n".join(str(d) for d in diffs[:20]) + (f"\n... {len(diffs) - 20} more" if len(diffs) > 20 else ""),
                 style="bold red") if diffs else Text("reference", style="dim")
        if m and m.cache and name != rep.source or (m and m.cache and name == rep.source):
            verify.append(f"\nhashed {m.cache['hashed']}, cached {m.cache['hits']} ({m.seconds:.1f} s)", style="dim")
        problems = rep.model.get(name, [])
        model = Text("; ".join(problems), style="bold red") if problems else Text("valid", style="green")
        t.add_row(name, str(len(m.files)) if m else "?", _gb(m.total_bytes) if m else "?", copy, verify, model)
    if rep.targets:
        console.print(t)
    for note in rep.notes:
        console.print(note, style="yellow" if "only" in note else None)
    for k in rep.staged:   # what the engine fetches at a first start: staged on the source, equal on the targets
        for check in staged_checks(k, rep.source, rep.targets):
            console.print(Text(f"staged on {check.host}: {check.detail}" + (f" ({check.evidence})" if check.evidence
                                                                             else ""),
                               style="green" if check.status == PASS else "bold red"), soft_wrap=True)
            if check.status != PASS and check.hint:
                console.print(Text(f"fix: {check.hint}", style="cyan"))
    for name, fixed in rep.repaired.items():
        if fixed:
            console.print(f"repaired on {name}: " + "; ".join(fixed))
    if any(c.errors for c in rep.copies.values()):
        fix = next((c.hint for c in rep.copies.values() if c.errors and c.hint), "")
        console.print(Text(f"fix: {fix}" if fix else "the copy was interrupted: run sync-model again; finished files "
                           "are not sent again and partial ones are continued", style="cyan"))
    done = "OK: copies equal and the model valid" if rep.targets else "OK: staged"
    console.print(Text(done if rep.ok else "FAILED: differences, an invalid model or a failed staging (see above); "
                       "--repair re-sends only what differs", style="bold green" if rep.ok else "bold red"))


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"
