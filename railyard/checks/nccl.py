"""Judge NCCL debug logs (NCCL_DEBUG=INFO, NCCL_DEBUG_SUBSYS including INIT,NET). Pure: text in, verdict out.

A rank passes only on positive evidence: inter-node channels (`Channel .. via NET/...`) over
IB with GPUDirect RDMA (`/GDRDMA`) on the configured HCA, and no `NCCL WARN`. Everything
else fails with a reason and a fix. Not fooled by:
- `GPU Direct RDMA Disabled for HCA` (it contains the words "GPU Direct RDMA");
- NCCL 2.4 printing `NET/Socket : Using` during init when IB is used afterwards;
- old channel formats (`Channel 01 : 2[c7000] -> 0[87000] ... via NET/IB/5/GDRDMA`, `Ring 00 : ...`);
- line prefixes (timestamps, `[1,12]<stdout>:`, `(RayWorkerWrapper pid=..., ip=...)`, empty hostnames);
- external net plugins (`NET/IBext_v10/1`, `GPU Direct RDMA (DMABUF) enabled`);
- a net plugin that fails to load (`plugin/net.cc:118 -> 2`) before NCCL's own IB takes over;
- text after the channel path (Ray's `[repeated 14x across cluster]`, RCCL's `comm 0x... nRanks 02`, `/Shared`,
  `0(2)` for a PXN proxy device);
- several NCCL messages on one physical line (a pasted or spliced log) and a WARN wrapped onto the next line;
- IB-verbs plugins that do not call themselves IB (`NET/NCCL RDMA Plugin v6/0/GDRDMA`, `IBext_v8`): IB;
  AWS `Libfabric` (EFA, aws-ofi-nccl) and `UCX`: RDMA plugins named as such, never a "TCP fallback";
- error traces of NCCL's proxy/async threads (`proxy.cc:858 -> 6 [Proxy Thread]`, `group.cc:75 -> 6 [Async thread]`).
A bootstrap or socket connect failure (`Connection refused`, `closed by remote peer`) gets the bootstrap fix, an IB
completion error the GID/MTU one; `NCCL_IB_HCA` without `=` matches by prefix (`mlx5_1` is also `mlx5_10`): an HCA
in use that only a prefix matched is flagged.

`judge_intranode` is the one-host judge (`inv nccl-check` on single_node_tp and dp_ep): the ranks of
one host pass only on channels via P2P/... (CUMEM, IPC, direct pointer, read or not) or NVLink SHARP
(NVLS) in use, with no channel via SHM or NET, one node and no `NCCL WARN`.
"""

from __future__ import annotations

import re
from typing import Sequence
from dataclasses import asdict, dataclass, field

_MARK = re.compile(r"NCCL (INFO|WARN|ERROR) ")
_VERSION = re.compile(r"\b[NR]CCL version[ :]*(\d+\.\d+\.\d+)")
_NNODES = re.compile(r"\bnNodes (\d+)")
_CHANNEL = re.compile(r"\b(?:Channel|Ring) \d+(?:/\d+)? ?: .*?\bvia NET/(?P<name>[^/]+)/(?P<dev>\d+)"
                      r"(?:\(\d+\))?(?P<flags>(?:/[A-Za-z][\w=]*)*)")
