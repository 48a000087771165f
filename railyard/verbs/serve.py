"""`inv env`, `inv launch`, `inv start`, `inv stop`, `inv status`, `inv logs`, `inv launch-script`:
each builds the inventory's plan (railyard.plan.layout, chosen by `serve_layout`) and hands
it to railyard.ops, so every verb works for every layout.

    plan = build_plan(inv, runner)    # static checks (exit 2), facts in one round trip per host, pure plan
"""

from __future__ import annotations

import os
from pathlib import Path

from ..checks import FAIL, PASS, SKIP, WARN, CheckResult
from ..errors import LaunchError, RailyardError, UsageError
from ..inventory import Inventory
from ..apply import envfiles
from ..apply import executor as ops
from ..apply import lock
from ..apply.executor import LaunchReport, Show, StopResult
from ..apply.lock import HeadLock
from ..apply.recovery import Book
from ..render import script
from ..render.docker import run_line
from ..transport.runner import Runner
from ..plan import layout as layouts
from ..facts.host import HostFacts, gather
from ..plan.spec import LaunchPlan
from ..transport import cmd
from ..report import NO_HOST, Report
from .sync import checkpoint_differs


def build_plan(inv: Inventory, runner: Runner | None, order: str | None = None, strict: bool = True) -> LaunchPlan:
    """The plan of the inventory's layout. strict: the layout's static checks first (InventoryError, exit
    2, before any SSH) and every fact required; otherwise missing facts leave blanks (stop, status)."""
    return plan_and_facts(inv, runner, order, strict)[0]


def plan_and_facts(inv: Inventory, runner: Runner | None, order: str | None = None,
                   strict: bool = True) -> tuple[LaunchPlan, dict[str, HostFacts]]:
    """build_plan, and the host facts it was built from (runner None: no SSH, blank facts)."""
    layout = layouts.validated(inv) if strict else layouts.get(inv)
    if order and not layout.rank_order:
        raise UsageError(f"--rank-order {order!r}: layout {layout.name} starts one service; it has no rank order")
    hosts = layout.hosts(inv)
    if runner is None:
        facts = {h.name: HostFacts(h) for h in hosts}
    else:
        needs, count = layout.needs(inv)
        facts = gather(runner, hosts, needs, count)
        problems = [p for f in facts.values() for p in f.problems]
        if problems and strict:
            raise LaunchError("cannot plan the launch:\n  " + "\n  ".join(problems))
    return layout.plan(inv, facts, order), facts


def _runner(inv: Inventory) -> Runner:
    return Runner(layouts.get(inv).hosts(inv))


def locked(inv: Inventory, runner: Runner, command: str) -> HeadLock:
    return HeadLock(runner.session(lock.lock_host(inv)), command)


def env(inv: Inventory, check: bool) -> tuple[list[envfiles.EnvFile], list[str]]:
    """Render every service's env file into env/ and, unless check, onto the hosts where it changed."""
    with _runner(inv) as runner:
        plan = build_plan(inv, runner)
        files = envfiles.plan_env(plan, runner)
        envfiles.write_local(files)
        written = [] if check else envfiles.apply_env(runner, files)
    return files, written


def launch(inv: Inventory, rank_order: str | None, dry_run: bool, recreate: bool, timeout: float | None,
           rollback: bool, show: Show | None) -> LaunchReport:
    with _runner(inv) as runner:
        plan = build_plan(inv, runner, rank_order)
        files = envfiles.plan_env(plan, runner)
        timeout = float(timeout or inv.head.vars["vllm_start_timeout_s"])
        if dry_run:
            rep = LaunchReport(plan.hosts(), {s.name: run_line(plan, s) for s in plan.services()}, plan=plan)
            stale = [f.host for f in files if f.changed]
            if stale:
                rep.hint = f"note: the env files are not current on {', '.join(stale)} (run `inv env`)"
            return rep
        with locked(inv, runner, "inv launch"):
            # the same checkpoint by content on every host that mounts it, before anything starts
            differs = checkpoint_differs(inv, runner, plan)
            if differs:
                raise LaunchError(f"the checkpoint differs between hosts: {differs}: nothing started "
                                  "(inv sync-model --repair re-sends what differs)")
            rep = ops.apply(plan, runner, files, inv.head.vars["model_path"], recreate, timeout, rollback, show)
            if not rep.noop:
                keep_timeline(inv, plan, runner, rep)
            if not rep.noop and not rep.failure and lock.lock_host(inv).vars["canary_at_launch"]:
                keep_canary(inv, plan, runner, rep)
            return rep


