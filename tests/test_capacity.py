"""inv plan: KV capacity under TP=8 and DP attention + EP, from header-only checkpoints.

The checkpoints are real safetensors files (8-byte length, JSON header with the real tensor
names, dtypes, shapes and offsets) whose data part is a hole: `truncate` gives them their full
size without using disk, and the planner never reads it. Shapes come from the models' public
config.json files: GLM-5.1 (78 layers, MLA 512 + 64, DSA indexer 128, 256 experts, MTP layer),
Mixtral-8x22B (56 layers, 8 KV heads, 8 experts), Llama-3.1-70B (80 layers, 8 KV heads, dense).
The GLM precisions follow a ModelOpt NVFP4 export: routed experts NVFP4 (packed U8 weights,
F8_E4M3 scales per 16, F32 global scales), everything else BF16, the MTP layer BF16 (~466 GB in
all, against the published "about 470 GB").
"""

from __future__ import annotations

import json
import os
import stat
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from invoke.exceptions import Exit

from railyard.verbs import capacity as C
from railyard.errors import UsageError
from railyard.inventory import Host, Inventory
from railyard.transport import LocalSession

ROOT = Path(__file__).resolve().parent.parent
H200_GIB = 143771 / 1024          # nvidia-smi memory.total of an H200, in GiB
PUBLISHED_TP_TOKENS = 679_808     # seed 002: GLM-5.1 NVFP4 on 8 x H200, TP=8
DTYPE_BYTES = {"BF16": 2, "F32": 4, "U8": 1, "F8_E4M3": 1}


# ---------------------------------------------------------------- writing checkpoints

def write_shard(path: Path, tensors: list[tuple[str, str, list[int]]]) -> int:
    """A safetensors file with these (name, dtype, shape) tensors; the data is a sparse hole."""
    header, offset = {}, 0
    for name, dtype, shape in tensors:
        n = DTYPE_BYTES[dtype]
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)
    return offset


def write_checkpoint(root: Path, config: dict, shards: list[list[tuple[str, str, list[int]]]]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config))
    weight_map, total = {}, 0
    if len(shards) == 1:
        total = write_shard(root / "model.safetensors", shards[0])
        return root
    for i, tensors in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        total += write_shard(root / name, tensors)
        weight_map.update({t[0]: name for t in tensors})
    (root / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}))
    return root


def bf16(name, *shape):
    return (name, "BF16", list(shape))


