"""`replicas`: N independent vLLM engines on one host (2 x TP4 or 4 x TP2 on 8 GPUs), one shared
LMCache server holding KV blocks in host memory, and a LiteLLM router in front.

    stage 1  lmcache   `lmcache server`, all the replicas' GPUs, host IPC, memlock; ready: /healthcheck
    stage 2  r0..rN-1  `vllm serve ... --kv-transfer-config {LMCacheMPConnector}`, disjoint GPUs by UUID,
                       pinned to their NUMA node's CPUs, port vllm_port + i on 127.0.0.1, own TMPDIR and
                       compile cache; ready: startup line, the connector registered its KV caches, /health
    stage 3  router    LiteLLM, one model name over the replicas, the API key (its master key);
                       ready: /health/liveliness and /health/readiness (its /health calls the models)

Every replica and LMCache get the same PYTHONHASHSEED (vllm_hash_seed): otherwise their block
hashes differ and nothing is shared; the static checks refuse a second value.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from ...errors import Problem
from ...inventory import IMAGE_RE, Host, Inventory, origin_of
from ...facts.host import HostFacts, on_host
from ...engines import kernels
from ...engines.litellm import (CONFIG_TARGET, LIVE_PATH, MASTER_KEY_TARGET, READY_PATH, Backend, LitellmConfig,
                                config_yaml, drain_module, proxy_command)
from ...engines.lmcache import (EVICTION_POLICIES, HEALTH_PATH, TRANSFER_MODES, LmcacheConfig, kv_transfer_config,
                                server_command)
from ...engines.lmcache import READY_LINE as LMCACHE_READY
from ...engines.lmcache import REGISTERED_LINE
from ...plan.layout import Layout
from ...plan.spec import (ContainerSpec, Dial, Endpoint, File, Gate, GpuRequest, LaunchPlan, Mount, Secret, Service,
                          Stage, is_loopback)
from ...engines.vllm import READY_LINE, VllmConfig, serve_command, service_env_path
from ..single_node import serve_hosts

if TYPE_CHECKING:
    from ...transport.runner import Runner

HASH_SEED_MAX = 4294967295  # what Python accepts for PYTHONHASHSEED besides "random"


def replica_names(n: int) -> list[str]:
    return [f"r{i}" for i in range(n)]


class Replicas(Layout, name="replicas"):
    cache_proof = True

    def api_probes(self, plan: LaunchPlan, cache_proof: int) -> Callable:
        """Each replica, LMCache and the router (railyard.layouts.replicas.health), and the cache proof."""
        from .health import api_probes
        return api_probes(cache_proof)

    def canary_targets(self, plan: LaunchPlan) -> list[Endpoint]:
        """Each replica directly, then the router: a wrong replica is named, and what users get is judged."""
        return [Endpoint.of(x, plan.endpoint.model) for x in plan.services() if x.role == "replica"] + [plan.endpoint]

    def roll_steps(self, plan: LaunchPlan) -> list[str] | None:
        from .roll import steps
        return steps(plan)

    def roll(self, inv: Inventory, runner: Runner, old: LaunchPlan, new: LaunchPlan, record: Any, timeout: float,
             drain_timeout: float, show: Any) -> None:
        """One replica at a time (railyard.layouts.replicas.roll)."""
        from .roll import roll
        roll(inv, runner, old, new, record, timeout, drain_timeout, show)

    def recovery(self, inv: Inventory, runner: Runner, plan: LaunchPlan, target: str | None, found: Any) -> Any:
        """A crashed, hung or named replica: the short or the long path (railyard.layouts.replicas.recover)."""
        from .recover import survey
        return survey(plan, runner, target, found.verdicts)[0]

    def restore(self, inv: Inventory, runner: Runner, plan: LaunchPlan, rec: Any, timeout: float,
                drain_timeout: float, show: Any) -> Any:
        from .recover import restore
        return restore(inv, runner, plan, rec, timeout, drain_timeout, show)

    def hosts(self, inv: Inventory) -> list[Host]:
        return serve_hosts(inv)[:1]

    def dials(self, inv: Inventory) -> list[Dial]:
        """One host: no connection of the deployment crosses to another."""
        return []

    def needs(self, inv: Inventory) -> tuple[set[str], int]:
        v = self.hosts(inv)[0].vars
        cfg = VllmConfig.from_vars(v)
        return ({"topology"} if cfg.cpuset == "auto" else set()), int(v["vllm_replicas"]) * cfg.world_size

    def validate(self, inv: Inventory) -> list[Problem]:
        hosts = serve_hosts(inv)
        if len(hosts) != 1:
            return [Problem(str(inv.path), "all.children.serve", ", ".join(h.name for h in hosts),
                            f"serve_layout {self.name} runs on one host: list exactly one in a group `serve`")]
        h = hosts[0]
        v = h.vars
        out: list[Problem] = []

        def bad(key: str, message: str, value=None) -> None:
            file_, where = origin_of(h, key)
            out.append(Problem(file_, where, v[key] if value is None else value, message))

        cfg = VllmConfig.from_vars(v)
        n = int(v["vllm_replicas"])
        if n < 1:
            bad("vllm_replicas", "must be at least 1")
            return out
        if cfg.data_parallel_size != 1:
            bad("vllm_data_parallel_size", "each replica is one engine: data parallel is not for this layout "
                                           "(use serve_layout dp_ep)")
        if n * cfg.world_size != v["cluster_gpus_per_host"]:
            bad("vllm_replicas", f"{n} replicas x tensor {cfg.tensor_parallel_size} x pipeline "
                                 f"{cfg.pipeline_parallel_size} = {n * cfg.world_size} GPUs; the host gives "
                                 f"cluster_gpus_per_host: {v['cluster_gpus_per_host']}")
        if not is_loopback(cfg.bind):
            bad("vllm_bind", "replicas take no API key and must listen on this host only (127.0.0.1); clients "
                             "call the router (litellm_bind)")
        if not v["litellm_image"]:
            bad("litellm_image", "required: the LiteLLM image pinned by digest, name:tag@sha256:<64 hex>")
        elif not IMAGE_RE.match(v["litellm_image"]):
            bad("litellm_image", "must be pinned by digest: name:tag@sha256:<64 hex>")
        if v["lmcache_image"] and not IMAGE_RE.match(v["lmcache_image"]):
            bad("lmcache_image", 'must be "" (the vLLM image) or pinned by digest: name:tag@sha256:<64 hex>')
        if v["lmcache_eviction_policy"] not in EVICTION_POLICIES:
            bad("lmcache_eviction_policy", f"not an LMCache eviction policy ({', '.join(EVICTION_POLICIES)})")
        if v["lmcache_transfer_mode"] and v["lmcache_transfer_mode"] not in TRANSFER_MODES:
            bad("lmcache_transfer_mode", f'not an LMCache transfer mode ("", {", ".join(TRANSFER_MODES)})')
        if not v["lmcache_l1_size_gb"] > 0:
            bad("lmcache_l1_size_gb", "must be more than 0 (GB of host memory for KV blocks)")
        seed = v["vllm_hash_seed"]
        if not 0 <= seed <= HASH_SEED_MAX:
            bad("vllm_hash_seed", f"PYTHONHASHSEED must be one fixed value 0..{HASH_SEED_MAX} (not random), the same "
                                  "in every replica and LMCache")
        for key in ("vllm_extra_env", "lmcache_extra_env"):
            other = v[key].get("PYTHONHASHSEED")
            if other is not None and str(other) != str(seed):
                bad(key, f"PYTHONHASHSEED {other} differs from vllm_hash_seed {seed}: the replicas and LMCache "
                         "would hash prompts differently and share nothing; set only vllm_hash_seed",
                    value={"PYTHONHASHSEED": other})
        ports = {f"r{i}": cfg.port + i for i in range(n)}
        ports.update(lmcache=v["lmcache_port"], **{"lmcache http": v["lmcache_http_port"], "router": v["litellm_port"]})
        seen: dict[int, str] = {}
        for who, port in ports.items():
            if not 1 <= port <= 65535:
                bad("vllm_port", f"replica ports run from vllm_port to vllm_port + {n - 1}; {who} would get {port}")
            elif port in seen:
                key = {"router": "litellm_port", "lmcache": "lmcache_port", "lmcache http": "lmcache_http_port"}.get(
                    who, "vllm_port")
                bad(key, f"port {port} is taken twice ({seen[port]} and {who}); every service needs its own")
            seen.setdefault(port, who)
        return out

    def plan(self, inv: Inventory, facts: dict[str, HostFacts], order: str | None = None) -> LaunchPlan:
        h = self.hosts(inv)[0]
        v = h.vars
        f = facts[h.name]
        cfg = VllmConfig.from_vars(v)
        n = int(v["vllm_replicas"])
        lmc = LmcacheConfig.from_vars(v, n)
        router = LitellmConfig.from_vars(v)
        dep = cfg.container
        seed = str(v["vllm_hash_seed"])
        state = on_host(v["vllm_state_dir"], f.home).rstrip("/") + "/" + dep
        model_host = on_host(v["model_path"], f.home)
        labels = (("railyard.layout", self.name), ("railyard.deployment", dep))
        gpus = f.gpus[:n * cfg.world_size]

        def env_file(svc: str, *pairs) -> tuple[tuple[str, str], ...]:
            head = (("LAYOUT", self.name), ("SERVICE", svc), ("HOST", h.name), ("DEPLOYMENT", dep))
            return tuple((k, str(x)) for k, x in head + pairs)

        lmcache = Service(
            name="lmcache", role="lmcache", host=h.name,
            spec=ContainerSpec(
                name=f"{dep}-{v['lmcache_container_suffix']}", image=lmc.image, command=server_command(lmc),
                env=(("PYTHONHASHSEED", seed),) + lmc.extra_env,
                gpus=GpuRequest(len(gpus), tuple(g.uuid for g in gpus), v["cluster_gpu_name"]),
                ports=(lmc.http_port, lmc.port), bind=lmc.http_host, shm_size=lmc.shm_size,
                ulimits=(("memlock", "-1"),), labels=labels + (("railyard.service", "lmcache"),)),
            ready=(Gate("log", pattern=LMCACHE_READY), Gate("http", path=HEALTH_PATH)),
            env_file=env_file("lmcache", ("IMG", lmc.image), ("ZMQ", f"{lmc.host}:{lmc.port}"),
                              ("HTTP", f"{lmc.http_host}:{lmc.http_port}"), ("L1_SIZE_GB", f"{lmc.l1_size_gb:g}"),
                              ("EVICTION", lmc.eviction_policy), ("PYTHONHASHSEED", seed)),
            env_path=service_env_path(v["vllm_env_file"], "lmcache"), expect=(("gpu_process", "optional"),))

        kv_json = kv_transfer_config(lmc, cfg.vllm.lmcache)
        replicas = []
        for i, name in enumerate(replica_names(n)):
            mine = gpus[i * cfg.world_size:(i + 1) * cfg.world_size]
            cpuset = f.cpus_of(mine) if cfg.cpuset == "auto" else cfg.cpuset
            port = cfg.port + i
            command = serve_command(cfg) + (("--enable-prefix-caching",) if "--enable-prefix-caching" not in cfg.flags
                                            else ()) + ("--kv-transfer-config", kv_json)
            own = f"{state}/{name}"
            spec = ContainerSpec(
                name=f"{dep}-{name}", image=cfg.image, command=command,
                env=(("PYTHONHASHSEED", seed), ("TMPDIR", f"/tmp/{dep}")) + cfg.extra_env,
                gpus=GpuRequest(len(mine), tuple(g.uuid for g in mine), v["cluster_gpu_name"]),
                mounts=(Mount(model_host, "/model", True, "model"), Mount(f"{own}/tmp", f"/tmp/{dep}", False, "state"),
                        Mount(f"{own}/vllm-cache", "/root/.cache/vllm", False, "state")) + kernels.mounts(v, f.home),
                ports=(port,), bind=cfg.bind, shm_size=cfg.shm_size, cpuset=cpuset, ulimits=(("stack", "67108864"),),
                labels=labels + (("railyard.service", name),))
            replicas.append(Service(
                name=name, role="replica", host=h.name, spec=spec,
                ready=(Gate("log", pattern=READY_LINE), Gate("log", pattern=REGISTERED_LINE), Gate("http", path="/health")),
                env_file=env_file(name, ("GPU_UUIDS", ",".join(g.uuid for g in mine)), ("CPUSET", cpuset),
                                  ("TP", cfg.tensor_parallel_size), ("PP", cfg.pipeline_parallel_size),
                                  ("IMG", cfg.image), ("MODEL_REPO", v["model_repo"]), ("MODEL_REV", v["model_revision"]),
                                  ("MODEL_HOST", model_host), ("CONTAINER", spec.name), ("PORT", port),
                                  ("API_BIND", cfg.bind), ("PYTHONHASHSEED", seed), ("KV_TRANSFER_CONFIG", kv_json)),
                env_path=service_env_path(v["vllm_env_file"], name), expect=(("kv_engines", "1"),)))

        conf_dir = f"{state}/router"
        key = on_host(router.master_key_file, f.home)
        backends = [Backend(r.name, f"http://{r.spec.bind}:{r.spec.ports[0]}/v1") for r in replicas]
        front = Service(
            name="router", role="router", host=h.name,
            spec=ContainerSpec(
                name=f"{dep}-{v['litellm_container_suffix']}", image=router.image, command=proxy_command(router),
                env=(("LITELLM_LOCAL_MODEL_COST_MAP", "True"),),
                mounts=(Mount(conf_dir, CONFIG_TARGET, True, "bind"),),
                secrets=(Secret("LITELLM_MASTER_KEY", key, MASTER_KEY_TARGET, prefix="sk-"),),
                files=(File(f"{conf_dir}/config.yaml", config_yaml(router, cfg.served_model_name, backends)),
                       File(f"{conf_dir}/railyard_drain.py", drain_module())),
                ports=(router.port,), bind=router.bind, shell="sh", labels=labels + (("railyard.service", "router"),),
                host_ipc=False),
            ready=(Gate("http", path=LIVE_PATH), Gate("http", path=READY_PATH)),
            env_file=env_file("router", ("IMG", router.image), ("API_BIND", router.bind), ("PORT", router.port),
                              ("BACKENDS", ",".join(f"{b.id}={b.api_base}" for b in backends))),
            env_path=service_env_path(v["vllm_env_file"], "router"), expect=(("gpu_process", "none"),))

        return LaunchPlan(deployment=dep, layout=self.name,
                          stages=(Stage((lmcache,), wait="ready"), Stage(tuple(replicas), wait="ready"),
                                  Stage((front,), wait="ready")),
                          endpoint=Endpoint(front.name, h.name, router.bind, router.port, key, cfg.served_model_name))
