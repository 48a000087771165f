"""The `vllm serve` command line and the environment every vLLM container gets, from typed config.

`VllmConfig.from_vars(host.vars)` reads the role's variables once; `serve_args` turns them into
arguments in the reference's order. A variable that is null (a layout's defaults may set one
so) or empty is not passed: vLLM's own default applies.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Sequence

from ..inventory import Host
from ..plan.spec import MODEL_DIR, PORT, Ref, Value
from . import MILESTONES, Engine, KvLine, Prefetch
from . import kernels
from .vllm_versions import TABLES, KvConnector, VllmVersion, for_vars

READY_LINE = "Application startup complete"
# What each engine core prints once its KV cache is sized: `GPU KV cache size: N tokens` on CUDA,
# `CPU KV cache size: N tokens` from the CPU build (the device type, upper-cased); `grep -F` finds both.
KV_LINE = "KV cache size:"

# The image's own NCCL, not the one a pip wheel drags in (see verify.MIN_NCCL).
NCCL_SO_SETUP = ('export VLLM_NCCL_SO_PATH="$(python3 -c \'import os, nvidia.nccl as n; '
                 'print(os.path.join(list(n.__path__)[0], "lib", "libnccl.so.2"))\')" || exit 1')

API_KEY_TARGET = "/run/secrets/vllm-api-key"

# NCCL and vLLM settings of the two-station reference for ranks talking over a RoCE rail;
# {placeholders} come from the rank's facts (rail_hca, gid_index, rail_iface, node_ip). NCCL_IB_HCA is in
# NCCL's exact form: without the leading '=' NCCL matches by prefix, and mlx5_1 also takes mlx5_10..mlx5_19.
NCCL_ENV = (
    ("NCCL_CUMEM_ENABLE", "1"), ("NCCL_IB_HCA", "={rail_hca}"), ("NCCL_IB_GID_INDEX", "{gid_index}"),
    ("NCCL_IB_TIMEOUT", "22"), ("NCCL_IB_RETRY_CNT", "7"), ("VLLM_ALLREDUCE_USE_FLASHINFER", "0"),
    ("VLLM_ALLREDUCE_USE_SYMM_MEM", "0"), ("NCCL_SOCKET_IFNAME", "{rail_iface}"), ("GLOO_SOCKET_IFNAME", "{rail_iface}"),
    ("NCCL_NET_GDR_LEVEL", "5"), ("NCCL_DEBUG", "INFO"), ("NCCL_DEBUG_SUBSYS", "INIT,NET"),
    ("NCCL_DEBUG_FILE", "/tmp/nccl_%h_%p.log"), ("VLLM_HOST_IP", "{node_ip}"),
    ("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "1800"), ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"),
    ("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1"), ("FLASHINFER_DISABLE_VERSION_CHECK", "1"),
)

# PyTorch's flight recorder, where vllm_flight_recorder is true (vllm_extra_env still overrides each): the last
# 2000 collectives of each process group, dumped on a collective's timeout, read by `inv hang-dump`. vLLM's TP
# all-reduce mostly runs through its own PyNccl, which the recorder does not see.
FLIGHT_RECORDER_ENV = (("TORCH_FR_BUFFER_SIZE", "2000"), ("TORCH_NCCL_DUMP_ON_TIMEOUT", "1"),
                       ("TORCH_FR_DUMP_TEMP_FILE", "/tmp/railyard_fr_rank_"))

# What a service with a KV connector (NIXL, LMCache) leaves out of NCCL_ENV: vLLM 0.32 refuses
# PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True beside any KV connector ("KV connector NixlConnector
# is incompatible with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True ...", vllm/config/vllm.py):
# CUDA VMM can remap the KV cache the connector registered for RDMA.
NO_EXPANDABLE_SEGMENTS = "PYTORCH_CUDA_ALLOC_CONF"


# --all2all-backend values each version's parser accepts, and those it accepts only to replace them: the version's
# table (railyard.engines.vllm_versions), from ParallelConfig in its vllm/config/parallel.py. "" leaves vLLM's default.
OLDEST = TABLES["0.30"]


def all2all_problem(backend: str, version: VllmVersion = OLDEST) -> str | None:
    """Why that version's vLLM would refuse this --all2all-backend, or None."""
    if backend and backend not in version.all2all_backends:
        return f"not an --all2all-backend vLLM {version.version} knows ({', '.join(version.all2all_backends)})"
    return None


