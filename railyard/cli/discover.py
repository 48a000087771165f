"""railyard discover: an inventory read from the hosts (their rails, the serving rail, their GPUs), written only
when everything in it was decided."""

from __future__ import annotations

import shlex
import sys

from rich.table import Table
from rich.text import Text

from . import console, rtask


@rtask(help={"hosts": "the hosts to read, comma-separated addresses or names; the first is the head (rank 0)",
             "user": "the SSH user (default: ansible_user from --set, else yours)",
             "out": "where to write the inventory (default: inventory.yml; never overwritten)",
             "dry_run": "print the inventory instead of writing it"},
       json_help="print one JSON document (the inventory's text under data.inventory) instead of the table")
def discover(hosts=None, user=None, out=None, dry_run=False, json=False, set_=None):
    """Read the hosts (rails, addresses, link speeds, GIDs, GPUs) and write an inventory preflight accepts.

    A rail is a subnet the hosts' rail netdevs share; the serving rail is the fastest one every host has (then
    the nearest the GPUs, then the first by HCA). What cannot be decided is one line each and nothing is
    written. `--set KEY=VALUE` values (the image, the model, ssh_known_hosts, ...) go into the inventory."""
    from ..verbs.discover import discover as run
    argv = sys.argv[1:]
    command = "railyard " + " ".join(shlex.quote(a) for a in argv) if argv else "railyard discover"
    d = run(hosts or "", user, set_, out, dry_run, command)
    if json:
        return d.report().print_json()
    err = console(stderr=True)
    f = d.found
    if f is not None and f.rails:
        t = Table(title="rails", title_justify="left")
        for c in ("rail", "subnet", *(h.name for h in f.hosts)):
            t.add_column(c, overflow="fold")
        for r in f.rails:
            cells = [(f"{m.netdev} {m.hca}\n{m.ipv4} {m.speed_mbps or '?'} Mb/s" if m else "-")
                     for m in (r.members.get(h.name) for h in f.hosts)]
            name = Text(r.name or "(names differ)", style="bold green" if r is f.serve else "")
            t.add_row(name, str(r.subnet), *cells)
        err.print(t)
    if f is not None:
        if f.serve is not None:
            err.print(f"serving rail: {f.why}", markup=False)
        if f.gpu_model:
            err.print(f"GPUs: {f.gpu_count} x {f.gpu_model} per host (cluster_gpu_name {f.gpu_name}); layout "
                      f"{f.layout or '?'}", markup=False)
        for n in f.notes:
            err.print(f"note: {n}", style="yellow", markup=False)
    if d.problems:
        for p in d.problems:
            print(f"error: {p}", file=sys.stderr)
        print("discover: nothing written", file=sys.stderr)
        return 1
    if dry_run:
        sys.stdout.write(d.text or "")
        return 0
    err.print(f"wrote {d.out}: next, railyard preflight --inventory {d.out}", style="green", markup=False)
    return 0
