"""The lab's real model: a tiny random-weight checkpoint that the real vLLM serves on a CPU.

Written offline by `transformers` (random weights from a fixed seed), with the lab's word-level
tokenizer (lab/railyard_lab/tokenizer) and a one-line chat template. Two kinds:

- `dense`: Qwen3ForCausalLM, hidden 256, 2 layers, 4 heads, 2 KV heads of 64 (1,024 bytes of KV
  cache per token in bf16: 2 layers x K,V x 2 heads x 64 x 2 bytes);
- `moe`: Qwen3MoeForCausalLM of the same shape with 8 experts, 2 per token (the dp_ep layout).

Qwen3, not Qwen2: transformers 5 forces its BPE Qwen2Tokenizer on model_type qwen2 and breaks the
word-level tokenizer; qwen3 and qwen3_moe load tokenizer.json as it is. The vocabulary is 4,096
(the tokenizer's 4,000 words and its end-of-text token, padded as real checkpoints pad theirs):
without an end-of-text token in the tokenizer, transformers adds one at id 4,000, past a 4,000-row
embedding, and vLLM's min-tokens logits processor fails the first request that names stop tokens.

Run with the engine venv's python (it needs torch and transformers), never imported by that venv:
    <venvs>/vllm/bin/python lab/railyard_lab/tinymodel.py OUT_DIR KIND SEED
The lab imports this module only for SPEC, which names everything that makes a model.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

TOKENIZER_DIR = Path(__file__).resolve().parent / "tokenizer"
EOS = "<|endoftext|>"
EOS_ID = 4000
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
COMMON = {"vocab_size": 4096, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 8192,
          "tie_word_embeddings": True, "eos_token_id": EOS_ID, "torch_dtype": "bfloat16"}
KINDS = {
    "dense": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {"num_experts": 8, "num_experts_per_tok": 2,
                                                      "moe_intermediate_size": 128, "decoder_sparse_step": 1,
                                                      "mlp_only_layers": []}),
}
# what makes a model: a change here is another model (the lab's cache key)
SPEC = json.dumps({"common": COMMON, "kinds": KINDS, "eos": EOS, "template": CHAT_TEMPLATE, "version": 1},
                  sort_keys=True)


def write(out: Path, kind: str, seed: int) -> None:
    import torch
    import transformers
    config_cls, model_cls, extra = KINDS[kind]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**COMMON, **extra)
    model = getattr(transformers, model_cls)(config).to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok = json.loads((TOKENIZER_DIR / "tokenizer.json").read_text())
    tok["added_tokens"] = [{"id": EOS_ID, "content": EOS, "single_word": False, "lstrip": False, "rstrip": False,
                            "normalized": False, "special": True}]
    (out / "tokenizer.json").write_text(json.dumps(tok))
    cfg = json.loads((TOKENIZER_DIR / "tokenizer_config.json").read_text())
    cfg.update(eos_token=EOS, pad_token=EOS, chat_template=CHAT_TEMPLATE)
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    (out / "special_tokens_map.json").write_text(json.dumps({"eos_token": EOS, "pad_token": EOS}))


if __name__ == "__main__":
    target, kind_, seed_ = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    write(tmp, kind_, seed_)
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