def nvfp4(name, out_dim, in_dim):
    """A ModelOpt NVFP4 linear: two values per byte, one F8_E4M3 scale per 16, two F32 scalars."""
    return [(f"{name}.weight", "U8", [out_dim, in_dim // 2]), (f"{name}.weight_scale", "F8_E4M3", [out_dim, in_dim // 16]),
            (f"{name}.weight_scale_2", "F32", []), (f"{name}.input_scale", "F32", [])]


GLM51 = {  # zai-org/GLM-5.1 config.json (the fields that shape tensors and caches)
    "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa", "dtype": "bfloat16",
    "first_k_dense_replace": 3, "hidden_size": 6144, "index_head_dim": 128, "index_n_heads": 32,
    "index_topk": 2048, "intermediate_size": 12288, "kv_lora_rank": 512, "max_position_embeddings": 202752,
    "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1, "num_attention_heads": 64,
    "num_experts_per_tok": 8, "num_hidden_layers": 78, "num_key_value_heads": 64, "num_nextn_predict_layers": 1,
    "q_lora_rank": 2048, "qk_head_dim": 256, "qk_nope_head_dim": 192, "qk_rope_head_dim": 64, "v_head_dim": 256,
    "vocab_size": 154880,
    "quantization_config": {"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": "FP8"},
}


def glm_layer(i: int, cfg: dict, experts_fp4: bool) -> list:
    h, p = cfg["hidden_size"], f"model.layers.{i}"
    heads, qk, v, lat, rope = (cfg["num_attention_heads"], cfg["qk_head_dim"], cfg["v_head_dim"],
                               cfg["kv_lora_rank"], cfg["qk_rope_head_dim"])
    ih, inh, qr = cfg["index_head_dim"], cfg["index_n_heads"], cfg["q_lora_rank"]
    t = [bf16(f"{p}.input_layernorm.weight", h), bf16(f"{p}.post_attention_layernorm.weight", h),
         bf16(f"{p}.self_attn.q_a_proj.weight", qr, h), bf16(f"{p}.self_attn.q_a_layernorm.weight", qr),
         bf16(f"{p}.self_attn.q_b_proj.weight", heads * qk, qr),
         bf16(f"{p}.self_attn.kv_a_proj_with_mqa.weight", lat + rope, h),
         bf16(f"{p}.self_attn.kv_a_layernorm.weight", lat),
         bf16(f"{p}.self_attn.kv_b_proj.weight", heads * (cfg["qk_nope_head_dim"] + v), lat),
         bf16(f"{p}.self_attn.o_proj.weight", h, heads * v),
         bf16(f"{p}.self_attn.indexer.wq_b.weight", inh * ih, qr), bf16(f"{p}.self_attn.indexer.wk.weight", ih, h),
         bf16(f"{p}.self_attn.indexer.k_norm.weight", ih), bf16(f"{p}.self_attn.indexer.k_norm.bias", ih),
         bf16(f"{p}.self_attn.indexer.weights_proj.weight", inh, h)]
    if i < cfg["first_k_dense_replace"]:
        f = cfg["intermediate_size"]
        return t + [bf16(f"{p}.mlp.gate_proj.weight", f, h), bf16(f"{p}.mlp.up_proj.weight", f, h),
                    bf16(f"{p}.mlp.down_proj.weight", h, f)]
    f, n = cfg["moe_intermediate_size"], cfg["n_routed_experts"]
    t += [bf16(f"{p}.mlp.gate.weight", n, h), (f"{p}.mlp.gate.e_score_correction_bias", "F32", [n]),
          bf16(f"{p}.mlp.shared_experts.gate_proj.weight", f, h), bf16(f"{p}.mlp.shared_experts.up_proj.weight", f, h),
          bf16(f"{p}.mlp.shared_experts.down_proj.weight", h, f)]
    for e in range(n):
        q = f"{p}.mlp.experts.{e}"
        for proj, o, k in (("gate_proj", f, h), ("up_proj", f, h), ("down_proj", h, f)):
            t += nvfp4(f"{q}.{proj}", o, k) if experts_fp4 else [bf16(f"{q}.{proj}.weight", o, k)]
    return t


def glm_shards(cfg: dict) -> list:
    h, vocab, layers = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    shards = [[bf16("model.embed_tokens.weight", vocab, h)]]
    shards += [glm_layer(i, cfg, experts_fp4=True) for i in range(layers)]
    mtp = glm_layer(layers, cfg, experts_fp4=False)  # the MTP block, kept in BF16
    p = f"model.layers.{layers}"
    mtp += [bf16(f"{p}.eh_proj.weight", h, 2 * h), bf16(f"{p}.enorm.weight", h), bf16(f"{p}.hnorm.weight", h),
            bf16(f"{p}.shared_head.norm.weight", h)]
    shards.append(mtp)
    shards.append([bf16("model.norm.weight", h), bf16("lm_head.weight", vocab, h)])
    return shards


MIXTRAL_8X22B = {  # mistralai/Mixtral-8x22B-v0.1 config.json
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "torch_dtype": "bfloat16", "hidden_size": 6144,
    "intermediate_size": 16384, "num_hidden_layers": 56, "num_attention_heads": 48, "num_key_value_heads": 8,
    "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 32000, "max_position_embeddings": 65536,
}

LLAMA31_70B = {  # meta-llama/Llama-3.1-70B config.json
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "bfloat16", "hidden_size": 8192,
    "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
    "vocab_size": 128256, "max_position_embeddings": 131072,
}


def gqa_shards(cfg: dict) -> list:
    h, f, heads, kvh = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = h // heads
    shards = [[bf16("model.embed_tokens.weight", cfg["vocab_size"], h)]]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        t = [bf16(f"{p}.input_layernorm.weight", h), bf16(f"{p}.post_attention_layernorm.weight", h),
             bf16(f"{p}.self_attn.q_proj.weight", heads * d, h), bf16(f"{p}.self_attn.k_proj.weight", kvh * d, h),
             bf16(f"{p}.self_attn.v_proj.weight", kvh * d, h), bf16(f"{p}.self_attn.o_proj.weight", h, heads * d)]
        if cfg.get("num_local_experts"):
            t.append(bf16(f"{p}.block_sparse_moe.gate.weight", cfg["num_local_experts"], h))
            for e in range(cfg["num_local_experts"]):
                q = f"{p}.block_sparse_moe.experts.{e}"
                t += [bf16(f"{q}.w1.weight", f, h), bf16(f"{q}.w2.weight", h, f), bf16(f"{q}.w3.weight", f, h)]
        else:
            t += [bf16(f"{p}.mlp.gate_proj.weight", f, h), bf16(f"{p}.mlp.up_proj.weight", f, h),
                  bf16(f"{p}.mlp.down_proj.weight", h, f)]
        shards.append(t)
    shards.append([bf16("model.norm.weight", h), bf16("lm_head.weight", cfg["vocab_size"], h)])
    return shards


@pytest.fixture(scope="module")
def glm(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("ckpt") / "GLM-5.1-NVFP4", GLM51, glm_shards(GLM51))


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("ckpt") / "Mixtral-8x22B", MIXTRAL_8X22B, gqa_shards(MIXTRAL_8X22B))


@pytest.fixture(scope="module")
def llama70b(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("ckpt") / "Llama-3.1-70B", LLAMA31_70B, gqa_shards(LLAMA31_70B))


def plan(path: Path, **kw) -> C.Plan:
    gpus = C.Gpus("NVIDIA H200", kw.pop("gib", H200_GIB), kw.pop("gpus", 8), "test")
    return C.plan_capacity(C.parse_checkpoint(C.read_local(path)), gpus, C.Assumptions(**kw))


def by_layout(p: C.Plan) -> dict[str, C.LayoutPlan]:
    return {lp.layout: lp for lp in p.layouts}


# ---------------------------------------------------------------- the published case and the GQA cases

def test_glm51_nvfp4_on_8_h200_reproduces_the_published_tp_figure_and_dp_ep_is_several_times_more(glm):
    p = plan(glm)
    tp, dp = by_layout(p)["single_node_tp"], by_layout(p)["dp_ep"]
    a = p.assumptions
    assert 430 <= a["checkpoint_gib"] <= 440                      # ~466 GB on disk
    assert a["routed_expert_gib"] / a["weights_gib"] > 0.9        # almost all in the routed experts
    assert a["mtp_weights_gib"] > 15 and a["mtp"] is False        # the MTP layer is not loaded without MTP
    # MLA: one 576-wide bf16 latent plus the indexer's 128 fp8 + 4 scale bytes per token and layer, on every GPU
    assert tp.kv_bytes_per_token_per_gpu == dp.kv_bytes_per_token_per_gpu == 78 * (576 * 2 + 132)
    assert abs(tp.kv_tokens_per_node - PUBLISHED_TP_TOKENS) / PUBLISHED_TP_TOKENS < 0.25
    assert tp.kv_tokens_per_gpu == tp.kv_tokens_per_node          # one engine: every GPU holds every token
    assert dp.kv_tokens_per_node == 8 * dp.kv_tokens_per_gpu      # eight engines, one cache each
    assert dp.ratio_vs_tp >= 2.5 and tp.ratio_vs_tp == 1.0
    assert dp.weights_gib_per_gpu > tp.weights_gib_per_gpu        # the price: dense weights replicated
    assert dp.max_concurrency > 2 * tp.max_concurrency >= 2
    assert a["gpu_memory_utilization"] == 0.9 and a["kv_cache_dtype_resolved"] == "bfloat16"
    assert "kv_cache_quant_algo FP8" in a["kv_cache_dtype_note"]


def test_glm51_fp8_cache_uses_vllms_fp8_ds_mla_layout_and_mtp_adds_a_layer(glm):
    fp8 = by_layout(plan(glm, kv_cache_dtype="fp8"))["single_node_tp"]
    assert fp8.kv_bytes_per_token_per_gpu == 78 * (656 + 132)
    base = by_layout(plan(glm))["single_node_tp"]
    assert fp8.kv_tokens_per_node > 1.5 * base.kv_tokens_per_node
    mtp = plan(glm, mtp=True)
    t = by_layout(mtp)["single_node_tp"]
    assert t.kv_bytes_per_token_per_gpu == 79 * (576 * 2 + 132) and mtp.assumptions["kv_layers"] == 79
    assert t.weights_gib_per_gpu > base.weights_gib_per_gpu and t.kv_tokens_per_node < base.kv_tokens_per_node


def test_gqa_moe_gains_little_or_nothing_from_dp_ep(mixtral):
    p = plan(mixtral)
    tp, dp = by_layout(p)["single_node_tp"], by_layout(p)["dp_ep"]
    # 8 KV heads split over 8 GPUs under TP: one head per GPU; each DP rank keeps all eight
    assert tp.kv_bytes_per_token_per_gpu * 8 == dp.kv_bytes_per_token_per_gpu == 56 * 2 * 8 * 128 * 2
    assert dp.ratio_vs_tp <= 1.1
    assert dp.fits and tp.fits


def test_dense_gqa_model_splits_under_tp_and_does_not_fit_whole_on_each_gpu(llama70b):
    p = plan(llama70b)
    tp, dp = by_layout(p)["single_node_tp"], by_layout(p)["dp_ep"]
    assert p.assumptions["routed_expert_gib"] == 0
    assert 130 < p.assumptions["weights_gib"] < 132                # 70.6B parameters in bf16
    assert tp.weights_gib_per_gpu == pytest.approx(p.assumptions["weights_gib"] / 8, rel=0.01)
    assert tp.kv_bytes_per_token_per_gpu == 80 * 2 * 1 * 128 * 2
    assert tp.fits and tp.kv_tokens_per_node > 1_000_000 and tp.max_concurrency >= 8
    assert not dp.fits and dp.kv_tokens_per_node == 0 and dp.max_concurrency == 0
    assert any("no KV cache" in n for n in dp.notes) and any("no routed experts" in n for n in dp.notes)


def test_kv_heads_are_replicated_once_tp_exceeds_them():
    spec = C.model_spec({"num_hidden_layers": 10, "num_attention_heads": 32, "num_key_value_heads": 4,
                         "hidden_size": 4096, "torch_dtype": "float16"})
    fmt = C.kv_format(spec, "auto", mtp=False)
    per_head = 10 * 2 * 128 * 2
    assert [C.kv_bytes_per_token(spec, fmt, tp) for tp in (1, 2, 4, 8)] == [4 * per_head, 2 * per_head, per_head, per_head]
    w = C.WeightBytes(kv_heads=8 * 4)
    assert C.weights_per_gpu(w, spec, 8, 1) == 8                     # k/v projections: 4 ways, not 8


def test_mla_latent_is_the_same_on_every_tp_rank_and_fp8_is_one_byte_without_dsa():
    spec = C.model_spec({"num_hidden_layers": 61, "kv_lora_rank": 512, "qk_rope_head_dim": 64})  # DeepSeek-V3
    bf = C.kv_format(spec, "auto", mtp=False)
    assert {C.kv_bytes_per_token(spec, bf, tp) for tp in (1, 8)} == {61 * 576 * 2}
    assert C.kv_bytes_per_token(spec, C.kv_format(spec, "fp8", mtp=False), 8) == 61 * 576


def test_the_flags_move_the_figures_the_right_way(glm):
    base = by_layout(plan(glm))["single_node_tp"]
    more = by_layout(plan(glm, gpu_memory_utilization=0.95))["single_node_tp"]
    less = by_layout(plan(glm, reserve_gib=16))["single_node_tp"]
    assert more.kv_tokens_per_node > base.kv_tokens_per_node > less.kv_tokens_per_node
    short = by_layout(plan(glm, context=32768))["single_node_tp"]
    assert short.max_concurrency == base.kv_tokens_per_node // 32768
    assert base.kv_tokens_per_node % 64 == 0                         # whole 64-token MLA blocks


# ---------------------------------------------------------------- bad input: one line naming the file, exit 2

def tiny(tmp_path: Path, name="tiny") -> Path:
    cfg = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 256,
           "torch_dtype": "bfloat16", "max_position_embeddings": 4096}
    return write_checkpoint(tmp_path / name, cfg, gqa_shards({**cfg, "intermediate_size": 512, "vocab_size": 1000}))


