"""The task layer: how an `inv` task is declared, once, beside its view.

Each module here (preflight, hosts, sync, serve, verify, health, recover, nccl, capacity, export,
collect, bench, hang) declares its tasks with `@rtask`: the function's parameters are the task's flags
(their order gives invoke's short flags), its body calls the verb and renders what it returns. tasks.py
only puts the modules' tasks into one namespace.

`rtask` adds what every task shares: the help of `--inventory`, `--set` (repeatable KEY=VALUE)
and `--json` where the function has them; numeric flags converted once (`numbers=`, a bad value is
one line and exit 2); and `entry`: expected errors become one line on stderr and an exit code (2 for
usage and inventory errors), never a traceback. Every `--json` output is a railyard.report.Report
(its docstring has the contract and the exit codes).

Imports: the views import at module level, except the verbs (railyard.verbs.*, railyard.bench.run,
railyard.apply.*, a layout's package) and what builds a plan beside them: every `inv` start, `--list`
and each tab completion imports every task's module, and the verbs with their SSH, render and layout
stacks would add about a third to each (0.3 s here); a task imports its verb when it runs.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys

from invoke import Context, Task
from invoke.exceptions import Exit
from invoke.parser import Argument
from rich.console import Console
from rich.live import Live
from rich.table import Table
from rich.text import Text

from ..checks import PASS, CheckResult
from ..errors import InventoryError, RailyardError
from ..inventory import Inventory, load_inventory
from ..report import error_report

INVENTORY = "inventory YAML file (default: $RAILYARD_INVENTORY)"
SET = "override a variable, KEY=VALUE (repeatable; highest precedence)"
JSON = "print one JSON document instead of the table"
STYLE = {"pass": "green", "warn": "yellow", "fail": "bold red", "skip": "dim"}


def console(stderr: bool = False) -> Console:
    stream = sys.stderr if stderr else sys.stdout
    # piped into a file or a pager: don't squeeze fingerprints and evidence into 80 columns
    width = None if stream.isatty() or os.environ.get("COLUMNS") else 160
    return Console(stderr=stderr, highlight=False, soft_wrap=False, width=width)


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
        row: list[str | Text] = [r.host, r.check, Text(r.status.upper(), style=STYLE.get(r.status, "")), ev]
        if needs_fix:
            row.append(Text(r.hint, style="cyan") if r.status in ("fail", "warn") else "")
        t.add_row(*row)
    return t


def verdict_table(verdicts: list, title: str) -> Table:
    """The NCCL transport of every judged log, for verify-rdma and nccl-check alike."""
    t = Table(title=title, title_justify="left")
    for c in ("source", "verdict", "transport", "GDRDMA", "HCAs", "NCCL", "reasons"):
        t.add_column(c, overflow="fold")
    for r in verdicts:
        t.add_row(r.source, Text(r.verdict.upper(), style="green" if r.verdict == PASS else "bold red"),
                  r.net_transport or "none seen", "yes" if r.gdrdma else "no", ", ".join(r.hcas) or "-",
                  r.nccl_version or "?", Text("\n".join(r.reasons), style="red") if r.reasons else
                  Text("\n".join(getattr(r, "notes", [])), style="yellow"))
    return t


def entry(fn):
    """Run a task body: expected errors become a message and an exit code. Under --json an error
    that is not a usage error (exit 1) also prints the task's one document, with one failed check."""
    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            code = fn(*args, **kwargs)
        except InventoryError as e:
            for p in e.problems:
                print(f"error: {p}", file=sys.stderr)
            raise Exit(code=e.exit_code)
        except RailyardError as e:
            print(f"error: {e}", file=sys.stderr)
            if e.exit_code == 1 and _json_out(sig, args, kwargs):
                error_report(fn.__name__, str(e)).print_json()
            raise Exit(code=e.exit_code)
        except KeyboardInterrupt:
            # the task's own cleanup (its lock, the live display) ran on the way up; the threads still
            # waiting on remote commands are not waited for: leaving drops their connections, and what
            # ran on a host over them ends with them (rsync on its next write), as after ssh's ^C
            print("interrupted: what had started on the hosts is as it was; run the task again to resume "
                  "(`inv status` shows what runs)", file=sys.stderr)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(130)
        if code:
            raise Exit(code=code)
    return wrapper


def _json_out(sig: inspect.Signature, args, kwargs) -> bool:
    try:
        return bool(sig.bind(*args, **kwargs).arguments.get("json"))
    except TypeError:
        return False


def number(value, flag: str, kind=int):
    """A numeric flag from invoke (which hands over strings); a bad one is a usage error, exit 2."""
    if value is None:
        return None
    try:
        return kind(value)
    except (TypeError, ValueError):
        print(f"error: {flag} {value!r}: not a number", file=sys.stderr)
        raise Exit(code=2)


