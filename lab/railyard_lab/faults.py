"""Inject and heal faults on lab hosts: real where the lab allows it (MTU, link, address,
sshd, host key, disk, a live process), a state file the simulated tools read otherwise.

Each active fault is recorded in the host's `state/faults.json` so `heal` undoes exactly it.
"""

from __future__ import annotations

import json
import re
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from railyard.errors import UsageError
from . import (PERFTEST_TOOLS, SIM_TOOLS, LabError, LabHost, _pid_alive, hosts_of, in_host, lab_dir, lab_host,
               restart_sshd, session_env, sh, start_sshd, stop_sshd)


def _faults_file(h: LabHost) -> Path:
    return h.state / "faults.json"


def active(h: LabHost) -> dict[str, str]:
    try:
        return json.loads(_faults_file(h).read_text())
    except (OSError, ValueError):
        return {}


def _record(h: LabHost, kind: str, value: str | None) -> None:
    faults = active(h)
    if value is None:
        faults.pop(kind, None)
    else:
        faults[kind] = value
    _faults_file(h).write_text(json.dumps(faults))


def _write(h: LabHost, name: str, text: str) -> None:
    (h.state / name).write_text(text)


def _remove(h: LabHost, name: str) -> None:
    (h.state / name).unlink(missing_ok=True)


# ---------------------------------------------------------------- each fault: (inject, heal)

def _rail_ip(h: LabHost) -> str:
    return f"{h.rail_ip(h.serve_rail)}/24"


def _mtu(h, value):
    mtu = value or "1500"
    if not mtu.isdigit():
        raise UsageError(f"lab.fault mtu: {mtu!r} is not an MTU")
    in_host(h, "ip", "link", "set", h.serve_rail, "mtu", mtu)
    return mtu


def _mtu_heal(h, value):
    in_host(h, "ip", "link", "set", h.serve_rail, "mtu", "9000")


def _mtu_blackhole(h, value):
    """A switch on the path below the rails' MTU: the bridge port of this host's serving rail (its root-namespace
    veth end) drops every frame larger than N (default 1500) silently, both ways; both hosts keep MTU 9000."""
    mtu = value or "1500"
    if not mtu.isdigit():
        raise UsageError(f"lab.fault mtu-blackhole: {mtu!r} is not an MTU")
    subprocess.run(["ip", "link", "set", h.veth(h.serve_rail), "mtu", mtu], check=True)
    return mtu


def _mtu_blackhole_heal(h, value):
    subprocess.run(["ip", "link", "set", h.veth(h.serve_rail), "mtu", "9000"], check=False)


def _rail_loss(h, value):
    """A marginal optic or cable on the serving rail: the host drops every Nth frame over 1500 bytes that arrives
    on it (default 3), in the kernel (nftables), before ping or any program sees it. Large frames only, as bit errors
    hit them first: small frames still pass, so preflight reports loss, not a dead path. Each kind of frame has its
    own count (echo requests, echo replies, the rest: one numgen per rule), so the first large echo of each ping run
    is lost whatever else crosses the rail at the same time (an SSH session over it, a peer's own ping)."""
    n = value or "3"
    if not n.isdigit() or int(n) < 2:
        raise UsageError(f"lab.fault rail-loss: {n!r} is not N >= 2 (drop every Nth large frame)")
    drop = f"iifname {h.serve_rail} meta length > 1500"
    rules = (f"table inet railyard_lab_loss {{ chain input {{ type filter hook input priority 0; "
             f"{drop} icmp type echo-request numgen inc mod {n} == 0 counter drop; "
             f"{drop} icmp type echo-reply numgen inc mod {n} == 0 counter drop; "
             f"{drop} meta l4proto != icmp numgen inc mod {n} == 0 counter drop; }}; }}")
    in_host(h, "nft", "-f", "-", input=rules)
    return n


def _rail_loss_heal(h, value):
    in_host(h, "nft", "delete", "table", "inet", "railyard_lab_loss", check=False)


def _port_block(h, value):
    """A host firewall on the serving rail: the host drops every TCP connection to PORT that arrives on it (nftables,
    in the kernel: the SYN gets no answer, as with a DROP rule). ICMP, SSH and every other port still pass."""
    port = value or "29501"
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"lab.fault port-block: {port!r} is not a TCP port")
    in_host(h, "nft", "-f", "-", input=f"table inet railyard_lab_ports {{ chain input {{ type filter hook input "
                                         f"priority 0; iifname {h.serve_rail} tcp dport {port} counter drop; }}; }}")
    return port


def _port_block_heal(h, value):
    in_host(h, "nft", "delete", "table", "inet", "railyard_lab_ports", check=False)


VETH_MBIT = 10000   # a lab rail's line rate (a veth: `ethtool` reports 10000Mb/s)


