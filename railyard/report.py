"""Reports: one JSON document for machines (the tables for people are the cli's).

Every `--json` task (preflight, sync-model, status, verify-rdma, health, nccl-check, plan)
prints exactly one document on stdout, built here by `Report`:

    {"ok": bool,
     "checks": [{"host", "check", "status": "pass|warn|fail|skip", "detail", "evidence", "hint"}],
     "data": {...the task's own payload...}}

`checks` holds one row per thing the task judged (the table shows the same verdicts); `ok` is
false exactly when a check failed; warn and skip never fail. A check about no single host
(the all-reduce bandwidth, a capacity plan) has host "-". `data` keeps everything the task
measured: preflight `{}`; status `ranks`; health `ranks`, `probes`, `metrics`; verify-rdma
`ranks` (and `skipped`, `layout` for a one-host layout); nccl-check `ranks`, `sizes`,
`link_fraction`, `threshold`, `link_speed_mbps`, `errors`, `removed` (one host: `layout`, `host`,
`local_ranks`, `transport`, `sizes`, `min_busbw_gbs`, `errors`, `removed`); sync-model `source`,
`verify`, `hosts`, ...; plan `model`, `assumptions`, `layouts` (plan also keeps those three
at the top level: its own contract, docs/plan.md). `health --watch --json` prints one such
document per round, each on one line.

Exit codes: 0 ok; 1 a check failed (`ok: false`); 2 usage or inventory error, one line per
problem on stderr and nothing on stdout. An error that stops a `--json` task before it could
judge anything (a host unreachable, a container that did not start) exits 1 with one
document whose only check, named after the task, fails with the message.

Only the contract lives here. Each task's adapter (its result -> checks + data) sits beside the verb
that produces the result (railyard.verbs.*, a layout's own module for a layout's own result); the
tables and the console are the cli's (railyard.cli).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field

from .checks import FAIL, PASS, SKIP, WARN, CheckResult

STATUSES = (PASS, WARN, FAIL, SKIP)
NO_HOST = "-"  # the host of a check about no single host


def host_of(source: str) -> str:
    """The host a verdict's source names (`HOST:...`); a source without one (a local file) is NO_HOST."""
    return source.split(":", 1)[0] if source else NO_HOST


def failed(checks: list[CheckResult]) -> bool:
    return any(c.status == FAIL for c in checks)


def exit_code(checks: list[CheckResult]) -> int:
    """0 when no check failed, 1 otherwise (2 is for usage errors, raised before any report)."""
    return 1 if failed(checks) else 0


def report_json(ok: bool, checks: list[CheckResult], data: dict, indent: int | None = 2, **top) -> str:
    """The one document of a --json task; `top` holds keys a task's own contract keeps beside them (plan)."""
    if ok != (not failed(checks)):
        raise ValueError(f"ok={ok} but {'a' if failed(checks) else 'no'} check failed")
    bad = [c for c in checks if c.status not in STATUSES]
    if bad:
        raise ValueError(f"check {bad[0].check} on {bad[0].host}: status {bad[0].status!r} is not one of {STATUSES}")
    return json.dumps({"ok": ok, "checks": [c.as_dict() for c in checks], "data": data, **top}, indent=indent)


@dataclass
class Report:
    checks: list[CheckResult]
    data: dict = field(default_factory=dict)
    top: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not failed(self.checks)

    @property
    def exit_code(self) -> int:
        return exit_code(self.checks)

    def json(self, indent: int | None = 2) -> str:
        return report_json(self.ok, self.checks, self.data, indent, **self.top)

    def print_json(self, indent: int | None = 2) -> int:
        sys.stdout.write(self.json(indent) + "\n")
        sys.stdout.flush()
        return self.exit_code


def error_report(task: str, message: str) -> Report:
    """A --json task stopped before it judged anything: one failed check named after the task."""
    return Report([CheckResult(NO_HOST, task, FAIL, message)], {"error": message})
