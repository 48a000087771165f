"""The one-host layouts: one vLLM engine on N GPUs of one host.

`single_node_tp`: tensor (and pipeline) parallel over the host's GPUs, one engine, one KV cache
(`vllm serve M -tp 8 ...`). `dp_ep`: DP attention + expert parallel, one engine core and one KV
cache per DP rank (`vllm serve M -dp 8 -tp 1 --enable-expert-parallel`); ready when /health
answers and every DP rank has logged its KV cache size.

The host is the inventory's only host, or the one host of the group `serve`. Its GPUs are the
first N (by index) whose name matches cluster_gpu_name, and the container is pinned to their
NUMA nodes' CPUs (vllm_cpuset: auto).
"""

from __future__ import annotations

from ...errors import Problem
from ...inventory import Host, Inventory, origin_of, set_by_default
from ...facts.host import HostFacts, on_host
from ...plan.layout import KvPlanRow, Layout
from ...plan.spec import ContainerSpec, Dial, Endpoint, Gate, GpuRequest, LaunchPlan, Mount, Secret, Service, Stage
from ...engines import kernels
from ...engines.vllm import (API_KEY_TARGET, KV_LINE, NCCL_SO_SETUP, READY_LINE, VllmConfig, all2all_notes,
                             all2all_problem, serve_command)

SERVE_GROUP = "serve"


def serve_hosts(inv: Inventory) -> list[Host]:
    """The hosts of the group `serve`, or every host when there is no such group."""
    chosen = [h for h in inv.hosts if SERVE_GROUP in h.groups]
    return chosen or list(inv.hosts)


def _set_by_user(h: Host, keys: tuple[str, ...]) -> str:
    """The first of keys the inventory or --set gave a value (not a role or layout default)."""
    for k in keys:
        if not set_by_default(h, k):
            return k
    return keys[0]


