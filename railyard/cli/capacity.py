"""inv plan: KV cache per GPU and per node under each one-host layout, from the checkpoint's headers; with
--against-engine, beside what the running engines printed. The view: one table row per layout, then the
assumptions the figures rest on."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.table import Table
from rich.text import Text

from ..errors import UsageError
from . import console, load, rtask

if TYPE_CHECKING:
    from ..verbs.capacity import Plan


def _row(name: str):
    """The layout's row in the planner (its `kv_plan`: label, shape, what the assumptions say of it)."""
    from ..plan import layout as layouts
    return layouts.by_name(name).kv_plan


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
        t.add_row(Text(f"{lp.layout}\n{_row(lp.layout).label.format(n=lp.tp * lp.dp)}", style=style),
                  f"{lp.weights_gib_per_gpu:.1f} GiB", f"{lp.kv_gib_per_gpu:.1f} GiB",
                  f"{lp.kv_bytes_per_token_per_gpu:,}", f"{lp.kv_tokens_per_gpu:,}",
                  Text(f"{lp.kv_tokens_per_node:,}", style="bold"), f"{lp.max_concurrency:,}",
                  "-" if lp.ratio_vs_tp is None else f"{lp.ratio_vs_tp:.2f}x",
                  Text("\n".join(lp.notes), style="yellow") if lp.notes else "")
    return t


def assumption_lines(plan: Plan) -> list[str]:
    a, s = plan.assumptions, plan.spec
    rows = [(lp.layout, _row(lp.layout)) for lp in plan.layouts]
    per_gpu = ", ".join(name for name, row in rows if row.engine_per_gpu)
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
        + (f" ({per_gpu} ranks: {a['dp_reserve_gib_per_gpu']:g} GiB)"
           if a["dp_reserve_gib_per_gpu"] != a["reserve_gib_per_gpu"] else "")
        + " (peak activation, CUDA graphs, non-torch memory, as vLLM's gpu_worker profiles them; "
        "--reserve-gib, --dp-reserve-gib)",
        f"kv_cache_dtype {a['kv_cache_dtype']} -> {a['kv_cache_dtype_resolved']} "
        f"({a['kv_attention_bytes_per_token_layer']} B per token and layer at TP=1); block size {a['block_size']}",
        f"context {a['context']:,} ({a['context_source']}): requests = whole requests that fit at once, per engine, "
        "summed over engines",
        "; ".join(f"{name}: {row.assumption}" for name, row in rows),
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


@rtask(help={"model": "checkpoint directory on this machine (default: model_path on the head, read over SSH)",
             "gpu-memory-gib": "memory per GPU in GiB, e.g. for a host not bought yet (default: the head's nvidia-smi)",
             "gpus": "GPUs on the host (default: the head's GPUs matching cluster_gpu_name)",
             "context": "tokens per request for the concurrency column (default: max_position_embeddings)",
             "gpu-memory-utilization": "vLLM's --gpu-memory-utilization (default 0.9, vLLM's default)",
             "kv-cache-dtype": "vLLM's --kv-cache-dtype: auto (the model dtype), bfloat16, float16, fp8 ... (default auto)",
             "reserve-gib": "per GPU: peak activation + CUDA graphs + non-torch memory vLLM keeps out of the KV "
                            "cache (default 8)",
             "dp-reserve-gib": "the same reserve for each dp_ep rank, if it differs (default: --reserve-gib)",
             "block-size": "KV block size (default: 64 for MLA, 16 otherwise)",
             "mtp": "count the MTP layers' weights and KV (as with --speculative-config method=mtp)",
             "against-engine": "the running deployment instead: each engine's planned KV tokens beside the "
                               "`GPU|CPU KV cache size` it printed, and the difference in percent"},
       numbers={"gpu_memory_gib": float, "gpus": int, "context": int, "gpu_memory_utilization": float,
                "reserve_gib": float, "block_size": int, "dp_reserve_gib": float})
