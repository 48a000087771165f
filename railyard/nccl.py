"""Judge NCCL debug logs (NCCL_DEBUG=INFO, NCCL_DEBUG_SUBSYS including INIT,NET). Pure: text in, verdict out.

A rank passes only on positive evidence: inter-node channels (`Channel .. via NET/...`) over
IB with GPUDirect RDMA (`/GDRDMA`) on the configured HCA, and no `NCCL WARN`. Everything
else fails with a reason and a fix. Not fooled by:
- `GPU Direct RDMA Disabled for HCA` (it contains the words "GPU Direct RDMA");
- NCCL 2.4 printing `NET/Socket : Using` during init when IB is used afterwards;
- old channel formats (`Channel 01 : 2[c7000] -> 0[87000] ... via NET/IB/5/GDRDMA`, `Ring 00 : ...`);
- line prefixes (timestamps, `[1,12]<stdout>:`, `(RayWorkerWrapper pid=..., ip=...)`, empty hostnames);
- external net plugins (`NET/IBext_v10/1`, `GPU Direct RDMA (DMABUF) enabled`);
- a net plugin that fails to load (`plugin/net.cc:118 -> 2`) before NCCL's own IB takes over.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

_MARK = re.compile(r"NCCL (INFO|WARN|ERROR) ")
_VERSION = re.compile(r"\b[NR]CCL version[ :]*(\d+\.\d+\.\d+)")
_NNODES = re.compile(r"\bnNodes (\d+)")
_CHANNEL = re.compile(r"\b(?:Channel|Ring) \d+(?:/\d+)? ?: .*?\bvia (NET/.+?)\s*$")
_IB_USING = re.compile(r"NET/IB\S* ?: Using (.*)$")
_HCA = re.compile(r"\[\d+\]([A-Za-z0-9_]+):\d+")
_TRACE = re.compile(r"^([\w./-]+\.(?:cc|cu|cpp|c|h)):(\d+) -> (\d+)\s*$")


@dataclass
class RankVerdict:
    source: str
    verdict: str  # pass | fail
    net_transport: str | None  # IB | Socket | another plugin's name | None: no inter-node channel seen
    gdrdma: bool
    hcas: list[str]
    nccl_version: str | None
    warnings: list[str]
    reasons: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


def _messages(text: str):
    """(level, message) for every NCCL line, whatever precedes `NCCL INFO` on it."""
    for line in text.splitlines():
        m = _MARK.search(line)
        if m:
            yield m.group(1), line[m.end():].rstrip(), line.rstrip()


def _transport(path: str) -> tuple[str, bool]:
    """`NET/IB/5/GDRDMA` -> ("IB", True); `NET/IBext_v10/1` -> ("IB", False); `NET/Socket/0` -> ("Socket", False)."""
    parts = path.split("/")
    name = parts[1] if len(parts) > 1 else path
    if name.startswith("IB"):
        name = "IB"
    return name, "GDRDMA" in parts[2:]


HINTS = {
    "socket_nodev": "no RDMA device inside the container: pass --device /dev/infiniband, and set NCCL_IB_HCA to the "
                    "rail's HCA (ibdev2netdev)",
    "socket_memlock": "registering memory failed: run the container with --ulimit memlock=-1 and --cap-add IPC_LOCK",
    "socket": "NCCL fell back to TCP: check /dev/infiniband in the container, NCCL_IB_HCA, memlock/IPC_LOCK, and that "
              "NCCL_NET/NCCL_IB_DISABLE are not set",
    "nogdr": "load the GPU peer-memory module (sudo modprobe nvidia_peermem) or use a DMA-BUF capable driver and "
             "kernel; check NCCL_NET_GDR_LEVEL",
    "gid": "the RoCE GID index or the MTU is wrong on the rail: NCCL_IB_GID_INDEX must be the RoCE v2 index of the "
           "rail IPv4 (inv preflight: gid) and the MTU equal on both ends (inv preflight: mtu)",
    "ifname": "NCCL_SOCKET_IFNAME must name the rail interface that exists in the container (host network)",
    "hca": "set NCCL_IB_HCA to the configured rail's HCA",
    "nochannel": "no inter-node channel in the log: it may be cut short, NCCL_DEBUG_SUBSYS may lack INIT,NET, or the "
                 "job never connected across nodes",
}


def _warn_hint(msg: str) -> str:
    low = msg.lower()
    if "vendor err 129" in low or "status=12" in low or "retry" in low or "ibv_modify_qp" in low \
            or "timed out" in low:
        return HINTS["gid"]
    if "ibv_reg_mr" in low or "cannot allocate memory" in low or "memlock" in low:
        return HINTS["socket_memlock"]
    if "socket" in low and ("interface" in low or "ifname" in low):
        return HINTS["ifname"]
    if "no device" in low or "ibv_open_device" in low:
        return HINTS["socket_nodev"]
    return "read the warning; NCCL_DEBUG_SUBSYS=ALL shows more"


def judge(text: str, source: str, expect_hcas: list[str] | None = None) -> RankVerdict:
    version = None
    hcas: list[str] = []
    channels: list[tuple[str, bool]] = []
    warnings: list[str] = []
    traces: list[str] = []
    no_ib_device = memlock_error = False
    m = _VERSION.search(text)  # older NCCL prints it on a line of its own, without `NCCL INFO`
    if m:
        version = m.group(1)
    nnodes = [int(n) for n in _NNODES.findall(text)]
    for level, msg, line in _messages(text):
        m = _IB_USING.search(msg)
        if m:
            for h in _HCA.findall(m.group(1)):
                if h not in hcas:
                    hcas.append(h)
        m = _CHANNEL.search(msg)
        if m:
            channels.append(_transport(m.group(1)))
        if "NET/IB : No device found" in msg:
            no_ib_device = True
        if "ibv_reg_mr" in msg or "Cannot allocate memory" in msg:
            memlock_error = True
        if level in ("WARN", "ERROR"):
            if msg not in warnings:
                warnings.append(msg)
        else:
            t = _TRACE.match(msg.strip())
            if t and not t.group(1).startswith("plugin/"):  # a plugin that fails to load is not a failure
                traces.append(msg.strip())
    if nnodes and max(nnodes) < 2:
        channels = []  # NET channels between ranks of one node (NCCL_P2P_LEVEL/SHM_DISABLE) prove nothing
    kinds = sorted({k for k, _ in channels})
    transport = None if not kinds else ("Socket" if "Socket" in kinds else kinds[0] if len(kinds) == 1 else "+".join(kinds))
    gdrdma = bool(channels) and all(g for k, g in channels) and transport == "IB"
    reasons: list[str] = []
    if transport is None and nnodes and max(nnodes) < 2:
        reasons.append("every communicator in the log is single-node (nNodes 1): no inter-node channel to judge "
                       f"(fix: {HINTS['nochannel']})")
    elif transport is None:
        reasons.append(f"no inter-node channel seen (fix: {HINTS['nochannel']})")
    elif transport != "IB":
        why = HINTS["socket_nodev"] if no_ib_device and not memlock_error else \
            HINTS["socket_memlock"] if memlock_error else HINTS["socket"]
        n = sum(1 for k, _ in channels if k != "IB")
        reasons.append(f"{n} inter-node channel(s) over {transport}, not IB (fix: {why})")
    elif not gdrdma:
        n = sum(1 for k, g in channels if not g)
        reasons.append(f"{n} of {len(channels)} inter-node IB channel(s) without GPUDirect RDMA (fix: {HINTS['nogdr']})")
    if transport == "IB" and expect_hcas:
        if not hcas:
            reasons.append("the HCAs in use are not in the log (fix: NCCL_DEBUG_SUBSYS must include INIT,NET)")
        else:
            other = [h for h in hcas if h not in expect_hcas]
            if other:
                reasons.append(f"uses {', '.join(other)}, not the configured rail's {', '.join(expect_hcas)} "
                               f"(fix: {HINTS['hca']}={','.join(expect_hcas)})")
    for w in warnings:
        reasons.append(f"NCCL WARN {w} (fix: {_warn_hint(w)})")
    for t in traces:
        reasons.append(f"error return trace {t} (fix: read the WARN before it; NCCL_DEBUG_SUBSYS=ALL shows more)")
    verdict = "pass" if not reasons else "fail"
    return RankVerdict(source, verdict, transport, gdrdma, hcas, version, warnings, reasons)
