"""Reports: a rich table for people, one JSON document for machines.

Every `--json` task (preflight, sync-model, status, verify-rdma, health, nccl-check, plan)
prints exactly one document on stdout, built here by `Report`:

    {"ok": bool,
     "checks": [{"host", "check", "status": "pass|warn|fail|skip", "detail", "evidence", "hint"}],
     "data": {...the task's own payload...}}

`checks` holds one row per thing the task judged (the table shows the same verdicts); `ok` is
false exactly when a check failed; warn and skip never fail. A check about no single host
(the all-reduce bandwidth, a capacity plan) has host "-". `data` keeps everything the task
measured: preflight `{}`; status `ranks`; health `ranks`, `probes`, `metrics`; verify-rdma
`ranks` (and `skipped`, `layout` for a one-host layout); nccl-check `ranks`, `sizes`,
`link_fraction`, `threshold`, `link_speed_mbps`, `errors`, `removed` (one host: `layout`, `host`,
`local_ranks`, `transport`, `sizes`, `min_busbw_gbs`, `errors`, `removed`); sync-model `source`,
`verify`, `hosts`, ...; plan `model`, `assumptions`, `layouts` (plan also keeps those three
at the top level: its own contract, docs/plan.md). `health --watch --json` prints one such
document per round, each on one line.

Exit codes: 0 ok; 1 a check failed (`ok: false`); 2 usage or inventory error, one line per
problem on stderr and nothing on stdout. An error that stops a `--json` task before it could
judge anything (a host unreachable, a container that did not start) exits 1 with one
document whose only check, named after the task, fails with the message.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections import Counter
from dataclasses import asdict, dataclass, field

from rich.console import Console
from rich.table import Table
from rich.text import Text

from .checks import FAIL, PASS, SKIP, WARN, CheckResult

STATUSES = (PASS, WARN, FAIL, SKIP)
STYLE = {"pass": "green", "warn": "yellow", "fail": "bold red", "skip": "dim"}
NO_HOST = "-"  # the host of a check about no single host


def console(stderr: bool = False) -> Console:
    stream = sys.stderr if stderr else sys.stdout
    # piped into a file or a pager: don't squeeze fingerprints and evidence into 80 columns
    width = None if stream.isatty() or os.environ.get("COLUMNS") else 160
    return Console(stderr=stderr, highlight=False, soft_wrap=False, width=width)


# ---------------------------------------------------------------- the document

def failed(checks: list[CheckResult]) -> bool:
    return any(c.status == FAIL for c in checks)


def exit_code(checks: list[CheckResult]) -> int:
    """0 when no check failed, 1 otherwise (2 is for usage errors, raised before any report)."""
    return 1 if failed(checks) else 0


def report_json(ok: bool, checks: list[CheckResult], data: dict, indent: int | None = 2, **top) -> str:
    """The one document of a --json task; `top` holds keys a task's own contract keeps beside them (plan)."""
    if ok != (not failed(checks)):
        raise ValueError(f"ok={ok} but {'a' if failed(checks) else 'no'} check failed")
    bad = [c for c in checks if c.status not in STATUSES]
    if bad:
        raise ValueError(f"check {bad[0].check} on {bad[0].host}: status {bad[0].status!r} is not one of {STATUSES}")
    return json.dumps({"ok": ok, "checks": [c.as_dict() for c in checks], "data": data, **top}, indent=indent)


@dataclass
class Report:
    checks: list[CheckResult]
    data: dict = field(default_factory=dict)
    top: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not failed(self.checks)

    @property
    def exit_code(self) -> int:
        return exit_code(self.checks)

    def json(self, indent: int | None = 2) -> str:
        return report_json(self.ok, self.checks, self.data, indent, **self.top)

    def print_json(self, indent: int | None = 2) -> int:
        sys.stdout.write(self.json(indent) + "\n")
        sys.stdout.flush()
        return self.exit_code


