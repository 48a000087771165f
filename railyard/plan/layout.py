"""The serving layouts, by `serve_layout`: one package each under railyard/layouts/, its class a
subclass of `Layout` that registers itself by name (`class Pd(Layout, name="pd")`). The registry is
the one list of layouts: the inventory's check of `serve_layout` (railyard.inventory.rules.LAYOUTS, which
registering writes), the verbs' dispatch and the docs read it. The registry never imports the layouts
(they build on it): a program imports railyard.layouts, which imports every layout package, before it
asks; the task layer's `load` does (railyard.cli), and the tests' conftest. Every layout has

    validate(inv) -> list[Problem]       static, before any SSH (exit 2 on any problem)
    hosts(inv) -> list[Host]             the hosts it runs on
    needs(inv) -> (facts, GPUs per host) what railyard.facts.host must gather
    plan(inv, facts, order) -> LaunchPlan   pure; golden-tested
    dials(inv) -> list[Dial]             the TCP connections between its hosts (no facts needed: preflight
                                         tries them before anything is gathered; plan() carries them too)

and may bring hooks that the generic verbs call, each falling back to the generic behaviour where
the layout has none (None):

    rank_order                           True: `--rank-order` chooses its start order
    kv_plan                              a KvPlanRow: `inv plan` (the KV planner) sizes it on one host's GPUs
    own_checks                           cluster-wide variables it compares itself (they may differ by host)
    final_gate(plan, runner)             after every stage is ready: a gate over the whole plan (a Proof)
    verify_rdma(inv, runner, plan)       `inv verify-rdma`'s verdicts, in place of NCCL over the rails
    rdma_report(verdicts)                the Report of those verdicts (with verify_rdma)
    api_probes(plan, cache_proof)        `inv health`'s probes of the endpoint, in place of the generic ones
    cache_proof                          True: `inv health --cache-proof` has a shared cache to prove
    canary_targets(plan)                 the APIs `inv health --canary` asks, in place of the endpoint alone
    recovery(inv, runner, plan, target, found)  `inv recover`'s look and choice (a Recovery) from the shared hung
                                         verdict (found: railyard.verbs.hung.Survey), in place of the group path
    restore(inv, runner, plan, rec, ...) the path that recovery chose, taken (with recovery)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar

from ..errors import InventoryError, Problem
from ..facts.host import HostFacts
from ..inventory import Host, Inventory, rules
from .spec import Dial, LaunchPlan

if TYPE_CHECKING:
    from ..report import Report
    from ..transport.runner import Runner

_REGISTRY: dict[str, type["Layout"]] = {}
CACHE_PROOF_AUTO = -1  # `inv health --cache-proof` without --proof-words: the layout chooses the prompt's words


@dataclass
class Proof:
    """What a layout's final gate saw: ok, what it saw, the fix when it failed, and what it proves (a
    failed launch says "<what> is not proven: <detail>")."""
    ok: bool
    detail: str
    fix: str = ""
    what: str = "the final gate"


@dataclass(frozen=True)
class KvPlanRow:
    """How `inv plan` (the KV planner, railyard.verbs.capacity) sizes a one-host layout on N GPUs: its row's
    label (`{n}`: the GPUs), whether each GPU is an engine of its own (attention DP, experts EP: one KV cache
    per GPU, each rank with --dp-reserve-gib's reserve) or one engine spans them all (TP=N), and what the
    assumptions say of it. The planner's rows come in the registry's order; the first is what the others are
    compared to ("vs TP")."""
    label: str
    engine_per_gpu: bool
    assumption: str


class Layout:
    """A serving layout. Subclass with `name=` to register it; override the hooks it brings."""
    name: ClassVar[str]
    rank_order: ClassVar[bool] = False
    own_checks: ClassVar[tuple[str, ...]] = ()
    cache_proof: ClassVar[bool] = False
    kv_plan: ClassVar[KvPlanRow | None] = None
    ranks_span_hosts: ClassVar[bool] = False   # its ranks form torch.distributed groups across hosts (Gloo, NCCL)

    def __init_subclass__(cls, name: str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if name:
            if name in _REGISTRY:
                raise TypeError(f"layout {name!r} registered twice ({_REGISTRY[name].__module__}, {cls.__module__})")
            cls.name = name
            _REGISTRY[name] = cls
            rules.LAYOUTS[name] = tuple(cls.own_checks)  # the inventory's view: it cannot import the layouts

    def validate(self, inv: Inventory) -> list[Problem]:
        raise NotImplementedError

    def rank_env(self, inv: Inventory, host: Host) -> dict[str, str]:
        """The NCCL/Gloo environment the layout gives this host's engine containers, as far as it is known before
        launch (preflight's nccl_conf and gloo_iface read its keys; a fact's value is a placeholder): by default
        vllm_extra_env alone."""
        return {str(k): str(v) for k, v in (host.vars.get("vllm_extra_env") or {}).items()}

    def hosts(self, inv: Inventory) -> list[Host]:
        raise NotImplementedError

    def needs(self, inv: Inventory) -> tuple[set[str], int]:
        raise NotImplementedError

    def plan(self, inv: Inventory, facts: dict[str, HostFacts], order: str | None = None) -> LaunchPlan:
        raise NotImplementedError

    def dials(self, inv: Inventory) -> list[Dial]:
        raise NotImplementedError

    # hooks: None (or the class default) means the generic verb does it

    def final_gate(self, plan: LaunchPlan, runner: "Runner") -> Proof | None:
        return None

    def verify_rdma(self, inv: Inventory, runner: "Runner", plan: LaunchPlan) -> list | None:
        return None

    def rdma_report(self, verdicts: list) -> "Report | None":
        return None

    def api_probes(self, plan: LaunchPlan, cache_proof: int) -> Callable | None:
        return None

    def canary_targets(self, plan: LaunchPlan) -> list[Any] | None:
        """Endpoints, or targets that ask their own way (railyard.verbs.canary.Asked)."""
        return None

    def recovery(self, inv: Inventory, runner: "Runner", plan: LaunchPlan, target: str | None, found: Any) -> Any:
        return None

    def roll_steps(self, plan: LaunchPlan) -> list[str] | None:
        """The steps of a roll of its own (railyard.verbs.roll); None: a planned restart of the whole plan."""
        return None

    def roll(self, inv: Inventory, runner: "Runner", old: LaunchPlan, new: LaunchPlan, record: Any, timeout: float,
             drain_timeout: float, show: Any) -> None:
        """Take the roll roll_steps described, its steps into record (railyard.verbs.roll.Roll); raise
        LaunchError when it stops."""
        raise NotImplementedError

    def restore(self, inv: Inventory, runner: "Runner", plan: LaunchPlan, rec: Any, timeout: float,
                drain_timeout: float, show: Any) -> Any:
        return None


__all__ = ["CACHE_PROOF_AUTO", "KvPlanRow", "Layout", "Proof", "by_name", "get", "names", "names_where", "validated"]


def _registry() -> dict[str, type[Layout]]:
    """Every layout, by name, as registered: importing railyard.layouts imports each layout package, which
    registers (the program does that, not this module: the layouts build on it)."""
    if not _REGISTRY:
        raise RuntimeError("no layout is registered: import railyard.layouts first (railyard.cli's load does)")
    return _REGISTRY


def names() -> tuple[str, ...]:
    """The values serve_layout takes."""
    return tuple(_registry())


def names_where(able: Callable[[type[Layout]], bool]) -> tuple[str, ...]:
    """The layouts whose class can do something (`able(cls)`): what an error names as the ones that can."""
    return tuple(n for n, cls in _registry().items() if able(cls))


def by_name(name: str) -> Layout:
    return _registry()[name]()


def get(inv: Inventory) -> Layout:
    """The inventory's layout (`serve_layout`, the same on every host: the loader checks that)."""
    return by_name(inv.head.vars["serve_layout"])


def validated(inv: Inventory) -> Layout:
    """The layout, after its static checks: any problem raises InventoryError (exit 2), before SSH."""
    layout = get(inv)
    problems = layout.validate(inv)
    if problems:
        raise InventoryError(problems)
    return layout
