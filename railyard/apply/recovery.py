"""What `inv recover` decided and did (a `Recovery`), in every layout; the restart budget; the record
of every recovery; its report. The verb itself is railyard.verbs.recover.

The budget: at most recover_restart_budget restarts of one service within recover_budget_window_s
(3 in 1800 s by default). Past it recover restarts nothing and says so in one line: a service that
dies on every start is a crash loop, and another restart only hides it.

The record: every recovery that ran (what, why, when, how long, its outcome) is kept on the
deployment's first host, beside the launch timeline, `<vllm_state_dir>/<deployment>/recoveries.json`
(the last 50); `inv status` shows the ones inside the budget's window and what is left of it.

Pure: `spent`, `budget_left`, `add_record`, `recover_report`; `Book` reads and writes the record;
`take_down` stops (or, hung, kills) one service, `start_alone` starts some and gates them.
"""

from __future__ import annotations

import getpass
import json
import socket
import time
from dataclasses import dataclass, field, replace

from ..checks import FAIL, PASS, CheckResult
from ..errors import LaunchError, RailyardError
from ..inventory import Inventory
from ..plan.spec import LaunchPlan, Service, Stage
from ..report import Report
from ..transport import Session, cmd, read_remote, write_remote
from ..transport.runner import Runner
from .executor import LaunchReport, Show, run_stages
from .lock import lock_host

FILE_NAME = "recoveries.json"
KEPT = 50


@dataclass
class Recovery:
    """What recover decided (path, the services it restarts, why, the steps) and what it did."""
    path: str                      # none | blocked | budget | group, or a layout's own (replicas: short | long)
    services: list[str]
    why: list[str]
    steps: list[str]
    done: list[str] = field(default_factory=list)
    failure: str = ""
    report: LaunchReport | None = None
    hung: list[str] = field(default_factory=list)   # services whose serving process is stopped: killed, not stopped
    title: str = ""                                 # the path in a few words (TITLES[path] when blank)

    @property
    def ok(self) -> bool:
        return not self.failure and self.path not in ("blocked", "budget")

    def describe(self) -> str:
        return self.title or TITLES[self.path]

    def as_report(self, plan: LaunchPlan, dry_run: bool) -> Report:
        return recover_report(plan, self, dry_run)


def take_down(s: Session, svc: Service, rec: Recovery) -> None:
    """Stop the service's container (SIGTERM, 60 s to exit), or kill it when it is hung: a stopped process
    never sees SIGTERM. What was done goes into rec.done."""
    kill = svc.name in rec.hung
    r = s.run(cmd("docker", "kill", svc.spec.name) if kill else
              cmd("docker", "stop", "--timeout", "60", svc.spec.name), timeout=120)
    if not r.ok and "No such" not in r.stderr and "is not running" not in r.stderr:
        raise LaunchError(f"could not stop {svc.name}: {(r.stderr or str(r.error)).strip()}")
    rec.done.append(f"{'killed' if kill else 'stopped'} {svc.name}")


def start_alone(plan: LaunchPlan, runner: Runner, services: list[Service], rec: Recovery, timeout: float,
                show: Show | None) -> None:
    """`docker start` the services' containers (each on its host) as one stage, gated as launch gates them
    (their ready gates); the report goes into rec, a failed gate raises LaunchError."""
    def start_one(svc: Service) -> str | None:
        r = runner.session(svc.host).run(cmd("docker", "start", svc.spec.name), timeout=120)
        return None if r.ok else (r.stderr.strip() or str(r.error))

    rep = run_stages(replace(plan, stages=(Stage(tuple(services), wait="ready"),)), runner, timeout, show, start_one)
    rec.report = rep
    if rep.failure:
        raise LaunchError(rep.failure)
    rec.done.append(f"started {', '.join(svc.name for svc in services)}: ready")


# ---------------------------------------------------------------- the budget and the record

def path_for(state_dir: str, deployment: str) -> str:
    return f"{state_dir.rstrip('/')}/{deployment}/{FILE_NAME}"


def load(s: Session, path: str) -> list[dict]:
    text = read_remote(s, path)
    try:
        doc = json.loads(text) if text else {}
    except ValueError:
        return []
    rows = doc.get("recoveries") if isinstance(doc, dict) else None
    return [r for r in rows if isinstance(r, dict)] if isinstance(rows, list) else []


