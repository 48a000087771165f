"""`inv verify-rdma` and `inv health`.

verify-rdma collects the NCCL logs from every rank's container and judges them with
railyard.nccl, adding what only the running container can show: memlock unlimited,
/dev/infiniband present, IPC_LOCK granted, and the NCCL library the image carries.

health asks each rank for its container and GPU, then the head's API (with the key, read
on the head): /health, /v1/models, one short real chat completion at temperature 0 that must
end with finish_reason "stop", and /metrics summarised. Every probe's latency is shown.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from .errors import UsageError
from .inventory import Host, Inventory
from .launch import NCCL_ENV, _uptime, gather_facts, gpu_usage, inspect
from .nccl import RankVerdict, judge
from .runner import Runner
from .transport import RemotePath, Session, cmd, q

NCCL_LIB_PY = ("import os, nvidia.nccl as n; p = os.path.join(list(n.__path__)[0], 'lib', 'libnccl.so.2'); "
               "print(p if os.path.exists(p) else 'missing ' + p)")
MIN_NCCL = (2, 30, 7)  # older NCCL can deadlock cross-node CUDA graph replays over RoCE (vLLM issue #52504)


def judge_files(paths: list[str]) -> list[RankVerdict]:
    out = []
    for p in paths:
        try:
            text = Path(p).read_text(errors="replace")
        except OSError as e:
            raise UsageError(f"--log {p}: {e.strerror}")
        out.append(judge(text, p))
    return out


def _log_glob(h: Host) -> str:
    path = h.vars["vllm_extra_env"].get("NCCL_DEBUG_FILE") or dict(NCCL_ENV)["NCCL_DEBUG_FILE"]
    return re.sub(r"%[hp]", "*", str(path))


def _version_tuple(v: str | None) -> tuple:
    try:
        return tuple(int(x) for x in (v or "").split("."))
    except ValueError:
        return ()


def verify_rank(s: Session, h: Host) -> list[RankVerdict]:
    name = h.vars["vllm_container"]
    c = inspect(s, name)
    src = f"{h.name}:{name}"
    if not c.exists or not c.running:
        return [RankVerdict(src, "fail", None, False, [], None, [],
                            [f"container {name} is {c.status if c.exists else 'missing'} on {h.name} "
                             "(fix: inv launch / inv start)"])]
    pattern = _log_glob(h)
    script = (f'for f in {pattern}; do [ -e "$f" ] || continue; printf "@@file %s\\n" "$f"; cat "$f"; done; '
              'printf "@@memlock %s\\n" "$(ulimit -l)"; '
              'if [ -d /dev/infiniband ]; then printf "@@ib %s\\n" "$(ls /dev/infiniband | tr "\\n" " ")"; fi')
    r = s.run(cmd("docker", "exec", name, "sh", "-c", script), timeout=60)
    caps = s.run(cmd("docker", "inspect", "--format", "{{json .HostConfig.CapAdd}}", name), timeout=30)
    lib = s.run(cmd("docker", "exec", name, "python3", "-c", NCCL_LIB_PY), timeout=60)  # as the entrypoint finds it
    nccl_lib = lib.stdout.strip() if lib.ok else None
    if r.error:
        return [RankVerdict(src, "fail", None, False, [], None, [], [f"{r.error.kind}: {r.error.message}"])]
    files: dict[str, list[str]] = {}
    memlock = ib = None
    current = None
    for line in r.stdout.splitlines():
        if line.startswith("@@file "):
            current = line[7:]
            files[current] = []
        elif line.startswith("@@memlock "):
            memlock, current = line[10:].strip(), None
        elif line.startswith("@@ib "):
            ib, current = line[5:].strip(), None
        elif current is not None:
            files[current].append(line)
    container = []
    if memlock != "unlimited":
        container.append(f"memlock inside the container is {memlock or '?'} KiB, not unlimited "
                         "(fix: docker run --ulimit memlock=-1)")
    if not ib:
        container.append("/dev/infiniband is missing inside the container (fix: docker run --device /dev/infiniband)")
    try:
        cap_add = json.loads(caps.stdout.strip() or "null") or []
    except ValueError:
        cap_add = []
    if "IPC_LOCK" not in cap_add and "CAP_IPC_LOCK" not in cap_add:
        container.append("IPC_LOCK not granted (fix: docker run --cap-add IPC_LOCK)")
    if not nccl_lib or nccl_lib.startswith("missing"):
        container.append(f"the image's own NCCL library was not found ({nccl_lib or 'no nvidia.nccl'}) "
                         "(fix: use the pinned image; the entrypoint sets VLLM_NCCL_SO_PATH from it)")
    if not files:
        return [RankVerdict(src, "fail", None, False, [], None, [],
                            [f"no NCCL log matching {pattern} in the container (fix: NCCL_DEBUG=INFO and "
                             "NCCL_DEBUG_FILE must be set, and the ranks must have connected)"] + container)]
    out = []
    for path, lines in sorted(files.items()):
        v = judge("\n".join(lines), f"{h.name}:{path}", [h.serve_rail.hca])
        if v.nccl_version and _version_tuple(v.nccl_version) < MIN_NCCL:
            v.reasons.append(f"NCCL {v.nccl_version} is older than {'.'.join(map(str, MIN_NCCL))}, which can deadlock "
                             "cross-node CUDA graph replays over RoCE (fix: load the image's own libnccl via "
                             "VLLM_NCCL_SO_PATH)")
        v.reasons.extend(container)
        v.verdict = "fail" if v.reasons else "pass"
        out.append(v)
    return out


def verify_rdma(inv: Inventory) -> list[RankVerdict]:
    with Runner(inv.hosts) as runner:
        got = runner.each(lambda s: verify_rank(s, s.host))
    out = []
    for h in inv.hosts:
        res = got[h.name]
        if isinstance(res, list):
            out.extend(res)
        else:
            out.append(RankVerdict(h.name, "fail", None, False, [], None, [], [str(res.error)]))
    return out


# ---------------------------------------------------------------- health

@dataclass
class Probe:
    name: str
    ok: bool
    detail: str
    ms: float | None = None


@dataclass
class RankHealth:
    host: str
    rank: int
    state: str
    uptime_s: float | None
    gpu_used_mib: int | None
    serving_process: str | None
    ok: bool
    reasons: list[str] = field(default_factory=list)


def _curl(s: Session, h: Host, path: str, body: dict | None = None, timeout: int = 60) -> tuple[int, float, str]:
    """One HTTP request from the head to its own API, the key read from its file on the head."""
    bind = h.vars["vllm_bind"]
    host = "127.0.0.1" if bind in ("0.0.0.0", "::") else bind
    url = f"http://{host}:{h.vars['vllm_port']}{path}"
    key = q(RemotePath(h.vars["vllm_api_key_file"]))
    auth = f'-H "Authorization: Bearer $(cat {key} 2>/dev/null)"'
    data = ""
    if body is not None:
        data = "-H 'Content-Type: application/json' --data-binary @-"
    line = (f"curl -sS --max-time {int(timeout)} {auth} {data} -w '\\n@@%{{http_code}} %{{time_total}}' "
            f"{q(url)}")
    r = s.run(line, timeout=timeout + 10, stdin=json.dumps(body).encode() if body is not None else None)
    if r.error:
        return 0, 0.0, f"{r.error.kind}: {r.error.message}"
    text, _, tail = r.stdout.rpartition("\n@@")
    try:
        code, secs = tail.split()
        if int(code) == 0:  # no HTTP answer at all: curl's own error says why
            return 0, float(secs) * 1000, (r.stderr.strip().splitlines() or ["no answer"])[-1]
        return int(code), float(secs) * 1000, text
    except ValueError:
        return 0, 0.0, (r.stderr or r.stdout).strip()[:200]


def parse_metrics(text: str) -> dict:
    """Sum Prometheus samples by metric name (labels dropped)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^([A-Za-z_:][\w:]*)(?:\{[^}]*\})?\s+([-+0-9.eEinfNa]+)", line)
        if m:
            try:
                out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
            except ValueError:
                pass
    return out