def _rail_slow_target(h: LabHost, value: str | None) -> tuple[str, float]:
    rail, _, frac = (value or "").rpartition(":") if ":" in (value or "") else ("", "", value or "0.4")
    rail = rail or h.serve_rail
    if rail not in [name for name, _, _ in h.rails]:
        raise UsageError(f"lab.fault rail-slow: {h.name} has no rail {rail!r} (one of "
                         f"{', '.join(name for name, _, _ in h.rails)})")
    try:
        fraction = float(frac or "0.4")
    except ValueError:
        fraction = -1.0
    if not 0 < fraction < 1:
        raise UsageError(f"lab.fault rail-slow: {value!r}: FRACTION or RAIL:FRACTION, 0 < FRACTION < 1")
    return rail, fraction


def _rail_slow(h, value):
    """A rail that links up at its rate and moves a fraction of it (a bad cable, a PCIe link trained down): a real
    token-bucket qdisc on the rail netdev in the host's namespace at FRACTION of the veth's 10000 Mbit/s (default
    0.4, the serving rail; RAIL:FRACTION for another). Every TCP flow over that rail is throttled for real; the
    perftest stand-in reads the qdisc (`tc -j qdisc show dev RAIL`) and scales that rail's figures, on this host's
    end only. ibstat and sysfs keep the negotiated rate."""
    rail, fraction = _rail_slow_target(h, value)
    mbit = max(1, int(VETH_MBIT * fraction))
    in_host(h, "tc", "qdisc", "replace", "dev", rail, "root", "tbf", "rate", f"{mbit}mbit", "burst", "1mb",
            "latency", "50ms")
    return f"{rail}:{fraction:g}"


def _rail_slow_heal(h, value):
    rail = (value or "").rpartition(":")[0] or h.serve_rail
    in_host(h, "tc", "qdisc", "del", "dev", rail, "root", check=False)


def _link_down(h, value):
    in_host(h, "ip", "link", "set", h.serve_rail, "down")
    return "down"


def _link_heal(h, value):
    in_host(h, "ip", "link", "set", h.serve_rail, "up")


def _mgmt_down(h, value):
    """The management link goes away under open SSH sessions: no RST, their packets just stop."""
    in_host(h, "ip", "link", "set", "mgmt0", "down")
    return "down"


def _mgmt_heal(h, value):
    in_host(h, "ip", "link", "set", "mgmt0", "up")


def _no_ip(h, value):
    in_host(h, "ip", "addr", "flush", "dev", h.serve_rail)
    return _rail_ip(h)


def _no_ip_heal(h, value):
    have = in_host(h, "ip", "-br", "-4", "addr", "show", "dev", h.serve_rail).stdout
    if _rail_ip(h) not in have:
        in_host(h, "ip", "addr", "add", _rail_ip(h), "dev", h.serve_rail)


def _gid_index(h, value):
    v = value or "5"
    if v != "none" and not (v.isdigit() and int(v) >= 3 and int(v) % 2 == 1):
        raise UsageError(f"lab.fault gid-index: {v!r}: an odd index >= 3 (where the IPv4 RoCE v2 GID lands), or none")
    _write(h, "gid-index", v)
    return v


def _state_heal(name):
    return lambda h, value: _remove(h, name)


def _ntp(h, value):
    _write(h, "ntp", "no")
    return "no"


def _clock_skew(h, value):
    secs = value or "30"
    try:
        float(secs)
    except ValueError:
        raise UsageError(f"lab.fault clock-skew: {secs!r} is not a number of seconds")
    _write(h, "clock-skew", f"{'+' if not secs.startswith('-') else ''}{secs}")
    restart_sshd(h)  # sessions pick the shifted clock up from sshd's SetEnv
    return secs


def _clock_heal(h, value):
    _remove(h, "clock-skew")
    restart_sshd(h)


def _shape(h: LabHost) -> dict:
    try:
        return json.loads(h.shape_file.read_text())
    except (OSError, ValueError):
        raise LabError(f"lab: host {h.name} has no shape file: run `inv lab.up`")


def _compute_gpus(h: LabHost) -> list[int]:
    """Indices (as nvidia-smi numbers them) of the host's compute GPUs, never a display GPU."""
    return [i for i, g in enumerate(_shape(h)["gpus"]) if not g["display"]]