def error_report(task: str, message: str) -> Report:
    """A --json task stopped before it judged anything: one failed check named after the task."""
    return Report([CheckResult(NO_HOST, task, FAIL, message)], {"error": message})


# ---------------------------------------------------------------- per task: results -> checks + data

def preflight_report(results: list[CheckResult]) -> Report:
    return Report(list(results), {})


def _uptime(s) -> str:
    return "-" if s is None else f"{s:.0f} s"


def status_report(rows: list[dict]) -> Report:
    """One `container` check per service: pass only when it runs with the current configuration."""
    checks = []
    for r in rows:
        host, svc, name, state = r["host"], r["service"], r.get("container") or r["service"], r["state"]
        mem = r.get("gpu_memory")
        ev = ", ".join(x for x in (
            f"state {state}", f"up {_uptime(r.get('uptime_s'))}" if r.get("uptime_s") is not None else "",
            f"config {r['config'][:12]}" if r.get("config") else "",
            f"image {r['image_id'][:19]}" if r.get("image_id") else "",
            f"GPU {mem['used_mib']} / {mem['total_mib']} MiB" if mem else "") if x)
        if r.get("error"):
            checks.append(CheckResult(host, "container", FAIL, f"{svc}: {state}: {r['error']}", ev,
                                      f"check SSH to {host} (inv preflight), then inv status again"))
        elif not r.get("running"):
            checks.append(CheckResult(host, "container", FAIL, f"{svc}: container {name} is {state}", ev,
                                      "inv start (a stopped container) or inv launch"))
        elif not r.get("config_current"):
            checks.append(CheckResult(host, "container", FAIL,
                                      f"{svc}: container {name} runs another configuration than the inventory's", ev,
                                      "inv launch --recreate"))
        elif r.get("image_id") and not r.get("pinned_digest_ok"):
            checks.append(CheckResult(host, "container", WARN,
                                      f"{svc}: container {name} runs, but its image is NOT the pinned digest", ev,
                                      "docker pull the pinned vllm_image on the host, then inv launch --recreate"))
        else:
            checks.append(CheckResult(host, "container", PASS,
                                      f"{svc}: container {name} running with the current configuration", ev))
    return Report(checks, {"ranks": rows})


PROBE_CHECKS = {"/health": "api_health", "/v1/models": "api_models", "chat completion": "api_chat",
                "/metrics": "api_metrics", "KV cache per DP rank": "kv_per_dp_rank",
                "engines in /metrics": "metrics_engines"}


def _slug(name: str) -> str:
    return PROBE_CHECKS.get(name) or re.sub(r"\W+", "_", name).strip("_").lower()


def health_report(ranks: list, probes: list, metrics: dict, endpoint_host: str) -> Report:
    """One `service` check per service (running, on its GPUs), one per API probe of the endpoint."""
    checks = []
    for r in ranks:
        ev = f"state {r.state}, up {_uptime(r.uptime_s)}" + (
            f", GPU memory {r.gpu_used_mib} MiB" if r.gpu_used_mib is not None else "")
        if r.ok:
            checks.append(CheckResult(r.host, "service", PASS, f"{r.service}: {r.state}" + (
                f", {r.serving_process} on its GPU" if r.serving_process else ""), ev))
        elif any(x.startswith("hung:") for x in r.reasons):
            checks.append(CheckResult(r.host, "service", FAIL, f"{r.service}: " + "; ".join(r.reasons), ev,
                                      f"on {r.host}, ps -o pid,stat,cmd -p PID shows it; kill -CONT PID resumes "
                                      "what was stopped; otherwise inv stop and inv launch --recreate"))
        else:
            checks.append(CheckResult(r.host, "service", FAIL, f"{r.service}: " + "; ".join(r.reasons), ev,
                                      f"inv logs --rank {r.host} --lines 50 says why; then inv stop and "
                                      "inv launch --recreate"))
    for p in probes:
        ev = f"{p.name}" + (f" in {p.ms:.0f} ms" if p.ms else "")
        checks.append(CheckResult(endpoint_host, _slug(p.name), PASS if p.ok else FAIL, p.detail, ev,
                                  "" if p.ok else f"inv status, then inv logs --rank {endpoint_host} --lines 50"))
    return Report(checks, {"ranks": [asdict(r) for r in ranks], "probes": [asdict(p) for p in probes],
                           "metrics": metrics})


