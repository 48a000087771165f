"""`multinode_tp`: one rank per host, one GPU per rank, tensor parallel across the hosts over a
RoCE rail (the two-DGX-Station reference). Rank 0 is the head and serves the API; the others
run `--headless` and join it at `--master-addr` on the rail.

Stages follow the start order (`--rank-order`, default workers first): each rank's container
must be up for 1.5 s before the next starts; then the head must log `Application startup
complete` and answer /health.
"""

from __future__ import annotations

from ...errors import Problem
from ...inventory import Host, Inventory, origin_of
from ...facts.host import HostFacts, on_host
from ...plan.layout import Layout
from ...plan.spec import (GID_INDEX, GROUP_SIZE, HEAD_ADDR, NODE_ADDR, NODE_RANK, ContainerSpec, Dial, Endpoint, Gate,
                          GpuRequest, LaunchPlan, Mount, RdmaRequest, Secret, Service, Stage, Value)
from ...engines import kernels
from ...engines.vllm import (API_KEY_TARGET, NCCL_SO_SETUP, READY_LINE, VllmConfig, nccl_env, rank_nccl_env,
                             serve_command)

GROUP = "tp"


class MultinodeTP(Layout, name="multinode_tp"):
    rank_order = True
    ranks_span_hosts = True

    def rank_env(self, inv: Inventory, host: Host) -> dict[str, str]:
        """The reference's NCCL environment for the host's serving rail, then vllm_extra_env."""
        return rank_nccl_env(host) | super().rank_env(inv, host)

    def hosts(self, inv: Inventory) -> list[Host]:
        return list(inv.hosts)

    def needs(self, inv: Inventory) -> tuple[set[str], int]:
        return {"gids"}, 1

    def validate(self, inv: Inventory) -> list[Problem]:
        head = inv.head
        v = head.vars
        out = []
        tp, pp = v["vllm_tensor_parallel_size"], v["vllm_pipeline_parallel_size"]
        pp_in_args = any(str(a).startswith(("--pipeline-parallel-size", "-pp")) for a in v["vllm_extra_args"])
        if tp * pp != len(inv.hosts) and not pp_in_args:
            file_, key = origin_of(head, "vllm_tensor_parallel_size")
            what = "" if pp == 1 else f"x vllm_pipeline_parallel_size {pp}: "
            out.append(Problem(file_, key, tp, f"{what}must equal the number of ranks "
                                               f"({len(inv.hosts)}): each rank serves one GPU (or set "
                                               "--pipeline-parallel-size in vllm_extra_args)"))
        if v["vllm_port"] == v["vllm_master_port"]:
            file_, key = origin_of(head, "vllm_master_port")
            out.append(Problem(file_, key, v["vllm_master_port"], "must differ from vllm_port on the head"))
        return out

    def plan(self, inv: Inventory, facts: dict[str, HostFacts], order: str | None = None) -> LaunchPlan:
        hosts = inv.ordered(order)
        services = {h.name: self._service(inv, h, facts[h.name]) for h in hosts}
        head = inv.head
        cfg = VllmConfig.from_vars(head.vars)
        key = on_host(cfg.api_key_file, facts[head.name].home)
        endpoint = Endpoint(services[head.name].name, head.name, cfg.bind, cfg.port, key, cfg.served_model_name)
        return LaunchPlan(deployment=cfg.container, layout=self.name,
                          stages=tuple(Stage((services[h.name],)) for h in hosts),
                          endpoint=endpoint, verifiers=("rdma",), dials=tuple(self.dials(inv)))

    def dials(self, inv: Inventory) -> list[Dial]:
        """Each worker joins the head's torch.distributed store at --master-addr:--master-port."""
        head = inv.head
        port = int(head.vars["vllm_master_port"])
        return [Dial(w.name, head.name, head.serve_rail.ip, port, "the head's master port") for w in inv.workers]

    def _service(self, inv: Inventory, h: Host, f: HostFacts) -> Service:
        cfg = VllmConfig.from_vars(h.vars)
        rail = h.serve_rail
        head_ip = inv.head.serve_rail.ip
        workers = [w.serve_rail.ip for w in inv.workers]
        peers = [p.serve_rail.ip for p in inv.hosts if p.name != h.name]
        values = {"rail_hca": rail.hca, "gid_index": GID_INDEX, "rail_iface": rail.name, "node_ip": NODE_ADDR}
        env = nccl_env(values, version=cfg.vllm) + list(cfg.extra_env)
        group_args: list[Value] = ["--nnodes", GROUP_SIZE, "--node-rank", NODE_RANK, "--master-addr", HEAD_ADDR,
                      "--master-port", str(cfg.master_port)]
        model_host = on_host(h.vars["model_path"], f.home)
        secrets = (Secret("VLLM_API_KEY", on_host(cfg.api_key_file, f.home), API_KEY_TARGET),) if h.is_head else ()
        spec = ContainerSpec(
            name=cfg.container, image=cfg.image, command=serve_command(cfg, group_args, headless=not h.is_head),
            env=tuple(_dedupe(env)), setup=(NCCL_SO_SETUP,), gpus=GpuRequest(1, (f.gpu_uuid or "",), h.vars["cluster_gpu_name"]),
            rdma=RdmaRequest((rail.hca,)),
            mounts=(Mount(model_host, "/model", True, "model"),) + kernels.mounts(h.vars, f.home),
            secrets=secrets,
            ports=(cfg.port,), bind=cfg.bind, shm_size=cfg.shm_size, ulimits=(("stack", "67108864"),),
            labels=(("railyard.rank", str(h.rank)),))
        env_file = [("RANK", h.rank), ("NNODES", len(inv.hosts)), ("HEAD_IP", head_ip)]
        if len(workers) == 1:
            env_file.append(("WORKER_IP", workers[0]))
        env_file += [("WORKER_IPS", ",".join(workers)), ("NODE_IP", rail.ip)]
        if len(peers) == 1:
            env_file.append(("PEER_IP", peers[0]))
        env_file += [("RAIL_IFACE", rail.name), ("RAIL_HCA", rail.hca), ("GPU_UUID", f.gpu_uuid),
                     ("GID_INDEX", f.gid_index), ("IMG", cfg.image), ("MODEL_REPO", h.vars["model_repo"]),
                     ("MODEL_REV", h.vars["model_revision"]), ("MODEL_HOST", model_host), ("CONTAINER", cfg.container),
                     ("PORT", cfg.port), ("MASTER_PORT", cfg.master_port), ("API_BIND", cfg.bind)]
        ready = (Gate("log", pattern=READY_LINE), Gate("http", path="/health")) if h.is_head else ()
        return Service(name="head" if h.is_head else f"worker-{h.rank}", role="head" if h.is_head else "worker",
                       host=h.name, spec=spec, ready=ready, rank=h.rank, group=GROUP, group_size=len(inv.hosts),
                       address=rail.ip, env_file=tuple((k, str(x)) for k, x in env_file), env_path=cfg.env_file,
                       facts=(("gid_index", str(f.gid_index)),))


def _dedupe(pairs: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Later values override earlier ones (vllm_extra_env over the reference's), order of first use kept."""
    out: dict[str, str] = {}
    for k, v in pairs:
        out[k] = v
    return list(out.items())
