"""A plan as Kubernetes manifests: a LeaderWorkerSet per multi-node group (the head leads, the workers
run `--headless`), a Deployment per one-host service, a DisaggregatedSet for prefill/decode pools,
a Service for the endpoint, the router's files in a ConfigMap.

    text = render(plan, ModelVolume.parse("pvc:glm-weights"))   # one YAML stream, in apply order

The same program, arguments and environment as `inv launch`'s docker run; what differs per target
is symbolic: the group's head address, rank and size are LWS's `$(LWS_LEADER_ADDRESS)`,
`$(LWS_WORKER_INDEX)` and `$(LWS_GROUP_SIZE)`; the rank's own rail address and its RoCE v2 GID index
are found in the pod when it starts (the rail's IPv4, sysfs GID table), as railyard finds them
over SSH. GPUs and RDMA are resource requests, IPC_LOCK a capability, /dev/shm a memory-backed
volume, secrets Secret volumes at the paths the program reads (the user creates the Secret; no
value is ever in a manifest). railyard does not install the LWS controller or apply anything.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import yaml

from ..errors import UsageError
from ..plan.spec import File, LaunchPlan, Secret, Service, is_loopback
from ..facts.net import ib_hca_device
from ..transport import q
from . import walk

DEFAULT_RDMA_RESOURCE = "rdma/rdma_shared_device_a"  # the NVIDIA network operator's shared RDMA device plugin
LWS_API = "leaderworkerset.x-k8s.io/v1"
DS_API = "disaggregatedset.x-k8s.io/v1"
LEADER = "leaderworkerset.sigs.k8s.io/worker-index=0"   # LWS's label: 0 on a group's leader pod
SET_LABEL = "leaderworkerset.sigs.k8s.io/name"
WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"

_LWS_REFS = {"head_addr": "$(LWS_LEADER_ADDRESS)", "node_rank": "$(LWS_WORKER_INDEX)", "group_size": "$(LWS_GROUP_SIZE)",
             "pod_ip": "$(POD_IP)", "pod_namespace": "$(POD_NAMESPACE)"}
_DOWNWARD = {"pod_ip": ("POD_IP", "status.podIP"), "pod_namespace": ("POD_NAMESPACE", "metadata.namespace")}
_SHELL_VARS = {"node_addr": "RAILYARD_NODE_ADDR", "gid_index": "RAILYARD_GID_INDEX"}
# What names the host's rail for a process on it: in a pod of its own network namespace that interface does not
# exist (NCCL and Gloo would find no socket interface) and NCCL's GID index is the host's
RAIL_ONLY_ENV = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_IB_GID_INDEX")
POOL_NODE_LABEL = "railyard.io/pool"

# The pod's own facts, as `inv env` reads them over SSH: the rail's IPv4 (SIOCGIFADDR) and the index of
# the RoCE v2 GID holding it (/sys/class/infiniband/HCA/ports/1/gids and gid_attrs/types).
NODE_FACTS_PY = """import fcntl, glob, ipaddress, os, socket, struct, sys
iface, hca = sys.argv[1], sys.argv[2]
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
try:
    ip = socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", iface[:15].encode()))[20:24])
except OSError:
    sys.exit("railyard: no IPv4 address on " + iface + " in this pod (hostNetwork, and the rail up?)")
want, d, gid = ipaddress.ip_address("::ffff:" + ip), "/sys/class/infiniband/" + hca + "/ports/1", "-"
for p in sorted(glob.glob(d + "/gids/*"), key=lambda p: int(os.path.basename(p))):
    n = os.path.basename(p)
    try:
        if ipaddress.ip_address(open(p).read().strip()) == want and open(d + "/gid_attrs/types/" + n).read().strip().lower() == "roce v2":
            gid = n
            break
    except (OSError, ValueError):
        pass
