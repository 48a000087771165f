"""verify-rdma: NCCL or NIXL over the rails (health is railyard.cli.health, recover railyard.cli.recover)."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text

from ..report import NO_HOST
from . import console, load, rtask, verdict_table


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
