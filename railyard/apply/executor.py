"""Apply any LaunchPlan with docker over SSH, and the lifecycle of what it started.

apply: the env files current, the pinned image (one digest) and the checkpoint on every host
of the plan; then, stage by stage, `docker run` each service and hold it to its start gate
(and, in a stage that waits for readiness, its ready gates); finally every service's ready
gates. A service that dies while others wait fails the launch, named. A label carries each
container's spec hash: the same plan is a no-op, another one needs --recreate; --rollback
stops and removes what a failed launch started.

stop goes in the reverse order of the stages, start resumes in their order with the same gates.
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, field
from contextlib import nullcontext
from typing import Callable, ContextManager, Protocol

from ..facts import ParseError
from ..errors import CommandFailed, LaunchError, UsageError
from ..render.docker import config_hash, run_line
from ..transport.runner import Runner
from ..facts.host import gpu_usage
from ..plan.spec import Dial, Gate, LaunchPlan, Service
from .. import engines
from ..transport import RemotePath, Session, cmd, q, read_remote, write_remote
from ..facts.docker import inspect, log_tail, parse_image_inspect, uptime
from ..facts.net import parse_port_probe, port_probe
from ..plan import layout as layouts
from . import timeline
from .envfiles import EnvFile


POLL_S = 0.3


class Clock:
    """Where the gates read the time and wait: the real clock. Tests swap the module's `clock` for
    railyard.testing.FakeClock, whose sleep() only moves its time on."""

    @staticmethod
    def monotonic() -> float:
        return time.monotonic()

    @staticmethod
    def sleep(seconds: float) -> None:
        time.sleep(seconds)


clock = Clock()


def describe(svc: Service) -> str:
    """How a service is named in messages: `A (rank 0)` in a multi-node group, `A (engine)` otherwise."""
    return f"{svc.host} (rank {svc.rank})" if svc.rank is not None else f"{svc.host} ({svc.name})"


def label(plan: LaunchPlan, svc: Service) -> str:
    """The host, or host:service where a host runs several services of the plan."""
    return svc.host if len(plan.on_host(svc.host)) == 1 else f"{svc.host}:{svc.name}"


def teardown_order(plan: LaunchPlan) -> list[Service]:
    """The reverse of the start order: the head before its workers, the front before what it calls."""
    return [s for st in reversed(plan.stages) for s in st.services]


@dataclass
class ServiceState:
    service: Service
    phase: str = "waiting"
    detail: str = ""


@dataclass
class LaunchReport:
    order: list[str]                      # hosts, in start order
    commands: dict[str, str] = field(default_factory=dict)  # service -> its docker run line
    started: list[str] = field(default_factory=list)        # services this run started
    kept: list[str] = field(default_factory=list)           # running with this configuration already (a resumed launch)
    noop: bool = False
    failed_rank: str | None = None        # the host of the service that failed
    failed_service: str | None = None
    failure: str | None = None
    hint: str = ""
    logs: dict[str, str] = field(default_factory=dict)      # label -> last lines
    rolled_back: list[str] = field(default_factory=list)    # hosts
    ready_seconds: float | None = None
    api: str = ""
    proof: str = ""                       # what the plan's final gate saw (pd: the P->D request)
    plan: LaunchPlan | None = None
    timeline: list = field(default_factory=list)            # ops.timeline.Timeline per vLLM container
    timeline_file: str = ""               # host:path where this launch's timeline is kept for the next one
    timeline_note: str = ""               # why the previous one was not read or this one not kept
    canary: str = ""                      # what became of the canary record (canary_at_launch)
    timeline_previous: dict | None = None  # the previous launch's timeline: written_at, by, file

    @property
    def ok(self) -> bool:
        return self.failure is None


# ---------------------------------------------------------------- gates

def _http(s: Session, svc: Service, g: Gate) -> tuple[bool, str]:
    bind = svc.spec.bind
    addr = "127.0.0.1" if bind in ("0.0.0.0", "::", "") else bind
    url = f"http://{addr}:{g.port or svc.spec.ports[0]}{g.path}"
    r = s.run(cmd("curl", "-fsS", "-o", "/dev/null", "-w", "%{http_code}", "--max-time", "5", url), timeout=15)
    return (r.ok and r.stdout.strip() == "200"), (r.stdout.strip() or r.stderr.strip())


def _log_lines(s: Session, svc: Service, gates: list[Gate]) -> tuple[list[str], str]:
    """The log lines matching any log gate's pattern, and the log's last line, in one round trip."""
    name = svc.spec.name
    pats = [a for g in gates for a in ("-e", g.pattern)]
    line = (cmd("docker", "logs", name) + " 2>&1 | " + cmd("grep", "-F", *pats) + " | cut -c1-400; " +
            "echo @@last; " + cmd("docker", "logs", "--tail", "1", name) + " 2>&1")
    r = s.run(line, timeout=30)
    matched, _, last = r.stdout.partition("@@last\n")
    return matched.splitlines(), last.strip()


def _short(g: Gate) -> str:
    if g.kind == "kv_engines":
        return f"KV cache line from all {g.count} engines"
    return f"`{g.pattern}`" if g.kind == "log" else g.path


def _holds(g: Gate, lines: list[str], engine: engines.Engine | None) -> bool:
    if g.kind == "kv_engines":
        return engine is not None and len(engine.kv_cache("\n".join(lines))) >= g.count
    return any(g.pattern in ln for ln in lines)


def pending_gates(s: Session, svc: Service) -> tuple[list[Gate], str]:
    """The ready gates of a service that do not hold yet, and what its log says last."""
    logs = [g for g in svc.ready if g.kind in ("log", "kv_engines")]
    lines, last = _log_lines(s, svc, logs) if logs else ([], "")
    engine = engines.of(svc)
    pending = [g for g in logs if not _holds(g, lines, engine)]
    detail = last
    if pending:  # the API is asked only once the log says it is up
        pending += [g for g in svc.ready if g.kind == "http"]
    else:
        for g in (g for g in svc.ready if g.kind == "http"):
            ok, why = _http(s, svc, g)
            if not ok:
                pending.append(g)
                detail = f"{', '.join(_short(x) for x in logs) or 'started'} seen; {g.path} not yet: {why}"
    return pending, detail


# ---------------------------------------------------------------- what shows the wait

class Shown(Protocol):
    """What shows the services while launch/start waits: refresh() after each change of phase or detail."""

    def refresh(self) -> None: ...


# show(states) -> a context manager around the wait giving a Shown (the cli's live table); None shows nothing
Show = Callable[[list["ServiceState"]], ContextManager[Shown]]


class _Unseen:
    def refresh(self) -> None:
        pass


# ---------------------------------------------------------------- running the stages

def run_stages(plan: LaunchPlan, runner: Runner, timeout: float, show: Show | None, start_one) -> LaunchReport:
    """Start (via start_one(service) -> error or None) and gate every stage in order, then wait for
    every service's ready gates."""
    services = plan.services()
    rep = LaunchReport(plan.hosts(), plan=plan)
    started_at = clock.monotonic()
    deadline = started_at + timeout
    states = {s.name: ServiceState(s) for s in services}

    def fail(svc: Service, why: str, phase_detail: str) -> None:
        states[svc.name].phase, states[svc.name].detail = "failed", phase_detail
        rep.failed_rank, rep.failed_service, rep.failure = svc.host, svc.name, f"{describe(svc)}{why}"

    def dead(among: list[Service]) -> bool:
        for svc in among:
            c = inspect(runner.session(svc.host), svc.spec.name)
            if not c.running:
                fail(svc, f" exited with code {c.exit_code} while the others were starting", f"exited ({c.exit_code})")
                return True
        return False

    def wait_ready(svcs: list[Service], status: Shown, live: list[Service]) -> bool:
        todo = [s for s in svcs if s.ready]
        while todo:
            if dead(live):
                return False
            for svc in list(todo):
                pending, detail = pending_gates(runner.session(svc.host), svc)
                st = states[svc.name]
                st.phase, st.detail = "loading", detail
                if not pending:
                    st.phase = "ready"
                    st.detail = ", ".join(g.describe() for g in svc.ready)
                    todo.remove(svc)
                elif clock.monotonic() > deadline:
                    fail(svc, f": no {' and '.join(_short(g) for g in pending)} within {timeout:.0f} s", "timed out")
                    return False
            status.refresh()
            if todo:
                clock.sleep(0.5)
        return True

    def watch(svcs: list[Service], ready: bool, status: Shown, live: list[Service]) -> bool:
        """A stage's services watched together, so that their windows overlap: each running for its
        start gate's seconds and, where the stage waits for ready, its ready gates asked in the same
        rounds (ready once both hold). One of them exiting fails the launch, as does an earlier
        stage's service."""
        up_since: dict[str, float] = {}
        waiting: dict[str, list[Gate]] = {}  # the ready gates each one still waits for
        todo = list(svcs)
        while True:
            if dead(live):
                return False
            for svc in list(todo):
                st = states[svc.name]
                c = inspect(runner.session(svc.host), svc.spec.name)
                if c.exists and not c.running and c.status == "exited":
                    fail(svc, f": the container exited with code {c.exit_code}", f"exited with code {c.exit_code}")
                    return False
                if not (c.running and c.pid):
                    continue
                ran = clock.monotonic() - up_since.setdefault(svc.name, clock.monotonic()) >= svc.started.seconds
                gated = ready and bool(svc.ready)
                if gated:
                    waiting[svc.name], detail = pending_gates(runner.session(svc.host), svc)
                    st.phase, st.detail = "loading", detail
                if ran and not waiting.get(svc.name):
                    todo.remove(svc)
                    if gated:
                        st.phase, st.detail = "ready", ", ".join(g.describe() for g in svc.ready)
                    else:
                        st.phase = "running"
                        st.detail = "waiting for the head" if svc.role == "worker" else "started"
            if not todo:
                return True
            if clock.monotonic() > deadline:
                svc = todo[0]
                if waiting.get(svc.name):
                    gates = " and ".join(_short(g) for g in waiting[svc.name])
                    fail(svc, f": no {gates} within {timeout:.0f} s", "timed out")
                else:
                    fail(svc, f": not running after {timeout:.0f} s", "timed out starting")
                return False
            status.refresh()
            clock.sleep(0.5 if ready else POLL_S)

    with show(list(states.values())) if show else nullcontext(_Unseen()) as status:
        live: list[Service] = []
        for stage in plan.stages:
            for svc in stage.services:
                st = states[svc.name]
                st.phase, st.detail = "starting", ""
                status.refresh()
                err = start_one(svc)
                if err:
                    fail(svc, f" did not start: {err}", err)
                    break
                rep.started.append(svc.name)
            if rep.failure:
                break
            if not watch(list(stage.services), stage.wait == "ready", status, live):
                break
            live += stage.services
        if not rep.failure and wait_ready(services, status, live):
            for st in states.values():
                if st.phase != "ready":
                    st.phase, st.detail = "ready", "joined the head" if st.service.role == "worker" else st.detail
            rep.ready_seconds = clock.monotonic() - started_at
            rep.api = plan.endpoint.url
    if rep.failure:
        rep.hint = ("read the logs above; `inv logs --rank HOST`; `inv preflight` for the hosts; --rollback stops what a "
                    "failed launch started")
        assert rep.failed_service is not None  # fail() sets it with the failure
        if states[rep.failed_service].detail.startswith("timed out"):  # a rank may wait for a peer it cannot reach
            cut = unreachable_dials(plan, runner, {s.host for s in live})
            if cut:
                rep.failure += "; " + "; ".join(f"{d.src} cannot reach {d.address}:{d.port} on {d.dst} ({d.what}): "
                                                f"{CUT.get(how, how)}" for d, how in cut)
                rep.hint = ("; ".join(dict.fromkeys(f"allow TCP {d.port} from {d.src} on {d.dst} (`nft list ruleset`, "
                                                    f"`iptables -S` there)" for d, _ in cut))
                            + "; `inv preflight` tries every port the plan dials; then `inv launch --recreate`")
        rep.logs = {label(plan, s): log_tail(runner.session(s.host), s.spec.name, 20) for s in services}
    return rep