def plan(inventory=None, model=None, gpu_memory_gib=None, gpus=None, context=None, json=False,
         gpu_memory_utilization=None, kv_cache_dtype=None, reserve_gib=None, block_size=None, mtp=False,
         dp_reserve_gib=None, set_=None, against_engine=False):
    """KV cache per GPU and per node under TP=N against DP attention + EP, from the checkpoint's own headers."""
    from .. import layouts  # noqa: F401  (the planner's rows are the layouts' own: every layout registers)
    from ..verbs.capacity import Assumptions, gather, parse_checkpoint, plan_capacity, plan_json, plan_report
    a = Assumptions(mtp=mtp, context=context, block_size=block_size, dp_reserve_gib=dp_reserve_gib)
    if gpu_memory_utilization is not None:
        a.gpu_memory_utilization = gpu_memory_utilization
    if kv_cache_dtype is not None:
        a.kv_cache_dtype = kv_cache_dtype
    if reserve_gib is not None:
        a.reserve_gib = reserve_gib
    if against_engine:
        if gpus is not None or context is not None:
            raise UsageError("--against-engine: the engines' own parallel sizes and lengths are used; leave out "
                             "--gpus and --context")
        return _plan_against_engine(load(inventory, set_), model, gpu_memory_gib, a, json)
    doc, found = gather(lambda: load(inventory, set_), model, gpu_memory_gib, gpus)
    result = plan_capacity(parse_checkpoint(doc), found, a)
    report = plan_report(plan_json(result))
    if json:
        return report.print_json()
    print_plan(result, console())
    return report.exit_code


def _plan_against_engine(inv, model: str | None, gpu_memory_gib: float | None, a, json_out: bool) -> int:
    """The running deployment's engines: railyard's KV tokens beside what each printed."""
    from ..verbs import capacity as C
    from ..verbs.against import TOLERANCE_PCT, compare, engine_kv_report, engine_services
    from ..verbs.serve import build_plan
    from ..plan import layout as layouts
    from ..transport.runner import Runner
    if gpu_memory_gib is not None and gpu_memory_gib <= 0:
        raise UsageError(f"--gpu-memory-gib {gpu_memory_gib}: must be positive")
    with Runner(layouts.get(inv).hosts(inv)) as runner:
        plan = build_plan(inv, runner, strict=False)
        engines = engine_services(plan)
        host = inv.host(engines[0].host) if engines else inv.head
        doc = C.read_local(model) if model is not None else C.read_remote(runner.session(host), host.vars["model_path"])
        ckpt = C.parse_checkpoint(doc)
        rows = compare(plan, runner, ckpt, a, gpu_memory_gib, lambda h: inv.host(h).vars["cluster_gpu_name"])
    spec = C.model_spec(ckpt.config, f"{ckpt.dir}/config.json")
    assumptions = {"model_dir": ckpt.dir, "reserve_gib_per_gpu": a.reserve_gib,
                   "dp_reserve_gib_per_gpu": a.reserve_gib if a.dp_reserve_gib is None else a.dp_reserve_gib,
                   "gpu_memory_utilization_default": a.gpu_memory_utilization, "mtp": a.mtp,
                   "tolerance_pct": TOLERANCE_PCT, "layout": plan.layout, "deployment": plan.deployment,
                   "difference": "(planned - engine) / engine x 100"}
    report = engine_kv_report(rows, spec.architecture, assumptions, TOLERANCE_PCT)
    if json_out:
        return report.print_json()
    con = console()
    con.print(engine_kv_table(rows))
    for r in rows:
        for n in r.notes:
            con.print(f"  {r.service} DP{r.dp_rank}: {n}", style="yellow", markup=False)
    con.print(f"model: {ckpt.dir} ({spec.architecture}); difference = (planned - engine) / engine; GPU engines: "
              f"memory x --gpu-memory-utilization - weights - reserve {a.reserve_gib:g} GiB (--reserve-gib); CPU "
              "build: VLLM_CPU_KVCACHE_SPACE GiB per worker, block 128", markup=False, highlight=False)
    far = [c for c in report.checks if c.status != "pass"]
    con.print(Text(f"OK: every engine within {TOLERANCE_PCT:g} % of the plan" if not far else
                   f"{len(far)} engine(s) not within {TOLERANCE_PCT:g} % or not seen: see above",
                   style="bold green" if not far else "yellow"))
    return report.exit_code


def engine_kv_table(rows: list) -> Table:
    t = Table(title="plan against the engine: KV tokens per engine core (each rank of it)", title_justify="left")
    for c in ("layout", "service", "engine", "shape", "device", "KV B/token/rank", "budget", "planned", "engine printed",
              "difference"):
        t.add_column(c, overflow="fold", justify="right" if c in ("planned", "engine printed", "difference",
                                                                   "KV B/token/rank") else "left")
    for r in rows:
        diff = "-" if r.difference_pct is None else f"{r.difference_pct:+.2f} %"
        t.add_row(r.layout, f"{r.service} ({r.host})", f"DP{r.dp_rank}", r.shape, r.device or "-",
                  "-" if r.kv_bytes_per_token_per_rank is None else f"{r.kv_bytes_per_token_per_rank:,}", r.budget,
                  "-" if r.planned_tokens is None else f"{r.planned_tokens:,}",
                  Text("not seen", style="yellow") if r.engine_tokens is None else f"{r.engine_tokens:,}", diff)
    return t
