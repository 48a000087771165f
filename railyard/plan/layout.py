"""The serving layouts, by `serve_layout`. Each is one module with one class:

    validate(inv) -> list[Problem]       static, before any SSH (exit 2 on any problem)
    hosts(inv) -> list[Host]             the hosts it runs on
    needs(inv) -> (facts, GPUs per host) what railyard.facts.host must gather
    plan(inv, facts, order) -> LaunchPlan   pure; golden-tested
    dials(inv) -> list[Dial]             the TCP connections between its hosts (no facts needed: preflight
                                         tries them before anything is gathered; plan() carries them too)
"""

from __future__ import annotations

from typing import Protocol

from ..errors import InventoryError, Problem
from ..inventory import LAYOUTS, Host, Inventory
from ..facts.host import HostFacts
from .spec import Dial, LaunchPlan


class Layout(Protocol):
    name: str

    def validate(self, inv: Inventory) -> list[Problem]: ...

    def hosts(self, inv: Inventory) -> list[Host]: ...

    def needs(self, inv: Inventory) -> tuple[set[str], int]: ...

    def plan(self, inv: Inventory, facts: dict[str, HostFacts], order: str | None = None) -> LaunchPlan: ...

    def dials(self, inv: Inventory) -> list[Dial]: ...


__all__ = ["LAYOUTS", "Layout", "get", "validated"]


def get(inv: Inventory) -> Layout:
    """The inventory's layout (`serve_layout`, the same on every host: the loader checks that)."""
    from ..layouts.multinode_tp import MultinodeTP
    from ..layouts.pd import Pd
    from ..layouts.replicas import Replicas
    from ..layouts.single_node import DpEp, SingleNodeTP
    classes: dict[str, type[Layout]] = {"multinode_tp": MultinodeTP, "single_node_tp": SingleNodeTP, "dp_ep": DpEp,
                                         "replicas": Replicas, "pd": Pd}
    return classes[inv.head.vars["serve_layout"]]()


def validated(inv: Inventory) -> Layout:
    """The layout, after its static checks: any problem raises InventoryError (exit 2), before SSH."""
    layout = get(inv)
    problems = layout.validate(inv)
    if problems:
        raise InventoryError(problems)
    return layout
