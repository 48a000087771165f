"""`inv plan --against-engine`: railyard's KV tokens per engine beside the figure the engine printed, on the
lab's real checkpoints (their config.json and safetensors headers) and real vLLM CPU-build logs
(tests/fixtures/real/vllm-cpu/ORIGINS.md); the GPU formula against the layouts' and the published case."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import pytest
from invoke.exceptions import Exit

from railyard.verbs import against as A
from railyard.verbs import capacity as C
from railyard.cli import capacity as cli
from railyard.render.docker import config_hash
from railyard.verbs.against import engine_kv_report
from railyard.transport.runner import Runner
from railyard.engines.vllm import engine_kv
from railyard.testing import FakeSession

from .conftest import REAL, real
from .test_capacity import H200_GIB, PUBLISHED_TP_TOKENS, glm  # noqa: F401 (glm: the GLM-5.1 checkpoint fixture)
from .test_plan import HGX, hgx_plan

SPACE_1 = {"VLLM_CPU_KVCACHE_SPACE": "1"}
# one host, TP=2 over two of its devices, the cache in the model's dtype: what tp2.log ran
TP2_SETS = ("cluster_gpus_per_host=2", "vllm_tensor_parallel_size=2", "vllm_kv_cache_dtype=auto")


def lab_checkpoint(tmp_path: Path, name: str) -> C.Checkpoint:
    """The lab's checkpoint `name` (tiny: Qwen3, moe: Qwen3-MoE) from its real config.json and safetensors
    header; the tensor data is a hole, as the planner never reads it."""
    root = tmp_path / name
    root.mkdir()
    (root / "config.json").write_text(real(f"vllm-cpu/{name}-config.json"))
    h = json.loads(real(f"vllm-cpu/{name}-model.safetensors-header.json"))
    raw = json.dumps(h["header"], separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    end = max(t["data_offsets"][1] for k, t in h["header"].items() if k != "__metadata__")
    with open(root / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + end)
    return C.parse_checkpoint(C.read_local(root))


def test_model_reading_handles_the_labs_qwen3_and_qwen3_moe_checkpoints(tmp_path):
    tiny, moe = lab_checkpoint(tmp_path, "tiny"), lab_checkpoint(tmp_path, "moe")
    for ck, arch, experts in ((tiny, "Qwen3ForCausalLM", 0), (moe, "Qwen3MoeForCausalLM", 8)):
        s = C.model_spec(ck.config)
        assert (s.architecture, s.attention, s.layers, s.num_kv_heads, s.head_dim, s.routed_experts, s.caveat) == \
            (arch, "gqa", 2, 2, 64, experts, "")  # head_dim from config (64), not hidden/heads; no sliding window
        fmt = C.kv_format(s, "auto", False)
        # 2 layers x 2 (K, V) x 2 KV heads x 64 x 2 bytes; TP=2: one KV head per rank
        assert [C.kv_bytes_per_token(s, fmt, tp) for tp in (1, 2)] == [1024, 512]
    w = C.weight_bytes(moe, C.model_spec(moe.config), False)
    assert w.expert == 8 * 3 * 2 * 128 * 256 * 2  # 8 experts x gate/up/down x 2 layers, bf16
    assert w.expert + w.split + w.replicated + w.kv_heads == sum(t.nbytes for t in moe.tensors)
    assert C.tensor_role("model.layers.0.mlp.gate.weight", C.model_spec(moe.config)) == "replicated"  # the router
    assert C.tensor_role("model.layers.0.self_attn.q_norm.weight", C.model_spec(tiny.config)) == "replicated"


def serve_words(*flags: str) -> list[str]:
    return ["vllm", "serve", "/model", "--served-model-name", "tiny", *flags]


@pytest.mark.parametrize("model, log, flags, want, block", [
    ("tiny", "vllm-cpu/timed-tp1/logs-t.txt", (), {0: 1_048_576}, 128),
    ("tiny", "vllm-cpu/timed-tp2/logs-t.txt", ("--tensor-parallel-size", "2"), {0: 2_097_152}, 128),
    ("tiny", "vllm-cpu/tp2.log", ("--tensor-parallel-size", "2"), {0: 2_097_152}, 128),
    ("moe", "vllm-cpu/moe1.log", (), {0: 1_048_576}, 128),
    ("moe", "vllm-cpu/moe2.log", ("--data-parallel-size", "2", "--enable-expert-parallel", "--api-server-count", "2"),
     {0: 1_048_576, 1: 1_048_576}, 128),
    # MLA: 2 layers x (kv_lora_rank 256 + qk_rope_head_dim 64) x 2 bytes = 1,280 B a token, not split by TP;
    # its block is 16 whatever --block-size says (the engine's own error: `Unsupported block size: 16`)
    ("mla", "vllm-cpu/mla.log", ("--block-size", "128"), {0: 838_848}, 16),
])
def test_planned_kv_tokens_are_exactly_what_the_cpu_engine_printed(tmp_path, model, log, flags, want, block):
    text = real(log)
    assert "Explicitly set (1.0/" in text  # each capture ran with VLLM_CPU_KVCACHE_SPACE=1 (1 GiB per worker)
    _, plan = hgx_plan()
    svc = plan.services()[0]
    svc = type(svc)(**{**svc.__dict__, "spec": type(svc.spec)(**{**svc.spec.__dict__, "command": tuple(serve_words(*flags))})})
    rows = A.rows_for("single_node_tp", svc, lab_checkpoint(tmp_path, model), engine_kv(text), SPACE_1, [0],
                      C.Assumptions(), None, [])
    assert {r.dp_rank: r.engine_tokens for r in rows} == want
    assert {r.dp_rank: r.planned_tokens for r in rows} == want
    assert {r.difference_pct for r in rows} == {0.0} and {r.device for r in rows} == {"CPU"}
    assert {r.budget for r in rows} == {"VLLM_CPU_KVCACHE_SPACE=1 GiB"} and {r.block_size for r in rows} == {block}


def test_a_cpu_engine_without_a_kv_space_is_not_planned(tmp_path):
    ck = lab_checkpoint(tmp_path, "tiny")
    p = C.plan_engine(ck, A.settings_of(serve_words(), {}, "CPU", None), C.Assumptions())
    assert p.tokens is None and "sized its cache from free memory" in p.notes[0]
    # --kv-cache-memory-bytes is the same budget by another name
    p = C.plan_engine(ck, A.settings_of(serve_words("--kv-cache-memory-bytes", "1GiB"), {}, "CPU", None), C.Assumptions())
    assert p.tokens == 1_048_576


def test_a_gpu_engine_is_planned_as_the_layouts_are_and_scored_against_the_published_figure(glm):  # noqa: F811
    ck = C.parse_checkpoint(C.read_local(glm))
    layouts = {lp.layout: lp for lp in C.plan_capacity(ck, C.Gpus("H200", H200_GIB, 8, "test"), C.Assumptions()).layouts}
    tp8 = C.plan_engine(ck, A.settings_of(serve_words("-tp", "8"), {}, "GPU", H200_GIB), C.Assumptions())
    assert tp8.tokens == layouts["single_node_tp"].kv_tokens_per_gpu == 675_520 and tp8.block_size == 64
    dp8 = C.plan_engine(ck, A.settings_of(serve_words("-dp", "8", "--enable-expert-parallel"), {}, "GPU", H200_GIB),
                        C.Assumptions())
    assert dp8.tokens == layouts["dp_ep"].kv_tokens_per_gpu
    # the published TP=8 figure of GLM-5.1 NVFP4 on 8 x H200 (docs/plan.md): the plan is 0.63 % under it
    assert C.difference_pct(tp8.tokens, PUBLISHED_TP_TOKENS) == -0.63
    # the engine's own utilization flag is what the plan uses
    lower = C.plan_engine(ck, A.settings_of(serve_words("-tp", "8", "--gpu-memory-utilization", "0.8"), {}, "GPU",
                                            H200_GIB), C.Assumptions())
    assert lower.tokens < tp8.tokens and "x 0.8 -" in lower.source


def test_the_engines_flags_are_read_as_vllm_takes_them():
    e = A.settings_of(serve_words("--tensor-parallel-size=4", "-dp", "2", "--enable-expert-parallel", "--block-size",
                                  "32", "--kv-cache-dtype", "fp8", "--kv-cache-memory-bytes", "2G"),
                      {"VLLM_CPU_KVCACHE_SPACE": "4"}, "CPU", None)
    assert (e.tp, e.dp, e.expert_parallel, e.block_size, e.kv_cache_dtype, e.kv_cache_memory_bytes,
            e.cpu_kvcache_space_gib) == (4, 2, True, 32, "fp8", 2_000_000_000, 4)
    assert A.settings_of(serve_words(), {"VLLM_CPU_KVCACHE_SPACE": ""}, "CPU", None).cpu_kvcache_space_gib is None


class Host:
    """A host running one engine container: `docker inspect` shows its environment and label, its log the
    engine's lines."""

    def __init__(self, host, name, env, label, log):
        self.session = FakeSession(host)
        doc = {"State": {"Running": True, "Status": "running", "Pid": 42, "ExitCode": 0,
                         "StartedAt": "2026-12-02T03:45:35.973495132Z"},
               "Config": {"Env": [f"{k}={v}" for k, v in env.items()], "Labels": {"railyard.config": label}}}
        self.session.on(f"docker inspect --format '{{{{json .}}}}' {name}", (0, json.dumps(doc) + "\n"))
        self.session.on(re.compile(r"^docker logs "), lambda c: (0, "".join(
            ln + "\n" for ln in log.splitlines() if "KV cache size:" in ln)))


