"""The lab checkpoint: the lab's real model (lab/railyard_lab/tinymodel.py), plus padding shards for size.

The model (config.json, generation_config.json, model.safetensors, the tokenizer with its chat
template) is the one the real vLLM serves; `model.safetensors.index.json` maps every one of its
tensors to model.safetensors, as a sharded checkpoint's index does. The padding shards
(`lab-padding-00001-of-000NN.safetensors`: valid safetensors files, one U8 tensor of random bytes)
make the checkpoint as large as a copy test needs; the index names none of them, so the engine
loads none (vLLM keeps only the files its index names) while sync-model copies and proves them
like any shard. A `.cache/huggingface/` directory is added, as `hf download --local-dir` leaves
one, to prove it is never copied or compared.
"""

from __future__ import annotations

import json
import random
import shutil
import struct
from pathlib import Path

CHUNK = 64 << 20
MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json")


def shard_name(i: int, n: int) -> str:
    return f"lab-padding-{i:05d}-of-{n:05d}.safetensors"


def tensor_names(path: Path) -> list[str]:
    """The tensor names of a safetensors file, from its header (8-byte length, then JSON)."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    return sorted(k for k in header if k != "__metadata__")


def write_checkpoint(root: Path, size_gb: float, shards: int, seed: int = 53, kind: str = "dense",
                     model_seed: int | None = None) -> dict:
    """Write the checkpoint under root (created): the lab model of that kind (and model_seed: the
    lab's own unless given) and `shards` padding shards of size_gb in all; returns {"files": n,
    "bytes": total} (the bytes of every shard, the model's included)."""
    from . import MODEL_SEED
    from .components import model
    if shards < 1:
        raise ValueError("shards must be >= 1")
    src = model(kind, MODEL_SEED if model_seed is None else model_seed)
    root.mkdir(parents=True, exist_ok=True)
    for name in MODEL_FILES:
        shutil.copyfile(src / name, root / name)
    weights = root / "model.safetensors"
    total = weights.stat().st_size
    (root / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": {t: weights.name for t in tensor_names(weights)}}, indent=2))
    rng = random.Random(seed)
    per = max(1, int(size_gb * 1e9 / shards))
    for i in range(1, shards + 1):
        header = {"padding": {"dtype": "U8", "shape": [per], "data_offsets": [0, per]}, "__metadata__": {"format": "pt"}}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        with open(root / shard_name(i, shards), "wb") as f:
            f.write(struct.pack("<Q", len(raw)))
            f.write(raw)
            left = per
            while left:
                n = min(CHUNK, left)
                f.write(rng.randbytes(n))
                left -= n
        total += per
    cache = root / ".cache" / "huggingface"
    cache.mkdir(parents=True, exist_ok=True)
    (cache / "download.lock").write_text("lab\n")
    return {"files": len(MODEL_FILES) + 1 + shards, "bytes": total}