def expect_error(path: Path, needle: str) -> str:
    with pytest.raises(UsageError) as e:
        C.parse_checkpoint(C.read_local(path))
    msg = str(e.value)
    assert e.value.exit_code == 2 and "\n" not in msg and needle in msg, msg
    return msg


def test_missing_config_json(tmp_path):
    root = tiny(tmp_path)
    (root / "config.json").unlink()
    assert expect_error(root, "missing").startswith(f"{root}/config.json:")


def test_header_that_is_not_json(tmp_path):
    root = tiny(tmp_path)
    shard = root / "model-00002-of-00004.safetensors"
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.seek(8)
        f.write(b"{not json")
    assert expect_error(root, "header is not JSON").startswith(f"{shard}:")
    assert shard.stat().st_size == size


def test_truncated_shard(tmp_path):
    root = tiny(tmp_path)
    shard = root / "model-00003-of-00004.safetensors"
    os.truncate(shard, shard.stat().st_size - 100)
    assert expect_error(root, "truncated").startswith(f"{shard}:")
    os.truncate(shard, 5)
    assert "too short" in expect_error(root, "truncated")


def test_shard_named_by_the_index_but_absent(tmp_path):
    root = tiny(tmp_path)
    (root / "model-00004-of-00004.safetensors").unlink()
    assert "model-00004-of-00004.safetensors: missing" in expect_error(root, "missing")