def keep_canary(inv: Inventory, plan: LaunchPlan, runner: Runner, rep: LaunchReport) -> None:
    """The canary's answers recorded on the deployment's first host (railyard.verbs.canary.at_launch). Never
    fails the launch."""
    from . import canary
    host = lock.lock_host(inv)
    path = canary.path_for(host.vars["vllm_state_dir"], plan.deployment)
    targets = layouts.get(inv).canary_targets(plan) or [plan.endpoint]
    try:
        rep.canary = canary.at_launch(inv, plan, runner, targets, runner.session(host), path, f"{host.name}:{path}")
    except RailyardError as e:
        rep.canary = f"canary: not recorded: {e}"


def keep_timeline(inv: Inventory, plan: LaunchPlan, runner: Runner, rep: LaunchReport) -> None:
    """The previous launch's figures beside this one's, from the deployment's first host (where the lock is);
    after a successful launch this one's replace them there, atomically. Never fails the launch."""
    from ..errors import RailyardError
    from ..apply import timeline
    host = lock.lock_host(inv)
    path = timeline.path_for(host.vars["vllm_state_dir"], plan.deployment)
    s = runner.session(host)
    try:
        previous = timeline.load(s, path)
    except RailyardError as e:
        previous = None
        rep.timeline_note = f"the previous launch's timeline was not read: {e}"
    timeline.merge_previous(rep.timeline, previous)
    if previous:
        rep.timeline_previous = {"written_at": previous.get("written_at"), "by": previous.get("by"), "file": path}
    if rep.failure or not rep.timeline:
        return
    try:
        timeline.save(s, path, timeline.document(plan, rep.timeline))
        rep.timeline_file = f"{host.name}:{path}"
    except RailyardError as e:
        rep.timeline_note = f"this launch's timeline was not kept: {e}"


def start(inv: Inventory, rank_order: str | None, timeout: float | None, show: Show | None) -> LaunchReport:
    with _runner(inv) as runner:
        plan = build_plan(inv, runner, rank_order, strict=False)
        with locked(inv, runner, "inv start"):
            return ops.start(plan, runner, float(timeout or inv.head.vars["vllm_start_timeout_s"]), show)


def stop(inv: Inventory) -> list[StopResult]:
    with _runner(inv) as runner:
        plan = build_plan(inv, runner, strict=False)
        with locked(inv, runner, "inv stop"):
            return ops.stop(plan, runner)


def status(inv: Inventory) -> tuple[list[dict], dict]:
    """Every service's row, and the deployment's recoveries inside the restart budget's window with the
    restarts each service has left (railyard.apply.recovery)."""
    with _runner(inv) as runner:
        plan = build_plan(inv, runner, strict=False)
        rows = ops.status(plan, runner)
        try:
            book = Book.open(inv, plan, runner)
        except RailyardError as e:
            return rows, {"error": f"the recovery record was not read: {e}"}
        names = [s.name for s in plan.by_rank()]
        from .hang_dump import latest
        from .roll import load_rolls, path_for
        state = lock.lock_host(inv).vars["vllm_state_dir"]
        rolls = load_rolls(book.session, path_for(state, plan.deployment))
        return rows, {"file": book.where, "budget": book.budget, "window_s": book.window_s,
                      "recent": book.recent(), "left": book.left(names),
                      "hang_dump": latest(book.session, state, plan.deployment),
                      "last_roll": rolls[-1] if rolls else None}


def logs(inv: Inventory, rank: str | None, follow: bool, lines: int | None, write) -> int:
    plan = build_plan(inv, None, strict=False)
    svc = ops.container_of(plan, None if rank is None else str(rank))
    argv = ["docker", "logs"] + (["--tail", str(lines)] if lines else []) + (["--follow"] if follow else []) + [svc.spec.name]
    host = inv.host(svc.host)
    with Runner([host]) as runner:
        r = runner.session(host).run(cmd(*argv) + " 2>&1", timeout=10 ** 7 if follow else 60, on_output=write)
    if r.error:
        raise LaunchError(f"{host.name}: {r.error.kind}: {r.error.message}")
    return 0 if r.rc == 0 else 1


def unlock(inv: Inventory) -> lock.Holder | None:
    """Remove the operator lock, whoever holds it; the holder it had."""
    host = lock.lock_host(inv)
    with Runner([host]) as runner:
        return lock.unlock(runner.session(host))


def launch_script(inv: Inventory, out_dir: str) -> Path:
    """Write DIR/launch_server.sh for the inventory's one-host layout; no host is contacted."""
    plan = build_plan(inv, None)
    text = script.render(plan, inv.host(plan.endpoint.host).vars["model_revision"])
    d = Path(out_dir)
    try:
        d.mkdir(parents=True, exist_ok=True)
        path = d / "launch_server.sh"
        tmp = d / ".launch_server.sh.tmp"
        tmp.write_text(text)
        os.chmod(tmp, 0o755)
        tmp.replace(path)
    except OSError as e:
        raise UsageError(f"--out {out_dir}: {e.strerror}") from None
    return path


