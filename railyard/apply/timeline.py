"""The bring-up timeline of a launch: for each container that runs vLLM, the seconds from the
container's start to its weights loaded, its KV cache sized, its engine initialised and its API
ready, read from the engine's own log lines.

The times are docker's, not vLLM's: `docker logs --timestamps` puts the moment the daemon read
each line (RFC3339Nano, UTC) in front of it, against the container's `State.StartedAt`. vLLM's
own `MM-DD HH:MM:SS` stamps have no year and a resolution of one second, and uvicorn's ready line
has none. A milestone whose line is not in the log of this run of the container is not seen,
never estimated.

The last successful launch's timeline stays on the deployment's first host (where its lock is),
`<vllm_state_dir>/<deployment>/launch-timeline.json`, written atomically, so the next launch from
any machine shows its figures beside its own.

Pure: `parse_stamp`, `timestamped`, `timeline_of`, `applicable`, `merge_previous`, `document`;
the rest asks the hosts.
"""

from __future__ import annotations

import calendar
import getpass
import json
import re
import socket
import time
from dataclasses import dataclass, field

from ..errors import RailyardError
from ..plan.spec import LaunchPlan, Service
from .. import engines
from ..engines import MILESTONES, Engine
from ..transport import Session, cmd, read_remote, write_remote
from ..facts.docker import inspect

FILE_NAME = "launch-timeline.json"
# a line stamped up to this long before StartedAt still belongs to this run (the daemon may record the
# start a moment after the process wrote its first line); anything earlier is an earlier run's
START_SLACK_S = 1.0

_STAMP_RE = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d{1,9}))?(Z|[+-]\d\d:\d\d)$")