def test_single_file_checkpoint(tmp_path):
    cfg = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 256, "torch_dtype": "bfloat16"}
    root = write_checkpoint(tmp_path / "one", cfg, [[bf16("model.layers.0.self_attn.q_proj.weight", 256, 256),
                                                       bf16("model.layers.1.self_attn.k_proj.weight", 256, 256)]])
    ck = C.parse_checkpoint(C.read_local(root))
    assert ck.files == 1 and ck.total_bytes == 2 * 256 * 256 * 2


# ---------------------------------------------------------------- the remote path and the task

def local_host(**vars_) -> Host:
    v = {"ssh_connect_timeout": 5, "ssh_command_timeout": 60, "ssh_parallel": 4}
    v.update(vars_)
    return Host("A", 0, "", 22, "", "local", "", {}, v)


def test_header_script_runs_as_python3_stdin_in_one_round_trip(tmp_path):
    root = tiny(tmp_path, "remote model")   # a space: the path must reach the shell quoted
    calls = []

    class Counting(LocalSession):
        def run(self, command, **kw):
            calls.append(command)
            return super().run(command, **kw)

    doc = C.read_remote(Counting(local_host()), str(root))
    assert len(calls) == 1 and calls[0].startswith("python3 - ")
    local = C.read_local(root)
    assert doc["files"] == local["files"] and doc["config"] == local["config"]
    assert doc["dir"] == f"A:{root}"
    assert C.parse_checkpoint(doc).total_bytes == C.parse_checkpoint(local).total_bytes


