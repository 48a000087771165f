"""The hung verdict that `inv health`, `inv recover`, `inv hang-dump` and `inv health --watch --recover` share.

A deployment can answer /health with 200 and serve nothing: vLLM's /health is 200 unless the engine is
dead (vllm-project/vllm #36451, #39863). So each engine process group (a replica, a pd instance, a TP
group, a DP rank) is judged on what it shows, and hung only on positive evidence:

    stopped   a process of its container is stopped (state T or t in /proc/PID/stat: SIGSTOP, a debugger)
    counters  requests running or waiting on one engine (its `engine` label in /metrics: a DP rank) while
              its token counters stayed still over the window (two reads, at least `window_s` apart)
    log       the engine's own hang lines, written after it served (its steady state): vLLM's
              "No available shared memory broadcast block found in 60 seconds" (benign during compile and
              warm-up, before the API is up), its RPC timeout ("RPC call to sample_tokens timed out."),
              NCCL's watchdog ("Watchdog caught collective operation timeout")
    dead      its container is not running, or its API process is gone

A probe that gets no token within its limit is the load the counters are judged under: it is a request
running on an engine that does not move. A timeout alone is not a verdict: an engine whose counters moved
is busy; one whose counters are still all 0 has not finished its first step (cold); counters that could not
be read twice are unknown. All pure: the reads are railyard.verbs.hung's.
"""

from __future__ import annotations

import re
import time
from dataclasses import asdict, dataclass, field

from ..facts.probe import Output

OK, HUNG, DEAD, UNKNOWN = "ok", "hung", "dead", "unknown"

# the engine's own lines that say it waits on its peers; each from the pinned engine's source or a real capture
HANG_LINES = (
    # vllm/distributed/device_communicators/shm_broadcast.py (0.32): LONG_WAIT_TIME_LOG_MSG, every 60 s a
    # writer or reader of the broadcast queue waits (VLLM_RINGBUFFER_WARNING_INTERVAL)
    ("shm_broadcast", re.compile(r"No available shared memory broadcast block found in \d+ seconds")),
    # vllm/v1/executor/multiproc_executor.py (0.32): collective_rpc's response timed out
    ("rpc_timeout", re.compile(r"RPC call to \w+ timed out")),
    # PyTorch's NCCL watchdog (tests/fixtures/real/hang: an H100, torch 2.11, NCCL 2.28.9)
    ("nccl_watchdog", re.compile(r"Watchdog caught collective operation timeout")),
)
READY_LINE = "Application startup complete"   # uvicorn: the API serves; hang lines before it are warm-up
_STAMP = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.\d+)?Z\s")


@dataclass
class Verdict:
    """One engine process group's verdict: what was judged (`target`: the service, `engine 2` of it, its API
    process), the state and the evidence read for it."""
    host: str
    service: str
    target: str
    state: str                      # ok | hung | dead | unknown
    evidence: list[str] = field(default_factory=list)
    source: str = ""                # stopped | counters | log | container | api | probe

    @property
    def bad(self) -> bool:
        return self.state in (HUNG, DEAD)

    def line(self) -> str:
        """`B worker-1 (rank 1): hung: ...`, the one-line verdict."""
        return f"{self.host} {self.target}: {self.state}" + (f": {'; '.join(self.evidence)}" if self.evidence else "")

    def as_dict(self) -> dict:
        return asdict(self)


# ---------------------------------------------------------------- processes

@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    state: str      # ps's stat: its first letter is the kernel's state
    title: str      # the command line as ps shows it (vLLM's process titles: VLLM::Worker_TP1)
    comm: str = ""  # the kernel's name, 15 characters (a program that names itself only there: VLLM::Worker_TP)


PS = "ps -e -o pid=,ppid=,stat=,comm=,args="
PS_LIMIT_S = 45   # ps takes milliseconds (10 ms for 81 processes here); this bounds a host under load


def ps_unread(out: Output) -> str:
    """Why PS's section did not finish ('' when it did): a list cut short says nothing of what it left out."""
    if out.ok:
        return ""
    return "ps did not finish: " + (f"timed out after {PS_LIMIT_S} s" if out.timed_out else
                                    out.text.strip()[-200:] or f"exit {out.rc}")


