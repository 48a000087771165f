"""`inv nccl-check`: an all-reduce across the ranks over the rail, before the model loads.

On every rank a short-lived container from the pinned image, with the GPU, devices, ulimits
and NCCL environment of that rank's service in the launch plan, runs scripts/nccl_probe.py. NCCL logs to stdout there, so `docker logs` carries both the probe's
JSON lines and the log the verify-rdma judge reads. The containers are always removed, also
when the probe fails or the user interrupts.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dataclasses import replace

from .errors import LaunchError, UsageError
from .inventory import Inventory
from .launch import plan_and_facts
from .nccl import RankVerdict, judge
from .ops.containers import inspect
from .render.docker import run_line
from .runner import Runner
from .serving.hostfacts import on_host
from .serving.spec import GROUP_SIZE, HEAD_ADDR, NODE_RANK, LaunchPlan, Mount, Service
from .transport import cmd, write_remote

PROBE = Path(__file__).resolve().parent / "scripts" / "nccl_probe.py"
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


def parse_probe(text: str) -> tuple[list[dict], list[str]]:
    """The probe's JSON lines (results, errors) out of a container log that also holds NCCL's lines."""
    results, errors = [], []
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith('{"railyard_probe"'):
            continue
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        (errors if "error" in doc else results).append(doc.get("error") or doc)
    return results, errors


def summarize(per_rank: dict[str, list[dict]]) -> list[SizeResult]:
    """Per size, the slowest rank's time (an all-reduce is as fast as its slowest member)."""
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


def nccl_check(inv: Inventory, sizes: str | None, timeout: float | None, console=None) -> CheckReport:
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
            raise UsageError(f"nccl-check: layout {plan.layout} runs on one host; no NCCL traffic crosses a rail")
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


def parse_sizes(text: str) -> str:
    from importlib import util
    spec = util.spec_from_file_location("nccl_probe", PROBE)
    mod = util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    try:
        values = [mod.parse_size(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise UsageError(f"--sizes {text!r}: sizes like 1M,16M,256M,1G")
    if not values or min(values) < 4:
        raise UsageError(f"--sizes {text!r}: at least one size of 4 bytes or more")
    return text
