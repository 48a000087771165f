"""`inv recover`: look at the deployment, choose a path, check the restart budget, and unless it is a dry
run take the path under the operator lock and record it (railyard.apply.recovery: the Recovery, the
budget, the record). The look is the shared hung verdict (railyard.verbs.hung, the one `inv health`
shows) beside each service's container and GPUs. A layout with a recovery of its own brings it (its
`recovery` and `restore` hooks: replicas restarts one replica alone, pd one instance); every other takes
the group path:

    group path   a service of the plan is dead (its container not running, its API process gone, or no
                 serving process on its GPUs) or hung (a process stopped, a probe held while its
                 counters stand still, its engine's own hang lines): the whole plan goes down, the head
                 first, a hung service killed (it never finishes what it waits in), the checkpoint
                 is compared on every host (by content against the first host's), then every
                 stage starts in order and is gated as `inv start` gates it (the workers before the
                 head, whose gate waits for them), the layout's final gate last. A rank of a
                 tensor-parallel group cannot rejoin a running group: the group restarts whole.
    blocked      a host did not answer, or nothing is bad but a verdict could not be read (`unknown`: its
                 /metrics or its probe failed): nothing is touched, and recover does not say it serves.
"""

from __future__ import annotations

import time

from ..apply import executor as ops
from ..apply.executor import Show
from ..apply.lock import HeadLock, lock_host
from ..apply.recovery import Book, Recovery, take_down
from ..checks.hang import UNKNOWN, fold
from ..errors import LaunchError, UsageError
from ..facts.docker import inspect
from ..inventory import Inventory
from ..plan import layout as layouts
from ..plan.spec import LaunchPlan
from ..transport.runner import Runner
from .serve import build_plan
from .sync import checkpoint_differs
from .hung import Survey, survey
from .health import service_health


def recover(inv: Inventory, target: str | None, dry_run: bool, timeout: float | None, drain_timeout: float,
            show: Show | None) -> tuple[LaunchPlan, Recovery]:
    layout = layouts.get(inv)
    with Runner(layout.hosts(inv)) as runner:
        plan = build_plan(inv, runner, strict=False)
        found = survey(runner, plan)
        rec = layout.recovery(inv, runner, plan, target, found)
        if rec is None:
            if target is not None:
                have = " or ".join(layouts.names_where(lambda cls: cls.recovery is not layouts.Layout.recovery))
                raise UsageError(f"--replica {target}: layout {plan.layout} restarts its services as one group "
                                 f"(--replica names a replica of serve_layout {have})")
            rec = survey_group(plan, runner, found)
        rec = unless_unread(rec, found)
        if rec.path in ("none", "blocked"):
            return plan, rec
        book = Book.open(inv, plan, runner)
        refused = book.spent(rec.services)
        if refused:
            return plan, Recovery("budget", [], rec.why, [], failure=refused)
        rec.steps.append("restarts left in the budget: " + ", ".join(
            f"{k} {n} of {book.budget}" for k, n in book.left(rec.services).items())
            + f" (in {book.window_s / 60:g} min)")
        if dry_run:
            return plan, rec
        timeout = float(timeout or inv.head.vars["vllm_start_timeout_s"])
        with HeadLock(runner.session(lock_host(inv)), "inv recover"):
            started = time.time()
            done = layout.restore(inv, runner, plan, rec, timeout, drain_timeout, show)
            rec = done if done is not None else restore_group(inv, runner, plan, rec, timeout, show)
            note = book.add(rec, started)
        rec.done.append(note or f"recorded in {book.where}")
        return plan, rec


def unless_unread(rec: Recovery, found: Survey) -> Recovery:
    """Nothing to recover stands only on verdicts that were read: where nothing is bad but a verdict is
    `unknown` (its /metrics or its probe failed), recover is blocked, naming it. Pure."""
    unread = [v for v in found.verdicts if v.state == UNKNOWN]
    if rec.path != "none" or not unread:
        return rec
    return Recovery("blocked", [], [v.line() for v in unread],
                    ["nothing: a verdict not read is no reason to restart, nor proof that it serves; `inv health` "
                     "shows what answers; then run `inv recover` again"])


def decide_group(plan: LaunchPlan, healths: list, host_reached: dict[str, bool]) -> Recovery:
    """What the group path would do, from every service's health (railyard.verbs.health's RankHealth).
    Pure."""
    names = [s.name for s in plan.by_rank()]
    down = [h for h in plan.report_hosts() if not host_reached.get(h, True)]
    if down:
        return Recovery("blocked", [], [f"{h} did not answer: its services' state is not known" for h in down],
                        ["nothing: make the host reachable (inv preflight), then run `inv recover` again"])
    bad = [h for h in healths if not h.ok]
    if not bad:
        return Recovery("none", [], [f"every service runs on its GPUs ({', '.join(names)})"], [])
    hung = [h.service for h in bad if any(r.startswith("hung:") for r in h.reasons)]
    why = [f"{h.service} on {h.host}: {'; '.join(h.reasons)}" for h in bad]
    if hung:
        why.append("`inv hang-dump` shows where each rank waited (run it before recover to keep the stacks)")
    hosts = list(dict.fromkeys(s.host for s in plan.by_rank()))
    if len(plan.by_rank()) > 1:
        why.append("its services serve as one group: they go down and come back together")
    steps = ["stop " + ", ".join(s.name for s in ops.teardown_order(plan)) + ", in that order"
             + (f"; kill {', '.join(hung)} (a hung rank never finishes its collective, a stopped process never sees "
                "SIGTERM)" if hung else "")]
    if len(hosts) > 1:
        steps.append(f"compare the checkpoint on {', '.join(hosts[1:])} with {hosts[0]}'s (by content; the digest "
                     "cache makes an unchanged tree a stat pass)")
    steps += [f"start {', '.join(s.name for s in st.services)} and gate it ({st.wait})" for st in plan.stages]
    return Recovery("group", names, why, steps, hung=hung)


def survey_group(plan: LaunchPlan, runner: Runner, found: Survey) -> Recovery:
    """Every service's container and GPU processes, the hosts in parallel, one session each, with the shared hung
    verdict (`found`, railyard.verbs.hung); then decide."""
    got = runner.each(lambda s: [service_health(s, svc) for svc in plan.on_host(s.host.name)])
    healths = fold([h for rows in got.ok.values() for h in rows], found.verdicts)
    return decide_group(plan, healths, {h: h in got.ok for h in plan.report_hosts()})


def restore_group(inv: Inventory, runner: Runner, plan: LaunchPlan, rec: Recovery, timeout: float,
                  show: Show | None) -> Recovery:
    try:
        for svc in ops.teardown_order(plan):
            s = runner.session(svc.host)
            if inspect(s, svc.spec.name).running:
                take_down(s, svc, rec)
        differs = checkpoint_differs(inv, runner, plan)
        if differs:
            raise LaunchError(f"the checkpoint differs between hosts ({differs}): nothing started; "
                              "inv sync-model --repair, then inv start")
        if len({s.host for s in plan.by_rank()}) > 1:
            rec.done.append("the checkpoint is the same on every host (by content)")
        rep = ops.start(plan, runner, timeout, show)
        rec.report = rep
        if rep.failure:
            raise LaunchError(rep.failure)
        rec.done.append(f"started {', '.join(s.name for st in plan.stages for s in st.services)} in stage order: ready"
                        + (f"; {rep.proof}" if rep.proof else ""))
    except LaunchError as e:
        rec.failure = str(e)
    return rec


