"""`railyard discover`: an inventory read from the hosts. Every host at once, one SSH connection and one round
trip each (host keys checked, as everywhere in railyard: railyard.transport), reading the facts of
railyard.facts (ibdev2netdev, ip addr, show_gids, ethtool of each rail netdev, nvidia-smi's GPU rows and
topology); then railyard.discover decides the rails, the serving rail and the GPUs, and renders the inventory,
which is loaded and validated as `preflight` loads it before a byte is written.

Exit codes: 0 written (or, with --dry-run, printed); 1 a host unreachable or something not decided (one line
each, nothing written); 2 usage error (a flag, a --set value, an --out that exists), before any host is touched.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from .. import discover as pure
from ..checks import FAIL, PASS, WARN, CheckResult
from ..errors import InventoryError, UsageError
from ..facts.gpu import gpus_section, topo_section
from ..facts.net import ibdev2netdev_section, ip_addr_section, rail_speeds_section
from ..facts.probe import Section, joined_script, new_token, split_output
from ..inventory import Host, load_inventory, parse_overrides
from ..inventory.rules import HOST_ONLY_KEYS, NAME_RE
from ..inventory.vars import merge_vars, role_layers
from ..report import NO_HOST, Report
from ..transport import Session, cmd
from ..transport.runner import Runner

PATH_KEYS = ("ssh_known_hosts", "ansible_ssh_private_key_file")  # written absolute: the inventory may live elsewhere


def sections() -> list[Section]:
    return [Section("hostname", cmd("hostname")), ibdev2netdev_section(), ip_addr_section(),
            Section("gids", cmd("show_gids"), "show_gids"), rail_speeds_section(), gpus_section(), topo_section()]


@dataclass
class Discovery:
    found: pure.Found | None
    text: str | None            # the inventory (None: not decided)
    out: Path | None            # where it was written (None: dry run or nothing written)
    problems: list[str] = field(default_factory=list)

    def report(self) -> Report:
        checks = [CheckResult(NO_HOST, "discover", FAIL, p) for p in self.problems]
        f = self.found
        if f is not None:
            checks += [CheckResult(NO_HOST, "note", WARN, n) for n in f.notes]
            if f.serve is not None:
                checks.append(CheckResult(NO_HOST, "serve_rail", PASS, f.why))
        data: dict = {"inventory": self.text, "out": str(self.out) if self.out else None}
        if f is not None:
            data.update({
                "hosts": [{"name": h.name, "address": h.address, "hostname": h.hostname} for h in f.hosts],
                "rails": [{"subnet": str(r.subnet), "name": r.name, "speed_mbps": r.speed_mbps,
                           "members": {h: {"netdev": m.netdev, "hca": m.hca, "ipv4": str(m.ipv4),
                                           "speed_mbps": m.speed_mbps} for h, m in r.members.items()}}
                          for r in f.rails],
                "serve_rail": f.serve.name if f.serve else None, "why": f.why, "layout": f.layout,
                "gpu": {"name": f.gpu_name, "model": f.gpu_model, "count": f.gpu_count}})
        return Report(checks, data)


def overrides_of(pairs: list[str] | None) -> dict:
    """The --set values, checked as an inventory's would be (a known variable, not a per-host key); paths
    absolute."""
    values = parse_overrides(pairs).values
    known = {k for layer in role_layers() for k in layer.values}
    for k in values:
        if k in HOST_ONLY_KEYS:
            raise UsageError(f"--set {k}: is per host: discover writes it from what the hosts say")
        if k not in known:
            raise UsageError(f"--set {k}: unknown variable")
    for k in PATH_KEYS:
        if values.get(k):
            values[k] = str(Path(str(values[k])).expanduser().absolute())
    return values


def hosts_of(spec: str, user: str | None, overrides: dict) -> list[Host]:
    """Host objects to connect to, from `--hosts A,B`: their variables the role defaults under --set."""
    addresses = [a.strip() for a in (spec or "").split(",") if a.strip()]
    if not addresses:
        raise UsageError("--hosts: the hosts to read, comma-separated addresses or names (the first is the head)")
    if len(set(addresses)) != len(addresses):
        raise UsageError(f"--hosts {spec}: a host given twice")
    for a in addresses:
        if not NAME_RE.match(a):
            raise UsageError(f"--hosts: {a!r} is not a host name or IPv4 address")
    values, _ = merge_vars(role_layers() + [parse_overrides([])])
    values.update(overrides)
    if user:
        values["ansible_user"] = user
    return [Host(name=a, rank=i, address=a, port=int(values["ansible_port"]), user=str(values["ansible_user"] or ""),
                 connection="ssh", key_file=str(values["ansible_ssh_private_key_file"] or ""), rails={},
                 vars=dict(values)) for i, a in enumerate(addresses)]


def read(s: Session) -> pure.HostRead:
    """One host's facts in one round trip."""
    secs = sections()
    token = new_token()
    r = s.run(joined_script(secs, token), timeout=60)
    if r.error:
        h = pure.HostRead(s.host.address)
        h.problems.append(f"{s.host.address}: {r.error.kind}: {r.error.message} (fix: {_fix(r.error, s.host)})")
        return h
    return pure.read_host(s.host.address, split_output(r.stdout, secs, token))