_FIX = re.compile(r"^(.*?) \(fix: (.*)\)$", re.S)


def _split_fixes(reasons: list[str]) -> tuple[str, str]:
    """A verdict's reasons `what (fix: how)` as one detail line and one hint line (each fix once)."""
    what, fixes = [], []
    for reason in reasons or ["no verdict"]:
        m = _FIX.match(reason)
        what.append(m.group(1) if m else reason)
        if m and m.group(2) not in fixes:
            fixes.append(m.group(2))
    return "; ".join(what), "; ".join(fixes)


def _host_of(source: str) -> str:
    return source.split(":", 1)[0] if source else NO_HOST


def verdict_checks(verdicts: list, host_of=_host_of) -> list[CheckResult]:
    """An `rdma` check per judged NCCL log: pass only on IB channels with GDRDMA on the rail's HCA."""
    out = []
    for v in verdicts:
        ev = (f"{v.source}: transport {v.net_transport or 'none seen'}, GDRDMA {'yes' if v.gdrdma else 'no'}, "
              f"HCAs {', '.join(v.hcas) or '-'}, NCCL {v.nccl_version or '?'}")
        if v.verdict == PASS:
            out.append(CheckResult(host_of(v.source), "rdma", PASS,
                                   f"inter-node channels over {v.net_transport} with GPUDirect RDMA on "
                                   f"{', '.join(v.hcas) or 'the rail'}", ev))
            if v.notes:  # what no channel runs over yet: a warning beside the pass
                detail, hint = _split_fixes(v.notes)
                out.append(CheckResult(host_of(v.source), "rdma", WARN, detail, ev, hint))
            continue
        detail, hint = _split_fixes(v.reasons)
        out.append(CheckResult(host_of(v.source), "rdma", FAIL, detail, ev, hint))
    return out


def verdict_table(verdicts: list, title: str) -> Table:
    """The NCCL transport of every judged log, for verify-rdma and nccl-check alike."""
    t = Table(title=title, title_justify="left")
    for c in ("source", "verdict", "transport", "GDRDMA", "HCAs", "NCCL", "reasons"):
        t.add_column(c, overflow="fold")
    for r in verdicts:
        t.add_row(r.source, Text(r.verdict.upper(), style="green" if r.verdict == PASS else "bold red"),
                  r.net_transport or "none seen", "yes" if r.gdrdma else "no", ", ".join(r.hcas) or "-",
                  r.nccl_version or "?", Text("\n".join(r.reasons), style="red") if r.reasons else
                  Text("\n".join(getattr(r, "notes", [])), style="yellow"))
    return t


def rdma_report(verdicts: list, skipped: str | None = None, skip_host: str = NO_HOST, layout: str | None = None,
                host_of=_host_of) -> Report:
    """verify-rdma: a check per rank verdict; a one-host layout is one `skip` (nothing crossed a rail)."""
    if skipped is not None:
        return Report([CheckResult(skip_host, "rdma", SKIP, skipped)],
                      {"ranks": [], "skipped": skipped, "layout": layout})
    checks = verdict_checks(verdicts, host_of)
    if not checks:  # nothing judged is never a pass
        checks = [CheckResult(NO_HOST, "rdma", FAIL, "no NCCL log was judged")]
    return Report(checks, {"ranks": [v.as_dict() for v in verdicts]})


