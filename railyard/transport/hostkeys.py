"""`inv trust-hosts`: show each host's SSH host key fingerprint; record it only when asked.

Never trust on first use silently: unknown keys are shown and recorded with --accept,
changed keys only with --replace.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Mapping

import paramiko
from paramiko.hostkeys import HostKeys

from ..inventory import Host
from . import fingerprint, host_key_name, known_hosts_path
from .runner import Runner


@dataclass(frozen=True)
class KeyStatus:
    host: str
    name: str  # how known_hosts names it
    key: paramiko.PKey | None
    status: Literal["known", "unknown", "changed", "unreachable"]
    detail: str
    known_file: Path

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.key) if self.key else ""


def _known(path: Path) -> HostKeys:
    keys = HostKeys()
    if path.is_file():
        keys.load(str(path))
    return keys


def scan(host: Host, timeout: float = 10) -> KeyStatus:
    """Fetch the host key over a bare SSH handshake (no authentication) and compare."""
    path = known_hosts_path(host)
    name = host_key_name(host)
    try:
        known = _known(path)
    except (OSError, paramiko.SSHException) as e:
        return KeyStatus(host.name, name, None, "unreachable", f"cannot read {path}: {e}", path)
    recorded: Mapping[str, paramiko.PKey] = known.lookup(name) or {}
    try:
        sock = socket.create_connection((host.address, host.port), timeout=timeout)
    except OSError as e:
        return KeyStatus(host.name, name, None, "unreachable", f"{host.address}:{host.port}: {e.strerror or e}", path)
    t = paramiko.Transport(sock)
    try:
        if recorded:
            opts = t.get_security_options()
            first = [k for k in recorded.keys() if k in opts.key_types]
            opts.key_types = first + [k for k in opts.key_types if k not in first]
        t.start_client(timeout=timeout)
        key = t.get_remote_server_key()
    except (paramiko.SSHException, OSError, EOFError) as e:
        return KeyStatus(host.name, name, None, "unreachable", f"SSH handshake failed: {e}", path)
    finally:
        t.close()
    if key.get_name() in recorded:
        if recorded[key.get_name()] == key:
            return KeyStatus(host.name, name, key, "known", f"matches {path}", path)
        return KeyStatus(host.name, name, key, "changed",
                         f"{path} records {fingerprint(recorded[key.get_name()])}", path)
    return KeyStatus(host.name, name, key, "unknown", f"not in {path}", path)


def scan_all(hosts: list[Host]) -> list[KeyStatus]:
    ssh_hosts = [h for h in hosts if not h.is_local]
    if not ssh_hosts:
        return []
    with Runner(ssh_hosts) as runner:  # its bounded fan-out only: the sessions stay unopened (scan is a bare handshake)
        got = runner.each(lambda s: scan(s.host))
    return [got.ok[h.name] if h.name in got.ok
            else KeyStatus(h.name, host_key_name(h), None, "unreachable", str(got.failed[h.name].error),
                           known_hosts_path(h))
            for h in ssh_hosts]


def record(st: KeyStatus) -> None:
    """Write the key into known_hosts: append, or replace the old key of that type for that name."""
    if st.key is None:
        raise ValueError(f"{st.host}: no host key to record ({st.status})")
    key = st.key
    path = st.known_file
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = path.read_text().splitlines() if path.exists() else []
    kept = []
    for line in lines:
        fields = line.split()
        if len(fields) >= 3 and not line.lstrip().startswith("#") and fields[1] == key.get_name() \
                and _names_match(fields[0], st.name):
            continue
        kept.append(line)
    kept.append(f"{st.name} {key.get_name()} {key.get_base64()}")
    tmp = path.with_name(path.name + ".railyard.tmp")
    tmp.write_text("\n".join(kept) + "\n")
    tmp.chmod(0o644)
    tmp.replace(path)


def _names_match(field: str, name: str) -> bool:
    for entry in field.split(","):
        if entry.startswith("|1|"):
            try:
                if HostKeys.hash_host(name, entry) == entry:
                    return True
            except Exception:
                continue
        elif entry == name:
            return True
    return False