def _gpu_busy(h, value):
    """MIB (on the host's first compute GPU: the GB300 of a station, GPU 0 of an hgx8) or MIB@INDEX."""
    mib_s, _, idx_s = (value or "8710").partition("@")
    targets = _compute_gpus(h)
    if not mib_s.isdigit() or (idx_s and not (idx_s.isdigit() and int(idx_s) in targets)):
        raise UsageError(f"lab.fault gpu-busy: {value!r}: MIB or MIB@INDEX, INDEX one of "
                         f"{', '.join(map(str, targets))} (nvidia-smi's numbering)")
    mib = int(mib_s)
    index = int(idx_s) if idx_s else targets[0]
    p = subprocess.Popen(["nsenter", "-t", str(_anchor(h)), "-n", "-m", "-u", "--", "/usr/bin/python3", "-c",
                          "import time\nwhile True: time.sleep(3600)"],
                         start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    # without -p, nsenter execs the command itself: p.pid is the python process
    _write(h, "gpu-busy", json.dumps({"pid": p.pid, "name": "python3", "mib": mib, "index": index}))
    return f"{mib}@{index}" if idx_s else str(mib)


def _gpu_busy_heal(h, value):
    kill_recorded(h, "gpu-busy")


# the faults that leave a process of their own running, its pid in the host's state file of that name
RECORDED_PROCESSES = ("gpu-busy", "engine-crash")


def kill_recorded(h: LabHost, name: str) -> None:
    """End the process a fault started (gpu-busy's GPU holder, engine-crash's watcher) and forget it."""
    try:
        info = json.loads((h.state / name).read_text())
    except (OSError, ValueError):
        return
    pid = info.get("pid")
    if _pid_alive(pid):
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)  # when we started it in this process: reap it, no zombie left
        except (ProcessLookupError, ChildProcessError):
            pass
    _remove(h, name)


def _container_of(pid: str) -> str:
    """The lab container directory a process runs in: its RAILYARD_LAB_CONTAINER, or its nearest ancestor's
    (vLLM's process titles overwrite the environment a `ps` reads of its engine core and workers)."""
    for _ in range(16):
        try:
            env = dict(e.split(b"=", 1) for e in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in e)
            if b"RAILYARD_LAB_CONTAINER" in env:
                return env[b"RAILYARD_LAB_CONTAINER"].decode()
            pid = re.search(r"^PPid:\s+(\d+)", Path(f"/proc/{pid}/status").read_text(), re.M).group(1)
        except (OSError, AttributeError):
            return ""
    return ""


def _engine_processes(h: LabHost, service: str | None, every: bool = False) -> list[int]:
    """The engine cores and workers (vLLM's `VLLM::` process titles) of the host's containers, or of its
    container SERVICE (its name, or its name's last part: `r1` for vllm-replicas-r1); never an API server.
    every: every process of those containers (the API server, the container's own first process)."""
    containers = str(h.dir / "docker" / "containers") + "/"
    pids = []
    for d in Path("/proc").iterdir():
        try:
            if not d.name.isdigit() or not (every or (d / "comm").read_text().startswith("VLLM::")):
                continue
        except OSError:
            continue
        where = _container_of(d.name)
        if not where.startswith(containers):
            continue
        name = where[len(containers):]
        if service is None or name == service or name.endswith("-" + service):
            pids.append(int(d.name))
    return pids


def _engine_hang(h, value):
    pids = _engine_processes(h, value)
    if not pids:
        raise UsageError(f"lab.fault engine-hang: no engine process on {h.name}"
                         + (f" in a container named {value!r} or ending in -{value}" if value else ""))
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    _write(h, "engine-hang", json.dumps(pids))
    return value or "all"


def _engine_hang_heal(h, value):
    try:
        pids = json.loads((h.state / "engine-hang").read_text())
    except (OSError, ValueError):
        pids = []
    for pid in pids:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    _remove(h, "engine-hang")


# engine-stall: the signal the engines' processes park a rank on, and the one that lets it go (their handlers:
# sim/engine_site.py in the real engine, sim/vllm.py's spawn in the stand-in)
STALL_SIGNAL = signal.SIGUSR2
STALL_SETTLE_S = 1.2
RELEASE_SIGNAL = signal.SIGCONT
RANK_RE = re.compile(r"(?:DP|PP|TP|EP)\d+(?:_(?:DP|PP|TP|EP)\d+)*")


def _title_of(h: LabHost, pid: int) -> str:
    """A vLLM process's title: its command line (setproctitle), or the title the stand-in holds its GPU under
    (its command line is python's; /proc/PID/comm keeps 15 characters), or its comm."""
    try:
        first = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace").strip()
        if first.startswith("VLLM::"):
            return first
        for f in (h.dir / "gpu-held").glob(f"{pid}.*.json"):
            return json.loads(f.read_text())["name"]
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except (OSError, ValueError, KeyError):
        return ""


def _catches(pid: int, sig: int) -> bool:
    try:
        caught = re.search(r"^SigCgt:\s+([0-9a-f]+)", Path(f"/proc/{pid}/status").read_text(), re.M).group(1)
    except (OSError, AttributeError):
        return False
    return bool(int(caught, 16) >> (sig - 1) & 1)


