"""`inv nccl-check`: an all-reduce across the ranks, before the model loads.

Two stations (multinode_tp): on every rank a short-lived container from the pinned image, with
the GPU, devices, ulimits and NCCL environment of that rank's service in the launch plan, runs
scripts/nccl_probe.py over the rail. NCCL logs to stdout there, so `docker logs` carries both the
probe's JSON lines and the log the verify-rdma judge reads.

One host (single_node_tp, dp_ep): one container with the engine's GPUs (by UUID), its environment,
`--ipc host`, shm size and CPU set runs `nccl_probe.py --local-ranks N`, rank i on GPU i; NCCL's
log is judged by `nccl.judge_intranode` (peer-to-peer or NVLS, never SHM or NET) and the largest
size's bus bandwidth against nccl_check_min_busbw_gbs_intranode.

The containers are always removed, also when the probe fails or the user interrupts.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping

from dataclasses import replace

from ..checks import FAIL, PASS, CheckResult, split_fixes
from ..errors import LaunchError, UsageError
from ..inventory import Inventory
from .serve import plan_and_facts
from .verify import verdict_checks
from ..checks.nccl import IntraVerdict, RankVerdict, judge, judge_intranode
from ..facts.docker import inspect
from ..render.docker import run_line
from ..transport.runner import Runner
from ..facts.host import on_host
from ..plan.spec import GROUP_SIZE, HEAD_ADDR, NODE_RANK, LaunchPlan, Mount, Service
from ..transport import cmd, write_remote
from ..report import NO_HOST, Report, host_of

PROBE = Path(__file__).resolve().parent.parent / "scripts" / "nccl_probe.py"
PROBE_CONTAINER = "railyard-nccl-check"
PROBE_REMOTE = "~/.cache/railyard/nccl_probe.py"


@dataclass
class SizeResult:
    bytes: int
    time_ms: float
    algbw_gbs: float
    busbw_gbs: float


@dataclass
class CheckReport:
    ok: bool
    ranks: list[RankVerdict]
    sizes: list[SizeResult]
    link_fraction: float | None
    threshold: float
    link_speed_mbps: int
    errors: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"ok": self.ok, "ranks": [r.as_dict() for r in self.ranks], "sizes": [asdict(s) for s in self.sizes],
                "link_fraction": self.link_fraction, "threshold": self.threshold,
                "link_speed_mbps": self.link_speed_mbps, "errors": self.errors}


@dataclass
class OneHostReport:
    """nccl-check on a one-host layout: the N local ranks of one container."""

    ok: bool
    layout: str
    host: str
    local_ranks: int
    transport: IntraVerdict | None
    sizes: list[SizeResult]
    min_busbw_gbs: float
    errors: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"ok": self.ok, "layout": self.layout, "host": self.host, "local_ranks": self.local_ranks,
                "transport": self.transport.as_dict() if self.transport else None,
                "sizes": [asdict(s) for s in self.sizes], "min_busbw_gbs": self.min_busbw_gbs, "errors": self.errors}


def parse_probe(text: str, with_rank: bool = False) -> tuple[list[dict], list[str]]:
    """The probe's JSON lines (results, errors) out of a container log that also holds NCCL's lines;
    with_rank: each error as `rank N: <its first line>` (several ranks share one log on one host; torch's
    CUDA errors run on for lines of advice)."""
    results, errors = [], []
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith('{"railyard_probe"'):
            continue
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if "error" in doc:
            e = str(doc["error"]).strip()
            errors.append(f"rank {doc['rank']}: {e.splitlines()[0] if e else e}" if with_rank and "rank" in doc
                          else e)
        else:
            results.append(doc)
    return results, errors


def summarize(per_rank: Mapping[Any, list[dict]]) -> list[SizeResult]:
    """Per size, the slowest rank's time (an all-reduce is as fast as its slowest member); per_rank's keys
    (ranks, or host:rank names) are not read."""
    sizes: dict[int, list[dict]] = {}
    for rows in per_rank.values():
        for r in rows:
            sizes.setdefault(int(r["bytes"]), []).append(r)
    out = []
    for b in sorted(sizes):
        worst = max(sizes[b], key=lambda r: r["time_s"])
        out.append(SizeResult(b, worst["time_s"] * 1000, worst["algbw_gbs"], worst["busbw_gbs"]))
    return out


def probe_service(svc: Service, probe_path: str, sizes: str, timeout: int, port: int) -> Service:
    """A rank's probe: its serving container's GPU, devices, ulimits and NCCL environment (not its
    debug file: NCCL logs to stdout here), running nccl_probe.py instead of vLLM."""
    spec = svc.spec
    env = [(k, v) for k, v in spec.env if k != "NCCL_DEBUG_FILE"]
    env += [("RANK", NODE_RANK), ("WORLD_SIZE", GROUP_SIZE), ("MASTER_ADDR", HEAD_ADDR), ("MASTER_PORT", str(port)),
            ("LOCAL_RANK", "0")]
    command = ("python3", "/railyard/nccl_probe.py", "--sizes", sizes, "--timeout", str(timeout))
    return replace(svc, spec=replace(spec, name=PROBE_CONTAINER, command=command, env=tuple(env), setup=(),
                                     secrets=(), labels=(("railyard.nccl-check", "1"),),
                                     mounts=spec.mounts + (Mount(probe_path, "/railyard/nccl_probe.py", True),)))


def probe_lines(plan: LaunchPlan, homes: dict[str, str | None], sizes: str, timeout: int, port: int) -> dict[str, str]:
    """service -> the `docker run` of its probe container."""
    return {svc.name: run_line(plan, probe_service(svc, on_host(PROBE_REMOTE, homes.get(svc.host)), sizes, timeout,
                                                   port), with_hash=False)
            for svc in plan.services()}


LOCAL_DEBUG_SUBSYS = "INIT,ENV,P2P,SHM,NET"  # channels, the variables NCCL read, NVLS, SHM and NET lines
_LOCAL_ENV_DROP = {"NCCL_DEBUG", "NCCL_DEBUG_SUBSYS", "NCCL_DEBUG_FILE", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                   "MASTER_ADDR", "MASTER_PORT"}


def local_probe_service(svc: Service, probe_path: str, sizes: str, timeout: int, port: int) -> Service:
    """A one-host service's probe: its GPUs by UUID, its environment, host network and IPC, shm size, CPU
    set and ulimits; NCCL at INFO to stdout; nccl_probe.py with one local rank per GPU instead of vLLM.
    The checkpoint, the API key and the port stay out: the probe needs none of them."""
    spec = svc.spec
    n = spec.gpus.count
    env = [(k, v) for k, v in spec.env if k not in _LOCAL_ENV_DROP]
    env += [("NCCL_DEBUG", "INFO"), ("NCCL_DEBUG_SUBSYS", LOCAL_DEBUG_SUBSYS), ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", str(port))]
    command = ("python3", "/railyard/nccl_probe.py", "--local-ranks", str(n), "--sizes", sizes,
               "--timeout", str(timeout))
    return replace(svc, spec=replace(spec, name=PROBE_CONTAINER, command=command, env=tuple(env), setup=(),
                                     secrets=(), ports=(), labels=(("railyard.nccl-check", "1"),),
                                     mounts=(Mount(probe_path, "/railyard/nccl_probe.py", True),)))


def local_probe_line(plan: LaunchPlan, svc: Service, home: str | None, sizes: str, timeout: int, port: int) -> str:
    """The `docker run` of a one-host service's probe container."""
    return run_line(plan, local_probe_service(svc, on_host(PROBE_REMOTE, home), sizes, timeout, port),
                    with_hash=False)