class SingleNodeTP(Layout, name="single_node_tp"):
    role = "engine"
    kv_plan = KvPlanRow("TP={n} (one engine)", False,
                        "one engine; each GPU holds every token's latent (MLA) or its share of the KV heads (GQA)")

    def hosts(self, inv: Inventory) -> list[Host]:
        return serve_hosts(inv)[:1]

    def dials(self, inv: Inventory) -> list[Dial]:
        """One host: no connection of the deployment crosses to another."""
        return []

    def needs(self, inv: Inventory) -> tuple[set[str], int]:
        h = self.hosts(inv)[0]
        return ({"topology"} if h.vars["vllm_cpuset"] == "auto" else set()), VllmConfig.from_vars(h.vars).world_size

    def validate(self, inv: Inventory) -> list[Problem]:
        out: list[Problem] = []
        hosts = serve_hosts(inv)
        if len(hosts) != 1:
            out.append(Problem(str(inv.path), "all.children.serve", ", ".join(h.name for h in hosts),
                               f"serve_layout {self.name} runs on one host: list exactly one in a group `serve`"))
            return out
        h = hosts[0]
        v = h.vars
        cfg = VllmConfig.from_vars(v)
        gpus = v["cluster_gpus_per_host"]
        if cfg.world_size != gpus:
            blame = _set_by_user(h, ("vllm_data_parallel_size", "vllm_tensor_parallel_size",
                                     "vllm_pipeline_parallel_size", "cluster_gpus_per_host"))
            file_, key = origin_of(h, blame)
            out.append(Problem(file_, key, v[blame],
                               f"tensor {cfg.tensor_parallel_size} x pipeline {cfg.pipeline_parallel_size} x data "
                               f"{cfg.data_parallel_size} parallel = {cfg.world_size} must equal the GPUs the host "
                               f"gives it (cluster_gpus_per_host: {gpus})"))
        out += self._own_checks(h, cfg)
        return out

    def _own_checks(self, h: Host, cfg: VllmConfig) -> list[Problem]:
        if cfg.data_parallel_size != 1:
            file_, key = origin_of(h, "vllm_data_parallel_size")
            return [Problem(file_, key, cfg.data_parallel_size,
                            "single_node_tp runs one engine: use serve_layout dp_ep for data parallel")]
        return []

    def plan(self, inv: Inventory, facts: dict[str, HostFacts], order: str | None = None) -> LaunchPlan:
        h = self.hosts(inv)[0]
        f = facts[h.name]
        cfg = VllmConfig.from_vars(h.vars)
        gpus = f.gpus[:cfg.world_size]
        cpuset = f.cpus_of(gpus) if cfg.cpuset == "auto" else cfg.cpuset
        key = on_host(cfg.api_key_file, f.home)
        model_host = on_host(h.vars["model_path"], f.home)
        spec = ContainerSpec(
            name=cfg.container, image=cfg.image, command=serve_command(cfg), env=cfg.extra_env, setup=(NCCL_SO_SETUP,),
            gpus=GpuRequest(len(gpus), tuple(g.uuid for g in gpus), h.vars["cluster_gpu_name"]),
            mounts=(Mount(model_host, "/model", True, "model"),) + kernels.mounts(h.vars, f.home),
            secrets=(Secret("VLLM_API_KEY", key, API_KEY_TARGET),),
            ports=(cfg.port,), bind=cfg.bind, shm_size=cfg.shm_size, cpuset=cpuset, ulimits=(("stack", "67108864"),),
            labels=(("railyard.layout", self.name),))
        dp = cfg.data_parallel_size
        ready = [Gate("log", pattern=READY_LINE), Gate("http", path="/health")]
        if dp > 1:
            ready.append(Gate("kv_engines", pattern=KV_LINE, count=dp))
        env_file = (("LAYOUT", self.name), ("SERVICE", self.role), ("HOST", h.name),
                    ("GPU_UUIDS", ",".join(g.uuid for g in gpus)), ("CPUSET", cpuset),
                    ("TP", cfg.tensor_parallel_size), ("PP", cfg.pipeline_parallel_size), ("DP", dp),
                    ("EP", int(cfg.enable_expert_parallel)), ("IMG", cfg.image), ("MODEL_REPO", h.vars["model_repo"]),
                    ("MODEL_REV", h.vars["model_revision"]), ("MODEL_HOST", model_host), ("CONTAINER", cfg.container),
                    ("PORT", cfg.port), ("API_BIND", cfg.bind))
        svc = Service(name=self.role, role=self.role, host=h.name, spec=spec, ready=tuple(ready),
                      env_file=tuple((k, str(x)) for k, x in env_file), env_path=cfg.env_file,
                      expect=(("kv_engines", str(dp)),))
        return LaunchPlan(deployment=cfg.container, layout=self.name, stages=(Stage((svc,), wait="ready"),),
                          endpoint=Endpoint(svc.name, h.name, cfg.bind, cfg.port, key, cfg.served_model_name),
                          verifiers=("kv_engines",) if dp > 1 else (), notes=all2all_notes([cfg.all2all_backend], cfg.vllm))


class DpEp(SingleNodeTP, name="dp_ep"):
    kv_plan = KvPlanRow("DP={n} + EP (attention DP, experts EP)", True,
                        "one engine and one KV cache per GPU, node = sum of ranks")

    def _own_checks(self, h: Host, cfg: VllmConfig) -> list[Problem]:
        out = []
        if not cfg.enable_expert_parallel:
            file_, key = origin_of(h, "vllm_enable_expert_parallel")
            out.append(Problem(file_, key, False, "dp_ep needs expert parallel: set it true (or use single_node_tp)"))
        if cfg.data_parallel_size < 2:
            file_, key = origin_of(h, "vllm_data_parallel_size")
            out.append(Problem(file_, key, cfg.data_parallel_size, "dp_ep needs a data parallel size of at least 2"))
        if why := all2all_problem(cfg.all2all_backend, cfg.vllm):
            file_, key = origin_of(h, "vllm_all2all_backend")
            out.append(Problem(file_, key, cfg.all2all_backend, why))
        if cfg.api_server_count > cfg.data_parallel_size:
            file_, key = origin_of(h, "vllm_api_server_count")
            out.append(Problem(file_, key, cfg.api_server_count, "more API servers than DP ranks"))
        return out