GATE_DIAL_S = 3  # each connection of the plan tried again for this long when a launch timed out
CUT = {"timeout": "no answer (dropped: a firewall on the rail?)", "refused": "refused (nothing listens, or a "
       "firewall rejects it)", "unreachable": "unreachable (ICMP: a firewall rejecting it, or no route)"}


def unreachable_dials(plan: LaunchPlan, runner: Runner, running: set[str]) -> list[tuple[Dial, str]]:
    """The plan's connections between hosts whose target host runs its service, tried once more from each
    dialing host at once (scripts/port_probe.py): those that did not connect, with how they failed."""
    by_src: dict[str, list[Dial]] = {}
    for d in plan.dials:
        if d.dst in running:
            by_src.setdefault(d.src, []).append(d)

    def one(s: Session) -> dict:
        mine = list(dict.fromkeys((d.address, d.port) for d in by_src[s.host.name]))
        return parse_port_probe(s.run(port_probe(GATE_DIAL_S, [], mine), timeout=GATE_DIAL_S + 10).stdout)[1]
    got = runner.each(one, [runner.session(src).host for src in by_src])
    out = []
    for src, dials in by_src.items():
        seen = got.ok.get(src, {})  # a host that did not answer shows nothing
        out += [(d, seen[(d.address, d.port)].status) for d in dials
                if (d.address, d.port) in seen and seen[(d.address, d.port)].status != "connected"]
    return out