def _stall_target(h: LabHost, value: str | None) -> tuple[int, str]:
    """The one engine rank engine-stall parks: VALUE is [SERVICE][:RANK]; SERVICE as engine-hang takes it,
    RANK the parts of a vLLM title (TP1, DP2, DP1_TP0): the worker whose title has them all, else that DP
    rank's engine core. No RANK: the highest-ranked worker of the first such container (by name), or its
    engine core where the engine has no workers (one GPU)."""
    service, _, rank = (value or "").rpartition(":") if ":" in (value or "") else (value or "", "", "")
    if not rank and service and RANK_RE.fullmatch(service):
        service, rank = "", service
    if rank and not RANK_RE.fullmatch(rank):
        raise UsageError(f"lab.fault engine-stall: {rank!r} is no rank (TP1, DP2, DP1_TP0 ...)")
    found = []
    for pid in _engine_processes(h, service or None):
        title = _title_of(h, pid)
        kind, _, parts = title.removeprefix("VLLM::").partition("_")
        if kind not in ("Worker", "EngineCore") or (rank and not set(rank.split("_")) <= set(parts.split("_"))):
            continue
        found.append((_container_of(str(pid)), kind != "Worker", [-int(x) for x in re.findall(r"\d+", parts)],
                      pid, title))
    if not found:
        raise UsageError(f"lab.fault engine-stall: no engine worker on {h.name}"
                         + (f" in a container named {service!r} or ending in -{service}" if service else "")
                         + (f" with {rank} in its title" if rank else ""))
    first = min(f[0] for f in found)
    _, _, _, pid, title = min(f for f in found if f[0] == first)
    return pid, title


def _engine_stall(h, value):
    """Park one engine rank (STALL_SIGNAL to it): it stops joining its group's collectives while every process
    keeps running; its peers and its engine core wait for it for real."""
    pid, title = _stall_target(h, value)
    if not _catches(pid, STALL_SIGNAL):  # the default action would kill it: a lab made before engine-stall
        raise UsageError(f"lab.fault engine-stall: {title} (pid {pid}) on {h.name} has no stall handler: the "
                         "lab's engine image predates it (run `inv lab.up` again, then launch)")
    os.kill(pid, STALL_SIGNAL)
    _write(h, "engine-stall", json.dumps({"pid": pid, "start": _start_of(pid), "title": title}))
    # in effect when this returns: the real engine parks at once; the stand-in's headless node tells its head within
    # its 0.5 s watch (sim/vllm.py, watch_own_stall), and a request sent before that would still be answered
    time.sleep(STALL_SETTLE_S)
    return f"{title} (pid {pid})"


