"""`inv roll --revision REV | --image IMAGE`: move a running deployment to a new model revision or image.

1. The target: the inventory with model_revision (and model_path: the new revision's own directory, beside
   the old one) or vllm_image changed, validated as every inventory is; its plan beside the running one's.
2. Staged before anything stops: the new revision's checkpoint on the head copied to every host that
   serves and verified by content (sync-model's path), or the new image pulled on every host; the env
   files the new plan needs written.
3. The layout's own roll where it has one (its `roll` hook: replicas moves one replica at a time, out of
   routing, drained, restarted on the new revision, gated, its canary recorded, back in); every other
   layout serves as one group (or, pd, never a prefill of one revision beside a decode of another), so
   its roll is a planned restart: it says so before it starts, and measures the downtime, from the first
   container removed to the last gate passed.
4. The canary recorded again for the new revision (the old record belongs to the old weights); the roll
   recorded with the deployment (`rolls.json` beside the recoveries: when, from what to what, each step
   and how long); `inv status` shows the last one.
"""

from __future__ import annotations

import getpass
import json
import socket
import time
from dataclasses import dataclass, field
from typing import Callable

from .. import engines
from ..apply import envfiles
from ..apply import executor as ops
from ..apply.executor import LaunchReport, Show
from ..apply.lock import HeadLock, lock_host
from ..checks import FAIL, PASS, CheckResult
from ..errors import LaunchError, RailyardError, UsageError
from ..facts.docker import inspect
from ..inventory import Inventory
from ..plan import layout as layouts
from ..plan.spec import LaunchPlan
from ..report import Report
from ..transport import RemotePath, Session, Sh, cmd, q, read_remote, write_remote
from ..transport.runner import Runner
from .serve import build_plan, keep_canary
from .sync import SyncOptions, _sync_model

FILE_NAME = "rolls.json"
KEPT = 20


@dataclass
class Roll:
    """What a roll does and did: the change, the path (`planned restart` or the layout's own), its steps
    (planned), what was done with each step's seconds, the downtime a planned restart cost."""
    change: dict                     # {"what": "revision" | "image", "from": ..., "to": ...}
    path: str
    steps: list[str]
    done: list[dict] = field(default_factory=list)     # {"step", "seconds"}
    failure: str = ""
    downtime_s: float | None = None
    canary: str = ""
    seconds: float = 0.0
    record: str = ""

    @property
    def ok(self) -> bool:
        return not self.failure

    def did(self, step: str, started: float) -> None:
        self.done.append({"step": step, "seconds": round(time.monotonic() - started, 1)})


def target(inv: Inventory, load: Callable[[list[str]], Inventory], revision: str | None, image: str | None,
           model_path: str | None) -> tuple[Inventory, dict]:
    """The inventory to roll to (loaded and validated as every inventory: a bad value is one line, exit 2),
    and the change."""
    if bool(revision) == bool(image):
        raise UsageError("roll: give exactly one of --revision REV (with the new checkpoint on the head) or "
                         "--image IMAGE@sha256:DIGEST")
    v = inv.head.vars
    if revision:
        if revision == v["model_revision"]:
            raise UsageError(f"--revision {revision}: the deployment's inventory already pins it")
        if model_path is None:
            model_path = f"{str(v['model_path']).rstrip('/')}-{revision[:12]}"
        if model_path.rstrip("/") == str(v["model_path"]).rstrip("/"):
            raise UsageError(f"--model-path {model_path}: the running revision's own directory; the new revision "
                             "goes beside it (the old one stays until the roll is done)")
        # each value a YAML string (a revision of digits alone would read as a number)
        new = load([f"model_revision={json.dumps(revision)}", f"model_path={json.dumps(model_path)}"])
        change = {"what": "revision", "from": v["model_revision"], "to": revision,
                  "from_path": v["model_path"], "to_path": model_path}
    else:
        if image == v["vllm_image"]:
            raise UsageError(f"--image {image}: the deployment's inventory already pins it")
        new = load([f"vllm_image={json.dumps(image)}"])
        change = {"what": "image", "from": v["vllm_image"], "to": image}
    return new, change


