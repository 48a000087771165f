"""System facts: the clock (timedatectl, chronyc), disk space (df, du), the versions compared across ranks,
and GPUDirect RDMA readiness (kernel modules, ibv_devinfo, lspci's PCIe paths and ACS). Each fact's command (the
`Section` a probe script runs) beside its pure parser.

Each parser is tested on real captured output in tests/fixtures/real/.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from . import ParseError
from .net import counters_script
from .probe import MISSING_MARK, Section
from ..transport import RemotePath, Sh, cmd, q


# ---------------------------------------------------------------- time: timedatectl, else chronyc

CHRONY_MARK = "@@chronyc"


def time_section() -> Section:
    """timedatectl where it works; else `chronyc tracking` after a marker (containers and minimal images without
    systemd as PID 1); neither installed: the missing-tool mark for timedatectl."""
    td = cmd("timedatectl", "show") + " 2>/dev/null || " + cmd("timedatectl")
    return Section("time", Sh(
        f"{{ command -v timedatectl >/dev/null 2>&1 && {{ {td}; }}; }} || "
        f"{{ command -v chronyc >/dev/null 2>&1 && {{ echo {q(CHRONY_MARK)}; chronyc tracking; }}; }} || "
        f"{{ command -v timedatectl >/dev/null 2>&1 || echo {q(MISSING_MARK + 'timedatectl')}; exit 127; }}"))


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


# ---------------------------------------------------------------- df / du

def df_section(model_path: str) -> Section:
    """`df` of the model's directory, or of its nearest existing parent."""
    model = q(RemotePath(model_path))
    return Section("df", Sh(f"p={model}; while [ ! -e \"$p\" ]; do p=$(dirname \"$p\"); done; df -P -B1 \"$p\""), "df")


def du_section(model_path: str) -> Section:
    """The bytes of the model already there (nothing when the directory is missing)."""
    model = q(RemotePath(model_path))
    return Section("du", Sh(f"if [ -d {model} ]; then du -sb --exclude=.cache {model}; fi"), "du", 60)


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


# ---------------------------------------------------------------- versions compared across ranks

def versions_section(rail: str) -> Section:
    """The versions compared across ranks (parity): kernel, the rail NIC's driver and firmware, OFED/DOCA."""
    return Section("versions", Sh(
        "echo \"@@kernel $(uname -r)\"; "
        f"ethtool -i {q(rail)} 2>/dev/null | grep -E '^(driver|version|firmware-version|bus-info):'; "
        "if command -v ofed_info >/dev/null 2>&1; then echo \"@@ofed $(ofed_info -s 2>/dev/null)\"; fi; exit 0"))


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

def gdr_section(rail: str, hca: str) -> Section:
    """GPUDirect RDMA readiness in one shell: kernel modules, the NVIDIA driver flavour, the rail HCA's port,
    ACS on the PCIe bridges (lspci shows capabilities to root only; no sudo is tried: a read-only preflight leaves
    no auth-log trail), and the rail's error counters read twice, half a second apart (ethtool -S, else sysfs)."""
    stats = counters_script(rail, hca)
    # -PP names each device by its path through the bridges above it (pciutils >= 3.6), so the gdr check judges
    # the ports between each GPU and the rail NIC; an older lspci: the plain listing, every switch port judged
    pci = (f"{{ lspci -PP -vvv 2>/dev/null && echo {q(PCI_PATHS_MARK)} || lspci -vvv 2>/dev/null; }} "
           f"| grep -E '^[0-9a-f]|Express|ACSCtl|access denied|{PCI_PATHS_MARK}'")
    return Section("gdr", Sh(
        "echo '@@gdr modules'; if command -v lsmod >/dev/null 2>&1; then lsmod; else cat /proc/modules; fi; "
        "echo '@@gdr nvidia'; cat /proc/driver/nvidia/version 2>/dev/null; "
        f"echo '@@gdr ibv'; if command -v ibv_devinfo >/dev/null 2>&1; then ibv_devinfo -d {q(hca)} 2>&1; "
        "else echo @@missing; fi; "
        f"echo '@@gdr lspci'; if command -v lspci >/dev/null 2>&1; then {pci}; "
        "else echo @@missing; fi; "
        f"echo '@@gdr stats1'; {stats}; sleep 0.5; echo '@@gdr stats2'; {stats}; exit 0"), timeout=20)


def gdr_parts(text: str) -> dict[str, str]:
    """gdr_section's output as its parts, by their `@@gdr NAME` line: modules, nvidia, ibv, lspci, stats1, stats2."""
    parts: dict[str, list[str]] = {}
    cur = None
    for line in text.splitlines():
        if line.startswith("@@gdr "):
            cur = line[6:].strip()
            parts[cur] = []
        elif cur is not None:
            parts[cur].append(line)
    return {k: "\n".join(v) for k, v in parts.items()}


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