def parse_stamp(stamp: str) -> float | None:
    """An RFC3339(Nano) time (`2026-12-02T03:43:23.570115758Z`, `...+02:00`) -> seconds since the epoch."""
    m = _STAMP_RE.match(stamp.strip())
    if not m:
        return None
    try:
        sec = calendar.timegm(time.strptime(m.group(1), "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return None
    frac = int((m.group(2) or "0").ljust(9, "0")) / 1e9
    tz = m.group(3)
    offset = 0 if tz == "Z" else (1 if tz[0] == "+" else -1) * (int(tz[1:3]) * 3600 + int(tz[4:6]) * 60)
    return sec + frac - offset


def timestamped(text: str) -> list[tuple[float, str]]:
    """`docker logs --timestamps` output -> (time, line) for each line that carries docker's time."""
    out = []
    for raw in text.splitlines():
        stamp, _, line = raw.partition(" ")
        t = parse_stamp(stamp)
        if t is not None:
            out.append((t, line.rstrip("\r")))
    return out


def applicable(svc: Service) -> tuple[str, ...] | None:
    """The milestones this service's log can show (its engine says which); None: it runs no engine (a proxy,
    LMCache, a router)."""
    engine = engines.of(svc)
    return engine.milestones_of([str(w) for w in svc.spec.command]) if engine else None


@dataclass
class Timeline:
    """One container's bring-up: seconds from its start per milestone (None: not seen)."""

    host: str
    service: str
    rank: int | None
    container: str
    started_at: str = ""
    seconds: dict[str, float | None] = field(default_factory=dict)
    not_applicable: list[str] = field(default_factory=list)
    lines: dict[str, str] = field(default_factory=dict)   # the line each seen milestone was read from
    previous: dict[str, float | None] | None = None        # the last successful launch's figures
    error: str = ""

    def as_dict(self) -> dict:
        return {"host": self.host, "service": self.service, "rank": self.rank, "container": self.container,
                "started_at": self.started_at or None, "seconds": self.seconds,
                "not_applicable": self.not_applicable, "lines": self.lines, "previous": self.previous,
                "error": self.error or None}


def timeline_of(log_t: str, started_at: str, milestones: tuple[str, ...], engine: Engine) -> tuple[dict, dict]:
    """Pure: the `docker logs -t` text of a container and its StartedAt -> ({milestone: seconds or None},
    {milestone: line}). The last line of a milestone in this run counts (every worker, engine and API
    server of the container is past it then)."""
    start = parse_stamp(started_at) if started_at else None
    seen: dict[str, tuple[float, str]] = {}
    if start is not None:
        for t, line in timestamped(log_t):
            if t < start - START_SLACK_S:
                continue  # an earlier run of this container (docker start appends to the same log)
            m = engine.milestone_of(line)
            if m in milestones:
                seen[m] = (t, line.strip())
    secs = {m: (round(max(0.0, seen[m][0] - start), 2) if m in seen and start is not None else None)
            for m in milestones}
    return secs, {m: seen[m][1][:300] for m in milestones if m in seen}


def logs_command(name: str, engine: Engine):
    """The milestone lines of a container's log with docker's time in front, and nothing else."""
    pats = [a for p in engine.milestone_grep for a in ("-e", p)]
    return cmd("docker", "logs", "--timestamps", name) + " 2>&1 | " + cmd("grep", "-F", *pats) + " | cut -c1-600"


def read_one(s: Session, svc: Service, milestones: tuple[str, ...], engine: Engine) -> Timeline:
    tl = Timeline(svc.host, svc.name, svc.rank, svc.spec.name,
                  not_applicable=[m for m in MILESTONES if m not in milestones])
    try:
        c = inspect(s, svc.spec.name)
        if not c.exists:
            tl.error = "no container"
            tl.seconds = {m: None for m in milestones}
            return tl
        tl.started_at = c.started
        r = s.run(logs_command(svc.spec.name, engine), timeout=60)
        if r.error:
            raise RailyardError(f"{svc.host}: {r.error.kind}: {r.error.message}")
        tl.seconds, tl.lines = timeline_of(r.stdout, c.started, milestones, engine)
        if parse_stamp(c.started or "") is None:
            tl.error = f"no usable State.StartedAt ({c.started!r})"
    except RailyardError as e:
        tl.error = str(e)
        tl.seconds = {m: None for m in milestones}
    return tl


def read(plan: LaunchPlan, runner) -> list[Timeline]:
    """The timeline of every service of the plan that runs an engine, by rank (the head first); the hosts in
    parallel, a host's services one after another on its session."""
    wanted = [(svc, ms) for svc in plan.by_rank() if (ms := applicable(svc)) is not None]
    hosts = list(dict.fromkeys(svc.host for svc, _ in wanted))

    def on_host(s: Session) -> list[Timeline]:
        return [read_one(s, svc, ms, engine) for svc, ms in wanted
                if svc.host == s.host.name and (engine := engines.of(svc)) is not None]

    got = runner.each(on_host, [runner.session(h).host for h in hosts])
    by_name: dict[str, Timeline] = {}
    for h in hosts:
        if h in got.ok:
            by_name.update({t.service: t for t in got.ok[h]})
        else:  # the host's work raised: every service of it says so
            res = got.failed[h]
            for svc, ms in wanted:
                if svc.host == h:
                    by_name[svc.name] = Timeline(svc.host, svc.name, svc.rank, svc.spec.name,
                                                 seconds={m: None for m in ms},
                                                 not_applicable=[m for m in MILESTONES if m not in ms],
                                                 error=(f"{res.error.kind}: {res.error.message}"
                                                        if getattr(res, "error", None) else str(res)))
    return [by_name[svc.name] for svc, _ in wanted]


# ---------------------------------------------------------------- the previous launch

def path_for(state_dir: str, deployment: str) -> str:
    return f"{state_dir.rstrip('/')}/{deployment}/{FILE_NAME}"


def document(plan: LaunchPlan, timelines: list[Timeline], now: float | None = None) -> dict:
    """Pure: what is kept for the next launch."""
    now = time.time() if now is None else now
    return {"deployment": plan.deployment, "layout": plan.layout,
            "written_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
            "by": f"{getpass.getuser()}@{socket.gethostname()}",
            "services": [{"service": t.service, "host": t.host, "rank": t.rank, "container": t.container,
                          "started_at": t.started_at, "seconds": t.seconds} for t in timelines]}


def parse_document(text: str | None) -> dict | None:
    """The kept document, or None when there is none or it is not one (a half-written file never is: the
    write is atomic)."""
    if not text:
        return None
    try:
        doc = json.loads(text)
    except ValueError:
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get("services"), list):
        return None
    return doc


def merge_previous(timelines: list[Timeline], doc: dict | None) -> None:
    """Pure: each timeline gets the previous launch's figures of the same service (None: none kept)."""
    if not doc:
        return
    by_name = {str(s.get("service")): s for s in doc["services"] if isinstance(s, dict)}
    for t in timelines:
        prev = by_name.get(t.service)
        if prev and isinstance(prev.get("seconds"), dict):
            t.previous = {m: prev["seconds"].get(m) for m in MILESTONES if m in prev["seconds"]}


def load(s: Session, path: str) -> dict | None:
    return parse_document(read_remote(s, path))


def save(s: Session, path: str, doc: dict) -> None:
    """Atomically (a temporary file renamed over it), readable by the operators' group."""
    write_remote(s, path, json.dumps(doc, indent=2) + "\n", mode="644")