def within(records: list[dict], now: float, window_s: float) -> list[dict]:
    """The recoveries of the last window_s seconds."""
    return [r for r in records if now - float(r.get("at_s", 0)) < window_s]


def restarts(records: list[dict], service: str, now: float, window_s: float) -> list[dict]:
    """The recoveries within the window that restarted this service (a refused one restarted nothing)."""
    return [r for r in within(records, now, window_s) if service in r.get("services", [])
            and r.get("path") not in ("budget", "none", "blocked")]


def spent(records: list[dict], services: list[str], now: float, budget: int, window_s: float) -> str:
    """'' while every service has a restart left, else the one line that says which has none. Pure."""
    for name in services:
        done = restarts(records, name, now, window_s)
        if len(done) >= budget:
            last = max(float(r["at_s"]) for r in done)
            return (f"restart budget spent: {name} was restarted {len(done)} times in the last "
                    f"{window_s / 60:g} min (budget {budget}; last {now - last:.0f} s ago): a crash loop is not fixed "
                    f"by another restart; read why it dies (inv logs --rank {name} --lines 50)")
    return ""


def budget_left(records: list[dict], services: list[str], now: float, budget: int, window_s: float) -> dict:
    return {name: budget - len(restarts(records, name, now, window_s)) for name in services}


def add_record(records: list[dict], rec: Recovery, started: float, ended: float) -> list[dict]:
    """The records with this recovery appended (the last KEPT). Pure."""
    row = {"at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)), "at_s": round(started, 3),
           "by": f"{getpass.getuser()}@{socket.gethostname()}", "path": rec.path, "services": rec.services,
           "why": rec.why, "seconds": round(ended - started, 1), "ok": rec.ok, "failure": rec.failure or None}
    return (records + [row])[-KEPT:]


@dataclass
class Book:
    """The deployment's recovery records, where they are kept, and its budget."""
    session: Session
    path: str
    records: list[dict]
    budget: int
    window_s: float

    @classmethod
    def open(cls, inv: Inventory, plan: LaunchPlan, runner: Runner) -> "Book":
        host = lock_host(inv)
        s = runner.session(host)
        path = path_for(host.vars["vllm_state_dir"], plan.deployment)
        return cls(s, path, load(s, path), int(host.vars["recover_restart_budget"]),
                   float(host.vars["recover_budget_window_s"]))

    @property
    def where(self) -> str:
        return f"{self.session.host.name}:{self.path}"

    def spent(self, services: list[str]) -> str:
        return spent(self.records, services, time.time(), self.budget, self.window_s)

    def left(self, services: list[str]) -> dict:
        return budget_left(self.records, services, time.time(), self.budget, self.window_s)

    def recent(self) -> list[dict]:
        return within(self.records, time.time(), self.window_s)

    def add(self, rec: Recovery, started: float) -> str:
        """Keep this recovery; '' or why it was not kept (never fails the recovery)."""
        self.records = add_record(self.records, rec, started, time.time())
        try:
            write_remote(self.session, self.path, json.dumps({"recoveries": self.records}, indent=2) + "\n", mode="644")
        except RailyardError as e:
            return f"this recovery was not recorded: {e}"
        return ""


# ---------------------------------------------------------------- the report

TITLES = {"none": "nothing to recover", "blocked": "blocked", "budget": "restart budget spent",
          "group": "group path: every service down, then up in stage order, each stage gated"}


def recover_report(plan: LaunchPlan, rec: Recovery, dry_run: bool) -> Report:
    """`inv recover --json`: one `recover` check on the endpoint's host (pass: recovered, nothing to do, or a dry
    run that can proceed); data: the path, why, the steps and what was done."""
    host = plan.endpoint.host
    if rec.failure or rec.path == "blocked":
        status, detail = FAIL, rec.failure or "; ".join(rec.why)
    else:
        status = PASS
        detail = ("nothing to recover" if rec.path == "none" else f"{rec.path} path") + (
            " (dry run)" if dry_run and rec.path != "none" else "") + (f": {', '.join(rec.services)}" if rec.services else "")
    check = CheckResult(host, "recover", status, detail, "; ".join(rec.why),
                        "" if status == PASS else "inv status; inv logs --rank SERVICE --lines 50")
    return Report([check], {"path": rec.path, "services": rec.services, "why": rec.why, "steps": rec.steps,
                            "done": rec.done, "failure": rec.failure or None, "dry_run": dry_run})
