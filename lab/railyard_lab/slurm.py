"""A real Slurm cluster over the lab hosts (Debian's slurm-wlm and munge, run as root).

One `munged` on its own socket (a path every namespace reaches), `slurmctld` on this machine at the
lab's control address, and one `slurmd` inside each host's namespaces (network, mount, hostname)
with its management address and the GPU count of its shape. The GPUs are gres devices `mknod`ed
as character devices (aliases of /dev/null: Slurm refuses plain files and leaves count-only GPUs
INVAL). A TaskProlog gives each task its host's PATH and lab directory, as the host's sshd gives
an SSH session, so a job step on B runs B's docker, nvidia-smi and show_gids.

    env = up(root, hosts)     # SLURM_CONF for sbatch, srun, squeue, scancel; idle nodes
    down(root)                # every daemon stopped by its pid file, its files gone with the lab's
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from . import INSTANCE, LabError, _read_pid
from . import _pid_alive as _alive

# slurmctld listens on this machine (every address), slurmd in each host's namespace; the other lab
# instance's slurmctld takes the next ports
CTLD_PORT = 16817 + 10 * INSTANCE
SLURMD_PORT = 16818 + 10 * INSTANCE
STATE = "slurm"
CGROUPS = ("mountpoint -q /sys/fs/cgroup || { mount -t tmpfs -o mode=755 railyard-cgroup /sys/fs/cgroup && "
           "mkdir -p /sys/fs/cgroup/freezer /sys/fs/cgroup/systemd && "
           "mount -t cgroup -o freezer cgroup /sys/fs/cgroup/freezer && "
           "mount -t cgroup -o none,name=systemd cgroup /sys/fs/cgroup/systemd; }")


def slurm_dir(root: Path) -> Path:
    return root / STATE


def conf_path(root: Path) -> Path:
    return slurm_dir(root) / "slurm.conf"


def client_env(root: Path) -> dict[str, str]:
    return {"SLURM_CONF": str(conf_path(root))}


def _need() -> None:
    missing = [t for t in ("munged", "slurmctld", "slurmd", "sbatch") if shutil.which(t) is None
               and not Path("/usr/sbin", t).exists()]
    if missing:
        raise LabError(f"lab --slurm: {', '.join(missing)} not installed (fix: apt-get install slurm-wlm munge, "
                       "or bin/setup)")


def _run(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    r = subprocess.run(list(argv), capture_output=True, text=True, env=env, timeout=60)
    if r.returncode != 0:
        raise LabError(f"lab --slurm: {' '.join(argv[:3])}: {(r.stderr or r.stdout).strip()[-400:]}")
    return r


def _conf(root: Path, hosts, gpus: dict[str, int], control_ip: str) -> tuple[str, str]:
    d = slurm_dir(root)
    nodes, gres = [], []
    for h in hosts:
        n = gpus[h.name]
        nodes.append(f"NodeName={h.name} NodeHostname={h.name} NodeAddr={h.mgmt_ip} CPUs={os.cpu_count() or 2} "
                     f"RealMemory=2000 Gres=gpu:{n} State=UNKNOWN")
        if n:
            gres.append(f"NodeName={h.name} Name=gpu File={d}/dev/{h.name}/nvidia[0-{n - 1}]")
    conf = f"""\
