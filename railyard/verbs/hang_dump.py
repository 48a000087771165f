"""`inv hang-dump`: what every rank of a deployment is doing, read from the hosts, and which rank is the odd one.

On every host of the plan in parallel, one session each, three round trips: (1) the host's processes
(`ps`), each service container's main pid and environment (`docker inspect`), the tools there; (2) py-spy
copied to `<vllm_state_dir>/tools/` when the host has none (the control machine's own binary, from the
py-spy wheel, where the architectures match); (3) at once: each engine process's stack, NCCL RAS's status
where a rank's NCCL listens, the flight recorder's dumps where it is on; then each engine log's last lines.

A process is found from the host side: the container's main pid, then its descendants, by vLLM's titles
(`VLLM::EngineCore`, `VLLM::Worker_TP<n>`, `EngineCore_DP<n>`, `VLLM::Worker_DP<d>_TP<n>`; the container's
`vllm serve` process is the API server). Its stack: `py-spy dump --native`, else plain, else
`--nonblocking` (py-spy cannot pause a process that is already stopped, state T: it fails with "Failed to
suspend process"; a stopped process reads consistently without a pause), else gdb's `thread apply all bt`.
Run on the host as root, no `SYS_PTRACE` is needed in the container. A stack that did not come back is
named with why, never guessed.

The shared hung verdict (railyard.verbs.hung.survey) says whether anything is hung: nothing hung is exit
0 (the stacks are still shown); hung or dead is the summary and exit 1. The document is kept on the
deployment's first host, `<vllm_state_dir>/<deployment>/hang-dumps/<UTC stamp>.json` (the last KEPT), and
`inv status` points to the newest.
"""

from __future__ import annotations

import base64
import hashlib
import json
import platform
import re
import shutil
import sysconfig
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..checks import FAIL, PASS, WARN, CheckResult
from ..checks.hang import PS, PS_LIMIT_S, Verdict, parse_ps, ps_unread, tree
from ..checks.hang import Proc as PsRow
from ..checks.stacks import (Frame, Stack, flight_record, group_ranks, load_flight_recorder, parse_gdb, parse_py_spy,
                             parse_ras_status, waiting_frame)
from ..errors import RailyardError
from ..facts.docker import log_tail
from ..facts.probe import Section, joined_script, new_token, split_output
from ..inventory import Inventory
from ..plan.spec import LaunchPlan, Service
from ..report import Report
from ..transport import RemotePath, Session, Sh, cmd, q, write_remote
from ..transport.runner import Runner

DIR_NAME = "hang-dumps"
KEPT = 10
LOG_LINES = 50
ATTEMPT_S = 20            # each py-spy or gdb attempt on one process
RAS_PORT = 28028
FR_PREFIX_DEFAULT = "/tmp/nccl_trace_rank_"   # PyTorch's TORCH_FR_DUMP_TEMP_FILE default
FR_MAX_BYTES = 8 << 20
_STAMP = re.compile(r"^\d{8}T\d{6}Z\.json$")


def survey(inv: Inventory, runner: Runner, plan: LaunchPlan) -> list[Verdict]:
    """The shared hung verdict (railyard.verbs.hung, as health and recover read it)."""
    from .hung import survey as shared
    return list(shared(runner, plan).verdicts)


# ---------------------------------------------------------------- the processes (pure)


@dataclass
class Proc:
    pid: int
    ppid: int
    state: str
    title: str       # vLLM's process title (VLLM::Worker_TP1), or `vllm serve` for the API server
    kind: str        # api | serve (a headless rank's own process) | engine | worker


_TITLE = re.compile(r"^(VLLM::\S+|EngineCore(?:_DP\d+|_\d+)?)\b")


