"""GPU facts: nvidia-smi's GPU rows, health fields, compute processes, `-q -d PIDS`, the topology matrix,
lscpu's NUMA nodes, and NVIDIA Xid lines of the kernel log. Each fact's command (the `Section` a probe script
runs) beside its pure parser.

Each parser is tested on real captured output in tests/fixtures/real/.
"""

from __future__ import annotations

import csv
import io
import re
from dataclasses import dataclass

from . import ParseError
from .probe import Section
from .system import pci_bdf
from ..transport import Sh, cmd


# ---------------------------------------------------------------- nvidia-smi --query-gpu

def gpus_section() -> Section:
    """The GPU rows alone (GPU_FIELDS)."""
    return Section("gpus", cmd("nvidia-smi", "--query-gpu=" + ",".join(GPU_FIELDS), "--format=csv,noheader,nounits"),
                   "nvidia-smi")


def gpus_and_health_section() -> Section:
    """One nvidia-smi call for the gpu and gpu_health checks (GPU_AND_HEALTH_FIELDS; a second, GPU_FIELDS alone,
    only on an old driver that lacks a health field): split_gpu_query parts the answer."""
    return Section("gpus", Sh(cmd("nvidia-smi", "--query-gpu=" + ",".join(GPU_AND_HEALTH_FIELDS),
                                  "--format=csv,noheader,nounits") + " 2>&1 || "
                              + cmd("nvidia-smi", "--query-gpu=" + ",".join(GPU_FIELDS), "--format=csv,noheader,nounits")),
                   "nvidia-smi")


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


def select_gpu(gpus: list[Gpu], selector: str) -> list[Gpu]:
    """GPUs whose name contains the selector, case-insensitively (`GB300` never matches `RTX PRO`)."""
    return [g for g in gpus if selector.lower() in g.name.lower()]


# ---------------------------------------------------------------- nvidia-smi --query-compute-apps

COMPUTE_APPS_FIELDS = ("gpu_uuid", "pid", "process_name", "used_memory")


def apps_section() -> Section:
    """The compute processes on every GPU (parse_compute_apps); empty when idle. A call of its own: nvidia-smi
    answers one --query-* switch per call."""
    return Section("apps", cmd("nvidia-smi", "--query-compute-apps=" + ",".join(COMPUTE_APPS_FIELDS),
                               "--format=csv,noheader,nounits"), "nvidia-smi")


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


GPU_FIELDS = ("index", "uuid", "name", "memory.used", "memory.total")


# preflight asks nvidia-smi once for both: the gpu check's five fields, then the health fields after index, uuid
GPU_AND_HEALTH_FIELDS = GPU_FIELDS + HEALTH_FIELDS[2:]


# what preflight puts in place of the health rows where this driver's nvidia-smi lacks a health field
HEALTH_UNSUPPORTED = "@@health-fields-unsupported"


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


# ---------------------------------------------------------------- nvidia-smi -q -d PIDS

def gpu_pids_section() -> Section:
    """The compute processes and the driver's CUDA version in one call: nvidia-smi answers one --query-* switch per
    call ("Only one --query-* switch can be used at a time.", exit 2: a real capture in
    tests/fixtures/real/nvidia-smi-one-call/), and -q -d PIDS has both."""
    return Section("gpu_pids", cmd("nvidia-smi", "-q", "-d", "PIDS"), "nvidia-smi")


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


# ================================================================ topology: nvidia-smi topo -m, lscpu
# (GPU <-> CPU/NUMA affinity and GPU <-> NIC distance, for placing ranks on multi-socket hosts)


def topo_section() -> Section:
    return Section("topo", cmd("nvidia-smi", "topo", "-m"), "nvidia-smi")


def lscpu_section() -> Section:
    return Section("lscpu", cmd("lscpu"), "lscpu")


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


# ---------------------------------------------------------------- kernel log: NVIDIA Xid

def xid_section() -> Section:
    """The kernel log's NVIDIA Xid lines (the last 50); where dmesg is refused (dmesg_restrict), its error and exit
    status."""
    return Section("dmesg", Sh("o=$(dmesg 2>&1); rc=$?; if [ $rc -ne 0 ]; then printf '%s\\n' \"$o\" | head -n 3; "
                               "exit $rc; fi; printf '%s\\n' \"$o\" | grep -F 'NVRM: Xid' | tail -n 50; exit 0"), "dmesg")


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