def all2all_notes(backends, version: VllmVersion = OLDEST) -> tuple[str, ...]:
    """A note per removed backend asked for: vLLM runs another one without failing (ParallelConfig's warning
    "The '%s' all2all backend has been removed. Falling back to 'allgather_reducescatter'.", nothing else)."""
    return tuple(f"vllm_all2all_backend = {b!r}: removed in vLLM {version.version}, which runs allgather_reducescatter "
                 f"instead (its log: \"The '{b}' all2all backend has been removed\"); set that, or leave it empty"
                 for b in dict.fromkeys(backends) if b in version.all2all_removed)

# (flag, field, how): value = passed when set; json = compact JSON; switch = the bare flag when true;
# unless1/unless0 = passed only when not vLLM's default.
PARALLEL_FLAGS = (
    ("--tensor-parallel-size", "tensor_parallel_size", "value"),
    ("--pipeline-parallel-size", "pipeline_parallel_size", "unless1"),
    ("--data-parallel-size", "data_parallel_size", "unless1"),
    ("--enable-expert-parallel", "enable_expert_parallel", "switch"),
    ("--all2all-backend", "all2all_backend", "value"),
    ("--api-server-count", "api_server_count", "unless0"),
)
TUNING_FLAGS = (
    ("--speculative-config", "speculative_config", "json"),
    ("--max-model-len", "max_model_len", "value"),
    ("--max-num-batched-tokens", "max_num_batched_tokens", "value"),
    ("--block-size", "block_size", "value"),
    ("--max-num-seqs", "max_num_seqs", "value"),
    ("--kv-cache-dtype", "kv_cache_dtype", "value"),
    ("--gpu-memory-utilization", "gpu_memory_utilization", "value"),
    ("--kernel-config", "kernel_config", "json"),
    ("--compilation-config", "compilation_config", "json"),
    ("--distributed-timeout-seconds", "distributed_timeout_seconds", "value"),
    ("--tool-call-parser", "tool_call_parser", "value"),
    ("--reasoning-parser", "reasoning_parser", "value"),
    ("--async-scheduling", "async_scheduling", "switch"),
)


@dataclass(frozen=True)
class VllmConfig:
    """The `vllm_*` variables of one service, typed."""

    image: str
    container: str
    served_model_name: str
    bind: str
    port: int
    master_port: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    data_parallel_size: int
    enable_expert_parallel: bool
    all2all_backend: str
    api_server_count: int
    speculative_config: Any
    max_model_len: Any
    max_num_batched_tokens: Any
    block_size: Any
    max_num_seqs: Any
    kv_cache_dtype: Any
    gpu_memory_utilization: Any
    kernel_config: Any
    compilation_config: Any
    distributed_timeout_seconds: Any
    tool_call_parser: Any
    reasoning_parser: Any
    async_scheduling: bool
    flags: tuple[str, ...]
    extra_args: tuple[str, ...]
    extra_env: tuple[tuple[str, str], ...]
    shm_size: str
    cpuset: str
    env_file: str
    api_key_file: str
    start_timeout_s: float
    # the table of the vLLM this service runs: what is rendered for it
    vllm: VllmVersion = OLDEST

    @classmethod
    def from_vars(cls, v: dict) -> "VllmConfig":
        return cls(
            image=v["vllm_image"], container=v["vllm_container"], served_model_name=v["model_repo"],
            bind=v["vllm_bind"], port=int(v["vllm_port"]), master_port=int(v["vllm_master_port"]),
            tensor_parallel_size=int(v["vllm_tensor_parallel_size"]),
            pipeline_parallel_size=int(v["vllm_pipeline_parallel_size"]),
            data_parallel_size=int(v["vllm_data_parallel_size"]),
            enable_expert_parallel=bool(v["vllm_enable_expert_parallel"]),
            all2all_backend=v["vllm_all2all_backend"] or "", api_server_count=int(v["vllm_api_server_count"]),
            speculative_config=v["vllm_speculative_config"], max_model_len=v["vllm_max_model_len"],
            max_num_batched_tokens=v["vllm_max_num_batched_tokens"], block_size=v["vllm_block_size"],
            max_num_seqs=v["vllm_max_num_seqs"], kv_cache_dtype=v["vllm_kv_cache_dtype"],
            gpu_memory_utilization=v["vllm_gpu_memory_utilization"], kernel_config=v["vllm_kernel_config"],
            compilation_config=v["vllm_compilation_config"],
            distributed_timeout_seconds=v["vllm_distributed_timeout_seconds"],
            tool_call_parser=v["vllm_tool_call_parser"], reasoning_parser=v["vllm_reasoning_parser"],
            async_scheduling=bool(v["vllm_async_scheduling"]),
            flags=tuple(str(a) for a in v["vllm_flags"]), extra_args=tuple(str(a) for a in v["vllm_extra_args"]),
            extra_env=(FLIGHT_RECORDER_ENV if v.get("vllm_flight_recorder") else ())
            + tuple((str(k), str(x)) for k, x in v["vllm_extra_env"].items()) + kernels.env(v),
            shm_size=v["vllm_shm_size"], cpuset=v["vllm_cpuset"] or "", env_file=v["vllm_env_file"],
            api_key_file=v["vllm_api_key_file"], start_timeout_s=float(v["vllm_start_timeout_s"]), vllm=for_vars(v))

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size * self.data_parallel_size