def kind_of(args: str, comm: str) -> tuple[str, str] | None:
    """(kind, title) of one process, or None when it is none of vLLM's. The title is its args where
    setproctitle wrote it (vLLM), else the kernel's comm."""
    for name in (args.strip(), comm):
        m = _TITLE.match(name)
        if m:
            title = m.group(1)
            if "Worker" in title:
                return "worker", title
            if "APIServer" in title:
                return "api", title
            return "engine", title
    shell = re.match(r"^(\S*/)?(ba|da|z)?sh\s", args)  # `bash -c '...; vllm serve ...'` is not the server
    if not shell and re.search(r"(^|[/\s])vllm serve\b|vllm\.entrypoints\.(openai\.api_server|cli)", args):
        return ("serve" if "--headless" in args else "api"), "vllm serve"
    return None


def container_processes(main: int, table: dict[int, PsRow]) -> list[Proc]:
    """vLLM's processes among the container's main process and its descendants, in pid order; a `vllm serve`
    process below another one (vLLM's own children re-exec'd) is not a second API server."""
    out, has_serve = [], False
    for row in sorted(tree(table, main), key=lambda r: r.pid):
        k = kind_of(row.title, row.comm)
        if k is None or (k[0] in ("api", "serve") and k[1] == "vllm serve" and has_serve):
            continue
        has_serve = has_serve or k[1] == "vllm serve"
        out.append(Proc(row.pid, row.ppid, row.state, k[1], k[0]))
    return out


def env_of(text: str) -> dict[str, str]:
    """`docker inspect --format '{{json .Config.Env}}'`'s list, only the keys hang-dump reads (never a secret)."""
    try:
        rows = json.loads(text)
    except ValueError:
        return {}
    keep = ("NCCL_RAS_", "TORCH_FR_", "TORCH_NCCL_")
    return {k: v for k, _, v in (str(e).partition("=") for e in rows or []) if k.startswith(keep)}


def ras_address(env: dict[str, str]) -> tuple[str, int] | None:
    """Where the rank's NCCL RAS listens (NCCL_RAS_ADDR host:port, localhost:28028 by default); None: off."""
    if env.get("NCCL_RAS_ENABLE", "1").strip() == "0":
        return None
    addr = env.get("NCCL_RAS_ADDR", "").strip()
    if not addr:
        return "127.0.0.1", RAS_PORT
    host, _, port = addr.rpartition(":")
    if not port.isdigit():
        return addr, RAS_PORT
    return (host.strip("[]") or "127.0.0.1"), int(port)


def flight_recorder_prefix(env: dict[str, str]) -> str | None:
    """The dump files' prefix where the recorder is on (a buffer size above 0), else None."""
    size = env.get("TORCH_FR_BUFFER_SIZE") or env.get("TORCH_NCCL_TRACE_BUFFER_SIZE") or "0"
    if not size.strip().isdigit() or int(size) <= 0:
        return None
    return env.get("TORCH_FR_DUMP_TEMP_FILE") or env.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE") or FR_PREFIX_DEFAULT


# ---------------------------------------------------------------- the host's commands


def dump_command(pid: int, spy: str | None, gdb: bool) -> Sh:
    """Each attempt in turn until one prints a stack, each under ATTEMPT_S, marked `@@try NAME` and `@@rc N`;
    `sudo -n` where the SSH user is not root (ptrace on another user's process)."""
    attempts = []
    if spy:
        for name, flags in (("py-spy --native", ["--native"]), ("py-spy", []), ("py-spy --nonblocking", ["--nonblocking"])):
            attempts.append((name, cmd(spy, "dump", *flags, "--pid", pid)))
    if gdb:
        attempts.append(("gdb", cmd("gdb", "-p", pid, "--batch", "-ex", "thread apply all bt")))
    lines = ['S=""; [ "$(id -u)" = 0 ] || S="sudo -n"']
    for name, line in attempts:
        lines.append(f"echo {q('@@try ' + name)}; timeout -k 2 {ATTEMPT_S} $S {line} 2>&1; r=$?; echo \"@@rc $r\"; "
                     f"[ $r = 0 ] && exit 0")
    lines.append("exit 1")
    return Sh("; ".join(lines))


