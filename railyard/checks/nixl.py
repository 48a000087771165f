"""The NIXL judge: did KV blocks move over UCX on the rail's RDMA devices, not TCP?

With UCX_LOG_LEVEL=info (railyard sets it on every pd instance, as NCCL_DEBUG=INFO for NCCL),
UCX prints what each endpoint to another host uses:

    [1764583211.10] [P1:4121:a]  ucp_worker.c:1903 UCX  INFO  ucp_context_0 inter-node cfg#1 rma(rc_mlx5/mlx5_0:1) am(rc_mlx5/mlx5_0:1) ka(ud_mlx5/mlx5_0:1)
    [1764583211.10] [P1:4121:a]  ucp_worker.c:1903 UCX  INFO  ucp_context_0 inter-node cfg#1 rma_am(tcp/enp24s0np0) am(tcp/enp24s0np0) ka(tcp/enp24s0np0)

on both ends of a KV transfer (decode reads, prefill is read from). A pass needs positive evidence:
an inter-node endpoint over an RDMA transport (rc/dc/ud over mlx5 or verbs) on one of the host's
rail HCAs, and no endpoint over tcp; an instance no transfer has touched yet is not a pass
(verify-rdma sends requests through the proxy first, so that round robin reaches every one).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

_CFG = re.compile(r"UCX\s+INFO\s+\S+ inter-node cfg#\d+ (?P<lanes>.*)$")
_LANES = re.compile(r"(?P<kind>[a-z_]+)\((?P<items>[^)]*)\)")  # rma(rc_mlx5/mlx5_0:1) or tag(a/x b/y ...)
RDMA_TLS = ("rc_mlx5", "rc_verbs", "dc_mlx5", "ud_mlx5", "ud_verbs", "rc_x", "ib")
BACKEND_ERRORS = ("NIXL_ERR_BACKEND", "NIXL_ERR_REMOTE_DISCONNECT", "NIXL_ERR_NOT_FOUND")


@dataclass
class NixlVerdict:
    source: str
    verdict: str              # pass | fail
    transport: str | None     # rdma | tcp | None: no inter-node endpoint seen
    devices: list[str]        # the RDMA devices its endpoints used
    reasons: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


def judge(source: str, log: str, rail_hcas: list[str], ucx_net_devices: str | None) -> NixlVerdict:
    """One instance's container log and its UCX_NET_DEVICES against the host's rail HCAs."""
    rdma_devs, tcp_devs, reasons = [], [], []
    for line in log.splitlines():
        m = _CFG.search(line)
        if not m:
            continue
        for lanes in _LANES.finditer(m.group("lanes")):
            for item in lanes.group("items").split():
                tl, _, dev = item.partition("/")
                if tl in RDMA_TLS:
                    rdma_devs.append(dev.split("/")[0])
                elif tl == "tcp":
                    tcp_devs.append(dev)
    errors = sorted({e for e in BACKEND_ERRORS if e in log})
    if errors:
        reasons.append(f"NIXL failed: {', '.join(errors)} in the log (fix: the image's UCX, not one from a pip wheel; "
                       "inv logs for the traceback)")
    if ucx_net_devices is None:
        reasons.append("UCX_NET_DEVICES is not set in the container: UCX may pick any device, TCP included "
                       "(fix: inv env and inv launch --recreate)")
    elif ucx_net_devices != "all":
        listed = [d.split(":")[0] for d in ucx_net_devices.split(",") if d]
        if not any(d in rail_hcas for d in listed):
            reasons.append(f"UCX_NET_DEVICES={ucx_net_devices} names no rail HCA of the host ({', '.join(rail_hcas)}) "
                           "(fix: pd_ucx_net_devices)")
    if tcp_devs:
        reasons.append(f"KV blocks moved over TCP ({', '.join(sorted(set(tcp_devs)))}), not RDMA (fix: /dev/infiniband, "
                       "IPC_LOCK and unlimited memlock in the container, an rc transport in UCX_TLS, rail HCAs in "
                       "UCX_NET_DEVICES)")
    off_rail = sorted({d for d in rdma_devs if d.split(":")[0] not in rail_hcas})
    if off_rail:
        reasons.append(f"RDMA over {', '.join(off_rail)}, which is not a rail HCA of the host")
    if not rdma_devs and not tcp_devs:
        reasons.append("no UCX inter-node endpoint in the log: no KV transfer touched this instance yet, or "
                       "UCX_LOG_LEVEL is not info (fix: requests through the proxy, then verify again)")
    transport = "tcp" if tcp_devs else ("rdma" if rdma_devs else None)
    ok = not reasons and bool(rdma_devs)
    return NixlVerdict(source, "pass" if ok else "fail", transport, sorted(set(rdma_devs)), reasons)