# the `host:pid:tid [dev] ` (and a WARN's `file.cc:NN `) that opens the next message spliced onto a line
_NEXT_HEADER = re.compile(r"\s*(?:\S*:\d+:\d+ )?\[\d+\](?: [\w./-]+:\d+)?\s*$")
_RECORD_START = re.compile(r"^\s*(?:\S*:\d+:\d+ \[\d+\]|\[|\(|NCCL |#|INFO |WARNING |ERROR )")
# the rest of a WARN wrapped onto the next line (`...len` / `0, vendor err 129 (Recv)`), never a `tool: message` record
_CONTINUATION = re.compile(r"^\s*(?![^\s:]{1,16}: )[0-9a-z,(]")
_UCX_ERROR = re.compile(r"\bUCX\s+ERROR\s+(.*\S)")
_IB_HCA_SET = re.compile(r"\bNCCL_IB_HCA set (?:by environment )?to (\S+)")
_IB_USING = re.compile(r"NET/IB\S* ?: Using (.*)$")
_HCA = re.compile(r"\[\d+\]([A-Za-z0-9_]+):\d+")
_HCA_AT = re.compile(r"\[(\d+)\]([A-Za-z0-9_]+):\d+(/RoCE\b)?")   # `via NET/IB/<n>`: entry [n] of `Using`
_TRACE = re.compile(r"^([\w./-]+\.(?:cc|cu|cpp|c|h)):(\d+) -> (\d+)(?: \[([^\]]+)\])?\s*$")


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
    net_plugin: str | None = None  # the NET plugin's own name in the channel lines: IB, IBext_v8, AWS Libfabric, ...
    roce: bool = False  # an HCA NCCL uses is RoCE (`NET/IB : Using [0]mlx5_0:1/RoCE`), not InfiniBand
    notes: list[str] = field(default_factory=list)  # latent misconfigurations no channel runs over: warned, passed

    def as_dict(self) -> dict:
        return asdict(self)


def _messages(text: str):
    """(level, message, line) for every NCCL message, whatever precedes `NCCL INFO` on its line; several messages
    on one physical line (pasted or spliced) are split, and a WARN wrapped onto the next line is joined again."""
    pending = None
    for line in text.splitlines():
        marks = list(_MARK.finditer(line))
        if not marks:
            if pending and _CONTINUATION.match(line) and not _RECORD_START.match(line):
                pending = (pending[0], pending[1] + " " + line.strip(), pending[2] + "\n" + line.rstrip())
                continue
            if pending:
                yield pending
                pending = None
            continue
        if pending:
            yield pending
            pending = None
        for i, m in enumerate(marks):
            end = marks[i + 1].start() if i + 1 < len(marks) else len(line)
            msg = line[m.end():end]
            if i + 1 < len(marks):
                msg = _NEXT_HEADER.sub("", msg)
            item = (m.group(1), msg.rstrip(), line.rstrip())
            if i + 1 == len(marks) and m.group(1) == "WARN":
                pending = item  # its text may go on on the next physical line
            else:
                yield item
    if pending:
        yield pending


# NET plugins that speak IB verbs to the HCA: NCCL's own (IB), the HPC-X/nccl-rdma-sharp-plugins builds (IBext,
# IBext_v8, "NCCL RDMA Plugin v6"). Other RDMA plugins keep their own name: Libfabric (AWS EFA via aws-ofi-nccl), UCX.
def _family(name: str) -> str:
    low = name.lower()
    if name.startswith("IB") or low.startswith("nccl rdma plugin"):
        return "IB"
    if "libfabric" in low or low.startswith("ofi"):
        return "Libfabric"
    if low.startswith("ucx"):
        return "UCX"
    return name


PLUGIN_WHAT = {"Libfabric": "Libfabric (the aws-ofi-nccl plugin: AWS EFA or a libfabric provider)",
               "UCX": "UCX (the nccl-rdma-sharp-plugins UCX transport)"}


def network_of(v: RankVerdict) -> str:
    """The network a rank's inter-node channels ran over, in words."""
    if v.net_transport == "IB":
        return "NCCL's IB verbs over RoCE" if v.roce else "NCCL's IB verbs over InfiniBand"
    return PLUGIN_WHAT.get(v.net_transport or "", v.net_transport or "no network")


