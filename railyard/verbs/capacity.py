"""`inv plan`: how much KV cache one host gets under TP=N against DP attention + expert parallel.

Flow: the checkpoint's own files (config.json and every shard's safetensors header, never the
tensor data; read on the head over SSH by `scripts/safetensors_headers.py`, or from a local
directory) -> exact bytes of routed-expert tensors and of everything else -> bytes per GPU under
each layout -> the KV budget vLLM leaves per GPU (memory x gpu_memory_utilization - weights -
reserve) -> tokens per GPU, per node, and requests of `context` tokens that fit at once.

The layouts, each the one its `kv_plan` row (railyard.plan.layout.KvPlanRow) describes (docs/plan.md has
the formulas):
- `single_node_tp`: one engine, `-tp N`. Routed experts and most dense weights are split N ways;
  MLA's latent projections, the DSA indexer and norms are replicated. The KV cache holds every
  token on every GPU: MLA's one latent per token is replicated (each TP rank keeps a full copy),
  grouped-query attention is split by KV heads (replicated once N > num_key_value_heads).
- `dp_ep`: `-dp N -tp 1 --enable-expert-parallel`. Experts split N ways (EP = DP x TP), everything
  else replicated; each DP rank is its own engine with its own full KV cache, node = sum of ranks.

Pure functions from `parse_checkpoint` to `plan_json`; the I/O is in `read_local`,
`read_remote` and `gather`. Bad input raises CheckpointError (exit 2) naming the file.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..checks import PASS, WARN, CheckResult
from ..errors import RailyardError, UsageError
from ..plan import layout as layouts
from ..plan.layout import KvPlanRow
from ..transport import RemotePath, Session, Sh, cmd, q
from ..report import NO_HOST, Report

HEADER_SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "safetensors_headers.py"
GIB = 1 << 30
MIB = 1 << 20
def planned_layouts() -> list[tuple[str, KvPlanRow]]:
    """The layouts the planner compares, each with its row (its `kv_plan`), in the registry's order."""
    return [(name, row) for name in layouts.names() if (row := layouts.by_name(name).kv_plan) is not None]