def parse_ps(text: str) -> dict[int, Proc]:
    """`ps -e -o pid=,ppid=,stat=,comm=,args=` (PS) -> {pid: Proc}."""
    out = {}
    for line in text.splitlines():
        parts = line.split(None, 4)
        if len(parts) >= 3 and parts[0].isdigit() and parts[1].isdigit():
            out[int(parts[0])] = Proc(int(parts[0]), int(parts[1]), parts[2], parts[4] if len(parts) > 4 else "",
                                      parts[3] if len(parts) > 3 else "")
    return out


def tree(procs: dict[int, Proc], root: int) -> list[Proc]:
    """The process `root` and every process under it (a container's processes, from its main pid)."""
    if root not in procs:
        return []
    kids: dict[int, list[int]] = {}
    for p in procs.values():
        kids.setdefault(p.ppid, []).append(p.pid)
    out, todo = [], [root]
    while todo:
        pid = todo.pop(0)
        out.append(procs[pid])
        todo += sorted(kids.get(pid, []))
    return out


def role_of(p: Proc, main: int) -> str:
    """What a process of an engine container is: its vLLM title (`VLLM::Worker_TP1`), the API server (`vllm
    serve`, whose engine core and workers are its children), the container's main process, or its first word."""
    for word in (p.title.split() or ["?"])[0], p.comm:   # setproctitle writes the args (vLLM); else the name
        if word.startswith("VLLM::") or word.startswith("EngineCore") or word in ("DPCoordinator",):
            return word
    word = p.title.split()[0] if p.title.split() else "?"
    if "vllm serve" in p.title and "--headless" in p.title.split():
        return "vllm serve --headless"
    if "vllm serve" in p.title or "openai.api_server" in p.title:
        return "API server"
    return "main process" if p.pid == main else word.rsplit("/", 1)[-1]


def stopped(procs: list[Proc], main: int) -> list[str]:
    """Each stopped process of a container, named: `VLLM::Worker_TP1 (pid 4242, state T)`."""
    return [f"{role_of(p, main)} (pid {p.pid}, state {p.state})" for p in procs if p.state[:1] in ("T", "t")]


# ---------------------------------------------------------------- the engine's log

def hang_lines(log: str, now: float, recent_s: float) -> list[str]:
    """The engine's hang lines in its log (`docker logs --timestamps`), only those written after the API
    was ready the last time (steady state) and within recent_s of now: [`<kind>: <line>`]."""
    ready_at = None
    found: list[tuple[float, str, str]] = []
    for line in log.splitlines():
        m = _STAMP.match(line)
        when = _epoch(m.group(1)) if m else None
        text = line[m.end():] if m else line
        if READY_LINE in text:
            ready_at, found = when or 0.0, []   # a restart's lines after its own ready line only
            continue
        for kind, rx in HANG_LINES:
            if rx.search(text):
                found.append((when or 0.0, kind, text.strip()))
    if ready_at is None:
        return []
    return [f"{kind}: {text[-220:]}" for when, kind, text in found if when and now - when <= recent_s]


def _epoch(stamp: str) -> float:
    return float(time.mktime(time.strptime(stamp, "%Y-%m-%dT%H:%M:%S")) - time.timezone)


# ---------------------------------------------------------------- the counters

LOAD = ("vllm:num_requests_running", "vllm:num_requests_waiting")
_SAMPLE = re.compile(r"^([A-Za-z_:][\w:]*)(?:\{([^}]*)\})?\s+([-+0-9.eEinfNa]+)")
_ENGINE = re.compile(r'(?:^|,)\s*engine="([^"]*)"')


def by_engine(text: str, names: tuple[str, ...]) -> dict[str, dict[str, float]]:
    """Prometheus text -> {engine label: {metric: value}} for the named metrics, summed over their other labels
    (a series without an `engine` label counts as engine "0"). One engine per DP rank: never summed across."""
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m or m.group(1) not in names:
            continue
        e = _ENGINE.search(m.group(2) or "")
        label = e.group(1) if e else "0"
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        row = out.setdefault(label, {})
        row[m.group(1)] = row.get(m.group(1), 0.0) + value
    return out


