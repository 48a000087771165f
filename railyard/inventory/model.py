"""What a loaded inventory is: its hosts (with their resolved variables and where each was set) and their
RDMA rails, in rank order."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import UsageError


@dataclass(frozen=True)
class Rail:
    name: str
    hca: str
    ipv4: ipaddress.IPv4Interface

    @property
    def ip(self) -> str:
        return str(self.ipv4.ip)


@dataclass(frozen=True)
class Host:
    """One host of the inventory with its resolved variables."""

    name: str
    rank: int
    address: str  # ansible_host; "" for a local host without one
    port: int
    user: str
    connection: str  # "ssh" or "local"
    key_file: str
    rails: dict[str, Rail]
    vars: dict[str, Any] = field(repr=False)
    groups: tuple[str, ...] = ()  # the inventory groups it is in, outermost first
    origins: dict[str, tuple[str, str]] = field(repr=False, default_factory=dict)  # var -> (file, key path)

    @property
    def is_head(self) -> bool:
        return self.rank == 0

    @property
    def serve_rail(self) -> Rail:
        return self.rails[self.vars["cluster_serve_rail"]]

    @property
    def is_local(self) -> bool:
        return self.connection == "local"


@dataclass
class Inventory:
    path: Path
    hosts: list[Host]  # in rank order

    @property
    def head(self) -> Host:
        return self.hosts[0]

    @property
    def workers(self) -> list[Host]:
        return self.hosts[1:]

    def host(self, name: str) -> Host:
        for h in self.hosts:
            if h.name == name:
                return h
        raise UsageError(f"{self.path}: no host named {name!r} (hosts: {', '.join(self.names)})")

    @property
    def names(self) -> list[str]:
        return [h.name for h in self.hosts]

    def ordered(self, spec: str | None) -> list[Host]:
        """Hosts in the order `B,A`; default: workers first, the head last."""
        if not spec:
            return self.workers + [self.head]
        names = [n.strip() for n in spec.split(",") if n.strip()]
        if sorted(names) != sorted(self.names):
            raise UsageError(
                f"--rank-order {spec!r}: must name every host exactly once ({', '.join(self.names)})")
        return [self.host(n) for n in names]

    def select(self, spec: str | None) -> list[Host]:
        """Hosts named in `A,B` (rank order kept); all hosts when empty."""
        if not spec:
            return list(self.hosts)
        wanted = [n.strip() for n in spec.split(",") if n.strip()]
        for n in wanted:
            self.host(n)
        return [h for h in self.hosts if h.name in wanted]
