"""Pure parsers: tool output text -> typed values. No I/O here.

Each is tested on real captured output in tests/fixtures/real/.
"""

from __future__ import annotations

import csv
import io
import json
import re
from dataclasses import dataclass, field
from typing import Any


class ParseError(ValueError):
    """The text is not what the tool prints."""


# ---------------------------------------------------------------- ibdev2netdev

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


# ---------------------------------------------------------------- ping

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


# ---------------------------------------------------------------- show_gids

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


# ---------------------------------------------------------------- timedatectl

@dataclass(frozen=True)
class NtpStatus:
    synchronized: bool | None
    service: str | None  # active / inactive / n/a, or NTP=yes/no from `show`
    line: str


def parse_timedatectl(text: str) -> NtpStatus:
    """`timedatectl show` (NTPSynchronized=yes) or the human layouts, modern and legacy."""
    synced = service = None
    line = ""
    for raw in text.splitlines():
        s = raw.strip()
        if "=" in s and ":" not in s.split("=", 1)[0]:
            k, v = s.split("=", 1)
            if k == "NTPSynchronized":
                synced, line = v.strip() == "yes", s
            elif k == "NTP":
                service = "active" if v.strip() == "yes" else "inactive"
            continue
        if ":" not in s:
            continue
        k, v = (x.strip() for x in s.split(":", 1))
        if k in ("System clock synchronized", "NTP synchronized"):
            synced, line = v == "yes", s
        elif k in ("NTP service", "NTP enabled", "Network time on", "systemd-timesyncd.service active"):
            service = v.lower()
    return NtpStatus(synced, service, line)


# ---------------------------------------------------------------- nvidia-smi

@dataclass(frozen=True)
class Gpu:
    index: int
    uuid: str
    name: str
    memory_used_mib: int
    memory_total_mib: int


def _csv_rows(text: str) -> list[list[str]]:
    rows = []
    for row in csv.reader(io.StringIO(text), skipinitialspace=True):
        if row and any(c.strip() for c in row):
            rows.append([c.strip() for c in row])
    return rows


def _mib(v: str) -> int:
    v = v.replace("MiB", "").strip()
    return int(v) if v.isdigit() else 0


def parse_gpus(text: str) -> list[Gpu]:
    """`--query-gpu=index,uuid,name,memory.used,memory.total --format=csv,noheader,nounits`."""
    out = []
    for row in _csv_rows(text):
        if len(row) != 5 or not row[0].isdigit():
            if row and row[0] == "index":
                continue  # a header line
            raise ParseError(f"unexpected nvidia-smi row: {', '.join(row)}")
        out.append(Gpu(int(row[0]), row[1], row[2], _mib(row[3]), _mib(row[4])))
    return out


@dataclass(frozen=True)
class GpuProcess:
    gpu_uuid: str
    pid: int
    name: str
    used_mib: int


def parse_compute_apps(text: str) -> list[GpuProcess]:
    """`--query-compute-apps=gpu_uuid,pid,process_name,used_memory --format=csv,noheader,nounits`; empty when idle."""
    out = []
    for row in _csv_rows(text):
        if row[0] == "gpu_uuid":
            continue
        if len(row) != 4 or not row[1].isdigit():
            raise ParseError(f"unexpected nvidia-smi row: {', '.join(row)}")
        out.append(GpuProcess(row[0], int(row[1]), row[2], _mib(row[3])))
    return out


def select_gpu(gpus: list[Gpu], selector: str) -> list[Gpu]:
    """GPUs whose name contains the selector, case-insensitively (`GB300` never matches `RTX PRO`)."""
    return [g for g in gpus if selector.lower() in g.name.lower()]


# ---------------------------------------------------------------- df / du

@dataclass(frozen=True)
class DiskFree:
    filesystem: str
    size: int
    used: int
    avail: int
    mount: str


def parse_df(text: str) -> DiskFree:
    """`df -P -B1 PATH`: a header, then `fs size used avail cap% mount`."""
    lines = [line for line in text.splitlines() if line.strip()]
    for line in lines[1:]:
        parts = line.split()
        if len(parts) >= 6 and parts[1].isdigit():
            return DiskFree(parts[0], int(parts[1]), int(parts[2]), int(parts[3]), " ".join(parts[5:]))
    raise ParseError("no df row")