# vLLM's dtype sizes (vllm/utils/torch_utils.py STR_DTYPE_TO_TORCH_DTYPE) for the model and KV dtypes
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4}
_KV_DTYPES = ("auto", "bfloat16", "float16", "half", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_ds_mla")
# vllm/v1/kv_cache_interface.py MLAAttentionSpec: fp8_ds_mla stores 512 fp8 latent values,
# 4 float32 scales and 64 bf16 rope values per token and layer
FP8_DS_MLA_BYTES = 656
# the DSA indexer's key cache (deepseek_v2.py Indexer): fp8 values plus one float32 scale per 128
INDEXER_QUANT_BLOCK = 128


class CheckpointError(UsageError):
    """A checkpoint that cannot be planned from: one line naming the file. Exit 2."""


# ---------------------------------------------------------------- the checkpoint

@dataclass(frozen=True)
class Tensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


@dataclass
class Checkpoint:
    dir: str
    config: dict
    tensors: list[Tensor]
    files: int

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def parse_checkpoint(doc: dict) -> Checkpoint:
    """The document `safetensors_headers.py` prints -> a Checkpoint, or CheckpointError naming the file.

    A shard whose tensors need more data than the file holds is a truncated (half-downloaded) file."""
    root = str(doc.get("dir") or "?")
    if not doc.get("exists", True):
        raise CheckpointError(f"{root}: no such directory")
    cfg_path = f"{root}/config.json"
    if doc.get("config_error"):
        why = doc["config_error"]
        raise CheckpointError(f"{cfg_path}: {'missing' if why == 'missing' else 'does not parse: ' + why}")
    config = doc.get("config")
    if not isinstance(config, dict):
        raise CheckpointError(f"{cfg_path}: not a JSON object")
    if doc.get("index_error"):
        raise CheckpointError(f"{root}/model.safetensors.index.json: {doc['index_error']}")
    files = doc.get("files") or {}
    if not files:
        raise CheckpointError(f"{root}: no *.safetensors shard (and no model.safetensors.index.json)")
    tensors: list[Tensor] = []
    for name in sorted(files):
        info, path = files[name], f"{root}/{name}"
        if info.get("error"):
            why = info["error"]
            raise CheckpointError(f"{path}: {'missing (named by model.safetensors.index.json)' if why == 'missing' else why}")
        header, size, n = info.get("header"), int(info.get("size", 0)), int(info.get("header_len", 0))
        if not isinstance(header, dict):
            raise CheckpointError(f"{path}: header is not a JSON object")
        end = 0
        for tname, t in header.items():
            try:
                start, stop = (int(x) for x in t["data_offsets"])
                shape = tuple(int(x) for x in t.get("shape", []))
                dtype = str(t["dtype"])
            except (KeyError, TypeError, ValueError):
                raise CheckpointError(f"{path}: tensor {tname!r} has no valid dtype/shape/data_offsets") from None
            if stop < start or start < 0:
                raise CheckpointError(f"{path}: tensor {tname!r} has data_offsets [{start}, {stop}]")
            end = max(end, stop)
            tensors.append(Tensor(tname, dtype, shape, stop - start))
        if 8 + n + end > size:
            raise CheckpointError(f"{path}: truncated: its header describes {8 + n + end} bytes, the file has {size}")
    return Checkpoint(root, config, tensors, len(files))


# ---------------------------------------------------------------- the model

@dataclass(frozen=True)
class ModelSpec:
    """What the planner needs from config.json (a `text_config` section is used when present)."""

    architecture: str
    attention: str                 # "mla" | "gqa"
    layers: int                    # num_hidden_layers
    mtp_layers: int                # num_nextn_predict_layers (0 when absent)
    dtype: str                     # torch_dtype / dtype: what kv_cache_dtype=auto means
    kv_lora_rank: int = 0          # MLA
    qk_rope_head_dim: int = 0      # MLA
    index_head_dim: int = 0        # DSA indexer (config has index_topk); 0 without one
    num_kv_heads: int = 0          # GQA
    head_dim: int = 0              # GQA
    routed_experts: int = 0
    max_context: int | None = None
    kv_cache_quant_algo: str | None = None
    caveat: str = ""               # what config.json declares that the planner does not model


def _caveat(cfg: dict) -> str:
    kinds = sorted({str(k) for k in cfg.get("layer_types") or [] if k != "full_attention"})
    if not kinds and isinstance(cfg.get("sliding_window"), int) and cfg.get("use_sliding_window") is not False:
        kinds = ["sliding_attention"]
    if not kinds:
        return ""
    return (f"config.json declares {', '.join(kinds)} layers; every layer is counted as full attention here, "
            "so their KV capacity is understated")


def _need(cfg: dict, key: str, where: str):
    v = cfg.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise CheckpointError(f"{where}: {key} {'missing' if v is None else repr(v)}: a positive integer is needed")
    return v


def model_spec(config: dict, where: str = "config.json") -> ModelSpec:
    text_config = config.get("text_config")
    cfg: dict = text_config if isinstance(text_config, dict) and "num_hidden_layers" not in config else config
    arch = ",".join(config.get("architectures") or []) or str(config.get("model_type", "?"))
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or config.get("torch_dtype") or config.get("dtype")
                or "bfloat16")
    layers = _need(cfg, "num_hidden_layers", where)
    experts = cfg.get("n_routed_experts") or cfg.get("num_local_experts") or cfg.get("num_experts") or 0
    quant = config.get("quantization_config")
    qc: dict = quant if isinstance(quant, dict) else {}
    common = dict(architecture=arch, layers=layers, mtp_layers=int(cfg.get("num_nextn_predict_layers") or 0),
                  dtype=dtype, routed_experts=int(experts),
                  max_context=cfg.get("max_position_embeddings") if isinstance(cfg.get("max_position_embeddings"), int)
                  else None, kv_cache_quant_algo=qc.get("kv_cache_quant_algo"), caveat=_caveat(cfg))
    if cfg.get("kv_lora_rank"):
        # vLLM marks DeepSeek-V3.2-style sparse attention by index_topk (models/config.py
        # DeepseekV32ForCausalLM); the indexer's key is index_head_dim wide
        index = int(cfg.get("index_head_dim") or 128) if cfg.get("index_topk") or cfg.get("index_head_dim") else 0
        return ModelSpec(attention="mla", kv_lora_rank=_need(cfg, "kv_lora_rank", where),
                         qk_rope_head_dim=_need(cfg, "qk_rope_head_dim", where), index_head_dim=index, **common)
    heads = _need(cfg, "num_attention_heads", where)
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or _need(cfg, "hidden_size", where) // heads
    return ModelSpec(attention="gqa", num_kv_heads=int(kv_heads), head_dim=int(head_dim), **common)


