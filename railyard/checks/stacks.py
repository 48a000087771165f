"""What a hung rank shows, read from its tools' text: py-spy dumps (with `--native` or not), gdb backtraces,
NCCL RAS's status report and the PyTorch flight recorder's dump; then the ranks grouped by the frame they wait
in, the outliers named. Pure: text or bytes in, typed values out (`inv hang-dump` runs the tools).

    Thread 530 (active): "MainThread"          py-spy: innermost frame first
        synchronize (torch/cuda/__init__.py:1162)
    Thread 1 (Thread 0x7f.. (LWP 530) "python3"):   gdb: `#0  0x.. in func (...) at file:line`
    #0-0 (096f7190a46ab9aa) MISMATCH              NCCL RAS: a communicator whose ranks disagree
"""

from __future__ import annotations

import io
import pickle
import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Sequence

# ---------------------------------------------------------------- stacks


@dataclass(frozen=True)
class Frame:
    func: str
    where: str          # file.py:line for Python, the library for a native frame (libcuda.so.580.159.04)
    python: bool

    def __str__(self) -> str:
        return f"{self.func} ({self.where})" if self.where else self.func


@dataclass
class Thread:
    tid: str
    name: str
    state: str          # py-spy: idle | active; gdb: ""
    frames: list[Frame] = field(default_factory=list)   # innermost first


@dataclass
class Stack:
    pid: int | None
    command: str = ""
    python: str = ""
    threads: list[Thread] = field(default_factory=list)

    def main(self) -> Thread | None:
        """The main thread: py-spy names it MainThread; gdb's first thread is the process's own."""
        return next((t for t in self.threads if t.name == "MainThread"), self.threads[0] if self.threads else None)

    def as_dict(self) -> dict:
        return asdict(self)


_SPY_PROC = re.compile(r"^Process (\d+): (.*)$")
_SPY_PY = re.compile(r"^Python (v\S+)")
_SPY_THREAD = re.compile(r'^Thread (\S+) \(([^)]*)\)(?:: "(.*)")?\s*$')
_SPY_FRAME = re.compile(r"^\s+(.+?) \(([^()]*)\)\s*$")


def _frame(func: str, where: str) -> Frame:
    """py-spy gives a Python frame `file:line` (a script without .py too: `vllm:335`), a native one its library."""
    return Frame(func, where, bool(re.search(r":\d+$", where)))


def parse_py_spy(text: str) -> Stack:
    """`py-spy dump --pid P [--native]`. A dump that failed (py-spy prints the process and Python lines, then
    `Error: ...` on stderr) has no thread: callers treat an empty `threads` as no stack."""
    st = Stack(None)
    cur: Thread | None = None
    for line in text.splitlines():
        if m := _SPY_PROC.match(line):
            st.pid, st.command = int(m.group(1)), m.group(2).strip()
        elif m := _SPY_PY.match(line):
            st.python = m.group(1)
        elif m := _SPY_THREAD.match(line):
            cur = Thread(m.group(1), m.group(3) or "", m.group(2))
            st.threads.append(cur)
        elif cur is not None and (m := _SPY_FRAME.match(line)):
            cur.frames.append(_frame(m.group(1), m.group(2)))
        elif cur is not None and line.strip() and not line.startswith(" "):
            cur = None  # py-spy's `--locals` / error text after the frames
    return st


_GDB_THREAD = re.compile(r'^Thread (\d+) \((?:Thread 0x[0-9a-f]+ \(LWP (\d+)\)|[^()]*)(?: "([^"]*)")?\):\s*$')
_GDB_FRAME = re.compile(r"^#\d+\s+(?:0x[0-9a-f]+ in )?(\S+?)\s*\(.*?\)(?: (?:at|from) (\S+))?\s*$")


def parse_gdb(text: str, pid: int | None = None) -> Stack:
    """`gdb -p P --batch -ex 'thread apply all bt'`: `Thread N (Thread 0x.. (LWP tid) "comm"):` and `#k` frames."""
    st = Stack(pid)
    cur: Thread | None = None
    for line in text.splitlines():
        if m := _GDB_THREAD.match(line):
            cur = Thread(m.group(2) or m.group(1), m.group(3) or "", "")
            st.threads.append(cur)
        elif cur is not None and (m := _GDB_FRAME.match(line)):
            where = m.group(2) or ""
            cur.frames.append(Frame(m.group(1), where.rsplit("/", 1)[-1], False))
    # gdb lists the threads newest first; the process's own (tid == pid) is the main one
    if pid is not None:
        st.threads.sort(key=lambda t: t.tid != str(pid))
    return st


# native frames that say only that a thread sleeps, not in what: the meaningful one is the caller
_PLUMBING = re.compile(r"^(0x[0-9a-f]+|\?\?|_?_?(libc_)?(clock_)?nanosleep|__futex\w*|futex_\w+|syscall|__GI_\w+|"
                       r"___?pthread_cond_\w+|pthread_cond_\w+|__pthread_clockjoin_ex|epoll_wait|__poll|poll|select|"
                       r"__select|__libc_\w+|__internal_syscall_cancel|__syscall_cancel\w*|do_futex_wait\w*|"
                       r"__new_sem_wait_slow\w*|sem_\w*wait\w*|start_thread|clone3?|__clone3?|_start|_?Py\w+|main)$")