def parse_du(text: str) -> int | None:
    """`du -sb PATH` -> bytes."""
    for line in text.splitlines():
        parts = line.split()
        if parts and parts[0].isdigit():
            return int(parts[0])
    return None


# ---------------------------------------------------------------- docker

@dataclass(frozen=True)
class DockerVersion:
    client: str | None
    server: str | None
    error: str | None


def parse_docker_version(text: str) -> DockerVersion:
    """`docker version`: a Client section, then a Server section only when the daemon answered."""
    client = server = err = None
    section = None
    for line in text.splitlines():
        if line.startswith("Client"):
            section = "client"
        elif line.startswith("Server"):
            section = "server"
        elif line.strip().startswith("Version:"):
            v = line.split(":", 1)[1].strip()
            if section == "client" and client is None:
                client = v
            elif section == "server" and server is None:
                server = v
        elif ("Cannot connect to the Docker daemon" in line or "permission denied" in line
              or "Error response from daemon" in line or line.startswith("error during connect")):
            err = line.strip()
    return DockerVersion(client, server, err)


@dataclass(frozen=True)
class DockerImage:
    id: str
    repo_digests: list[str]
    repo_tags: list[str]
    architecture: str
    os: str
    env: tuple[str, ...] = ()  # Config.Env, `KEY=value`

    def env_value(self, key: str) -> str | None:
        return next((e.split("=", 1)[1] for e in self.env if e.split("=", 1)[0] == key and "=" in e), None)

    def digests(self) -> set[str]:
        return {d.split("@", 1)[1] for d in self.repo_digests if "@" in d}


def parse_image_inspect(text: str) -> list[DockerImage]:
    """`docker image inspect REF [REF...]`: one JSON array of the refs found, in order (`[]` when none; the
    CLI prints `Error response from daemon: No such image: REF` on stderr for each one missing, exit 1)."""
    start = text.find("[")
    if start < 0:
        raise ParseError("no JSON array")
    try:
        docs, _ = json.JSONDecoder().raw_decode(text[start:])
    except ValueError as e:
        raise ParseError(f"bad JSON: {e}") from None
    return [DockerImage(d.get("Id", ""), d.get("RepoDigests") or [], d.get("RepoTags") or [],
                        d.get("Architecture", ""), d.get("Os", ""), tuple((d.get("Config") or {}).get("Env") or ()))
            for d in docs]


# ================================================================ topology: nvidia-smi topo -m, lscpu
# (GPU <-> CPU/NUMA affinity and GPU <-> NIC distance, for placing ranks on multi-socket hosts)

@dataclass(frozen=True)
class GpuTopo:
    index: int
    cpu_affinity: str            # as printed: "0-55,112-167" (empty when nvidia-smi prints none)
    numa_affinity: int | None    # None for N/A
    gpus: dict[int, str]         # other GPU index -> "NV18", "SYS", ...
    nics: dict[str, str]         # NIC name from the NIC legend ("mlx5_0"; "NIC0" without a legend) -> "PIX", ...
    line: str


_TOPO_TAIL = ("CPU Affinity", "NUMA Affinity", "GPU NUMA ID")


def _topo_header(line: str) -> list[str] | None:
    """The matrix header's column names: GPU0.. NIC0.. then the affinity columns."""
    if "GPU0" not in line or "CPU Affinity" not in line:
        return None
    if "\t" in line:
        return [c.strip() for c in line.split("\t") if c.strip()]
    # pasted with the tabs turned into spaces: the multi-word names come last
    cols = line.split()
    out, i = [], 0
    while i < len(cols):
        joined = next((t for t in _TOPO_TAIL if cols[i:i + len(t.split())] == t.split()), None)
        out.append(joined or cols[i])
        i += len(joined.split()) if joined else 1
    return out