RAS_CLIENT = r"""
import socket, sys, time
host, port = sys.argv[1], int(sys.argv[2])
try:
    s = socket.create_connection((host, port), timeout=5)
except ConnectionRefusedError:
    print("@@ras refused"); sys.exit(0)
except OSError as e:
    print("@@ras error %s" % e); sys.exit(0)
s.sendall(b"CLIENT PROTOCOL 2\nSTATUS\n")
s.settimeout(10)
out, end = b"", time.time() + 20
while time.time() < end:
    try:
        b = s.recv(65536)
    except socket.timeout:
        break
    if not b:
        break
    out += b
    s.settimeout(2)
sys.stdout.write(out.decode("utf-8", "replace"))
"""


def ras_command(container: str, addr: tuple[str, int]) -> Sh:
    """NCCL RAS's text protocol from inside the container's network (`CLIENT PROTOCOL 2`, then `STATUS`)."""
    return cmd("docker", "exec", container, "python3", "-c", RAS_CLIENT, addr[0], addr[1])


def flight_recorder_command(container: str, prefix: str) -> Sh:
    script = (f"for f in {q(prefix)}*; do [ -f \"$f\" ] || continue; printf '@@file %s\\n' \"$f\"; "
              f"head -c {FR_MAX_BYTES} \"$f\" | base64 | tr -d '\\n'; echo; done")
    return cmd("docker", "exec", container, "sh", "-c", script)


def tools_dir(state_dir: str) -> str:
    return f"{state_dir.rstrip('/')}/tools"


def local_py_spy() -> Path | None:
    """railyard's own py-spy (the wheel's static binary in this environment's scripts), else PATH's."""
    here = Path(sysconfig.get_path("scripts")) / "py-spy"
    if here.is_file():
        return here
    found = shutil.which("py-spy")
    return Path(found) if found else None


def machine_arch() -> str:
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(platform.machine().lower(), platform.machine().lower())


# ---------------------------------------------------------------- what came back (pure)


@dataclass
class ProcDump:
    pid: int
    title: str
    kind: str
    state: str
    tool: str = ""                     # what read the stack ("" when nothing did)
    frame: str = ""                    # where its main thread waits
    stack: dict | None = None
    failures: list[str] = field(default_factory=list)   # each attempt that failed, with py-spy's or gdb's words


def _error_words(text: str) -> str:
    """py-spy's error and its last cause (`Failed to suspend process: unexpected waitpid result ...`), or gdb's
    last line, or the text's last line."""
    lines = [x.strip() for x in text.splitlines() if x.strip()]
    err = next((x[len("Error:"):].strip() for x in lines if x.startswith("Error:")), "")
    if err:
        cause = ""
        for x in lines[lines.index(next(x for x in lines if x.startswith("Error:"))) + 1:]:
            if x.startswith("Stack backtrace"):
                break
            m = re.match(r"^\d+: (.*)", x)
            if m:
                cause = m.group(1)
        return f"{err}: {cause}" if cause and cause != err else err
    return lines[-1][:200] if lines else "no output"


def read_dump(pid: int, text: str) -> tuple[str, Stack | None, list[str]]:
    """The `@@try` blocks of one dump_command: (the tool that read a stack, its stack, the failures before)."""
    failures: list[str] = []
    for block in text.split("@@try ")[1:]:
        name, _, body = block.partition("\n")
        m = re.search(r"^@@rc (\d+)\s*$", body, re.M)
        rc = int(m.group(1)) if m else None
        body = body[:m.start()] if m else body
        st = parse_gdb(body, pid) if name == "gdb" else parse_py_spy(body)
        if rc == 0 and st.threads:
            return name, st, failures
        why = "timed out" if rc in (124, 137) else _error_words(body)
        failures.append(f"{name}: {why}")
    return "", None, failures