def _start_of(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _engine_stall_heal(h, value):
    try:
        info = json.loads((h.state / "engine-stall").read_text())
    except (OSError, ValueError):
        info = {}
    pid = info.get("pid")
    if pid and _start_of(pid) == info.get("start"):  # the same process, still there: let it go on
        try:
            os.kill(pid, RELEASE_SIGNAL)
        except ProcessLookupError:
            pass
    _remove(h, "engine-stall")


def _engine_crash(h, value):
    """A crash loop: a watcher kills (SIGKILL) every process of the host's engine containers, or of SERVICE's,
    whenever they appear, as the kernel's OOM killer or a segfault ends an engine: the container exits
    (137), on every start, until healed. The processes that run now are gone when it returns."""
    deadline = time.monotonic() + 10
    while _kill_containers(h, value) and time.monotonic() < deadline:
        time.sleep(0.2)
    p = subprocess.Popen([sys.executable, "-m", "railyard_lab.faults", str(h.root), h.name, value or ""],
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True)
    _write(h, "engine-crash", json.dumps({"pid": p.pid}))
    return value or "all"


def _engine_crash_heal(h, value):
    kill_recorded(h, "engine-crash")


def _kill_containers(h: LabHost, service: str | None) -> list[int]:
    """SIGKILL every process of the host's containers (or of SERVICE's); the pids it found."""
    pids = _engine_processes(h, service, every=True)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pids


def crash_loop(root: str, host: str, service: str) -> None:
    """engine-crash's watcher (python3 -m railyard_lab.faults ROOT HOST SERVICE): every 0.2 s, every process of
    the host's containers (or of SERVICE's) killed."""
    h = lab_host(Path(root), host)
    while True:
        _kill_containers(h, service or None)
        time.sleep(0.2)


READY = "Application startup complete"   # uvicorn's line: the engine's API serves
WRONG_SEED = 1          # the lab model's other seed: the same config and tokenizer, other weights
WEIGHTS = "model.safetensors"


def _docker(h: LabHost, *argv: str) -> subprocess.CompletedProcess:
    env = [f"{k}={v}" for k, v in session_env(h).items()]
    return in_host(h, "env", *env, "docker", *argv, check=False)


def _engine_containers(h: LabHost, service: str | None) -> list[tuple[str, str]]:
    """(name, the host directory it serves as /model) of the host's running containers that serve a checkpoint,
    or of container SERVICE (its name, or its name's last part)."""
    out = []
    for cfg_file in sorted((h.dir / "docker" / "containers").glob("*/config.json")):
        name = cfg_file.parent.name
        if service is not None and name != service and not name.endswith("-" + service):
            continue
        binds = json.loads(cfg_file.read_text())["HostConfig"]["Binds"]
        src = next((b.split(":")[0] for b in binds if b.split(":")[1] == "/model"), None)
        if src and _docker(h, "inspect", "--format", "{{.State.Running}}", name).stdout.strip() == "true":
            out.append((name, src))
    return out


def _wrong_weights(h, value):
    """The checkpoint each engine container (or SERVICE) serves gets the weights of another seed of the lab
    model on disk (the same config.json, tokenizer, names and sizes; the file's mtime kept, so a size or
    mtime manifest sees no change), and those containers are restarted (docker stop, start): they load it.
    Another engine that serves the same directory keeps the weights it loaded until it restarts."""
    from .components import model
    chosen = _engine_containers(h, value)
    if not chosen:
        raise UsageError(f"lab.fault wrong-weights: no running container serving /model on {h.name}"
                         + (f" named {value!r} or ending in -{value}" if value else ""))
    kept = {}
    for src in dict.fromkeys(src for _, src in chosen):
        weights = h.home / src.removeprefix("/root/") / WEIGHTS
        kind = "moe" if "num_experts" in (weights.parent / "config.json").read_text() else "dense"
        backup = h.state / f"wrong-weights.{len(kept)}"
        shutil.copy2(weights, backup)
        st = weights.stat()
        shutil.copyfile(model(kind, WRONG_SEED, log=lambda *_: None) / WEIGHTS, weights)
        os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
        kept[str(weights)] = str(backup)
    _write(h, "wrong-weights", json.dumps(kept))
    for name, _ in chosen:
        ready = _docker(h, "logs", name).stdout.count(READY)
        if _docker(h, "stop", name).returncode != 0 or _docker(h, "start", name).returncode != 0:
            _wrong_weights_heal(h, value)   # not recorded as active, so `heal` would not put the weights back
            raise LabError(f"lab.fault wrong-weights: could not restart {name} on {h.name}")
        deadline = time.monotonic() + 120   # serving again (on the other weights) when the fault returns
        while _docker(h, "logs", name).stdout.count(READY) <= ready and time.monotonic() < deadline:
            time.sleep(0.5)
    return value or "all"


def _wrong_weights_heal(h, value):
    """The checkpoint's own weights back on disk; what runs keeps the weights it loaded until it restarts."""
    try:
        kept = json.loads((h.state / "wrong-weights").read_text())
    except (OSError, ValueError):
        kept = {}
    for weights, backup in kept.items():
        shutil.copy2(backup, weights)
        Path(backup).unlink()
    _remove(h, "wrong-weights")


def _state_choice(kind: str, choices: tuple[str, ...], meaning: str):
    """A fault that writes one of a few values into the host's state file `kind`."""
    def inject(h, value):
        v = value or choices[0]
        if v not in choices:
            raise UsageError(f"lab.fault {kind}: {v!r}: {meaning}")
        _write(h, kind, v)
        return v
    return inject


def _no_gpu(h, value):
    """gb300: the compute GPUs are gone (a station keeps its display GPU); all: every GPU; N: GPU N fell
    off the bus (the others are numbered again, as nvidia-smi does)."""
    v = value or "gb300"
    if v not in ("gb300", "all") and not (v.isdigit() and int(v) < len(_shape(h)["gpus"])):
        raise UsageError(f"lab.fault no-gpu: {v!r}: gb300 (only the display GPU left), all, or a GPU index")
    _write(h, "no-gpu", v)
    return v


def _disk_full(h, value):
    mb = value or "64"
    if not mb.isdigit():
        raise UsageError(f"lab.fault disk-full: {mb!r} is not a size in MB")
    in_host(h, "mkdir", "-p", "/root/models")
    in_host(h, "mount", "-t", "tmpfs", "-o", f"size={mb}m", "railyard-lab-small", "/root/models")
    return mb


def _disk_heal(h, value):
    in_host(h, "umount", "/root/models", check=False)


def _sshd_down(h, value):
    stop_sshd(h)
    return "stopped"


def _sshd_heal(h, value):
    start_sshd(h)


def _host_key_changed(h, value):
    orig = h.host_key.with_name(h.host_key.name + ".orig")
    if not orig.exists():
        h.host_key.rename(orig)
        h.host_key.with_suffix(".pub").rename(orig.with_name(orig.name + ".pub"))
    else:
        h.host_key.unlink(missing_ok=True)
        h.host_key.with_suffix(".pub").unlink(missing_ok=True)
    sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"host-{h.name}-new", "-f", str(h.host_key))
    restart_sshd(h)
    return "new key"