# railyard lab: a Slurm cluster over the lab hosts (written by `inv lab.up --slurm`)
ClusterName=railyard-lab
SlurmctldHost={socket.gethostname().split('.')[0]}({control_ip})
SlurmctldPort={CTLD_PORT}
SlurmdPort={SLURMD_PORT}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={d}/munge/munge.socket
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
TaskProlog={d}/task-prolog
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
GresTypes=gpu
MailProg=/bin/true
KillWait=10
SlurmdTimeout=60
InactiveLimit=0
{chr(10).join(nodes)}
PartitionName=lab Nodes=ALL Default=YES State=UP MaxTime=INFINITE
"""
    return conf, "\n".join(gres) + "\n"


def up(root: Path, hosts, gpus: dict[str, int], control_ip: str, host_env, in_host_argv) -> dict[str, str]:
    """Start munged, slurmctld and one slurmd per host (idempotent); wait until every node is idle.
    gpus: each host's GPU count (its gres); host_env(h): the environment of a session on h;
    in_host_argv(h): the argv prefix that enters h's namespaces."""
    _need()
    d = slurm_dir(root)
    for sub in ("state", "spool", "log"):
        (d / sub).mkdir(parents=True, exist_ok=True)
    _munge(d)
    conf, gres = _conf(root, hosts, gpus, control_ip)
    for h in hosts:
        dev = d / "dev" / h.name
        dev.mkdir(parents=True, exist_ok=True)
        for i in range(gpus[h.name]):
            p = dev / f"nvidia{i}"
            if not p.exists():
                os.mknod(p, 0o666 | 0o020000, os.makedev(1, 3))  # a character device (/dev/null's numbers)
    prolog = d / "task-prolog"
    lines = ["#!/bin/sh", "# each task gets its lab host's environment, as an SSH session there does",
             'case "$SLURMD_NODENAME" in']
    for h in hosts:
        env = host_env(h)
        lines.append(f"    {h.name}) " + "; ".join(f"echo 'export {k}={v}'" for k, v in env.items()) + ";;")
    lines += ["esac", f"echo 'export SLURM_CONF={conf_path(root)}'", ""]
    prolog.write_text("\n".join(lines))
    prolog.chmod(0o755)
    changed = not conf_path(root).exists() or conf_path(root).read_text() != conf
    conf_path(root).write_text(conf)
    (d / "gres.conf").write_text(gres)
    env = dict(os.environ, **client_env(root))
    ctld = _read_pid(d / "slurmctld.pid")
    if changed and _alive(ctld):
        _stop(d)
        ctld = None
    if not _alive(ctld):
        _run("slurmctld", "-f", str(conf_path(root)), env=env)
    for h in hosts:
        (d / "spool" / h.name).mkdir(parents=True, exist_ok=True)
        if not _alive(_read_pid(d / f"slurmd-{h.name}.pid")):
            # `ip netns exec` gave the host a sysfs of its own, without cgroups: slurmd needs a v1 layout there
            # (a freezer and systemd's named hierarchy), whatever its plugins use
            subprocess.run(in_host_argv(h) + ["sh", "-c", CGROUPS], check=True, capture_output=True, timeout=30)
            subprocess.run(in_host_argv(h) + ["env", *(f"{k}={v}" for k, v in host_env(h).items()),
                                              f"SLURM_CONF={conf_path(root)}", "slurmd", "-f", str(conf_path(root)),
                                              "-N", h.name], check=True, capture_output=True, timeout=60)
    _wait_idle(root, [h.name for h in hosts], env)
    return client_env(root)


def _munge(d: Path) -> None:
    m = d / "munge"
    key = d / "munge-key"
    m.mkdir(parents=True, exist_ok=True)
    key.mkdir(parents=True, exist_ok=True)
    shutil.chown(m, "munge", "munge")
    shutil.chown(key, "munge", "munge")
    os.chmod(m, 0o755)  # munged refuses a socket directory without execute for all
    os.chmod(key, 0o700)
    kf = key / "munge.key"
    if not kf.exists():
        kf.write_bytes(os.urandom(1024))
        shutil.chown(kf, "munge", "munge")
        os.chmod(kf, 0o400)
    if _alive(_read_pid(m / "munged.pid")):
        return
    _run("runuser", "-u", "munge", "--", "munged", f"--socket={m}/munge.socket", f"--key-file={kf}",
         f"--pid-file={m}/munged.pid", f"--log-file={m}/munged.log", f"--seed-file={key}/munged.seed")
    r = subprocess.run(f"munge -S {m}/munge.socket -n | unmunge -S {m}/munge.socket", shell=True,
                       capture_output=True, text=True, timeout=30)
    if "Success" not in r.stdout:
        raise LabError(f"lab --slurm: munge does not authenticate: {(r.stdout + r.stderr).strip()[-300:]}")


def _wait_idle(root: Path, names: list[str], env: dict, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        r = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True, text=True, env=env, timeout=30)
        states = dict(line.split()[:2] for line in r.stdout.splitlines() if len(line.split()) >= 2)
        last = r.stdout.strip() or r.stderr.strip()
        if all(states.get(n, "") in ("idle", "allocated", "mixed") for n in names):  # `idle*`: not registered yet
            return
        time.sleep(0.3)
    tails = []
    for n in names:
        try:
            tails.append(f"{n}: " + (slurm_dir(root) / "log" / f"slurmd-{n}.log").read_text().strip().splitlines()[-1])
        except (OSError, IndexError):
            tails.append(f"{n}: no slurmd log")
    raise LabError(f"lab --slurm: nodes not idle after {timeout:g} s: {' '.join(last.split())}; last slurmd lines: "
                   f"{'; '.join(tails)} (logs: {slurm_dir(root)}/log)")


def _stop(d: Path) -> None:
    _stop_pids([_read_pid(p) for p in sorted(d.glob("slurmd-*.pid"))] + [_read_pid(d / "slurmctld.pid")])


def _stop_pids(pids: list[int | None]) -> None:
    """SIGTERM, up to 10 s, then SIGKILL."""
    for pid in pids:
        if _alive(pid):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    for pid in pids:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def down(root: Path) -> None:
    """Stop every daemon up() started (by their pid files); the files go with the lab's directory."""
    d = slurm_dir(root)
    if not d.exists():
        return
    _stop(d)
    _stop_pids([_read_pid(d / "munge" / "munged.pid")])
    shutil.rmtree(d, ignore_errors=True)