@dataclass
class ServiceDump:
    service: str
    container: str
    running: bool
    main_pid: int
    processes: list[ProcDump] = field(default_factory=list)
    log_tail: str = ""
    ras: dict | None = None
    flight_recorder: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def read_ras(text: str, addr: tuple[str, int]) -> dict[str, Any]:
    where = f"{addr[0]}:{addr[1]}"
    if "@@ras refused" in text:
        return {"address": where, "listening": False, "line": f"NCCL RAS: nothing listens on {where} (no NCCL "
                "communicator in this container's network, or NCCL before 2.24)"}
    m = re.search(r"@@ras error (.*)", text)
    if m:
        return {"address": where, "listening": False, "line": f"NCCL RAS: {where}: {m.group(1)}"}
    if "NCCL version" not in text:
        return {"address": where, "listening": None, "line": f"NCCL RAS: no report from {where}: "
                f"{(text.strip().splitlines() or ['no output'])[-1][:200]}", "text": text}
    st = parse_ras_status(text)
    bad = [c for c in st.communicators if c["errors"] != "OK"]
    line = (f"NCCL RAS {st.version}: {st.nodes} node(s), {st.processes} process(es), {len(st.communicators)} "
            f"communicator group(s)" + (": " + "; ".join(i.line() for i in st.issues) if st.issues else
                                       (f", errors {', '.join(c['errors'] for c in bad)}" if bad else ", no error")))
    return {"address": where, "listening": True, "line": line, "status": st.as_dict(), "text": text}


def read_flight_recorder(text: str) -> list[dict]:
    out: list[dict[str, Any]] = []
    for part in text.split("@@file ")[1:]:
        path, _, body = part.partition("\n")
        try:
            rec = flight_record(load_flight_recorder(base64.b64decode(body.strip(), validate=False)))
        except (ValueError, TypeError) as e:
            out.append({"file": path.strip(), "error": str(e)})
            continue
        out.append({"file": path.strip(), "line": rec.line(), "record": rec.as_dict()})
    return out


# ---------------------------------------------------------------- one host


@dataclass
class HostDump:
    host: str
    services: list[ServiceDump] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    error: str = ""


def _provision(s: Session, state_dir: str, arch: str, on_path: str, ours_sum: str) -> tuple[str | None, str]:
    """The py-spy to run on this host and a note: PATH's, else railyard's copy under the state dir (copied
    when missing or another build)."""
    if on_path:
        return on_path, ""
    local = local_py_spy()
    if local is None:
        return None, "py-spy: none on the host and none in railyard's environment (pip install py-spy): gdb only"
    mine = machine_arch()
    if arch and arch != mine:
        return None, (f"py-spy: none on the host, and railyard's is for {mine}, the host is {arch}: gdb only "
                      f"(install py-spy for {arch} on the host)")
    dest = tools_dir(state_dir) + "/py-spy"
    data = local.read_bytes()
    if ours_sum != hashlib.sha256(data).hexdigest():
        p = q(RemotePath(dest))
        r = s.run(f"set -e; f={p}; mkdir -p \"$(dirname \"$f\")\"; t=\"$f.railyard.$$\"; cat > \"$t\"; chmod 755 \"$t\"; "
                  f"mv -f \"$t\" \"$f\"", stdin=data, timeout=120)
        if not r.ok:
            return None, f"py-spy: could not copy it to {dest}: {(r.stderr or str(r.error)).strip()[:200]}: gdb only"
        note = f"py-spy: copied railyard's to {dest}"
    else:
        note = f"py-spy: railyard's copy in {dest}"
    home = s.run("printf %s \"$HOME\"", timeout=10).stdout if dest.startswith("~/") else ""
    return (home + dest[1:] if home else dest), note


