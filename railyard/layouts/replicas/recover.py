"""Running the `replicas` layout: who holds each GPU, the router's view and its drain list, and
`inv recover` for a replica that crashed or needs a restart.

A hung replica (a serving process stopped: /health still answers 200, nothing moves) takes the
short path too, killed instead of stopped: its requests in flight never finish.

A crashed replica's GPUs can stay full after it died: LMCache's CUDA IPC handles into its KV
cache keep the memory allocated until LMCache itself restarts (LMCache #4014; seen in the
reference: 122.61 GiB free, 169.43 GiB needed). So recover looks first:

    short path  the replica's GPUs hold nothing but its own processes: take it out of routing
                (railyard's drain filter in LiteLLM), wait for its requests in flight, restart it
                alone, gate it, put it back;
    long path   another process (LMCache) holds memory on them: stop the replicas, restart LMCache,
                start the replicas, in that order; the router stays up;
    blocked     a process of no container of this deployment holds them: named, nothing touched.

Before any replica starts, its GPUs must have free >= gpu_memory_utilization x total, or recover
stops with the numbers. The verb around it (railyard.verbs.recover) holds the operator lock, checks
the restart budget and records the recovery.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ...facts import ParseError
from ...errors import LaunchError, UsageError
from ...facts.probe import Section, joined_script, new_token, split_output
from ...facts.gpu import Gpu, apps_section, gpus_section, parse_compute_apps, parse_gpus
from ...transport.runner import Runner
from ...engines.litellm import CONFIG_TARGET, parse_health
from ...plan.spec import Endpoint, LaunchPlan, Service
from ...transport import Session, Sh, write_remote
from ...facts.docker import inspect
from ...transport.http import parse_metrics, request
from ...apply.executor import Show
from ...apply.recovery import Recovery, start_alone, take_down
from ...checks.hang import Verdict
from ...inventory import Inventory

DRAIN_FILE = "drained"


# ---------------------------------------------------------------- who holds each GPU

@dataclass
class Holder:
    gpu_uuid: str
    pid: int
    name: str
    used_mib: int
    container: str  # "" when the process belongs to no container
    state: str = ""  # its process state (ps's stat: T is stopped)


@dataclass
class GpuState:
    gpus: dict[str, Gpu]  # uuid -> the GPU (memory used/total)
    holders: list[Holder]


def parse_pid_table(text: str) -> tuple[dict[int, int], dict[int, str]]:
    """`ps -e -o pid=,ppid=,stat=` -> ({pid: ppid}, {pid: state})."""
    parents, states = {}, {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0].isdigit() and parts[1].isdigit():
            parents[int(parts[0])] = int(parts[1])
            states[int(parts[0])] = parts[2] if len(parts) > 2 else ""
    return parents, states


def parse_container_pids(text: str) -> dict[int, str]:
    """`docker inspect --format '{{.State.Pid}} {{.Name}}' ...` -> {main pid: container name} (running ones)."""
    out = {}
    for line in text.splitlines():
        pid, _, name = line.strip().partition(" ")
        if pid.isdigit() and int(pid) > 0 and name:
            out[int(pid)] = name.lstrip("/")
    return out


def container_of_pid(pid: int, parents: dict[int, int], mains: dict[int, str]) -> str:
    """The container whose main process is pid or one of its ancestors ("" if none)."""
    seen = set()
    while pid and pid not in seen:
        if pid in mains:
            return mains[pid]
        seen.add(pid)
        pid = parents.get(pid, 0)
    return ""


def gpu_state(s: Session) -> GpuState:
    """Every GPU's memory and every compute process on it, mapped to its container, in one round trip."""
    sections = [gpus_section(), apps_section(),
                Section("ps", Sh("ps -e -o pid=,ppid=,stat=")),
                Section("mains", Sh("n=$(docker ps --format '{{.Names}}'); [ -z \"$n\" ] || docker inspect --format "
                                    "'{{.State.Pid}} {{.Name}}' $n"), "docker")]
    token = new_token()
    r = s.run(joined_script(sections, token), timeout=60)
    if r.error:
        raise LaunchError(f"{s.host.name}: {r.error.kind}: {r.error.message}")
    out = split_output(r.stdout, sections, token)
    for key in ("gpus", "apps"):
        if not out[key].ok:
            raise LaunchError(f"{s.host.name}: nvidia-smi failed: {out[key].text.strip()[:200]}")
    try:
        gpus = {g.uuid: g for g in parse_gpus(out["gpus"].text)}
        apps = parse_compute_apps(out["apps"].text)
    except ParseError as e:
        raise LaunchError(f"{s.host.name}: {e}") from None
    parents, states = parse_pid_table(out["ps"].text)
    mains = parse_container_pids(out["mains"].text) if out["mains"].ok else {}
    return GpuState(gpus, [Holder(a.gpu_uuid, a.pid, a.name, a.used_mib, container_of_pid(a.pid, parents, mains),
                                  states.get(a.pid, "")) for a in apps])