def passed_line(verdicts: list[RankVerdict], on_the_rail: bool) -> str:
    """What a pass saw, per network (an EFA cluster passes on Libfabric: it must not read as IB)."""
    nets = list(dict.fromkeys(network_of(v) for v in verdicts))
    return (f"OK: every rank uses {' or '.join(nets)} with GPUDirect RDMA" + (" on the rail" if on_the_rail else "")
            + ("" if len(nets) == 1 else f" ({len(nets)} networks)"))


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
    "hca_prefix": "NCCL_IB_HCA without a leading '=' matches HCA names by prefix: set the exact form "
                  "NCCL_IB_HCA=={exact}",
    "bootstrap": "a TCP connection between ranks failed before any RDMA (NCCL's bootstrap or socket layer): every "
                 "rank must be started and listening, no firewall between them, and NCCL_SOCKET_IFNAME must name an "
                 "interface whose address the peers can reach (ping and nc the address in the warning)",
    "net_init": "no NET plugin could start (NCCL_NET forces one, e.g. NCCL_NET=IB, that finds no device): pass "
                "--device /dev/infiniband and the rail HCA into the container, or unset NCCL_NET",
    "peer_closed": "the peer rank closed the connection: it most likely exited or crashed first; read that rank's log "
                   "for its first error",
    "other_plugin": "the image loads the {what} net plugin instead of NCCL's IB verbs on the rail HCA: remove the "
                    "plugin from the image or set NCCL_NET=IB, and NCCL_IB_HCA to the rail's HCA",
    "ucx": "the UCX transport reported an error: read it (UCX_LOG_LEVEL=info shows more), check UCX_NET_DEVICES "
           "names the rail HCA",
    "nochannel": "no inter-node channel in the log: it may be cut short, NCCL_DEBUG_SUBSYS may lack INIT,NET, or the "
                 "job never connected across nodes",
    "open_device": "NCCL lists the HCA but cannot open it inside the container: pass its device files (docker run "
                   "--device /dev/infiniband; in Kubernetes the RDMA device plugin's resource, with SR-IOV the VF "
                   "attached to the pod) and IPC_LOCK",
    "loc_prot": "status 4 is IBV_WC_LOC_PROT_ERR: the NIC could not access the memory the request named, usually GPU "
                "memory without a working peer-memory path: load nvidia_peermem (or use DMA-BUF), then check memlock "
                "(--ulimit memlock=-1)",
    "flushed": "status 5 is IBV_WC_WR_FLUSH_ERR: the queue pair had already failed and its requests were flushed; the "
               "first error is the one to fix (an async event on this host, or the peer's log)",
    "access_violation": "the NIC refused a packet on this queue pair (a local access violation): on RoCE, an MTU that "
                        "differs between the two ends does this (NCCL 2.20+ no longer takes the lower one): the same "
                        "MTU on both hosts and the switch (inv preflight: mtu)",
    "cqe": "NCCL 2.28+ names the failed completion's status in its next WARN (`Got completion from peer ... "
           "status=...`): that line's fix applies",
    "efa_cuda_mr": "the EFA provider could not register GPU memory (type 2, EINVAL): a known Libfabric bug of EFA "
                   "installers before 1.29.1 with NCCL 2.19+: upgrade the EFA installer (1.29.1 or later) or set "
                   "FI_EFA_SET_CUDA_SYNC_MEMOPS=0",
}
GENERIC = "read the warning; NCCL_DEBUG_SUBSYS=ALL shows more"
# WARNs that are advice, not a failure (RCCL names its own fix): shown as a note, never a reason
ADVICE = ("numa auto balancing enabled",)