def p2p_checks(verdict, host: str) -> list[CheckResult]:
    """A `p2p` check for one host's ranks: pass only on channels via P2P (or NVLS in use), never SHM or NET."""
    v = verdict
    chans = ", ".join(f"{k} {n}" for k, n in v.channels.items()) or "none"
    ev = (f"{v.source}: localRanks {v.local_ranks if v.local_ranks is not None else '?'}, nNodes "
          f"{v.nodes if v.nodes is not None else '?'}, channels {chans}, NVLS {'yes' if v.nvls else 'no'}, "
          f"NCCL {v.nccl_version or '?'}")
    if v.verdict == PASS:
        how = ", ".join(v.paths) or "NVLink SHARP"
        return [CheckResult(host, "p2p", PASS, f"GPU to GPU: {sum(v.channels.values())} channel(s) via {how}"
                            + ("; NVLink SHARP (NVLS) in use" if v.nvls and v.paths else ""), ev)]
    detail, hint = _split_fixes(v.reasons)
    return [CheckResult(host, "p2p", FAIL, detail, ev, hint)]


def nccl_one_host_report(rep) -> Report:
    """nccl-check on one host: `probe` (every local rank finished), `p2p` (the intra-node transport) and
    `bandwidth` (the largest size's bus bandwidth against nccl_check_min_busbw_gbs_intranode), all on
    the engine's host."""
    h = rep.host
    checks = []
    if rep.errors:
        checks.append(CheckResult(h, "probe", FAIL, "; ".join(e[len(h) + 2:] if e.startswith(f"{h}: ") else e
                                                              for e in rep.errors), "",
                                  "the p2p row's log says more; inv status (a running engine holds the GPUs), "
                                  "then inv nccl-check again"))
    elif not rep.sizes:
        checks.append(CheckResult(h, "probe", FAIL, "no all-reduce result from the probe", "", "inv nccl-check again"))
    else:
        checks.append(CheckResult(h, "probe", PASS, f"the all-reduce finished on {rep.local_ranks} local ranks: "
                                                    f"{len(rep.sizes)} size(s)"))
    if rep.transport is not None:
        checks += p2p_checks(rep.transport, h)
    else:
        checks.append(CheckResult(h, "p2p", FAIL, "no NCCL log was judged"))
    thr = rep.min_busbw_gbs
    if not rep.sizes:
        checks.append(CheckResult(h, "bandwidth", FAIL, "no all-reduce result to measure", "", "see the probe row"))
    else:
        big = rep.sizes[-1]
        ev = f"{big.bytes} bytes in {big.time_ms:.3f} ms: algbw {big.algbw_gbs:.2f} GB/s, busbw {big.busbw_gbs:.2f} GB/s"
        good = big.busbw_gbs >= thr
        checks.append(CheckResult(h, "bandwidth", PASS if good else FAIL,
                                  f"largest size's bus bandwidth {big.busbw_gbs:.1f} GB/s across {rep.local_ranks} "
                                  f"GPUs (threshold {thr:g} GB/s)", ev,
                                  "" if good else "judge at 1G (a small size is latency-bound); a transport other "
                                  "than P2P (p2p row) is slower; nvidia-smi nvlink -s (links down or slow), "
                                  "nvidia-smi topo -m (NV# between every pair), nvidia-fabricmanager on NVSwitch "
                                  "systems; on A100/H800 or PCIe servers lower nccl_check_min_busbw_gbs_intranode"))
    data = {k: v for k, v in rep.as_dict().items() if k != "ok"}
    data["removed"] = list(rep.removed)
    return Report(checks, data)