def fake_nvidia_smi(tmp_path: Path, rows: str) -> str:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    tool = bin_dir / "nvidia-smi"
    tool.write_text("#!/bin/sh\ncat <<'EOF'\n" + rows + "EOF\n")
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    return f"{bin_dir}:{os.environ['PATH']}"


def test_head_gives_the_model_and_the_gpus_that_match_cluster_gpu_name(tmp_path, monkeypatch):
    root = tiny(tmp_path)
    monkeypatch.setenv("PATH", fake_nvidia_smi(tmp_path, "NVIDIA RTX PRO 6000, 97887\n" + "NVIDIA H200, 143771\n" * 8))
    inv = Inventory(tmp_path / "inv.yml", [local_host(model_path=str(root), cluster_gpu_name="H200")])
    doc, gpus = C.gather(lambda: inv, None, None, None)
    assert gpus.count == 8 and gpus.memory_gib == pytest.approx(H200_GIB) and "nvidia-smi on A" in gpus.source
    assert C.parse_checkpoint(doc).config["num_hidden_layers"] == 2
    with pytest.raises(Exception, match="no GPU matches cluster_gpu_name 'GB300'"):
        C.gather(lambda: Inventory(inv.path, [local_host(model_path=str(root), cluster_gpu_name="GB300")]),
                 None, None, None)


