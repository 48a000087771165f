"""`inv verify-rdma`, from the launch plan's services, so it works for every layout (`inv health` is
railyard.verbs.health).

verify-rdma collects the NCCL logs from every service whose traffic crosses the rails and
judges them with railyard.checks.nccl, adding what only the running container can show: memlock
unlimited, /dev/infiniband present, IPC_LOCK granted, and the NCCL library the image carries.
A one-host layout has nothing to verify there, and says so.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from ..checks import FAIL, PASS, SKIP, WARN, CheckResult, split_fixes
from ..errors import UsageError
from ..inventory import Inventory
from .serve import build_plan
from ..checks.nccl import RankVerdict, judge
from ..facts.docker import inspect
from ..transport.runner import Runner
from ..plan import layout as layouts
from ..plan.spec import LaunchPlan, Service
from ..transport import Session, Sh, cmd, q
from ..report import NO_HOST, Report, host_of

NCCL_LIB_PY = ("import os, nvidia.nccl as n; p = os.path.join(list(n.__path__)[0], 'lib', 'libnccl.so.2'); "
               "print(p if os.path.exists(p) else 'missing ' + p)")
MIN_NCCL = (2, 30, 7)  # older NCCL can deadlock cross-node CUDA graph replays over RoCE (vLLM issue #52504)


def cuda_graphs(svc: Service) -> bool:
    """Does this vLLM capture CUDA graphs: not with --enforce-eager, nor with a cudagraph_mode of NONE."""
    words = [w for w in svc.spec.command if isinstance(w, str)]
    if "--enforce-eager" in words:
        return False
    config = None   # the last one given wins, as vLLM's parser takes it: `--compilation-config J` or `...=J`
    for i, w in enumerate(words):
        if w == "--compilation-config" and i + 1 < len(words):
            config = words[i + 1]
        elif w.startswith("--compilation-config="):
            config = w.split("=", 1)[1]
    try:
        mode = json.loads(config).get("cudagraph_mode") if config else None
    except (ValueError, AttributeError):
        mode = None
    return str(mode).upper() != "NONE"


def old_nccl_reason(v: RankVerdict, svc: Service) -> str | None:
    """MIN_NCCL where its reason applies: channels between nodes, over RoCE, inside captured CUDA graphs
    (vLLM #52504: the same setup serves with --enforce-eager; NCCL 2.30.4 fixed it)."""
    if not (v.nccl_version and _version_tuple(v.nccl_version) < MIN_NCCL):
        return None
    if not (v.net_transport and v.roce and cuda_graphs(svc)):
        return None
    return (f"NCCL {v.nccl_version} is older than {'.'.join(map(str, MIN_NCCL))}, which can deadlock cross-node CUDA "
            "graph replays over RoCE (fix: load the image's own libnccl via VLLM_NCCL_SO_PATH, or serve with "
            "--enforce-eager)")


def judge_files(paths: list[str]) -> list[RankVerdict]:
    out = []
    for p in paths:
        try:
            text = Path(p).read_text(errors="replace")
        except OSError as e:
            raise UsageError(f"--log {p}: {e.strerror}")
        out.append(judge(text, p))
    return out


def nccl_log_glob(svc: Service) -> Sh:
    """The container's NCCL_DEBUG_FILE as a shell glob: %h and %p become `*`, every other character is
    quoted (a value from the inventory stays a value inside the container's `sh -c`)."""
    path = re.sub(r"%[hp]", "*", str(dict(svc.spec.env).get("NCCL_DEBUG_FILE", "/tmp/nccl_%h_%p.log")))
    return Sh("*".join(q(part) if part else "" for part in path.split("*")))


def _version_tuple(v: str | None) -> tuple:
    try:
        return tuple(int(x) for x in (v or "").split("."))
    except ValueError:
        return ()


def verify_rank(s: Session, svc: Service) -> list[RankVerdict]:
    name = svc.spec.name
    host = svc.host
    c = inspect(s, name)
    src = f"{host}:{name}"
    if not c.exists or not c.running:
        return [RankVerdict(src, "fail", None, False, [], None, [],
                            [f"container {name} is {c.status if c.exists else 'missing'} on {host} "
                             "(fix: inv launch / inv start)"])]
    pattern = nccl_log_glob(svc)
    script = (f'for f in {pattern}; do [ -e "$f" ] || continue; printf "@@file %s\\n" "$f"; cat "$f"; done; '
              'printf "@@memlock %s\\n" "$(ulimit -l)"; '
              'if [ -d /dev/infiniband ]; then printf "@@ib %s\\n" "$(ls /dev/infiniband | tr "\\n" " ")"; fi')
    r = s.run(cmd("docker", "exec", name, "sh", "-c", script), timeout=60)
    caps = s.run(cmd("docker", "inspect", "--format", "{{json .HostConfig.CapAdd}}", name), timeout=30)  # as granted
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
        v = judge("\n".join(lines), f"{host}:{path}", list(svc.spec.rdma.hcas if svc.spec.rdma else ()))
        if why := old_nccl_reason(v, svc):
            v.reasons.append(why)
        v.reasons.extend(container)
        v.verdict = "fail" if v.reasons else "pass"
        out.append(v)
    return out


def verify_rdma(inv: Inventory) -> tuple[LaunchPlan, list]:
    """Every service of a layout whose NCCL traffic crosses the rails (RankVerdicts); none for a one-host
    layout; a layout with its own verify-rdma (its hook) gives its own verdicts."""
    with Runner(layouts.get(inv).hosts(inv)) as runner:
        plan = build_plan(inv, runner, strict=False)
        own = layouts.by_name(plan.layout).verify_rdma(inv, runner, plan)
        if own is not None:
            return plan, own
        if "rdma" not in plan.verifiers:
            return plan, []
        got = runner.each(lambda s: [v for svc in plan.on_host(s.host.name) for v in verify_rank(s, svc)])
    out = []
    for h in plan.report_hosts():
        out.extend(got.ok[h] if h in got.ok else
                   [RankVerdict(h, "fail", None, False, [], None, [], [str(got.failed[h].error)])])
    return plan, out


def verdict_checks(verdicts: list, host_of=host_of) -> list[CheckResult]:
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
                detail, hint = split_fixes(v.notes)
                out.append(CheckResult(host_of(v.source), "rdma", WARN, detail, ev, hint))
            continue
        detail, hint = split_fixes(v.reasons)
        out.append(CheckResult(host_of(v.source), "rdma", FAIL, detail, ev, hint))
    return out


def rdma_report(verdicts: list, skipped: str | None = None, skip_host: str = NO_HOST, layout: str | None = None,
                host_of=host_of) -> Report:
    """verify-rdma: a check per rank verdict; a one-host layout is one `skip` (nothing crossed a rail)."""
    if skipped is not None:
        return Report([CheckResult(skip_host, "rdma", SKIP, skipped)],
                      {"ranks": [], "skipped": skipped, "layout": layout})
    checks = verdict_checks(verdicts, host_of)
    if not checks:  # nothing judged is never a pass
        checks = [CheckResult(NO_HOST, "rdma", FAIL, "no NCCL log was judged")]
    return Report(checks, {"ranks": [v.as_dict() for v in verdicts]})
