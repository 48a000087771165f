"""`inv plan --against-engine`: railyard's KV tokens for each engine of the running deployment, beside the
figure the engine printed (`GPU KV cache size: N tokens`, the CPU build's `CPU KV cache size: N tokens`,
one line per engine core, `EngineCore_DP<n>` for DP ranks), and the difference in percent.

What each engine was started with comes from the inventory's launch plan (its `vllm serve` flags) and
from the container itself (`docker inspect`: its environment, e.g. VLLM_CPU_KVCACHE_SPACE, and whether it
runs the plan's configuration); the figure it printed from its log. An engine whose line is not in its
log is shown as not seen.

Pure: `settings_of`, `rows_for`; `compare` asks the hosts.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field

from . import capacity as C
from ..checks import PASS, WARN, CheckResult
from ..errors import LaunchError, RailyardError, UsageError
from ..apply.timeline import applicable
from ..render.docker import config_hash
from ..plan.spec import LaunchPlan, Service
from .. import engines
from ..engines import KvLine
from ..transport import Session, cmd
from ..report import NO_HOST, Report

TOLERANCE_PCT = 10.0   # a plan further than this from the engine's figure is a warn (a plan never fails)

_SIZE_RE = re.compile(r"^(\d+(?:\.\d+)?)\s*([KMGT]i?B?|[kmgt])?$")
_UNITS = {"k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30, "ti": 1 << 40}


def _size(text: str) -> int | None:
    """`--kv-cache-memory-bytes`: a number of bytes, or with a unit (1G, 8GiB)."""
    m = _SIZE_RE.match(text.strip())
    if not m:
        return None
    unit = (m.group(2) or "").lower().rstrip("b")
    return int(float(m.group(1)) * _UNITS.get(unit, 1))


def _flags(words: list[str]) -> dict[str, str]:
    """`--flag value`, `--flag=value` and bare switches of a command line -> {flag: value ("" for a switch)}."""
    out: dict[str, str] = {}
    i = 0
    while i < len(words):
        w = words[i]
        if w.startswith("-"):
            if "=" in w:
                k, _, v = w.partition("=")
                out[k] = v
            elif i + 1 < len(words) and not words[i + 1].startswith("-"):
                out[w] = words[i + 1]
                i += 1
            else:
                out[w] = ""
        i += 1
    return out


def settings_of(command: list[str], env: dict[str, str], device: str, gpu_memory_gib: float | None) -> C.EngineSettings:
    """Pure: an engine's KV-relevant settings from its `vllm serve` words and its environment."""
    f = _flags(command)

    def num(*names, kind=int):
        for n in names:
            if n in f and f[n] != "":
                try:
                    return kind(f[n])
                except ValueError:
                    return None
        return None

    space = env.get("VLLM_CPU_KVCACHE_SPACE", "")
    return C.EngineSettings(
        device=device, tp=num("--tensor-parallel-size", "-tp") or 1, dp=num("--data-parallel-size", "-dp") or 1,
        expert_parallel="--enable-expert-parallel" in f or "-ep" in f, pp=num("--pipeline-parallel-size", "-pp") or 1,
        gpu_memory_utilization=num("--gpu-memory-utilization", kind=float),
        kv_cache_dtype=f.get("--kv-cache-dtype") or "auto", block_size=num("--block-size"),
        kv_cache_memory_bytes=_size(f["--kv-cache-memory-bytes"]) if f.get("--kv-cache-memory-bytes") else None,
        cpu_kvcache_space_gib=int(space) if space.strip().isdigit() else None, gpu_memory_gib=gpu_memory_gib)


@dataclass
class EngineRow:
    """One engine core: the plan beside what it printed."""

    layout: str
    service: str
    host: str
    container: str
    dp_rank: int
    shape: str                       # TP=2, DP=2 + EP, ...
    device: str | None               # from its KV line; None: not seen
    planned_tokens: int | None
    engine_tokens: int | None
    difference_pct: float | None
    kv_bytes_per_token_per_rank: int | None
    block_size: int | None
    budget: str                      # where the planned budget comes from
    engine_line: str = ""
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


def _shape(e: C.EngineSettings) -> str:
    parts = [f"TP={e.tp}"] + ([f"PP={e.pp}"] if e.pp > 1 else []) + ([f"DP={e.dp}"] if e.dp > 1 else [])
    return " ".join(parts) + (" + EP" if e.expert_parallel else "")


def rows_for(layout: str, svc: Service, ckpt: C.Checkpoint, lines: dict[int, KvLine], env: dict[str, str],
             expected: list[int], a: C.Assumptions, gpu_memory_gib: float | None, notes: list[str]) -> list[EngineRow]:
    """Pure: one row per engine core the service runs (its expected DP ranks and any other that printed)."""
    words = [str(w) for w in svc.spec.command]
    engine = engines.of(svc)
    assert engine is not None   # engine_services: each runs one
    out = []
    for dp in sorted(set(expected) | set(lines)):
        seen = lines.get(dp)
        if seen is None:
            out.append(EngineRow(layout, svc.name, svc.host, svc.spec.name, dp, _shape(settings_of(words, env, "?", None)),
                                 None, None, None, None, None, None, "-", "",
                                 notes + [f"no `{engine.kv_line}` line from this engine core in the log"]))
            continue
        e = settings_of(words, env, seen.device, gpu_memory_gib)
        p = C.plan_engine(ckpt, e, a)
        out.append(EngineRow(layout, svc.name, svc.host, svc.spec.name, dp, _shape(e), seen.device, p.tokens, seen.tokens,
                             C.difference_pct(p.tokens, seen.tokens), p.kv_bytes_per_token, p.block_size, p.source,
                             seen.line[:300], notes + p.notes))
    return out


