"""The NCCL judge on public captures of the three failures the lab simulates: a wrong NCCL_IB_GID_INDEX, an MTU
mismatch between the hosts, a memlock limit too small for RDMA registration; plus the NCCL 2.30 line formats.
Origins: fixtures/real/nccl/public/ORIGINS.md, section "The lab simulator's three failure modes"."""

import pytest

from railyard.checks.nccl import judge

from .conftest import REAL

PUB = REAL / "nccl" / "public"

GID_TITLE_283 = "nccl2.8.3-2node-roce-default-gid-index_ib-completion-error-12-vendor-err-129_title-line_fragment.log"
GID_NO_SUCH_DEVICE = "k8s-pods-nccl2.11_wrong-nccl-ib-gid-index_ibv-modify-qp-no-such-device_line_fragment.log"
GID_TIMED_OUT = "a100-roce-gid-index-1-link-local-v2_ibv-modify-qp-connection-timed-out_line_fragment.log"
RETRY_230 = ("nccl2.30.4-2node-roce_ib-completion-retry-exc-err-12-vendor-err-129-hca_cqe-error_markdown-autolinks"
             "_fragment.log")
INIT_230 = "nccl2.30.4-2node-4rank-roce-2hca_net-ib-no-gdrdma-nic-gdr0_gid-index-3-dot_fragments.log"
MTU_220 = "nccl2.20-2node-roce_mtu-mismatch_async-local-access-violation_status-5-vendor-err-249_fragment.log"
MEMLOCK_TITLE = "nccl-tests-memlock-8192k_ibv-reg-mr-iova2-cannot-allocate-memory_title-line_fragment.log"
MEMLOCK_BLOG = "k8s-ib-hpcx-plugin-memlock-64k_ibv-reg-mr-failed_ib-plugin-trace_blog_fragment.log"
GDR_ENABLED_216 = "nccl-tests-a100-2node-nccl2.16.5_net-ib-gpu-direct-rdma-enabled-for-hca_gdrdma_fragments.log"


def j(name, expect=None):
    path = PUB / name
    return judge(path.read_text(errors="replace"), str(path), expect)


def warn_reasons(v):
    return [r for r in v.reasons if r.startswith("NCCL WARN")]


# ---------------------------------------------------------------- wrong NCCL_IB_GID_INDEX

@pytest.mark.parametrize("name, warning", [
    (GID_TITLE_283, "NET/IB : Got completion with error 12, opcode 0, len 0, vendor err 129"),
    (GID_NO_SUCH_DEVICE, "Call to ibv_modify_qp failed with error No such device"),
    (GID_TIMED_OUT, "Call to ibv_modify_qp failed with error Connection timed out"),
])
def test_wrong_gid_index_captures_fail_naming_the_gid_index(name, warning):
    v = j(name, ["mlx5_1"])
    assert v.verdict == "fail" and v.warnings == [warning]
    assert len(warn_reasons(v)) == 1 and "NCCL_IB_GID_INDEX must be the RoCE v2 index" in warn_reasons(v)[0]
    # none of them shows a channel line: a wrong GID index never rewrites `via NET/IB/0/GDRDMA` to `via NET/IB/0`
    assert v.net_transport is None and not v.gdrdma
    assert "no inter-node channel seen" in v.reasons[0]


def test_nccl_2_30_retry_exceeded_completion_format_is_read_and_gets_the_gid_mtu_fix():
    text = (PUB / RETRY_230).read_text()
    # the 2.30 form, as printed: `NET/IB:` without a space, `remoteGids` glued to the address, `hca` at the end
    assert "with status=IBV_WC_RETRY_EXC_ERR(12) opcode=IBV_WC_RDMA_WRITE(1) vendor_err=129 localGid" in text
    assert "remoteGids::ffff:1.1.2.2 hca mlx5_0" in text and "remoteGid ::ffff" not in text
    assert "transport/net_ib/[p2p.cc:648](https://p2p.cc:648/) NCCL WARN" in text  # GitHub's autolink, kept
    v = j(RETRY_230, ["mlx5_0"])
    assert v.verdict == "fail" and len(v.warnings) == 6
    completions = [r for r in warn_reasons(v) if "Got completion from peer" in r]
    assert len(completions) == 3
    assert all("IBV_WC_RETRY_EXC_ERR(12)" in r and "NCCL_IB_GID_INDEX" in r and "MTU" in r for r in completions)
    # the CQE line that precedes each completion is a WARN of its own: reported, never dropped
    assert sum("ncclIbTest: Got CQE with error" in r for r in warn_reasons(v)) == 3


