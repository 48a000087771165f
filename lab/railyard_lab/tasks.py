"""The lab's tasks, `inv lab.*`: railyard's tasks.py adds this collection as `lab` when the lab
distribution is installed (pip install -e lab). Declared with railyard's task layer (railyard.cli.rtask):
one line and an exit code for an expected error, never a traceback."""

from __future__ import annotations

import os
import subprocess
import sys

from invoke import Collection

import railyard_lab as lab
from railyard.cli import remainder, rtask
from railyard.errors import UsageError

from . import faults
from .checkpoint import write_checkpoint


def _log(message: str) -> None:
    print(message, file=sys.stderr)


@rtask(help={"hosts": "number of test hosts (A, B, C, ...); default 2, or what --layout needs",
             "shape": "station (a DGX Station: GB300 + display GPU, 2 rails; default) or hgx8 "
                      "(8 GPUs on 2 NUMA nodes, 8 rails); another shape rebuilds the lab",
             "gpu": "the GPUs of an hgx8 host: H200 (default) or B200",
             "slurm": "also a real Slurm cluster over the hosts (munged, slurmctld, a slurmd per host; "
                      "clients: SLURM_CONF=<lab>/slurm/slurm.conf)",
             "engine": "what serves: vllm (the real vLLM, its CPU build; the default) or stand-in "
                       "(the lab's own; kept until changed)",
             "layout": "write the lab inventory for this serve_layout on the hosts it needs: multinode_tp "
                       "(2 stations), single_node_tp, dp_ep, replicas (1 hgx8 host), pd (2 hgx8 hosts)"},
       numbers={"hosts": int})
def up(hosts=None, shape=None, gpu="H200", slurm=False, engine=None, layout=None):
    """Start the lab: N test hosts as network namespaces with sshd, rails and simulated GPU tools."""
    print(lab.up(hosts, log=_log, shape=shape, gpu=gpu, slurm=slurm, engine=engine, layout=layout))
    return 0


@rtask()
def down():
    """Remove everything the lab made: namespaces, links, processes, files."""
    lab.down(log=_log)
    return 0


@rtask(positional=["host", "kind"],
       help={"host": "lab host, e.g. B", "kind": "fault kind (see the list above); KIND=VALUE also works",
             "value": "optional value, e.g. an MTU or a number of seconds"})
def fault(host, kind, value=""):
    """Inject a fault: inv lab.fault B mtu --value 1500 (or B mtu=1500). Kinds: mtu, link-down, no-ip,
    gid-index, ntp-unsynced, clock-skew, gpu-busy, no-gpu, disk-full, sshd-down, host-key-changed,
    missing-tool, docker-down, image-mismatch."""
    if "=" in kind and not value:
        kind, value = kind.split("=", 1)
    print(faults.fault(host, kind, value or None))
    return 0


@rtask(help={"host": "heal only this host (default: every host)"})
def heal(host=""):
    """Undo the faults injected with lab.fault."""
    done = faults.heal(host or None)
    print("\n".join(done) if done else "nothing to heal")
    return 0


@rtask(help={"size-gb": "total size of the padding shards in GB (default 0.5)",
             "shards": "number of padding safetensors shards, which the engine ignores (default 10)",
             "host": "where to write it (default: the head, A)"},
       numbers={"size_gb": float, "shards": int})
def checkpoint(size_gb=0.5, shards=10, host=None):
    """Write the lab checkpoint on the head: the lab's real tiny model (the MoE one for dp_ep) and padding shards."""
    if size_gb <= 0 or not 1 <= shards <= 100_000:
        raise UsageError(f"--size-gb {size_gb} --shards {shards}: size must be > 0 and shards 1..100000")
    root = lab.lab_dir()
    h = lab.lab_host(root, host or lab.hosts_of(root)[0].name)
    layout = lab.lab_layout(root)
    where = lab.lab_model_path(layout)  # ~/models/..., the lab inventory's model_path
    out = write_checkpoint(h.home / where.removeprefix("~/"), size_gb, shards, kind=lab.model_kind(layout))
    print(f"{h.name}: wrote {out['files']} files, {out['bytes'] / 1e9:.2f} GB of shards, at {where}")
    return 0


@rtask(help={"host": "lab host, e.g. A"})
def ssh(host):
    """Open a shell on a lab host, or run one command there: inv lab.ssh A -- ip -br addr."""
    command = remainder() or None
    root = lab.lab_dir()
    argv = lab.ssh_argv(root, lab.lab_host(root, host), command)
    if command:
        return subprocess.run(argv).returncode
    if sys.stdin.isatty():
        argv.insert(1, "-t")
    os.execvp(argv[0], argv)
    return 0


ns = Collection("lab", up, down, fault, heal, checkpoint, ssh)