def foreign_holders(state: GpuState, svc: Service) -> list[Holder]:
    """Processes on the service's GPUs that are not the service's own."""
    mine = set(svc.spec.gpus.uuids)
    return [h for h in state.holders if h.gpu_uuid in mine and h.container != svc.spec.name]


def short_of_memory(state: GpuState, svc: Service, util: float) -> list[str]:
    """The service's GPUs without free >= util x total, as `GPU 5: 122.61 GiB free, 169.43 GiB needed`."""
    out = []
    for u in svc.spec.gpus.uuids:
        g = state.gpus.get(u)
        if g is None:
            out.append(f"{u}: not on the host")
            continue
        free, need = (g.memory_total_mib - g.memory_used_mib) / 1024, util * g.memory_total_mib / 1024
        if free < need:
            out.append(f"GPU {g.index}: {free:.2f} GiB free, {need:.2f} GiB needed")
    return out


def describe_holder(h: Holder, state: GpuState) -> str:
    g = state.gpus.get(h.gpu_uuid)
    where = f"GPU {g.index}" if g else h.gpu_uuid
    return f"{where}: pid {h.pid} {h.name} {h.used_mib / 1024:.1f} GiB ({h.container or 'no container'})"


# ---------------------------------------------------------------- the router

def router_dir(plan: LaunchPlan) -> str:
    router = plan.service("router")
    return next(m.source for m in router.spec.mounts if m.target == CONFIG_TARGET)


def set_drained(s: Session, plan: LaunchPlan, names: list[str]) -> None:
    """The replicas the router must not pick (railyard's filter reads the file on every request)."""
    write_remote(s, f"{router_dir(plan)}/{DRAIN_FILE}", "".join(f"{n}\n" for n in names), mode="644")


def in_flight(s: Session, svc: Service, model: str) -> float | None:
    """Requests running or waiting on a replica, from its /metrics (None: no answer)."""
    code, _, text, _ = request(s, Endpoint.of(svc, model), "/metrics", timeout=10)
    if code != 200:
        return None
    m = parse_metrics(text)
    return m.get("vllm:num_requests_running", 0.0) + m.get("vllm:num_requests_waiting", 0.0)


# ---------------------------------------------------------------- recover

@dataclass
class ReplicaView:
    service: Service
    running: bool
    healthy: bool
    status: str
    foreign: list[Holder] = field(default_factory=list)
    stopped: list[Holder] = field(default_factory=list)  # its own GPU processes that are stopped: hung
    hung: list[str] = field(default_factory=list)        # the shared hung verdict's evidence (railyard.checks.hang)


TITLES = {"short": "short path: restart the replica alone", "long": "long path: restart LMCache and every replica"}


def _views(s: Session, plan: LaunchPlan, state: GpuState, verdicts: list[Verdict]) -> list[ReplicaView]:
    out = []
    for svc in (x for x in plan.services() if x.role == "replica"):
        c = inspect(s, svc.spec.name)
        code = request(s, Endpoint.of(svc, plan.endpoint.model), "/health", timeout=5)[0] if c.running else 0
        status = c.status if c.exists else "missing"
        if c.exists and not c.running:
            status += f" (exit code {c.exit_code})"
        own = [h for h in state.holders if h.container == svc.spec.name and h.state.startswith("T")]
        hung = [f"{v.state}: {'; '.join(v.evidence)}" for v in verdicts if v.service == svc.name and v.bad
                and v.source != "container"]
        out.append(ReplicaView(svc, c.running, code == 200, status, foreign_holders(state, svc), own if c.running else [],
                               hung if c.running else []))
    return out


