"""inv trust-hosts: each host's SSH host key, recorded in known_hosts only when asked."""

from __future__ import annotations

from typing import Literal

from rich.table import Table
from rich.text import Text

from . import console, load, rtask


@rtask(help={"hosts": "only these hosts, comma-separated (default: all)",
             "accept": "record keys not yet in known_hosts", "replace": "replace keys that CHANGED (verify first!)"})
def trust_hosts(inventory=None, hosts=None, accept=False, replace=False, set_=None):
    """Show each host's SSH host key fingerprint; record it only with --accept (or --replace)."""
    from ..transport.hostkeys import record, scan_all
    inv = load(inventory, set_)
    statuses = scan_all(inv.select(hosts))
    t = Table(title="SSH host keys", title_justify="left")
    for col in ("host", "known_hosts name", "key", "fingerprint", "status"):
        t.add_column(col, no_wrap=col != "status")
    code = 0
    for st in statuses:
        # the key's status, or what --accept / --replace did about it
        action: Literal["known", "unknown", "changed", "unreachable", "recorded", "replaced"] = st.status
        if st.status == "unknown" and accept:
            record(st)
            action = "recorded"
        elif st.status == "changed" and replace:
            record(st)
            action = "replaced"
        elif st.status in ("unknown", "changed", "unreachable"):
            code = 1
        style = {"known": "green", "recorded": "green", "replaced": "yellow", "unknown": "yellow"}.get(action, "bold red")
        t.add_row(st.host, st.name, st.key.get_name() if st.key else "-", st.fingerprint or "-",
                  Text(f"{action}: {st.detail}", style=style))
    con = console()
    con.print(t)
    if any(s.status == "unknown" for s in statuses) and not accept:
        con.print("Compare each fingerprint with the host's own (`ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub` "
                  "on its console); then record them with --accept.", style="yellow")
    if any(s.status == "changed" for s in statuses) and not replace:
        con.print("A CHANGED key means the host was reinstalled or someone is in the middle. Verify it out of band, "
                  "then replace it with --replace.", style="bold red")
    return code