def render_compose(inv: Inventory, out_dir: str) -> list[Path]:
    """Write DIR/docker-compose.yml (and the files it mounts) for the inventory's one-host layout; one
    round trip to the host for its GPUs (UUIDs) and CPUs, nothing changed there."""
    from ..render import compose
    with _runner(inv) as runner:
        plan = build_plan(inv, runner)
    try:
        files = compose.render(plan)
    except ValueError as e:
        raise UsageError(f"--compose: {e}") from None
    from .export import write
    return write(files, out_dir, "--compose")


def uptime_text(s) -> str:
    return "-" if s is None else f"{s:.0f} s"


def status_report(rows: list[dict], recoveries: dict | None = None) -> Report:
    """One `container` check per service: pass only when it runs with the current configuration; a `restarts`
    warning for a service whose restart budget is spent (`inv recover` will not restart it)."""
    recoveries = recoveries or {}
    checks = []
    for r in rows:
        host, svc, name, state = r["host"], r["service"], r.get("container") or r["service"], r["state"]
        mem = r.get("gpu_memory")
        ev = ", ".join(x for x in (
            f"state {state}", f"up {uptime_text(r.get('uptime_s'))}" if r.get("uptime_s") is not None else "",
            f"config {r['config'][:12]}" if r.get("config") else "",
            f"image {r['image_id'][:19]}" if r.get("image_id") else "",
            f"GPU {mem['used_mib']} / {mem['total_mib']} MiB" if mem else "") if x)
        if r.get("error"):
            checks.append(CheckResult(host, "container", FAIL, f"{svc}: {state}: {r['error']}", ev,
                                      f"check SSH to {host} (inv preflight), then inv status again"))
        elif not r.get("running"):
            checks.append(CheckResult(host, "container", FAIL, f"{svc}: container {name} is {state}", ev,
                                      "inv start (a stopped container) or inv launch"))
        elif not r.get("config_current"):
            checks.append(CheckResult(host, "container", FAIL,
                                      f"{svc}: container {name} runs another configuration than the inventory's", ev,
                                      "inv launch --recreate"))
        elif r.get("image_id") and not r.get("pinned_digest_ok"):
            checks.append(CheckResult(host, "container", WARN,
                                      f"{svc}: container {name} runs, but its image is NOT the pinned digest", ev,
                                      "docker pull the pinned vllm_image on the host, then inv launch --recreate"))
        else:
            checks.append(CheckResult(host, "container", PASS,
                                      f"{svc}: container {name} running with the current configuration", ev))
        if recoveries.get("left", {}).get(svc, 1) <= 0:
            checks.append(CheckResult(host, "restarts", WARN, f"{svc}: restart budget spent ({recoveries['budget']} "
                                      f"restarts in {recoveries['window_s'] / 60:g} min): inv recover will not restart "
                                      "it", recoveries.get("file", ""), f"inv logs --rank {svc} --lines 50"))
    return Report(checks, {"ranks": rows, "recoveries": recoveries or None})


def launch_report(rep, dry_run: bool = False) -> Report:
    """launch: one `launch` check per service (pass: ready, or already running with this configuration; a
    dry run: skip) or, when it failed, one fail naming the service; data: what ran, the gates' outcome and
    the bring-up timeline of each vLLM container beside the previous launch's."""
    plan = rep.plan
    services = plan.by_rank() if plan else []
    data = {"deployment": plan.deployment if plan else None, "layout": plan.layout if plan else None,
            "dry_run": dry_run, "order": rep.order, "commands": rep.commands, "notes": list(plan.notes) if plan else []}
    if dry_run:
        checks = [CheckResult(s.host, "launch", SKIP, f"{s.name}: dry run: nothing started") for s in services]
        return Report(checks, {**data, "hint": rep.hint or None})
    if rep.failure:
        checks = [CheckResult(rep.failed_rank or NO_HOST, "launch", FAIL, rep.failure, "", rep.hint)]
    else:
        checks = []
        for s in services:
            if rep.noop:
                what = "already running with this configuration"
            elif s.name in rep.started:
                what = "started and ready"
            else:
                what = "kept (already running with this configuration) and ready"
            gates = ", ".join(g.describe() for g in (s.started,) + tuple(s.ready))
            checks.append(CheckResult(s.host, "launch", PASS, f"{s.name}: {what}", gates))
    data.update({"started": rep.started, "kept": rep.kept, "noop": rep.noop, "ready_seconds":
                 None if rep.ready_seconds is None else round(rep.ready_seconds, 2), "api": rep.api or None,
                 "proof": rep.proof or None, "failure": rep.failure, "hint": rep.hint or None, "logs": rep.logs,
                 "rolled_back": rep.rolled_back, "timeline": [t.as_dict() for t in rep.timeline],
                 "timeline_file": rep.timeline_file or None, "timeline_previous": rep.timeline_previous,
                 "timeline_note": rep.timeline_note or None, "canary": rep.canary or None})
    return Report(checks, data)