def decide(plan: LaunchPlan, views: list[ReplicaView], state: GpuState, which: str | None) -> Recovery:
    """What recover would do, and why (pure)."""
    names = [v.service.name for v in views]
    if which is not None and which not in names:
        raise UsageError(f"--replica {which}: no such replica (replicas: {', '.join(names)})")
    lmcache = plan.service("lmcache").spec.name
    if which is not None:
        targets = [v for v in views if v.service.name == which]
    else:
        targets = [v for v in views if not (v.running and v.healthy and not v.stopped and not v.hung)]
    if not targets:
        return Recovery("none", [], [f"every replica runs and answers /health ({', '.join(names)})"], [])
    why = []
    for v in targets:
        state_line = (f"is hung: {v.stopped[0].name} (pid {v.stopped[0].pid}) on its GPU is stopped (state "
                      f"{v.stopped[0].state}), whatever /health answers" if v.stopped else
                      f"is {v.hung[0]}, whatever /health answers" if v.hung else
                      "runs and answers /health: a planned restart" if v.running and v.healthy else
                      f"is {v.status}" if not v.running else "runs but /health does not answer")
        why.append(f"{v.service.name} {state_line}")
    crashed = [v for v in targets if not v.running]
    others = [h for v in crashed for h in v.foreign if h.container != lmcache]
    if others:
        return Recovery("blocked", [v.service.name for v in targets],
                        why + [f"memory on {v.service.name}'s GPUs is held by a process of no replica or LMCache: "
                               + "; ".join(describe_holder(h, state) for h in v.foreign if h.container != lmcache)
                               for v in crashed if any(h.container != lmcache for h in v.foreign)],
                        ["nothing: stop that process (or its container) first, then run `inv recover` again"])
    held = [v for v in crashed if v.foreign]
    if held:
        for v in held:
            why.append(f"LMCache still holds {v.service.name}'s GPUs (its CUDA IPC handles outlive the crash): "
                       + "; ".join(describe_holder(h, state) for h in v.foreign))
        why.append("only restarting LMCache frees that memory, and every replica must reconnect to the new one")
        replicas = [v.service.name for v in views]
        running = [v.service.name for v in views if v.running]
        steps = ([f"wait for requests in flight on {', '.join(running)}"] if running else []) + [
            f"stop {', '.join(reversed(running))}" if running else "no replica to stop",
            f"restart LMCache ({lmcache}) and gate on /healthcheck",
            f"check free GPU memory >= gpu_memory_utilization x total for {', '.join(replicas)}",
            f"start {', '.join(replicas)} and gate each (startup, LMCache registration, /health)",
            "the router stays up: wait until its health check lists every replica healthy again"]
        return Recovery("long", replicas, why, steps, title=TITLES["long"])
    steps = []
    for v in targets:
        n = v.service.name
        steps += [f"take {n} out of routing (railyard's drain list in the router)"]
        if v.stopped or v.hung:
            steps += [f"kill {n} (hung: its requests in flight never finish; a stopped process never sees SIGTERM)"]
        elif v.running:
            steps += [f"wait for {n}'s requests in flight", f"stop {n}"]
        steps += [f"check free GPU memory on {n}'s GPUs >= gpu_memory_utilization x total",
                  f"start {n} alone and gate it (startup, LMCache registration, /health)", f"put {n} back into routing",
                  f"wait until the router's health check lists {n} healthy"]
    if crashed:
        why.append(f"{', '.join(v.service.name for v in crashed)}: its GPUs hold no other process")
    return Recovery("short", [v.service.name for v in targets], why, steps,
                    hung=[v.service.name for v in targets if v.stopped or v.hung], title=TITLES["short"])


def survey(plan: LaunchPlan, runner: Runner, which: str | None, verdicts: list[Verdict]) -> tuple[Recovery, GpuState]:
    """Who holds each GPU and each replica's state, with the shared hung verdict (railyard.checks.hang); then decide."""
    s = runner.session(plan.endpoint.host)
    state = gpu_state(s)
    return decide(plan, _views(s, plan, state, verdicts), state, which), state