def dump_host(s: Session, services: list[Service], lines: int) -> HostDump:
    """Every engine process's stack on this host, its services' RAS status, flight recorder dumps and log tails."""
    hd = HostDump(s.host.name)
    state_dir = str(s.host.vars.get("vllm_state_dir", "~/.cache/railyard/serve"))
    probe = [Section("ps", Sh(PS), timeout=PS_LIMIT_S), Section("arch", Sh("uname -m")),
             Section("pyspy", Sh("command -v py-spy || true")), Section("gdb", Sh("command -v gdb || true")),
             Section("ours", Sh(f"sha256sum {q(RemotePath(tools_dir(state_dir) + '/py-spy'))} 2>/dev/null || true"))]
    for i, svc in enumerate(services):
        probe.append(Section(f"c{i}", cmd("docker", "inspect", "--format", "{{.State.Pid}} {{.State.Running}} "
                                          "{{json .Config.Env}}", svc.spec.name), "docker", 30))
    token = new_token()
    r = s.run(joined_script(probe, token), timeout=90)
    if r.error:
        raise RailyardError(f"{s.host.name}: {r.error.kind}: {r.error.message}")
    got = split_output(r.stdout, probe, token)
    if unread := ps_unread(got["ps"]):   # a list cut short would leave ranks out without a word
        raise RailyardError(f"{s.host.name}: {unread}")
    table = parse_ps(got["ps"].text)
    spy, note = _provision(s, state_dir, got["arch"].text.strip(), got["pyspy"].text.strip(),
                           got["ours"].text.split()[0] if got["ours"].text.split() else "")
    if note:
        hd.notes.append(note)
    has_gdb = bool(got["gdb"].text.strip())
    if not spy and not has_gdb:
        hd.notes.append("neither py-spy nor gdb on the host: no stack can be read")
    work: list[Section] = []
    ras_seen: dict[tuple, str] = {}
    for i, svc in enumerate(services):
        out = got[f"c{i}"]
        parts = out.text.strip().split(" ", 2)
        main = int(parts[0]) if out.ok and parts and parts[0].isdigit() else 0
        running = out.ok and len(parts) > 1 and parts[1] == "true"
        env = env_of(parts[2]) if len(parts) > 2 else {}
        sd = ServiceDump(svc.name, svc.spec.name, running, main)
        hd.services.append(sd)
        if not out.ok:
            sd.notes.append(f"docker inspect {svc.spec.name}: {out.text.strip()[:200] or f'exit {out.rc}'}")
            continue
        if not running:
            sd.notes.append(f"container {svc.spec.name} is not running")
            continue
        procs = container_processes(main, table)
        if not procs:
            sd.notes.append(f"no vLLM process below the container's main process (pid {main})")
        for p in procs:
            sd.processes.append(ProcDump(p.pid, p.title, p.kind, p.state))
            if spy or has_gdb:
                work.append(Section(f"d{p.pid}", dump_command(p.pid, spy, has_gdb), None, ATTEMPT_S * 4 + 10))
        addr = ras_address(env)
        if addr is None:
            sd.ras = {"listening": False, "line": "NCCL RAS: off (NCCL_RAS_ENABLE=0)"}
        else:
            key = (addr, "host")  # railyard's containers share the host's network: one RAS per address
            if key in ras_seen:
                sd.ras = {"same_as": ras_seen[key]}
            else:
                ras_seen[key] = svc.name
                work.append(Section(f"r{i}", ras_command(svc.spec.name, addr), "docker", 30))
        prefix = flight_recorder_prefix(env)
        if prefix:
            work.append(Section(f"f{i}", flight_recorder_command(svc.spec.name, prefix), "docker", 60))
    if work:
        token = new_token()
        r = s.run(joined_script(work, token), timeout=ATTEMPT_S * 4 + 60)
        if r.error:
            raise RailyardError(f"{s.host.name}: {r.error.kind}: {r.error.message}")
        done = split_output(r.stdout, work, token)
        for i, sd in enumerate(hd.services):
            for proc in sd.processes:
                o = done.get(f"d{proc.pid}")
                if o is None:
                    continue
                proc.tool, st, proc.failures = read_dump(proc.pid, o.text)
                if st is None:
                    if not proc.failures:
                        proc.failures.append("timed out" if o.timed_out or o.rc is None else f"exit {o.rc}, no output")
                    continue
                proc.stack = st.as_dict()
                f = waiting_frame(st)
                proc.frame = str(f) if f else ""
            if f"r{i}" in done:
                o = done[f"r{i}"]
                addr = ras_address(env_of_service(got, i)) or ("127.0.0.1", RAS_PORT)
                sd.ras = read_ras(o.text, addr) if o.ok else {
                    "address": f"{addr[0]}:{addr[1]}", "listening": None,
                    "line": f"NCCL RAS: not asked: {o.text.strip()[-200:] or f'exit {o.rc}'}"}
            if f"f{i}" in done:
                sd.flight_recorder = read_flight_recorder(done[f"f{i}"].text)
                if not sd.flight_recorder:
                    sd.notes.append("flight recorder: on, no dump written (it dumps on a collective's timeout)")
    for sd in hd.services:
        if sd.running:
            sd.log_tail = log_tail(s, sd.container, lines)
    return hd