def tp2_deployment(log: str, env=SPACE_1, label=None):
    inv, plan = hgx_plan(*TP2_SETS)
    svc = plan.services()[0]
    h = Host(inv.hosts[0], svc.spec.name, env, config_hash(plan, svc) if label is None else label, log)
    return inv, plan, h


def test_compare_reads_the_running_engines_environment_and_log(tmp_path):
    inv, plan, h = tp2_deployment(real("vllm-cpu/tp2.log"))
    with Runner(inv.hosts, sessions={"G1": h.session}) as runner:
        rows = A.compare(plan, runner, lab_checkpoint(tmp_path, "tiny"), C.Assumptions(), None, lambda _: "H200")
    [r] = rows
    assert (r.shape, r.planned_tokens, r.engine_tokens, r.difference_pct, r.notes) == ("TP=2", 2_097_152, 2_097_152, 0.0, [])
    doc = json.loads(engine_kv_report(rows, "Qwen3ForCausalLM", {}, A.TOLERANCE_PCT).json())
    assert doc["ok"] and doc["checks"][0]["status"] == "pass" and doc["engines"][0]["planned_tokens"] == 2_097_152
    assert "planned 2,097,152, the engine printed 2,097,152 (+0.00 %)" in doc["checks"][0]["detail"]


def test_an_engine_that_printed_no_kv_line_is_not_seen_and_another_configuration_is_named(tmp_path):
    log = real("vllm-cpu/tp2.log")
    inv, plan, h = tp2_deployment(log[:log.index("CPU KV cache size")], label="0123456789abcdef")
    with Runner(inv.hosts, sessions={"G1": h.session}) as runner:
        [r] = A.compare(plan, runner, lab_checkpoint(tmp_path, "tiny"), C.Assumptions(), None, lambda _: "H200")
    assert r.engine_tokens is None and r.planned_tokens is None
    assert any("another configuration" in n for n in r.notes) and any("no `KV cache size:` line" in n for n in r.notes)
    doc = json.loads(engine_kv_report([r], "Qwen3ForCausalLM", {}, A.TOLERANCE_PCT).json())
    assert doc["ok"] and doc["checks"][0]["status"] == "warn" and "no KV cache size line seen" in doc["checks"][0]["detail"]