print(ip, gid)"""

PROBE_PY = ("import sys, urllib.request; [urllib.request.urlopen('http://%s:%s%s' % (sys.argv[1], p, u), timeout=5).read() "
            "for p, u in zip(sys.argv[2::2], sys.argv[3::2])]")


@dataclass(frozen=True)
class ModelVolume:
    kind: str  # pvc | hostPath
    name: str  # the claim, or the path on the node

    @classmethod
    def parse(cls, text: str, flag: str = "--model-volume") -> "ModelVolume":
        kind, sep, name = text.partition(":")
        if not sep or kind not in ("pvc", "hostPath") or not name:
            raise UsageError(f"{flag} {text!r}: expected pvc:CLAIM or hostPath:/PATH (where the checkpoint is)")
        if kind == "hostPath" and not name.startswith("/"):
            raise UsageError(f"{flag} {text!r}: a hostPath must be absolute")
        if kind == "pvc" and not _DNS.match(name):
            raise UsageError(f"{flag} {text!r}: {name!r} is not a Kubernetes object name")
        return cls(kind, name)

    def volume(self) -> dict:
        if self.kind == "pvc":
            return {"name": "model", "persistentVolumeClaim": {"claimName": self.name, "readOnly": True}}
        return {"name": "model", "hostPath": {"path": self.name, "type": "Directory"}}


_DNS = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def k8s_name(*parts: str) -> str:
    """A DNS-1123 label from the parts: lower case, `-` for anything else, at most 63 characters."""
    s = re.sub(r"[^a-z0-9-]+", "-", "-".join(p for p in parts if p).lower()).strip("-")
    return s[:63].rstrip("-")


def secret_name(plan: LaunchPlan, s: Secret) -> str:
    """The Secret the user creates for it: `kubectl create secret generic NAME --from-file=value=FILE`."""
    return k8s_name(plan.deployment, s.env.replace("_", "-"))


class _Pods:
    def __init__(self, plan: LaunchPlan, model: ModelVolume, rdma_resource: str):
        self.plan, self.model, self.rdma_resource = plan, model, rdma_resource
        self.config_maps: dict[str, dict[str, str]] = {}

    def template(self, svc: Service, labels: dict[str, str], argv_of=None, pod_network: bool = False) -> dict:
        """The pod template of one service. argv_of: what the program's words are here (the router finds its
        backends by their labels). pod_network: the pod has its own network namespace (a pd instance that is one
        pod: its DP ranks talk inside it, its KV goes over RDMA): its own rail address is the pod's address,
        and the rail's interface, not in the pod, is named nowhere."""
        spec = svc.spec
        resolved = walk.markers(svc)

        def own(text: str) -> str:
            text = walk.own_address(text, svc)
            return text.replace(walk.token("ref_node_addr"), walk.token("pod_ip")) if pod_network else text
        argv = [own(w) for w in walk.words(svc, resolved)]
        if _node_bound(svc) and "--host" in argv:  # its API on the pod's address, where Services and probes reach it
            argv[argv.index("--host") + 1] = walk.token("pod_ip")
        if argv_of:
            argv = argv_of(argv)
        env: list[dict[str, Any]] = []
        exports: list[str] = []
        for k, v in spec.env:
            if pod_network and k in RAIL_ONLY_ENV:
                continue
            text = own(walk.value(v, resolved))
            if walk.tokens_in(text) & {"ref_node_addr", "ref_gid_index", "gid_index"}:
                exports.append(f"export {k}={q(text)}")
            else:
                env.append({"name": k, "value": text})
        needed = walk.tokens_in(" ".join(argv + exports))
        before = []
        if needed & {"ref_node_addr", "ref_gid_index", "gid_index"}:
            before += self._node_facts(svc, needed)
        before += _limits(svc)
        script = walk.entry(spec, argv, lambda s: s.target, before=tuple(before + exports))

        def symbols(text: str, shell: bool) -> str:
            def by(name: str) -> str:
                name = name.removeprefix("ref_")
                if name in _LWS_REFS:
                    return _LWS_REFS[name]
                if name in _SHELL_VARS and shell:
                    return "'\"$$" + _SHELL_VARS[name] + "\"'"  # out of the single quotes; $$: kubelet's escape
                raise UsageError(f"--to lws: {svc.name}: {name} is known only on the node; it cannot be in a "
                                 "program run without a shell")
            return walk.replace_tokens(text.replace("$", "$$"), by)

        env = [{"name": var, "valueFrom": {"fieldRef": {"fieldPath": path}}}
               for tok, (var, path) in _DOWNWARD.items() if tok in needed] + env
        container: dict = {"name": k8s_name(svc.name), "image": spec.image}
        if script is None:
            container["command"] = [symbols(w, False) for w in argv]
        else:
            container["command"] = [spec.shell, "-c", symbols(script, True)]
        if spec.ports:
            container["ports"] = [{"containerPort": p, "protocol": "TCP"} for p in spec.ports]
        limits = {}
        if spec.gpus.count and svc.expects("gpu_process", "required") == "required":
            limits["nvidia.com/gpu"] = spec.gpus.count
        elif spec.gpus.count:  # another service's GPUs (LMCache maps the replicas' memory): all of the node's, none its own
            env.append({"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"})
        if spec.rdma:
            limits[self.rdma_resource] = 1
        if env:
            container["env"] = [e if "valueFrom" in e else {"name": e["name"], "value": symbols(e["value"], False)}
                                for e in env]
        if limits:
            container["resources"] = {"limits": limits, "requests": dict(limits)}
        if spec.rdma and spec.rdma.ipc_lock:
            container["securityContext"] = {"capabilities": {"add": ["IPC_LOCK"]}}
        mounts, volumes = self._volumes(svc)
        if mounts:
            container["volumeMounts"] = mounts
        probe = self._probe(svc)
        if probe:
            container["readinessProbe"] = probe
        pod: dict = {}
        if spec.host_network and not pod_network:
            pod.update(hostNetwork=True, dnsPolicy="ClusterFirstWithHostNet")
        if spec.host_ipc:
            pod["hostIPC"] = True
        pod["containers"] = [container]
        if volumes:
            pod["volumes"] = volumes
        return {"metadata": {"labels": labels}, "spec": pod}

    def _node_facts(self, svc: Service, needed: set[str]) -> list[str]:
        env = dict(svc.spec.env)
        iface, hca = env.get("NCCL_SOCKET_IFNAME"), env.get("NCCL_IB_HCA")
        if not (isinstance(iface, str) and isinstance(hca, str)):
            raise UsageError(f"--to lws: {svc.name} needs its rail's address but its environment names no "
                             "NCCL_SOCKET_IFNAME and NCCL_IB_HCA")
        hca = ib_hca_device(hca)
        lines = [f"f=\"$(python3 -c {q(NODE_FACTS_PY)} {q(iface)} {q(hca)})\" || exit 1",
                 'RAILYARD_NODE_ADDR="${f% *}"; RAILYARD_GID_INDEX="${f#* }"']
        if needed & {"ref_gid_index", "gid_index"}:
            lines.append(f'if [ "$RAILYARD_GID_INDEX" = - ]; then echo "railyard: no RoCE v2 GID for '
                         f'$RAILYARD_NODE_ADDR on {hca} (fix: RoCE v2 enabled, the address on {iface})" >&2; exit 1; fi')
        return lines

    def _volumes(self, svc: Service) -> tuple[list[dict], list[dict]]:
        spec = svc.spec
        mounts, volumes = [], []
        rendered: dict[str, list[File]] = {f.host_path.rsplit("/", 1)[0]: [] for f in spec.files}
        for f in spec.files:
            rendered[f.host_path.rsplit("/", 1)[0]].append(f)
        for i, m in enumerate(spec.mounts):
            if m.kind == "model":
                mounts.append({"name": "model", "mountPath": m.target, "readOnly": True})
                volumes.append(self.model.volume())
            elif m.kind == "staged":   # the folder sync-model staged on each node (vllm_kernels_path)
                mounts.append({"name": "staged", "mountPath": m.target, "readOnly": True})
                volumes.append({"name": "staged", "hostPath": {"path": m.source, "type": "Directory"}})
            elif m.source in rendered:
                name = k8s_name(self.plan.deployment, svc.name, "files")
                self.config_maps[name] = {f.host_path.rsplit("/", 1)[1]: f.content for f in rendered[m.source]}
                mounts.append({"name": "files", "mountPath": m.target, "readOnly": True})
                volumes.append({"name": "files", "configMap": {"name": name}})
            else:  # the service's own state (caches, scratch): the pod's, gone with it
                mounts.append({"name": f"state-{i}", "mountPath": m.target})
                volumes.append({"name": f"state-{i}", "emptyDir": {}})
        for i, s in enumerate(spec.secrets):
            mounts.append({"name": f"secret-{i}", "mountPath": s.target, "subPath": "value", "readOnly": True})
            volumes.append({"name": f"secret-{i}", "secret": {"secretName": secret_name(self.plan, s),
                                                                "defaultMode": 0o400}})
        if spec.host_ipc or spec.shm_size:
            shm: dict = {"medium": "Memory"}
            if spec.shm_size:
                shm["sizeLimit"] = _quantity(spec.shm_size)
            mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
            volumes.append({"name": "dshm", "emptyDir": shm})
        return mounts, volumes

    def _probe(self, svc: Service) -> dict | None:
        """The ready gates as a readiness probe that is a real request: the kubelet's GET of the last gate's path
        on the pod's address, or, for a loopback bind, python3 in the image GETting every path there."""
        gates = walk.http_gates(svc)
        if not gates:
            return None
        timing = {"initialDelaySeconds": 30, "periodSeconds": 10, "timeoutSeconds": 10, "failureThreshold": 3}
        if _node_bound(svc) or not is_loopback(svc.spec.bind or "0.0.0.0"):
            port, path = gates[-1]
            return {"httpGet": {"path": path, "port": port}, **timing}
        argv = ["python3", "-c", PROBE_PY, walk.local_address(svc.spec.bind)] + [
            x for p, path in gates for x in (str(p), path)]
        return {"exec": {"command": argv}, **timing}