def nccl_report(rep) -> Report:
    """nccl-check: a `probe` check per rank (the all-reduce finished), its `rdma` verdict, and one
    `bandwidth` check: the largest size's bus bandwidth against the threshold share of the link.
    On one host (a OneHostReport): nccl_one_host_report."""
    if hasattr(rep, "local_ranks"):
        return nccl_one_host_report(rep)
    hosts = list(dict.fromkeys(_host_of(v.source) for v in rep.ranks))
    left = list(rep.errors)
    checks = []
    for h in hosts:
        mine = [e for e in left if e.startswith(f"{h}: ")]
        left = [e for e in left if e not in mine]
        if mine:
            checks.append(CheckResult(h, "probe", FAIL, "; ".join(e[len(h) + 2:] for e in mine), "",
                                      "inv preflight (rail_link, mtu, jumbo_ping), then inv nccl-check again"))
        elif not rep.sizes:
            checks.append(CheckResult(h, "probe", FAIL, "no all-reduce result from the probe", "",
                                      "inv nccl-check again; the rank's log is in the rdma row"))
        else:
            checks.append(CheckResult(h, "probe", PASS, f"the all-reduce finished: {len(rep.sizes)} size(s)"))
    if left:
        checks.append(CheckResult(NO_HOST, "probe", FAIL, "; ".join(left), "", "inv nccl-check again"))
    checks += verdict_checks(rep.ranks)
    link, thr, frac = rep.link_speed_mbps, rep.threshold, rep.link_fraction
    if frac is None or not rep.sizes:
        checks.append(CheckResult(NO_HOST, "bandwidth", FAIL, "no all-reduce result to measure", "",
                                  "see the probe rows"))
    else:
        big = rep.sizes[-1]
        ev = f"{big.bytes} bytes in {big.time_ms:.2f} ms: algbw {big.algbw_gbs:.2f} GB/s, busbw {big.busbw_gbs:.2f} GB/s"
        detail = f"largest size reached {frac * 100:.0f} % of {link} Mb/s (threshold {thr * 100:.0f} %)"
        checks.append(CheckResult(NO_HOST, "bandwidth", PASS if frac >= thr else FAIL, detail, ev,
                                  "" if frac >= thr else "inv preflight (link_speed, mtu), cables and transceivers; "
                                  "a rank without GDRDMA (rdma rows) is slower too"))
    data = {k: v for k, v in rep.as_dict().items() if k != "ok"}
    data["removed"] = list(rep.removed)
    return Report(checks, data)


def sync_report(rep) -> Report:
    """sync-model: a `model` check per host (the checkpoint's own files) and a `sync` check per target
    (copied and equal to the source); a dry run skips them, a stop before copying is one fail."""
    from .verbs.sync import report_json as sync_json
    data = {k: v for k, v in sync_json(rep).items() if k != "ok"}
    src_name = rep.source
    if rep.failure:
        return Report([CheckResult(src_name, "sync", FAIL, rep.failure, "", rep.hint)], data)
    if rep.dry_run:
        checks = []
        for t in rep.targets:
            c = rep.copies.get(t)
            p = c.plan if c else None
            what = (f"would send {len(p.send)} file(s), resume {len(p.resume)}, {p.equal} already equal, "
                    f"{p.bytes} bytes" if p else f"{src_name} has no checkpoint yet: would download it first")
            checks.append(CheckResult(t, "sync", SKIP, f"dry run: {what}; nothing copied or verified"))
        return Report(checks, data)
    checks = []
    src = rep.manifests.get(src_name)
    for name in [src_name] + rep.targets:
        m = rep.manifests.get(name)
        problems = rep.model.get(name, [])
        if problems:
            checks.append(CheckResult(name, "model", FAIL, "; ".join(problems), "",
                                      "fix the checkpoint on the source (or download it again), then inv sync-model"
                                      + (" --repair" if name != src_name else "")))
        elif m is not None:
            arch = ", ".join((m.config or {}).get("architectures") or []) if isinstance(m.config, dict) else ""
            checks.append(CheckResult(name, "model", PASS, "config.json and the shard index are valid",
                                      f"{len(m.files)} files, {m.total_bytes} bytes" + (f"; {arch}" if arch else "")))
    how = "sha256 of every file" if rep.verify == "content" else "names and sizes only (content not compared)"
    for t in rep.targets:
        c, m, diffs = rep.copies.get(t), rep.manifests.get(t), rep.differences.get(t, [])
        sent = "" if c is None else ("nothing sent" if not c.bytes_sent else f"{c.bytes_sent} bytes sent in {c.seconds:.1f} s")
        if c is not None and c.errors:
            checks.append(CheckResult(t, "sync", FAIL, "copy failed: " + "; ".join(c.errors), sent,
                                      rep.hint or "run sync-model again: finished files are not sent again"))
        elif m is None or src is None or m.error or src.error:
            why = (m.error if m else None) or (src.error if src else None) or "no manifest"
            checks.append(CheckResult(t, "sync", FAIL, f"not compared with {src_name}: {why}", sent,
                                      "fix SSH or python3 on the host, then inv sync-model again"))
        elif diffs:
            shown = "; ".join(str(d) for d in diffs[:5]) + (f"; ... {len(diffs) - 5} more" if len(diffs) > 5 else "")
            checks.append(CheckResult(t, "sync", FAIL, f"{len(diffs)} difference(s) from {src_name}: {shown}", sent,
                                      "inv sync-model --repair re-sends exactly those files"))
        else:
            fixed = rep.repaired.get(t)
            checks.append(CheckResult(t, "sync", PASS, f"{len(m.files)} files equal to {src_name} by {how}",
                                      sent + (f"; repaired {len(fixed)}" if fixed else "")))
    return Report(checks, data)


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