def env_of_service(got: dict, i: int) -> dict[str, str]:
    parts = got[f"c{i}"].text.strip().split(" ", 2)
    return env_of(parts[2]) if len(parts) > 2 else {}


# ---------------------------------------------------------------- the deployment


def who(hd_host: str, sd: ServiceDump, p: ProcDump) -> str:
    return f"{hd_host}/{sd.service} pid {p.pid} {p.title}"


def ranks_of(hosts: list[HostDump]) -> list[tuple[str, Frame | None, ProcDump]]:
    """The processes that are the deployment's ranks: its workers where it has any, else its engine cores,
    else its API servers (a one-process engine)."""
    procs = [(h.host, sd, p) for h in hosts for sd in h.services for p in sd.processes]
    for kind in ("worker", "engine", "api", "serve"):
        chosen = [(h, sd, p) for h, sd, p in procs if p.kind == kind]
        if chosen:
            return [(who(h, sd, p), _frame_of(p), p) for h, sd, p in chosen]
    return []


def _frame_of(p: ProcDump) -> Frame | None:
    return Frame(p.frame, "", True) if p.frame else None


def summary(hosts: list[HostDump]) -> dict:
    """The ranks grouped by the frame their main thread waits in, the outliers named, as data and one line; the
    engine cores (where the workers are the ranks) break a tie."""
    ranks = ranks_of(hosts)
    kinds = {p.kind for _, _, p in ranks}
    cores = [_frame_of(p) for h in hosts for sd in h.services for p in sd.processes
             if p.kind == "engine" and "engine" not in kinds]
    g = group_ranks([(w, f) for w, f, _ in ranks], cores)
    return {"line": g.line(), "groups": [asdict(x) for x in g.groups], "outliers": [asdict(x) for x in g.outliers],
            "missing": g.missing}


def verdict_checks(verdicts: list[Verdict]) -> list[CheckResult]:
    out = []
    for v in verdicts:
        status = PASS if v.state == "ok" else WARN if v.state == "unknown" else FAIL
        out.append(CheckResult(v.host, "hang", status, f"{v.service}: {v.state}" + (f" ({v.target})" if v.target else ""),
                               "; ".join(v.evidence),
                               "" if status == PASS else "inv recover brings it back (inv recover --dry-run shows how)"))
    return out


def is_hung(verdicts: list[Verdict]) -> bool:
    return any(v.state in ("hung", "dead") for v in verdicts)