def parse_topo_matrix(text: str) -> dict[int, GpuTopo]:
    """`nvidia-smi topo -m`: per GPU index, its CPU affinity (as printed), NUMA affinity, and its relation
    to every other GPU and to every NIC, the NICs named by the `NIC Legend` (NIC0: mlx5_0). Reads the real
    tab-separated layout (a GPU row has an empty cell before GPU NUMA ID) and copies whose tabs became
    spaces; a header without its leading tab too."""
    lines = text.splitlines()
    header = None
    for n, line in enumerate(lines):
        header = _topo_header(line)
        if header:
            break
    if not header:
        raise ParseError("no topology matrix header (GPU0 ... CPU Affinity)")
    gpu_cols = [c for c in header if re.fullmatch(r"GPU\d+", c)]
    nic_cols = [c for c in header if re.fullmatch(r"NIC\d+", c)]
    legend = {m[1]: m[2] for m in re.finditer(r"^\s*(NIC\d+):\s*(\S+)\s*$", text, re.M)}
    out: dict[int, GpuTopo] = {}
    for line in lines[n + 1:]:
        m = re.match(r"^\s*GPU(\d+)\b", line)
        if not m:
            if out and not line.strip():
                break
            continue
        cells = [c.strip() for c in line.split("\t")[1:]] if "\t" in line else line.split()[1:]
        rel = cells[:len(gpu_cols) + len(nic_cols)]
        rest = [c for c in cells[len(rel):] if c]
        if len(rel) < len(gpu_cols) + len(nic_cols):
            raise ParseError(f"short topology row: {line!r}")
        idx = int(m[1])
        cpu = rest[0] if rest and re.fullmatch(r"[\d,\-]+|N/A", rest[0]) else ""
        numa_s = rest[1] if len(rest) > 1 else (rest[0] if rest and not cpu else "N/A")
        out[idx] = GpuTopo(
            index=idx, cpu_affinity="" if cpu == "N/A" else cpu,
            numa_affinity=int(numa_s) if numa_s.isdigit() else None,
            gpus={int(c[3:]): v.strip() for c, v in zip(gpu_cols, rel) if int(c[3:]) != idx},
            nics={legend.get(c, c): v.strip() for c, v in zip(nic_cols, rel[len(gpu_cols):])},
            line=line)
    if not out:
        raise ParseError("topology matrix without GPU rows")
    return out


def parse_cpu_list(spec: str) -> list[int]:
    """A kernel CPU list, `0-55,112-167` -> [0, ..., 55, 112, ..., 167]; empty -> []."""
    out: list[int] = []
    for part in spec.strip().split(","):
        if not part:
            continue
        a, _, b = part.partition("-")
        if not a.isdigit() or (b and not b.isdigit()):
            raise ParseError(f"not a CPU list: {spec!r}")
        out.extend(range(int(a), int(b or a) + 1))
    return out


def parse_lscpu_numa(text: str) -> dict[int, list[int]]:
    """`lscpu`: NUMA node -> its CPU ids, from the `NUMA nodeN CPU(s):` lines (flat or indented output).
    A node without CPUs (a Grace-Hopper GPU's memory node) maps to []."""
    out = {}
    for m in re.finditer(r"^\s*NUMA node(\d+) CPU\(s\):[ \t]*(\S*)[ \t]*$", text, re.M):
        out[int(m[1])] = parse_cpu_list(m[2])
    return out


# ---------------------------------------------------------------- chrony

@dataclass(frozen=True)
class ChronyTracking:
    ref_id: str | None        # 8 hex digits; 00000000: no source; 7F7F0101: chrony's own `local` clock
    ref_name: str             # the name in brackets, often empty
    stratum: int | None
    offset_s: float | None    # system clock minus NTP time: `fast` positive, `slow` negative
    leap: str | None          # Normal / Not synchronised / Insert second / Delete second; None: no such line
    line: str                 # the Leap status line (or the Reference ID line) as evidence


_CHRONY_SYSTEM = re.compile(r"^([\d.]+) seconds (fast|slow) of NTP time$")


