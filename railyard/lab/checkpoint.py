"""A fake checkpoint for the lab: random safetensors shards plus a real-shaped config and index.

Each shard is a valid safetensors file (8-byte header length, JSON header, data) holding
one U8 tensor of random bytes; `model.safetensors.index.json` maps a few tensor names to
every shard; `config.json` carries the fields sync-model checks (`architectures`,
`quantization_config.quant_algo`) and the attention and MoE fields `inv plan` reads. A `.cache/huggingface/` directory is added, as
`hf download --local-dir` leaves one, to prove it is never copied or compared. The tokenizer
is a real one (built offline by railyard/lab/tokenizer/build.py), so that AIPerf can make prompts.
"""

from __future__ import annotations

import json
import random
import struct
from pathlib import Path

CHUNK = 64 << 20
TOKENIZER_DIR = Path(__file__).resolve().parent / "tokenizer"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def shard_name(i: int, n: int) -> str:
    return f"model-{i:05d}-of-{n:05d}.safetensors"


def write_checkpoint(root: Path, size_gb: float, shards: int, seed: int = 53) -> dict:
    """Write the checkpoint under root (created); returns {"files": n, "bytes": total}."""
    if shards < 1:
        raise ValueError("shards must be >= 1")
    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    per = max(1, int(size_gb * 1e9 / shards))
    weight_map = {}
    total = 0
    for i in range(1, shards + 1):
        name = shard_name(i, shards)
        tensors = {f"model.layers.{i - 1}.mlp.experts.weight_packed": None}
        header = {k: {"dtype": "U8", "shape": [per], "data_offsets": [0, per]} for k in tensors}
        header["__metadata__"] = {"format": "pt"}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        with open(root / name, "wb") as f:
            f.write(struct.pack("<Q", len(raw)))
            f.write(raw)
            left = per
            while left:
                n = min(CHUNK, left)
                f.write(rng.randbytes(n))
                left -= n
        total += per
        for k in tensors:
            weight_map[k] = name
        weight_map[f"model.layers.{i - 1}.input_layernorm.weight"] = name
    (root / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2))
    (root / "config.json").write_text(json.dumps({  # GLM-5's attention and MoE fields, one layer per shard
        "architectures": ["GlmMoeDsaForCausalLM"],
        "model_type": "glm_moe_dsa",
        "hidden_size": 6144,
        "num_hidden_layers": shards,
        "num_attention_heads": 64, "num_key_value_heads": 64, "kv_lora_rank": 512, "q_lora_rank": 2048,
        "qk_nope_head_dim": 192, "qk_rope_head_dim": 64, "v_head_dim": 256, "index_head_dim": 128,
        "index_n_heads": 32, "index_topk": 2048, "n_routed_experts": 256, "num_experts_per_tok": 8,
        "moe_intermediate_size": 2048, "intermediate_size": 12288, "vocab_size": 154880,
        "first_k_dense_replace": 0, "num_nextn_predict_layers": 0,
        "torch_dtype": "bfloat16",
        "quantization_config": {"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION",
                                "kv_cache_quant_algo": "FP8"},
    }, indent=2))
    (root / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 1.0}))
    for name in TOKENIZER_FILES:  # the lab's small real tokenizer (railyard/lab/tokenizer), for AIPerf and the stand-in
        (root / name).write_bytes((TOKENIZER_DIR / name).read_bytes())
    cache = root / ".cache" / "huggingface"
    cache.mkdir(parents=True, exist_ok=True)
    (cache / "download.lock").write_text("lab\n")
    return {"files": shards + 3 + len(TOKENIZER_FILES), "bytes": total}