# ---------------------------------------------------------------- MTU mismatch between the hosts

def test_mtu_mismatch_capture_fails_with_its_real_signature():
    v = j(MTU_220, ["mlx5_0"])
    assert v.verdict == "fail"
    assert v.warnings == [
        "NET/IB : mlx5_0:1 Got async event : local access violation work queue error",
        "NET/IB : Got completion from peer 192.168.1.2<57888> with status=5 opcode=1 len=0 vendor err 249 (Recv) "
        "localGid fe80::e61d:2dff:fef2:9c94 remoteGidsfe80::e61d:2dff:fef2:9fa0"]
    # the real MTU failure is not the retry-exceeded 12/129 the simulator prints
    assert not any("status=12" in w or "vendor err 129" in w for w in v.warnings)
    assert any("through NCCL's Progress Thread" in r for r in v.reasons)


def test_mtu_mismatch_capture_names_the_mtu():
    # the poster's cause (NCCL issue #1524): different MTUs on the two hosts; the async event comes first, the
    # flushed completion (status 5) after it carries the same fix, and the chain that unwinds them too
    v = j(MTU_220, ["mlx5_0"])
    warns = warn_reasons(v)
    assert len(warns) == 2 and all("an MTU that differs between the two ends" in r for r in warns), warns
    assert any(r.startswith("error return trace") and "MTU" in r for r in v.reasons)


# ---------------------------------------------------------------- memlock / IPC_LOCK

@pytest.mark.parametrize("name, warning", [
    (MEMLOCK_TITLE, "Call to ibv_reg_mr_iova2 failed with error Cannot allocate memory"),
    (MEMLOCK_BLOG, "Call to ibv_reg_mr failed"),
])
def test_memlock_captures_fail_naming_memlock_and_ipc_lock(name, warning):
    v = j(name, ["mlx5_1"])
    assert v.verdict == "fail" and v.warnings == [warning]
    assert len(warn_reasons(v)) == 1
    assert "--ulimit memlock=-1" in warn_reasons(v)[0] and "IPC_LOCK" in warn_reasons(v)[0]
    # no capture shows a memlock failure turning into a socket fallback: no channel, no "fell back to TCP"
    assert v.net_transport is None and not any("TCP" in r for r in v.reasons)


def test_memlock_blog_trace_through_the_ib_plugin_is_one_reason():
    v = j(MEMLOCK_BLOG)
    trace = [r for r in v.reasons if r.startswith("error return trace")]
    assert trace == ["error return trace ib_plugin.c:448 -> 2, include/net.h:23 -> 2, transport/net.cc:248 -> 2 "
                     "(3 frame(s)) (fix: it unwinds the WARN before it: registering memory failed: run the container "
                     "with --ulimit memlock=-1 and --cap-add IPC_LOCK)"]


# ---------------------------------------------------------------- NCCL 2.30 / 2.16 line formats of a working IB init