def parse_chrony_tracking(text: str) -> ChronyTracking:
    """`chronyc tracking`: `Key : value` lines (chrony 2.x to 4.x). `506 Cannot talk to daemon` has none."""
    kv: dict[str, str] = {}
    for raw in text.splitlines():
        k, sep, v = raw.partition(":")
        if sep and k.strip() and not k.startswith(" "):
            kv.setdefault(k.strip(), v.strip())
    if "Reference ID" not in kv and "Leap status" not in kv:
        raise ParseError(f"not chronyc tracking output: {text.strip()[:120]!r}")
    ref = kv.get("Reference ID", "")
    m = re.match(r"^([0-9A-Fa-f]{8})\s*\((.*)\)$", ref)
    ref_id, ref_name = (m.group(1).upper(), m.group(2)) if m else (ref.split()[0] if ref else None, "")
    st = kv.get("Stratum", "")
    off = None
    s = _CHRONY_SYSTEM.match(kv.get("System time", ""))
    if s:
        off = float(s.group(1)) * (1 if s.group(2) == "fast" else -1)
    leap = kv.get("Leap status")
    line = f"Leap status : {leap}" if leap is not None else f"Reference ID : {ref}"
    return ChronyTracking(ref_id, ref_name, int(st) if st.isdigit() else None, off, leap, line)


# ---------------------------------------------------------------- kernel log: NVIDIA Xid

@dataclass(frozen=True)
class Xid:
    pci: str      # the GPU's PCI address as the driver prints it: 0000:07:00
    code: int
    text: str     # the message after the code
    line: str


_XID = re.compile(r"NVRM: Xid \(PCI:([0-9A-Fa-f:.]+)\): (\d+), ?(.*)$")


def parse_xids(text: str) -> list[Xid]:
    """`NVRM: Xid (PCI:0000:07:00): 48, pid=..., name=..., message` lines of `dmesg` (any timestamp form) or
    `journalctl -k`/syslog; everything else is ignored."""
    out = []
    for raw in text.splitlines():
        m = _XID.search(raw)
        if m:
            out.append(Xid(m.group(1).lower(), int(m.group(2)), m.group(3).strip(), raw.strip()))
    return out


def pci_matches(xid_pci: str, bus_id: str) -> bool:
    """The driver's `0000:07:00` against nvidia-smi's `00000000:07:00.0`: same domain, bus and device."""
    def norm(p: str) -> tuple[int, ...]:
        parts = re.split(r"[:.]", p.lower())
        nums = [int(x, 16) for x in parts if x]
        return tuple(nums[:3])
    try:
        return norm(xid_pci) == norm(bus_id)
    except ValueError:
        return False


# ---------------------------------------------------------------- nvidia-smi -q -d PIDS

@dataclass(frozen=True)
class SmiProcess:
    gpu: int        # the GPU block's position: nvidia-smi's index order, as --query-gpu lists them
    bus_id: str     # the block's `GPU 00000000:07:00.0`
    pid: int
    type: str       # C, G, C+G, M+C ...
    name: str
    used: str       # `8710 MiB`, or `Not available`


@dataclass(frozen=True)
class SmiPids:
    driver: str | None
    cuda: str | None            # the driver's CUDA version (`CUDA Version : 13.0`)
    gpus: list[str]             # bus ids, in order
    procs: list[SmiProcess]


_SMI_KV = re.compile(r"^(\s*)([^:]+?)\s*:\s*(.*?)\s*$")


def parse_cuda_version(text: str) -> str | None:
    """The driver's CUDA version from nvidia-smi's table header (`CUDA Version: 12.8`), `-q` or `--version`
    (`CUDA Version : 13.0`); newer drivers' `CUDA UMD Version` too. None when not printed (or `N/A`)."""
    m = re.search(r"CUDA (?:UMD )?Version\s*:\s*([0-9][0-9.]*)", text)
    return m.group(1) if m else None