def _host_key_heal(h, value):
    orig = h.host_key.with_name(h.host_key.name + ".orig")
    if orig.exists():
        orig.replace(h.host_key)
        orig.with_name(orig.name + ".pub").replace(h.host_key.with_suffix(".pub"))
        restart_sshd(h)


def _missing_tool(h, value):
    tool = value or "ibdev2netdev"
    if tool not in SIM_TOOLS + PERFTEST_TOOLS:
        raise UsageError(f"lab.fault missing-tool: {tool!r}: one of {', '.join(SIM_TOOLS + PERFTEST_TOOLS)}")
    (h.bin / tool).unlink(missing_ok=True)
    gone = set(json.loads(_read(h, "missing-tools.json") or "[]")) | {tool}
    _write(h, "missing-tools.json", json.dumps(sorted(gone)))
    return tool


def _missing_tool_heal(h, value):
    gone = json.loads(_read(h, "missing-tools.json") or "[]")
    for tool in gone:
        link = h.bin / tool
        if not link.is_symlink():
            link.symlink_to(h.root / "sim" / ("perftest.py" if tool in PERFTEST_TOOLS else "tools.py"))
    _remove(h, "missing-tools.json")


def _read(h: LabHost, name: str) -> str | None:
    try:
        return (h.state / name).read_text()
    except OSError:
        return None


def _image_mismatch(h, value):
    images_file = h.dir / "docker" / "images.json"
    images = json.loads(images_file.read_text())
    backup = h.dir / "docker" / "images.json.orig"
    if not backup.exists():
        backup.write_text(json.dumps(images))
    import hashlib
    other = "sha256:" + hashlib.sha256(f"another build {h.name}".encode()).hexdigest()
    images_file.write_text(json.dumps({name: other for name in images}))
    return other


def _image_heal(h, value):
    backup = h.dir / "docker" / "images.json.orig"
    if backup.exists():
        backup.replace(h.dir / "docker" / "images.json")


def _flag(kind: str):
    def inject(h, value):
        _write(h, kind, "1")
        return "on"
    return inject


def _since(kind: str):
    def inject(h, value):
        import time
        _write(h, kind, f"{time.time():.3f}")
        return "on"
    return inject


def _number(kind: str, default: str):
    def inject(h, value):
        v = value or default
        if not v.isdigit():
            raise UsageError(f"lab.fault {kind}: {v!r} is not a whole number")
        _write(h, kind, v)
        return v
    return inject


def _version(kind: str, default: str):
    def inject(h, value):
        v = value or default
        if not re.fullmatch(r"\d+(\.\d+){1,3}", v):
            raise UsageError(f"lab.fault {kind}: {v!r} is not a version like {default}")
        _write(h, kind, v)
        return v
    return inject


# ---------------------------------------------------------------- host regressions (preflight: cma, nccl_conf,
# nccl_lib, gloo_iface)

def _cma_zero(h, value):
    """The linux-nvidia 7.0 kernels' KHO scratch area (NV-Kernels #591): /proc/meminfo reads `CmaTotal: 0 kB` with
    CmaFree MIB (default 9.5 GiB). The kernel's own file cannot be changed, so the host's mount namespace gets a copy
    of it with those two lines, bind-mounted over /proc/meminfo (as lxcfs shows a container its own)."""
    mib = value or "9728"
    if not mib.isdigit():
        raise UsageError(f"lab.fault cma-zero: {mib!r} is not a number of MiB (CmaFree)")
    _cma_heal(h, None)
    lines = [line for line in Path("/proc/meminfo").read_text().splitlines() if not line.startswith("Cma")]
    at = next((i for i, line in enumerate(lines) if line.startswith("HugePages_Total")), len(lines))
    lines[at:at] = [f"{'CmaTotal:':<16}{0:>8} kB", f"{'CmaFree:':<16}{int(mib) * 1024:>8} kB"]
    _write(h, "meminfo", "\n".join(lines) + "\n")
    in_host(h, "mount", "--bind", str(h.state / "meminfo"), "/proc/meminfo")
    return mib


def _cma_heal(h, value):
    while in_host(h, "umount", "/proc/meminfo", check=False).returncode == 0:
        pass
    _remove(h, "meminfo")


def _layer_file(h: LabHost, path: str) -> Path:
    """PATH in this host's copy of the lab's vLLM image (the docker stand-in overlays it in its containers)."""
    from . import LAB_IMAGE_NAME
    return h.dir / "docker" / "layers" / re.sub(r"[^A-Za-z0-9_.-]", "_", LAB_IMAGE_NAME) / path.lstrip("/")


NCCL_CONF_DEFAULT = "NCCL_IB_DISABLE=1;NCCL_SOCKET_IFNAME=eth0"


def _nccl_conf(h, value):
    """An /etc/nccl.conf in this host's image: VALUE's lines, `;` between them (default: TCP instead of RDMA, and
    an interface railyard's env overrides)."""
    text = value or NCCL_CONF_DEFAULT
    f = _layer_file(h, "/etc/nccl.conf")
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text("\n".join(text.split(";")) + "\n")
    return text