def test_an_engine_whose_container_is_gone_is_a_row_not_seen(tmp_path):
    inv, plan, _ = tp2_deployment("")
    s = FakeSession(inv.hosts[0]).on(re.compile(r"^docker inspect "), (1, "", "Error: No such object: vllm-tp8"))
    with Runner(inv.hosts, sessions={"G1": s}) as runner:
        [r] = A.compare(plan, runner, lab_checkpoint(tmp_path, "tiny"), C.Assumptions(), None, lambda _: "H200")
    assert r.engine_tokens is None and "no container vllm-tp8 on G1: `inv launch` first" in r.notes


def test_inv_plan_against_engine_prints_the_comparison(tmp_path, capsys, monkeypatch):
    import railyard.verbs.serve as launch_mod
    import railyard.transport.runner as runner_mod
    inv, plan, h = tp2_deployment(real("vllm-cpu/tp2.log"))
    lab_checkpoint(tmp_path, "tiny")
    real_runner = runner_mod.Runner
    monkeypatch.setattr(runner_mod, "Runner", lambda hosts: real_runner(hosts, sessions={"G1": h.session}))
    monkeypatch.setattr(launch_mod, "build_plan", lambda *a, **k: plan)
    sets = list(TP2_SETS)
    for json_out in (False, True):
        code = 0
        try:
            cli.plan(str(HGX), model=str(tmp_path / "tiny"), against_engine=True, json=json_out, set_=sets)
        except Exit as e:
            code = e.code
        out = capsys.readouterr().out
        assert code == 0
        if json_out:
            doc = json.loads(out)
            assert doc["ok"] and doc["data"]["engines"][0]["engine_tokens"] == 2_097_152
            assert doc["data"]["assumptions"]["difference"] == "(planned - engine) / engine x 100"
        else:
            assert "2,097,152" in out and "+0.00 %" in out and "VLLM_CPU_KVCACHE_SPACE=1 GiB" in out and "OK:" in out


def test_against_engine_refuses_the_flags_that_describe_another_layout(capsys):
    with pytest.raises(Exit) as e:
        cli.plan(str(HGX), against_engine=True, gpus=8)
    assert e.value.code == 2 and "--against-engine" in capsys.readouterr().err


def test_the_fixtures_say_where_they_come_from():
    for d in ("vllm-cpu", "vllm-gpu"):
        origins = (REAL / d / "ORIGINS.md").read_text()
        for f in (REAL / d).rglob("*"):
            if f.is_file() and f.name != "ORIGINS.md" and f.suffix != ".py":
                rel = f.relative_to(REAL / d)
                assert rel.as_posix() in origins or f"{rel.parent.as_posix()}/" in origins, f  # a file or its folder
