"""A service of a plan as the `docker run` that starts it: argv, and the shell line of it.

The flags are today's two-station contract (GPU by UUID, host network and IPC, the RDMA
devices, IPC_LOCK, memlock, the model read-only at /model, every variable as `-e`); a label
carries the spec hash so `inv launch` can tell a running container of the same plan.
"""

from __future__ import annotations

from ..plan.spec import GpuRequest, LaunchPlan, Service, spec_hash
from ..transport import q
from . import walk
from .walk import value

HASH_LABEL = "railyard.config"


def refs(plan: LaunchPlan, svc: Service) -> dict[str, str]:
    """What each Ref is on a docker host: the group head's rail address, the rank, the port, /model, the
    service's own address and its host's facts."""
    group = plan.group(svc.group) if svc.group else [svc]
    model = next((m.target for m in svc.spec.mounts if m.kind == "model"), "")
    return {"head_addr": group[0].address, "node_rank": str(svc.rank or 0), "group_size": str(svc.group_size),
            "port": str(svc.spec.ports[0]) if svc.spec.ports else "", "model_dir": model, "node_addr": svc.address,
            "gid_index": dict(svc.facts).get("gid_index", "")}




def config_hash(plan: LaunchPlan, svc: Service) -> str:
    return spec_hash(svc.spec, refs(plan, svc))


def gpus_flag(g: GpuRequest) -> str:
    """docker's --gpus value: `device=UUID`; several devices must be quoted inside the value."""
    if not g.uuids:
        return str(g.count)
    return f"device={g.uuids[0]}" if len(g.uuids) == 1 else '"device=' + ",".join(g.uuids) + '"'


def entry_script(plan: LaunchPlan, svc: Service, resolved: dict[str, str] | None = None) -> str:
    """What `bash -lc` runs in the image: its setup lines, each secret from its file, then the program."""
    r = resolved if resolved is not None else refs(plan, svc)
    return walk.entry(svc.spec, walk.words(svc, r), lambda s: s.target, optional=True) or ""


def run_argv(plan: LaunchPlan, svc: Service, with_hash: bool = True, resolved: dict[str, str] | None = None) -> list[str]:
    """resolved: what each Ref is, when not a docker host's values (a Slurm node's, found when its step starts)."""
    spec = svc.spec
    r = resolved if resolved is not None else refs(plan, svc)
    argv = ["docker", "run", "-d", "--name", spec.name]
    if with_hash:
        argv += ["--label", f"{HASH_LABEL}={spec_hash(spec, r)}"]
    for k, v in spec.labels:
        argv += ["--label", f"{k}={v}"]
    if spec.gpus.count:
        argv += ["--gpus", gpus_flag(spec.gpus)]
    if spec.host_network:
        argv += ["--network", "host"]
    if spec.host_ipc:
        argv += ["--ipc", "host"]
    if spec.shm_size:
        argv += ["--shm-size", spec.shm_size]
    if spec.rdma:
        for d in spec.rdma.devices:
            argv += ["--device", d]
        if spec.rdma.ipc_lock:
            argv += ["--cap-add", "IPC_LOCK"]
        if spec.rdma.memlock_unlimited:
            argv += ["--ulimit", "memlock=-1"]
    for name, limit in spec.ulimits:
        argv += ["--ulimit", f"{name}={limit}"]
    if spec.cpuset:
        argv += ["--cpuset-cpus", spec.cpuset]
    for m in spec.mounts:
        argv += ["-v", f"{m.source}:{m.target}" + (":ro" if m.read_only else "")]
    for k, ev in spec.env:
        argv += ["-e", f"{k}={value(ev, r)}"]
    for s in spec.secrets:
        argv += ["-v", f"{s.host_file}:{s.target}:ro"]
    if spec.setup or spec.secrets:
        argv += ["--entrypoint", spec.shell, spec.image, "-lc" if spec.shell == "bash" else "-c",
                 entry_script(plan, svc, r)]
    else:
        argv += ["--entrypoint", value(spec.command[0], r), spec.image] + [value(a, r) for a in spec.command[1:]]
    return argv


def run_line(plan: LaunchPlan, svc: Service, with_hash: bool = True) -> str:
    """The argv as one shell line, every word quoted: what runs over SSH and what --dry-run prints."""
    return " ".join(q(a) for a in run_argv(plan, svc, with_hash))