def launch_report(rep, dry_run: bool = False) -> Report:
    """launch: one `launch` check per service (pass: ready, or already running with this configuration; a
    dry run: skip) or, when it failed, one fail naming the service; data: what ran, the gates' outcome and
    the bring-up timeline of each vLLM container beside the previous launch's."""
    plan = rep.plan
    services = plan.by_rank() if plan else []
    data = {"deployment": plan.deployment if plan else None, "layout": plan.layout if plan else None,
            "dry_run": dry_run, "order": rep.order, "commands": rep.commands, "notes": list(plan.notes) if plan else []}
    if dry_run:
        checks = [CheckResult(s.host, "launch", SKIP, f"{s.name}: dry run: nothing started") for s in services]
        return Report(checks, {**data, "hint": rep.hint or None})
    if rep.failure:
        checks = [CheckResult(rep.failed_rank or NO_HOST, "launch", FAIL, rep.failure, "", rep.hint)]
    else:
        checks = []
        for s in services:
            if rep.noop:
                what = "already running with this configuration"
            elif s.name in rep.started:
                what = "started and ready"
            else:
                what = "kept (already running with this configuration) and ready"
            gates = ", ".join(g.describe() for g in (s.started,) + tuple(s.ready))
            checks.append(CheckResult(s.host, "launch", PASS, f"{s.name}: {what}", gates))
    data.update({"started": rep.started, "kept": rep.kept, "noop": rep.noop, "ready_seconds":
                 None if rep.ready_seconds is None else round(rep.ready_seconds, 2), "api": rep.api or None,
                 "proof": rep.proof or None, "failure": rep.failure, "hint": rep.hint or None, "logs": rep.logs,
                 "rolled_back": rep.rolled_back, "timeline": [t.as_dict() for t in rep.timeline],
                 "timeline_file": rep.timeline_file or None, "timeline_previous": rep.timeline_previous,
                 "timeline_note": rep.timeline_note or None})
    return Report(checks, data)


def _secs(v) -> str:
    return "not seen" if v is None else f"{v:.1f} s"


def timeline_table(timelines: list, title: str = "bring-up: seconds from the container's start "
                                                 "(the previous launch's in brackets)") -> Table:
    """One row per vLLM container: each milestone's time, `not seen`, or `n/a` where that rank has none."""
    from .engines.vllm import MILESTONE_LABELS, MILESTONES
    t = Table(title=title, title_justify="left")
    for c in ("rank", "host", "service"):
        t.add_column(c, no_wrap=True)
    for m in MILESTONES:
        t.add_column(MILESTONE_LABELS[m], justify="right", no_wrap=True)
    t.add_column("notes", overflow="fold")
    for tl in timelines:
        cells = []
        for m in MILESTONES:
            if m in tl.not_applicable:
                cells.append(Text("n/a", style="dim"))
                continue
            v = tl.seconds.get(m)
            cell = Text(_secs(v), style="yellow" if v is None else "")
            if tl.previous is not None:
                cell.append(f" ({_secs(tl.previous.get(m)) if m in tl.previous else '-'})", style="dim")
            cells.append(cell)
        t.add_row("-" if tl.rank is None else str(tl.rank), tl.host, tl.service, *cells,
                  Text(tl.error, style="yellow") if tl.error else "")
    return t


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


