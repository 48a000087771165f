"""`inv env`, `inv launch`, `inv stop`, `inv start`, `inv status`, `inv logs`.

env: facts from every host (GPU UUID by name, RoCE v2 GID index, $HOME) + inventory ->
one env file per rank from roles/vllm/templates/rank.env.j2, kept under env/ and written
0600 to each host atomically, only when it changed.

launch: the env files current, one image digest on every rank, the checkpoint present ->
one `docker run` per rank from roles/vllm/templates/docker-run.j2, in rank order (workers
first by default), each gated (container running, process up), then the head's log
followed until `Application startup complete` and /health answers. A label carries a hash
of the command, so the same configuration is a no-op and another one needs --recreate.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path

from jinja2 import Environment, FileSystemLoader, StrictUndefined

from . import facts as F
from .errors import RailyardError, UsageError
from .inventory import ROLES_DIR, Host, Inventory, check_parallelism
from .preflight import gids_section, gpus_section
from .probe import Section, joined_script, new_token, split_output
from .runner import Runner
from .transport import RemotePath, Session, Sh, cmd, q

TEMPLATES = ROLES_DIR / "vllm" / "templates"
LOCAL_ENV_DIR = "env"
READY_LINE = "Application startup complete"


class LaunchError(RailyardError):
    """A launch-time refusal with its fix."""


def _jinja() -> Environment:
    env = Environment(loader=FileSystemLoader(str(TEMPLATES)), undefined=StrictUndefined, keep_trailing_newline=True,
                      autoescape=False)
    env.filters["q"] = lambda v: q(v if isinstance(v, str) else json.dumps(v) if isinstance(v, (dict, list)) else str(v))
    return env


# ---------------------------------------------------------------- facts

@dataclass
class RankFacts:
    host: Host
    home: str | None = None
    gpu_uuid: str | None = None
    gid_index: int | None = None
    problems: list[str] = field(default_factory=list)


def gather_facts(runner: Runner, hosts: list[Host]) -> dict[str, RankFacts]:
    """$HOME, the selected GPU's UUID and the rail's RoCE v2 GID index, one round trip per host."""
    def one(s: Session) -> RankFacts:
        h = s.host
        f = RankFacts(h)
        sections = [Section("home", Sh('printf "%s\\n" "$HOME"')), gpus_section(), gids_section(h.serve_rail.hca)]
        token = new_token()
        r = s.run(joined_script(sections, token), timeout=60)
        if r.error:
            f.problems.append(f"{h.name}: {r.error.kind}: {r.error.message} (fix: {r.error.hint})")
            return f
        out = split_output(r.stdout, sections, token)
        f.home = out["home"].text.strip() or None
        sel = h.vars["cluster_gpu_name"]
        if out["gpus"].missing_tool:
            f.problems.append(f"{h.name}: GPU_UUID: nvidia-smi not found (fix: install the NVIDIA driver utilities)")
        else:
            try:
                chosen = F.select_gpu(F.parse_gpus(out["gpus"].text), sel) if out["gpus"].ok else []
            except F.ParseError:
                chosen = []
            if not chosen:
                f.problems.append(f"{h.name}: GPU_UUID: no GPU matches {sel!r} (fix: check cluster_gpu_name against "
                                  "`nvidia-smi -L`)")
            else:
                f.gpu_uuid = chosen[0].uuid
        rail = h.serve_rail
        if out["gids"].missing_tool:
            f.problems.append(f"{h.name}: GID_INDEX: show_gids not found (fix: install DOCA-Host / MLNX_OFED tools)")
        else:
            f.gid_index = F.roce_v2_index(F.parse_show_gids(out["gids"].text), rail.hca, rail.ip)
            if f.gid_index is None:
                f.problems.append(f"{h.name}: GID_INDEX: no RoCE v2 GID for {rail.ip} on {rail.hca} (fix: put "
                                  f"{rail.ipv4} on {rail.name}; `inv preflight` shows the gid check)")
        return f
    got = runner.each(one, hosts)
    out = {}
    for name, f in got.items():
        if not isinstance(f, RankFacts):
            f = RankFacts(runner.session(name).host, problems=[f"{name}: {f.error}"])
        out[name] = f
    return out


def on_host(path: str, home: str | None) -> str:
    """A `~/...` path of the inventory as the absolute path on a host whose $HOME is home."""
    return (home or "~").rstrip("/") + path[1:] if path.startswith("~/") else path


# ---------------------------------------------------------------- env

def env_values(inv: Inventory, f: RankFacts) -> dict:
    h = f.host
    v = h.vars
    head_ip = inv.head.serve_rail.ip
    workers = [w.serve_rail.ip for w in inv.workers]
    peers = [p.serve_rail.ip for p in inv.hosts if p.name != h.name]
    return {
        "host": h.name, "rank": h.rank, "nnodes": len(inv.hosts), "head_ip": head_ip, "worker_ips": workers,
        "node_ip": h.serve_rail.ip, "peer_ip": peers[0] if len(peers) == 1 else None,
        "rail_iface": h.serve_rail.name, "rail_hca": h.serve_rail.hca, "gpu_uuid": f.gpu_uuid,
        "gid_index": f.gid_index, "image": v["vllm_image"], "model_repo": v["model_repo"],
        "model_revision": v["model_revision"], "model_host": on_host(v["model_path"], f.home),
        "container": v["vllm_container"], "port": v["vllm_port"], "master_port": v["vllm_master_port"],
        "bind": v["vllm_bind"],
    }


def render_env(inv: Inventory, f: RankFacts) -> str:
    return _jinja().get_template("rank.env.j2").render(**env_values(inv, f))


@dataclass
class EnvFile:
    host: str
    path: str  # on the host
    rendered: str
    current: str | None  # what the host has (None: missing)

    @property
    def changed(self) -> bool:
        return self.current != self.rendered

    def diff(self) -> str:
        old = (self.current or "").splitlines(keepends=True)
        return "".join(difflib.unified_diff(old, self.rendered.splitlines(keepends=True),
                                            f"{self.host}:{self.path}" if self.current is not None else "/dev/null",
                                            f"{self.host}:{self.path} (rendered)"))


def _read_remote(s: Session, path: str) -> str | None:
    r = s.run(f"cat -- {q(RemotePath(path))} 2>/dev/null || echo @@railyard-missing", timeout=30)
    if r.error:
        raise LaunchError(f"{s.host.name}: {r.error.kind}: {r.error.message} (fix: {r.error.hint})")
    return None if r.stdout == "@@railyard-missing\n" else r.stdout


def _write_remote(s: Session, path: str, content: str, mode: str = "600") -> None:
    p = q(RemotePath(path))
    script = (f"set -e; umask 077; f={p}; mkdir -p \"$(dirname \"$f\")\"; t=\"$f.railyard.$$\"; cat > \"$t\"; "
              f"chmod {mode} \"$t\"; mv -f \"$t\" \"$f\"")
    r = s.run(script, stdin=content.encode(), timeout=30)
    if not r.ok:
        raise LaunchError(f"{s.host.name}: could not write {path}: {r.error or r.stderr.strip()}")


def plan_env(inv: Inventory, runner: Runner) -> tuple[dict[str, RankFacts], list[EnvFile]]:
    facts = gather_facts(runner, inv.hosts)
    problems = [p for f in facts.values() for p in f.problems]
    if problems:
        raise LaunchError("cannot render the env files:\n  " + "\n  ".join(problems))
    files = []
    for h in inv.hosts:
        path = h.vars["vllm_env_file"]
        files.append(EnvFile(h.name, path, render_env(inv, facts[h.name]), _read_remote(runner.session(h), path)))
    return facts, files


def write_local(files: list[EnvFile], local_dir: str | os.PathLike | None = None) -> list[Path]:
    d = Path(local_dir or os.environ.get("RAILYARD_ENV_DIR") or LOCAL_ENV_DIR)
    d.mkdir(parents=True, exist_ok=True)
    out = []
    for f in files:
        p = d / f"{f.host}.env"
        p.write_text(f.rendered)
        p.chmod(0o600)
        out.append(p)
    return out


def apply_env(runner: Runner, files: list[EnvFile]) -> list[str]:
    written = []
    for f in files:
        if f.changed:
            _write_remote(runner.session(f.host), f.path, f.rendered)
            written.append(f.host)
    return written


# ---------------------------------------------------------------- the docker run command

NCCL_ENV = (
    ("NCCL_CUMEM_ENABLE", "1"), ("NCCL_IB_HCA", "{rail_hca}"), ("NCCL_IB_GID_INDEX", "{gid_index}"),
    ("NCCL_IB_TIMEOUT", "22"), ("NCCL_IB_RETRY_CNT", "7"), ("VLLM_ALLREDUCE_USE_FLASHINFER", "0"),
    ("VLLM_ALLREDUCE_USE_SYMM_MEM", "0"), ("NCCL_SOCKET_IFNAME", "{rail_iface}"), ("GLOO_SOCKET_IFNAME", "{rail_iface}"),
    ("NCCL_NET_GDR_LEVEL", "5"), ("NCCL_DEBUG", "INFO"), ("NCCL_DEBUG_SUBSYS", "INIT,NET"),
    ("NCCL_DEBUG_FILE", "/tmp/nccl_%h_%p.log"), ("VLLM_HOST_IP", "{node_ip}"),
    ("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "1800"), ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"),
    ("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1"), ("FLASHINFER_DISABLE_VERSION_CHECK", "1"),
)


def serve_args(inv: Inventory, h: Host) -> list[str]:
    v = h.vars
    args = ["--served-model-name", v["model_repo"], "--host", v["vllm_bind"], "--port", v["vllm_port"],
            "--nnodes", len(inv.hosts), "--node-rank", h.rank, "--master-addr", inv.head.serve_rail.ip,
            "--master-port", v["vllm_master_port"], "--tensor-parallel-size", v["vllm_tensor_parallel_size"],
            "--speculative-config", json.dumps(v["vllm_speculative_config"], separators=(",", ":")),
            "--max-model-len", v["vllm_max_model_len"], "--max-num-batched-tokens", v["vllm_max_num_batched_tokens"],
            "--block-size", v["vllm_block_size"], "--max-num-seqs", v["vllm_max_num_seqs"],
            "--kv-cache-dtype", v["vllm_kv_cache_dtype"], "--gpu-memory-utilization", v["vllm_gpu_memory_utilization"],
            "--kernel-config", json.dumps(v["vllm_kernel_config"], separators=(",", ":")),
            "--compilation-config", json.dumps(v["vllm_compilation_config"], separators=(",", ":")),
            "--distributed-timeout-seconds", v["vllm_distributed_timeout_seconds"],
            "--tool-call-parser", v["vllm_tool_call_parser"], "--reasoning-parser", v["vllm_reasoning_parser"]]
    args += list(v["vllm_flags"]) + list(v["vllm_extra_args"])
    if not h.is_head:
        args.append("--headless")
    return [str(a) for a in args]


def container_context(inv: Inventory, f: RankFacts, drop_env: tuple[str, ...] = ()) -> dict:
    """The values every container of a rank is rendered with (container-flags.j2)."""
    h = f.host
    vals = env_values(inv, f)
    environment = {k: tpl.format(**vals) for k, tpl in NCCL_ENV if k not in drop_env}
    environment.update({k: str(v) for k, v in h.vars["vllm_extra_env"].items()})
    return dict(vals, environment=environment, is_head=h.is_head, shm_size=h.vars["vllm_shm_size"],
                api_key_file=on_host(h.vars["vllm_api_key_file"], f.home))


def render_command(template: str, ctx: dict) -> str:
    return _jinja().get_template(template).render(**ctx).replace("\n", "")


def run_command(inv: Inventory, f: RankFacts) -> str:
    """The exact `docker run` for this rank; its label carries a hash of everything else in it."""
    entry = "; ".join(line for line in _jinja().get_template("entrypoint.sh.j2").render(
        serve_args=serve_args(inv, f.host)).splitlines() if line.strip())
    body = render_command("docker-run.j2", dict(container_context(inv, f), entrypoint=entry, config_hash="@@"))
    digest = hashlib.sha256(body.encode()).hexdigest()[:16]
    return body.replace(q("railyard.config=@@"), q(f"railyard.config={digest}"))


def config_hash(command: str) -> str:
    marker = "railyard.config="
    i = command.find(marker)
    return command[i + len(marker):i + len(marker) + 16] if i >= 0 else ""


# ---------------------------------------------------------------- containers

@dataclass
class Container:
    host: str
    exists: bool
    running: bool = False
    status: str = "missing"
    config: str = ""
    started: str = ""
    image: str = ""
    exit_code: int = 0
    pid: int = 0


def inspect(s: Session, name: str) -> Container:
    r = s.run(cmd("docker", "inspect", "--format", "{{json .}}", name), timeout=30)
    if r.error:
        raise LaunchError(f"{s.host.name}: {r.error.kind}: {r.error.message}")
    if r.rc != 0:
        if "No such" in r.stderr:
            return Container(s.host.name, False)
        raise LaunchError(f"{s.host.name}: docker inspect failed: {r.stderr.strip() or r.stdout.strip()}")
    try:
        doc = json.loads(r.stdout.strip().splitlines()[0])
        st = doc["State"]
    except (ValueError, IndexError, KeyError, TypeError):
        raise LaunchError(f"{s.host.name}: unexpected `docker inspect` output: {r.stdout.strip()[:200]}") from None
    labels = (doc.get("Config") or {}).get("Labels") or {}
    return Container(s.host.name, True, bool(st.get("Running")), st.get("Status", "?"),
                     labels.get("railyard.config", ""), st.get("StartedAt", ""), doc.get("Image", ""),
                     int(st.get("ExitCode") or 0), int(st.get("Pid") or 0))


def log_tail(s: Session, name: str, lines: int = 20) -> str:
    r = s.run(cmd("docker", "logs", "--tail", lines, name) + " 2>&1", timeout=30)
    return r.stdout if not r.error else f"({r.error.message})"


def ensure_api_key(s: Session, path: str) -> bool:
    """Create the API key on the head (0600) unless it exists. Returns True when it was created."""
    p = q(RemotePath(path))
    r = s.run(f"test -s {p}", timeout=30)
    if r.ok:
        return False
    _write_remote(s, path, secrets.token_urlsafe(32) + "\n")
    return True


@dataclass
class RankState:
    host: str
    rank: int
    phase: str = "waiting"
    detail: str = ""


@dataclass
class LaunchReport:
    order: list[str]
    commands: dict[str, str] = field(default_factory=dict)
    started: list[str] = field(default_factory=list)
    noop: bool = False
    failed_rank: str | None = None
    failure: str | None = None
    hint: str = ""
    logs: dict[str, str] = field(default_factory=dict)
    rolled_back: list[str] = field(default_factory=list)
    ready_seconds: float | None = None
    api: str = ""

    @property
    def ok(self) -> bool:
        return self.failure is None


def _prechecks(inv: Inventory, runner: Runner, files: list[EnvFile]) -> None:
    stale = [f.host for f in files if f.changed]
    if stale:
        raise LaunchError(f"the env files are not current on {', '.join(stale)}: run `inv env` (see `inv env --check`)")
    image = inv.head.vars["vllm_image"]

    def look(s: Session):
        r = s.run(cmd("docker", "image", "inspect", image), timeout=60)
        try:
            imgs = F.parse_image_inspect(r.stdout) if not r.error else []
        except F.ParseError:
            imgs = []
        m = s.run(f"test -f {q(RemotePath(s.host.vars['model_path'] + '/config.json'))}", timeout=30)
        return (imgs[0].id if imgs else None), m.ok

    got = runner.each(look)
    missing_img = [n for n, (i, _) in got.items() if not i]
    if missing_img:
        raise LaunchError(f"the pinned image is not on {', '.join(missing_img)}: docker pull {image} there "
                          "(`inv preflight` checks it)")
    ids = {i for i, _ in got.values()}
    if len(ids) > 1:
        raise LaunchError("the image id differs between ranks: " +
                          ", ".join(f"{n}={i[:19]}" for n, (i, _) in got.items()) + f" (docker pull {image} everywhere)")
    no_model = [n for n, (_, ok) in got.items() if not ok]
    if no_model:
        raise LaunchError(f"no checkpoint (config.json) at {inv.head.vars['model_path']} on {', '.join(no_model)}: "
                          "run `inv sync-model`")


class _Status:
    """A live table of every rank while launch/start waits."""

    def __init__(self, console, states: list[RankState]):
        self.console = console
        self.states = states
        self.live = None

    def table(self):
        from rich.table import Table
        t = Table(title="launch", title_justify="left")
        for c in ("rank", "host", "phase", "detail"):
            t.add_column(c, overflow="fold")
        for s in self.states:
            style = {"ready": "green", "failed": "bold red", "running": "cyan"}.get(s.phase, "")
            t.add_row(str(s.rank), s.host, f"[{style}]{s.phase}[/]" if style else s.phase, s.detail[-100:])
        return t

    def __enter__(self):
        if self.console is not None:
            from rich.live import Live
            self.live = Live(self.table(), console=self.console, refresh_per_second=4, transient=False)
            self.live.start()
        return self

    def refresh(self):
        if self.live:
            self.live.update(self.table())

    def __exit__(self, *exc):
        if self.live:
            self.refresh()
            self.live.stop()
            self.console.print()


def _health(s: Session, h: Host) -> tuple[bool, str]:
    bind = h.vars["vllm_bind"]
    host = "127.0.0.1" if bind in ("0.0.0.0", "::") else bind
    url = f"http://{host}:{h.vars['vllm_port']}/health"
    r = s.run(cmd("curl", "-fsS", "-o", "/dev/null", "-w", "%{http_code}", "--max-time", "5", url), timeout=15)
    return (r.ok and r.stdout.strip() == "200"), (r.stdout.strip() or r.stderr.strip())


def wait_ready(inv: Inventory, runner: Runner, order: list[Host], started_at: float, timeout: float, console,
               launch_one=None) -> LaunchReport:
    """Start (via launch_one) and gate each rank in order, then wait for the head to serve."""
    rep = LaunchReport([h.name for h in order])
    name = inv.head.vars["vllm_container"]
    states = {h.name: RankState(h.name, h.rank) for h in order}
    deadline = started_at + timeout
    with _Status(console, list(states.values())) as status:
        for h in order:
            s = runner.session(h)
            st = states[h.name]
            if launch_one is not None:
                st.phase, st.detail = "starting", ""
                status.refresh()
                err = launch_one(h)
                if err:
                    st.phase, st.detail = "failed", err
                    rep.failed_rank, rep.failure = h.name, f"{h.name} (rank {h.rank}) did not start: {err}"
                    break
                rep.started.append(h.name)
            # gate: the container runs and its process stays up (a worker waits for the head: its ready state)
            up_since = None
            while True:
                c = inspect(s, name)
                if c.running and c.pid:
                    up_since = up_since or time.monotonic()
                    if time.monotonic() - up_since >= 1.5:
                        st.phase = "running"
                        st.detail = "waiting for the head" if not h.is_head else "waiting for the workers"
                        break
                elif c.exists and not c.running and c.status == "exited":
                    st.phase, st.detail = "failed", f"exited with code {c.exit_code}"
                    rep.failed_rank = h.name
                    rep.failure = f"{h.name} (rank {h.rank}): the container exited with code {c.exit_code}"
                    break
                if time.monotonic() > deadline:
                    st.phase, st.detail = "failed", "timed out starting"
                    rep.failed_rank, rep.failure = h.name, f"{h.name} (rank {h.rank}): not running after {timeout:.0f} s"
                    break
                time.sleep(0.3)
                status.refresh()
            status.refresh()
            if rep.failure:
                break
        if not rep.failure:
            head = inv.head
            hs = runner.session(head)
            states[head.name].phase = "loading"
            while True:
                for h in order:  # any rank that died fails the launch, named
                    c = inspect(runner.session(h), name)
                    if not c.running:
                        states[h.name].phase, states[h.name].detail = "failed", f"exited ({c.exit_code})"
                        rep.failed_rank = h.name
                        rep.failure = f"{h.name} (rank {h.rank}) exited with code {c.exit_code} while the head was starting"
                        break
                if rep.failure:
                    break
                tail = log_tail(hs, name, 40)
                last = [line for line in tail.splitlines() if line.strip()]
                states[head.name].detail = last[-1] if last else ""
                if READY_LINE in tail:
                    ok, why = _health(hs, head)
                    if ok:
                        for st in states.values():
                            st.phase = "ready"
                            st.detail = "joined the head" if st.host != head.name else st.detail
                        states[head.name].detail = f"/health 200 on {head.vars['vllm_bind']}:{head.vars['vllm_port']}"
                        rep.ready_seconds = time.monotonic() - started_at
                        rep.api = f"http://{head.vars['vllm_bind']}:{head.vars['vllm_port']}/v1"
                        break
                    states[head.name].detail = f"startup complete, /health not yet: {why}"
                if time.monotonic() > deadline:
                    rep.failed_rank = head.name
                    rep.failure = (f"{head.name} (rank 0): no `{READY_LINE}` and /health within {timeout:.0f} s")
                    states[head.name].phase = "failed"
                    break
                status.refresh()
                time.sleep(0.5)
    if rep.failure:
        rep.logs = {h.name: log_tail(runner.session(h), name, 20) for h in order}
        rep.hint = "read the logs above; `inv logs --rank HOST`; `inv preflight` for the hosts; --rollback stops what a failed launch started"
    return rep


def launch(inv: Inventory, rank_order: str | None, dry_run: bool, recreate: bool, timeout: float | None,
           rollback: bool, console) -> LaunchReport:
    order = inv.ordered(rank_order)
    check_parallelism(inv)
    name = inv.head.vars["vllm_container"]
    timeout = float(timeout or inv.head.vars["vllm_start_timeout_s"])
    with Runner(inv.hosts) as runner:
        facts, files = plan_env(inv, runner)
        commands = {h.name: run_command(inv, facts[h.name]) for h in order}
        if dry_run:
            rep = LaunchReport([h.name for h in order], commands)
            stale = [f.host for f in files if f.changed]
            if stale:
                rep.hint = f"note: the env files are not current on {', '.join(stale)} (run `inv env`)"
            return rep
        _prechecks(inv, runner, files)
        existing = {h.name: inspect(runner.session(h), name) for h in order}
        same = all(c.exists and c.running and c.config == config_hash(commands[n]) for n, c in existing.items())
        if same:
            rep = LaunchReport([h.name for h in order], commands, noop=True)
            return rep
        present = {n: c for n, c in existing.items() if c.exists}
        if present and not recreate:
            desc = ", ".join(f"{n}: {c.status}{'' if c.config == config_hash(commands[n]) else ', another configuration'}"
                             for n, c in present.items())
            raise LaunchError(f"container {name} already exists ({desc}): pass --recreate to replace it, or use "
                              "`inv start` to resume stopped containers")
        for n in sorted(present, key=lambda n: inv.host(n).rank):  # head first, as stop does
            runner.session(n).run(cmd("docker", "rm", "-f", name), timeout=120)
        ensure_api_key(runner.session(inv.head), inv.head.vars["vllm_api_key_file"])

        def launch_one(h: Host) -> str | None:
            r = runner.session(h).run(commands[h.name], timeout=300)
            if r.error:
                return f"{r.error.kind}: {r.error.message}"
            if r.rc != 0:
                return (r.stderr.strip() or r.stdout.strip()).splitlines()[-1] if (r.stderr or r.stdout) else f"exit {r.rc}"
            return None

        rep = wait_ready(inv, runner, order, time.monotonic(), timeout, console, launch_one)
        rep.commands = commands
        if rep.failure and rollback:
            rep.rolled_back = _stop_hosts(inv, runner, [h for h in inv.hosts if h.name in rep.started], remove=True)
        return rep


# ---------------------------------------------------------------- stop / start / status / logs

def _stop_hosts(inv: Inventory, runner: Runner, hosts: list[Host], remove: bool = False) -> list[str]:
    name = inv.head.vars["vllm_container"]
    done = []
    for h in sorted(hosts, key=lambda h: h.rank):  # the head first, then the workers
        s = runner.session(h)
        s.run(cmd("docker", "stop", "--timeout", "60", name), timeout=120)
        if remove:
            s.run(cmd("docker", "rm", "-f", name), timeout=60)
        done.append(h.name)
    return done


@dataclass
class StopResult:
    host: str
    status: str
    gpu_free: bool
    detail: str


def stop(inv: Inventory) -> list[StopResult]:
    name = inv.head.vars["vllm_container"]
    out = []
    with Runner(inv.hosts) as runner:
        facts = gather_facts(runner, inv.hosts)
        for h in sorted(inv.hosts, key=lambda h: h.rank):
            s = runner.session(h)
            c = inspect(s, name)
            if c.exists and c.running:
                r = s.run(cmd("docker", "stop", "--timeout", "60", name), timeout=120)
                if not r.ok:
                    out.append(StopResult(h.name, "error", False, (r.stderr or str(r.error)).strip()))
                    continue
            c = inspect(s, name)
            procs = gpu_usage(s, facts[h.name].gpu_uuid).processes
            detail = f"Status={c.status} Running={str(c.running).lower()}" if c.exists else "no container"
            if procs:
                detail += "; still on the GPU: " + ", ".join(f"pid {p.pid} {p.name} {p.used_mib} MiB" for p in procs)
            out.append(StopResult(h.name, c.status if c.exists else "missing", not procs, detail))
    return out


def start(inv: Inventory, rank_order: str | None, timeout: float | None, console) -> LaunchReport:
    order = inv.ordered(rank_order)
    name = inv.head.vars["vllm_container"]
    timeout = float(timeout or inv.head.vars["vllm_start_timeout_s"])
    with Runner(inv.hosts) as runner:
        existing = {h.name: inspect(runner.session(h), name) for h in order}
        missing = [n for n, c in existing.items() if not c.exists]
        if missing:
            raise LaunchError(f"no container {name} on {', '.join(missing)}: run `inv launch`")
        if all(c.running for c in existing.values()):
            return LaunchReport([h.name for h in order], noop=True)

        def start_one(h: Host) -> str | None:
            if existing[h.name].running:
                return None
            r = runner.session(h).run(cmd("docker", "start", name), timeout=120)
            return None if r.ok else (r.stderr.strip() or str(r.error))

        return wait_ready(inv, runner, order, time.monotonic(), timeout, console, start_one)


def status(inv: Inventory) -> list[dict]:
    name = inv.head.vars["vllm_container"]
    image = inv.head.vars["vllm_image"]
    with Runner(inv.hosts) as runner:
        facts = gather_facts(runner, inv.hosts)

        def one(s: Session) -> dict:
            h = s.host
            c = inspect(s, name)
            img = s.run(cmd("docker", "image", "inspect", "--format", "{{.Id}} {{json .RepoDigests}}", c.image or image),
                        timeout=30)
            digests = []
            if img.ok and img.stdout.strip():
                try:
                    digests = json.loads(img.stdout.split(" ", 1)[1])
                except (ValueError, IndexError):
                    digests = []
            g = gpu_usage(s, facts[h.name].gpu_uuid)
            used = {"used_mib": g.used_mib, "total_mib": g.total_mib} if g.used_mib is not None else None
            return {"host": h.name, "rank": h.rank, "container": name, "state": c.status if c.exists else "missing",
                    "running": c.running, "started_at": c.started if c.exists else None,
                    "uptime_s": _uptime(c.started) if c.running else None,
                    "image_id": c.image or None, "image_digests": digests,
                    "pinned_digest_ok": any(d.endswith(image.split("@", 1)[1]) for d in digests),
                    "config": c.config or None, "gpu_uuid": facts[h.name].gpu_uuid, "gpu_memory": used}

        got = runner.each(one)
        return [got[h.name] if isinstance(got[h.name], dict) else {"host": h.name, "rank": h.rank,
                                                                    "state": "unreachable",
                                                                    "error": str(got[h.name].error)}
                for h in inv.hosts]


@dataclass
class GpuUsage:
    used_mib: int | None
    total_mib: int | None
    processes: list  # facts.GpuProcess on this GPU


def gpu_usage(s: Session, uuid: str | None) -> GpuUsage:
    """Memory used on one GPU (by UUID) and the compute processes holding it, in one round trip."""
    sections = [gpus_section(), Section("apps", cmd("nvidia-smi", "--query-compute-apps=gpu_uuid,pid,process_name,"
                                                    "used_memory", "--format=csv,noheader,nounits"), "nvidia-smi")]
    token = new_token()
    r = s.run(joined_script(sections, token), timeout=60)
    if r.error:
        return GpuUsage(None, None, [])
    out = split_output(r.stdout, sections, token)
    try:
        gpu = next((g for g in F.parse_gpus(out["gpus"].text) if g.uuid == uuid), None) if out["gpus"].ok else None
        procs = [a for a in F.parse_compute_apps(out["apps"].text) if a.gpu_uuid == uuid] if out["apps"].ok else []
    except F.ParseError:
        gpu, procs = None, []
    return GpuUsage(gpu.memory_used_mib if gpu else None, gpu.memory_total_mib if gpu else None, procs)


def _uptime(stamp: str) -> float | None:
    try:
        t = time.mktime(time.strptime(stamp[:19], "%Y-%m-%dT%H:%M:%S")) - time.timezone
        return round(max(0.0, time.time() - t), 1)
    except (ValueError, TypeError):
        return None


def logs(inv: Inventory, rank: str, follow: bool, lines: int | None, write) -> int:
    host = _host_by_rank(inv, rank)
    name = inv.head.vars["vllm_container"]
    argv = ["docker", "logs"] + (["--tail", str(lines)] if lines else []) + (["--follow"] if follow else []) + [name]
    with Runner([host]) as runner:
        r = runner.session(host).run(cmd(*argv) + " 2>&1", timeout=10 ** 7 if follow else 60, on_output=write)
    if r.error:
        raise LaunchError(f"{host.name}: {r.error.kind}: {r.error.message}")
    return 0 if r.rc == 0 else 1


def _host_by_rank(inv: Inventory, rank: str) -> Host:
    if rank is None:
        raise UsageError("--rank: name a host (B) or a rank number (1)")
    if str(rank).isdigit():
        for h in inv.hosts:
            if h.rank == int(rank):
                return h
        raise UsageError(f"--rank {rank}: no such rank (0..{len(inv.hosts) - 1})")
    return inv.host(str(rank))
