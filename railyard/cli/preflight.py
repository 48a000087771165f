"""inv preflight: every host checked before launch, the verdicts as a table or one JSON document."""

from __future__ import annotations

from ..report import console, print_checks
from . import load, rtask


@rtask()
def preflight(inventory=None, json=False, set_=None):
    """Check every host before launch: rails, MTU, jumbo ping, GID, clocks, disk, GPU, Docker, image, SSH."""
    from ..verbs.preflight import run_preflight
    inv = load(inventory, set_)
    if json:
        return print_checks(run_preflight(inv), True, "")
    err = console(stderr=True)
    err.print(f"preflight: {len(inv.hosts)} host(s) from {inv.path}", style="dim")
    waiting = [h.name for h in inv.hosts]
    with err.status(f"probing {len(waiting)} host(s)") as status:
        def landed(name: str, probe) -> None:
            waiting.remove(name)
            ssh = getattr(probe, "ssh", None)
            if ssh is not None and ssh.status != "pass":  # say it now; the other hosts' probes go on
                err.print(f"preflight: {name}: {ssh.detail}", style="red", markup=False)
            status.update(f"probed {len(inv.hosts) - len(waiting)} of {len(inv.hosts)} host(s); "
                          + ("waiting for " + ", ".join(waiting[:8]) + (" ..." if len(waiting) > 8 else "")
                             if waiting else "judging"))
        results = run_preflight(inv, landed)
    return print_checks(results, False, f"railyard preflight — {inv.path.name}")