def _warn_hint(msg: str, traces: list[str] | None = None, others: Sequence[str] = ()) -> str:
    low = msg.lower()
    ib = "net/ib" in low or "ibv_" in low or "vendor err" in low or "completion" in low
    if "got cqe with error" in low:   # its status comes on the next WARN
        status = [_warn_hint(o, traces) for o in others if "got completion" in o.lower()]
        return status[0] if status and status[0] != GENERIC else HINTS["cqe"]
    if "local access violation" in low:
        return HINTS["access_violation"]
    if "status=5 " in low or "with error 5," in low or "ibv_wc_wr_flush_err" in low:
        first = [o for o in others if "local access violation" in o.lower()]
        return HINTS["access_violation"] if first else HINTS["flushed"]
    if "with error 4," in low or "status=4 " in low or "ibv_wc_loc_prot_err" in low:
        return HINTS["loc_prot"]
    if "unable to open device" in low:
        return HINTS["open_device"]
    if "net/ofi unable to register memory" in low and "type = 2" in low and "invalid argument" in low:
        return HINTS["efa_cuda_mr"]
    if "vendor err 129" in low or "status=12" in low or "with error 12," in low or "ibv_modify_qp" in low \
            or (ib and ("retry" in low or "timed out" in low)):
        return HINTS["gid"]
    if "failed to initialize any net plugin" in low:
        return HINTS["net_init"]
    if "closed by remote peer" in low:
        return HINTS["peer_closed"]
    if "connection refused" in low or "socketstartconnect" in low or "connection abort" in low \
            or ("connect to" in low and "failed" in low) or "bootstrap" in low and "connect" in low \
            or ("timed out" in low and not ib) \
            or (traces and any(t.startswith(("bootstrap.cc", "misc/socket.cc")) for t in traces)
                and ("socket" in low or "connect" in low)):
        return HINTS["bootstrap"]
    if "ibv_reg_mr" in low or "cannot allocate memory" in low or "memlock" in low:
        return HINTS["socket_memlock"]
    if "socket" in low and ("interface" in low or "ifname" in low):
        return HINTS["ifname"]
    if "no device" in low or "ibv_open_device" in low:
        return HINTS["socket_nodev"]
    return GENERIC