def test_nccl_2_30_ib_without_gdrdma_fails_and_reads_its_formats():
    text = (PUB / INIT_230).read_text()
    assert "NCCL INFO NCCL_IB_GID_INDEX set by environment to 3.\n" in text  # integer parameters end with a dot
    assert "NCCL INFO [Rank 1] ncclCommInitRank comm 0x5563e3b79140" in text and "ncclCommInitRankConfig" not in text
    v = j(INIT_230, ["mlx5_0", "mlx5_1"])
    assert (v.verdict, v.net_transport, v.gdrdma, v.nccl_version) == ("fail", "IB", False, "2.30.4")
    assert v.hcas == ["mlx5_0", "mlx5_1"] and v.warnings == []
    assert v.reasons == ["8 of 8 inter-node IB channel(s) without GPUDirect RDMA (fix: load the GPU peer-memory module "
                         "(sudo modprobe nvidia_peermem) or use a DMA-BUF capable driver and kernel; check "
                         "NCCL_NET_GDR_LEVEL)"]


def test_gdr_enabled_for_hca_line_carries_the_net_ib_prefix_and_the_run_passes():
    text = (PUB / GDR_ENABLED_216).read_text()
    assert "NCCL INFO NET/IB : GPU Direct RDMA Enabled for HCA 0 'mlx5_0'\n" in text
    v = j(GDR_ENABLED_216)
    assert (v.verdict, v.net_transport, v.gdrdma, v.nccl_version) == ("pass", "IB", True, "2.16.5"), v.reasons
    assert v.hcas == ["mlx5_0", "mlx5_2"]
    # every channel runs via NET/IB/1, [1]mlx5_2 (InfiniBand); [0]mlx5_0 (RoCE) is listed, idle
    rail = j(GDR_ENABLED_216, ["mlx5_2"])
    assert rail.verdict == "pass" and not v.roce and rail.notes[0].startswith("lists mlx5_0 beside the configured")
    other = j(GDR_ENABLED_216, ["mlx5_0"])
    assert other.verdict == "fail" and any("uses mlx5_2, not the configured rail's mlx5_0" in r for r in other.reasons)


# ---------------------------------------------------------------- WARN families with a known cause


@pytest.mark.parametrize("name, warning, fix", [
    ("k8s-horovod-sriov-ib_nccl2.4.8_mpi-timestamp-prefix_ring-no-gdrdma.log", "Unable to open device mlx5_0",
     "NCCL lists the HCA but cannot open it inside the container"),
    ("nccl-tests-2node-roce_ib-completion-error-vendor-err-81_fragment.log", "Got completion with error 4",
     "status 4 is IBV_WC_LOC_PROT_ERR"),
    # NCCL 2.30's `Got CQE with error` carries no status; the next WARN's (status=IBV_WC_RETRY_EXC_ERR(12)) fix
    ("nccl2.30.4-2node-roce_ib-completion-retry-exc-err-12-vendor-err-129-hca_cqe-error_markdown-autolinks_fragment.log",
     "ncclIbTest: Got CQE with error", "NCCL_IB_GID_INDEX must be the RoCE v2 index"),
    ("efa-ofi-register-mr-cuda-type2-einval_title_line_fragment.log", "Unable to register memory (type = 2)",
     "EFA installers before 1.29.1 with NCCL 2.19+"),
    ("efa-ofi-register-mr-host-type1-enomem_trace_fragment.log", "Unable to register memory (type = 1)",
     "--ulimit memlock=-1"),
])
def test_a_warn_with_a_known_cause_gets_its_fix_not_the_generic_one(name, warning, fix):
    v = j(name)
    mine = [r for r in warn_reasons(v) if warning in r]
    assert mine and all(fix in r for r in mine), warn_reasons(v)
    assert not any("read the warning; NCCL_DEBUG_SUBSYS=ALL" in r for r in v.reasons), v.reasons


def test_rccl_s_numa_balancing_advice_is_a_note_not_a_reason():
    # RCCL's WARN names its own fix ("sudo sysctl kernel.numa_balancing=0"): performance advice, not a failure
    v = j("vllm-ray-2node-rccl2.26.6_socket-fallback_no-libibverbs.log")
    assert not any("NUMA auto balancing" in r for r in v.reasons)
    assert any("NUMA auto balancing" in n for n in v.notes)
    assert v.verdict == "fail" and v.net_transport == "Socket"   # it fails for its socket fallback, as before