# ---------------------------------------------------------------- weights per GPU

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")
# replicated on every TP rank in vLLM: norms, MoE routers, MLA's down-projections
# (fused_qkv_a_proj is a ReplicatedLinear), the DSA indexer, the MTP block's eh_proj (nn.Linear)
_REPLICATED_RE = re.compile(r"norm|\.q_a_proj\.|\.kv_a_proj_with_mqa\.|\.indexer\.|\.eh_proj\.|"
                            r"\.(?:mlp|block_sparse_moe|feed_forward)\.gate\.|\.router\.|e_score_correction_bias")
_KV_PROJ_RE = re.compile(r"\.(?:k_proj|v_proj)\.")


def layer_of(name: str) -> int | None:
    m = _LAYER_RE.search(name)
    return int(m[1]) if m else None


def tensor_role(name: str, spec: ModelSpec) -> str:
    """`expert` (routed, split by EP), `replicated` (whole on every TP rank), `kv_heads` (split by
    KV heads: replicated past TP = num_key_value_heads) or `split` (split TP ways)."""
    if ".experts." in name:
        return "expert"
    if _REPLICATED_RE.search(name):
        return "replicated"
    if spec.attention == "gqa" and _KV_PROJ_RE.search(name):
        return "kv_heads"
    return "split"


@dataclass
class WeightBytes:
    expert: int = 0
    split: int = 0
    replicated: int = 0
    kv_heads: int = 0
    mtp: int = 0          # bytes of layers >= num_hidden_layers (the MTP block), in the roles above when counted

    @property
    def total(self) -> int:
        return self.expert + self.split + self.replicated + self.kv_heads


def weight_bytes(ckpt: Checkpoint, spec: ModelSpec, mtp: bool) -> WeightBytes:
    """Bytes by role. The MTP layers' weights load only with MTP speculative decoding (vLLM's target
    model skips `layers.N` for N >= num_hidden_layers; DeepSeekMTP loads them)."""
    w = WeightBytes()
    for t in ckpt.tensors:
        layer = layer_of(t.name)
        if layer is not None and layer >= spec.layers:
            w.mtp += t.nbytes
            if not mtp:
                continue
        role = tensor_role(t.name, spec)
        setattr(w, role, getattr(w, role) + t.nbytes)
    return w


def weights_per_gpu(w: WeightBytes, spec: ModelSpec, tp: int, ep: int) -> float:
    """Bytes of weights each GPU holds with tensor parallel `tp` and expert parallel `ep` (ep=1: experts split by tp)."""
    kv_split = min(tp, spec.num_kv_heads) if spec.num_kv_heads else tp
    experts = w.expert / (ep if ep > 1 else tp)
    return experts + w.split / tp + w.replicated + w.kv_heads / kv_split


# ---------------------------------------------------------------- KV bytes per token

@dataclass(frozen=True)
class KvFormat:
    cache_dtype: str      # as vLLM resolves it: auto -> the model dtype; fp8 on DSA -> fp8_ds_mla
    element_bytes: int
    attention_bytes: int  # per token and layer on one GPU, TP=1
    indexer_bytes: int    # per token and layer (DSA), replicated under TP
    layers: int           # layers that hold KV (MTP layers included when counted)