def judge(text: str, source: str, expect_hcas: list[str] | None = None) -> RankVerdict:
    version = None
    hcas: list[str] = []
    at: dict[int, str] = {}
    devices: set[int] = set()
    channels: list[tuple[str, bool]] = []
    warnings: list[str] = []
    traces: list[str] = []
    no_ib_device = memlock_error = False
    rocev: set[str] = set()       # the listed HCAs whose link layer is RoCE
    conflict = False              # two processes of the log number their HCAs differently
    ucx_errors: list[str] = []
    for line in text.splitlines():
        u = _UCX_ERROR.search(line)
        if u and u.group(1) not in ucx_errors:
            ucx_errors.append(u.group(1))
    hca_setting = None
    m = _VERSION.search(text)  # older NCCL prints it on a line of its own, without `NCCL INFO`
    if m:
        version = m.group(1)
    nnodes = [int(n) for n in _NNODES.findall(text)]
    for level, msg, line in _messages(text):
        m = _IB_USING.search(msg)
        if m:
            for i, h, r in _HCA_AT.findall(m.group(1)):
                conflict = conflict or at.get(int(i), h) != h
                at[int(i)] = h
                if r:
                    rocev.add(h)
            for h in _HCA.findall(m.group(1)):
                if h not in hcas:
                    hcas.append(h)
        m = _CHANNEL.search(msg)
        if m:
            channels.append((m.group("name"), "/GDRDMA" in m.group("flags") + "/"))
            if _family(m.group("name")) == "IB":
                devices.add(int(m.group("dev")))
        h = _IB_HCA_SET.search(msg)
        if h:
            hca_setting = h.group(1)
        if "NET/IB : No device found" in msg:
            no_ib_device = True
        if "ibv_reg_mr" in msg or "Cannot allocate memory" in msg:
            memlock_error = True
        if level in ("WARN", "ERROR"):
            if msg not in warnings:
                warnings.append(msg)
        else:
            t = _TRACE.match(msg.strip())
            if t and not t.group(1).startswith("plugin/") and msg.strip() not in traces:
                traces.append(msg.strip())  # (a plugin that fails to load is not a failure)
    if nnodes and max(nnodes) < 2:
        channels = []  # NET channels between ranks of one node (NCCL_P2P_LEVEL/SHM_DISABLE) prove nothing
    plugins = sorted({k for k, _ in channels})
    channels = [(_family(k), g) for k, g in channels]
    kinds = sorted({k for k, _ in channels})
    transport = None if not kinds else ("Socket" if "Socket" in kinds else kinds[0] if len(kinds) == 1 else "+".join(kinds))
    rdma = transport in ("IB", "Libfabric", "UCX")
    gdrdma = bool(channels) and all(g for k, g in channels) and rdma
    reasons: list[str] = []
    if transport is None and nnodes and max(nnodes) < 2:
        reasons.append("every communicator in the log is single-node (nNodes 1): no inter-node channel to judge "
                       f"(fix: {HINTS['nochannel']})")
    elif transport is None:
        reasons.append(f"no inter-node channel seen (fix: {HINTS['nochannel']})")
    elif transport in ("Libfabric", "UCX") and expect_hcas:
        what = PLUGIN_WHAT[transport]
        reasons.append(f"{len(channels)} inter-node channel(s) over {what}, not NCCL's IB verbs on the rail's "
                       f"{', '.join(expect_hcas)} (fix: {HINTS['other_plugin'].format(what=transport)})")
    elif not rdma:
        why = HINTS["socket_nodev"] if no_ib_device and not memlock_error else \
            HINTS["socket_memlock"] if memlock_error else HINTS["socket"] if "Socket" in kinds else \
            f"NCCL used the {'/'.join(plugins)} net plugin, not RDMA: remove it or set NCCL_NET=IB"
        n = sum(1 for k, _ in channels if k not in ("IB", "Libfabric", "UCX"))
        reasons.append(f"{n} inter-node channel(s) over {transport}, not IB (fix: {why})")
    elif not gdrdma:
        n = sum(1 for k, g in channels if not g)
        what = "IB" if transport == "IB" else PLUGIN_WHAT[transport]
        reasons.append(f"{n} of {len(channels)} inter-node {what} channel(s) without GPUDirect RDMA "
                       f"(fix: {HINTS['nogdr']})")
    # an HCA NCCL listed carries traffic only if a channel runs over it; with channels mapped to their
    # `Using` entries, one listed but idle is a latent misconfiguration (a note), not a failure
    mapped = transport == "IB" and bool(devices) and devices <= set(at) and not conflict
    carried = {at[d] for d in devices} if mapped else set(hcas)
    roce = bool(carried & rocev)
    notes: list[str] = []
    pulled = _prefix_pulled(hca_setting, hcas)
    if pulled:
        exact = ",".join(h for h in hcas if h not in pulled) if not expect_hcas else ",".join(expect_hcas)
        busy = [h for h in pulled if h in carried]
        finding = (f"NCCL_IB_HCA={hca_setting} matched by prefix and pulled in {', '.join(busy or pulled)}"
                   + ("" if busy else f", which no channel runs over (the traffic is on {', '.join(sorted(carried))})"))
        (reasons if busy else notes).append(f"{finding} (fix: {HINTS['hca_prefix'].format(exact=exact)})")
    if transport == "IB" and expect_hcas:
        if not hcas:
            reasons.append("the HCAs in use are not in the log (fix: NCCL_DEBUG_SUBSYS must include INIT,NET)")
        else:
            other = [h for h in hcas if h not in expect_hcas and h not in pulled]
            busy = [h for h in other if h in carried]
            if busy:
                reasons.append(f"uses {', '.join(busy)}, not the configured rail's {', '.join(expect_hcas)} "
                               f"(fix: {HINTS['hca']}={','.join(expect_hcas)})")
            elif other:
                notes.append(f"lists {', '.join(other)} beside the configured rail's {', '.join(expect_hcas)}, and no "
                             f"channel runs over {'it' if len(other) == 1 else 'them'} "
                             f"(fix: {HINTS['hca']}={','.join(expect_hcas)})")
    advice = [w for w in warnings if any(a in w.lower() for a in ADVICE)]
    notes += [f"NCCL WARN {w} (fix: the warning names it)" for w in advice]
    failing = [w for w in warnings if w not in advice]
    hints = []
    for w in failing:
        hints.append(_warn_hint(w, traces, failing))
        reasons.append(f"NCCL WARN {w} (fix: {hints[-1]})")
    if traces:  # one failure unwinds as a chain of `file:line -> code` frames: one reason for the chain
        threads = sorted({m.group(4) for m in map(_TRACE.match, traces) if m and m.group(4)})
        chain = ", ".join(traces) if len(traces) <= 3 else f"{traces[0]}, ..., {traces[-1]}"
        where = f", through NCCL's {' and '.join(threads)}" if threads else ""
        known = [h for h in hints if h != GENERIC]
        fix = HINTS["bootstrap"] if not failing and any(t.startswith("bootstrap.cc") for t in traces) else \
            f"it unwinds the WARN before it: {known[0]}" if known else \
            "read the WARN before it; NCCL_DEBUG_SUBSYS=ALL shows more"
        reasons.append(f"error return trace {chain} ({len(traces)} frame(s){where}) (fix: {fix})")
    for ucx in ucx_errors:
        reasons.append(f"UCX ERROR {ucx} (fix: {HINTS['ucx']})")
    verdict = "pass" if not reasons else "fail"
    plugin = plugins[0] if len(plugins) == 1 else ("+".join(plugins) if plugins else None)
    return RankVerdict(source, verdict, transport, gdrdma, hcas, version, warnings, reasons, plugin, roce, notes)


