"""LMCache's multiprocess server (`lmcache server`) and the connector that vLLM replicas use
to reach it: typed config, the server's command line, the `--kv-transfer-config` JSON, and
the server's /status, parsed.

Facts (LMCache 0.5.x, `lmcache server --help`, docs/source/mp): ZMQ on --port (5555), the HTTP
admin API on --http-port (8080) with /healthcheck and /status; --l1-size-gb and
--eviction-policy are required; every process must share one PYTHONHASHSEED or their cache keys
differ.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from . import vllm
from .vllm_versions import LMCACHE, KvConnector

CONNECTOR = LMCACHE.name
READY_LINE = "LMCache cache server is running"
# what vLLM's LMCache connector logs once it has handed its KV caches to the server
REGISTERED_LINE = "Registering kv caches"
HEALTH_PATH = "/healthcheck"
STATUS_PATH = "/status"
EVICTION_POLICIES = ("LRU", "ARC", "IsolatedLRU", "noop")
TRANSFER_MODES = ("lmcache_driven", "engine_driven", "auto")  # `lmcache server --supported-transfer-mode`


@dataclass(frozen=True)
class LmcacheConfig:
    image: str
    host: str
    port: int
    http_host: str
    http_port: int
    l1_size_gb: float
    eviction_policy: str
    eviction_trigger_watermark: float
    eviction_ratio: float
    chunk_size: int
    max_workers: int
    max_gpu_workers: int
    transfer_mode: str
    extra_args: tuple[str, ...]
    extra_env: tuple[tuple[str, str], ...]
    shm_size: str
    start_timeout_s: float

    @classmethod
    def from_vars(cls, v: dict, replicas: int) -> "LmcacheConfig":
        return cls(image=v["lmcache_image"] or v["vllm_image"], host=v["lmcache_host"], port=int(v["lmcache_port"]),
                   http_host=v["lmcache_http_host"], http_port=int(v["lmcache_http_port"]),
                   l1_size_gb=v["lmcache_l1_size_gb"], eviction_policy=v["lmcache_eviction_policy"],
                   eviction_trigger_watermark=v["lmcache_eviction_trigger_watermark"],
                   eviction_ratio=v["lmcache_eviction_ratio"], chunk_size=int(v["lmcache_chunk_size"]),
                   max_workers=int(v["lmcache_max_workers"]),
                   max_gpu_workers=int(v["lmcache_max_gpu_workers"]) or replicas,
                   transfer_mode=v["lmcache_transfer_mode"] or "",
                   extra_args=tuple(str(a) for a in v["lmcache_extra_args"]),
                   extra_env=tuple((str(k), str(x)) for k, x in v["lmcache_extra_env"].items()),
                   shm_size=v["lmcache_shm_size"], start_timeout_s=float(v["lmcache_start_timeout_s"]))


def server_command(c: LmcacheConfig) -> tuple[str, ...]:
    return ("lmcache", "server", "--host", c.host, "--port", str(c.port), "--http-host", c.http_host,
            "--http-port", str(c.http_port), "--l1-size-gb", f"{c.l1_size_gb:g}", "--eviction-policy",
            c.eviction_policy, "--eviction-trigger-watermark", f"{c.eviction_trigger_watermark:g}",
            "--eviction-ratio", f"{c.eviction_ratio:g}", "--chunk-size", str(c.chunk_size),
            "--max-workers", str(c.max_workers), "--max-gpu-workers", str(c.max_gpu_workers)) + (
                ("--supported-transfer-mode", c.transfer_mode) if c.transfer_mode else ()) + c.extra_args


def kv_transfer_config(c: LmcacheConfig, connector: KvConnector = LMCACHE) -> str:
    """vLLM's --kv-transfer-config for a replica of this server, as one compact JSON word, in the shape of the
    replica's vLLM version (its table's LMCache connector)."""
    return vllm.kv_transfer_config(connector, "kv_both",
                                   extra={"lmcache.mp.host": f"tcp://{c.host}", "lmcache.mp.port": c.port})


@dataclass(frozen=True)
class ServerStatus:
    healthy: bool
    registered_gpu_ids: tuple[int, ...]
    l1_used_bytes: int | None
    l1_total_bytes: int | None
    # engine-driven (non-CUDA) contexts, as a CPU engine registers: instance id -> its world size
    engine_instances: tuple[tuple[int, int], ...] = ()
    # worker_liveness: an instance without a heartbeat for this long is dropped (None: no reaper)
    reap_timeout_s: float | None = None

    @property
    def workers(self) -> int:
        """Engine workers registered: one per GPU id (CUDA), each non-CUDA context's world size."""
        return len(self.registered_gpu_ids) + sum(w for _, w in self.engine_instances)


def parse_status(text: str) -> ServerStatus:
    """GET /status of `lmcache server` (0.5.x): is_healthy, registered_gpu_ids (a CUDA engine's workers),
    registered_non_cuda_instance_ids with non_cuda_context_meta's world_size (a CPU engine's),
    worker_liveness's reap timeout and storage_manager's L1 use. Raises ValueError on anything else."""
    doc = json.loads(text)
    if not isinstance(doc, dict) or "is_healthy" not in doc:
        raise ValueError("not an LMCache /status document")
    l1 = _find(doc.get("storage_manager") or {}, "memory_used_bytes"), _find(doc.get("storage_manager") or {},
                                                                               "memory_total_bytes")
    meta = doc.get("non_cuda_context_meta") or {}
    engines = tuple((int(i), int((meta.get(str(i)) or {}).get("world_size") or 1))
                    for i in doc.get("registered_non_cuda_instance_ids") or ())
    live = doc.get("worker_liveness") or {}
    reap = float(live["reap_timeout_seconds"]) if live.get("enabled") and live.get("reap_timeout_seconds") else None
    return ServerStatus(bool(doc["is_healthy"]), tuple(int(i) for i in doc.get("registered_gpu_ids") or ()),
                        l1[0], l1[1], engines, reap)


def _find(d, key: str):
    """The first value of key anywhere in a nested mapping (the L1 stats sit a level or two down)."""
    if isinstance(d, dict):
        if key in d and isinstance(d[key], (int, float)):
            return int(d[key])
        for v in d.values():
            got = _find(v, key)
            if got is not None:
                return got
    return None