def nccl_check(inv: Inventory, sizes: str | None, timeout: float | None, console=None):
    """CheckReport (ranks over the rail) or OneHostReport (the ranks of one host), by the plan's layout."""
    head = inv.head
    v = head.vars
    sizes = sizes or v["nccl_check_sizes"]
    timeout = float(timeout or v["nccl_check_timeout_s"])
    threshold = float(v["nccl_check_min_link_fraction"])
    link = int(v["preflight_link_speed_mbps"])
    say = (lambda m: console.print(m, style="dim")) if console else (lambda m: None)
    with Runner(inv.hosts) as runner:
        plan, facts = plan_and_facts(inv, runner)
        if "rdma" not in plan.verifiers:
            return _check_one_host(plan, facts, runner, sizes, timeout, say)
        lines = probe_lines(plan, {n: f.home for n, f in facts.items()}, sizes, int(timeout),
                            int(v["vllm_master_port"]) + 10)
        started: list[str] = []
        try:
            for svc in plan.services():
                s = runner.session(svc.host)
                s.run(cmd("docker", "rm", "-f", PROBE_CONTAINER) + " >/dev/null 2>&1; true", timeout=60)
                write_remote(s, PROBE_REMOTE, PROBE.read_text(), mode="644")
            for svc in plan.services():  # in the plan's order (workers first); the head hosts the rendezvous
                r = runner.session(svc.host).run(lines[svc.name], timeout=120)
                if not r.ok:
                    raise LaunchError(f"{svc.host}: the probe container did not start: "
                                      f"{(r.stderr or str(r.error)).strip().splitlines()[-1:]}")
                started.append(svc.host)
            say(f"probe running on {', '.join(started)} (sizes {sizes})")
            deadline = time.monotonic() + timeout + 10
            while True:
                states = {h.name: inspect(runner.session(h), PROBE_CONTAINER) for h in inv.hosts}
                if all(not c.running for c in states.values()) or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            logs = {h.name: runner.session(h).run(cmd("docker", "logs", PROBE_CONTAINER) + " 2>&1", timeout=60).stdout
                    for h in inv.hosts}
        finally:  # always clean up, whatever happened above (also on Ctrl-C)
            removed = []
            for h in inv.hosts:
                r = runner.session(h).run(cmd("docker", "rm", "-f", PROBE_CONTAINER) + " 2>/dev/null", timeout=60)
                if r.ok and r.stdout.strip():
                    removed.append(h.name)
    errors: list[str] = []
    per_rank: dict[str, list[dict]] = {}
    verdicts = []
    for h in inv.hosts:
        text = logs[h.name]
        results, errs = parse_probe(text)
        per_rank[h.name] = results
        errors += [f"{h.name}: {e}" for e in errs]
        c = states[h.name]
        if c.running:
            errors.append(f"{h.name}: the probe did not finish within {timeout:.0f} s")
        elif c.exit_code != 0 and not errs:
            errors.append(f"{h.name}: the probe exited with code {c.exit_code}")
        verdicts.append(judge(text, f"{h.name}:{PROBE_CONTAINER}", [h.serve_rail.hca]))
    table = summarize(per_rank)
    fraction = (table[-1].busbw_gbs * 8000 / link) if table else None
    ok = (not errors and bool(table) and all(v_.verdict == "pass" for v_ in verdicts)
          and fraction is not None and fraction >= threshold)
    rep = CheckReport(ok, verdicts, table, fraction, threshold, link, errors, removed)
    return rep


