"""inv roll: move a running deployment to a new model revision or image (railyard.verbs.roll)."""

from __future__ import annotations

from rich.text import Text

from . import console, live_table, load, rtask


@rtask(help={"revision": "the new model revision (40-hex); its checkpoint on the head at --model-path",
             "image": "the new image, pinned (IMAGE:TAG@sha256:DIGEST)",
             "model-path": "where the new revision's checkpoint is on the head (default: model_path-REV12, beside "
                           "the running one)",
             "dry-run": "print the steps the roll would take; change nothing",
             "timeout": "seconds each start may take to pass its gates (default: vllm_start_timeout_s)",
             "drain-timeout": "seconds to wait for a replica's requests in flight (default 300)"},
       numbers={"timeout": float, "drain_timeout": float})
def roll(inventory=None, revision=None, image=None, model_path=None, dry_run=False, timeout=None, drain_timeout=None,
         json=False, set_=None):
    """Roll a new model revision or image through a running deployment: replicas one at a time, out of routing
    and back; a layout that serves as one group in a planned restart whose downtime is measured. Recorded."""
    from ..verbs.roll import roll as run, roll_report, target
    old = load(inventory, set_)
    new, change = target(old, lambda extra: load(inventory, list(set_ or []) + extra), revision, image, model_path)
    plan, r = run(old, new, change, dry_run, timeout, 300.0 if drain_timeout is None else drain_timeout,
                  None if json else live_table(console(), "roll"))
    report = roll_report(plan, r, dry_run)
    if json:
        return report.print_json()
    con = console()
    con.print(Text(f"roll ({plan.deployment}): {change['what']} {change['from']} -> {change['to']}: {r.path}",
                   style="bold"))
    for i, st in enumerate(r.steps, 1):
        if dry_run:
            con.print(f"  would {i}. {st}")
    for d in r.done:
        con.print(Text(f"  done ({d['seconds']:.1f} s): {d['step']}", style="green"))
    if r.failure:
        con.print(Text(f"FAILED: {r.failure}", style="bold red"))
    elif not dry_run:
        con.print(Text(f"OK: rolled in {r.seconds:.0f} s" + (f"; downtime {r.downtime_s:.0f} s (a planned restart)"
                                                               if r.downtime_s is not None else "; no downtime")
                       + f"; recorded at {r.record}", style="bold green"))
        pins = ", ".join(f"{k}: {new.head.vars[k]}" for k in (("model_revision", "model_path")
                                                              if change["what"] == "revision" else ("vllm_image",)))
        con.print(f"now pin it in the inventory ({pins}): inv status and launch compare what runs with it",
                  soft_wrap=True, markup=False)
    return report.exit_code