# ---------------------------------------------------------------- apply

def prechecks(plan: LaunchPlan, runner: Runner, files: list[EnvFile], model_path: str) -> None:
    """Before anything starts: the env files current, every pinned image on the hosts that run it (one
    image id per image everywhere) and the checkpoint on every host whose services mount it."""
    stale = sorted({f.host for f in files if f.changed}, key=plan.hosts().index)
    if stale:
        raise LaunchError(f"the env files are not current on {', '.join(stale)}: run `inv env` (see `inv env --check`)")
    images = {h: list(dict.fromkeys(s.spec.image for s in plan.on_host(h))) for h in plan.hosts()}
    model_hosts = {s.host for s in plan.services() if any(m.kind == "model" for m in s.spec.mounts)}

    def look(s: Session):
        ids = {}
        for image in images[s.host.name]:
            r = s.run(cmd("docker", "image", "inspect", image), timeout=60)
            try:
                imgs = parse_image_inspect(r.stdout) if not r.error else []
            except ParseError:
                imgs = []
            ids[image] = imgs[0].id if imgs else None
        ok = s.host.name not in model_hosts or s.run(
            f"test -f {q(RemotePath(model_path + '/config.json'))}", timeout=30).ok
        staged = [m.source for svc in plan.on_host(s.host.name) for m in svc.spec.mounts if m.kind == "staged"]
        unstaged = [d for d in dict.fromkeys(staged)
                    if not s.run(f"test -f {q(d + '/' + engines.STAGED_MARK)}", timeout=30).ok]
        return ids, ok, unstaged

    looked = runner.each(look, [runner.session(h).host for h in plan.hosts()])
    got = {n: looked.ok.get(n, ({i: None for i in images[n]}, False, [])) for n in looked}
    for image in dict.fromkeys(i for imgs in images.values() for i in imgs):
        having = {n: ids[image] for n, (ids, _, _) in got.items() if image in ids}
        missing_img = [n for n, i in having.items() if not i]
        if missing_img:
            raise LaunchError(f"the pinned image is not on {', '.join(missing_img)}: docker pull {image} there "
                              "(`inv preflight` checks it)")
        if len(set(having.values())) > 1:
            raise LaunchError("the image id differs between ranks: " +
                              ", ".join(f"{n}={i[:19]}" for n, i in having.items()) + f" (docker pull {image} everywhere)")
    no_model = [n for n, (_, ok, _) in got.items() if not ok]
    if no_model:
        raise LaunchError(f"no checkpoint (config.json) at {model_path} on {', '.join(no_model)}: run `inv sync-model`")
    unstaged = [f"{n} ({', '.join(got[n][2])})" for n in plan.report_hosts() if n in got and got[n][2]]
    if unstaged:
        raise LaunchError(f"nothing staged (no {engines.STAGED_MARK}) in the folder the engine mounts on "
                          f"{', '.join(unstaged)}: run `inv sync-model`, which stages it and copies it to every host")


