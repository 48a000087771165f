"""inv nccl-check: an all-reduce in short-lived containers before launch, its transport and bandwidth."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text

from . import checks_table, console, load, rtask, verdict_table


@rtask(help={"sizes": "message sizes, e.g. 1M,16M,256M,1G (default: nccl_check_sizes)",
             "timeout": "seconds the probe may run (default: nccl_check_timeout_s)"},
       numbers={"timeout": float})
def nccl_check(inventory=None, sizes=None, timeout=None, json=False, set_=None):
    """All-reduce in short-lived containers before launch, over the rail (two stations) or across the GPUs of one host: transport and bandwidth."""
    from ..verbs.nccl_check import nccl_check as run, nccl_report, parse_sizes
    inv = load(inventory, set_)
    if sizes:
        parse_sizes(sizes)
    rep = run(inv, sizes, timeout, None if json else console(stderr=True))
    report = nccl_report(rep)
    if json:
        return report.print_json()
    con = console()
    if hasattr(rep, "local_ranks"):
        return _nccl_one_host_out(con, rep, report)
    con.print(verdict_table(rep.ranks, "nccl-check: transport per rank"))
    b = Table(title="all-reduce (slowest rank per size)", title_justify="left")
    for c in ("size", "time", "algbw", "busbw", "of the link"):
        b.add_column(c, justify="right")
    for s in rep.sizes:
        b.add_row(_size(s.bytes), f"{s.time_ms:.2f} ms", f"{s.algbw_gbs:.2f} GB/s", f"{s.busbw_gbs:.2f} GB/s",
                  f"{s.busbw_gbs * 8000 / rep.link_speed_mbps * 100:.0f} %")
    con.print(b)
    for e in rep.errors:
        con.print(Text(f"error: {e}", style="bold red"))
    frac = "-" if rep.link_fraction is None else f"{rep.link_fraction * 100:.0f} %"
    con.print(Text(f"{'OK' if report.ok else 'FAILED'}: largest size reached {frac} of {rep.link_speed_mbps} Mb/s "
                   f"(threshold {rep.threshold * 100:.0f} %); probe containers removed on "
                   f"{', '.join(rep.removed) or 'none'}", style="bold green" if report.ok else "bold red"))
    return report.exit_code


def _nccl_one_host_out(con, rep, report) -> int:
    con.print(checks_table(report.checks, f"nccl-check: {rep.local_ranks} GPUs of {rep.host} ({rep.layout})"))
    b = Table(title=f"all-reduce across {rep.local_ranks} GPUs (slowest rank per size)", title_justify="left")
    for c in ("size", "time", "algbw", "busbw"):
        b.add_column(c, justify="right")
    for s in rep.sizes:
        b.add_row(_size(s.bytes), f"{s.time_ms:.3f} ms", f"{s.algbw_gbs:.2f} GB/s", f"{s.busbw_gbs:.2f} GB/s")
    con.print(b)
    busbw = f"{rep.sizes[-1].busbw_gbs:.1f} GB/s" if rep.sizes else "-"
    t = rep.transport
    how = " + ".join(x for x in ((t.transport if t else None), ("NVLS" if t and t.nvls else None)) if x) or \
        "no transport seen"
    con.print(Text(f"{'OK' if report.ok else 'FAILED'}: {how}, largest size's bus bandwidth {busbw} "
                   f"(threshold {rep.min_busbw_gbs:g} GB/s); probe container removed on "
                   f"{', '.join(rep.removed) or 'none'}", style="bold green" if report.ok else "bold red"))
    return report.exit_code


def _size(n: int) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div} {unit}"
    return f"{n} B"