def parse_smi_pids(text: str) -> SmiPids:
    """`nvidia-smi -q -d PIDS`: the header (Driver Version, CUDA Version), then per GPU `GPU <bus id>` and its
    Processes (`: None` when idle; else per process `Process ID`, `Type`, `Name`, `Used GPU Memory`)."""
    driver = None
    gpus: list[str] = []
    procs: list[SmiProcess] = []
    cur: dict | None = None

    def flush():
        if cur and cur.get("pid", "").isdigit():
            procs.append(SmiProcess(len(gpus) - 1, gpus[-1], int(cur["pid"]), cur.get("type", ""),
                                    cur.get("name", ""), cur.get("used", "")))

    for raw in text.splitlines():
        m = re.match(r"^GPU ([0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.\d)\s*$", raw)
        if m:
            flush()
            cur = None
            gpus.append(m.group(1))
            continue
        kv = _SMI_KV.match(raw)
        if not kv:
            continue
        k, v = kv.group(2), kv.group(3)
        if not gpus:
            if k in ("Driver Version", "KMD Version"):
                driver = v
            continue
        if k == "GPU instance ID":  # each process record starts with it
            flush()
            cur = {}
        elif k == "Process ID":
            if cur is None or "pid" in cur:
                flush()
                cur = {}
            cur["pid"] = v
        elif cur is not None and k in ("Type", "Name", "Used GPU Memory"):
            cur[{"Type": "type", "Name": "name", "Used GPU Memory": "used"}[k]] = v
    flush()
    if driver is None and not gpus:
        raise ParseError(f"not nvidia-smi -q output: {text.strip()[:120]!r}")
    return SmiPids(driver, parse_cuda_version(text), gpus, procs)


def compute_apps_csv(pids: SmiPids, gpus: list[Gpu], bus_of: dict[str, str] | None = None) -> str:
    """The compute processes of `-q -d PIDS` as `--query-compute-apps=gpu_uuid,pid,process_name,used_memory
    --format=csv,noheader,nounits` prints them (parse_compute_apps reads it): Type C or C+G only, each GPU named
    by its UUID (by bus id where known, else by its position, which is nvidia-smi's index order)."""
    def bdf(bus: str) -> str | None:
        try:
            return pci_bdf(bus)
        except ValueError:
            return None

    by_bus = {bdf(b): u for u, b in (bus_of or {}).items()}
    by_bus.pop(None, None)
    rows = []
    for p in pids.procs:
        if "C" not in p.type.split("+"):
            continue
        uuid = by_bus.get(bdf(p.bus_id)) or (gpus[p.gpu].uuid if p.gpu < len(gpus) else p.bus_id)
        used = p.used.replace("MiB", "").strip()
        rows.append(f"{uuid}, {p.pid}, {p.name}, {used if used.isdigit() else '[N/A]'}\n")
    return "".join(rows)


# ---------------------------------------------------------------- GPU health: nvidia-smi --query-gpu

HEALTH_FIELDS = ("index", "uuid", "pci.bus_id", "driver_version", "ecc.errors.uncorrected.volatile.total",
                 "ecc.errors.uncorrected.aggregate.total", "retired_pages.pending", "remapped_rows.pending",
                 "remapped_rows.failure")


@dataclass(frozen=True)
class GpuHealth:
    index: int
    uuid: str
    bus_id: str
    driver: str
    ecc_uncorrected_volatile: int | None   # None: [N/A] (ECC off or not supported)
    ecc_uncorrected_aggregate: int | None
    retired_pages_pending: bool | None     # None: [N/A] (row-remapping GPUs: A100 and later)
    remapped_rows_pending: bool | None
    remapped_rows_failure: bool | None


def _na_int(v: str) -> int | None:
    return int(v) if v.strip().isdigit() else None


def _na_bool(v: str) -> bool | None:
    v = v.strip().lower()
    return True if v == "yes" else False if v == "no" else None


def parse_gpu_health(text: str) -> list[GpuHealth]:
    """`--query-gpu=` + HEALTH_FIELDS `--format=csv,noheader,nounits` (the header line is skipped if present)."""
    out = []
    for row in _csv_rows(text):
        if row[0] == "index":
            continue
        if len(row) != len(HEALTH_FIELDS) or not row[0].isdigit():
            raise ParseError(f"unexpected nvidia-smi row: {', '.join(row)}")
        out.append(GpuHealth(int(row[0]), row[1], row[2], row[3], _na_int(row[4]), _na_int(row[5]),
                             _na_bool(row[6]), _na_bool(row[7]), _na_bool(row[8])))
    return out


# ---------------------------------------------------------------- versions compared across ranks

