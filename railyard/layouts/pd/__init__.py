"""`pd`: prefill/decode disaggregation over NIXL across 8-GPU hosts, a proxy in front.

    stage 1  prefill-0.. and decode-0..   `vllm serve ... --kv-transfer-config {NixlConnector, kv_producer
             | kv_consumer}`, each instance on its own GPUs (by UUID) of one host, listening on the
             host's serve-rail address; NIXL's side channel on that address and a port of its own;
             UCX over the host's rail HCAs; ready: startup line, KV cache of every DP rank, /health
    stage 2  proxy                         vllm-router in vLLM PD mode (NIXL), round robin per pool;
             ready: its /health; then the P->D proof (railyard.layouts.pd.proof): one real request through
             it with a prompt over one KV block, whose id both logs show, the decode side with one
             more successful NIXL transfer

vllm-router 0.1.17 checks no client key and passes none on (its workers get an empty bearer), so
the instances take no key and listen on their host's serve-rail address (a private fabric), and
the proxy listens on this host's loopback unless pd_proxy_unauthenticated_ok says the network is
closed.

The hosts of the group `prefill` run prefill instances, those of `decode` decode instances
(`pd_instances_per_host` each), or one instance spans `pd_hosts_per_instance` consecutive hosts of
its pool (multi-node data parallel): the first host serves its API, the others run its DP ranks
`--headless` and join it at `--data-parallel-address` on the rail; they start first (stage 0,
started), then the heads with the single-host instances (stage 1). Each pool's settings are its group vars, over the pool defaults
`pd_prefill_defaults` / `pd_decode_defaults` (the reference's flags), over the layout's.
Static checks, before any SSH: what the NIXL handshake compares (image = vLLM and connector
version, model and revision, KV cache dtype, attention backend, speculative method) is equal in
both pools, one line per difference; TP, block counts and speculative token counts may differ.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable

from ...errors import Problem
from ...inventory import IMAGE_RE, Host, Inventory, origin_of, set_by_default
from ...facts.host import HostFacts, on_host
from ...plan.layout import Layout, Proof
from ...plan.spec import (HEAD_ADDR, ContainerSpec, Dial, Endpoint, Gate, GpuRequest, LaunchPlan, Mount, RdmaRequest,
                          Service, Stage, is_loopback)
from ...engines import kernels
from ...engines.vllm import (KV_LINE, NCCL_SO_SETUP, NO_EXPANDABLE_SEGMENTS, READY_LINE, VllmConfig, all2all_notes,
                             all2all_problem, kv_transfer_config, nccl_env, rank_nccl_env, serve_command,
                             service_env_path)

if TYPE_CHECKING:
    from ...report import Report
    from ...transport.runner import Runner

POOLS = ("prefill", "decode")
# the cluster-wide variables pd compares itself (its pools may differ in TP and ports; the NIXL handshake's
# own terms, one line per difference, for the rest)
OWN_CHECKS = ("vllm_image", "vllm_port", "vllm_master_port", "vllm_tensor_parallel_size", "model_repo",
              "model_revision")
ROLE = {"prefill": "kv_producer", "decode": "kv_consumer"}
PROXY_READY = "/health"
# what the NIXL handshake's compatibility hash covers, as inventory variables (nixl_connector_compatibility.md)
COMPARED = (("vllm_image", "the image (vLLM and NIXL connector version)"), ("model_repo", "the model"),
            ("model_revision", "the model revision"), ("vllm_kv_cache_dtype", "the KV cache dtype"),
            ("attention_backend", "the attention backend"), ("speculative_method", "the speculative method"))


def pool_of(h: Host) -> str | None:
    return next((p for p in POOLS if p in h.groups), None)


def url_of(svc: Service) -> str:
    """How the proxy names an instance (its --prefill / --decode argument, and its /workers entries)."""
    return f"http://{svc.spec.bind}:{svc.spec.ports[0]}"


def serving(plan: LaunchPlan) -> list[Service]:
    """The instances that serve an API: each single-host instance and the head of each multi-host one."""
    return [s for s in plan.services() if s.role in POOLS and not s.rank]


def members(plan: LaunchPlan) -> list[Service]:
    """Every container of the pools: the serving instances and the headless ranks of multi-host ones."""
    return [s for s in plan.services() if s.role in POOLS]


@dataclass(frozen=True)
class PoolVars:
    """A host's variables with its pool's defaults filled in where the inventory set nothing."""

    values: dict
    origins: dict  # key -> (file, key path) for problem lines

    def origin(self, key: str) -> tuple[str, str]:
        return self.origins.get(key, ("(defaults)", key))


def pool_vars(h: Host) -> PoolVars:
    pool = pool_of(h)
    values, origins = dict(h.vars), dict(h.origins)
    if pool:
        dfile, dkey = origin_of(h, f"pd_{pool}_defaults")
        for k, val in h.vars[f"pd_{pool}_defaults"].items():
            if k in values and set_by_default(h, k):
                values[k] = val
                origins[k] = (dfile, f"{dkey}.{k}")
    return PoolVars(values, origins)


def _attention_backend(v: dict) -> str:
    """The --attention-backend the instance is given ("": vLLM picks one for the GPU). vLLM 0.30 reads no
    VLLM_ATTENTION_BACKEND any more: the engine uses what the flag says, and that is what the handshake compares."""
    args = [str(a) for a in list(v["vllm_flags"]) + list(v["vllm_extra_args"])]
    found = ""
    for i, a in enumerate(args):   # the last one given wins, as in vLLM's parser
        if a == "--attention-backend" and i + 1 < len(args):
            found = args[i + 1]
        elif a.startswith("--attention-backend="):
            found = a.split("=", 1)[1]
    return found


def _ignored_env_notes(hosts: list[Host]) -> tuple[str, ...]:
    if any("VLLM_ATTENTION_BACKEND" in pool_vars(h).values["vllm_extra_env"] for h in hosts):
        return ("vllm_extra_env sets VLLM_ATTENTION_BACKEND, which vLLM 0.30 no longer reads (the engine picks "
                "the backend for its GPU): give --attention-backend in vllm_extra_args instead",)
    return ()


def compared(v: dict) -> dict:
    spec = v["vllm_speculative_config"] or {}
    return {"vllm_image": v["vllm_image"], "model_repo": v["model_repo"], "model_revision": v["model_revision"],
            "vllm_kv_cache_dtype": v["vllm_kv_cache_dtype"] or "auto", "attention_backend": _attention_backend(v),
            "speculative_method": spec.get("method", "") if isinstance(spec, dict) else ""}


def _origin_key(key: str) -> str:
    return {"attention_backend": "vllm_extra_args", "speculative_method": "vllm_speculative_config"}.get(key, key)


class Pd(Layout, name="pd"):
    own_checks = OWN_CHECKS
    ranks_span_hosts = True

    def rank_env(self, inv: Inventory, host: Host) -> dict[str, str]:
        """The reference's NCCL environment for the host's serving rail, then vllm_extra_env."""
        return rank_nccl_env(host) | super().rank_env(inv, host)

    def final_gate(self, plan: LaunchPlan, runner: Runner) -> Proof:
        """One real request through the proxy over one KV block, prefilled in one pool and decoded in the
        other with a NIXL transfer (railyard.layouts.pd.proof)."""
        from .proof import prove
        proof = prove(plan, runner, int(plan.service(plan.endpoint.service).expects("proof_words", "64")))
        return Proof(proof.ok, proof.detail, proof.fix or "inv logs --rank prefill-0 / decode-0; inv verify-rdma",
                     "the P->D path")

    def verify_rdma(self, inv: Inventory, runner: Runner, plan: LaunchPlan) -> list:
        from .verify import verify_nixl
        return verify_nixl(inv, runner, plan)

    def rdma_report(self, verdicts: list) -> Report:
        from .verify import nixl_report
        return nixl_report(verdicts)

    def recovery(self, inv: Inventory, runner: Runner, plan: LaunchPlan, target: str | None, found: Any) -> Any:
        """One instance alone, or the proxy alone; otherwise the group path (railyard.layouts.pd.recover)."""
        from .recover import survey
        return survey(plan, runner, target, found.verdicts)

    def restore(self, inv: Inventory, runner: Runner, plan: LaunchPlan, rec: Any, timeout: float,
                drain_timeout: float, show: Any) -> Any:
        from .recover import restore
        return restore(inv, runner, plan, rec, timeout, show)

    def canary_targets(self, plan: LaunchPlan) -> list:
        """Each prefill/decode pair, asked as the proxy asks it, then the proxy (railyard.layouts.pd.canary)."""
        from .canary import targets
        return targets(plan)

    def api_probes(self, plan: LaunchPlan, cache_proof: int) -> Callable:
        from .health import api_probes
        return api_probes(int(plan.service(plan.endpoint.service).expects("proof_words", "64")))


    def pool(self, inv: Inventory, pool: str) -> list[Host]:
        return [h for h in inv.hosts if pool_of(h) == pool]

    def proxy_host(self, inv: Inventory) -> Host | None:
        prefill = self.pool(inv, "prefill")
        want = inv.head.vars["pd_proxy_host"]
        if want:
            return next((h for h in inv.hosts if h.name == want), None)
        return prefill[0] if prefill else None

    def hosts(self, inv: Inventory) -> list[Host]:
        return [h for h in inv.hosts if pool_of(h)] or list(inv.hosts)

    def needs(self, inv: Inventory) -> tuple[set[str], int]:
        counts = []
        for h in self.hosts(inv):
            v = pool_vars(h).values
            span = max(1, int(v["pd_hosts_per_instance"]))
            counts.append(int(v["pd_instances_per_host"]) * VllmConfig.from_vars(v).world_size // span)
        return {"gids", "topology"}, max(counts or [1])

    def validate(self, inv: Inventory) -> list[Problem]:
        out: list[Problem] = []
        path = str(inv.path)
        for pool in POOLS:
            if not self.pool(inv, pool):
                out.append(Problem(path, f"all.children.{pool}", "(none)",
                                   f"serve_layout pd needs hosts in a group `{pool}` (its instances run there)"))
        both = [h for h in inv.hosts if "prefill" in h.groups and "decode" in h.groups]
        for h in both:
            out.append(Problem(path, f"all.children.decode.hosts.{h.name}", h.name,
                               "a host serves one pool: it is in both `prefill` and `decode`"))
        if out:
            return out
        proxy = self.proxy_host(inv)
        if proxy is None:
            file_, key = origin_of(inv.head, "pd_proxy_host")
            out.append(Problem(file_, key, inv.head.vars["pd_proxy_host"], "no such host in the inventory"))
        v0 = inv.head.vars
        if not is_loopback(v0["pd_proxy_bind"]) and not v0["pd_proxy_unauthenticated_ok"]:
            file_, key = origin_of(inv.head, "pd_proxy_bind")
            out.append(Problem(file_, key, v0["pd_proxy_bind"],
                               "vllm-router checks no client key (and passes none on): on an address other than this "
                               "host's loopback anyone who reaches it is served; put a gateway with a key in front, or "
                               "set pd_proxy_unauthenticated_ok: true if the network is closed"))
        if not v0["pd_proxy_image"]:
            file_, key = origin_of(inv.head, "pd_proxy_image")
            out.append(Problem(file_, key, "", "required: the proxy image (vllm-router) pinned by digest, "
                                               "name:tag@sha256:<64 hex>"))
        elif not IMAGE_RE.match(v0["pd_proxy_image"]):
            file_, key = origin_of(inv.head, "pd_proxy_image")
            out.append(Problem(file_, key, v0["pd_proxy_image"], "must be pinned by digest: name:tag@sha256:<64 hex>"))
        if v0["pd_proof_words"] <= 16:
            file_, key = origin_of(inv.head, "pd_proof_words")
            out.append(Problem(file_, key, v0["pd_proof_words"], "the proof prompt must be longer than one KV block "
                                                                 "(16 tokens), or no block moves and nothing is proven"))
        for h in self.hosts(inv):
            out += self._host_checks(h)
        for pool in POOLS:
            out += self._span_checks(inv, pool)
        ref = self.pool(inv, "prefill")[0]
        ref_vals = compared(pool_vars(ref).values)
        for h in self.pool(inv, "decode") + self.pool(inv, "prefill")[1:]:
            pv = pool_vars(h)
            for key, what in COMPARED:
                mine = compared(pv.values)[key]
                if mine != ref_vals[key]:
                    file_, where = pv.origin(_origin_key(key))
                    out.append(Problem(file_, where, mine,
                                       f"{what} differs from prefill host {ref.name} ({ref_vals[key]!r}): the NIXL "
                                       "handshake between prefill and decode would refuse with a compatibility hash "
                                       "mismatch; make them equal"))
            gpu, ref_gpu = pv.values["cluster_gpu_name"], pool_vars(ref).values["cluster_gpu_name"]
            if gpu != ref_gpu and not compared(pv.values)["attention_backend"] and not ref_vals["attention_backend"]:
                file_, where = pv.origin("cluster_gpu_name")
                out.append(Problem(file_, where, gpu,
                                   f"another GPU than prefill host {ref.name} ({ref_gpu!r}) and no --attention-backend "
                                   "in either: vLLM picks the attention backend per GPU, and the NIXL handshake "
                                   "compares it (a compatibility hash mismatch); set the same --attention-backend in "
                                   "both pools' vllm_extra_args"))
        return out

    def _host_checks(self, h: Host) -> list[Problem]:
        pv = pool_vars(h)
        v = pv.values
        out = []

        def bad(key: str, value, message: str) -> None:
            file_, where = pv.origin(key)
            out.append(Problem(file_, where, value, message))

        cfg = VllmConfig.from_vars(v)
        n = int(v["pd_instances_per_host"])
        span = int(v["pd_hosts_per_instance"])
        dp = cfg.data_parallel_size
        if n < 1 or span < 1:
            bad("pd_instances_per_host" if n < 1 else "pd_hosts_per_instance", n if n < 1 else span, "must be at least 1")
            return out
        if span > 1 and n != 1:
            bad("pd_instances_per_host", n, f"must be 1 when an instance spans hosts (pd_hosts_per_instance: {span})")
            return out
        if dp % span:
            bad("vllm_data_parallel_size", dp, f"does not split over pd_hosts_per_instance: {span} hosts; each host "
                                              "of an instance runs the same number of DP ranks")
            return out
        local = dp // span
        if n * cfg.world_size // span != v["cluster_gpus_per_host"]:
            over = f" per host ({dp} over {span} hosts)" if span > 1 else ""
            bad("pd_instances_per_host", n, f"{n} instances x tensor {cfg.tensor_parallel_size} x pipeline "
                                            f"{cfg.pipeline_parallel_size} x data {local}{over} = "
                                            f"{n * cfg.world_size // span} GPUs on {h.name}; the host gives "
                                            f"cluster_gpus_per_host: {v['cluster_gpus_per_host']}")
        if why := all2all_problem(cfg.all2all_backend, cfg.vllm):
            bad("vllm_all2all_backend", cfg.all2all_backend, why)
        last = cfg.port + n - 1
        side = v["pd_side_channel_port"]
        side_last = side + n * cfg.data_parallel_size - 1
        if last > 65535 or side_last > 65535:
            bad("vllm_port" if last > 65535 else "pd_side_channel_port", cfg.port if last > 65535 else side,
                "the instances' ports run past 65535")
        elif side <= last and cfg.port <= side_last:
            bad("pd_side_channel_port", side, f"the side-channel ports {side}-{side_last} overlap the API ports "
                                              f"{cfg.port}-{last} on {h.name}")
        rpc = v["pd_dp_rpc_port"]
        if span > 1 and (cfg.port <= rpc <= last or side <= rpc <= side_last):
            bad("pd_dp_rpc_port", rpc, f"is one of the instance's API or side-channel ports on {h.name}")
        return out

    def _span_checks(self, inv: Inventory, pool: str) -> list[Problem]:
        """An instance over several hosts takes them in order: one span for the pool, and hosts for whole instances."""
        hosts = self.pool(inv, pool)
        if not hosts:
            return []
        first = pool_vars(hosts[0])
        span = first.values["pd_hosts_per_instance"]
        for h in hosts[1:]:
            pv = pool_vars(h)
            if pv.values["pd_hosts_per_instance"] != span:
                file_, where = pv.origin("pd_hosts_per_instance")
                return [Problem(file_, where, pv.values["pd_hosts_per_instance"],
                                f"differs from {hosts[0].name} ({span}) in the pool `{pool}`; set it in the pool's "
                                "group vars")]
        if span > 1 and len(hosts) % span:
            file_, where = first.origin("pd_hosts_per_instance")
            return [Problem(file_, where, span, f"the pool `{pool}` has {len(hosts)} hosts "
                                                f"({', '.join(h.name for h in hosts)}): not whole instances of {span}")]
        return []

    def placements(self, inv: Inventory) -> list[tuple[Host, str, int, int, int, Host | None]]:
        """Where each instance (or each node of one over several hosts) runs, in plan order:
        (host, pool, k: its index on the host, number: its index in the pool, node, the instance's first host
        when it spans hosts, else None)."""
        out: list[tuple[Host, str, int, int, int, Host | None]] = []
        numbers = {p: 0 for p in POOLS}
        taken: set[str] = set()
        for h in self.hosts(inv):
            if h.name in taken:
                continue
            pool = pool_of(h)
            assert pool is not None  # validate(): both pools have hosts, so hosts() is the pools' hosts
            v = pool_vars(h).values
            span = int(v["pd_hosts_per_instance"])
            if span > 1:  # h and the next span-1 hosts of its pool: one instance
                hosts = self.pool(inv, pool)
                group = hosts[hosts.index(h):hosts.index(h) + span]
                taken.update(x.name for x in group)
                out += [(x, pool, 0, numbers[pool], node, group[0]) for node, x in enumerate(group)]
                numbers[pool] += 1
                continue
            for k in range(int(v["pd_instances_per_host"])):
                out.append((h, pool, k, numbers[pool], 0, None))
                numbers[pool] += 1
        return out

    def dials(self, inv: Inventory) -> list[Dial]:
        """The decode hosts fetch each prefill rank's NIXL metadata at its side channel (VLLM_NIXL_SIDE_CHANNEL_HOST,
        the port + the rank's DP index); the proxy host calls every instance's API; the other nodes of an
        instance over several hosts join its first at --data-parallel-address:--data-parallel-rpc-port. The KV
        itself moves over UCX on ports it picks at run time: no port to try there."""
        places = self.placements(inv)
        decode_hosts = list(dict.fromkeys(h.name for h, pool, *_ in places if pool == "decode"))
        proxy = self.proxy_host(inv)
        out: list[Dial] = []
        for h, pool, k, number, node, first in places:
            v = pool_vars(h).values
            cfg = VllmConfig.from_vars(v)
            name = f"{pool}-{number}" + (f"-node{node}" if node else "")
            ip = h.serve_rail.ip
            if node:
                assert first is not None  # a node past the first is in an instance over several hosts
                out.append(Dial(h.name, first.name, first.serve_rail.ip, int(v["pd_dp_rpc_port"]),
                                f"{pool}-{number}'s DP RPC port"))
            elif proxy is not None:
                out.append(Dial(proxy.name, h.name, ip, cfg.port + k, f"{name}'s API"))
            if pool == "prefill":
                local = cfg.data_parallel_size // (int(v["pd_hosts_per_instance"]) if first else 1)
                base = int(v["pd_side_channel_port"]) + k * cfg.data_parallel_size + node * local
                out += [Dial(d, h.name, ip, base + i, f"{name}'s NIXL side channel, DP rank {node * local + i}")
                        for d in decode_hosts for i in range(local)]
        return [d for d in out if d.src != d.dst]

    def plan(self, inv: Inventory, facts: dict[str, HostFacts], order: str | None = None) -> LaunchPlan:
        head = inv.head
        dep = head.vars["vllm_container"]
        instances: list[Service] = []
        headless: list[Service] = []
        for h, pool, k, number, node, first in self.placements(inv):
            svc = self._instance(inv, h, facts[h.name], pool, k, number, dep, node, first)
            (headless if node else instances).append(svc)
        proxy = self._proxy(inv, facts, instances, dep)
        headless_stage = (Stage(tuple(headless)),) if headless else ()
        return LaunchPlan(deployment=dep, layout=self.name,
                          stages=headless_stage + (Stage(tuple(instances), wait="ready"), Stage((proxy,), wait="ready")),
                          endpoint=Endpoint(proxy.name, proxy.host, proxy.spec.bind, proxy.spec.ports[0], "",
                                            head.vars["model_repo"]),
                          notes=all2all_notes(pool_vars(h).values["vllm_all2all_backend"] or "" for h in self.hosts(inv))
                          + _ignored_env_notes(self.hosts(inv)), dials=tuple(self.dials(inv)))

    def _instance(self, inv: Inventory, h: Host, f: HostFacts, pool: str, k: int, number: int, dep: str,
                  node: int = 0, head: Host | None = None) -> Service:
        """Instance `number` of the pool (its k-th on h), or node `node` of one whose first host is `head`."""
        v = pool_vars(h).values
        cfg = VllmConfig.from_vars(v)
        rail = h.serve_rail
        span = int(v["pd_hosts_per_instance"]) if head else 1
        per_host = cfg.world_size // span
        local = cfg.data_parallel_size // span
        mine = f.gpus[k * per_host:(k + 1) * per_host]
        cpuset = f.cpus_of(mine) if cfg.cpuset == "auto" else cfg.cpuset
        port = cfg.port + k
        side = v["pd_side_channel_port"] + k * cfg.data_parallel_size
        devices = v["pd_ucx_net_devices"]
        if devices == "auto":
            devices = ",".join(f"{r.hca}:1" for r in h.rails.values())
        name = f"{pool}-{number}" + (f"-node{node}" if node else "")
        lease = int(v["pd_kv_lease_s"])
        kv = kv_transfer_config(cfg.vllm.nixl, ROLE[pool],
                                {"kv_buffer_device": v["pd_kv_buffer_device"]} if v["pd_kv_buffer_device"] else {},
                                {"kv_lease_duration": lease} if lease else {})
        group_args: list = []
        if span > 1:
            group_args = ["--data-parallel-size-local", str(local), "--data-parallel-address", HEAD_ADDR,
                          "--data-parallel-rpc-port", str(v["pd_dp_rpc_port"])]
            if node:
                group_args += ["--data-parallel-start-rank", str(node * local)]
        command = serve_command(replace(cfg, bind=rail.ip), group_args, headless=node > 0) + ("--kv-transfer-config", kv)
        values = {"rail_hca": rail.hca, "gid_index": f.gid_index, "rail_iface": rail.name, "node_ip": rail.ip}
        # the DP/EP ranks inside the instance still talk NCCL; no expandable_segments: its CUDA VMM
        # remaps the KV cache NIXL registered, and vLLM (0.32) refuses it beside any KV connector
        env = dict(nccl_env(values, drop=(NO_EXPANDABLE_SEGMENTS,), version=cfg.vllm))
        env.update({"UCX_TLS": v["pd_ucx_tls"], "UCX_NET_DEVICES": devices, "UCX_LOG_LEVEL": "info",
                    "VLLM_NIXL_SIDE_CHANNEL_HOST": rail.ip, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side)})
        env.update(dict(cfg.extra_env))
        model_host = on_host(v["model_path"], f.home)
        spec = ContainerSpec(
            name=f"{dep}-{name}", image=cfg.image, command=command, env=tuple(env.items()), setup=(NCCL_SO_SETUP,),
            gpus=GpuRequest(len(mine), tuple(g.uuid for g in mine), v["cluster_gpu_name"]),
            rdma=RdmaRequest(tuple(r.hca for r in h.rails.values())),
            mounts=(Mount(model_host, "/model", True, "model"),) + kernels.mounts(v, f.home),
            ports=(port,), bind=rail.ip,
            shm_size=cfg.shm_size, cpuset=cpuset, ulimits=(("stack", "67108864"),),
            labels=(("railyard.layout", self.name), ("railyard.pool", pool), ("railyard.service", name)))
        ready = [Gate("log", pattern=READY_LINE), Gate("http", path="/health")]
        if local > 1:
            ready.append(Gate("kv_engines", pattern=KV_LINE, count=local))
        if node:  # a headless rank serves no API; its head is ready only once every rank has joined it
            ready = []
        env_file: tuple[tuple[str, object], ...] = (("LAYOUT", self.name), ("SERVICE", name), ("POOL", pool), ("HOST", h.name), ("DEPLOYMENT", dep),
                    ("GPU_UUIDS", ",".join(g.uuid for g in mine)), ("CPUSET", cpuset),
                    ("TP", cfg.tensor_parallel_size), ("DP", cfg.data_parallel_size),
                    ("EP", int(cfg.enable_expert_parallel)), ("KV_ROLE", ROLE[pool]), ("IMG", cfg.image),
                    ("MODEL_REPO", v["model_repo"]), ("MODEL_REV", v["model_revision"]), ("MODEL_HOST", model_host),
                    ("PORT", port), ("API_BIND", rail.ip), ("NIXL_SIDE_CHANNEL", f"{rail.ip}:{side}"),
                    ("UCX_NET_DEVICES", devices), ("UCX_TLS", v["pd_ucx_tls"]))
        expect: tuple = (("kv_engines", str(local)),)
        if span > 1:
            assert head is not None  # placements() gives each node of an instance over several hosts its first host
            env_file += (("NODE", node), ("DP_LOCAL", local), ("DP_START_RANK", node * local),
                         ("DP_ADDRESS", f"{head.serve_rail.ip}:{v['pd_dp_rpc_port']}"))
            expect += (("dp_start", str(node * local)),)
        return Service(name=name, role=pool, host=h.name, spec=spec, ready=tuple(ready),
                       env_file=tuple((a, str(b)) for a, b in env_file), env_path=service_env_path(cfg.env_file, name),
                       expect=expect, address=rail.ip, rank=node if span > 1 else None,
                       group=f"{pool}-{number}" if span > 1 else "", group_size=span)

    def _proxy(self, inv: Inventory, facts: dict[str, HostFacts], instances: list[Service], dep: str) -> Service:
        h = self.proxy_host(inv)
        assert h is not None  # validate() names a pd_proxy_host that is not in the inventory
        v = h.vars
        urls = {p: [url_of(s) for s in instances if s.role == p] for p in POOLS}
        command = ["vllm-router", "--vllm-pd-disaggregation", "--kv-connector", "nixl"]
        for u in urls["prefill"]:
            command += ["--prefill", u]
        for u in urls["decode"]:
            command += ["--decode", u]
        command += ["--policy", v["pd_proxy_policy"], "--host", v["pd_proxy_bind"], "--port", str(v["pd_proxy_port"]),
                    "--request-timeout-secs", str(v["pd_proxy_request_timeout_s"]),
                    "--retry-max-retries", str(v["pd_proxy_retries"]),
                    "--health-check-interval-secs", str(v["pd_proxy_health_interval_s"]),
                    "--health-failure-threshold", str(v["pd_proxy_health_failures"])]
        spec = ContainerSpec(
            name=f"{dep}-proxy", image=v["pd_proxy_image"], command=tuple(command), ports=(int(v["pd_proxy_port"]),),
            bind=v["pd_proxy_bind"], host_ipc=False, labels=(("railyard.layout", self.name), ("railyard.service", "proxy")))
        env_file = (("LAYOUT", self.name), ("SERVICE", "proxy"), ("HOST", h.name), ("DEPLOYMENT", dep),
                    ("IMG", v["pd_proxy_image"]), ("API_BIND", v["pd_proxy_bind"]), ("PORT", v["pd_proxy_port"]),
                    ("PREFILL", ",".join(urls["prefill"])), ("DECODE", ",".join(urls["decode"])))
        return Service(name="proxy", role="proxy", host=h.name, spec=spec, ready=(Gate("http", path=PROXY_READY),),
                       env_file=tuple((a, str(b)) for a, b in env_file), env_path=service_env_path(v["vllm_env_file"], "proxy"),
                       expect=(("gpu_process", "none"), ("proof_words", str(v["pd_proof_words"]))))
