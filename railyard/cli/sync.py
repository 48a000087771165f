"""inv sync-model: the checkpoint from the head to every other rank, the copies proven equal."""

from __future__ import annotations

from ..report import console, sync_report
from . import load, rtask


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
    from ..verbs.sync import SyncOptions, print_report
    from ..verbs.sync import sync_model as run
    inv = load(inventory, set_)
    con = console(stderr=json)
    opts = SyncOptions(source, to, verify, streams, dry_run, repair, rehash, bwlimit, transport)
    rep = run(inv, opts, con)
    report = sync_report(rep)
    if json:
        return report.print_json()
    print_report(rep, console())
    return report.exit_code