def parse_versions(text: str) -> dict[str, str | None]:
    """preflight's versions section: `@@kernel 6.8.0-60-generic`, `ethtool -i RAIL`'s driver/version/
    firmware-version lines (and bus-info: the NIC's PCI address, `nic_bus`, for the gdr check's ACS path),
    `@@ofed MLNX_OFED_LINUX-24.10-...` (ofed_info -s). Empty values are None."""
    out: dict[str, str | None] = {}
    for raw in text.splitlines():
        s = raw.strip()
        if s.startswith("@@kernel "):
            out["kernel"] = s[9:].strip() or None
        elif s.startswith("@@ofed "):
            out["ofed"] = s[7:].strip().rstrip(":") or None
        elif s.startswith("driver:"):
            out["nic_driver"] = s[7:].strip() or None
        elif s.startswith("firmware-version:"):
            out["nic_firmware"] = s[17:].strip() or None
        elif s.startswith("bus-info:"):
            out["nic_bus"] = s[9:].strip() or None
        elif s.startswith("version:") and out.get("nic_driver"):
            out["nic_driver"] = f"{out['nic_driver']} {s[8:].strip()}".strip()
    return out


# ---------------------------------------------------------------- GPUDirect RDMA readiness

def parse_modules(text: str) -> set[str]:
    """Module names from `lsmod` (header `Module  Size  Used by`) or `/proc/modules` (`name size refs deps state`)."""
    names = set()
    for raw in text.splitlines():
        parts = raw.split()
        if len(parts) >= 2 and parts[0] != "Module" and parts[1].isdigit():
            names.add(parts[0])
    return names


@dataclass(frozen=True)
class IbPort:
    port: int
    state: str         # PORT_ACTIVE, PORT_DOWN, PORT_INIT, ...
    link_layer: str    # Ethernet (RoCE) or InfiniBand
    active_mtu: int | None


@dataclass(frozen=True)
class IbDevInfo:
    hca: str
    fw_ver: str | None
    ports: dict[int, IbPort]


def parse_ibv_devinfo(text: str) -> IbDevInfo:
    """`ibv_devinfo -d HCA` (tab-indented `key:\\tvalue`, ports as `port:\\tN` blocks)."""
    hca: str | None = None
    fw: str | None = None
    ports: dict[int, dict[str, Any]] = {}
    cur: dict[str, Any] | None = None
    for raw in text.splitlines():
        k, sep, v = raw.strip().partition(":")
        if not sep:
            continue
        v = v.strip()
        if k == "hca_id":
            hca = v
        elif k == "fw_ver":
            fw = v
        elif k == "port" and v.isdigit():
            cur = {"port": int(v), "state": "", "link_layer": "", "active_mtu": None}
            ports[int(v)] = cur
        elif cur is not None and k == "state":
            cur["state"] = v.split()[0]
        elif cur is not None and k == "link_layer":
            cur["link_layer"] = v
        elif cur is not None and k == "active_mtu":
            cur["active_mtu"] = int(v.split()[0]) if v.split()[0].isdigit() else None
    if hca is None:
        raise ParseError(f"not ibv_devinfo output: {text.strip()[:120]!r}")
    return IbDevInfo(hca, fw, {n: IbPort(**p) for n, p in ports.items()})


_EXPRESS = re.compile(r"Express \(v\d\) (Root Port|Downstream Port|Upstream Port|Endpoint|Legacy Endpoint)|"
                      r"Express (Root Port|Downstream Port|Upstream Port|Endpoint)")


@dataclass(frozen=True)
class PciDev:
    bdf: str                 # normalised: dddd:bb:dd.f
    path: tuple[str, ...]    # the bridges above it, root first, then itself (normalised); itself alone without -PP
    name: str
    port: str                # the Express capability's port type (Root Port, Downstream Port, Endpoint, ...)
    acsctl: dict[str, bool] | None  # None: no ACSCtl line (no ACS capability, or capabilities hidden)
    line: str                # the ACSCtl line as printed

    @property
    def slot(self) -> str:
        """The address as lspci prints it: the domain only where it is not 0000."""
        return self.bdf[5:] if self.bdf.startswith("0000:") else self.bdf

    @property
    def redirects(self) -> bool:
        return self.acsctl is not None and bool(self.acsctl.get("ReqRedir") or self.acsctl.get("CmpltRedir"))