def waiting_frame(st: Stack) -> Frame | None:
    """Where the main thread waits: its innermost Python frame, else its innermost native frame that names a
    function other than a sleep or lock primitive (cuCtxSynchronize_v2, not __futex_abstimed_wait_common)."""
    t = st.main()
    if t is None or not t.frames:
        return None
    py = next((f for f in t.frames if f.python), None)
    if py is not None:
        return py
    return next((f for f in t.frames if not _PLUMBING.match(f.func)), t.frames[0])


# frames of a rank that waits on its peers (a collective, vLLM's shared-memory broadcast, a device sync)
_COLLECTIVE = re.compile(r"all_?reduce|all_?gather|reduce_?scatter|broadcast|barrier|all_?to_?all|dequeue|acquire_read|"
                         r"synchroni[sz]e|nccl|recv|send|wait_for|collective", re.I)


def in_collective(frame: str) -> bool:
    return bool(_COLLECTIVE.search(frame))


@dataclass
class Group:
    frame: str
    members: list[str]        # who, as the summary names them (B/vllm-worker pid 123 VLLM::Worker_TP1)


@dataclass
class Grouping:
    groups: list[Group]       # most members first
    outliers: list[Group]     # the odd ones out (empty: the ranks agree, or no side is the odd one)
    missing: list[str]        # ranks whose stack did not come back

    def line(self) -> str:
        """One summary line: the outliers first, each named, then the others counted."""
        def named(g: Group) -> str:
            return f"{', '.join(g.members)} in {g.frame}"

        def counted(g: Group) -> str:
            return f"{len(g.members)} rank{'s' if len(g.members) != 1 else ''} in {g.frame}"

        if not self.groups:
            parts = ["no stack came back"]
        elif len(self.groups) == 1:
            parts = [f"all {counted(self.groups[0])}"]
        else:
            odd = [named(g) for g in self.outliers]
            rest = [counted(g) for g in self.groups if g not in self.outliers]
            parts = odd + rest if odd else ["the ranks differ, no odd one out: " + "; ".join(counted(g) for g in self.groups)]
        if self.missing:
            parts.append(f"no stack from {', '.join(self.missing)}")
        return "; ".join(parts)


def group_ranks(ranks: list[tuple[str, Frame | None]], others: Sequence[Frame | None] = ()) -> Grouping:
    """Ranks by the frame they wait in; the outliers: the groups of fewest ranks when the others agree (one
    larger group). Where the largest sizes tie (two ranks, one each), `others` (the deployment's other engine
    processes: its engine cores) break it, each on the side whose frame it shares (the stand-in's idle worker
    and its engine core wait in the same loop, the parked rank alone elsewhere); still tied, the groups outside
    a collective while the rest wait in one are the odd ones (rank 1 sleeps while rank 0 waits in its
    all-reduce)."""
    by: dict[str, list[str]] = {}
    missing = []
    for who, f in ranks:
        if f is None:
            missing.append(who)
        else:
            by.setdefault(str(f), []).append(who)
    groups = sorted((Group(k, v) for k, v in by.items()), key=lambda g: -len(g.members))
    outliers: list[Group] = []
    if len(groups) > 1:
        votes = Counter(str(f) for f in others if f is not None)
        weight = {g.frame: (len(g.members), votes[g.frame]) for g in groups}  # the ranks first, votes break ties
        biggest = max(weight.values())
        top = [g for g in groups if weight[g.frame] == biggest]
        if len(top) == 1:
            outliers = [g for g in groups if g is not top[0]]
        else:
            waiting = [g for g in groups if in_collective(g.frame)]
            if waiting and len(waiting) < len(groups):
                outliers = [g for g in groups if g not in waiting]
    return Grouping(groups, outliers, missing)


# ---------------------------------------------------------------- NCCL RAS


@dataclass
class RasRank:
    rank: int
    operation: int
    gpu: str
    pid: int
    node: str


@dataclass
class RasIssue:
    communicator: str   # #0-0 (096f7190a46ab9aa)
    kind: str           # MISMATCH | INCOMPLETE | ...
    message: str
    ranks: list[RasRank] = field(default_factory=list)

    def line(self) -> str:
        """`communicator #0-0 MISMATCH: ...: rank 1 (pid 531 on 192.0.2.2) behind at operation 1; rank 0 at 2`."""
        text = f"communicator {self.communicator.split(' ')[0]} {self.kind}: {self.message}"
        if self.ranks:
            low = min(r.operation for r in self.ranks)
            behind = [r for r in self.ranks if r.operation == low]
            ahead = sorted({r.operation for r in self.ranks if r.operation != low})
            text += "; " + ", ".join(f"rank {r.rank} (pid {r.pid} on {r.node})" for r in behind)
            text += f" at operation {low}" + (f", the others at {', '.join(map(str, ahead))}" if ahead else "")
        return text


@dataclass
class RasStatus:
    version: str = ""
    nodes: int | None = None
    processes: int | None = None
    communicators: list[dict] = field(default_factory=list)   # {group, status, errors}
    issues: list[RasIssue] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