def test_model_and_gpu_flags_need_no_inventory():
    def no_inventory():
        raise AssertionError("the inventory must not be loaded")
    with pytest.raises(UsageError):
        C.gather(no_inventory, "/nonexistent", 0, 8)
    doc, gpus = C.gather(no_inventory, "/nonexistent", 140.0, 8)
    assert not doc["exists"] and gpus.count == 8


def run_plan(capsys, *args, **kw):
    from railyard.cli import capacity
    code = 0
    try:
        capacity.plan(*args, **kw)
    except Exit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_plan_json_contract(glm, capsys):
    code, out, _ = run_plan(capsys, model=str(glm), gpu_memory_gib=H200_GIB, gpus=8, json=True)
    doc = json.loads(out)
    assert code == 0 and doc["ok"] is True and set(doc) >= {"ok", "assumptions", "layouts"}
    assert [lp["layout"] for lp in doc["layouts"]] == ["single_node_tp", "dp_ep"]
    for lp in doc["layouts"]:
        assert {"weights_gib_per_gpu", "kv_tokens_per_gpu", "kv_tokens_per_node", "max_concurrency"} <= set(lp)
    assert doc["assumptions"]["gpu_memory_utilization"] == 0.9 and doc["assumptions"]["reserve_gib_per_gpu"] == 8.0


def test_plan_table_prints_both_layouts_and_the_assumptions(mixtral, capsys):
    code, out, _ = run_plan(capsys, model=str(mixtral), gpu_memory_gib=H200_GIB, gpus=8, context=32768)
    assert code == 0
    for text in ("single_node_tp", "dp_ep", "KV tokens/node", "gpu_memory_utilization 0.9", "reserve",
                 "32,768", "bfloat16"):
        assert text in out, text


def test_plan_bad_checkpoint_exits_2_with_one_line(tmp_path, capsys):
    root = tiny(tmp_path)
    (root / "config.json").write_text("{")
    code, out, err = run_plan(capsys, model=str(root), gpu_memory_gib=140, gpus=8, json=True)
    assert code == 2 and out == "" and err.count("\n") == 1 and f"{root}/config.json" in err


def test_inv_plan_runs_from_the_command_line(tmp_path):
    root = tiny(tmp_path)
    r = subprocess.run([sys.executable, "-m", "invoke", "plan", "--model", str(root), "--gpu-memory-gib", "80",
                        "--gpus", "2", "--json"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["assumptions"]["gpus"] == 2
    r = subprocess.run([sys.executable, "-m", "invoke", "plan", "--model", str(root), "--gpu-memory-gib", "lots",
                        "--gpus", "2"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 2 and "--gpu-memory-gib 'lots': not a number" in r.stderr


def test_sliding_window_layers_are_named_as_not_modelled():
    spec = C.model_spec({"num_hidden_layers": 4, "num_attention_heads": 8, "hidden_size": 512,
                         "layer_types": ["sliding_attention", "full_attention"] * 2})
    assert "sliding_attention" in spec.caveat
    qwen2 = C.model_spec({"num_hidden_layers": 4, "num_attention_heads": 8, "hidden_size": 512,
                          "sliding_window": 131072, "use_sliding_window": False})
    assert qwen2.caveat == ""


def test_real_h200_nvidia_smi_row():
    text = (ROOT / "tests/fixtures/real/plan-h200/query-gpu-name-memory-csv-noheader-nounits.txt").read_text()
    gpus = C.parse_gpu_memory(text, "H200", "h200")
    assert (gpus.name, gpus.count, gpus.memory_gib * 1024) == ("NVIDIA H200", 1, 143771)


def test_a_larger_reserve_on_the_dp_ranks_only_moves_dp_ep(glm):
    base, dp15 = plan(glm), plan(glm, dp_reserve_gib=15)
    assert by_layout(dp15)["single_node_tp"] == by_layout(base)["single_node_tp"]
    assert by_layout(dp15)["dp_ep"].kv_tokens_per_node < by_layout(base)["dp_ep"].kv_tokens_per_node
    assert dp15.assumptions["dp_reserve_gib_per_gpu"] == 15 and dp15.assumptions["reserve_gib_per_gpu"] == 8
