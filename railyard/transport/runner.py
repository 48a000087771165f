"""Bounded parallel fan-out over hosts, one reused session per host.

    with Runner(inventory.hosts) as r:
        results = r.run(lambda host: "hostname")     # {"A": Result, "B": Result}

Every host yields a Result (or whatever the per-host function returns); an unexpected
exception inside one host's work becomes that host's `ssh_error`, never a traceback:
`each` answers a HostResults, its `.ok` the hosts whose work returned, its `.failed` the others.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Callable, Iterable, Iterator, Mapping, TypeVar, cast

from ..inventory import Host
from . import HostError, Result, Session, open_session

T = TypeVar("T")


class HostResults(Mapping[str, T | Result]):
    """Runner.each's answer (fabric's GroupResult, for railyard's sessions): by host name, in the hosts'
    order, fn's value or, where fn raised, the Result whose `error` (a HostError) says so.
    .ok: {host: fn's value}; .failed: {host: that Result}; both in the hosts' order."""

    def __init__(self, outcomes: Iterable[tuple[str, T | Result, bool]]):
        """outcomes: (host name, value, whether fn returned it), in the hosts' order."""
        self._all: dict[str, T | Result] = {}
        self.ok: dict[str, T] = {}
        self.failed: dict[str, Result] = {}
        for name, value, returned in outcomes:
            self._all[name] = value
            if returned:
                self.ok[name] = cast(T, value)  # fn's own value (T may itself be Result)
            else:
                assert isinstance(value, Result)
                self.failed[name] = value

    def __getitem__(self, name: str) -> T | Result:
        return self._all[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._all)

    def __len__(self) -> int:
        return len(self._all)

    def __repr__(self) -> str:
        return f"HostResults(ok={self.ok!r}, failed={self.failed!r})"


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
             on_done: Callable[[str, T | Result], None] | None = None) -> HostResults[T]:
        """Call fn(session) for every host, at most `parallel` at once, results keyed by host name (in the
        hosts' order; .ok and .failed split them). on_done(name, result), if given, is called as each host
        finishes, in finishing order."""
        chosen = list(hosts) if hosts is not None else self.hosts

        def guarded(h: Host) -> tuple[str, T | Result, bool]:
            started = time.monotonic()
            try:
                return h.name, fn(self.session(h)), True
            except Exception as e:  # a bug in per-host work must not take the other hosts down
                return h.name, Result(h.name, "", None, "", "", time.monotonic() - started,
                                      HostError("ssh_error", f"{type(e).__name__}: {e}",
                                                "this is a railyard bug: please report it")), False

        if len(chosen) <= 1:
            got = [guarded(h) for h in chosen]
            for name, r, _ in got:
                if on_done:
                    on_done(name, r)
            return HostResults(got)
        with ThreadPoolExecutor(max_workers=min(self.parallel, len(chosen))) as pool:
            futures = [pool.submit(guarded, h) for h in chosen]
            if on_done:
                for f in as_completed(futures):
                    name, r, _ = f.result()
                    on_done(name, r)
            return HostResults(f.result() for f in futures)

    def run(self, command: str | Callable[[Host], str], timeout: float | None = None,
            hosts: Iterable[Host] | None = None) -> HostResults[Result]:
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