def _flags(cfg: VllmConfig, table) -> list[str]:
    out: list[str] = []
    for flag, name, how in table:
        value = getattr(cfg, name)
        _reads(cfg.vllm, flag)
        if value is None or value == "" or value == {}:
            continue
        if how == "switch":
            if value:
                out.append(flag)
        elif how == "json":
            out += [flag, json.dumps(value, separators=(",", ":"))]
        elif how == "unless1" and value == 1 or how == "unless0" and value == 0:
            continue
        else:
            out += [flag, str(value)]
    return out


def serve_command(cfg: VllmConfig, group_args: Sequence[Value] = (), headless: bool = False) -> tuple[Value, ...]:
    """`vllm serve MODEL ...`: name, bind and port, the group's own arguments (multi-node), then
    parallelism, tuning, the switches and the extra arguments as given."""
    args: list[Value] = ["vllm", "serve", MODEL_DIR, "--served-model-name", cfg.served_model_name,
                         "--host", cfg.bind, "--port", PORT]
    for word in group_args:
        if isinstance(word, str) and word.startswith("--"):
            _reads(cfg.vllm, word)
    args += list(group_args)
    # a headless rank runs no API server: vLLM 0.30 refuses one there ("api_server_count can't be set in
    # headless mode", vllm/entrypoints/cli/serve.py run_headless)
    parallel = tuple(f for f in PARALLEL_FLAGS if not (headless and f[0] == "--api-server-count"))
    args += _flags(cfg, parallel) + _flags(cfg, TUNING_FLAGS)
    args += list(cfg.flags) + list(cfg.extra_args)
    if headless:
        args.append("--headless")
    return tuple(args)


def _reads(version: VllmVersion, flag: str) -> None:
    """A flag railyard writes must be one the version's parser takes (its table): a code error otherwise."""
    if flag not in version.flags:
        raise ValueError(f"{flag} is not in vLLM {version.version}'s table (railyard.engines.vllm_versions)")


def kv_transfer_config(connector: KvConnector, role: str, root: dict | None = None,
                       extra: dict | None = None) -> str:
    """--kv-transfer-config as one compact JSON word, in the shape the version's table gives the connector:
    its name, its module path at the root where the table has one, the role, root keys, then the extra config."""
    root, extra = root or {}, extra or {}
    unknown = [k for k in root if k not in connector.root_keys] + [k for k in extra if k not in connector.extra_keys]
    if unknown:
        raise ValueError(f"{connector.name} takes no {', '.join(unknown)} in railyard's table")
    doc: dict = {"kv_connector": connector.name}
    if connector.module_path:
        doc["kv_connector_module_path"] = connector.module_path
    doc.update({"kv_role": role, **root})
    if extra:
        doc["kv_connector_extra_config"] = extra
    return json.dumps(doc, separators=(",", ":"))


