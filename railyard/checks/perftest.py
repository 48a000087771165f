"""perftest output (`ib_write_bw`, `ib_send_bw`, `ib_write_lat`, `ib_send_lat`) and the link rate
(`ibstat`, sysfs `rate`), parsed to typed values. Pure: no I/O. Real captures: tests/fixtures/real/perftest/.

A run prints a header (test name, device, QPs, GID index, data exchange method), then one table:

     #bytes     #iterations    BW peak[Gb/sec]    BW average[Gb/sec]   MsgRate[Mpps]
     65536      20000            111.72             111.71             0.213070

(`MiB/sec` without `--report_gbits` in newer builds, `MB/sec` in older ones; converted here to Gb/s). With
`-D` the peak is not measured and reads 0.00. A `Conflicting CPU frequency values` line (no `-F`) can
stand between the table's header and its row. A run that printed no row has `bw`/`lat` None: a failure,
never a pass.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..facts import ParseError


@dataclass(frozen=True)
class BwRow:
    size: int
    iterations: int
    peak_gbps: float        # 0.0 with -D: perftest does not measure the peak of a timed run
    avg_gbps: float
    msg_rate_mpps: float


@dataclass(frozen=True)
class LatRow:
    size: int
    iterations: int
    min_us: float
    max_us: float
    typical_us: float
    avg_us: float
    stdev_us: float
    p99_us: float
    p999_us: float


@dataclass(frozen=True)
class Run:
    test: str               # "RDMA_Write BW Test", as the header names it ("" if none)
    device: str             # the header's "Device : mlx5_0" ("" if none)
    qps: int | None
    gid_index: int | None
    cm: bool                # "Data ex. method : rdma_cm"
    cuda: int | None        # the GPU perftest picked ("Picking device No. N"), None for host memory
    unit: str               # "Gb/sec" | "MiB/sec" | "MB/sec" | "usec" | ""
    bw: BwRow | None
    lat: LatRow | None
    error: str              # the tool's own failure line(s), "" if none
    bw_rows: tuple[BwRow, ...] = ()   # every row of a multi-size run (-a); bw is the last (largest) one


# to Gb/s: MiB is 2^20 bytes, MB 10^6 (perftest's two non-Gb/s units)
_TO_GBPS = {"Gb/sec": 1.0, "MiB/sec": 1048576 * 8 / 1e9, "MB/sec": 1e6 * 8 / 1e9}

_TEST = re.compile(r"^\s*(\S.*?(?:BW|Latency) Test)\s*$", re.M)
_DEVICE = re.compile(r"\bDevice\s*:\s*(\S+)")
_QPS = re.compile(r"Number of qps\s*:\s*(\d+)")
_GID = re.compile(r"GID index\s*:\s*(\d+)")
_CM = re.compile(r"Data ex\. method\s*:\s*rdma_cm")
_CUDA = re.compile(r"Picking device No\. (\d+)|\[pid = \d+, dev = (\d+)\]")
_BW_HEAD = re.compile(r"BW peak\[([A-Za-z/]+)\]")
_LAT_HEAD = re.compile(r"t_min\[usec\]")
_NUM = r"(\d+(?:\.\d+)?)"
_BW_ROW = re.compile(rf"^\s*(\d+)\s+(\d+)\s+{_NUM}\s+{_NUM}\s+{_NUM}\s*$")
_LAT_ROW = re.compile(r"^\s*(\d+)\s+(\d+)" + rf"\s+{_NUM}" * 7 + r"\s*$")
# the tool's own failure lines (perftest prints them on stderr; the verb reads both streams)
_ERROR = re.compile(r"^\s*(?:Couldn't|Unable to|Failed to|failed to|IB device \S+ not found|ERRNO:|"
                    r"Completion with error|Perftest supports CUDA latency|CUDA DMA-BUF cannot|"
                    r"Parser function exited|Segmentation fault|\S+_read_keys:|Mismatch)")
_WAITING = re.compile(r"Waiting for client (?:rdma_cm QP )?to connect")


def _gbps(value: str, unit: str) -> float:
    factor = _TO_GBPS[unit]
    return float(value) if factor == 1.0 else round(float(value) * factor, 4)


def parse(text: str) -> Run:
    """One perftest run's output (either end), e.g. ` RDMA_Write BW Test ... 65536  20000  111.72  111.71  0.213070`."""
    test = _TEST.search(text)
    device = _DEVICE.search(text)
    qps = _QPS.search(text)
    gid = _GID.search(text)
    cuda = _CUDA.search(text)
    unit, rows, lat = "", [], None
    in_table = ""
    for line in text.splitlines():
        head = _BW_HEAD.search(line)
        if head:
            unit = head.group(1)
            in_table = "bw" if unit in _TO_GBPS else ""
            continue
        if _LAT_HEAD.search(line):
            unit, in_table = "usec", "lat"
            continue
        if in_table == "bw":
            m = _BW_ROW.match(line)
            if m:
                rows.append(BwRow(int(m.group(1)), int(m.group(2)), _gbps(m.group(3), unit),
                                  _gbps(m.group(4), unit), float(m.group(5))))
        elif in_table == "lat" and lat is None:
            m = _LAT_ROW.match(line)
            if m:
                v = [float(x) for x in m.groups()[2:]]
                lat = LatRow(int(m.group(1)), int(m.group(2)), *v)
    errors = [ln.strip() for ln in text.splitlines() if _ERROR.match(ln)]
    return Run(
        test=test.group(1) if test else "",
        device=device.group(1) if device else "",
        qps=int(qps.group(1)) if qps else None,
        gid_index=int(gid.group(1)) if gid else None,
        cm=bool(_CM.search(text)),
        cuda=int(cuda.group(1) or cuda.group(2)) if cuda else None,
        unit=unit,
        bw=rows[-1] if rows else None,
        lat=lat,
        error="\n".join(errors),
        bw_rows=tuple(rows),
    )