def hang_report(plan: LaunchPlan, hosts: list[HostDump], failed: dict[str, str], verdicts: list[Verdict],
                at: float, kept: str = "", keep_error: str = "") -> Report:
    """One `hang` check per verdict, one `stacks` check (the summary: pass when every rank's stack came back,
    warn otherwise; a stack never fails the task, the verdict does), one `host` fail per host not read."""
    summ = summary(hosts)
    hung = is_hung(verdicts)
    checks = verdict_checks(verdicts)
    if not verdicts:
        checks.append(CheckResult(plan.endpoint.host, "hang", WARN, "the hung verdict said nothing about any service"))
    stacks_ok = not summ["missing"] and bool(summ["groups"])
    checks.append(CheckResult(plan.endpoint.host, "stacks", PASS if stacks_ok else WARN, summ["line"],
                              f"{sum(len(g['members']) for g in summ['groups'])} rank stack(s) read",
                              "" if stacks_ok else "each rank's `failures` in --json say why; run as root, or "
                              "install gdb or py-spy on the host"))
    for h, err in failed.items():
        checks.append(CheckResult(h, "host", FAIL, f"not read: {err}", "", f"check SSH to {h} (inv preflight)"))
    if keep_error:
        checks.append(CheckResult(plan.endpoint.host, "kept", WARN, keep_error))
    verdict_line = ("HUNG: " + "; ".join(f"{v.host}/{v.service} {v.state}" for v in verdicts if v.state in ("hung", "dead"))
                    + " -- " + summ["line"]) if hung else "nothing is hung"
    data = {"deployment": plan.deployment, "layout": plan.layout,
            "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at)), "hung": hung, "verdict": verdict_line,
            "verdicts": [{"host": v.host, "service": v.service, "target": v.target, "state": v.state,
                          "evidence": list(v.evidence)} for v in verdicts],
            "summary": summ, "hosts": {h.host: asdict(h) for h in hosts}, "failed": failed, "kept": kept or None}
    return Report(checks, data)


def dump_dir(state_dir: str, deployment: str) -> str:
    return f"{state_dir.rstrip('/')}/{deployment}/{DIR_NAME}"


def stamp(at: float) -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(at))


def keep(s: Session, state_dir: str, deployment: str, at: float, doc: str) -> str:
    """Write the dump on the deployment's first host and drop all but the newest KEPT; HOST:path."""
    d = dump_dir(state_dir, deployment)
    path = f"{d}/{stamp(at)}.json"
    write_remote(s, path, doc, mode="644")
    s.run(f"cd {q(RemotePath(d))} && ls -1 | grep -E '^[0-9]{{8}}T[0-9]{{6}}Z[.]json$' | sort | head -n -{KEPT} | "
          "while read -r f; do rm -f -- \"$f\"; done", timeout=30)
    return f"{s.host.name}:{path}"


def latest(s: Session, state_dir: str, deployment: str) -> str | None:
    """HOST:path of the newest kept dump, or None (for `inv status`)."""
    d = dump_dir(state_dir, deployment)
    r = s.run(f"ls -1 {q(RemotePath(d))} 2>/dev/null | grep -E '^[0-9]{{8}}T[0-9]{{6}}Z[.]json$' | sort | tail -n 1",
              timeout=30)
    name = r.stdout.strip() if r.ok else ""
    return f"{s.host.name}:{d}/{name}" if _STAMP.match(name) else None


def dump(inv: Inventory, plan: LaunchPlan, runner: Runner, lines: int = LOG_LINES, keep_it: bool = True,
         verdicts: list[Verdict] | None = None) -> Report:
    """Every rank read in parallel, the shared verdict (asked after the stacks are read, unless given), the
    report; kept on the first host."""
    from ..apply.lock import lock_host
    at = time.time()
    hosts = [inv.host(h) for h in plan.hosts()]
    got = runner.each(lambda s: dump_host(s, plan.on_host(s.host.name), lines), hosts)
    dumps = [got.ok[h] for h in got.ok]
    failed = {h: str(r.error) for h, r in got.failed.items()}
    if verdicts is None:
        verdicts = survey(inv, runner, plan)
    kept, keep_error = "", ""
    if keep_it:
        first = lock_host(inv)
        doc = hang_report(plan, dumps, failed, verdicts, at).json()
        try:
            kept = keep(runner.session(first), str(first.vars["vllm_state_dir"]), plan.deployment, at, doc)
        except RailyardError as e:
            keep_error = f"this dump was not kept: {e}"
    return hang_report(plan, dumps, failed, verdicts, at, kept, keep_error)


def hang_dump(inv: Inventory, lines: int = LOG_LINES) -> Report:
    from ..plan import layout as layouts
    from .serve import build_plan
    with Runner(layouts.get(inv).hosts(inv)) as runner:
        plan = build_plan(inv, runner, strict=False)
        return dump(inv, plan, runner, lines)
