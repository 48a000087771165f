"""`inv sync-model`: copy the checkpoint from one host to the others and prove the copies equal.

Flow: manifests of every host (names, sizes, mtimes) -> the head's SSH to each target
(host keys checked) -> a copy plan per target (send, resume, already equal) -> parallel
rsync streams, host to host, fed into one live progress display -> verification on every
host in parallel (`size`: name+size manifest; `content`: a sha256 per file, every core,
cached per host) -> model checks from the checkpoint's own config.json and index ->
optional --repair of exactly what differs.

Exit codes: 0 copies equal and the model valid, 1 differences, an invalid model or a failed
copy, 2 usage or inventory error. `--json` prints railyard.report's one document, whose
`data` is `report_json` here.
"""

from __future__ import annotations

import json
import re
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from .. import checks as C
from ..checks import FAIL, PASS, SKIP, CheckResult
from ..checks.net import check_ssh_peer
from . import rsyncd
from ..errors import UsageError
from ..inventory import Host, Inventory
from ..apply.lock import HeadLock, lock_host
from .. import engines
from ..engines import Prefetch, Staged
from ..facts.net import ssh_peer_section
from ..facts.probe import joined_script, new_token, split_output
from ..transport.runner import Runner
from ..transport import RemotePath, Session, Sh, cmd, q, quote_text
from ..report import Report

if TYPE_CHECKING:
    from ..plan.spec import LaunchPlan

MANIFEST_SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "manifest.py"
EXCLUDE = ".cache/"
TRANSPORTS = ("ssh", "rsyncd")


# ---------------------------------------------------------------- manifests

@dataclass(frozen=True)
class FileInfo:
    size: int
    mtime: int
    sha256: str | None = None


@dataclass
class Manifest:
    host: str
    exists: bool
    files: dict[str, FileInfo]
    config: dict | None = None
    index: dict | None = None
    cache: dict | None = None
    seconds: float = 0.0
    error: str | None = None

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files.values())


def manifest_command(model_path: str, mode: str, rehash: bool = False) -> Sh:
    """python3 reads scripts/manifest.py from stdin; only the standard library is needed on the host."""
    return cmd("python3", "-", Sh(q(RemotePath(model_path))), mode, *(["--rehash"] if rehash else []))