def stage(new: Inventory, change: dict, runner: Runner, plan: LaunchPlan, roll: Roll) -> None:
    """What the new plan needs, before anything stops: the checkpoint everywhere (verified by content) or
    the image on every host; the env files."""
    began = time.monotonic()
    if change["what"] == "revision":
        head = runner.session(new.head)
        where = RemotePath(str(change["to_path"]).rstrip("/") + "/config.json")
        if not head.run(Sh(f"test -f {q(where)}"), timeout=30).ok:
            raise LaunchError(f"no checkpoint at {change['to_path']} on {new.head.name} (no config.json): download the "
                              f"new revision there first (hf download {new.head.vars['model_repo']} --revision "
                              f"{change['to']} --local-dir {change['to_path']}), or name it with --model-path")
        others = [h.name for h in layouts.get(new).hosts(new) if h.name != new.head.name]
        if others:   # sync-model's own path, under the lock the roll holds
            rep = _sync_model(new, SyncOptions(to=",".join(others), verify="content"), None)
            if not rep.ok:
                raise LaunchError(f"the new revision's checkpoint was not copied and verified: {rep.why()}")
            roll.did(f"the new revision's checkpoint ({change['to_path']}) copied to every host and verified by "
                     "content", began)
        else:
            roll.did("the new revision's checkpoint is on the only host", began)
    else:
        image = change["to"]

        def pull(s: Session) -> str:
            r = s.run(cmd("docker", "image", "inspect", image), timeout=60)
            if r.ok:
                return "present"
            r = s.run(cmd("docker", "pull", image), timeout=3600)
            return "pulled" if r.ok else f"not pulled: {(r.stderr or str(r.error)).strip()[:200]}"

        got = runner.each(pull)
        bad = {h: v for h, v in got.ok.items() if v.startswith("not")} | {h: str(r.error) for h, r in got.failed.items()}
        if bad:
            raise LaunchError("the new image is not on every host: " + "; ".join(f"{h}: {w}" for h, w in bad.items()))
        roll.did(f"the new image on every host ({', '.join(f'{h} {w}' for h, w in got.ok.items())})", began)
        # what the new image fetches at a first start, staged beside the running image's (sync-model's path)
        if engines.prefetches(new.head.vars):
            began = time.monotonic()
            rep = _sync_model(new, SyncOptions(verify="content"), None)
            if not rep.ok:
                raise LaunchError(f"what the new image needs staged was not staged and copied: {rep.why()}")
            roll.did("staged for the new image on every host: " + "; ".join(k.staged.line for k in rep.staged), began)
    began = time.monotonic()
    files = envfiles.plan_env(plan, runner)
    written = envfiles.apply_env(runner, files)
    roll.did(f"env files for the new plan ({', '.join(written) if written else 'unchanged'})", began)


def planned_restart(plan: LaunchPlan, runner: Runner, model_path: str, timeout: float, show: Show | None,
                    roll: Roll) -> LaunchReport:
    """The whole deployment down and up again on the new plan, gated as launch gates it; the downtime from the
    first container removed to the last gate passed."""
    began = time.monotonic()
    rep = ops.apply(plan, runner, envfiles.plan_env(plan, runner), model_path, True, timeout, False, show)
    roll.downtime_s = round(time.monotonic() - began, 1)
    if rep.failure:
        raise LaunchError(f"the new plan did not pass its gates: {rep.failure}")
    roll.did(f"every service down and up again on the new plan, gated ({', '.join(rep.started)})", began)
    return rep


def back(plan: LaunchPlan, runner: Runner, model_path: str, timeout: float, show: Show | None, r: Roll,
         restart: bool) -> None:
    """After a failed roll: the old plan's env files written back and, where a planned restart failed, the old
    plan started again; what happened goes into the failure."""
    try:
        envfiles.apply_env(runner, envfiles.plan_env(plan, runner))
        if restart:
            rep = ops.apply(plan, runner, envfiles.plan_env(plan, runner), model_path, True, timeout, False, show)
            r.failure += ("; the old plan did not come back either: " + rep.failure if rep.failure else
                          "; the old plan serves again")
    except (LaunchError, RailyardError) as e:
        r.failure += f"; the old plan was not put back: {e}"