@dataclass(frozen=True)
class Sample:
    """One read of an engine's /metrics (None: it did not answer), and when."""
    engines: dict[str, dict[str, float]] | None
    at: float


def judge_engines(before: Sample, after: Sample, progress: tuple[str, ...], window_s: float,
                  answered: dict[str, bool]) -> dict[str, tuple[str, str]]:
    """{engine label: (state, evidence)} from two reads of the engine's /metrics around its probes (answered: DP
    rank label -> whether its probe got an answer). hung: every progress counter of that engine the same at both
    reads, not all 0, the reads at least window_s apart, and its probe unanswered or requests running or waiting
    on it at both reads. vLLM publishes an engine's running and waiting counts when a step completes, so a step
    that never completes leaves them as they were: the probe held in flight is the load that is certain. Moved is
    busy and 0 is cold (not hung, `ok`); counters that could not be read twice, or a probe that ended without a
    token before the window (an error, not a wait), are `unknown`: no verdict either way."""
    if before.engines is None or after.engines is None:
        return {label: (UNKNOWN, "its /metrics could not be read twice") for label in answered or {"0": False}}
    span = after.at - before.at
    at = " and ".join(time.strftime("%H:%M:%S", time.localtime(t)) for t in (before.at, after.at))
    out = {}
    for label in sorted(set(before.engines) | set(after.engines) | set(answered)):
        b, a = before.engines.get(label, {}), after.engines.get(label, {})
        if answered.get(label):
            out[label] = (OK, "answered its probe")
            continue
        moved = {k.split(":")[-1]: a[k] - b[k] for k in progress if k in a and k in b and a[k] != b[k]}
        loaded = min(sum(b.get(k, 0.0) for k in LOAD), sum(a.get(k, 0.0) for k in LOAD)) > 0
        held = label in answered   # its own probe is in flight, unanswered
        seen = ", ".join(f"{k.split(':')[-1]} {a.get(k, 0):,.0f}" for k in progress)
        running = f"{a.get(LOAD[0], 0):.0f} running and {a.get(LOAD[1], 0):.0f} waiting"
        if not any(k in a and k in b for k in progress):
            out[label] = (UNKNOWN, "no token counters in its /metrics")
        elif moved:
            out[label] = (OK, "its token counters moved (" + ", ".join(f"{k} +{v:,.0f}" for k, v in moved.items())
                          + f" in {span:.0f} s)")
        elif not held and not loaded:
            out[label] = (OK, f"idle: no probe and no request on it ({seen})")
        elif span < window_s and held:
            out[label] = (UNKNOWN, f"its probe ended after {span:.0f} s without a token, under the {window_s:.0f} s "
                                   f"window: not judged")
        elif span < window_s:
            out[label] = (OK, f"{running}; read {span:.0f} s apart, under the {window_s:.0f} s window")
        elif not any(a.get(k, 0) for k in progress):
            out[label] = (OK, f"cold: no token made since it started ({seen} at {at}): its first step may still run")
        else:
            out[label] = (HUNG, (f"its probe got no token in {span:.0f} s and its token counters did not move ({seen} "
                                 f"at {at}; {running} as it last reported)") if held else
                          (f"{running} at both reads and its token counters did not move in {span:.0f} s ({seen} at "
                           f"{at})"))
    return out


def fold(healths: list, verdicts: list[Verdict]) -> list:
    """Each service's health (railyard.checks.probes.RankHealth) with its bad verdicts added as reasons
    (`hung: ...`, a dead API's `dead: ...`), so every recovery decides on the one verdict."""
    from dataclasses import replace
    out = []
    for h in healths:
        extra = [f"{v.state}: {v.target}: {'; '.join(v.evidence)}" for v in verdicts
                 if v.service == h.service and v.bad and not (v.source == "container" and not h.ok)]
        if any(r.startswith("hung:") for r in h.reasons):   # its stopped GPU process already says it
            extra = [x for x in extra if not x.startswith("hung:")]
        out.append(replace(h, ok=h.ok and not extra, reasons=h.reasons + extra) if extra else h)
    return out