def _check_one_host(plan: LaunchPlan, facts: dict, runner: Runner, sizes: str, timeout: float, say) -> OneHostReport:
    services = plan.services()
    hosts = plan.hosts()
    if len(hosts) != 1 or len(services) != 1:
        raise UsageError(f"nccl-check: layout {plan.layout} has {len(services)} service(s) on {len(hosts)} host(s); "
                         "the one-host check runs one engine on one host")
    svc = services[0]
    n = svc.spec.gpus.count
    if n < 2:
        raise UsageError(f"nccl-check: {svc.name} on {svc.host} runs on {n} GPU: no NCCL traffic between GPUs to check")
    h = next(x for x in runner.hosts if x.name == svc.host)
    v = h.vars
    min_busbw = float(v["nccl_check_min_busbw_gbs_intranode"])
    line = local_probe_line(plan, svc, facts[svc.host].home, sizes, int(timeout), int(v["vllm_master_port"]) + 10)
    s = runner.session(svc.host)
    removed: list[str] = []
    try:
        s.run(cmd("docker", "rm", "-f", PROBE_CONTAINER) + " >/dev/null 2>&1; true", timeout=60)
        write_remote(s, PROBE_REMOTE, PROBE.read_text(), mode="644")
        r = s.run(line, timeout=120)
        if not r.ok:
            raise LaunchError(f"{svc.host}: the probe container did not start: "
                              f"{(r.stderr or str(r.error)).strip().splitlines()[-1:]}")
        say(f"probe running on {svc.host}: {n} local ranks (sizes {sizes})")
        deadline = time.monotonic() + timeout + 10
        while True:
            state = inspect(s, PROBE_CONTAINER)
            if not state.running or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        text = s.run(cmd("docker", "logs", PROBE_CONTAINER) + " 2>&1", timeout=60).stdout
    finally:  # always clean up, whatever happened above (also on Ctrl-C)
        r = s.run(cmd("docker", "rm", "-f", PROBE_CONTAINER) + " 2>/dev/null", timeout=60)
        if r.ok and r.stdout.strip():
            removed.append(svc.host)
    results, errs = parse_probe(text, with_rank=True)
    errors = [f"{svc.host}: {e}" for e in errs]
    if state.running:
        errors.append(f"{svc.host}: the probe did not finish within {timeout:.0f} s")
    elif state.exit_code != 0 and not errs:
        errors.append(f"{svc.host}: the probe exited with code {state.exit_code}")
    per_rank: dict[int, list[dict]] = {}
    for row in results:
        per_rank.setdefault(int(row.get("rank", 0)), []).append(row)
    silent = [str(i) for i in range(n) if i not in per_rank]
    if results and silent and not errs:
        errors.append(f"{svc.host}: rank(s) {', '.join(silent)} of {n} reported no result")
    verdict = judge_intranode(text, f"{svc.host}:{PROBE_CONTAINER}")
    table = summarize(per_rank)
    ok = (not errors and bool(table) and verdict.verdict == "pass" and table[-1].busbw_gbs >= min_busbw)
    return OneHostReport(ok, plan.layout, svc.host, n, verdict, table, min_busbw, errors, removed)


def parse_sizes(text: str) -> str:
    from importlib import util
    spec = util.spec_from_file_location("nccl_probe", PROBE)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {PROBE}")
    mod = util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    try:
        values = [mod.parse_size(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise UsageError(f"--sizes {text!r}: sizes like 1M,16M,256M,1G")
    if not values or min(values) < 4:
        raise UsageError(f"--sizes {text!r}: at least one size of 4 bytes or more")
    return text


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
    detail, hint = split_fixes(v.reasons)
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
    hosts = list(dict.fromkeys(host_of(v.source) for v in rep.ranks))
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