def ensure_secrets(plan: LaunchPlan, runner: Runner) -> list[str]:
    """Create each service's secret file (0600) on its host unless it exists; the files created."""
    made = []
    for svc in plan.services():
        for sec in svc.spec.secrets:
            s = runner.session(svc.host)
            if not s.run(f"test -s {q(RemotePath(sec.host_file))}", timeout=30).ok:
                write_remote(s, sec.host_file, sec.prefix + secrets.token_urlsafe(32) + "\n")
                made.append(f"{svc.host}:{sec.host_file}")
    return made


def ensure_files(plan: LaunchPlan, runner: Runner, services: list[Service]) -> None:
    """The services' own folders (state mounts) and rendered files on their hosts; a file is written
    only when its content differs."""
    for svc in services:
        s = runner.session(svc.host)
        dirs = [m.source for m in svc.spec.mounts if m.kind == "state"]
        if dirs:
            r = s.run(cmd("mkdir", "-p", *[RemotePath(d) for d in dirs]), timeout=30)
            if not r.ok:
                raise CommandFailed(r, f"could not make {', '.join(dirs)}")
        for f in svc.spec.files:
            if read_remote(s, f.host_path) != f.content:
                write_remote(s, f.host_path, f.content, mode=f"{f.mode:o}")


def apply(plan: LaunchPlan, runner: Runner, files: list[EnvFile], model_path: str, recreate: bool, timeout: float,
          rollback: bool, show: Show | None) -> LaunchReport:
    services = plan.services()
    commands = {s.name: run_line(plan, s) for s in services}
    prechecks(plan, runner, files, model_path)
    existing = {s.name: inspect(runner.session(s.host), s.spec.name) for s in services}
    wanted = {s.name: config_hash(plan, s) for s in services}
    if all(c.exists and c.running and c.config == wanted[n] for n, c in existing.items()):
        return LaunchReport(plan.hosts(), commands, noop=True, api=plan.endpoint.url, plan=plan)
    present = {n: c for n, c in existing.items() if c.exists}
    # what an interrupted or failed launch of this same plan left running is kept: the launch resumes
    keep = set() if recreate else {n for n, c in present.items() if c.running and c.config == wanted[n]}
    other = {n: c for n, c in present.items() if n not in keep}
    if other and not recreate:
        names = ", ".join(sorted({plan.service(n).spec.name for n in other}))
        desc = ", ".join(f"{label(plan, plan.service(n))}: {c.status}"
                         f"{'' if c.config == wanted[n] else ', another configuration'}" for n, c in other.items())
        raise LaunchError(f"container {names} already exists ({desc}): pass --recreate to replace it, or use "
                          "`inv start` to resume stopped containers")
    for svc in teardown_order(plan):
        if svc.name in present and svc.name not in keep:
            runner.session(svc.host).run(cmd("docker", "rm", "-f", svc.spec.name), timeout=120)
    ensure_secrets(plan, runner)
    ensure_files(plan, runner, services)

    refused: list[str] = []   # a run docker refused at start (a --device the host lacks) leaves a Created container

    def start_one(svc: Service) -> str | None:
        if svc.name in keep:  # its gates are still waited for, as for the others
            return None
        r = runner.session(svc.host).run(commands[svc.name], timeout=300)
        if r.error:
            return f"{r.error.kind}: {r.error.message}"
        if r.rc != 0:
            refused.append(svc.name)
            return (r.stderr.strip() or r.stdout.strip()).splitlines()[-1] if (r.stderr or r.stdout) else f"exit {r.rc}"
        return None

    rep = run_stages(plan, runner, timeout, show, start_one)
    rep.kept = [label(plan, plan.service(n)) for n in rep.started if n in keep]
    rep.started = [n for n in rep.started if n not in keep]
    rep.commands = commands
    final_gates(plan, runner, rep)
    rep.timeline = timeline.read(plan, runner)  # before a rollback removes what it is read from
    if rep.failure and rollback:
        rep.rolled_back = stop_services(plan, runner, [s for s in services if s.name in rep.started + refused],
                                        remove=True)
    return rep