def _nccl_conf_heal(h, value):
    _layer_file(h, "/etc/nccl.conf").unlink(missing_ok=True)


def _nccl_lib_path(h: LabHost) -> str:
    return str(h.root / "sim" / "image" / "site" / "nvidia" / "nccl" / "lib" / "libnccl.so.2")


def _nccl_lib(h, value):
    """Another libnccl.so.2 build where this host's image keeps it (the one vLLM loads): NCCL VALUE (default
    2.27.3+cuda12.9), as a real build carries its version string."""
    v = value or "2.27.3+cuda12.9"
    if not re.fullmatch(r"\d+\.\d+\.\d+\S*", v):
        raise UsageError(f"lab.fault nccl-lib: {v!r} is not a build like 2.27.3+cuda12.9")
    f = _layer_file(h, _nccl_lib_path(h))
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_bytes(b"railyard lab stand-in for NCCL, another build\0NCCL version " + v.encode() + b"\0")
    return v


def _nccl_lib_heal(h, value):
    _layer_file(h, _nccl_lib_path(h)).unlink(missing_ok=True)


def _gloo_loopback(h, value):
    """Debian's installer line: the host's name at 127.0.1.1 in its /etc/hosts (written in place: it is
    bind-mounted over /etc/hosts in the host's mount namespace)."""
    from . import hosts_file_text
    with open(h.hosts_file, "w") as f:
        f.write(hosts_file_text(h, "127.0.1.1"))
    return "127.0.1.1"


def _gloo_loopback_heal(h, value):
    from . import hosts_file_text
    with open(h.hosts_file, "w") as f:
        f.write(hosts_file_text(h))


def _anchor(h: LabHost) -> int:
    from . import anchor_pid
    return anchor_pid(h)