def summarize_metrics(m: dict) -> dict:
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


def health(inv: Inventory) -> tuple[list[RankHealth], list[Probe], dict]:
    name = inv.head.vars["vllm_container"]
    served = inv.head.vars["model_repo"]
    with Runner(inv.hosts) as runner:
        facts = gather_facts(runner, inv.hosts)

        def rank(s: Session) -> RankHealth:
            h = s.host
            c = inspect(s, name)
            usage = gpu_usage(s, facts[h.name].gpu_uuid)
            procs, used = usage.processes, usage.used_mib
            reasons = []
            if not c.exists or not c.running:
                reasons.append(f"container {name} is {c.status if c.exists else 'missing'}")
            if c.running and not procs:
                reasons.append("no serving process on the GPU")
            return RankHealth(h.name, h.rank, c.status if c.exists else "missing",
                              _uptime(c.started) if c.running else None, used,
                              procs[0].name if procs else None, not reasons, reasons)

        got = runner.each(rank)
        ranks = [got[h.name] if isinstance(got[h.name], RankHealth) else
                 RankHealth(h.name, h.rank, "unreachable", None, None, None, False, [str(got[h.name].error)])
                 for h in inv.hosts]
        probes: list[Probe] = []
        metrics: dict = {}
        head = inv.head
        s = runner.session(head)
        code, ms, text = _curl(s, head, "/health", timeout=10)
        probes.append(Probe("/health", code == 200, f"HTTP {code}" if code else f"no answer: {text[:120]}", ms))
        code, ms, text = _curl(s, head, "/v1/models", timeout=10)
        try:
            ids = [m["id"] for m in json.loads(text).get("data", [])] if code == 200 else []
        except (ValueError, AttributeError):
            ids = []
        probes.append(Probe("/v1/models", code == 200 and served in ids,
                            (f"HTTP {code}; serves {', '.join(ids) or 'nothing'}" if code else f"no answer: {text[:120]}")
                            + ("" if served in ids else f" (expected {served})"), ms))
        body = {"model": served, "temperature": 0, "max_tokens": 64,
                "messages": [{"role": "user", "content": "Reply with the single word: ready."}]}
        code, ms, text = _curl(s, head, "/v1/chat/completions", body, timeout=120)
        finish = None
        try:
            doc = json.loads(text)
            finish = doc["choices"][0]["finish_reason"]
            tokens = doc.get("usage", {}).get("completion_tokens")
        except (ValueError, KeyError, IndexError, TypeError):
            tokens = None
        probes.append(Probe("chat completion", code == 200 and finish == "stop",
                            f"HTTP {code}; finish_reason {finish}" + (f"; {tokens} tokens" if tokens else ""), ms))
        code, ms, text = _curl(s, head, "/metrics", timeout=10)
        if code == 200:
            metrics = summarize_metrics(parse_metrics(text))
        probes.append(Probe("/metrics", code == 200, f"HTTP {code}", ms))
    return ranks, probes, metrics
