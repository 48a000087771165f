"""inv collect: one .tar.gz for the on-call ticket (every host's state, logs, NCCL logs, verdicts)."""

from __future__ import annotations

import time
from pathlib import Path

from ..errors import RailyardError
from . import console, load, rtask


@rtask(help={"out": "the archive to write (default: railyard-collect-<deployment>-<stamp>.tar.gz)",
             "no-preflight": "leave preflight's checks out (faster)"})
def collect(inventory=None, out=None, no_preflight=False, set_=None):
    """One .tar.gz for the on-call ticket: every host's state, logs, NCCL logs and verdicts, no secret."""
    from ..plan import layout as layouts
    from ..transport.runner import Runner
    from ..verbs.collect import collect as run, hang_evidence
    from ..verbs.preflight import preflight_report, run_preflight
    from ..verbs.serve import build_plan
    inv = load(inventory, set_)
    con = console(stderr=True)
    hang: tuple[str | None, str] = (None, "")
    try:  # the plan names the services whose containers, logs and env files are collected
        with Runner(layouts.get(inv).hosts(inv)) as runner:
            plan = build_plan(inv, runner, strict=False)
            hang = hang_evidence(inv, plan, runner)  # hang-dump's document where a service is hung
    except RailyardError as e:
        con.print(f"collect: no plan ({e}); collecting the hosts only", style="yellow")
        plan = None
    doc = preflight_report(run_preflight(inv)).json() if not no_preflight else None
    path = Path(out or f"railyard-collect-{plan.deployment if plan else 'hosts'}-"
                       f"{time.strftime('%Y%m%d-%H%M%S')}.tar.gz")
    manifest = run(inv, plan, path, doc, hang)
    failed = {h: v["error"] for h, v in manifest["hosts"].items() if "error" in v}
    size = path.stat().st_size
    console().print(f"wrote {path} ({size / 1024:.0f} KiB, {len(manifest['files'])} files from "
                    f"{len(manifest['hosts']) - len(failed)} of {len(manifest['hosts'])} hosts in "
                    f"{manifest['seconds']:g} s)" + "".join(f"\n  {h}: {e}" for h, e in failed.items())
                    + (f"\n  hung: {hang[1]} (hang-dump.json)" if hang[0] else ""))
    return 1 if failed else 0
