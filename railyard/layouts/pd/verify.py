"""`inv verify-rdma` for the pd layout: requests through the proxy (two per prefill DP rank, so that
round robin reaches each), then every instance's UCX endpoints judged by railyard.checks.nixl: KV
blocks over RDMA on the rails. No NCCL crosses the rails here."""

from __future__ import annotations

import json

from ...checks import FAIL, PASS, CheckResult, split_fixes
from ...checks.nixl import NixlVerdict, judge as judge_ucx
from ...facts.docker import inspect, log_tail
from ...inventory import Inventory
from ...plan.spec import LaunchPlan, Service
from ...transport import Session, cmd
from ...report import NO_HOST, Report, host_of
from ...transport.runner import Runner
from . import members
from .proof import each_service, exercise


def _instance(s: Session, svc: Service, hcas: list[str]) -> NixlVerdict:
    src = f"{svc.host}:{svc.spec.name}"
    c = inspect(s, svc.spec.name)
    if not c.exists or not c.running:
        return NixlVerdict(src, "fail", None, [], [f"container {svc.spec.name} is {c.status if c.exists else 'missing'} "
                                                   f"on {svc.host} (fix: inv launch / inv start)"])
    log = log_tail(s, svc.spec.name, None)
    env = s.run(cmd("docker", "inspect", "--format", "{{json .Config.Env}}", svc.spec.name), timeout=30)
    try:
        values = dict(e.split("=", 1) for e in json.loads(env.stdout) if "=" in e) if env.ok else {}
    except ValueError:
        values = {}
    return judge_ucx(src, log, hcas, values.get("UCX_NET_DEVICES"))


def verify_nixl(inv: Inventory, runner: Runner, plan: LaunchPlan) -> list[NixlVerdict]:
    """Every instance's verdict; a host that could not be reached fails its instances."""
    instances = members(plan)
    exercise(plan, runner, int(plan.service(plan.endpoint.service).expects("proof_words", "64")))
    got, unreachable = each_service(runner, instances,
                                    lambda s, x: _instance(s, x, [r.hca for r in inv.host(x.host).rails.values()]))
    return [got[x.name] for x in instances if x.name in got] + [NixlVerdict(h, "fail", None, [], [why])
                                                                for h, why in unreachable.items()]


def nixl_report(verdicts: list) -> Report:
    """verify-rdma on the pd layout: a `nixl` check per instance (KV blocks over RDMA on the rails)."""
    checks = []
    for v in verdicts:
        ev = f"{v.source}: transport {v.transport or 'none seen'}, devices {', '.join(v.devices) or '-'}"
        if v.verdict == PASS:
            checks.append(CheckResult(host_of(v.source), "nixl", PASS,
                                      f"UCX over {', '.join(v.devices)} (RDMA on the rail)", ev))
        else:
            detail, hint = split_fixes(v.reasons)
            checks.append(CheckResult(host_of(v.source), "nixl", FAIL, detail, ev, hint))
    if not checks:
        checks = [CheckResult(NO_HOST, "nixl", FAIL, "no instance was judged")]
    return Report(checks, {"instances": [v.as_dict() for v in verdicts]})
