"""Bounded parallel fan-out over hosts, one reused session per host.

    with Runner(inventory.hosts) as r:
        results = r.run(lambda host: "hostname")     # {"A": Result, "B": Result}

Every host yields a Result (or whatever the per-host function returns); an unexpected
exception inside one host's work becomes that host's `ssh_error`, never a traceback.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Callable, Iterable, TypeVar

from ..inventory import Host
from . import HostError, Result, Session, open_session

T = TypeVar("T")


class Runner:
    def __init__(self, hosts: Iterable[Host], parallel: int | None = None,
                 connect_timeout: float | None = None, command_timeout: float | None = None,
                 sessions: dict[str, Session] | None = None):
        """sessions: ready-made sessions by host name (a FakeSession in unit tests)."""
        self.hosts = list(hosts)
        first = self.hosts[0].vars if self.hosts else {}
        self.parallel = max(1, int(parallel or first.get("ssh_parallel", 32)))
        self._sessions: dict[str, Session] = dict(sessions or {})
        for h in self.hosts:
            if h.name not in self._sessions:
                self._sessions[h.name] = open_session(h, connect_timeout=connect_timeout,
                                                      command_timeout=command_timeout)

    def session(self, host: Host | str) -> Session:
        return self._sessions[host if isinstance(host, str) else host.name]

    def each(self, fn: Callable[[Session], T], hosts: Iterable[Host] | None = None,
             on_done: Callable[[str, T | Result], None] | None = None) -> dict[str, T | Result]:
        """Call fn(session) for every host, at most `parallel` at once, results keyed by host name (in the
        hosts' order). on_done(name, result), if given, is called as each host finishes, in finishing order."""
        chosen = list(hosts) if hosts is not None else self.hosts

        def guarded(h: Host):
            started = time.monotonic()
            try:
                return fn(self.session(h))
            except Exception as e:  # a bug in per-host work must not take the other hosts down
                return Result(h.name, "", None, "", "", time.monotonic() - started,
                              HostError("ssh_error", f"{type(e).__name__}: {e}", "this is a railyard bug: please report it"))

        if len(chosen) <= 1:
            got = {h.name: guarded(h) for h in chosen}
            for name, r in got.items():
                if on_done:
                    on_done(name, r)
            return got
        with ThreadPoolExecutor(max_workers=min(self.parallel, len(chosen))) as pool:
            futures = {pool.submit(guarded, h): h.name for h in chosen}
            if on_done:
                for f in as_completed(futures):
                    on_done(futures[f], f.result())
            got = {name: f.result() for f, name in futures.items()}
            return {h.name: got[h.name] for h in chosen}

    def run(self, command: str | Callable[[Host], str], timeout: float | None = None,
            hosts: Iterable[Host] | None = None) -> dict[str, Result]:
        """Run one command (or a per-host command) on every host."""
        def one(s: Session) -> Result:
            c = command(s.host) if callable(command) else command
            return s.run(c, timeout=timeout)
        return self.each(one, hosts)

    def close(self) -> None:
        for s in self._sessions.values():
            s.close()

    def __enter__(self) -> "Runner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
