"""inv rdma-test: perftest on every rail of every host pair, judged against the link (before nccl-check)."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text

from . import checks_table, console, load, rtask

STYLE = {"pass": "green", "warn": "yellow", "fail": "bold red"}


@rtask(help={"hosts": "test these hosts only, e.g. A,B (default: every host)",
             "rails": "these rails only, by netdev, e.g. enp24s0np0,enp58s0np0 (default: every rail the hosts share)",
             "memory": "host, gpu (--use_cuda, the GPU nearest each NIC) or both (default host)",
             "duration": "seconds each bandwidth run lasts (default: rdma_test_duration_s)"},
       numbers={"duration": int})
def rdma_test(inventory=None, hosts=None, rails=None, memory="host", duration=None, json=False, set_=None):
    """Qualify every RDMA link with perftest: ib_write_bw and ib_write_lat per rail of each host pair (a ring at
    scale, each rail alone then all at once, host and GPU memory), judged against the link's rate."""
    from ..verbs.rdma_test import link_report, rdma_test as run
    inv = load(inventory, set_)
    err = console(stderr=True)
    t = run(inv, hosts, rails, memory, duration, None if json else lambda line: err.print(line, style="dim"))
    report = link_report(t)
    if json:
        return report.print_json()
    con = console()
    if t.checks:
        con.print(checks_table(t.checks, "rdma-test: what stopped a pair"))
    table = Table(title=f"rdma-test: {len(t.rounds)} round(s) of pairs over {', '.join(t.rails)}",
                  title_justify="left")
    for c in ("pair", "rail", "memory", "test", "figure", "of the link", "verdict"):
        table.add_column(c, overflow="fold")
    for m in t.measures:
        figure = (f"{m.gbps:.1f} Gb/s" if m.gbps is not None else "-") if m.test == "bw" else \
            (f"{m.lat_us:.2f} us" if m.lat_us is not None else "-")
        share = f"{m.gbps / m.expected_gbps:.2f} of {m.expected_gbps:g}" if m.gbps and m.expected_gbps else "-"
        table.add_row(m.pair.name, f"{m.rail} ({m.hca})", m.memory + (" (all rails)" if m.together else ""),
                      "bandwidth" if m.test == "bw" else "latency", figure, share,
                      Text(m.status.upper() + ("" if m.status == "pass" else f": {m.detail}"),
                           style=STYLE.get(m.status, "")))
    con.print(table)
    for m in t.measures:   # each failure whole, on one line: the table folds it
        if m.status == "fail":
            con.print(Text(f"fail: {m.where}: {m.detail}", style="red"), soft_wrap=True)
    bad = sum(1 for c in report.checks if c.status == "fail")
    con.print(Text(f"{'OK' if report.ok else 'FAILED'}: {len(t.measures)} run(s) on {len(t.hosts)} host(s) in "
                   f"{t.took_s:.1f} s" + (f"; {bad} failed" if bad else ""),
                   style="bold green" if report.ok else "bold red"))
    return report.exit_code
