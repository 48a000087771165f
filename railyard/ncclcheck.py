"""`inv nccl-check`: an all-reduce across the ranks over the rail, before the model loads.

On every rank a short-lived container from the pinned image, with the GPU, devices, ulimits
and NCCL environment that `launch` uses (roles/vllm/templates/container-flags.j2), runs
scripts/nccl_probe.py. NCCL logs to stdout there, so `docker logs` carries both the probe's
JSON lines and the log the verify-rdma judge reads. The containers are always removed, also
when the probe fails or the user interrupts.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .errors import UsageError
from .inventory import Inventory
from .launch import (LaunchError, RankFacts, _write_remote, container_context, gather_facts, inspect, on_host,
                     render_command)
from .nccl import RankVerdict, judge
from .runner import Runner
from .transport import cmd

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


def nccl_check(inv: Inventory, sizes: str | None, timeout: float | None, console=None) -> CheckReport:
    head = inv.head
    v = head.vars
    sizes = sizes or v["nccl_check_sizes"]
    timeout = float(timeout or v["nccl_check_timeout_s"])
    threshold = float(v["nccl_check_min_link_fraction"])
    link = int(v["preflight_link_speed_mbps"])
    say = (lambda m: console.print(m, style="dim")) if console else (lambda m: None)
    with Runner(inv.hosts) as runner:
        facts = gather_facts(runner, inv.hosts)
        problems = [p for f in facts.values() for p in f.problems]
        if problems:
            raise LaunchError("cannot start the probe:\n  " + "\n  ".join(problems))
        started: list[str] = []
        try:
            for h in inv.ordered(None):
                s = runner.session(h)
                s.run(cmd("docker", "rm", "-f", PROBE_CONTAINER) + " >/dev/null 2>&1; true", timeout=60)
                _write_remote(s, PROBE_REMOTE, PROBE.read_text(), mode="644")
            for h in inv.ordered(None):  # workers first, as launch does; the head hosts the rendezvous
                f: RankFacts = facts[h.name]
                ctx = container_context(inv, f, drop_env=("NCCL_DEBUG_FILE",))
                ctx.update(probe_container=PROBE_CONTAINER, probe_path=on_host(PROBE_REMOTE, f.home), sizes=sizes,
                           probe_port=int(h.vars["vllm_master_port"]) + 10, timeout=int(timeout))
                r = runner.session(h).run(render_command("nccl-check-run.j2", ctx), timeout=120)
                if not r.ok:
                    raise LaunchError(f"{h.name}: the probe container did not start: "
                                      f"{(r.stderr or str(r.error)).strip().splitlines()[-1:]}")
                started.append(h.name)
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