def waiting(text: str) -> bool:
    """The server printed its banner (`* Waiting for client to connect... *`, or rdma_cm's
    `Waiting for client rdma_cm QP to connect`): it listens, the client may start."""
    return bool(_WAITING.search(text))


@dataclass(frozen=True)
class IbPort:
    state: str              # "Active", "Down", ...
    physical_state: str     # "LinkUp", "Disabled", ...
    rate_gbps: float | None
    link_layer: str         # "Ethernet" (RoCE) or "InfiniBand"


_CA = re.compile(r"^CA '([^']+)'", re.M)
_PORT = re.compile(r"^\s*Port (\d+):\s*$", re.M)


def parse_ibstat(text: str) -> dict[str, dict[int, IbPort]]:
    """`ibstat [HCA [PORT]]`: each CA's ports, e.g. `CA 'mlx5_0'` ... `Port 1:` `State: Active` `Rate: 400`."""
    out: dict[str, dict[int, IbPort]] = {}
    cas = list(_CA.finditer(text))
    for i, ca in enumerate(cas):
        block = text[ca.end():cas[i + 1].start() if i + 1 < len(cas) else len(text)]
        ports = list(_PORT.finditer(block))
        out[ca.group(1)] = {}
        for j, p in enumerate(ports):
            body = block[p.end():ports[j + 1].start() if j + 1 < len(ports) else len(block)]
            kv = dict(re.findall(r"^\s*([A-Za-z ]+):\s*(.*?)\s*$", body, re.M))
            rate = kv.get("Rate")
            out[ca.group(1)][int(p.group(1))] = IbPort(
                kv.get("State", ""), kv.get("Physical state", ""),
                float(rate) if rate and re.fullmatch(r"\d+(?:\.\d+)?", rate) else None, kv.get("Link layer", ""))
    if not out and text.strip():
        raise ParseError(f"ibstat: no `CA '...'` block in {text.strip()[:80]!r}")
    return out


def parse_ibstat_rate(text: str) -> dict[str, float]:
    """Each HCA's port-1 rate in Gb/s from `ibstat` (`Rate: 200`); an HCA without a rate line is left out.
    The rate is the negotiated one whatever the state: a Down port reads its own (`Rate: 40`), so a caller
    judging a link reads `parse_ibstat` for the state too."""
    rates = {}
    for hca, ports in parse_ibstat(text).items():
        port = ports.get(1) or next(iter(ports.values()), None)
        if port is not None and port.rate_gbps is not None:
            rates[hca] = port.rate_gbps
    return rates


_SYSFS_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?) Gb/sec\b")


def parse_sysfs_rate(text: str) -> float:
    """/sys/class/infiniband/HCA/ports/1/rate, e.g. `400 Gb/sec (4X NDR)` -> 400.0."""
    m = _SYSFS_RATE.match(text)
    if not m:
        raise ParseError(f"sysfs rate: {text.strip()[:80]!r} is not `N Gb/sec (...)`")
    return float(m.group(1))