def _node_bound(svc: Service) -> bool:
    """Binds the rail address of its host (pd's instances): found in the pod."""
    return bool(svc.address) and svc.spec.bind == svc.address


def _limits(svc: Service) -> list[str]:
    """docker's --ulimit flags as the shell's ulimit (a pod has no such field): raised where the
    runtime allows, else a warning naming it."""
    out = []
    limits = dict(svc.spec.ulimits)
    if svc.spec.rdma and svc.spec.rdma.memlock_unlimited:
        limits["memlock"] = "-1"
    for name, v in limits.items():
        flag, want = {"stack": ("-s", str(int(v) // 1024) if v != "-1" else "unlimited"),
                      "memlock": ("-l", "unlimited" if v == "-1" else str(int(v) // 1024))}.get(name, (None, None))
        if flag:
            out.append(f'ulimit {flag} {want} 2>/dev/null || echo "railyard: cannot raise the {name} limit to {want} '
                       f'(now $(ulimit {flag})): raise it in the container runtime (containerd: Limit{name.upper()})" >&2')
    return out


def _quantity(size: str) -> str:
    """docker's 32g as a Kubernetes quantity: 32Gi."""
    m = re.fullmatch(r"(\d+)([kmgt]?)b?", size.lower())
    if not m:
        return size
    return m.group(1) + {"": "", "k": "Ki", "m": "Mi", "g": "Gi", "t": "Ti"}[m.group(2)]


def _meta(plan: LaunchPlan, name: str, extra: dict | None = None) -> dict:
    labels = {"app.kubernetes.io/managed-by": "railyard", "railyard.io/deployment": k8s_name(plan.deployment)}
    labels.update(extra or {})
    return {"name": name, "labels": labels}


def _labels(plan: LaunchPlan, svc_or_role: str) -> dict[str, str]:
    return {"railyard.io/deployment": k8s_name(plan.deployment), "railyard.io/service": k8s_name(svc_or_role)}


def render(plan: LaunchPlan, model: ModelVolume, rdma_resource: str = DEFAULT_RDMA_RESOURCE) -> str:
    pods = _Pods(plan, model, rdma_resource)
    ep = plan.endpoint
    ep_svc = plan.service(ep.service)
    if is_loopback(ep_svc.spec.bind):
        raise UsageError(f"--to lws: the endpoint {ep.service} binds {ep_svc.spec.bind}, which a Kubernetes Service "
                         "cannot reach: set its bind (vllm_bind, litellm_bind or pd_proxy_bind) to 0.0.0.0 or the "
                         "node's address (its API key stays required)")
    objects: list[dict] = []
    done: set[str] = set()
    selectors: dict[str, dict[str, str]] = {}
    pools: dict[str, list[Service]] = {s.role: [] for s in plan.services() if s.role in ("prefill", "decode")}
    for s in plan.services():
        if s.role in pools and (not s.group or s.rank in (None, 0)):
            pools[s.role].append(s)
    router = _discovery(plan, pools) if pools else None
    if pools:
        objects.append(_disaggregated(plan, pods, pools, selectors))
        done.update(s.name for s in plan.services() if s.role in pools)
    for svc, _ in walk.in_order(plan):
        if svc.name in done:
            continue
        if svc.group and svc.group_size > 1:
            members = plan.group(svc.group)
            done.update(m.name for m in members)
            name = k8s_name(plan.deployment, svc.group if len(members) < len(plan.services()) else "")
            labels = _labels(plan, svc.group)
            leader = pods.template(members[0], labels)
            worker = _one_worker(pods, members, labels)
            objects.append({"apiVersion": LWS_API, "kind": "LeaderWorkerSet", "metadata": _meta(plan, name), "spec": {
                "replicas": 1, "startupPolicy": "LeaderCreated",  # the head waits for its workers itself
                "leaderWorkerTemplate": {"size": len(members), "restartPolicy": "RecreateGroupOnPodRestart",
                                         "leaderTemplate": leader, "workerTemplate": worker}}})
            sel = {SET_LABEL: name, WORKER_INDEX_LABEL: "0"}
            for m in members:
                selectors[m.name] = sel
            continue
        done.add(svc.name)
        name = k8s_name(plan.deployment, svc.name)
        labels = _labels(plan, svc.name)
        template = pods.template(svc, labels, router if svc.role == "proxy" else None)
        if svc.role == "proxy" and router:
            template["spec"]["serviceAccountName"] = k8s_name(plan.deployment, "router")
            objects += _router_rbac(plan)
        objects.append({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(plan, name), "spec": {
            "replicas": 1, "strategy": {"type": "Recreate"},  # GPUs and ports are never held twice
            "selector": {"matchLabels": labels}, "template": template}})
        selectors[svc.name] = labels
    _same_node(plan, objects)
    objects.append(_service(plan, k8s_name(plan.deployment, "api"), selectors[ep.service], ep.port))
    for name, data in pods.config_maps.items():
        objects.insert(0, {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(plan, name), "data": data})
    head = (f"# Rendered by railyard from the {plan.layout} plan of {plan.deployment}: the containers `inv launch` "
            "starts, as Kubernetes objects.\n# Needs: the LeaderWorkerSet controller (LWS v0.9+ for DisaggregatedSet), "
            "the NVIDIA device plugin, an RDMA device plugin.\n")
    if pools:
        for role, hosts in pool_nodes(plan).items():
            head += (f"# Before applying: kubectl label nodes {' '.join(hosts)} {POOL_NODE_LABEL}="
                     f"{pool_node_label(plan, role)} (the {role} pool's nodes: its pods run there only)\n")
    secrets = sorted({secret_name(plan, s) for svc in plan.services() for s in svc.spec.secrets})
    for secret in secrets:
        head += f"# Before applying: kubectl create secret generic {secret} --from-file=value=FILE (one value, no newline)\n"
    return head + "".join("---\n" + yaml.dump(o, Dumper=_Dumper, sort_keys=False, width=1000) for o in objects)


class _Dumper(yaml.SafeDumper):
    """No anchors: a label map used twice is written twice, as people write manifests."""

    def ignore_aliases(self, data) -> bool:
        return True


def _one_worker(pods: _Pods, members: list[Service], labels: dict[str, str]) -> dict:
    """LWS runs one template for every worker: the workers must differ in nothing but their rank's refs."""
    first = pods.template(members[1], labels)
    for m in members[2:]:
        other = pods.template(m, labels)
        other["spec"]["containers"][0]["name"] = first["spec"]["containers"][0]["name"]
        if other != first:
            raise UsageError(f"--to lws: {members[1].name} and {m.name} differ in more than their rank; a "
                             "LeaderWorkerSet runs one worker template (a per-rank value that is no ref of the plan)")
    return first


def _same_node(plan: LaunchPlan, objects: list[dict]) -> None:
    """Services of a one-host plan that share loopback and IPC (LMCache and its replicas, their router)
    land on one node: each Deployment after the first requires the first one's pods beside it."""
    deps = [o for o in objects if o["kind"] == "Deployment"]
    if len(plan.hosts()) != 1 or len(deps) < 2:
        return
    first = deps[0]["spec"]["selector"]["matchLabels"]
    for o in deps[1:]:
        o["spec"]["template"]["spec"]["affinity"] = {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
            {"labelSelector": {"matchLabels": first}, "topologyKey": "kubernetes.io/hostname"}]}}


def _disaggregated(plan: LaunchPlan, pods: _Pods, pools: dict[str, list[Service]],
                   selectors: dict[str, dict[str, str]]) -> dict:
    """One role per pool; each instance is one LWS group: its DP ranks across hosts (host network: the ranks
    meet over the rail, so one pod of the pool per node), or one pod in its own network namespace, so that
    several instances share a node as `inv launch` runs them, all on the one port the router's discovery takes.
    Every pod of a pool runs on the nodes labelled for it (pool_nodes): a decode pod never takes the GPUs a
    prefill pod was planned on."""
    roles: list[dict[str, Any]] = []
    for role, members in pools.items():
        first = members[0]
        labels = _pool_labels(plan, role)
        group = plan.group(first.group) if first.group else [first]
        one_pod = len(group) == 1   # else one instance per host (the plan's rule): one pod of the pool per node
        leader = pods.template(group[0], labels, pod_network=one_pod)
        leader["spec"]["nodeSelector"] = {POOL_NODE_LABEL: pool_node_label(plan, role)}
        worker = leader
        if not one_pod:
            worker = _one_worker(pods, group, labels)
            worker["spec"]["nodeSelector"] = dict(leader["spec"]["nodeSelector"])
        lwt: dict = {"size": len(group), "restartPolicy": "RecreateGroupOnPodRestart", "leaderTemplate": leader,
                     "workerTemplate": worker}
        roles.append({"name": role, "spec": {"replicas": len(members), "startupPolicy": "LeaderCreated",
                                             "leaderWorkerTemplate": lwt}})
        for s in plan.services():
            if s.role == role:
                selectors[s.name] = labels
    name = k8s_name(plan.deployment)
    for r in roles:
        _generated_names_fit(name, r["name"], r["spec"]["replicas"])
    return {"apiVersion": DS_API, "kind": "DisaggregatedSet", "metadata": _meta(plan, name), "spec": {"roles": roles}}


def pool_node_label(plan: LaunchPlan, role: str) -> str:
    """The value of the node label that puts a pool's pods on its nodes (`kubectl label nodes`)."""
    return k8s_name(plan.deployment, role)


def pool_nodes(plan: LaunchPlan) -> dict[str, list[str]]:
    """Each pool's hosts, in plan order: the nodes to label for it."""
    out: dict[str, list[str]] = {}
    for s in plan.services():
        if s.role in ("prefill", "decode") and s.host not in out.setdefault(s.role, []):
            out[s.role].append(s.host)
    return out


def _generated_names_fit(ds: str, role: str, replicas: int) -> None:
    """LWS's admission webhook refuses a DisaggregatedSet whose generated names pass DNS-1035's 63
    characters: the role's LeaderWorkerSet `<ds>-<slice>-<revision, 8>-<role>`, plus the longer of its
    Service's `-prv` and its worker pods' revision label `-<group index>-<hash, 10>` (kubernetes-sigs/lws,
    pkg/webhooks/disaggregatedset/disaggregatedset_webhook.go, validateGeneratedNames; one slice here)."""
    suffix = max(len("-prv"), 1 + len(str(max(replicas - 1, 0))) + 11)
    fixed = 3 + 1 + 8 + suffix          # three "-", the slice index, the revision
    if len(ds) + len(role) + fixed > 63:
        raise UsageError(f"--to lws: vllm_container = {ds!r}: with the role {role!r}, the names LWS generates "
                         f"reach {len(ds) + len(role) + fixed} characters and its webhook refuses past 63: "
                         f"name and role together at most {63 - fixed} ({63 - fixed - len(role)} for the name)")


def _pool_labels(plan: LaunchPlan, role: str) -> dict[str, str]:
    return {"railyard.io/deployment": k8s_name(plan.deployment), "railyard.io/pool": role}


def _discovery(plan: LaunchPlan, pools: dict[str, list[Service]]):
    """vllm-router's backends as its Kubernetes service discovery: each pool's pods by their labels, in the
    router's namespace, on the pools' port (one port: the pods of a pool share one template)."""
    ports = {m[0].spec.ports[0] for m in pools.values()}
    if len(ports) != 1:
        raise UsageError(f"--to lws: the pools serve on ports {sorted(ports)}; vllm-router's service discovery takes "
                         "one port (set vllm_port alike in both pools)")
    port = next(iter(ports))

    def argv_of(argv: list[str]) -> list[str]:
        out, i = [], 0
        while i < len(argv):
            if argv[i] in ("--prefill", "--decode") and i + 1 < len(argv):
                i += 2
                continue
            out.append(argv[i])
            i += 1
        out += ["--service-discovery", "--service-discovery-namespace", walk.token("pod_namespace"),
                "--service-discovery-port", str(port)]
        for role in pools:   # the leaders only: an instance's other pods run headless, no API
            out += [f"--{role}-selector"] + [f"{k}={v}" for k, v in _pool_labels(plan, role).items()] + [LEADER]
        return out
    return argv_of


def _router_rbac(plan: LaunchPlan) -> list[dict]:
    """What the router's discovery needs: to get, list and watch the pods of its namespace."""
    name = k8s_name(plan.deployment, "router")
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(plan, name)},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": _meta(plan, name),
         "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": _meta(plan, name),
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
         "subjects": [{"kind": "ServiceAccount", "name": name}]},
    ]


def _service(plan: LaunchPlan, name: str, selector: dict[str, str], port: int) -> dict:
    return {"apiVersion": "v1", "kind": "Service", "metadata": _meta(plan, name),
            "spec": {"selector": dict(selector), "ports": [{"name": "http", "port": port, "targetPort": port,
                                                             "protocol": "TCP"}]}}