def roll(old: Inventory, new: Inventory, change: dict, dry_run: bool, timeout: float | None, drain_timeout: float,
         show: Show | None) -> tuple[LaunchPlan, Roll]:
    layout = layouts.get(old)
    started = time.monotonic()
    with Runner(layout.hosts(new)) as runner:
        old_plan = build_plan(old, runner)
        plan = build_plan(new, runner)
        running = [s.name for s in old_plan.services() if inspect(runner.session(s.host), s.spec.name).running]
        if not running:
            raise UsageError(f"roll: nothing of {old_plan.deployment} runs: `inv launch` it (with the new "
                             f"{change['what']} in the inventory) instead")
        own = layout.roll_steps(plan)
        path = "one replica at a time" if own else "planned restart"
        steps = [("copy the new revision's checkpoint to every host and verify it by content"
                  if change["what"] == "revision" else "pull the new image on every host")]
        if change["what"] == "image":
            steps += [f"stage {p.what} in {p.path} on every host, beside the running image's"
                      for p in engines.prefetches(new.head.vars)]
        steps += ["write the env files the new plan needs"]
        steps += own or [f"planned restart: {layout.name} serves as one group, so it is down from the first container "
                         "removed until the new plan's gates pass (measured)",
                         "remove every container, then start the new plan in stage order, each stage gated"]
        steps += ["record the canary for the new " + change["what"], "record the roll with the deployment"]
        r = Roll(change, path, steps)
        if dry_run:
            return plan, r
        timeout = float(timeout or new.head.vars["vllm_start_timeout_s"])
        with HeadLock(runner.session(lock_host(new)), "inv roll"):
            try:
                stage(new, change, runner, plan, r)
                if own:
                    layout.roll(new, runner, old_plan, plan, r, timeout, drain_timeout, show)
                else:
                    planned_restart(plan, runner, str(new.head.vars["model_path"]), timeout, show, r)
            except (LaunchError, RailyardError) as e:
                r.failure = str(e)
                back(old_plan, runner, str(old.head.vars["model_path"]), timeout, show, r, restart=not own)
            if r.ok:
                began = time.monotonic()
                rep = LaunchReport(plan.hosts(), {}, plan=plan)
                keep_canary(new, plan, runner, rep)
                r.canary = str(rep.canary or "")
                r.did(r.canary, began)
            r.seconds = round(time.monotonic() - started, 1)
            r.record = keep(new, plan, runner, r)
    return plan, r


def path_for(state_dir: str, deployment: str) -> str:
    return f"{state_dir.rstrip('/')}/{deployment}/{FILE_NAME}"


def load_rolls(s: Session, path: str) -> list[dict]:
    try:
        doc = json.loads(read_remote(s, path) or "{}")
    except (ValueError, RailyardError):
        return []
    rows = doc.get("rolls") if isinstance(doc, dict) else None
    return [x for x in rows if isinstance(x, dict)] if isinstance(rows, list) else []


def keep(inv: Inventory, plan: LaunchPlan, runner: Runner, r: Roll) -> str:
    """The roll appended to the deployment's record on its first host; where, or why it was not kept."""
    host = lock_host(inv)
    s = runner.session(host)
    path = path_for(host.vars["vllm_state_dir"], plan.deployment)
    row = {"at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "by": f"{getpass.getuser()}@{socket.gethostname()}",
           "change": r.change, "path": r.path, "done": r.done, "downtime_s": r.downtime_s, "seconds": r.seconds,
           "ok": r.ok, "failure": r.failure or None}
    try:
        write_remote(s, path, json.dumps({"rolls": (load_rolls(s, path) + [row])[-KEPT:]}, indent=2) + "\n",
                     mode="644")
    except RailyardError as e:
        return f"not recorded: {e}"
    return f"{host.name}:{path}"


def roll_report(plan: LaunchPlan, r: Roll, dry_run: bool) -> Report:
    what = f"{r.change['what']} {str(r.change['from'])[:19]} -> {str(r.change['to'])[:19]}"
    status, detail = (FAIL, r.failure) if r.failure else (PASS, f"{what}: {r.path}" + (" (dry run)" if dry_run else
                                                                                        f" in {r.seconds:.0f} s"))
    if r.downtime_s is not None and not r.failure:
        detail += f"; downtime {r.downtime_s:.0f} s"
    return Report([CheckResult(plan.endpoint.host, "roll", status, detail, "; ".join(d["step"] for d in r.done),
                               "" if status == PASS else "inv status; inv logs --rank SERVICE --lines 50")],
                  {"change": r.change, "path": r.path, "steps": r.steps, "done": r.done, "downtime_s": r.downtime_s,
                   "seconds": r.seconds, "canary": r.canary or None, "record": r.record or None,
                   "failure": r.failure or None, "dry_run": dry_run})