def _prefix_pulled(setting: str | None, hcas: list[str]) -> list[str]:
    """HCAs in use that `NCCL_IB_HCA` (NCCL's prefix form: no leading `=`, no `^`) names only as a prefix."""
    if not setting or setting.startswith(("=", "^")):
        return []
    names = [e.split(":")[0] for e in setting.split(",") if e]
    return [h for h in hcas if h not in names and any(h.startswith(n) for n in names)]


# ---------------------------------------------------------------- one host: the intra-node transport
#
# On one host NCCL should move an all-reduce GPU to GPU: over NVLink (or PCIe) peer-to-peer, or
# through the NVSwitch with NVLink SHARP (NVLS). The formats, from NCCL's sources
# (src/transport/p2p.cc, shm.cc, net.cc, nvls.cc, init.cc, graph/paths.cc, v2.4 to 2.30):
#   Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read        (also P2P/CUMEM, P2P/IPC[/read], P2P/MNNVL,
#   Channel 00/0 : 7[7] -> 6[6] via P2P/direct pointer     P2P/indirect/3[3], /CE; 2.7-2.12: `Channel 00 :
#   Ring 00 : 3[3] -> 1[1] via P2P/IPC                     0[87000] -> ...`, 2.4: `Ring 00 : ...`)
#   Channel 00 : 0[1] -> 1[2] via SHM/direct/direct        (2.30: `via SHM/direct`; <= 2.12: `via direct
#                                                            shared memory`): through host memory
#   Channel 00/0 : 0[0] -> 1[1] [send] via NET/Socket/0    (ranks of one host over the network)
#   NVLS comm 0x... headRank 3 nHeads 8 ...; `24 coll channels, ..., 16 nvls channels, ...`
#   NCCL_P2P_DISABLE set by environment to 1; NCCL_P2P_LEVEL set by environment to LOC;
#   P2P is disabled between connected GPUs 1 and 2. (NVML: no P2P, e.g. ACS or the IOMMU)

_LOCAL_CHANNEL = re.compile(r"\b(?:Channel|Ring) \d+(?:/\d+)? ?: (\d+)(?:\[[0-9a-fA-Fx]+\])? -> (\d+)"
                            r"(?:\[[0-9a-fA-Fx]+\])?(?: \[(?:send|receive)\])? via (.+?)\s*$")
_RAY_REPEAT = re.compile(r"\s*\[repeated \d+x across cluster\]$")
_LOCAL_RANKS = re.compile(r"\blocalRanks (\d+)")
_NVLS_COMM = re.compile(r"\bNVLS comm 0x[0-9a-fA-F]+ headRank")
_NVLS_CHANNELS = re.compile(r"\b(\d+) nvls channels")
_ENV_SET = re.compile(r"\b(NCCL_P2P_DISABLE|NCCL_P2P_LEVEL|NCCL_SHM_DISABLE) set by environment to (\S+?)\.?$")
_P2P_OFF_HW = re.compile(r"P2P is disabled between (?:NVLINK )?connected GPUs (\d+) and (\d+)")