def service_env_path(env_file: str, service: str) -> str:
    """Where a layout with several services keeps one's env file: ~/vllm-x.env -> ~/vllm-x.<service>.env."""
    return f"{env_file[:-4] if env_file.endswith('.env') else env_file}.{service}.env"


def nccl_env(values: dict, drop: tuple[str, ...] = (), version: VllmVersion = OLDEST) -> list[tuple[str, str]]:
    """The reference's NCCL/vLLM environment for one rank, with its rail's facts filled in (a Ref stays
    one: a fact each target resolves where it runs)."""
    out = []
    for k, tpl in NCCL_ENV:
        if k in drop:
            continue
        if k.startswith("VLLM_") and k not in version.env:
            raise ValueError(f"{k} is not in vLLM {version.version}'s table (railyard.engines.vllm_versions)")
        key = tpl[1:-1] if tpl.startswith("{") and tpl.endswith("}") else None
        out.append((k, values[key] if key and isinstance(values[key], Ref) else tpl.format(**values)))
    return out


def rank_nccl_env(host: Host) -> dict[str, str]:
    """The NCCL environment nccl_env renders for a rank on this host's serving rail, as far as it is known before
    launch (its GID index a fact: a placeholder here); what preflight's nccl_conf and gloo_iface read."""
    rail = host.serve_rail
    return dict(nccl_env({"rail_hca": rail.hca, "gid_index": "(fact)", "rail_iface": rail.name, "node_ip": rail.ip}))


# ---------------------------------------------------------------- what vLLM prints

# engine cores are `EngineCore`, `EngineCore_DP<n>` (DP ranks) or, in older releases, `EngineCore_<n>`
_KV_RE = re.compile(r"(?:\((?P<proc>EngineCore(?:_DP(?P<dp>\d+)|_(?P<old>\d+))?) pid=\d+\).*?)?"
                    r"\b(?P<dev>[A-Z]{3,})(?: \+ host)? KV cache size: (?P<n>[\d,]+) tokens")
_ENGINE_RE = re.compile(r'^vllm:[A-Za-z_:]+\{[^}]*\bengine="(?P<e>[^"]+)"')


def engine_kv(log: str) -> dict[int, KvLine]:
    """DP rank -> what its engine core printed; the last line counts when one prints twice.

        (EngineCore_DP3 pid=4121) INFO 12-01 08:20:11 [kv_cache_utils.py:1087] GPU KV cache size: 299,584 tokens
        (EngineCore pid=4525) INFO 12-02 03:03:14 [kv_cache_utils.py:2327] CPU KV cache size: 1,048,576 tokens, ..."""
    out: dict[int, KvLine] = {}
    for line in log.splitlines():
        m = _KV_RE.search(line)
        if m:
            dp = int(m.group("dp") or m.group("old") or 0)
            out[dp] = KvLine(dp, int(m.group("n").replace(",", "")), m.group("dev"), line.strip())
    return out


def parse_kv_cache(log: str) -> dict[int, int]:
    """DP rank -> KV tokens, from each engine core's `GPU KV cache size: N tokens` line (the CPU build's
    `CPU KV cache size: N tokens` too).

        (EngineCore_DP3 pid=4121) INFO 12-01 08:20:11 [kv_cache_utils.py:1087] GPU KV cache size: 299,584 tokens
        (EngineCore pid=120) INFO 06-01 09:22:30 [kv_cache_utils.py:1733] GPU KV cache size: 620,944 tokens

    A line without a DP suffix is rank 0; an engine that prints its line twice counts once."""
    return {dp: e.tokens for dp, e in engine_kv(log).items()}