# ---------------------------------------------------------------- lifecycle

def stop_services(plan: LaunchPlan, runner: Runner, services: list[Service], remove: bool = False) -> list[str]:
    done = []
    for svc in (s for s in teardown_order(plan) if s in services):
        s = runner.session(svc.host)
        s.run(cmd("docker", "stop", "--timeout", "60", svc.spec.name), timeout=120)
        if remove:
            s.run(cmd("docker", "rm", "-f", svc.spec.name), timeout=60)
        done.append(svc.host)
    return done


@dataclass
class StopResult:
    host: str
    service: str
    status: str
    gpu_free: bool
    detail: str


def stop(plan: LaunchPlan, runner: Runner) -> list[StopResult]:
    out = []
    for svc in teardown_order(plan):
        s = runner.session(svc.host)
        c = inspect(s, svc.spec.name)
        if c.exists and c.running:
            r = s.run(cmd("docker", "stop", "--timeout", "60", svc.spec.name), timeout=120)
            if not r.ok:
                out.append(StopResult(svc.host, svc.name, "error", False, (r.stderr or str(r.error)).strip()))
                continue
        c = inspect(s, svc.spec.name)
        procs = gpu_usage(s, svc.spec.gpus.uuids).processes
        detail = f"Status={c.status} Running={str(c.running).lower()}" if c.exists else "no container"
        if procs:
            detail += "; still on the GPU: " + ", ".join(f"pid {p.pid} {p.name} {p.used_mib} MiB" for p in procs)
        out.append(StopResult(svc.host, svc.name, c.status if c.exists else "missing", not procs, detail))
    return out