FAULTS: dict[str, tuple[Callable, Callable, str]] = {
    "mtu": (_mtu, _mtu_heal, "set the serving rail's MTU (default 1500)"),
    "mtu-blackhole": (_mtu_blackhole, _mtu_blackhole_heal, "a switch port on the serving rail's path drops frames "
                      "above N bytes (default 1500); both ends keep MTU 9000"),
    "rail-loss": (_rail_loss, _rail_loss_heal, "drop every Nth frame over 1500 bytes arriving on the serving rail "
                  "(default 3; a marginal optic: small frames pass)"),
    "port-block": (_port_block, _port_block_heal, "a host firewall drops TCP to PORT arriving on the serving rail "
                   "(default 29501, the master port); ping and SSH still pass"),
    "link-down": (_link_down, _link_heal, "take the serving rail's link down"),
    "rail-slow": (_rail_slow, _rail_slow_heal, "throttle a rail to FRACTION of its rate (default 0.4 of the "
                  "serving rail; RAIL:FRACTION for another) with a real tc tbf qdisc: it links up at full rate, "
                  "perftest reads that rail lower on this host's end"),
    "perftest-down": (_flag("perftest-down"), _state_heal("perftest-down"), "the host's perftest server never "
                      "serves: it prints its banner, then fails to create its QP and exits at once"),
    "engine-hang": (_engine_hang, _engine_hang_heal, "stop (SIGSTOP) the engine processes of the host's containers, "
                    "or of container SERVICE: alive, holding their GPUs, their API still up, making no progress"),
    "engine-stall": (_engine_stall, _engine_stall_heal, "one engine rank of the host's containers, or of container "
                     "SERVICE, stops joining its collectives while every process keeps running (state S or R, "
                     "never T): --value [SERVICE][:RANK], RANK as in the worker's title (TP1, DP2); by default "
                     "the highest-ranked worker. Its peers wait in the collective, the engine core waits for it, "
                     "/health answers 200, requests stay running, the token counters stand still; heal lets it go "
                     "on (the group may stay wedged: recover restarts it)"),
    "engine-crash": (_engine_crash, _engine_crash_heal, "kill every process of the host's containers, or of "
                     "SERVICE's, whenever they appear: an engine that dies on every start (a crash loop)"),
    "wrong-weights": (_wrong_weights, _wrong_weights_heal, "the checkpoint of the host's engine containers, or of "
                      "container SERVICE, replaced on disk by another seed of the lab model (same config, tokenizer, "
                      "sizes and mtime), and those containers restarted: they serve, and answer otherwise; heal puts "
                      "the weights back on disk (a restart loads them)"),
    "mgmt-down": (_mgmt_down, _mgmt_heal, "take the management link down (SSH from the control machine stops answering)"),
    "no-ip": (_no_ip, _no_ip_heal, "remove the serving rail's IPv4 address"),
    "gid-index": (_gid_index, _state_heal("gid-index"), "move the RoCE v2 IPv4 GID to index N (odd, default 5), or none"),
    "ntp-unsynced": (_ntp, _state_heal("ntp"), "timedatectl reports the clock not synchronized"),
    "clock-skew": (_clock_skew, _clock_heal, "shift the host's clock by N seconds (default 30, libfaketime)"),
    "gpu-busy": (_gpu_busy, _gpu_busy_heal, "a live compute process holds N MiB on the GB300 (default 8710), "
                 "or on GPU I with N@I"),
    "no-gpu": (_no_gpu, _state_heal("no-gpu"), "the GB300 is gone (gb300), every GPU (all), or GPU N"),
    "disk-full": (_disk_full, _disk_heal, "put the model directory on a small tmpfs (default 64 MB)"),
    "sshd-down": (_sshd_down, _sshd_heal, "stop the host's sshd"),
    "host-key-changed": (_host_key_changed, _host_key_heal, "give the host a new SSH host key"),
    "missing-tool": (_missing_tool, _missing_tool_heal, "remove a tool from the host's PATH (default ibdev2netdev)"),
    "docker-down": (_state_choice("docker-down", ("stopped", "permission"), "stopped or permission"),
                    _state_heal("docker-down"), "the Docker daemon is unreachable (stopped or permission)"),
    "image-mismatch": (_image_mismatch, _image_heal, "the host holds another digest of the pinned image"),
    "gpu-ecc": (_number("gpu-ecc", "2"), _state_heal("gpu-ecc"), "N uncorrectable ECC errors (default 2) and a "
                "pending row remap on the compute GPU (nvidia-smi)"),
    "xid": (_number("xid", "79"), _state_heal("xid"), "an NVRM Xid N (default 79) for the compute GPU in the "
            "kernel log (dmesg)"),
    "no-peermem": (_flag("no-peermem"), _state_heal("no-peermem"), "nvidia_peermem is not loaded (lsmod)"),
    "no-uverbs": (_flag("no-uverbs"), _state_heal("no-uverbs"), "ib_uverbs is not loaded: the HCAs are in sysfs "
                  "(ibdev2netdev lists them), /dev/infiniband is not there (docker run --device refuses it)"),
    "acs-redirect": (_state_choice("acs-redirect", ("path", "off-path"), "path (the switch ports between the GPU "
                     "and the serving rail's NIC) or off-path (an NVMe drive's port on that switch)"),
                     _state_heal("acs-redirect"), "ACS ReqRedir/CmpltRedir on the PCIe switch ports between a GPU "
                     "and the serving rail's NIC (path, default) or on an unrelated port (off-path) (lspci -vvv)"),
    "no-ethtool-stats": (_flag("no-ethtool-stats"), _state_heal("no-ethtool-stats"), "`ethtool -S` on the serving "
                         "rail shows no error counters (the veth's own statistics): preflight reads sysfs"),
    "rail-errors": (_since("rail-errors"), _state_heal("rail-errors"), "the rail's symbol and CRC error counters "
                    "climb (ethtool -S), as with a bad optic"),
    "driver-mismatch": (_version("driver-mismatch", "570.195.03"), _state_heal("driver-mismatch"),
                        "the host reports another NVIDIA driver version (default 570.195.03)"),
    "cma-zero": (_cma_zero, _cma_heal, "/proc/meminfo reads CmaTotal 0 kB with CmaFree MIB (default 9728): the "
                 "KHO scratch area of the linux-nvidia 7.0 kernels"),
    "nccl-conf": (_nccl_conf, _nccl_conf_heal, "an /etc/nccl.conf in the host's image: VALUE's lines, ';' between "
                  f"them (default {NCCL_CONF_DEFAULT})"),
    "nccl-lib": (_nccl_lib, _nccl_lib_heal, "another libnccl.so.2 build in the host's image (default NCCL "
                 "2.27.3+cuda12.9)"),
    "gloo-loopback": (_gloo_loopback, _gloo_loopback_heal, "the host's name resolves to 127.0.1.1 (/etc/hosts)"),
}


def fault(host: str, kind: str, value: str | None = None, path: str | None = None) -> str:
    if kind not in FAULTS:
        raise UsageError(f"lab.fault: unknown fault {kind!r} (one of: {', '.join(FAULTS)})")
    h = lab_host(lab_dir(path), host)
    recorded = FAULTS[kind][0](h, value)
    _record(h, kind, recorded)
    return f"{host}: {kind} {recorded}"


def heal(host: str | None = None, path: str | None = None) -> list[str]:
    root = lab_dir(path)
    hosts = [lab_host(root, host)] if host else hosts_of(root)
    done = []
    for h in hosts:
        for kind, value in active(h).items():
            try:
                FAULTS[kind][1](h, value)
            except LabError:
                raise
            done.append(f"{h.name}: healed {kind}")
            _record(h, kind, None)
    return done


if __name__ == "__main__":
    crash_loop(*sys.argv[1:4])
