"""One operator at a time: a lock on the deployment's first host (the head) around every verb that
changes it (launch, start, stop, sync-model), so two launches, stops or syncs never interleave.

The lock is a directory made atomically with mkdir (`~/.cache/railyard/lock`) holding `owner`:
who, from which machine, with which pid, since when, running what. A second operator is refused
with that owner named. A lock whose owner ran on this machine and is gone is reported as stale;
nothing breaks a lock on its own: `inv unlock` shows the owner and removes it.
"""

from __future__ import annotations

import getpass
import json
import os
import secrets
import socket
import time
from dataclasses import dataclass

from ..errors import LaunchError
from ..inventory import Host, Inventory
from ..plan import layout as layouts
from ..transport import RemotePath, Session, q

LOCK_DIR = "~/.cache/railyard/lock"


def lock_host(inv: Inventory) -> Host:
    """Where the lock lives: the layout's first host (the head on the stations)."""
    return layouts.get(inv).hosts(inv)[0]


@dataclass
class Holder:
    user: str
    machine: str
    pid: int
    since: str
    command: str
    token: str = ""

    @classmethod
    def parse(cls, text: str) -> "Holder":
        try:
            d = json.loads(text)
            return cls(str(d["user"]), str(d["machine"]), int(d["pid"]), str(d["since"]), str(d["command"]),
                       str(d.get("token", "")))
        except (ValueError, KeyError, TypeError):
            return cls("?", "?", 0, "?", f"unreadable lock file: {text.strip()[:80]!r}")

    @property
    def stale(self) -> bool:
        """Taken on this machine by a process that is gone (another machine's owner cannot be checked)."""
        if self.machine != socket.gethostname() or self.pid <= 0:
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False

    def describe(self) -> str:
        return (f"{self.user}@{self.machine} (pid {self.pid}, `{self.command}`, since {self.since})"
                + (": that process is gone, the lock is stale" if self.stale else ""))


def me(command: str) -> Holder:
    return Holder(getpass.getuser(), socket.gethostname(), os.getpid(),
                  time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), command, secrets.token_hex(8))


def read(s: Session) -> Holder | None:
    r = s.run(f"cat {q(RemotePath(LOCK_DIR + '/owner'))} 2>/dev/null || echo @@none", timeout=30)
    if r.error:
        raise LaunchError(f"{s.host.name}: {r.error.kind}: {r.error.message} (fix: {r.error.hint})")
    return None if r.stdout.strip() == "@@none" else Holder.parse(r.stdout)


class HeadLock:
    """with HeadLock(session, "inv launch"): ... — refused (LaunchError) while another run holds it."""

    def __init__(self, session: Session, command: str):
        self.session = session
        self.owner = me(command)
        self.held = False

    def __enter__(self) -> "HeadLock":
        d = q(RemotePath(LOCK_DIR))
        script = (f"d={d}; mkdir -p \"$(dirname \"$d\")\"; if mkdir \"$d\" 2>/dev/null; then umask 077; "
                  "cat > \"$d/owner\"; echo @@acquired; else echo @@held; cat \"$d/owner\" 2>/dev/null; fi")
        r = self.session.run(script, stdin=json.dumps(self.owner.__dict__).encode(), timeout=30)
        if r.error:
            raise LaunchError(f"{self.session.host.name}: {r.error.kind}: {r.error.message} (fix: {r.error.hint})")
        first, _, rest = r.stdout.partition("\n")
        if first.strip() != "@@acquired":
            other = Holder.parse(rest)
            raise LaunchError(f"{self.session.host.name} is locked by {other.describe()}: wait for it to finish, or, "
                              "if that run is gone, `inv unlock` shows the lock and removes it")
        self.held = True
        return self

    def __exit__(self, *exc) -> None:
        if self.held:  # only our own lock: the token must match
            d = q(RemotePath(LOCK_DIR))
            self.session.run(f"d={d}; grep -qF {q(self.owner.token)} \"$d/owner\" 2>/dev/null && rm -rf -- \"$d\"",
                             timeout=30)
            self.held = False


def unlock(s: Session) -> Holder | None:
    """Remove the lock, whoever holds it; the holder it had (None: there was none)."""
    holder = read(s)
    if holder is not None:
        s.run(f"rm -rf -- {q(RemotePath(LOCK_DIR))}", timeout=30)
    return holder