def kv_format(spec: ModelSpec, kv_cache_dtype: str, mtp: bool) -> KvFormat:
    kvd = kv_cache_dtype.lower()
    if kvd not in _KV_DTYPES:
        raise UsageError(f"--kv-cache-dtype {kv_cache_dtype!r}: one of {', '.join(_KV_DTYPES)}")
    if kvd == "auto":
        kvd = spec.dtype
    elem: int | None
    if kvd.startswith("fp8"):
        elem = 1
        if spec.attention == "mla" and spec.index_head_dim:
            kvd = "fp8_ds_mla"  # vLLM converts any fp8 cache on DeepSeek-V3.2-style models
    else:
        elem = _DTYPE_BYTES.get(kvd)
        if elem is None:
            raise CheckpointError(f"config.json: torch_dtype {spec.dtype!r} is not a KV cache dtype; "
                                  "pass --kv-cache-dtype")
    if spec.attention == "mla":
        latent = spec.kv_lora_rank + spec.qk_rope_head_dim
        attn = FP8_DS_MLA_BYTES if kvd == "fp8_ds_mla" else latent * elem
    else:
        attn = 2 * spec.num_kv_heads * spec.head_dim * elem
    idx = spec.index_head_dim + spec.index_head_dim // INDEXER_QUANT_BLOCK * 4 if spec.index_head_dim else 0
    layers = spec.layers + (spec.mtp_layers if mtp else 0)
    return KvFormat(kvd, elem, attn, idx, layers)