def _fix(error, host: Host) -> str:
    if error.kind == "host_key_unknown":  # trust-hosts needs an inventory, which is what is being made
        kh = host.vars.get("ssh_known_hosts") or "~/.ssh/known_hosts"
        return (f"compare {error.fingerprint} with the host's own (ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub "
                f"on its console), then record it: ssh-keyscan -p {host.port} {host.address} >> {kh}")
    return error.hint


def discover(spec: str, user: str | None = None, set_: list[str] | None = None, out: str | None = "inventory.yml",
             dry_run: bool = False, command: str = "railyard discover") -> Discovery:
    overrides = overrides_of(set_)
    target = Path(out or "inventory.yml")
    if not dry_run and target.exists():
        raise UsageError(f"--out {target}: exists; discover never overwrites an inventory (another --out, or "
                         "remove it)")
    hosts = hosts_of(spec, user, overrides)
    with Runner(hosts) as runner:
        got = runner.each(read)
    reads = [got.ok[h.name] if h.name in got.ok else _failed(h, got.failed[h.name]) for h in hosts]
    conn = {k: overrides[k] for k in ("ansible_user",) if k in overrides}
    if user:
        conn["ansible_user"] = user
    found = pure.decide(reads, overrides)
    if found.problems:
        return Discovery(found, None, None, list(found.problems))
    text = pure.render(found, command, {**overrides, **conn})
    problems = _validate(text, target)
    if problems:
        return Discovery(found, text, None, problems)
    if dry_run:
        return Discovery(found, text, None)
    _write(target, text)
    return Discovery(found, text, target)


def _failed(h: Host, r) -> pure.HostRead:
    read_ = pure.HostRead(h.address)
    read_.problems.append(f"{h.address}: {r.error}")
    return read_


def _validate(text: str, target: Path) -> list[str]:
    """The inventory loaded as preflight loads it, from beside where it goes (its relative paths resolve there)."""
    from .. import layouts  # noqa: F401  (imported for its registrations: serve_layout is checked against them)
    where = target.absolute().parent
    if not where.is_dir():
        return [f"--out {target}: no folder {where}"]
    fd, tmp = tempfile.mkstemp(prefix=".discover-", suffix=".yml", dir=where)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        load_inventory(tmp)
    except InventoryError as e:
        return [f"the inventory would not load: {p}" for p in e.problems]
    finally:
        os.unlink(tmp)
    return []


def _write(target: Path, text: str) -> None:
    tmp = target.with_name(f".{target.name}.railyard.tmp")
    tmp.write_text(text)
    tmp.replace(target)