# The bring-up milestones of one vLLM container, each the line that marks it (docs: README, `inv launch`):
#   weights_loaded      a worker's `Loading weights took X seconds` (both builds) or the GPU build's
#                       `Model loading took X GiB [memory] and Y seconds` / older `Loading model weights took`
#   kv_cache_allocated  an engine core's `<DEVICE> KV cache size: N tokens`; on a rank without an engine core
#                       (a headless TP rank) its worker's `Available KV cache memory: X GiB` (GPU) or
#                       `Explicitly set|Auto set (...) GiB for KV cache` (CPU build)
#   engine_initialised  `init engine (profile, create kv cache, warmup model) took X s|seconds`
#   api_ready           uvicorn's `Application startup complete.`
# With several workers, engines or API servers in one container the last line counts: all of them are there.
_MILESTONE_RES = (
    ("weights_loaded", re.compile(r"\] (?:Loading weights took [\d.]+ seconds|Model loading took [\d.]+ GiB"
                                  r"|Loading model weights took [\d.]+ G)")),
    ("kv_cache_allocated", re.compile(r"\b[A-Z]{3,}(?: \+ host)? KV cache size: [\d,]+ tokens"
                                      r"|\] Available KV cache memory: [\d.]+ GiB"
                                      r"|\] (?:Explicitly|Auto) set \([\d./]+\) GiB for KV cache")),
    ("engine_initialised", re.compile(r"\] init engine \(profile, create kv cache, warmup model\) took [\d.]+ s")),
    ("api_ready", re.compile(r"\bINFO:\s+Application startup complete\.")),
)
# what `grep -F` keeps of a log before milestone_of looks at it (one pattern per milestone line)
MILESTONE_GREP = ("Loading weights took", "Model loading took", "Loading model weights took", "KV cache size:",
                  "Available KV cache memory", "GiB for KV cache", "init engine (profile, create kv cache",
                  READY_LINE)


def milestone_of(line: str) -> str | None:
    """Which bring-up milestone a vLLM log line marks, or None.

        (Worker pid=4555) INFO 12-02 03:03:13 [default_loader.py:501] Loading weights took 0.01 seconds -> weights_loaded
        INFO:     Application startup complete.                                                     -> api_ready"""
    for name, rx in _MILESTONE_RES:
        if rx.search(line):
            return name
    return None


def metric_engines(text: str) -> set[str]:
    """The `engine="<n>"` labels that vLLM's /metrics carries on its vllm:* series."""
    return {m.group("e") for line in text.splitlines() if (m := _ENGINE_RE.match(line))}


def summarize_metrics(m: dict) -> dict:
    """The figures health shows from vLLM's /metrics (parsed): requests running and waiting, KV cache
    usage, the prefix cache's hit rate, speculative decoding's acceptance; None where not exported."""
    def get(*names):
        for n in names:
            if n in m:
                return m[n]
        return None
    q_ = get("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total")
    h_ = get("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total")
    d_ = get("vllm:spec_decode_num_draft_tokens_total")
    a_ = get("vllm:spec_decode_num_accepted_tokens_total")
    return {
        "running": get("vllm:num_requests_running"),
        "waiting": get("vllm:num_requests_waiting"),
        "kv_cache_usage": get("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        "prefix_cache_hit_rate": (h_ / q_) if q_ else None,
        "spec_acceptance": (a_ / d_) if d_ else None,
    }


class Vllm(Engine, name="vllm"):
    """vLLM (`vllm serve`), as the generic code reads it: see railyard.engines."""
    kv_line = KV_LINE
    milestone_grep = MILESTONE_GREP
    # the token counters; a wedged engine's /health still answers 200 (vllm-project/vllm #36451, #39863)
    progress = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total")

    def serves(self, command: Sequence[str]) -> bool:
        return list(command[:2]) == ["vllm", "serve"]

    def milestones_of(self, command: Sequence[str]) -> tuple[str, ...]:
        """A `--headless` rank serves no API. A headless rank of a tensor-parallel group runs workers only
        (its engine core is on the head): weights and KV cache, no engine line; a headless rank of a
        multi-node DP instance runs its own engine cores."""
        if "--headless" not in command:
            return MILESTONES
        dp = any(w.startswith(("--data-parallel-size", "-dp")) for w in command)
        return ("weights_loaded", "kv_cache_allocated") + (("engine_initialised",) if dp else ())

    def milestone_of(self, line: str) -> str | None:
        return milestone_of(line)

    def kv_lines(self, log: str) -> dict[int, KvLine]:
        return engine_kv(log)

    def prefetch(self, v: dict) -> Prefetch | None:
        """FlashInfer's kernels (vLLM 0.32 and later fetch them at a first start), where vllm_kernels_path names a
        folder: railyard.engines.kernels."""
        return kernels.prefetch(v)

    def metric_engines(self, text: str) -> set[str]:
        return metric_engines(text)

    def summarize_metrics(self, m: dict) -> dict:
        return summarize_metrics(m)