def kv_bytes_per_token(spec: ModelSpec, fmt: KvFormat, tp: int) -> int:
    """Bytes one GPU stores per cached token with tensor parallel `tp`.

    MLA: one latent per token, the same on every TP rank (replicated). GQA: vLLM gives each rank
    max(1, num_key_value_heads // tp) heads, so the cache splits by KV heads until TP passes them."""
    if spec.attention == "mla":
        per_layer = fmt.attention_bytes + fmt.indexer_bytes
    else:
        heads_here = max(1, spec.num_kv_heads // tp)
        per_layer = fmt.attention_bytes * heads_here // spec.num_kv_heads + fmt.indexer_bytes
    return per_layer * fmt.layers


def kv_blocks(budget_bytes: float, per_token: int, block: int) -> int:
    """Whole KV blocks a budget holds, as vLLM counts them (budget // page size, a page = block x bytes/token)."""
    return max(0, int(budget_bytes // (per_token * block)))


# ---------------------------------------------------------------- GPUs

@dataclass(frozen=True)
class Gpus:
    name: str
    memory_gib: float     # per GPU, as nvidia-smi memory.total
    count: int
    source: str


def parse_gpu_memory(text: str, selector: str, host: str) -> Gpus:
    """`nvidia-smi --query-gpu=name,memory.total --format=csv,noheader,nounits` -> the GPUs whose
    name contains `selector` (case-insensitive): their count and the smallest memory, in GiB.

        NVIDIA H200, 143771"""
    rows = []
    for line in text.splitlines():
        if not line.strip():
            continue
        name, _, mem = line.rpartition(",")
        try:
            rows.append((name.strip(), int(mem.strip().replace("MiB", "").strip())))
        except ValueError:
            raise RailyardError(f"{host}: unexpected nvidia-smi line: {line.strip()!r}") from None
    chosen = [r for r in rows if selector.lower() in r[0].lower()]
    if not chosen:
        seen = ", ".join(sorted({r[0] for r in rows})) or "none"
        raise RailyardError(f"{host}: no GPU matches cluster_gpu_name {selector!r} (nvidia-smi shows: {seen}); "
                            "fix cluster_gpu_name or pass --gpu-memory-gib and --gpus")
    mib = min(m for _, m in chosen)
    return Gpus(chosen[0][0], mib / 1024, len(chosen), f"nvidia-smi on {host}: {len(chosen)} x {mib} MiB")


# ---------------------------------------------------------------- the plan

@dataclass
class Assumptions:
    gpu_memory_utilization: float = 0.9   # vLLM's default (--gpu-memory-utilization)
    kv_cache_dtype: str = "auto"          # vLLM's default: the model dtype
    reserve_gib: float = 8.0              # per GPU: peak activation + CUDA graphs + non-torch memory
    dp_reserve_gib: float | None = None   # the same for each dp_ep rank; None: reserve_gib
    block_size: int | None = None         # None: 64 for MLA (FlashMLA), 16 otherwise (vLLM defaults)
    context: int | None = None            # None: max_position_embeddings
    mtp: bool = False                     # MTP speculative decoding (--speculative-config method=mtp)


@dataclass
class LayoutPlan:
    layout: str
    tp: int
    dp: int
    ep: int
    engines: int
    weights_gib_per_gpu: float
    kv_bytes_per_token_per_gpu: int
    kv_gib_per_gpu: float
    kv_tokens_per_gpu: int
    kv_tokens_per_node: int
    max_concurrency: int
    fits: bool
    ratio_vs_tp: float | None = None
    notes: list[str] = field(default_factory=list)


@dataclass
class Plan:
    model: str
    spec: ModelSpec
    gpus: Gpus
    assumptions: dict
    layouts: list[LayoutPlan]


def _layout(name: str, row: KvPlanRow, spec: ModelSpec, w: WeightBytes, fmt: KvFormat, gpus: Gpus, a: Assumptions,
            block: int, context: int) -> LayoutPlan:
    n = gpus.count
    tp, dp, ep = (1, n, n) if row.engine_per_gpu else (n, 1, 1)
    weights = weights_per_gpu(w, spec, tp, ep)
    per_token = kv_bytes_per_token(spec, fmt, tp)
    reserve = a.dp_reserve_gib if row.engine_per_gpu and a.dp_reserve_gib is not None else a.reserve_gib
    budget = gpus.memory_gib * GIB * a.gpu_memory_utilization - weights - reserve * GIB
    blocks = kv_blocks(budget, per_token, block)
    tokens = blocks * block
    per_request = math.ceil(context / block)
    notes = []
    if budget <= 0:
        notes.append(f"weights ({weights / GIB:.1f} GiB) and reserve leave no KV cache within "
                     f"{a.gpu_memory_utilization:g} x {gpus.memory_gib:.1f} GiB: vLLM would not start")
    elif tokens < context:
        notes.append(f"one request of {context:,} tokens does not fit ({tokens:,} tokens per engine): "
                     "vLLM refuses this max_model_len")
    if row.engine_per_gpu and not w.expert:
        notes.append("no routed experts: every rank holds the whole model")
    if not row.engine_per_gpu and spec.attention == "gqa" and n > spec.num_kv_heads:
        notes.append(f"TP {n} > {spec.num_kv_heads} KV heads: each KV head is replicated {n // spec.num_kv_heads} times")
    return LayoutPlan(name, tp, dp, ep, dp, round(weights / GIB, 2), per_token, round(max(budget, 0) / GIB, 2),
                      tokens, tokens * dp, (blocks // per_request) * dp, budget > 0 and tokens >= context, notes=notes)


def plan_capacity(ckpt: Checkpoint, gpus: Gpus, a: Assumptions) -> Plan:
    if gpus.count < 1 or gpus.memory_gib <= 0:
        raise UsageError(f"--gpus {gpus.count} --gpu-memory-gib {gpus.memory_gib:g}: both must be positive")
    if not 0 < a.gpu_memory_utilization <= 1:
        raise UsageError(f"--gpu-memory-utilization {a.gpu_memory_utilization:g}: must be in (0, 1]")
    if a.reserve_gib < 0 or (a.dp_reserve_gib or 0) < 0:
        raise UsageError(f"--reserve-gib {a.reserve_gib:g} --dp-reserve-gib {a.dp_reserve_gib}: must not be negative")
    spec = model_spec(ckpt.config, f"{ckpt.dir}/config.json")
    block = a.block_size or (64 if spec.attention == "mla" else 16)
    context = a.context or spec.max_context or 32768
    context_source = "--context" if a.context else ("max_position_embeddings" if spec.max_context else "default")
    if block < 1 or context < 1:
        raise UsageError(f"--block-size {block} --context {context}: both must be positive")
    w = weight_bytes(ckpt, spec, a.mtp)
    fmt = kv_format(spec, a.kv_cache_dtype, a.mtp)
    rows = [_layout(name, row, spec, w, fmt, gpus, a, block, context) for name, row in planned_layouts()]
    tp_tokens = rows[0].kv_tokens_per_node
    for lp in rows:
        lp.ratio_vs_tp = round(lp.kv_tokens_per_node / tp_tokens, 2) if tp_tokens else None
    kv_note = ""
    if a.kv_cache_dtype == "auto" and spec.kv_cache_quant_algo:
        kv_note = (f"the checkpoint declares kv_cache_quant_algo {spec.kv_cache_quant_algo}: vLLM releases that "
                   "resolve auto from it (PR #30785) cache in fp8; plan that with --kv-cache-dtype fp8")
    assumptions = {
        "gpu": gpus.name, "gpus": gpus.count, "gpu_memory_gib": round(gpus.memory_gib, 2), "gpu_source": gpus.source,
        "gpu_memory_utilization": a.gpu_memory_utilization, "reserve_gib_per_gpu": a.reserve_gib,
        "dp_reserve_gib_per_gpu": a.reserve_gib if a.dp_reserve_gib is None else a.dp_reserve_gib,
        "kv_cache_dtype": a.kv_cache_dtype, "kv_cache_dtype_resolved": fmt.cache_dtype,
        "kv_cache_dtype_note": kv_note, "model_caveat": spec.caveat, "block_size": block, "context": context,
        "context_source": context_source, "mtp": a.mtp,
        "attention": spec.attention + ("+dsa_indexer" if spec.index_head_dim else ""),
        "kv_layers": fmt.layers, "kv_attention_bytes_per_token_layer": fmt.attention_bytes,
        "kv_indexer_bytes_per_token_layer": fmt.indexer_bytes,
        "weights_gib": round(w.total / GIB, 2), "routed_expert_gib": round(w.expert / GIB, 2),
        "mtp_weights_gib": round(w.mtp / GIB, 2), "checkpoint_gib": round(ckpt.total_bytes / GIB, 2),
        "shards": ckpt.files, "model_dir": ckpt.dir,
    }
    return Plan(spec.architecture, spec, gpus, assumptions, rows)


def plan_json(plan: Plan) -> dict:
    """The --json contract: {"ok": true, "assumptions": {...}, "layouts": [{"layout", "weights_gib_per_gpu",
    "kv_tokens_per_gpu", "kv_tokens_per_node", "max_concurrency", ...}]}."""
    return {"ok": True, "model": plan.model, "assumptions": plan.assumptions,
            "layouts": [asdict(lp) for lp in plan.layouts]}


# ---------------------------------------------------------------- against a running engine

CPU_BLOCK = 128      # the CPU build's block size unless --block-size is given (vllm/platforms/cpu.py)
CPU_MLA_BLOCK = 16   # ... and what it forces for MLA models


@dataclass
class EngineSettings:
    """What one running engine was started with, as far as its KV cache goes: its flags, its environment
    and the device its KV line names."""

    device: str                                # GPU (CUDA) or CPU (the CPU build), from its KV line
    tp: int = 1
    dp: int = 1                                # DP ranks of the instance: experts split over tp x dp with EP
    expert_parallel: bool = False
    pp: int = 1
    gpu_memory_utilization: float | None = None
    kv_cache_dtype: str = "auto"
    block_size: int | None = None
    kv_cache_memory_bytes: int | None = None   # --kv-cache-memory-bytes
    cpu_kvcache_space_gib: int | None = None   # VLLM_CPU_KVCACHE_SPACE in the engine's environment
    gpu_memory_gib: float | None = None        # per GPU, nvidia-smi memory.total


@dataclass
class EnginePlan:
    """railyard's KV tokens for one engine: None when its budget cannot be planned (said in notes)."""

    tokens: int | None
    kv_bytes_per_token: int       # on each GPU (or CPU worker) of the engine
    block_size: int
    budget_bytes: float | None
    source: str                   # where the budget comes from, in words
    notes: list[str] = field(default_factory=list)


def plan_engine(ckpt: Checkpoint, e: EngineSettings, a: Assumptions) -> EnginePlan:
    """The KV tokens each rank of one engine holds, planned from the checkpoint and the engine's settings.

    CPU build: its KV space is VLLM_CPU_KVCACHE_SPACE GiB per worker when the environment sets it (vLLM's
    platform turns it into kv_cache_memory_bytes), else --kv-cache-memory-bytes; otherwise it sized the cache
    from free memory, which no plan can know. GPU: --kv-cache-memory-bytes when given, else memory x
    gpu_memory_utilization - weights/GPU - reserve, as for the layouts."""
    spec = model_spec(ckpt.config, f"{ckpt.dir}/config.json")
    fmt = kv_format(spec, e.kv_cache_dtype or "auto", a.mtp)
    per_token = kv_bytes_per_token(spec, fmt, e.tp)
    notes = []
    if e.pp > 1:
        notes.append(f"pipeline parallel {e.pp}: each stage holds only its layers' KV, not modelled")
    budget: float
    if e.device == "CPU":
        block = CPU_MLA_BLOCK if spec.attention == "mla" else (e.block_size or CPU_BLOCK)
        if e.cpu_kvcache_space_gib is not None:
            budget, source = e.cpu_kvcache_space_gib * GIB, f"VLLM_CPU_KVCACHE_SPACE={e.cpu_kvcache_space_gib} GiB"
        elif e.kv_cache_memory_bytes is not None:
            budget, source = float(e.kv_cache_memory_bytes), f"--kv-cache-memory-bytes {e.kv_cache_memory_bytes}"
        else:
            return EnginePlan(None, per_token, block, None, "free memory at start",
                              notes + ["the CPU build sized its cache from free memory (no VLLM_CPU_KVCACHE_SPACE, "
                                       "no --kv-cache-memory-bytes): not planned"])
    else:
        block = e.block_size or a.block_size or (64 if spec.attention == "mla" else 16)
        if e.kv_cache_memory_bytes is not None:
            budget, source = float(e.kv_cache_memory_bytes), f"--kv-cache-memory-bytes {e.kv_cache_memory_bytes}"
        elif e.gpu_memory_gib is None:
            return EnginePlan(None, per_token, block, None, "GPU memory unknown",
                              notes + ["no GPU memory to plan from: pass --gpu-memory-gib"])
        else:
            w = weight_bytes(ckpt, spec, a.mtp)
            ep = e.tp * e.dp if e.expert_parallel else 1
            weights = weights_per_gpu(w, spec, e.tp, ep)
            util = a.gpu_memory_utilization if e.gpu_memory_utilization is None else e.gpu_memory_utilization
            reserve = a.reserve_gib if e.dp == 1 or a.dp_reserve_gib is None else a.dp_reserve_gib
            budget = e.gpu_memory_gib * GIB * util - weights - reserve * GIB
            source = (f"{e.gpu_memory_gib:.1f} GiB x {util:g} - {weights / GIB:.2f} GiB weights - "
                      f"{reserve:g} GiB reserve")
    tokens = kv_blocks(budget, per_token, block) * block
    return EnginePlan(tokens, per_token, block, budget, source, notes)


def difference_pct(planned: int | None, engine: int | None) -> float | None:
    """How far the plan is from what the engine printed, in percent of the engine's figure (+: the plan is higher)."""
    if planned is None or not engine:
        return None
    return round((planned - engine) / engine * 100, 2)


# ---------------------------------------------------------------- reading (I/O)

def read_local(path: str | Path) -> dict:
    """The same document as on a host, from a directory on this machine (the script's own function)."""
    spec = importlib.util.spec_from_file_location("_railyard_safetensors_headers", HEADER_SCRIPT)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {HEADER_SCRIPT}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.collect(str(path))


def headers_command(model_path: str) -> Sh:
    """python3 reads scripts/safetensors_headers.py from stdin; the standard library is all it needs."""
    return cmd("python3", "-", Sh(q(RemotePath(model_path))))


def read_remote(session: Session, model_path: str, timeout: float = 300) -> dict:
    """config.json and every shard's header in one round trip."""
    r = session.run(headers_command(model_path), timeout=timeout, stdin=HEADER_SCRIPT.read_bytes())
    host = session.host.name
    if r.error:
        raise RailyardError(f"{host}: {r.error.kind}: {r.error.message}" + (f" (fix: {r.error.hint})" if r.error.hint else ""))
    if r.rc != 0:
        tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["no output"]
        raise RailyardError(f"{host}: reading {model_path} failed ({r.rc}): "
                            + ("python3 not found on the host" if r.rc == 127 else tail[0]))
    try:
        doc = json.loads(r.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise RailyardError(f"{host}: unreadable output from the header script: {r.stdout.strip()[:200]!r}") from None
    doc["dir"] = f"{host}:{doc.get('dir') or model_path}"
    return doc


GPU_QUERY = cmd("nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits")


def read_gpus(session: Session, selector: str) -> Gpus:
    r = session.run(GPU_QUERY, timeout=60)
    host = session.host.name
    if r.error:
        raise RailyardError(f"{host}: {r.error.kind}: {r.error.message}")
    if r.rc != 0:
        why = "nvidia-smi not found" if r.rc == 127 else ((r.stderr or r.stdout).strip().splitlines() or ["no output"])[-1]
        raise RailyardError(f"{host}: nvidia-smi failed ({r.rc}): {why}; or pass --gpu-memory-gib and --gpus")
    return parse_gpu_memory(r.stdout, selector, host)


def gather(inventory_loader, model: str | None, gpu_memory_gib: float | None,
           gpus: int | None) -> tuple[dict, Gpus]:
    """The headers document and the GPUs. With a local --model and both GPU flags nothing is loaded
    or contacted; otherwise the inventory's head answers what the flags leave open, over one session."""
    if gpu_memory_gib is not None and gpu_memory_gib <= 0 or gpus is not None and gpus < 1:
        raise UsageError(f"--gpu-memory-gib {gpu_memory_gib} --gpus {gpus}: both must be positive")
    if model is not None and gpu_memory_gib is not None and gpus is not None:
        return read_local(model), Gpus("GPU", gpu_memory_gib, gpus, "--gpu-memory-gib and --gpus")
    from ..transport.runner import Runner
    head = inventory_loader().head
    with Runner([head]) as runner:
        s = runner.session(head)
        doc = read_local(model) if model is not None else read_remote(s, head.vars["model_path"])
        found = read_gpus(s, head.vars["cluster_gpu_name"])
    mem = gpu_memory_gib if gpu_memory_gib is not None else found.memory_gib
    count = gpus if gpus is not None else found.count
    source = found.source if (gpu_memory_gib, gpus) == (None, None) else f"{found.source}, overridden by flags"
    return doc, Gpus(found.name, mem, count, source)


def plan_report(plan_doc: dict) -> Report:
    """plan: a `fits_<layout>` check per layout, pass or warn (a plan judges no host, so never fail);
    `model`, `assumptions` and `layouts` stay at the top level as well (docs/plan.md)."""
    checks = []
    for lp in plan_doc["layouts"]:
        detail = (f"{lp['layout']}: {lp['kv_tokens_per_gpu']:,} KV tokens per GPU, {lp['kv_tokens_per_node']:,} per "
                  f"node, {lp['max_concurrency']:,} request(s) of the context at once")
        ev = f"weights {lp['weights_gib_per_gpu']} GiB per GPU, KV {lp['kv_gib_per_gpu']} GiB per GPU"
        if lp["fits"]:
            checks.append(CheckResult(NO_HOST, f"fits_{lp['layout']}", PASS, detail, ev))
        else:
            checks.append(CheckResult(NO_HOST, f"fits_{lp['layout']}", WARN,
                                      f"{lp['layout']}: does not fit: " + "; ".join(lp["notes"] or ["no KV cache"]), ev,
                                      "a shorter --context, --kv-cache-dtype fp8, or more GPU memory"))
    keep = {k: plan_doc[k] for k in ("model", "assumptions", "layouts")}
    return Report(checks, dict(keep), keep)