# ---------------------------------------------------------------- tables

def checks_table(results: list[CheckResult], title: str) -> Table:
    t = Table(title=title, title_justify="left", show_lines=False, expand=False)
    t.add_column("host", style="bold", no_wrap=True)
    t.add_column("check", no_wrap=True)
    t.add_column("status", no_wrap=True)
    t.add_column("evidence", overflow="fold")
    needs_fix = any(r.status in ("fail", "warn") for r in results)
    if needs_fix:
        t.add_column("fix", overflow="fold")
    last = None
    for r in results:
        if last is not None and r.host != last:
            t.add_section()
        last = r.host
        ev = Text(r.detail)
        if r.evidence:
            ev.append("\n" + r.evidence, style="dim")
        row: list[str | Text] = [r.host, r.check, Text(r.status.upper(), style=STYLE.get(r.status, "")), ev]
        if needs_fix:
            row.append(Text(r.hint, style="cyan") if r.status in ("fail", "warn") else "")
        t.add_row(*row)
    return t


def summary(results: list[CheckResult]) -> str:
    c = Counter(r.status for r in results)
    hosts = len({r.host for r in results})
    parts = [f"{c[s]} {s}" for s in ("pass", "warn", "fail", "skip") if c[s]]
    verdict = "FAILED" if c["fail"] else "OK"
    return f"{verdict}: {', '.join(parts)} across {hosts} host(s)"


def print_checks(results: list[CheckResult], as_json: bool, title: str) -> int:
    """preflight's output: the document, or the table and a summary line; returns the exit code."""
    rep = preflight_report(results)
    if as_json:
        return rep.print_json()
    con = console()
    con.print(checks_table(results, title))
    con.print(Text(summary(results), style="bold green" if rep.ok else "bold red"))
    return rep.exit_code


def recover_report(plan, rec, dry_run: bool) -> Report:
    """`inv recover`: one `recover` check on the layout's host (pass: recovered, nothing to do, or a dry
    run that can proceed); data: the path, why, the steps and what was done."""
    host = plan.endpoint.host
    if rec.failure or rec.path == "blocked":
        status, detail = FAIL, rec.failure or "; ".join(rec.why)
    else:
        status = PASS
        detail = {"none": "nothing to recover", "short": "short path", "long": "long path"}[rec.path] + (
            " (dry run)" if dry_run and rec.path != "none" else "") + (f": {', '.join(rec.replicas)}" if rec.replicas else "")
    check = CheckResult(host, "recover", status, detail, "; ".join(rec.why),
                        "" if status == PASS else "inv status; inv logs --rank SERVICE --lines 50")
    return Report([check], {"path": rec.path, "replicas": rec.replicas, "why": rec.why, "steps": rec.steps,
                            "done": rec.done, "failure": rec.failure or None, "dry_run": dry_run})


def nixl_report(verdicts: list) -> Report:
    """verify-rdma on the pd layout: a `nixl` check per instance (KV blocks over RDMA on the rails)."""
    checks = []
    for v in verdicts:
        ev = f"{v.source}: transport {v.transport or 'none seen'}, devices {', '.join(v.devices) or '-'}"
        if v.verdict == PASS:
            checks.append(CheckResult(_host_of(v.source), "nixl", PASS,
                                      f"UCX over {', '.join(v.devices)} (RDMA on the rail)", ev))
        else:
            detail, hint = _split_fixes(v.reasons)
            checks.append(CheckResult(_host_of(v.source), "nixl", FAIL, detail, ev, hint))
    if not checks:
        checks = [CheckResult(NO_HOST, "nixl", FAIL, "no instance was judged")]
    return Report(checks, {"instances": [v.as_dict() for v in verdicts]})