def pci_bdf(text: str, domain: str = "0000") -> str:
    """`00000008:06:00.0` (nvidia-smi), `0008:06:00.0`, `06:00.0` (lspci; `domain` where it shows none) ->
    `0008:06:00.0`. ValueError on anything else."""
    m = re.fullmatch(r"(?:([0-9A-Fa-f]{1,8}):)?([0-9A-Fa-f]{1,2}):([0-9A-Fa-f]{1,2})\.([0-7])", text.strip())
    if not m:
        raise ValueError(f"not a PCI address: {text!r}")
    dom = int(m.group(1) or domain, 16)
    return f"{dom:04x}:{int(m.group(2), 16):02x}:{int(m.group(3), 16):02x}.{m.group(4)}"


PCI_PATHS_MARK = "@@pci-paths"


def parse_lspci_devices(text: str) -> tuple[dict[str, PciDev], bool, bool]:
    """`lspci -PP -vvv` (each device named by its path through the bridges above it:
    `[dddd:]bb:dd.f/bb:dd.f/...`, pciutils >= 3.6; the domain printed once, where any device has one) or plain
    `lspci -vvv`, filtered or whole: {bdf: PciDev}, whether capabilities were hidden (`<access denied>`: not
    root), and whether the paths were printed (preflight's PCI_PATHS_MARK after a successful `lspci -PP`)."""
    devs: dict[str, PciDev] = {}
    cur: dict | None = None

    def flush():
        if cur:
            devs[cur["bdf"]] = PciDev(cur["bdf"], cur["path"], cur["name"], cur["port"], cur["acs"], cur["line"])

    for raw in text.splitlines():
        if raw and not raw[0].isspace() and not raw.startswith("@@"):
            slot, _, name = raw.partition(" ")
            try:
                parts = slot.split("/")
                first = pci_bdf(parts[0])
                path = (first,) + tuple(pci_bdf(x, first[:4]) for x in parts[1:])
            except ValueError:
                continue
            flush()
            cur = {"bdf": path[-1], "path": path, "name": name, "port": "", "acs": None, "line": ""}
            continue
        if cur is None:
            continue
        m = _EXPRESS.search(raw)
        if m:
            cur["port"] = m.group(1) or m.group(2)
        st = raw.strip()
        if st.startswith("ACSCtl:"):
            cur["acs"] = {f[:-1]: f.endswith("+") for f in st[7:].split() if f[-1:] in "+-"}
            cur["line"] = st
    flush()
    return devs, "<access denied>" in text, PCI_PATHS_MARK in text


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


RAIL_ERROR_COUNTERS = re.compile(r"(symbol_err|crc_err|link_down_events|discards|_errors_phy|fec_uncorrect|"
                                 r"out_of_buffer|rx_err_lane|excessive_buffer_overrun)")


GPU_FIELDS = ("index", "uuid", "name", "memory.used", "memory.total")
# preflight asks nvidia-smi once for both: the gpu check's five fields, then the health fields after index, uuid
GPU_AND_HEALTH_FIELDS = GPU_FIELDS + HEALTH_FIELDS[2:]


def split_gpu_query(text: str) -> tuple[str, str | None]:
    """One `--query-gpu=` + GPU_AND_HEALTH_FIELDS answer (or, where this driver lacks a health field, the
    five-field answer of the fallback after its `Field "..." is not a valid field to query.` line) as the two
    texts parse_gpus and parse_gpu_health read; health None when the fields were not reported. Lines that are not
    GPU rows (`No devices were found`) stay in both."""
    base, health, other = [], [], []
    unsupported = False
    for line in text.splitlines():
        if "is not a valid field to query" in line:
            unsupported = True
            continue
        rows = _csv_rows(line + "\n")
        cells = rows[0] if rows else []
        if cells and cells[0].isdigit() and len(cells) == len(GPU_AND_HEALTH_FIELDS):
            base.append(", ".join(cells[:len(GPU_FIELDS)]))
            health.append(", ".join(cells[:2] + cells[len(GPU_FIELDS):]))
        elif cells and cells[0].isdigit() and len(cells) == len(GPU_FIELDS):
            base.append(line.strip())
        elif line.strip():
            other.append(line.rstrip())
    base_text = "".join(x + "\n" for x in other + base)
    if unsupported or (base and not health):
        return base_text, None
    return base_text, "".join(x + "\n" for x in other + health)