INTRA_HINTS = {
    "p2p_disable": "NCCL_P2P_DISABLE=1 is set (vllm_extra_env, the image's environment or /etc/nccl.conf): remove it; "
                   "GPUs of one host must talk peer-to-peer",
    "p2p_level": "NCCL_P2P_LEVEL={level} limits peer-to-peer (LOC turns it off): unset it",
    "p2p_hw": "the driver reports no peer-to-peer between GPUs {pair}: PCIe ACS or the IOMMU blocks peer traffic "
              "(disable ACS on the PCIe switches, boot with iommu=pt), or on an NVSwitch system "
              "nvidia-fabricmanager is not running (systemctl status nvidia-fabricmanager); "
              "`nvidia-smi topo -p2p r` must say OK between every pair",
    "shm": "NCCL found no peer-to-peer path between these GPUs: `nvidia-smi topo -m` should show NV# between them and "
           "`nvidia-smi topo -p2p r` OK; check nvidia-fabricmanager on NVSwitch systems, ACS/IOMMU on PCIe systems, "
           "and that every rank runs in one container with --ipc host",
    "net": "ranks of one host went through the network: peer-to-peer and shared memory are both off or impossible "
           "({set}): unset them, and run every rank in one container with --ipc host",
    "nnodes": "NCCL counted {n} nodes: the ranks do not share one host identity (separate containers or network "
              "namespaces, NCCL_HOSTID); run them in one container with --network host --ipc host",
    "nochannel": "no channel line in the log: NCCL_DEBUG=INFO with NCCL_DEBUG_SUBSYS including INIT, at least 2 "
                 "ranks, and a collective that ran",
    "shm_space": "/dev/shm is too small for NCCL's buffers: run the container with --ipc host (or a larger "
                 "--shm-size)",
}


@dataclass
class IntraVerdict:
    """The intra-node transport of one host's ranks, judged from their (merged) NCCL log."""

    source: str
    verdict: str                  # pass | fail
    transport: str | None         # P2P | SHM | NET/Socket | ... (the worst seen) | None: no channel seen
    paths: list[str]              # the distinct `via` paths: P2P/CUMEM/read, SHM/direct/direct, ...
    channels: dict[str, int]      # channel lines per kind: {"P2P": 96, "SHM": 0, ...}
    nvls: bool                    # NVLink SHARP in use (NVLS buffers, or nvls channels > 0)
    local_ranks: int | None       # localRanks NCCL reported (the largest)
    nodes: int | None             # nNodes NCCL reported (the largest)
    nccl_version: str | None
    env: dict[str, str]           # NCCL_P2P_DISABLE / NCCL_P2P_LEVEL / NCCL_SHM_DISABLE as NCCL echoed them
    warnings: list[str]
    reasons: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


def _kind(path: str) -> str:
    if path.startswith("P2P/"):
        return "P2P"
    if path.startswith("SHM") or path == "direct shared memory":
        return "SHM"
    if path.startswith("NET/"):
        return "NET/" + path.split("/")[1]
    return path.split("/")[0]


def _intra_warn_hint(msg: str) -> str:
    low = msg.lower()
    if "shared memory" in low or "/dev/shm" in low or "no space left" in low:
        return INTRA_HINTS["shm_space"]
    m = _P2P_OFF_HW.search(msg)
    if m:
        return INTRA_HINTS["p2p_hw"].format(pair=f"{m.group(1)} and {m.group(2)}")
    return _warn_hint(msg)


