"""What `inv plan` prints: one table row per layout, then the assumptions the figures rest on."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text

from ..verbs.capacity import Plan

LABELS = {"single_node_tp": "TP={n} (one engine)", "dp_ep": "DP={n} + EP (attention DP, experts EP)"}


def plan_table(plan: Plan) -> Table:
    a = plan.assumptions
    t = Table(title=f"plan: {plan.model} on {a['gpus']} x {a['gpu']} ({a['gpu_memory_gib']:.1f} GiB), "
                    f"context {a['context']:,}", title_justify="left")
    t.add_column("layout", no_wrap=True)
    for col in ("weights/GPU", "KV cache/GPU", "KV bytes/token/GPU", "KV tokens/GPU", "KV tokens/node",
                f"requests of {a['context']:,}", "vs TP"):
        t.add_column(col, justify="right", no_wrap=True)
    t.add_column("notes", overflow="fold")
    for lp in plan.layouts:
        style = "" if lp.fits else "red"
        t.add_row(Text(f"{lp.layout}\n{LABELS[lp.layout].format(n=lp.tp * lp.dp)}", style=style),
                  f"{lp.weights_gib_per_gpu:.1f} GiB", f"{lp.kv_gib_per_gpu:.1f} GiB",
                  f"{lp.kv_bytes_per_token_per_gpu:,}", f"{lp.kv_tokens_per_gpu:,}",
                  Text(f"{lp.kv_tokens_per_node:,}", style="bold"), f"{lp.max_concurrency:,}",
                  "-" if lp.ratio_vs_tp is None else f"{lp.ratio_vs_tp:.2f}x",
                  Text("\n".join(lp.notes), style="yellow") if lp.notes else "")
    return t


def assumption_lines(plan: Plan) -> list[str]:
    a, s = plan.assumptions, plan.spec
    if s.attention == "mla":
        attn = (f"MLA: {s.kv_lora_rank} + {s.qk_rope_head_dim} latent per token and layer, the same on every TP rank"
                + (f"; DSA indexer key {s.index_head_dim} fp8 + scales = {a['kv_indexer_bytes_per_token_layer']} B"
                   if s.index_head_dim else ""))
    else:
        attn = (f"grouped-query attention: {s.num_kv_heads} KV heads x {s.head_dim}, split across TP ranks "
                "(replicated once TP exceeds the KV heads)")
    lines = [
        f"model: {a['model_dir']} ({a['shards']} shard(s), {a['checkpoint_gib']:.1f} GiB; loaded weights "
        f"{a['weights_gib']:.1f} GiB, routed experts {a['routed_expert_gib']:.1f} GiB)",
        f"attention: {attn}; {a['kv_layers']} layers hold KV"
        + (" (MTP layers included: --mtp)" if a["mtp"] else
           f" (MTP layers not counted: {a['mtp_weights_gib']:.1f} GiB of MTP weights unloaded; --mtp counts them)"
           if s.mtp_layers else ""),
        f"GPUs: {a['gpu_source']}",
        f"KV budget per GPU = {a['gpu_memory_gib']:.2f} GiB x gpu_memory_utilization {a['gpu_memory_utilization']:g} "
        f"- weights/GPU - reserve {a['reserve_gib_per_gpu']:g} GiB"
        + (f" (dp_ep ranks: {a['dp_reserve_gib_per_gpu']:g} GiB)" if a["dp_reserve_gib_per_gpu"] != a["reserve_gib_per_gpu"]
           else "")
        + " (peak activation, CUDA graphs, non-torch memory, as vLLM's gpu_worker profiles them; "
        "--reserve-gib, --dp-reserve-gib)",
        f"kv_cache_dtype {a['kv_cache_dtype']} -> {a['kv_cache_dtype_resolved']} "
        f"({a['kv_attention_bytes_per_token_layer']} B per token and layer at TP=1); block size {a['block_size']}",
        f"context {a['context']:,} ({a['context_source']}): requests = whole requests that fit at once, per engine, "
        "summed over engines",
        "single_node_tp: one engine; each GPU holds every token's latent (MLA) or its share of the KV heads (GQA); "
        "dp_ep: one engine and one KV cache per GPU, node = sum of ranks",
    ]
    if a["model_caveat"]:
        lines.append(f"not modelled: {a['model_caveat']}")
    if a["kv_cache_dtype_note"]:
        lines.append(f"note: {a['kv_cache_dtype_note']}")
    return lines


def print_plan(plan: Plan, console) -> None:
    console.print(plan_table(plan))
    console.print("assumptions:", style="bold")
    for line in assumption_lines(plan):
        console.print(f"  {line}", highlight=False, markup=False)