def parse_manifest(host: str, text: str) -> Manifest:
    try:
        doc = json.loads(text.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return Manifest(host, False, {}, error=f"manifest unreadable: {text.strip()[:200] or 'no output'}")
    files = {p: FileInfo(int(f["size"]), int(f["mtime"]), f.get("sha256")) for p, f in doc.get("files", {}).items()}
    return Manifest(host, bool(doc.get("exists")), files, doc.get("config"), doc.get("index"), doc.get("cache"),
                    float(doc.get("seconds", 0)))


def read_manifest(session: Session, model_path: str, mode: str, rehash: bool = False,
                  timeout: float = 86400) -> Manifest:
    r = session.run(manifest_command(model_path, mode, rehash), timeout=timeout, stdin=MANIFEST_SCRIPT.read_bytes())
    if r.error:
        return Manifest(session.host.name, False, {}, error=f"{r.error.kind}: {r.error.message}")
    if r.rc != 0:
        tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["no output"]
        why = "python3 not found on the host" if r.rc == 127 else tail[0]
        return Manifest(session.host.name, False, {}, error=f"manifest failed ({r.rc}): {why}")
    return parse_manifest(session.host.name, r.stdout)


# ---------------------------------------------------------------- comparing

@dataclass(frozen=True)
class Difference:
    path: str
    kind: str  # missing | extra | size | content
    source: object = None
    target: object = None

    def __str__(self) -> str:
        if self.kind == "missing":
            return f"missing: {self.path}"
        if self.kind == "extra":
            return f"extra: {self.path}"
        if self.kind == "size":
            return f"size differs: {self.path} ({self.target} bytes, source {self.source})"
        return f"content differs: {self.path} (sha256 {str(self.target)[:12]}, source {str(self.source)[:12]})"


def diff(src: Manifest, dst: Manifest, mode: str) -> list[Difference]:
    """What differs on dst compared with src: by names and sizes, and by sha256 in content mode."""
    out = []
    for path, f in sorted(src.files.items()):
        g = dst.files.get(path)
        if g is None:
            out.append(Difference(path, "missing", f.size, None))
        elif g.size != f.size:
            out.append(Difference(path, "size", f.size, g.size))
        elif mode == "content" and f.sha256 != g.sha256:
            out.append(Difference(path, "content", f.sha256, g.sha256))
    for path in sorted(set(dst.files) - set(src.files)):
        out.append(Difference(path, "extra", None, dst.files[path].size))
    return out


def check_model(m: Manifest, v: dict) -> list[str]:
    """Problems the checkpoint's own files show: config.json and the shard index. No hard-coded shard count."""
    if m.error:
        return [m.error]
    if not m.exists or not m.files:
        return [f"no checkpoint at {v['model_path']}"]
    problems = []
    cfg = m.config
    if cfg is None:
        problems.append("config.json missing")
    elif "_error" in cfg:
        problems.append(f"config.json does not parse ({cfg['_error'].split(': ', 1)[-1]})")
    elif not isinstance(cfg, dict):
        problems.append("config.json is not a JSON object")
    else:
        want_arch = v.get("model_architectures") or []
        if want_arch and cfg.get("architectures") != want_arch:
            problems.append(f"config.json architectures {cfg.get('architectures')!r}, expected {want_arch!r}")
        want_q = v.get("model_quant_algo")
        got_q = (cfg.get("quantization_config") or {}).get("quant_algo") if isinstance(cfg.get("quantization_config"), dict) else None
        if want_q and got_q != want_q:
            problems.append(f"config.json quantization_config.quant_algo {got_q!r}, expected {want_q!r}")
    shards = sorted(p for p in m.files if p.endswith(".safetensors"))
    idx = m.index
    if idx is None:
        if len(shards) > 1:
            problems.append("model.safetensors.index.json missing (several shards)")
        elif not shards:
            problems.append("no *.safetensors shard")
    elif "_error" in idx:
        problems.append(f"model.safetensors.index.json does not parse ({idx['_error'].split(': ', 1)[-1]})")
    elif not idx.get("shards"):
        problems.append("model.safetensors.index.json has no weight_map")
    else:
        absent = [s for s in idx["shards"] if s not in m.files]
        if absent:
            shown = ", ".join(absent[:5]) + (f" and {len(absent) - 5} more" if len(absent) > 5 else "")
            problems.append(f"the index names {len(absent)} shard(s) not present: {shown}")
    return problems


# ---------------------------------------------------------------- planning the copy

@dataclass
class CopyPlan:
    target: str
    send: list[str] = field(default_factory=list)      # whole-file
    resume: list[str] = field(default_factory=list)    # shorter on the target: append, then verify
    equal: int = 0
    extra: list[str] = field(default_factory=list)
    bytes: int = 0

    @property
    def empty(self) -> bool:
        return not self.send and not self.resume


def plan_copy(src: Manifest, dst: Manifest, force: list[str] | None = None) -> CopyPlan:
    """Quick check as rsync does it (size and mtime); a shorter file on the target is resumed."""
    plan = CopyPlan(dst.host)
    forced = set(force or ())
    for path, f in sorted(src.files.items()):
        g = dst.files.get(path)
        if path in forced or g is None:
            plan.send.append(path)
            plan.bytes += f.size
        elif g.size == f.size and g.mtime == f.mtime:
            plan.equal += 1
        elif g.size < f.size and path not in forced:
            plan.resume.append(path)
            plan.bytes += f.size - g.size
        else:
            plan.send.append(path)
            plan.bytes += f.size
    plan.extra = sorted(set(dst.files) - set(src.files))
    return plan


def split_streams(paths: list[str], sizes: dict[str, int], n: int) -> list[list[str]]:
    """Largest first onto the least-loaded stream: n lists of similar byte counts."""
    streams: list[list[str]] = [[] for _ in range(max(1, n))]
    loads = [0] * len(streams)
    for p in sorted(paths, key=lambda p: -sizes.get(p, 0)):
        i = loads.index(min(loads))
        streams[i].append(p)
        loads[i] += sizes.get(p, 0)
    return [s for s in streams if s]


def remote_dest(path: str) -> str:
    """rsync's remote path: `~/x` becomes `x`, which rsync resolves in the remote user's home."""
    return path[2:] if path.startswith("~/") else path


def rsync_args(mode: str, bwlimit_mbps: float, io_timeout_s: int = 0) -> list[str]:
    """The rsync options of one stream, whatever carries it (SSH, or the rsyncd transport)."""
    argv = ["rsync", "-aH", "--copy-links", "--no-compress", "--inplace", "--partial", "--protect-args", "--from0", "--files-from=-",
            "--exclude", EXCLUDE, "--stats", "--info=progress2", "--no-human-readable"]
    argv += {"whole": ["--whole-file"], "append": ["--append-verify"], "repair": ["--whole-file", "--ignore-times"]}[mode]
    if bwlimit_mbps:
        argv.append(f"--bwlimit={int(bwlimit_mbps * 1000)}")
    if io_timeout_s:
        argv.append(f"--timeout={int(io_timeout_s)}")
    return argv


def rsync_command(src_path: str, target: Host, dest_path: str, mode: str, cipher: str, bwlimit_mbps: float,
                  io_timeout_s: int = 0) -> Sh:
    """One rsync stream, run on the source; the file list arrives on stdin (NUL-separated). With
    io_timeout_s, a stream on which no data moves that long ends (rsync's --timeout, exit 30) and its
    SSH gives up on a peer that stopped answering, instead of waiting out sync_timeout_s."""
    ssh = cmd("ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes", "-o", "Compression=no", "-c", cipher,
              *(("-o", f"ServerAliveInterval={max(1, io_timeout_s // 4)}", "-o", "ServerAliveCountMax=4",
                 "-o", f"ConnectTimeout={io_timeout_s}") if io_timeout_s else ()))
    argv = rsync_args(mode, bwlimit_mbps, io_timeout_s)
    user = f"{target.user}@" if target.user else ""
    argv += ["-e", quote_text(ssh), "./", f"{user}{target.serve_rail.ip}:{remote_dest(dest_path)}/"]
    return Sh(f"cd {q(RemotePath(src_path))} && " + cmd(*argv))


# what rsync and its ssh print when the peer stops answering (rsync's --timeout; ssh's ServerAlive*)
_STALLED = ("timeout in data send/receive", "io timeout after", "Timeout, server", "not responding",
            "Connection timed out", "Broken pipe")


def stream_error(stderr: str, rc: int | None, io_timeout_s: int) -> str:
    """One stream's failure in a line: a stall named as one (with the line that says so), else rsync's last line."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    stall = next((ln for ln in lines if any(m in ln for m in _STALLED)), None)
    if stall:
        return (f"no data moved for {io_timeout_s} s: the target or the rail to it stopped answering ({stall}); "
                "check the rail (inv preflight), then run sync-model again")
    return lines[-1] if lines else f"rsync exit {rc}"


_PROGRESS_RE = re.compile(r"^\s*([\d,]+)\s+\d+%\s")
_SENT_RE = re.compile(r"Total bytes sent:\s*([\d,.]+)")


def parse_progress(text: str) -> int | None:
    """The bytes figure of the last `--info=progress2` update in text (updates end in \\r)."""
    last = None
    for piece in re.split(r"[\r\n]", text):
        m = _PROGRESS_RE.match(piece)
        if m:
            last = int(m[1].replace(",", ""))
    return last


def parse_bytes_sent(text: str) -> int:
    m = _SENT_RE.search(text)
    return int(m[1].replace(",", "").replace(".", "")) if m else 0


def download_command(v: dict) -> Sh:
    """The reference's pinned download, inside the pinned image, into model_path on the source."""
    inner = cmd("exec", "hf", "download", v["model_repo"], "--revision", v["model_revision"], "--local-dir", "/model")
    mount = Sh(q(RemotePath(v["model_path"])) + q(":/model"))
    return Sh(cmd("mkdir", "-p", Sh(q(RemotePath(v["model_path"])))) + " && " +
              cmd("docker", "run", "--rm", "--network", "host", "-v", mount, "--entrypoint", "bash",
                  v["vllm_image"], "-lc", quote_text(inner)))


# ---------------------------------------------------------------- running it

@dataclass
class TargetResult:
    host: str
    plan: CopyPlan | None = None
    bytes_sent: int = 0
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)
    hint: str = ""  # the fix for errors that "run sync-model again" does not mend (a daemon's port in use)
    notes: list[str] = field(default_factory=list)