def load(path: str | None, overrides) -> Inventory:
    """The inventory of `--inventory` and `--set` (the one place the task layer loads it), after every layout
    has registered (railyard.plan.layout: serve_layout is checked against them)."""
    from .. import layouts  # noqa: F401  (imported for its registrations; here, not at start: inv --list stays fast)
    return load_inventory(path, overrides)


def remainder(argv: list[str] | None = None) -> list[str]:
    """The words after `--` on the command line (invoke keeps them away from tasks)."""
    argv = sys.argv if argv is None else argv
    return argv[argv.index("--") + 1:] if "--" in argv else []


def _flag(name: str) -> str:
    return "--" + name.rstrip("_").replace("_", "-")


class _NumberArgument(Argument):
    """A flag whose default is a number (invoke casts it while parsing): a bad value is the same one
    line and exit 2 as a flag converted by `number`, not invoke's traceback."""

    def set_value(self, value, cast: bool = True) -> None:
        try:
            super().set_value(value, cast)
        except ValueError:
            print(f"error: --{self.names[0]} {value!r}: not a number", file=sys.stderr)
            raise Exit(code=2)


class RTask(Task):
    """An invoke task whose body takes no context (no railyard task uses it): invoke's executor hands
    one over, which is dropped; called directly (tests), the task takes just its flags."""

    def argspec(self, body):
        return inspect.signature(body)  # every parameter is a flag: there is no context to drop

    def __call__(self, *args, **kwargs):
        if args and isinstance(args[0], Context):
            args = args[1:]
        result = self.body(*args, **kwargs)
        self.times_called += 1
        return result

    def get_arguments(self, ignore_unknown_help: bool | None = None) -> list[Argument]:
        kept = dict(self.help)  # invoke pops each help text as it uses it: keep them for the next parse
        try:
            args = super().get_arguments(ignore_unknown_help)
        finally:
            self.help = kept
        out = []
        for a in args:
            names = tuple(n for n in a.names if n != "-")  # invoke's auto short flag can be "-" (shown as "--=")
            if a.kind in (int, float) or names != a.names:
                a = (_NumberArgument if a.kind in (int, float) else Argument)(
                    names=names, kind=a.kind, default=a.default, help=a.help, positional=a.positional,
                    optional=a.optional, incrementable=a.incrementable, attr_name=a.attr_name)
            out.append(a)
        return out


def rtask(*, help: dict | None = None, numbers: dict | None = None, iterable=(), positional=None,
          optional=(), json_help: str = JSON):
    """Declare a task: the function's parameters are its flags (`set_` is `--set`), its docstring the help.

    help: the task's own flags' help (`--inventory`, `--set` and `--json` have theirs; json_help
    replaces `--json`'s); numbers: {parameter: int or float}, converted before the body runs;
    iterable: repeatable flags besides `--set`; positional, optional (flags whose value may be left out): as
    invoke's."""
    def declare(body) -> RTask:
        params = inspect.signature(body).parameters
        shared = {"inventory": INVENTORY, "set_": SET, "json": json_help}
        texts = {k.rstrip("_"): v for k, v in shared.items() if k in params}
        texts.update(help or {})
        kinds = dict(numbers or {})
        run = entry(body)

        @functools.wraps(body)
        def convert(*args, **kwargs):
            bound = inspect.signature(body).bind(*args, **kwargs)
            for name, kind in kinds.items():
                if name in bound.arguments:
                    bound.arguments[name] = number(bound.arguments[name], _flag(name), kind)
            return run(*bound.args, **bound.kwargs)

        return RTask(convert, help=texts, positional=positional, optional=list(optional),
                     iterable=(["set_"] if "set_" in params else []) + list(iterable))
    return declare


class LiveTable:
    """Every service while launch, start, bench or recover waits (the executor's `show`), under the task's
    name: one row each, rank, host, service, phase and detail, redrawn on each change; nothing when there
    is no console."""

    def __init__(self, console, title: str, states: list) -> None:
        self.console = console
        self.title = title
        self.states = states
        self.live: Live | None = None

    def table(self) -> Table:
        t = Table(title=self.title, title_justify="left")
        for c in ("rank", "host", "service", "phase", "detail"):
            t.add_column(c, overflow="fold")
        for st in self.states:
            style = {"ready": "green", "failed": "bold red", "running": "cyan"}.get(st.phase, "")
            svc = st.service
            t.add_row("-" if svc.rank is None else str(svc.rank), svc.host, svc.name,
                      f"[{style}]{st.phase}[/]" if style else st.phase, st.detail[-100:])
        return t

    def __enter__(self) -> LiveTable:
        if self.console is not None:
            self.live = Live(self.table(), console=self.console, refresh_per_second=4, transient=False)
            self.live.start()
        return self

    def refresh(self) -> None:
        if self.live:
            self.live.update(self.table())

    def __exit__(self, *exc: object) -> None:
        if self.live:
            self.refresh()
            self.live.stop()
            self.console.print()


def live_table(console, title: str):
    """The executor's `show` for this console, titled by the task that waits (None: nothing shown)."""
    return functools.partial(LiveTable, console, title) if console is not None else None
