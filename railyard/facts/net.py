"""Network facts: the rail's link, addresses, routes, RoCE GIDs, error counters, jumbo pings, ssh and TCP
ports between the hosts. Each fact's command (the `Section` a probe script runs) beside its pure parser.

Each parser is tested on real captured output in tests/fixtures/real/.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from . import ParseError
from .probe import Section, fan_out
from ..inventory import Host
from ..plan.spec import Dial
from ..transport import Sh, cmd, q


# ---------------------------------------------------------------- ibdev2netdev

def ib_hca_device(setting: str) -> str:
    """The first device an NCCL_IB_HCA value names: `=mlx5_1:1,mlx5_2` -> `mlx5_1`."""
    return setting.lstrip("=^").split(",")[0].split(":")[0]


def ibdev2netdev_section() -> Section:
    return Section("ibdev2netdev", cmd("ibdev2netdev"), "ibdev2netdev")


@dataclass(frozen=True)
class IbDevMap:
    hca: str
    port: int
    netdev: str
    up: bool
    line: str


_IBDEV_RE = re.compile(r"^\s*(\S+) port (\d+) ==> (\S+) \((\w+)\)\s*$")


def parse_ibdev2netdev(text: str) -> list[IbDevMap]:
    """`mlx5_1 port 1 ==> cx8r1 (Up)` per line."""
    out = []
    for line in text.splitlines():
        m = _IBDEV_RE.match(line)
        if m:
            out.append(IbDevMap(m[1], int(m[2]), m[3], m[4] == "Up", line.strip()))
    return out


# ---------------------------------------------------------------- ip

def ip_addr_section() -> Section:
    return Section("ip_addr", cmd("ip", "-br", "addr", "show"), "ip")


def ip_link_section() -> Section:
    return Section("ip_link", cmd("ip", "-o", "link", "show"), "ip")


def route_section(peer_ips: list[str]) -> Section:
    """One `ip route get` per peer rail address, in one `ip -batch`."""
    return Section("route", Sh(cmd("printf", "route get %s\\n", *peer_ips) + " | ip -o -force -batch -"), "ip")


@dataclass(frozen=True)
class IfAddr:
    name: str
    state: str
    ipv4: list[str]  # "198.18.101.11/24"
    line: str


def _ifname(raw: str) -> str:
    # veth ends show as `cx8r1@if13`; real NICs as plain names
    return raw.split("@", 1)[0].rstrip(":")


def parse_ip_br_addr(text: str) -> dict[str, IfAddr]:
    """`ip -br addr`: `cx8r1            UP             192.168.101.1/24 fe80::1/64`."""
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 2:
            continue
        name = _ifname(parts[0])
        v4 = [p for p in parts[2:] if re.match(r"^\d+\.\d+\.\d+\.\d+/\d+$", p)]
        out[name] = IfAddr(name, parts[1], v4, " ".join(parts[:2] + v4))
    return out


@dataclass(frozen=True)
class Link:
    name: str
    mtu: int
    flags: tuple[str, ...]
    state: str
    line: str

    @property
    def up(self) -> bool:
        return "UP" in self.flags and "LOWER_UP" in self.flags


_LINK_RE = re.compile(r"^\d+:\s+(\S+?):\s+<([^>]*)>.*?\bmtu (\d+)(?:.*?\bstate (\S+))?")


def parse_ip_link(text: str) -> dict[str, Link]:
    """`ip -o link show`: `3: cx8r1@if13: <BROADCAST,MULTICAST,UP,LOWER_UP> mtu 9000 ... state UP ...`."""
    out = {}
    for line in text.splitlines():
        m = _LINK_RE.match(line)
        if m:
            name = _ifname(m[1])
            short = re.sub(r"\s+(qdisc|mode|group|qlen)\s+\S+", "", line.split("\\")[0]).strip()
            out[name] = Link(name, int(m[3]), tuple(m[2].split(",")), m[4] or "UNKNOWN", short)
    return out


@dataclass(frozen=True)
class Route:
    dest: str
    dev: str | None
    src: str | None
    via: str | None
    line: str


ROUTE_TYPES = {"local", "broadcast", "unicast", "unreachable", "prohibit", "blackhole", "multicast", "anycast", "throw"}


def parse_route_get(text: str) -> list[Route]:
    """`ip -o route get X` lines: `198.18.101.12 dev cx8r1 src 198.18.101.11 uid 0 \\    cache`."""
    out = []
    for line in text.splitlines():
        parts = line.replace("\\", " ").split()
        if parts and parts[0] in ROUTE_TYPES:
            parts = parts[1:]
        if not parts or not re.match(r"^\d+\.\d+\.\d+\.\d+$", parts[0]):
            continue

        def after(word):
            return parts[parts.index(word) + 1] if word in parts[:-1] else None

        out.append(Route(parts[0], after("dev"), after("src"), after("via"), " ".join(line.split("\\")[0].split())))
    return out


# ---------------------------------------------------------------- ethtool

def ethtool_section(rail: str) -> Section:
    return Section("ethtool", cmd("ethtool", rail), "ethtool")


def rail_speeds_section() -> Section:
    """`ethtool` of every netdev ibdev2netdev maps an HCA to (a host's rails before any inventory names them), each
    an `@@peer NETDEV rc=N` block (probe.split_blocks; parse_ethtool per block)."""
    return Section("ethtool", Sh("for d in $(ibdev2netdev 2>/dev/null | awk '{print $5}' | sort -u); do "
                                 "o=$(ethtool \"$d\" 2>&1); printf '@@peer %s rc=%s\\n%s\\n' \"$d\" \"$?\" \"$o\"; done"),
                   "ethtool")


@dataclass(frozen=True)
class Ethtool:
    speed_mbps: int | None
    speed_text: str | None
    link_detected: bool | None


def parse_ethtool(text: str) -> Ethtool:
    """`Speed: 400000Mb/s` / `Speed: Unknown!` and `Link detected: yes|no`."""
    speed = speed_text = link = None
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("Speed:"):
            speed_text = s.split(":", 1)[1].strip()
            m = re.match(r"(\d+)\s*Mb/s", speed_text)
            speed = int(m[1]) if m else None
        elif s.startswith("Link detected:"):
            link = s.split(":", 1)[1].strip() == "yes"
    return Ethtool(speed, speed_text, link)


# ---------------------------------------------------------------- rail error counters: ethtool -S, else sysfs

RAIL_ERROR_COUNTERS = re.compile(r"(symbol_err|crc_err|link_down_events|discards|_errors_phy|fec_uncorrect|"
                                 r"out_of_buffer|rx_err_lane|excessive_buffer_overrun)")


# the kernel's own counters, read where `ethtool -S` is missing or shows none of RAIL_ERROR_COUNTERS: the netdev's
# (every driver has them) and the RDMA port's (an HCA's IB counters; absent on a host without one)
SYSFS_NET_COUNTERS = ("rx_errors", "tx_errors", "rx_dropped", "tx_dropped", "rx_crc_errors", "rx_frame_errors",
                      "rx_fifo_errors", "rx_missed_errors", "rx_over_errors", "tx_carrier_errors", "tx_fifo_errors")


SYSFS_IB_COUNTERS = ("symbol_error", "link_downed", "link_error_recovery", "port_rcv_errors",
                     "port_rcv_remote_physical_errors", "port_xmit_discards", "local_link_integrity_errors",
                     "excessive_buffer_overrun_errors")


def counters_script(rail: str, hca: str) -> str:
    """One read of the rail's error counters: `ethtool -S` filtered to RAIL_ERROR_COUNTERS after `@@source ethtool`,
    or, where that shows none, `@@source sysfs` and, after `@@dir DIR`, the kernel's counters in DIR as `grep -H`
    prints them (`name:value`)."""
    net = f"/sys/class/net/{rail}/statistics"
    ib = f"/sys/class/infiniband/{hca}/ports/1/counters"
    return (f"o=$(ethtool -S {q(rail)} 2>/dev/null | grep -E {q(RAIL_ERROR_COUNTERS.pattern)}); "
            "if [ -n \"$o\" ]; then echo '@@source ethtool'; printf '%s\\n' \"$o\"; "
            "else echo '@@source sysfs'; "
            f"echo {q('@@dir ' + net)}; (cd {q(net)} 2>/dev/null && grep -H . {' '.join(SYSFS_NET_COUNTERS)} 2>/dev/null); "
            f"echo {q('@@dir ' + ib)}; (cd {q(ib)} 2>/dev/null && grep -H . {' '.join(SYSFS_IB_COUNTERS)} 2>/dev/null); fi")


def parse_ethtool_stats(text: str) -> dict[str, int]:
    """`ethtool -S IFACE`: `     name: value` lines (the `NIC statistics:` header is skipped)."""
    out = {}
    for raw in text.splitlines():
        k, sep, v = raw.strip().partition(": ")
        if sep and v.strip().lstrip("-").isdigit():
            out[k] = int(v)
    return out


def parse_rail_counters(text: str) -> tuple[str, dict[str, int]]:
    """One read of preflight's rail counters: after `@@source ethtool`, `ethtool -S` lines filtered to
    RAIL_ERROR_COUNTERS; after `@@source sysfs`, per `@@dir DIR`, the kernel's counters as `grep -H . NAME...`
    prints them in DIR (`rx_errors:0`; tests/fixtures/real/sysfs-counters/), every one an error or drop counter.
    Returns (where they were read: only the directories that gave a counter, {name: value}); text without a
    source line is `ethtool -S`."""
    lines = text.splitlines()
    head = next((line.strip() for line in lines if line.startswith("@@source ")), "@@source ethtool")
    if head.startswith("@@source sysfs"):
        out, read, where = {}, [], None
        for raw in lines:
            if raw.startswith("@@dir "):
                where = raw[6:].strip()
                continue
            k, sep, v = raw.strip().rpartition(":")
            if sep and k and not k.startswith("@@") and v.strip().isdigit():
                out[k.rsplit("/", 1)[-1]] = int(v)
                if where and where not in read:
                    read.append(where)
        return "sysfs " + ", ".join(read), out
    return "ethtool -S", {k: v for k, v in parse_ethtool_stats(text).items() if RAIL_ERROR_COUNTERS.search(k)}


# ---------------------------------------------------------------- ping

JUMBO_MARK = "@@jumbo"


def ping_section(rail: str, peer_ips: list[str], mtu: int, count: int) -> Section:
    """Per peer rail address, from `rail`: one small ping, JUMBO_MARK, then `count` unfragmented pings of an
    mtu-sized frame."""
    size = mtu - 28
    deadline = int(count * 0.2 + 3)
    # a small ping per peer first: it resolves the neighbour entry before the jumbo frames, and tells "small
    # frames pass" from "nothing passes" (an MTU black hole vs a dead path: checks.parity.one_cause)
    pings = fan_out([(ip, Sh(cmd("ping", "-I", rail, "-c", "1", "-W", "1", ip)
                             + f"; echo {q(JUMBO_MARK)}; "
                             + cmd("ping", "-I", rail, "-M", "do", "-s", size, "-c", count,
                                   "-i", "0.2", "-W", "2", ip)))
                     for ip in peer_ips])
    return Section("ping", pings, "ping", deadline + 6)


@dataclass(frozen=True)
class Ping:
    transmitted: int
    received: int
    errors: int
    loss_pct: float
    rtt_avg_ms: float | None
    local_errors: list[str] = field(default_factory=list)
    summary: str = ""


def parse_ping(text: str) -> Ping:
    """iputils summary `3 packets transmitted, 3 received, [+3 errors, ]0% packet loss, time 2003ms`."""
    tx = rx = err = 0
    loss = 100.0
    avg = None
    summary = ""
    local = []
    found = False
    for line in text.splitlines():
        s = line.strip()
        m = re.match(r"(\d+) packets transmitted, (\d+) (?:packets )?received,(?: \+(\d+) errors,)?"
                     r"(?: \+\d+ duplicates,)? ([\d.]+)% packet loss", s)
        if m:
            found = True
            tx, rx, err, loss = int(m[1]), int(m[2]), int(m[3] or 0), float(m[4])
            summary = s
            continue
        m = re.match(r"(?:rtt|round-trip) min/avg/max(?:/mdev|/stddev)? = [\d.]+/([\d.]+)/", s)
        if m:
            avg = float(m[1])
        elif "error" in s.lower() or "too long" in s.lower() or s.startswith("ping:") or "Frag needed" in s:
            if s not in local:
                local.append(s)
    if not found:
        raise ParseError("no ping statistics line")
    return Ping(tx, rx, err, loss, avg, local, summary)


def ping_pair(text: str) -> tuple[str | None, str]:
    """A peer's block: the small warm-up ping, the marker, the jumbo ping (an older block is all jumbo)."""
    if JUMBO_MARK in text:
        small, _, jumbo = text.partition(JUMBO_MARK)
        return small, jumbo
    return None, text


# ---------------------------------------------------------------- show_gids

def gids_section(hca: str) -> Section:
    return Section("gids", cmd("show_gids", hca), "show_gids")


@dataclass(frozen=True)
class RoceGid:
    dev: str
    port: int
    index: int
    gid: str
    ipv4: str | None
    ver: str
    netdev: str | None


_GID_RE = re.compile(r"^[0-9a-fA-F]{4}(:[0-9a-fA-F]{4}){7}$")


def parse_show_gids(text: str) -> list[RoceGid]:
    """Rows `DEV PORT INDEX GID [IPv4] VER [DEV]`, tab or space separated, maybe indented."""
    out = []
    for line in text.splitlines():
        parts = line.split()
        # find the GID column; what precedes it may be indentation or a comment marker
        j = next((i for i, p in enumerate(parts) if i >= 3 and _GID_RE.match(p)), None)
        if j is None or not parts[j - 2].isdigit() or not parts[j - 1].isdigit():
            continue
        rest = parts[j + 1:]
        ipv4 = None
        if rest and re.match(r"^\d+\.\d+\.\d+\.\d+$", rest[0]):
            ipv4, rest = rest[0], rest[1:]
        if not rest or rest[0] not in ("v1", "v2"):
            continue
        netdev = rest[1] if len(rest) > 1 else None
        out.append(RoceGid(parts[j - 3], int(parts[j - 2]), int(parts[j - 1]), parts[j].lower(), ipv4, rest[0], netdev))
    return out


def roce_v2_index(gids: list[RoceGid], hca: str, ipv4: str) -> int | None:
    """The GID index NCCL_IB_GID_INDEX needs: RoCE v2, this HCA, this IPv4. Never assumed."""
    for g in gids:
        if g.dev == hca and g.ipv4 == ipv4 and g.ver == "v2":
            return g.index
    return None


# ---------------------------------------------------------------- ssh from one host to the others

SSH_PEER_HANG_S = 8  # each ssh gets its own limit, so one that hangs (e.g. on an MTU black hole) is named alone


# OpenSSH 9's default key exchange (sntrup761x25519) cost the head 66 ms of CPU per connection here, curve25519
# 8 ms: N-1 of them at once on the head. Where the head's ssh takes a '^' list (OpenSSH >= 8.7; `ssh -G` only
# parses) curve25519 goes first, the defaults after it for a server that lacks it; else the defaults alone.
KEX_FIRST = "KexAlgorithms=^curve25519-sha256"


def ssh_peer_section(targets: list[Host], hang_s: int = SSH_PEER_HANG_S) -> Section:
    """From one host, a non-interactive ssh to each target's rail address, host keys checked."""
    detect = Sh(f"k=; ssh -G -o {q(KEX_FIRST)} railyard-probe >/dev/null 2>&1 && k={q(KEX_FIRST)}\n")
    return Section("ssh_peer", Sh(detect + fan_out([
        (t.serve_rail.ip, Sh(cmd("timeout", hang_s, "ssh", "-n") + ' ${k:+-o "$k"} '
                             + cmd("-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes",
                                   "-o", f"ConnectTimeout={hang_s - 3}",
                                   *(["-l", t.user] if t.user else []), t.serve_rail.ip, "hostname")))
        for t in targets])), "ssh", hang_s + 7)


# ---------------------------------------------------------------- TCP ports between the hosts

PORT_WAIT_S = 4  # a dial is tried again for this long while refused or unanswered (its listener starts with it)


PORT_LISTEN_MORE_S = 2  # a listener waits this much longer for its dialers (it ends once every one came)


PORT_SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "port_probe.py"


def port_probe(wait: float, listen: list[tuple[str, int, int]], dial: list[tuple[str, int]]) -> Sh:
    """scripts/port_probe.py on the host's python3: listen on each (address, port) until its n peers came,
    dial each (address, port) for up to `wait` s."""
    args: list = [wait, PORT_LISTEN_MORE_S]
    for addr, port, n in listen:
        args += ["listen", addr, port, n]
    for addr, port in dial:
        args += ["dial", addr, port]
    return cmd("python3", "-c", PORT_SCRIPT.read_text(), *args)


def ports_section(host: Host, dials: list[Dial]) -> Section | None:
    """This host's part of the port check: a listener for each address and port the others dial on it, and
    its own dials; None when it has neither. Run on every host concerned at once, in a round of its own
    after the probes (both ends connected already, so each listener is up within the dialers' retries)."""
    peers: dict[tuple[str, int], set[str]] = {}
    for d in dials:
        if d.dst == host.name:
            peers.setdefault((d.address, d.port), set()).add(d.src)
    mine = list(dict.fromkeys((d.address, d.port) for d in dials if d.src == host.name))
    if not peers and not mine:
        return None
    return Section("ports", port_probe(PORT_WAIT_S, [(a, p, len(n)) for (a, p), n in peers.items()], mine),
                   "python3", PORT_WAIT_S + PORT_LISTEN_MORE_S + 8)


@dataclass(frozen=True)
class PortLine:
    """One line of scripts/port_probe.py: a listener's or a dial's outcome, its times on that host's clock."""
    status: str
    detail: str  # a listener: the peers that connected; a dial: its tries
    start: float
    end: float


def parse_port_probe(text: str) -> tuple[dict[tuple[str, int], PortLine], dict[tuple[str, int], PortLine]]:
    """`listen|dial ADDR PORT STATUS DETAIL START END` lines -> (listeners, dials), by (address, port)."""
    listens: dict[tuple[str, int], PortLine] = {}
    dials: dict[tuple[str, int], PortLine] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) != 7 or parts[0] not in ("listen", "dial") or not parts[2].isdigit():
            continue
        try:
            item = PortLine(parts[3], parts[4], float(parts[5]), float(parts[6]))
        except ValueError:
            continue
        (listens if parts[0] == "listen" else dials)[(parts[1], int(parts[2]))] = item
    return listens, dials