def _env_of(s: Session, name: str) -> tuple[dict[str, str], str] | None:
    """The container's environment and its config label, from `docker inspect` (None: no such container)."""
    r = s.run(cmd("docker", "inspect", "--format", "{{json .}}", name), timeout=30)
    if r.error:
        raise LaunchError(f"{s.host.name}: {r.error.kind}: {r.error.message}")
    if r.rc != 0:
        if "No such" in r.stderr:
            return None
        raise LaunchError(f"{s.host.name}: docker inspect failed: {r.stderr.strip()}")
    try:
        doc = json.loads(r.stdout.strip().splitlines()[0])
        cfg = doc.get("Config") or {}
        env = dict(e.split("=", 1) for e in cfg.get("Env") or [] if "=" in e)
        return env, (cfg.get("Labels") or {}).get("railyard.config", "")
    except (ValueError, IndexError, AttributeError):
        raise LaunchError(f"{s.host.name}: unexpected `docker inspect` output: {r.stdout.strip()[:200]}") from None


def engine_services(plan: LaunchPlan) -> list[Service]:
    """The services that run an engine core: ranks that initialise an engine (not a headless TP rank)."""
    return [s for s in plan.by_rank() if "engine_initialised" in (applicable(s) or ())]


def compare(plan: LaunchPlan, runner, ckpt: C.Checkpoint, a: C.Assumptions, gpu_memory_gib: float | None,
            gpu_selector) -> list[EngineRow]:
    """Every engine of the running deployment: its planned KV tokens beside the ones it printed."""
    rows: list[EngineRow] = []
    gpu_mem: dict[str, float | None] = {}
    services = engine_services(plan)
    if not services:
        raise UsageError(f"--against-engine: layout {plan.layout} runs no vLLM engine")
    for svc in services:
        s = runner.session(svc.host)
        expected = list(range(int(svc.expects("kv_engines", "1") or 1)))
        start = int(svc.expects("dp_start", "0") or 0)
        found = _env_of(s, svc.spec.name)
        if found is None:
            rows += rows_for(plan.layout, svc, ckpt, {}, {}, [start + i for i in expected], a, None,
                             [f"no container {svc.spec.name} on {svc.host}: `inv launch` first"])
            continue
        env, label = found
        notes = [] if label == config_hash(plan, svc) else [
            "the container runs another configuration than the inventory's (inv launch --recreate): its flags may differ"]
        engine = engines.of(svc)
        assert engine is not None   # engine_services: each runs one
        r = s.run(cmd("docker", "logs", svc.spec.name) + " 2>&1 | " + cmd("grep", "-F", engine.kv_line), timeout=60)
        if r.error:
            raise LaunchError(f"{svc.host}: {r.error.kind}: {r.error.message}")
        kv = engine.kv_lines(r.stdout)
        mem = gpu_memory_gib
        if mem is None and any(e.device == "GPU" for e in kv.values()):
            if svc.host not in gpu_mem:
                try:
                    gpu_mem[svc.host] = C.read_gpus(s, gpu_selector(svc.host)).memory_gib
                except RailyardError as e:
                    gpu_mem[svc.host] = None
                    notes.append(f"GPU memory not read: {e}")
            mem = gpu_mem[svc.host]
        rows += rows_for(plan.layout, svc, ckpt, kv, env, [start + i for i in expected], a, mem, notes)
    return rows


def engine_kv_report(rows: list, model: str, assumptions: dict, tolerance_pct: float) -> Report:
    """plan --against-engine: a `kv_vs_engine` check per engine core (a plan never fails: pass within the
    tolerance, warn beyond it, when the engine printed no figure or the plan has none); `model`,
    `assumptions` and `engines` in data and at the top level, as plan keeps its own."""
    checks = []
    for r in rows:
        what = f"{r.service} DP{r.dp_rank} ({r.shape}, {r.device or 'device not seen'})"
        ev = (f"{r.kv_bytes_per_token_per_rank} B per token per rank, block {r.block_size}, budget {r.budget}"
              if r.kv_bytes_per_token_per_rank else "") + (f"; engine: {r.engine_line}" if r.engine_line else "")
        if r.engine_tokens is None:
            checks.append(CheckResult(r.host, "kv_vs_engine", WARN, f"{what}: no KV cache size line seen", ev,
                                      f"inv logs --rank {r.host}: is the engine up? (inv launch, inv health)"))
        elif r.planned_tokens is None:
            checks.append(CheckResult(r.host, "kv_vs_engine", WARN,
                                      f"{what}: the engine printed {r.engine_tokens:,} tokens; not planned: "
                                      + "; ".join(r.notes), ev, "pass --gpu-memory-gib, or set VLLM_CPU_KVCACHE_SPACE"))
        else:
            d = r.difference_pct
            detail = f"{what}: planned {r.planned_tokens:,}, the engine printed {r.engine_tokens:,} ({d:+.2f} %)"
            ok = abs(d) <= tolerance_pct
            checks.append(CheckResult(r.host, "kv_vs_engine", PASS if ok else WARN, detail, ev, "" if ok else
                                      "compare the engine's `Available KV cache memory` line with the plan's budget; "
                                      "move --reserve-gib (--dp-reserve-gib for DP ranks) to what it shows"))
    if not checks:
        checks = [CheckResult(NO_HOST, "kv_vs_engine", WARN, "no engine to compare with")]
    keep = {"model": model, "assumptions": assumptions, "engines": [r.as_dict() for r in rows]}
    return Report(checks, dict(keep), keep)