@dataclass
class StagedSync:
    """A folder an engine fetches at its first start (railyard.engines.Prefetch: vLLM's FlashInfer kernels): what
    staging on the source said, each target's copy and what still differs from the source's folder by content."""
    path: str
    what: str
    staged: Staged
    copies: dict[str, TargetResult] = field(default_factory=dict)
    differences: dict[str, list[str]] = field(default_factory=dict)
    files: int = 0

    def problems(self, target: str) -> list[str]:
        """What keeps the target's folder from being the source's: its copy's errors, then what differs."""
        c = self.copies.get(target)
        return (c.errors if c else []) + self.differences.get(target, [])

    @property
    def ok(self) -> bool:
        return self.staged.error is None and not any(self.problems(t) for t in self.differences)


@dataclass
class SyncReport:
    source: str
    verify: str
    targets: list[str]
    manifests: dict[str, Manifest] = field(default_factory=dict)
    copies: dict[str, TargetResult] = field(default_factory=dict)
    differences: dict[str, list[Difference]] = field(default_factory=dict)
    model: dict[str, list[str]] = field(default_factory=dict)
    repaired: dict[str, list[str]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    failure: str | None = None
    hint: str = ""
    dry_run: bool = False
    commands: dict[str, list[str]] = field(default_factory=dict)
    transport: str = "ssh"
    staged: list[StagedSync] = field(default_factory=list)   # the engines' prefetches: staged, then copied


    @property
    def ok(self) -> bool:
        return (self.failure is None and not any(self.differences.values())
                and not any(self.model.values()) and not any(c.errors for c in self.copies.values())
                and all(k.ok for k in self.staged))

    def why(self) -> str:
        """Why it is not ok, in one line: the stop, a difference, a model problem, a staging that failed."""
        return (self.failure or "; ".join(f"{h}: {d}" for h, ds in self.differences.items() for d in ds[:1])
                or "; ".join(f"{h}: {m}" for h, ms in self.model.items() for m in ms[:1])
                or "; ".join(f"{k.path}: {k.staged.error or next(p for t in k.differences for p in k.problems(t))}"
                             for k in self.staged if not k.ok)
                or "copy errors")


class Bars(Protocol):
    """What the view shows of the copies (railyard.cli.sync draws rich's bars): a context while they run."""

    def __enter__(self) -> "Bars": ...

    def __exit__(self, *exc: object) -> None: ...

    def update(self, target: str, completed: int) -> None: ...


class SyncView(Protocol):
    """What sync-model shows while it works; None shows nothing (--json, tests)."""

    def say(self, message: str) -> None: ...

    def out(self, text: str) -> None: ...   # a download's own output, as it comes

    def bars(self, plans: dict[str, CopyPlan]) -> Bars: ...


class Progress:
    """rsync's progress2 figures of every stream, summed per target for the view's bars."""

    def __init__(self, bars: Bars):
        self.bars = bars
        self.lock = threading.Lock()
        self.done: dict[tuple, int] = {}

    def update(self, target: str, key: tuple, value: int, limit: int) -> None:
        with self.lock:
            self.done[(target,) + key] = min(value, limit)
            self.bars.update(target, sum(v for k, v in self.done.items() if k[0] == target))

    def __enter__(self):
        self.bars.__enter__()
        return self

    def __exit__(self, *exc):
        self.bars.__exit__(*exc)


def _copy_target(source: Session, target: Host, plan: CopyPlan, src: Manifest, v: dict, opts: "SyncOptions",
                 progress: Progress | None, repair: bool, daemon=None, started: float | None = None) -> TargetResult:
    assert opts.streams is not None and opts.bwlimit_mbps is not None  # sync_model resolved them from the inventory
    bwlimit_mbps = opts.bwlimit_mbps
    res = TargetResult(target.name, plan)
    started = time.monotonic() if started is None else started
    sizes = {p: f.size for p, f in src.files.items()}
    groups = []
    for mode, paths in (("append", plan.resume), ("repair" if repair else "whole", plan.send)):
        for i, chunk in enumerate(split_streams(paths, sizes, opts.streams)):
            groups.append((mode, i, chunk))
    by_stream: dict[int, list] = {}
    for mode, i, chunk in groups:
        by_stream.setdefault(i, []).append((mode, chunk))
    lock = threading.Lock()

    def stream(i: int) -> None:
        for mode, chunk in by_stream[i]:
            limit = sum(sizes[p] for p in chunk)
            stdin = b"\0".join(p.encode() for p in chunk) + b"\0"
            if daemon is None:
                command = rsync_command(v["model_path"], target, v["model_path"], mode, v["sync_ssh_cipher"],
                                        bwlimit_mbps, v["sync_io_timeout_s"])
            else:  # the secret is stdin's first line, read by the stream's shell
                command = rsyncd.client_command(v["model_path"], source.host.serve_rail.ip, target.serve_rail.ip,
                                                daemon.port, rsync_args(mode, bwlimit_mbps, v["sync_io_timeout_s"]),
                                                v["sync_io_timeout_s"])
                stdin = daemon.secret.encode() + b"\n" + stdin
            buf = {"text": ""}

            def seen(text: str, key=(i, mode), limit=limit) -> None:
                buf["text"] = (buf["text"] + text)[-4096:]
                n = parse_progress(buf["text"])
                if n is not None and progress:
                    progress.update(target.name, key, n, limit)

            r = source.run(command, timeout=v["sync_timeout_s"], stdin=stdin, on_output=seen)
            with lock:
                # --stats only comes at the end; an interrupted stream counts what progress2 last showed
                res.bytes_sent += parse_bytes_sent(r.stdout) or parse_progress(r.stdout) or 0
                if r.error or r.rc != 0:
                    why = r.error.message if r.error else stream_error(r.stderr, r.rc, v["sync_io_timeout_s"])
                    refused = daemon is not None and not r.error and rsyncd.client_error(
                        r.stderr, target, source.host, daemon.port)
                    if refused:
                        why, res.hint = refused
                    res.errors.append(f"stream {i + 1} ({len(chunk)} files): {why}")
                    return
            if progress:
                progress.update(target.name, (i, mode), limit, limit)

    threads = [threading.Thread(target=stream, args=(i,)) for i in by_stream]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    res.seconds = time.monotonic() - started
    return res


@dataclass
class SyncOptions:
    source: str | None = None
    to: str | None = None
    verify: str | None = None
    streams: int | None = None
    dry_run: bool = False
    repair: bool = False
    rehash: bool = False
    bwlimit_mbps: float | None = None
    transport: str | None = None  # ssh | rsyncd; default sync_transport


def _targets(inv: Inventory, opts: SyncOptions) -> tuple[Host, list[Host]]:
    source = inv.host(opts.source) if opts.source else inv.head
    targets = inv.select(opts.to) if opts.to else [h for h in inv.hosts if h.name != source.name]
    if any(t.name == source.name for t in targets):
        raise UsageError(f"--to {opts.to}: the source {source.name} cannot also be a target")
    return source, targets


def manifests(runner: Runner, hosts: list[Host], v: dict, mode: str, rehash: bool) -> dict[str, Manifest]:
    got = runner.each(lambda s: read_manifest(s, v["model_path"], mode, rehash, v["sync_timeout_s"]), hosts)
    return {name: got.ok[name] if name in got.ok else Manifest(name, False, {}, error=str(got.failed[name].error))
            for name in got}


def _peer_check(runner: Runner, source: Host, targets: list[Host]) -> C.CheckResult:
    section = ssh_peer_section(targets)
    token = new_token()
    r = runner.session(source).run(joined_script([section], token), timeout=section.timeout + 10)
    if r.error:
        return C.CheckResult(source.name, "ssh_peer", C.FAIL, f"{r.error.kind}: {r.error.message}", "", r.error.hint)
    return check_ssh_peer(source, split_output(r.stdout, [section], token)["ssh_peer"], targets)


def sync_model(inv: Inventory, opts: SyncOptions, view: SyncView | None) -> SyncReport:
    if opts.dry_run:
        return _sync_model(inv, opts, view)
    host = lock_host(inv)
    with Runner([host]) as lr, HeadLock(lr.session(host), "inv sync-model"):
        return _sync_model(inv, opts, view)


def _sync_model(inv: Inventory, opts: SyncOptions, view: SyncView | None) -> SyncReport:
    source, targets = _targets(inv, opts)
    v = dict(source.vars)
    prefetches = engines.prefetches(v)
    if not targets and not prefetches:
        raise UsageError("sync-model: no target hosts (the inventory has a single host)")
    mode = opts.verify or v["sync_verify"]
    if mode not in ("size", "content"):
        raise UsageError(f"--verify {mode!r}: must be size or content")
    opts.streams = v["sync_streams"] if opts.streams is None else int(opts.streams)
    if not 1 <= opts.streams <= 64:
        raise UsageError(f"--streams {opts.streams}: must be between 1 and 64")
    opts.bwlimit_mbps = v["sync_bwlimit_mbps"] if opts.bwlimit_mbps is None else opts.bwlimit_mbps
    opts.transport = opts.transport or v["sync_transport"]
    if opts.transport not in TRANSPORTS:
        raise UsageError(f"--transport {opts.transport!r}: must be ssh or rsyncd")
    rep = SyncReport(source.name, mode, [t.name for t in targets], dry_run=opts.dry_run, transport=opts.transport)
    say = view.say if view else (lambda m: None)
    if not targets:   # one host: its checkpoint is where it is; only what the engine fetches is staged
        if opts.dry_run:
            rep.commands[source.name] = _stage_lines(prefetches, rep.targets)
            return rep
        with Runner([source]) as runner:
            rep.staged = [_sync_staged(runner, source, [], p, v, opts, say) for p in prefetches]
        return rep
    with Runner([source] + targets) as runner:
        # 1. what is where (names, sizes, mtimes), and can the source reach the targets
        say(f"reading {v['model_path']} on {source.name} and {', '.join(rep.targets)}")
        before = manifests(runner, [source] + targets, v, "size", False)
        src = before[source.name]
        for m in before.values():
            if m.error:
                rep.failure, rep.hint = f"{m.host}: {m.error}", "fix the host's SSH or python3, then rerun"
                return rep
        if not src.files or src.config is None:  # no checkpoint (or an unfinished download) on the source
            if opts.dry_run:
                rep.commands[source.name] = [download_command(v)]
                rep.notes.append(f"{source.name}: no checkpoint at {v['model_path']}: would download "
                                 f"{v['model_repo']}@{v['model_revision'][:12]} with the command shown")
                return rep
            say(f"{source.name}: no checkpoint at {v['model_path']}: downloading {v['model_repo']} "
                f"at {v['model_revision'][:12]}")
            r = runner.session(source).run(download_command(v), timeout=v["sync_timeout_s"],
                                           on_output=view.out if view else None)
            if not r.ok:
                rep.failure = f"{source.name}: download failed ({r.error or 'exit ' + str(r.rc)})"
                rep.hint = "check the image, network access to the model hub and the revision; rerun resumes"
                return rep
            src = manifests(runner, [source], v, "size", False)[source.name]
            before[source.name] = src
        if opts.transport == "ssh":  # rsyncd: railyard's own sessions start the daemons; no SSH from the source
            peers = _peer_check(runner, source, targets)
            if peers.status != C.PASS:
                rep.failure, rep.hint = peers.detail, peers.hint
                return rep
        plans = {t.name: plan_copy(src, before[t.name]) for t in targets}
        if opts.dry_run:
            for t in targets:
                p = plans[t.name]
                rep.copies[t.name] = TargetResult(t.name, p)
                cmds = []
                port = t.vars["sync_rsyncd_port"] or "PORT"
                if opts.transport == "rsyncd" and not p.empty:
                    cmds.append(f"rsync --daemon --no-detach --config=/tmp/railyard-rsyncd.XXXXXXXXXX/rsyncd.conf "
                                f"--port={port}  # over railyard's SSH session to {t.name}: address "
                                f"{t.serve_rail.ip}, hosts allow {source.serve_rail.ip}, a one-time secret on stdin; "
                                "removed after the copy")
                for mode_, paths in (("append", p.resume), ("whole", p.send)):
                    for chunk in split_streams(paths, {k: f.size for k, f in src.files.items()}, opts.streams):
                        if opts.transport == "rsyncd":
                            line = rsyncd.client_command(v["model_path"], source.serve_rail.ip, t.serve_rail.ip, port,
                                                         rsync_args(mode_, opts.bwlimit_mbps, v["sync_io_timeout_s"]),
                                                         v["sync_io_timeout_s"])
                            cmds.append(f"{line}  # the secret, then {len(chunk)} file(s) on stdin")
                        else:
                            line = rsync_command(v["model_path"], t, v["model_path"], mode_, v["sync_ssh_cipher"],
                                                 opts.bwlimit_mbps, v["sync_io_timeout_s"])
                            cmds.append(f"{line}  # {len(chunk)} file(s) on stdin")
                rep.commands[t.name] = cmds
            rep.commands.setdefault(source.name, []).extend(_stage_lines(prefetches, rep.targets))
            return rep
        # 2. copy, host to host, all targets and streams at once
        rep.copies = _run_copies(runner, source, targets, plans, src, v, opts, view, repair=False)
        if all(p.empty for p in plans.values()) and not opts.repair:
            rep.notes.append(f"nothing to send: every target already has all {len(src.files)} files "
                             f"with the same names, sizes and mtimes")
        # 3. verify every host in parallel, and the model from its own files
        _verify(runner, rep, source, targets, v, mode, opts.rehash, say)
        # 4. repair exactly what differs, then verify again
        if opts.repair and any(rep.differences.values()) and not any(c.errors for c in rep.copies.values()):
            _repair(runner, rep, source, targets, v, opts, view)
            _verify(runner, rep, source, targets, v, mode, False, say)
        # 5. what the engine fetches at a first start, for offline hosts: staged on the source, then copied
        rep.staged = [_sync_staged(runner, source, targets, p, v, opts, say) for p in prefetches]
    if any(c.errors for c in rep.copies.values()):
        rep.hint = next((c.hint for c in rep.copies.values() if c.errors and c.hint),
                        "run sync-model again: finished files are not sent again and partial ones are continued")
    for c in rep.copies.values():
        rep.notes += c.notes
    if opts.transport == "rsyncd" and any(c.plan and not c.plan.empty for c in rep.copies.values()):
        rep.notes.append("copied over rsyncd: a one-time rsync daemon on each target's rail address, "
                         "unencrypted on the rail (auth: a one-time secret and the source's rail address)")
    if mode == "size":
        rep.notes.append("verified by names and sizes only: content was not compared (use --verify content)")
    return rep


def _stage_lines(prefetches: list[Prefetch], targets: list[str]) -> list[str]:
    """A dry run's staging commands, each with what it stages and where the folder then goes."""
    then = f", then copied to {', '.join(targets)}" if targets else ""
    return [f"{p.command}  # stages {p.what} in {p.path}{then}" for p in prefetches]


def _sync_staged(runner, source, targets, p: Prefetch, v, opts, say) -> StagedSync:
    """Stage p on the source (its command, which leaves a folder staged for this image as it is), copy what differs
    to each target with the checkpoint's streams, remove what the source's folder no longer holds, then compare
    every target's folder with the source's by content."""
    say(f"staging {p.what} for {v['vllm_image']} in {p.path} on {source.name}")
    out = StagedSync(p.path, p.what, p.parse(runner.session(source).run(p.command, timeout=v["sync_timeout_s"],
                                                                        stdin=p.stdin)))
    if out.staged.error:
        return out
    tree = dict(v, model_path=p.path)   # the copy and the manifests read the tree at model_path
    before = manifests(runner, [source] + targets, tree, "size", False)
    src = before[source.name]
    plans = {t.name: plan_copy(src, before[t.name]) for t in targets}
    if targets:
        say(f"copying {p.path} ({len(src.files)} files) to {', '.join(t.name for t in targets)}")
    out.copies = _run_copies(runner, source, targets, plans, src, tree, opts, None, repair=False)
    for t in targets:   # what the source's folder no longer holds goes, its folders too (a stale *.dist-info)
        if plans[t.name].extra:
            runner.session(t).run(f"cd {q(RemotePath(p.path))} && " + cmd("rm", "-f", "--", *plans[t.name].extra)
                                  + " && find . -mindepth 1 -depth -type d -empty -delete")
    after = manifests(runner, [source] + targets, tree, "content", False)
    out.files = len(after[source.name].files)
    for t in targets:
        m, first = after[t.name], after[source.name]
        out.differences[t.name] = ([f"not compared: {m.error or first.error}"] if m.error or first.error
                                   else [str(d) for d in diff(first, m, "content")])
    return out


def _run_copies(runner, source, targets, plans, src, v, opts, view, repair) -> dict[str, TargetResult]:
    work = [t for t in targets if not plans[t.name].empty]
    results = {t.name: TargetResult(t.name, plans[t.name]) for t in targets}
    if not work:
        return results
    for t in work:  # the target directory must exist before rsync writes into it
        runner.session(t).run(cmd("mkdir", "-p", Sh(q(RemotePath(v["model_path"])))))
    started = time.monotonic()
    daemons: dict[str, rsyncd.Daemon] = {}
    try:
        if opts.transport == "rsyncd":
            work = _start_daemons(runner, source, work, v, opts, daemons, results)
        progress = Progress(view.bars({t.name: plans[t.name] for t in work})) if view and work else None
        out: dict[str, TargetResult] = {}

        def one(t: Host) -> None:
            out[t.name] = _copy_target(runner.session(source), t, plans[t.name], src, v, opts, progress, repair,
                                       daemons.get(t.name), started)

        threads = [threading.Thread(target=one, args=(t,)) for t in work]
        ctx = progress if progress else _Null()
        with ctx:
            for th in threads:
                th.start()
            for th in threads:
                th.join()
        results.update(out)
    except BaseException:  # Ctrl-C: the daemons go before railyard does (and with its connections regardless)
        for d in daemons.values():
            d.stop(wait_s=2)
        raise
    for name, d in daemons.items():
        removed = d.stop()
        died = d.died
        if died and results[name].errors:
            results[name].errors.append(died)
        if not removed:
            results[name].notes.append(f"{name}: the rsync daemon's shell (pid {d.shell_pid}) did not confirm "
                                       f"removing {d.tmpdir or 'its directory'}: check `ls -d /tmp/railyard-rsyncd.*` "
                                       f"on {name}")
    return results


def _start_daemons(runner, source, work, v, opts, daemons, results) -> list[Host]:
    """One rsync daemon per target, in parallel, over railyard's session to it; the targets whose daemon
    listens (the others fail with the daemon's one line and its fix)."""
    started = {t.name: rsyncd.Daemon(t, runner.session(t)) for t in work}
    daemons.update(started)
    got = runner.each(lambda s: started[s.host.name].start(v["model_path"], source, opts.streams,
                                                           v["sync_io_timeout_s"], v["sync_timeout_s"] + 120,
                                                           s.host.vars["sync_rsyncd_port"]), work)
    ok = []
    for t in work:
        d = started[t.name]
        if d.port and not d.error:
            ok.append(t)
        elif d.error:  # the daemon's own line and its fix
            results[t.name].errors.append(d.error)
            results[t.name].hint = d.hint
        else:  # a bug in its start, caught by Runner.each
            r = got.failed[t.name]
            results[t.name].errors.append(f"{t.name}: rsync daemon: {r.error.message}")
            results[t.name].hint = r.error.hint
    return ok


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _verify(runner, rep, source, targets, v, mode, rehash, say) -> None:
    say(f"verifying ({mode}) on {source.name}, {', '.join(t.name for t in targets)}")
    rep.manifests = manifests(runner, [source] + targets, v, mode, rehash)
    src = rep.manifests[source.name]
    rep.model = {name: check_model(m, v) for name, m in rep.manifests.items()}
    for t in targets:
        m = rep.manifests[t.name]
        rep.differences[t.name] = [] if m.error or src.error else diff(src, m, mode)


def _repair(runner, rep, source, targets, v, opts, view) -> None:
    src = rep.manifests[source.name]
    plans = {}
    for t in targets:
        diffs = rep.differences.get(t.name, [])
        resend = [d.path for d in diffs if d.kind in ("missing", "size", "content")]
        extra = [d.path for d in diffs if d.kind == "extra"]
        if extra:
            runner.session(t).run(f"cd {q(RemotePath(v['model_path']))} && " + cmd("rm", "-f", "--", *extra))
        plan = CopyPlan(t.name, send=resend, bytes=sum(src.files[p].size for p in resend))
        plans[t.name] = plan
        rep.repaired[t.name] = [str(d) for d in diffs]
    copies = _run_copies(runner, source, targets, plans, src, v, opts, view, repair=True)
    for name, c in copies.items():
        prev = rep.copies.get(name)
        if prev:
            prev.bytes_sent += c.bytes_sent
            prev.seconds += c.seconds
            prev.errors += c.errors
        else:
            rep.copies[name] = c


# ---------------------------------------------------------------- before a start: the same checkpoint everywhere

def checkpoint_differs(inv: Inventory, runner: Runner, plan: "LaunchPlan") -> str:
    """'' when every host of the plan whose services mount the checkpoint holds the first such host's (by rank)
    checkpoint by content (sha256 of every file, as `inv sync-model --verify content` proves it), else one
    line naming the host and the file. One session per host, the hosts in parallel; each host's digest
    cache (scripts/manifest.py) makes an unchanged tree a stat pass, and a file rewritten with its size and
    mtime put back is hashed again (its ctime moved). What this proves is equality with the first host's
    copy, not that copy's correctness; and what changes no stat field at all (bits rotting under the
    filesystem, a tampered digest cache) is not seen without `inv sync-model --rehash`."""
    names = dict.fromkeys(s.host for s in plan.by_rank() if any(m.kind == "model" for m in s.spec.mounts))
    hosts = [inv.host(n) for n in names]   # the first by rank is the reference (the head of two stations)
    if len(hosts) < 2:
        return ""
    got = runner.each(lambda s: read_manifest(s, s.host.vars["model_path"], "content", False,
                                              s.host.vars["sync_timeout_s"]), hosts)
    found = [got.ok[h.name] if h.name in got.ok else Manifest(h.name, False, {}, error=str(got.failed[h.name].error))
             for h in hosts]
    return judge_checkpoints(found, {h.name: str(h.vars["model_path"]) for h in hosts})


def judge_checkpoints(found: list[Manifest], paths: dict[str, str]) -> str:
    """checkpoint_differs' judgement of content manifests, the first the reference. Pure."""
    first = found[0]
    out = []
    for m in found:
        if m.error:
            out.append(f"{m.host}: checkpoint not read: {m.error}")
        elif not m.exists or not m.files:
            out.append(f"{m.host}: no checkpoint at {paths.get(m.host, '?')}")
        elif m is not first and not (first.error or not first.exists or not first.files):
            d = diff(first, m, "content")
            if d:
                out.append(f"{m.host}: " + _differs(d[0], first.host) + (f" (and {len(d) - 1} more file(s))"
                                                                         if len(d) > 1 else ""))
    return "; ".join(out)


def _differs(d: Difference, first: str) -> str:
    if d.kind == "missing":
        return f"{d.path} is missing ({first} has it)"
    if d.kind == "extra":
        return f"{d.path} is not in {first}'s checkpoint"
    if d.kind == "size":
        return f"{d.path} is {d.target} bytes, {d.source} on {first}"
    return f"{d.path} differs by content from {first}'s (sha256 {str(d.target)[:12]}, {first}'s {str(d.source)[:12]})"


# ---------------------------------------------------------------- reporting

def report_json(rep: SyncReport) -> dict:
    hosts = []
    for name in [rep.source] + rep.targets:
        m = rep.manifests.get(name)
        c = rep.copies.get(name)
        hosts.append({
            "host": name, "role": "source" if name == rep.source else "target",
            "files": len(m.files) if m else None, "bytes": m.total_bytes if m else None,
            "differences": [asdict(d) for d in rep.differences.get(name, [])],
            "model_problems": rep.model.get(name, []),
            "copy": None if c is None or c.plan is None else {
                "send": len(c.plan.send), "resume": len(c.plan.resume), "equal": c.plan.equal,
                "planned_bytes": c.plan.bytes, "bytes_sent": c.bytes_sent, "seconds": round(c.seconds, 3),
                "errors": c.errors},
            "repaired": rep.repaired.get(name, []),
            "cache": m.cache if m else None,
        })
    return {"ok": rep.ok, "source": rep.source, "verify": rep.verify, "transport": rep.transport, "dry_run": rep.dry_run,
            "failure": rep.failure, "hint": rep.hint, "notes": rep.notes, "commands": rep.commands, "hosts": hosts,
            "staged": [{"path": k.path, "what": k.what, "line": k.staged.line, "error": k.staged.error,
                        "detail": k.staged.detail, "files": k.files, "differences": k.differences,
                        "copies": {n: {"bytes_sent": c.bytes_sent, "errors": c.errors} for n, c in k.copies.items()}}
                       for k in rep.staged]}


def sync_report(rep) -> Report:
    """sync-model: a `model` check per host (the checkpoint's own files) and a `sync` check per target
    (copied and equal to the source); a dry run skips them, a stop before copying is one fail."""
    data = {k: v for k, v in report_json(rep).items() if k != "ok"}
    src_name = rep.source
    if rep.failure:
        return Report([CheckResult(src_name, "sync", FAIL, rep.failure, "", rep.hint)], data)
    if rep.dry_run:
        checks = []
        for t in rep.targets:
            c = rep.copies.get(t)
            p = c.plan if c else None
            what = (f"would send {len(p.send)} file(s), resume {len(p.resume)}, {p.equal} already equal, "
                    f"{p.bytes} bytes" if p else f"{src_name} has no checkpoint yet: would download it first")
            checks.append(CheckResult(t, "sync", SKIP, f"dry run: {what}; nothing copied or verified"))
        return Report(checks, data)
    checks = []
    src = rep.manifests.get(src_name)
    for name in [src_name] + rep.targets:
        m = rep.manifests.get(name)
        problems = rep.model.get(name, [])
        if problems:
            checks.append(CheckResult(name, "model", FAIL, "; ".join(problems), "",
                                      "fix the checkpoint on the source (or download it again), then inv sync-model"
                                      + (" --repair" if name != src_name else "")))
        elif m is not None:
            arch = ", ".join((m.config or {}).get("architectures") or []) if isinstance(m.config, dict) else ""
            checks.append(CheckResult(name, "model", PASS, "config.json and the shard index are valid",
                                      f"{len(m.files)} files, {m.total_bytes} bytes" + (f"; {arch}" if arch else "")))
    how = "sha256 of every file" if rep.verify == "content" else "names and sizes only (content not compared)"
    for t in rep.targets:
        c, m, diffs = rep.copies.get(t), rep.manifests.get(t), rep.differences.get(t, [])
        sent = "" if c is None else ("nothing sent" if not c.bytes_sent else f"{c.bytes_sent} bytes sent in {c.seconds:.1f} s")
        if c is not None and c.errors:
            checks.append(CheckResult(t, "sync", FAIL, "copy failed: " + "; ".join(c.errors), sent,
                                      rep.hint or "run sync-model again: finished files are not sent again"))
        elif m is None or src is None or m.error or src.error:
            why = (m.error if m else None) or (src.error if src else None) or "no manifest"
            checks.append(CheckResult(t, "sync", FAIL, f"not compared with {src_name}: {why}", sent,
                                      "fix SSH or python3 on the host, then inv sync-model again"))
        elif diffs:
            shown = "; ".join(str(d) for d in diffs[:5]) + (f"; ... {len(diffs) - 5} more" if len(diffs) > 5 else "")
            checks.append(CheckResult(t, "sync", FAIL, f"{len(diffs)} difference(s) from {src_name}: {shown}", sent,
                                      "inv sync-model --repair re-sends exactly those files"))
        else:
            fixed = rep.repaired.get(t)
            checks.append(CheckResult(t, "sync", PASS, f"{len(m.files)} files equal to {src_name} by {how}",
                                      sent + (f"; repaired {len(fixed)}" if fixed else "")))
    for k in rep.staged:
        checks += staged_checks(k, src_name, rep.targets)
    return Report(checks, data)


def staged_checks(k: StagedSync, source: str, targets: list[str]) -> list[CheckResult]:
    """A `staged` check on the source (what staging said) and on each target (its folder equal to the source's by
    content)."""
    if k.staged.error:
        return [CheckResult(source, "staged", FAIL, f"{k.what} in {k.path}: {k.staged.error}", "",
                            "the source stages them from vllm_kernels_index with the image's own pip: give it that "
                            "index (or a mirror: a URL, or a host folder laid out as an index), then inv sync-model")]
    out = [CheckResult(source, "staged", PASS, f"{k.path}: {k.staged.line}", f"{k.files} file(s)")]
    for t in targets:
        c, problems = k.copies.get(t), k.problems(t)
        if problems:
            out.append(CheckResult(t, "staged", FAIL, f"{k.path} is not {source}'s: {'; '.join(problems[:5])}", "",
                                   "run inv sync-model again: what differs is sent again"))
        else:
            sent = f"{c.bytes_sent} bytes sent" if c and c.bytes_sent else "nothing sent"
            out.append(CheckResult(t, "staged", PASS, f"{k.path}: {k.files} file(s) equal to {source}'s by sha256",
                                   sent))
    return out
