"""What every renderer of a plan shares: the services in start order with the stage they wait for,
each one's program words with its refs resolved for the target, the shell line that reads its
secrets from files before it execs the program, and its HTTP ready gates.

    for svc, before in walk.in_order(plan): ...
    words = walk.words(svc, resolved)                 # resolved: Ref name -> text on the target
    script = walk.entry(svc.spec, words, path_of)     # None: the program runs without a shell

Targets that schedule the plan themselves (Kubernetes, Slurm) know no host's facts when they
render it; `placeholder_facts` gives the layouts facts whose values are tokens (`@@{home}@@`,
`@@{gpu0}@@`, `@@{gid_index}@@`) that each such renderer turns into its own symbol.
"""

from __future__ import annotations

import re
from typing import Callable, Iterator

from ..facts.gpu import Gpu
from ..inventory import Inventory
from ..facts.host import HostFacts
from ..plan.spec import ContainerSpec, LaunchPlan, Ref, Secret, Service, Value
from ..transport import q


def in_order(plan: LaunchPlan) -> Iterator[tuple[Service, list[Service]]]:
    """Each service in start order, with the services of the stage before it (what it waits for)."""
    before: list[Service] = []
    for stage in plan.stages:
        for svc in stage.services:
            yield svc, before
        before = list(stage.services)


def value(v: Value, resolved: dict[str, str]) -> str:
    return resolved[v.name] if isinstance(v, Ref) else str(v)


def words(svc: Service, resolved: dict[str, str]) -> list[str]:
    return [value(a, resolved) for a in svc.spec.command]


def entry(spec: ContainerSpec, argv: list[str], secret_path: Callable[[Secret], str], optional: bool = False,
          before: tuple[str, ...] = ()) -> str | None:
    """The shell line the image runs: `before` and its setup lines, each secret exported from its file
    (optional: only when the file is there and not empty), then exec the program. None when there is
    nothing to run before the program."""
    if not (spec.setup or spec.secrets or before):
        return None
    lines = list(before) + list(spec.setup)
    for s in spec.secrets:
        path = q(secret_path(s))
        export = f'export {s.env}="$(cat {path})"'
        lines.append(f"if [ -s {path} ]; then {export}; fi" if optional else export)
    lines.append("exec " + " ".join(q(w) for w in argv))
    return "; ".join(lines)


def local_address(bind: str) -> str:
    """Where a service is reached from its own host (a wildcard bind answers on loopback)."""
    return "127.0.0.1" if bind in ("", "0.0.0.0", "::") else bind


def http_gates(svc: Service) -> list[tuple[int, str]]:
    """(port, path) of each HTTP ready gate."""
    return [(g.port or svc.spec.ports[0], g.path) for g in svc.ready if g.kind == "http"]


# ---------------------------------------------------------------- facts a scheduler finds where it runs

TOKEN = "@@{%s}@@"
_TOKEN_RE = re.compile(r"@@\{([a-z0-9_]+)\}@@")


def token(name: str) -> str:
    return TOKEN % name


def placeholder_facts(inv: Inventory, hosts, count: int) -> dict[str, HostFacts]:
    """Facts for a plan rendered for a scheduler: $HOME, `count` GPUs and the GID index as tokens; no CPU
    affinity (the scheduler pins CPUs)."""
    out = {}
    for h in hosts:
        name = h.vars["cluster_gpu_name"]
        gpus = [Gpu(i, token(f"gpu{i}"), name, 0, 0) for i in range(count)]
        out[h.name] = HostFacts(h, home=token("home"), gpus=gpus, gid_index=token("gid_index"))  # type: ignore[arg-type]
    return out


SCHEDULED_REFS = ("head_addr", "node_rank", "group_size", "node_addr", "gid_index")


def markers(svc: Service) -> dict[str, str]:
    """What each Ref resolves to for a scheduler's renderer: a token (`@@{ref_head_addr}@@`) for the values
    found where it runs; the port and the model's path as they are."""
    r = {n: token("ref_" + n) for n in SCHEDULED_REFS}
    r["port"] = str(svc.spec.ports[0]) if svc.spec.ports else ""
    r["model_dir"] = next((m.target for m in svc.spec.mounts if m.kind == "model"), "")
    return r


def own_address(text: str, svc: Service) -> str:
    """The service's own rail address where the plan has it as a literal (pd) as its node address's token."""
    if svc.address and svc.address in text:
        return re.sub(r"(?<![\d.])" + re.escape(svc.address) + r"(?![\d.])", token("ref_node_addr"), text)
    return text


def tokens_in(text: str) -> set[str]:
    return set(_TOKEN_RE.findall(text))


def replace_tokens(text: str, by: Callable[[str], str]) -> str:
    return _TOKEN_RE.sub(lambda m: by(m.group(1)), text)
