"""A launch as data: a `LaunchPlan` is ordered stages of services; a service is a container
spec of *intent* (image, command, env, GPUs, RDMA needs, mounts, ports, CPU set) plus the
gates that say when it has started and when it is ready.

    plan = build_plan(inv, facts)                 # pure: railyard.plan.layout
    render.docker.run_line(plan, service)         # one renderer per target
    ops.launch.apply(plan, runner, ...)           # stages in order, gates, rollback

Values that differ per target stay symbolic (`Ref`): the docker renderer puts in the head's
rail address and the rank; a script renderer puts in `"$PORT"`; the LeaderWorkerSet renderer
puts in `$(LWS_LEADER_ADDRESS)`, the sbatch renderer variables set on the node. The plan never
holds a docker flag.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Union


@dataclass(frozen=True)
class Ref:
    """A value each renderer fills in for its target."""

    name: str

    def __str__(self) -> str:
        return "${" + self.name + "}"


HEAD_ADDR = Ref("head_addr")    # where rank 0 of the service's group listens (rail IP, LWS leader, ...)
NODE_RANK = Ref("node_rank")    # this member's rank in its group
GROUP_SIZE = Ref("group_size")  # members in the group
PORT = Ref("port")              # the port the service serves on
MODEL_DIR = Ref("model_dir")    # the checkpoint as the program sees it (/model in a container)
NODE_ADDR = Ref("node_addr")    # this member's own address (its rail IP; a pod's IP; a Slurm node's rail IP)
GID_INDEX = Ref("gid_index")    # the RoCE v2 GID index of its rail's IPv4 (a host fact, discovered where it runs)
REFS = (HEAD_ADDR, NODE_RANK, GROUP_SIZE, PORT, MODEL_DIR, NODE_ADDR, GID_INDEX)

Value = Union[str, Ref]


@dataclass(frozen=True)
class GpuRequest:
    """How many GPUs, and which ones (by UUID) once the host's facts are known."""

    count: int
    uuids: tuple[str, ...] = ()
    name: str = ""  # the selector they were chosen by (cluster_gpu_name)


@dataclass(frozen=True)
class RdmaRequest:
    """What GPUDirect RDMA needs: the HCAs, pinned memory, IPC_LOCK and the verbs devices."""

    hcas: tuple[str, ...]
    memlock_unlimited: bool = True
    ipc_lock: bool = True
    devices: tuple[str, ...] = ("/dev/infiniband",)


@dataclass(frozen=True)
class Mount:
    source: str  # absolute path on the host
    target: str  # path inside the container
    read_only: bool = True
    kind: str = "bind"  # bind | model (the checkpoint: a volume the user names elsewhere) | state (a
                        # folder of the service's own, made on the host before it starts) | staged (a folder
                        # sync-model staged: railyard.engines.Prefetch)


@dataclass(frozen=True)
class Secret:
    """A value the program reads from its environment, kept in a 0600 file on the host."""

    env: str
    host_file: str  # absolute path on the host
    target: str     # where the container sees the file
    prefix: str = ""  # what a generated value starts with (LiteLLM's keys: sk-)


@dataclass(frozen=True)
class File:
    """A file the plan renders (a router's config), written on the host before the service starts;
    its content is part of the spec, so a change is another configuration."""

    host_path: str  # absolute path on the host
    content: str
    mode: int = 0o644


@dataclass(frozen=True)
class Gate:
    """One readiness condition.

    running: the container runs and its process stays up for `seconds`;
    log: `pattern` appears in the log;
    kv_engines: `count` engine cores (DP ranks) have logged their KV cache size;
    http: GET `path` on the service's port (or `port`) answers 200.
    """

    kind: str
    seconds: float = 0.0
    pattern: str = ""
    count: int = 1
    path: str = ""
    port: int = 0

    def describe(self) -> str:
        if self.kind == "running":
            return f"running for {self.seconds:g} s"
        if self.kind == "log":
            return f"log shows `{self.pattern}`"
        if self.kind == "kv_engines":
            return f"{self.count} engines logged their KV cache"
        return f"GET {self.path} answers 200"


@dataclass(frozen=True)
class ContainerSpec:
    name: str
    image: str
    command: tuple[Value, ...]                       # the program and its arguments
    env: tuple[tuple[str, Value], ...] = ()
    setup: tuple[str, ...] = ()                      # shell lines the image runs before the program
    gpus: GpuRequest = GpuRequest(0)
    rdma: RdmaRequest | None = None
    mounts: tuple[Mount, ...] = ()
    secrets: tuple[Secret, ...] = ()
    ports: tuple[int, ...] = ()
    bind: str = ""                                   # the address the program listens on ("": all)
    shm_size: str = ""
    cpuset: str = ""                                 # CPUs of the GPUs' NUMA node, e.g. "0-55,112-167"
    ulimits: tuple[tuple[str, str], ...] = ()        # besides memlock (that one is RDMA's)
    labels: tuple[tuple[str, str], ...] = ()
    files: tuple[File, ...] = ()                     # rendered files the service reads (mounted by `mounts`)
    shell: str = "bash"                              # what runs setup lines and secrets: bash, or sh (no bash in the image)
    host_network: bool = True
    host_ipc: bool = True