def judge_intranode(text: str, source: str) -> IntraVerdict:
    """Pass only on positive evidence that the ranks of one host reduce GPU to GPU: channels via P2P/...
    (or NVLS in use), none via SHM or NET, one node, no NCCL WARN. Every failure names the fix."""
    version = None
    m = _VERSION.search(text)
    if m:
        version = m.group(1)
    nodes = max((int(n) for n in _NNODES.findall(text)), default=None)
    local = max((int(n) for n in _LOCAL_RANKS.findall(text)), default=None)
    counts: dict[str, int] = {}
    paths: list[str] = []
    env: dict[str, str] = {}
    warnings: list[str] = []
    p2p_off_pairs: list[str] = []
    nvls = False
    for level, msg, _line in _messages(text):
        msg = _RAY_REPEAT.sub("", msg)
        c = _LOCAL_CHANNEL.search(msg)
        if c:
            path = c.group(3)
            if path.startswith("P2P/indirect/"):
                path = "P2P/indirect"
            elif path.startswith("NET/"):
                path = path.split()[0]  # RCCL appends `comm 0x... nRanks 02`
            kind = _kind(path)
            counts[kind] = counts.get(kind, 0) + 1
            if path not in paths:
                paths.append(path)
        if _NVLS_COMM.search(msg):
            nvls = True
        n = _NVLS_CHANNELS.search(msg)
        if n and int(n.group(1)) > 0:
            nvls = True
        e = _ENV_SET.search(msg)
        if e:
            env[e.group(1)] = e.group(2)
        h = _P2P_OFF_HW.search(msg)
        if h and f"{h.group(1)} and {h.group(2)}" not in p2p_off_pairs:
            p2p_off_pairs.append(f"{h.group(1)} and {h.group(2)}")
        if level in ("WARN", "ERROR") and msg not in warnings:
            warnings.append(msg)
    kinds = [k for k in counts if k != "P2P"]
    transport = None if not counts else (
        next((k for k in kinds if k.startswith("NET/")), None) or ("SHM" if "SHM" in kinds else None)
        or (kinds[0] if kinds else "P2P"))
    reasons: list[str] = []

    def why_not_p2p() -> str:
        if env.get("NCCL_P2P_DISABLE") == "1":
            return INTRA_HINTS["p2p_disable"]
        if env.get("NCCL_P2P_LEVEL"):
            return INTRA_HINTS["p2p_level"].format(level=env["NCCL_P2P_LEVEL"])
        if p2p_off_pairs:
            return INTRA_HINTS["p2p_hw"].format(pair=", ".join(p2p_off_pairs))
        return INTRA_HINTS["shm"]

    if nodes is not None and nodes > 1:
        reasons.append(f"NCCL counted {nodes} nodes, not one host (fix: {INTRA_HINTS['nnodes'].format(n=nodes)})")
    if not counts and not nvls:
        reasons.append(f"no channel seen (fix: {INTRA_HINTS['nochannel']})")
    total = sum(counts.values())
    if counts.get("SHM"):
        reasons.append(f"{counts['SHM']} of {total} channel(s) via SHM (host shared memory), not GPU peer-to-peer "
                       f"(fix: {why_not_p2p()})")
    seen = ", ".join(f"{k}={v}" for k, v in env.items() if not (k == "NCCL_P2P_DISABLE" and v == "0"))
    for k in kinds:
        if k.startswith("NET/"):
            fix = INTRA_HINTS["net"].format(set=f"{seen} set" if seen else
                                            "NCCL_P2P_DISABLE, NCCL_P2P_LEVEL or NCCL_SHM_DISABLE")
            reasons.append(f"{counts[k]} of {total} channel(s) via {k} between ranks of one host (fix: {fix})")
        elif k != "SHM":
            reasons.append(f"{counts[k]} of {total} channel(s) via {k}, not peer-to-peer (fix: {why_not_p2p()})")
    for w in warnings:
        reasons.append(f"NCCL WARN {w} (fix: {_intra_warn_hint(w)})")
    return IntraVerdict(source, "pass" if not reasons else "fail", transport, paths, counts, nvls, local, nodes,
                        version, env, warnings, reasons)