def start(plan: LaunchPlan, runner: Runner, timeout: float, show: Show | None) -> LaunchReport:
    services = plan.services()
    existing = {s.name: inspect(runner.session(s.host), s.spec.name) for s in services}
    missing = [label(plan, plan.service(n)) for n, c in existing.items() if not c.exists]
    if missing:
        names = ", ".join(sorted({s.spec.name for s in services}))
        raise LaunchError(f"no container {names} on {', '.join(missing)}: run `inv launch`")
    if all(c.running for c in existing.values()):
        return LaunchReport(plan.hosts(), noop=True, api=plan.endpoint.url, plan=plan)

    def start_one(svc: Service) -> str | None:
        if existing[svc.name].running:
            return None
        r = runner.session(svc.host).run(cmd("docker", "start", svc.spec.name), timeout=120)
        return None if r.ok else (r.stderr.strip() or str(r.error))

    rep = run_stages(plan, runner, timeout, show, start_one)
    final_gates(plan, runner, rep)
    return rep


def final_gates(plan: LaunchPlan, runner: Runner, rep: LaunchReport) -> None:
    """The layout's gate over the whole plan once every service is ready (its final_gate hook), if it has one."""
    if rep.failure:
        return
    proof = layouts.by_name(plan.layout).final_gate(plan, runner)
    if proof is None:
        return
    rep.proof = proof.detail
    if not proof.ok:
        gate = plan.service(plan.endpoint.service)
        rep.failed_rank, rep.failed_service = gate.host, gate.name
        rep.failure = f"{proof.what} is not proven: {proof.detail}"
        rep.hint = proof.fix


def status(plan: LaunchPlan, runner: Runner) -> list[dict]:
    def one(svc: Service) -> dict:
        s = runner.session(svc.host)
        c = inspect(s, svc.spec.name)
        image = svc.spec.image
        img = s.run(cmd("docker", "image", "inspect", "--format", "{{.Id}} {{json .RepoDigests}}", c.image or image),
                    timeout=30)
        digests = []
        if img.ok and img.stdout.strip():
            try:
                digests = json.loads(img.stdout.split(" ", 1)[1])
            except (ValueError, IndexError):
                digests = []
        g = gpu_usage(s, svc.spec.gpus.uuids)
        used = {"used_mib": g.used_mib, "total_mib": g.total_mib} if g.used_mib is not None else None
        return {"host": svc.host, "rank": svc.rank, "service": svc.name, "role": svc.role, "container": svc.spec.name,
                "state": c.status if c.exists else "missing", "running": c.running,
                "started_at": c.started if c.exists else None, "uptime_s": uptime(c.started) if c.running else None,
                "image_id": c.image or None, "image_digests": digests,
                "pinned_digest_ok": any(d.endswith(image.split("@", 1)[1]) for d in digests),
                "config": c.config or None, "config_current": bool(c.config) and c.config == config_hash(plan, svc),
                "gpu_uuid": svc.spec.gpus.uuids[0] if svc.spec.gpus.uuids else None,
                "gpu_uuids": list(svc.spec.gpus.uuids), "gpu_memory": used}

    def host_rows(s: Session) -> list[dict]:  # the services of one host, one after another on its session
        out = []
        for svc in (x for x in plan.by_rank() if x.host == s.host.name):
            try:
                out.append(one(svc))
            except LaunchError as e:
                out.append({"host": svc.host, "rank": svc.rank, "service": svc.name, "state": "unreachable",
                            "running": False, "error": str(e)})
        return out

    got = runner.each(host_rows, [runner.session(h).host for h in plan.report_hosts()])
    rows: list[dict] = []
    for h in plan.report_hosts():
        rows += got.ok[h] if h in got.ok else [{"host": h, "rank": svc.rank, "service": svc.name, "state": "unreachable",
                                                "running": False, "error": str(got.failed[h].error)}
                                               for svc in plan.on_host(h)]
    return rows


def container_of(plan: LaunchPlan, which: str | None) -> Service:
    """A service by host name, rank number or service name; the endpoint's when the plan has one host."""
    services = plan.services()
    if which is None:
        if len(plan.hosts()) == 1:
            return plan.service(plan.endpoint.service)
        raise UsageError("--rank: name a host (B), a rank number (1) or a service")
    for svc in services:
        if which in (svc.name, svc.host) or (which.isdigit() and svc.rank == int(which)):
            return svc
    raise UsageError(f"--rank {which}: no such host, rank or service (services: "
                      f"{', '.join(f'{s.host}:{s.name}' for s in services)})")