def _wait_idle(s: Session, svc: Service, model: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while True:
        n = in_flight(s, svc, model)
        if not n:  # 0, or no answer (nothing in flight can finish there)
            return "" if n == 0 else "no /metrics answer"
        if time.monotonic() > deadline:
            raise LaunchError(f"{svc.name} still has {n:g} requests in flight after {timeout:.0f} s; it stays out of "
                              "routing (run `inv recover` again, or stop it yourself)")
        time.sleep(0.5)


def router_healthy(s: Session, plan: LaunchPlan) -> tuple[set[str], str]:
    """The replicas the router's /health lists healthy (its last background check), or why not known."""
    code, _, text, _ = request(s, plan.endpoint, "/health", timeout=60)
    try:
        return (set(parse_health(text).healthy), "") if code == 200 else (set(), f"HTTP {code}: {text[:120]}")
    except ValueError:
        return set(), text[:120]


def execute(plan: LaunchPlan, runner: Runner, rec: Recovery, util: float, timeout: float, drain_timeout: float,
            show: Show | None, router_wait: float = 60.0) -> Recovery:
    """Take the chosen path. It ends when the router's own health check lists the restarted replicas
    healthy again (within router_wait seconds): until then LiteLLM does not route to them."""
    s = runner.session(plan.endpoint.host)
    model = plan.endpoint.model
    targets = [plan.service(n) for n in rec.services]

    def routed(svcs: list[Service]) -> None:
        want = {svc.name for svc in svcs}
        deadline = time.monotonic() + router_wait
        while True:
            seen, why = router_healthy(s, plan)
            if want <= seen:
                rec.done.append(f"the router sees {', '.join(sorted(want))} healthy")
                return
            if time.monotonic() > deadline:
                raise LaunchError(f"{', '.join(sorted(want - seen))} serve(s) again, but the router's health check has "
                                  f"not listed them healthy within {router_wait:.0f} s"
                                  + (f" ({why})" if why else f" (healthy there: {', '.join(sorted(seen)) or 'none'})"))
            time.sleep(1)

    def memory_ok(svcs: list[Service]) -> None:
        state = gpu_state(s)
        short = {svc.name: short_of_memory(state, svc, util) for svc in svcs}
        short = {k: v for k, v in short.items() if v}
        if short:
            holders = "; ".join(describe_holder(h, state) for svc in svcs for h in foreign_holders(state, svc))
            raise LaunchError("not enough free GPU memory to start " + "; ".join(
                f"{k}: {', '.join(v)}" for k, v in short.items()) + f" (gpu_memory_utilization {util:g})"
                + (f"; held by {holders}" if holders else ""))
        rec.done.append(f"free GPU memory checked for {', '.join(svc.name for svc in svcs)}")

    try:
        if rec.path == "short":
            set_drained(s, plan, rec.services)
            rec.done.append(f"took {', '.join(rec.services)} out of routing")
            for svc in targets:
                if inspect(s, svc.spec.name).running:
                    if svc.name not in rec.hung:
                        why = _wait_idle(s, svc, model, drain_timeout)
                        rec.done.append(f"{svc.name}: no request in flight" + (f" ({why})" if why else ""))
                    take_down(s, svc, rec)
            memory_ok(targets)
            start_alone(plan, runner, targets, rec, timeout, show)
            set_drained(s, plan, [])
            rec.done.append(f"put {', '.join(rec.services)} back into routing")
            routed(targets)
        elif rec.path == "long":
            lmc = plan.service("lmcache")
            running = [svc for svc in targets if inspect(s, svc.spec.name).running]
            for svc in running:
                _wait_idle(s, svc, model, drain_timeout)
            for svc in reversed(running):
                take_down(s, svc, rec)
            take_down(s, lmc, rec)
            start_alone(plan, runner, [lmc], rec, timeout, show)
            memory_ok(targets)
            start_alone(plan, runner, targets, rec, timeout, show)
            routed(targets)
    except LaunchError as e:
        rec.failure = str(e)
    return rec


def restore(inv: Inventory, runner: Runner, plan: LaunchPlan, rec: Recovery, timeout: float, drain_timeout: float,
            show: Show | None) -> Recovery:
    """Take the path survey chose (the verb holds the operator lock)."""
    v = inv.host(plan.endpoint.host).vars
    router_wait = 2 * v["litellm_health_check_interval_s"] + 30  # two checks, and the checks themselves
    return execute(plan, runner, rec, float(v["vllm_gpu_memory_utilization"]), timeout, drain_timeout, show,
                   router_wait)
