"""Run commands on one host: over SSH (one Fabric/Paramiko connection, reused) or locally.

Every remote call returns a `Result`; transport failures are classified here, at the
edge (unreachable, auth_failed, host_key_unknown, host_key_changed, timeout), so no
caller ever sees a Paramiko exception or a traceback.

Quoting lives here too: `q()` is the one place a value becomes shell text.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import os
import select
import shlex
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Literal

import paramiko

from ..errors import CommandFailed
from ..inventory import Host

if TYPE_CHECKING:
    from fabric import Connection

# paramiko logs a failed handshake (a dropped banner) with its traceback from its own thread; railyard
# reports the same failure once, classified, so those records go nowhere (no last-resort stderr).
logging.getLogger("paramiko").addHandler(logging.NullHandler())

# ---------------------------------------------------------------- quoting


class Sh(str):
    """Shell text that is already safe to paste into a command line."""


class RemotePath(str):
    """A path on the remote host; `~/x` is expanded by the remote shell, the rest stays quoted."""


def q(value: object) -> Sh:
    """Quote one value for a POSIX shell. The only place values become shell text."""
    if isinstance(value, Sh):
        return value
    if isinstance(value, RemotePath) and (value == "~" or value.startswith("~/")):
        rest = value[2:]
        return Sh('"$HOME"' + ("/" + shlex.quote(rest) if rest else ""))
    return Sh(shlex.quote(str(value)))


def quote_text(text: str) -> Sh:
    """Quote shell text (a whole command) so it travels as one argument, e.g. to `sh -c`."""
    return Sh(shlex.quote(str.__str__(text)))


def cmd(*argv: object) -> Sh:
    """`cmd("ping", "-I", iface, peer)` -> one command line with every argument quoted."""
    return Sh(" ".join(q(a) for a in argv))


# ---------------------------------------------------------------- results


HostErrorKind = Literal["unreachable", "auth_failed", "host_key_unknown", "host_key_changed", "timeout", "ssh_error"]


@dataclass(frozen=True)
class HostError:
    """A classified transport failure."""

    kind: HostErrorKind
    message: str
    hint: str = ""
    fingerprint: str = ""

    def __str__(self) -> str:
        return f"{self.kind}: {self.message}"


@dataclass
class Result:
    host: str
    command: str
    rc: int | None
    stdout: str
    stderr: str
    duration: float
    error: HostError | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.rc == 0


def fingerprint(key: paramiko.PKey) -> str:
    """OpenSSH-style `SHA256:...` fingerprint of a host key."""
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


def known_hosts_path(host: Host) -> Path:
    return Path(host.vars.get("ssh_known_hosts") or "~/.ssh/known_hosts").expanduser()


def host_key_name(host: Host) -> str:
    """How the host is named in known_hosts: `addr`, or `[addr]:port` off port 22."""
    return host.address if host.port == 22 else f"[{host.address}]:{host.port}"


class UnknownHostKey(paramiko.SSHException):
    def __init__(self, key: paramiko.PKey):
        self.key = key
        super().__init__(f"unknown host key {key.get_name()} {fingerprint(key)}")


class _RefuseUnknown(paramiko.MissingHostKeyPolicy):
    """Never add a key on our own: refuse and carry the key so we can show its fingerprint."""

    def missing_host_key(self, client, hostname, key):
        raise UnknownHostKey(key)


# ---------------------------------------------------------------- sessions

KEEPALIVE_MISSED = 3  # unanswered keepalives before a connection counts as lost (OpenSSH's ServerAliveCountMax)
LOST_HINT = ("the host or its management network went away (link, switch port, power): check it, then run the "
             "task again")


class Session:
    """A connection to one host; commands run one after another over it."""

    def __init__(self, host: Host, connect_timeout: float | None = None,
                 command_timeout: float | None = None):
        self.host = host
        self.connect_timeout = float(connect_timeout or host.vars.get("ssh_connect_timeout", 10))
        self.command_timeout = float(command_timeout or host.vars.get("ssh_command_timeout", 60))
        self.error: HostError | None = None

    def connect(self) -> HostError | None:
        """Open the connection now (a no-op for local); the error, if it failed."""
        return self.error

    def run(self, command: str, timeout: float | None = None, stdin: bytes | None = None,
            on_output: Callable[[str], None] | None = None) -> Result:
        """Run one command. on_output, if given, receives stdout as it arrives."""
        raise NotImplementedError

    def close(self) -> None:
        pass

    def _failed(self, command: str, started: float, error: HostError) -> Result:
        return Result(self.host.name, command, None, "", "", time.monotonic() - started, error)


class LocalSession(Session):
    """`ansible_connection: local`: the command runs on this machine, under /bin/sh."""

    def run(self, command: str, timeout: float | None = None, stdin: bytes | None = None,
            on_output: Callable[[str], None] | None = None) -> Result:
        timeout = timeout or self.command_timeout
        started = time.monotonic()
        proc = subprocess.Popen(["/bin/sh", "-c", command], stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        if stdin:
            threading.Thread(target=_feed, args=(proc.stdin, stdin), daemon=True).start()
        assert proc.stdout is not None and proc.stderr is not None  # both are PIPEs, above
        out, err = bytearray(), bytearray()
        streams = {proc.stdout.fileno(): out, proc.stderr.fileno(): err}
        deadline = started + timeout
        while streams:
            left = deadline - time.monotonic()
            if left <= 0:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                return Result(self.host.name, command, None, out.decode(errors="replace"), err.decode(errors="replace"),
                              time.monotonic() - started,
                              HostError("timeout", f"command did not finish within {timeout:g}s",
                                        "raise ssh_command_timeout or find what hangs on the host"))
            ready, _, _ = select.select(list(streams), [], [], min(left, 1.0))
            for fd in ready:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    del streams[fd]
                    continue
                streams[fd] += chunk
                if on_output and fd == proc.stdout.fileno():
                    on_output(chunk.decode(errors="replace"))
        rc = proc.wait()
        return Result(self.host.name, command, rc, out.decode(errors="replace"), err.decode(errors="replace"),
                      time.monotonic() - started)


def _feed(pipe, data: bytes) -> None:
    try:
        pipe.write(data)
        pipe.close()
    except OSError:
        pass


class SSHSession(Session):
    """One Fabric connection per host, opened on first use and reused for every command."""

    def __init__(self, host: Host, connect_timeout: float | None = None,
                 command_timeout: float | None = None):
        super().__init__(host, connect_timeout, command_timeout)
        self._conn: Connection | None = None

    def connect(self) -> HostError | None:
        if self._conn is not None or self.error is not None:
            return self.error
        from fabric import Connection  # imported here: fabric's import is slow and not always needed

        h = self.host
        kw: dict[str, object] = {"allow_agent": True, "look_for_keys": True,
              "banner_timeout": self.connect_timeout, "auth_timeout": self.connect_timeout}
        if h.key_file:
            kw["key_filename"] = [h.key_file]
        conn = Connection(h.address, user=h.user or None, port=h.port,
                          connect_timeout=int(self.connect_timeout), connect_kwargs=kw)
        conn.client.set_missing_host_key_policy(_RefuseUnknown())
        kh = known_hosts_path(h)
        if kh.is_file():
            try:
                conn.client.get_host_keys().load(str(kh))
            except (OSError, paramiko.SSHException) as e:
                self.error = HostError("ssh_error", f"cannot read known_hosts {kh}: {e}",
                                       "fix or remove the broken line in that file")
                return self.error
        try:
            conn.open()
        except Exception as e:  # classified below; nothing escapes as a traceback
            self.error = classify(e, h)
            try:
                conn.close()
            except Exception:
                pass
            return self.error
        self._keep_alive(conn.client.get_transport())
        self._conn = conn
        return None

    def _keep_alive(self, transport: paramiko.Transport) -> None:
        """An SSH keepalive every ssh_keepalive_s (OpenSSH's ServerAliveInterval), and the kernel drops the
        connection once one has gone unacknowledged for KEEPALIVE_MISSED intervals (TCP_USER_TIMEOUT): a host
        whose link died under a command (no reset) is named then, not when the command's own timeout runs out.
        The acknowledgement is the kernel's, so a host too busy to schedule sshd is not taken for a lost one."""
        every = int(self.host.vars.get("ssh_keepalive_s", 5))
        transport.set_keepalive(every)
        if isinstance(transport.sock, socket.socket) and hasattr(socket, "TCP_USER_TIMEOUT"):  # not via a proxy
            transport.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, every * KEEPALIVE_MISSED * 1000)

    def run(self, command: str, timeout: float | None = None, stdin: bytes | None = None,
            on_output: Callable[[str], None] | None = None) -> Result:
        timeout = timeout or self.command_timeout
        started = time.monotonic()
        err = self.connect()
        if err:
            return self._failed(command, started, err)
        assert self._conn is not None  # connect() either opened it or returned the error
        try:
            chan = self._conn.client.get_transport().open_session(timeout=self.connect_timeout)
            chan.exec_command(command)
            if stdin:
                chan.sendall(stdin)
            chan.shutdown_write()
            return self._collect(chan, command, started, timeout, on_output)
        except Exception as e:
            self.error = classify(e, self.host)
            return self._failed(command, started, self.error)

    def _collect(self, chan: paramiko.Channel, command: str, started: float, timeout: float,
                 on_output: Callable[[str], None] | None = None) -> Result:
        out, err = bytearray(), bytearray()
        deadline = started + timeout
        while True:
            while chan.recv_ready():
                chunk = chan.recv(1 << 16)
                out += chunk
                if on_output:
                    on_output(chunk.decode(errors="replace"))
            while chan.recv_stderr_ready():
                err += chan.recv_stderr(1 << 16)
            if chan.exit_status_ready() and chan.eof_received and not chan.recv_ready() \
                    and not chan.recv_stderr_ready():
                break
            if not chan.get_transport().is_active() and not chan.recv_ready() and not chan.recv_stderr_ready():
                return Result(self.host.name, command, None, out.decode(errors="replace"),
                              err.decode(errors="replace"), time.monotonic() - started, self._dropped())
            left = deadline - time.monotonic()
            if left <= 0:
                chan.close()
                return Result(self.host.name, command, None, out.decode(errors="replace"),
                              err.decode(errors="replace"), time.monotonic() - started,
                              self._lost(timeout) or HostError(
                                  "timeout", f"command did not finish within {timeout:g}s",
                                  "raise ssh_command_timeout or find what hangs on the host"))
            select.select([chan], [], [], min(left, 1.0))
        rc = chan.recv_exit_status()
        chan.close()
        return Result(self.host.name, command, rc, out.decode(errors="replace"), err.decode(errors="replace"),
                      time.monotonic() - started)

    def _dropped(self) -> HostError:
        """The connection died under a command: its keepalives went unanswered (or the host reset it)."""
        self.close()
        every = int(self.host.vars.get("ssh_keepalive_s", 5))
        self.error = HostError("unreachable", f"{self.host.address}:{self.host.port}: the connection stopped "
                                              f"answering during a command (no reply to SSH keepalives for "
                                              f"{every * KEEPALIVE_MISSED} s)", LOST_HINT)
        return self.error

    def _lost(self, timeout: float) -> HostError | None:
        """After a command ran out of time: does the host still answer on its SSH port? If not, the
        connection was lost under the command (a dead link sends no reset), and the session stays
        failed, so later commands to that host fail at once instead of each waiting out its timeout."""
        try:
            socket.create_connection((self.host.address, self.host.port), timeout=min(self.connect_timeout, 5)).close()
            return None
        except OSError:
            self.close()
            self.error = HostError("unreachable", f"{self.host.address}:{self.host.port}: the connection stopped "
                                                  f"answering during a command ({timeout:g}s) and the host no longer "
                                                  "answers",
                                   LOST_HINT)
            return self.error

    def close(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            except Exception:
                pass
            self._conn = None


def read_remote(s: Session, path: str) -> str | None:
    """A file's text on the host (None: it does not exist). A transport failure raises CommandFailed."""
    r = s.run(f"cat -- {q(RemotePath(path))} 2>/dev/null || echo @@railyard-missing", timeout=30)
    if r.error:
        raise CommandFailed(r)
    return None if r.stdout == "@@railyard-missing\n" else r.stdout


def write_remote(s: Session, path: str, content: str, mode: str = "600") -> None:
    """Write a file atomically (temp file + rename), created with `mode` (0600 by default)."""
    p = q(RemotePath(path))
    script = (f"set -e; umask 077; f={p}; mkdir -p \"$(dirname \"$f\")\"; t=\"$f.railyard.$$\"; cat > \"$t\"; "
              f"chmod {mode} \"$t\"; mv -f \"$t\" \"$f\"")
    r = s.run(script, stdin=content.encode(), timeout=30)
    if not r.ok:
        raise CommandFailed(r, f"could not write {path}")


def open_session(host: Host, **kw) -> Session:
    return LocalSession(host, **kw) if host.is_local else SSHSession(host, **kw)


def classify(e: BaseException, host: Host) -> HostError:
    """Turn a connection-time exception into one of a few kinds with a fix hint."""
    where = f"{host.address}:{host.port}"
    kh = known_hosts_path(host)
    if isinstance(e, UnknownHostKey):
        fp = fingerprint(e.key)
        return HostError("host_key_unknown", f"{where} offered {e.key.get_name()} key {fp}, not in {kh}",
                         f"check that fingerprint on the host (ssh-keygen -lf /etc/ssh/ssh_host_*_key.pub), "
                         f"then: inv trust-hosts --hosts {host.name} --accept", fp)
    if isinstance(e, paramiko.BadHostKeyException):
        got, want = fingerprint(e.key), fingerprint(e.expected_key)
        return HostError("host_key_changed",
                         f"{where} offered {e.key.get_name()} key {got}, but {kh} records {want}",
                         f"if {host.name} was reinstalled, verify {got} on its console, then: "
                         f"inv trust-hosts --hosts {host.name} --replace (otherwise suspect interception)", got)
    if isinstance(e, paramiko.AuthenticationException):
        user = host.user or os.environ.get("USER", "")
        return HostError("auth_failed", f"{user}@{where} refused our keys ({e})",
                         f"install your public key for {user} on {host.name} (ssh-copy-id) or set ansible_ssh_private_key_file")
    if isinstance(e, paramiko.ssh_exception.NoValidConnectionsError):
        return HostError("unreachable", f"{where}: connection refused",
                         f"is sshd running on {host.name} and listening on port {host.port}?")
    if isinstance(e, (socket.timeout, TimeoutError)):
        return HostError("unreachable", f"{where}: no answer within the connect timeout",
                         "check the address, routing and firewall, or raise ssh_connect_timeout")
    if isinstance(e, socket.gaierror):
        return HostError("unreachable", f"{host.address}: name does not resolve ({e.strerror})",
                         "fix ansible_host or DNS")
    if isinstance(e, ConnectionRefusedError):
        return HostError("unreachable", f"{where}: connection refused",
                         f"is sshd running on {host.name} and listening on port {host.port}?")
    if isinstance(e, OSError):
        return HostError("unreachable", f"{where}: {e.strerror or e}", "check the address and routing")
    if isinstance(e, paramiko.SSHException):
        text = str(e)
        if "banner" in text.lower() or "reset" in text.lower():
            return HostError("unreachable", f"{where}: {text}", f"sshd on {host.name} dropped the connection")
        return HostError("ssh_error", f"{where}: {text}", "run with plain ssh -v to see the negotiation")
    return HostError("ssh_error", f"{where}: {type(e).__name__}: {e}", "run with plain ssh -v to see more")