@dataclass(frozen=True)
class Service:
    name: str            # unique in the plan: head, worker-1, engine, ...
    role: str            # head | worker | engine | probe ...
    host: str            # inventory host name
    spec: ContainerSpec
    started: Gate = Gate("running", seconds=1.5)
    ready: tuple[Gate, ...] = ()                     # besides started; empty: started is ready
    rank: int | None = None                          # member rank in its group (multi-node groups)
    group: str = ""                                  # the multi-node group it belongs to
    group_size: int = 1
    address: str = ""                                # where the group's members reach it (its rail IP)
    env_file: tuple[tuple[str, str], ...] = ()       # what `inv env` writes for it (for people to diff)
    env_path: str = ""                               # where that file lives on the host
    expect: tuple[tuple[str, str], ...] = ()         # what health checks: e.g. ("kv_engines", "8")
    facts: tuple[tuple[str, str], ...] = ()          # the host facts its refs resolve to on a docker host (gid_index)

    def expects(self, key: str, default: str = "") -> str:
        return dict(self.expect).get(key, default)


@dataclass(frozen=True)
class Stage:
    services: tuple[Service, ...]
    wait: str = "started"   # started: each service's start gate; ready: its start and ready gates


@dataclass(frozen=True)
class Endpoint:
    """What users call: the OpenAI-compatible API of one service."""

    service: str
    host: str
    bind: str
    port: int
    api_key_file: str = ""  # on that host, absolute ('' when the API takes no key)
    model: str = ""

    @classmethod
    def of(cls, svc: "Service", model: str = "") -> "Endpoint":
        """A service's own API (its first port), called from its host without a key."""
        return cls(svc.name, svc.host, svc.spec.bind, svc.spec.ports[0], "", model)

    @property
    def local_address(self) -> str:
        """Where to reach it from its own host (a wildcard bind answers on loopback)."""
        return "127.0.0.1" if self.bind in ("0.0.0.0", "::", "") else self.bind

    @property
    def url(self) -> str:
        return f"http://{self.bind}:{self.port}/v1"


@dataclass(frozen=True)
class Dial:
    """A TCP connection the deployment opens from one host to another: `src` dials `address:port` on `dst`
    (what: whose port it is, for people)."""

    src: str
    dst: str
    address: str
    port: int
    what: str


@dataclass(frozen=True)
class LaunchPlan:
    deployment: str
    layout: str
    stages: tuple[Stage, ...]
    endpoint: Endpoint
    verifiers: tuple[str, ...] = ()   # rdma: NCCL crosses hosts over the rails; kv_engines: one KV cache per DP rank
                                      # (what a layout checks beyond these is its hooks: railyard.plan.layout)
    notes: tuple[str, ...] = field(default=())
    dials: tuple[Dial, ...] = ()      # the connections between hosts that must get through (preflight tries them)

    def services(self) -> list[Service]:
        return [s for st in self.stages for s in st.services]

    def by_rank(self) -> list[Service]:
        """The services for reports: ranked ones by rank (the head first), then the others in stage order."""
        return sorted(self.services(), key=lambda s: (s.rank is None, s.rank or 0))

    def report_hosts(self) -> list[str]:
        return _hosts_of(self.by_rank())

    def service(self, name: str) -> Service:
        for s in self.services():
            if s.name == name:
                return s
        raise KeyError(name)

    def on_host(self, host: str) -> list[Service]:
        return [s for s in self.services() if s.host == host]

    def hosts(self) -> list[str]:
        """The hosts in start order."""
        return _hosts_of(self.services())

    def group(self, name: str) -> list[Service]:
        return sorted((s for s in self.services() if s.group == name), key=lambda s: s.rank or 0)


def is_loopback(addr: str) -> bool:
    """127.0.0.0/8, ::1 or localhost: an address only the host itself reaches."""
    import ipaddress
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return addr == "localhost"


def _hosts_of(services: list[Service]) -> list[str]:
    """Each service's host once, in the order given."""
    return list(dict.fromkeys(s.host for s in services))


# Fields added after the first release: left out of the hash while at their default, so containers
# that release started are still this plan's (no --recreate after an upgrade).
_LATER_FIELDS = {"files": (), "shell": "bash"}
# Refs that were literal values before: hashed as the value they resolve to, as they were then.
_LATER_REFS = ("node_addr", "gid_index")


def spec_dict(spec: ContainerSpec) -> dict:
    """The spec as plain JSON-able data (a Ref becomes {"name": ...})."""
    d = asdict(spec)
    for k, default in _LATER_FIELDS.items():
        if getattr(spec, k) == default:
            d.pop(k)
    for sec in d["secrets"]:
        if not sec["prefix"]:
            sec.pop("prefix")
    return d


def spec_hash(spec: ContainerSpec, resolved: dict | None = None) -> str:
    """16 hex of sha256 over the canonical JSON of the spec and what its refs resolve to on the target.
    The running container carries it as a label: the same hash is a no-op, another needs --recreate."""
    resolved = dict(resolved or {})
    late = {k: resolved.pop(k, "") for k in _LATER_REFS}

    def literal(x):
        if isinstance(x, dict):
            return late[x["name"]] if set(x) == {"name"} and x["name"] in late else {k: literal(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [literal(v) for v in x]
        return x
    doc = {"spec": literal(spec_dict(spec)), "refs": resolved}
    return hashlib.sha256(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]