_RAS_ISSUE = re.compile(r"^(#\d+-\d+(?: \([0-9a-f]+\))?) ([A-Z]+)\s*$")
_RAS_RANK = re.compile(r"^\s+Rank (\d+) has launched up to operation (\d+) -- GPU (\S+) managed by process (\d+) "
                       r"on node (\S+)")


def parse_ras_status(text: str) -> RasStatus:
    """NCCL RAS's `STATUS` report (text protocol, NCCL 2.24+): version, job summary, the communicators table
    (group, status RUNNING|INIT|FINALIZE, errors OK|MISMATCH|INCOMPLETE), each communicator's issue and the
    operation each of its ranks launched up to."""
    st = RasStatus()
    lines = text.splitlines()
    section = ""
    cur: RasIssue | None = None
    for i, line in enumerate(lines):
        if m := re.match(r"^NCCL version (\S+)", line):
            st.version = m.group(1)
        elif re.match(r"^[A-Z]", line) and i + 1 < len(lines) and lines[i + 1].startswith("==="):
            section = re.split(r"\.\.\.|\(", line)[0].strip()   # `Communicators... (0.000s)`
        elif section == "Job summary" and re.match(r"^\s*\d+(\s+\d+){4}\s*$", line):
            nums = [int(x) for x in line.split()]
            st.nodes, st.processes = nums[0], nums[3]
        elif section == "Communicators" and re.match(r"^\s*\d+(\s+\d+){5}\s+[A-Z]+\s+[A-Z]+\s*$", line):
            p = line.split()
            st.communicators.append({"group": int(p[0]), "ranks": int(p[5]), "status": p[6], "errors": p[7]})
        elif m := _RAS_ISSUE.match(line):
            cur = RasIssue(m.group(1), m.group(2), "")
            st.issues.append(cur)
        elif cur is not None and (m := _RAS_RANK.match(line)):
            cur.ranks.append(RasRank(int(m.group(1)), int(m.group(2)), m.group(3), int(m.group(4)), m.group(5)))
        elif cur is not None and line.startswith("  ") and not cur.message:
            cur.message = line.strip()
    return st


# ---------------------------------------------------------------- the PyTorch flight recorder


class _Restricted(pickle.Unpickler):
    """Builds only what the pickle's own opcodes make (dict, list, tuple, str, int, float, bool, None, bytes):
    any class or function a remote file names is refused, so reading it runs no code."""

    def find_class(self, module: str, name: str):  # noqa: D401
        raise pickle.UnpicklingError(f"refused: the pickle names {module}.{name}")


def load_flight_recorder(data: bytes) -> dict:
    """A flight recorder dump (the pickle PyTorch writes to TORCH_FR_DUMP_TEMP_FILE<rank>), read with no class
    allowed. Raises ValueError on anything else."""
    try:
        doc = _Restricted(io.BytesIO(data)).load()
    except Exception as e:  # a truncated or hostile file: say what it is, never run it
        raise ValueError(f"not a flight recorder dump: {e}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("entries", []), list):
        raise ValueError("not a flight recorder dump: no `entries` list")
    return doc


@dataclass
class FlightRecord:
    version: str
    groups: dict[str, dict]          # pg id -> {desc, ranks, last_enqueued, last_started, last_completed}
    pending: list[dict]              # entries not completed: {pg, seq, op, state, sizes}
    last_completed: list[dict]       # the last completed entry of each group

    def line(self) -> str:
        if not self.pending:
            last = ", ".join(f"{e['op']} seq {e['seq']}" for e in self.last_completed)
            return "flight recorder: every recorded collective completed" + (f" (last: {last})" if last else "")
        return "flight recorder: " + "; ".join(f"{e['op']} seq {e['seq']} {e['state']} (group {e['pg']})"
                                               for e in self.pending)

    def as_dict(self) -> dict:
        return asdict(self)


def flight_record(doc: dict) -> FlightRecord:
    """The groups' counters and the collectives that never completed (state scheduled or started)."""
    groups = {}
    for pg, cfg in (doc.get("pg_config") or {}).items():
        status = (doc.get("pg_status") or {}).get(pg) or {}
        groups[str(pg)] = {"desc": cfg.get("desc", ""), "ranks": cfg.get("ranks", ""),
                           "last_enqueued": status.get("last_enqueued_collective"),
                           "last_started": status.get("last_started_collective"),
                           "last_completed": status.get("last_completed_collective")}
    pending, done = [], {}
    for e in doc.get("entries") or []:
        if not isinstance(e, dict):
            continue
        pg = e.get("process_group")
        row = {"pg": str(pg[0]) if isinstance(pg, (tuple, list)) and pg else str(e.get("pg_id", "")),
               "seq": e.get("collective_seq_id"), "op": e.get("profiling_name", "?"), "state": e.get("state", "?"),
               "sizes": e.get("input_sizes")}
        if row["state"] == "completed":
            done[row["pg"]] = row
        else:
            pending.append(row)
    return FlightRecord(str(doc.get("version", "")), groups, pending, list(done.values()))
