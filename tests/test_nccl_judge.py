"""The NCCL log judge on real logs: fixtures/real/nccl (origins in ORIGINS*.md beside them)."""

import json

import pytest

from railyard.checks.nccl import judge, judge_intranode

from .conftest import REAL, inv_cmd

NCCL = REAL / "nccl"
PUB = NCCL / "public"


def j(path, expect=None):
    return judge(path.read_text(errors="replace"), str(path), expect)


def test_roce_gdrdma_run_passes_despite_a_failed_plugin_and_no_enabled_line():
    v = j(NCCL / "sglang-dsr1-2node-8xroce-gdrdma-nccl2.27.5.log")
    assert (v.verdict, v.net_transport, v.gdrdma, v.nccl_version) == ("pass", "IB", True, "2.27.5")
    assert v.hcas == ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_5", "mlx5_6", "mlx5_7", "mlx5_8", "mlx5_11"]
    text = (NCCL / "sglang-dsr1-2node-8xroce-gdrdma-nccl2.27.5.log").read_text()
    assert "plugin/net.cc:118 -> 2" in text and "GPU Direct RDMA Enabled" not in text
    # judged against a rail: HCAs outside it fail, naming them
    narrow = j(NCCL / "sglang-dsr1-2node-8xroce-gdrdma-nccl2.27.5.log", ["mlx5_0"])
    assert narrow.verdict == "fail" and any("not the configured rail's mlx5_0" in r for r in narrow.reasons)


@pytest.mark.parametrize("scenario", ["default", "default_subsys_all", "ib_disabled", "lo_socket"])
def test_h200_socket_fallbacks_fail_with_the_reason(scenario):
    for rank in (0, 1):
        v = j(NCCL / f"h200-two-hosts-one-gpu_{scenario}_nccl2.28.9_r{rank}.log")
        assert (v.verdict, v.net_transport, v.gdrdma, v.nccl_version) == ("fail", "Socket", False, "2.28.9")
        assert "over Socket, not IB" in v.reasons[0]
    text = (NCCL / f"h200-two-hosts-one-gpu_{scenario}_nccl2.28.9_r0.log").read_text()
    if scenario != "ib_disabled":
        # the trap: a line that contains "GPU Direct RDMA" in a broken setup
        assert "GPU Direct RDMA Disabled for HCA" in text
        assert "/dev/infiniband" in j(NCCL / f"h200-two-hosts-one-gpu_{scenario}_nccl2.28.9_r0.log").reasons[0]


def test_h200_forced_ib_and_bad_socket_interface_fail_on_their_warnings():
    v = j(NCCL / "h200-two-hosts-one-gpu_net_ib_forced_nccl2.28.9_r0.log")
    assert v.verdict == "fail" and v.net_transport is None
    assert v.warnings == ["Failed to initialize any NET plugin"]
    b = j(NCCL / "h200-two-hosts-one-gpu_bad_socket_ifname_nccl2.28.9_r0.log")
    assert b.verdict == "fail" and b.nccl_version is None  # that log never reached its version line
    assert b.warnings == ["Bootstrap : no socket interface found"]
    assert any("NCCL_SOCKET_IFNAME" in r for r in b.reasons)
    silent = j(NCCL / "h200-two-hosts-one-gpu_bad_socket_ifname_nccl2.28.9_r1.log")  # 2 lines: nothing to prove
    assert silent.verdict == "fail" and "no inter-node channel seen" in silent.reasons[0]


def test_vllm_ray_prefixes_and_dedup_markers_still_pass():
    v = j(PUB / "vllm-ray-2node-8xib-gdrdma_nccl2.21.5_ray-prefix-dedup.log")
    assert (v.verdict, v.net_transport, v.gdrdma, v.nccl_version) == ("pass", "IB", True, "2.21.5")


def test_mpi_prefixes_old_ring_format_without_gdrdma_fail():
    v = j(PUB / "k8s-horovod-sriov-ib_nccl2.4.8_mpi-timestamp-prefix_ring-no-gdrdma.log")
    assert (v.verdict, v.net_transport, v.gdrdma, v.nccl_version) == ("fail", "IB", False, "2.4.8")
    assert any("without GPUDirect RDMA" in r for r in v.reasons)
    assert any("ibv_open_device" in w for w in v.warnings)


def test_old_busid_channel_format_is_read():
    v = j(PUB / "a100-nccl2.7.6_busid-channel-format_fragments.log")
    assert v.net_transport == "IB" and v.gdrdma and v.nccl_version == "2.7.6"
    assert "mlx5_8" in v.hcas


def test_nccl_2_4_socket_using_at_init_is_not_taken_for_a_fallback():
    v = j(PUB / "horovod-nccl2.4.7_socket-using-at-init-then-net-ib_fragment.log")
    assert v.net_transport is None  # no channel lines in this fragment: not "Socket"
    assert v.verdict == "fail" and "no inter-node channel seen" in v.reasons[0]


@pytest.mark.parametrize("name", ["dgx-spark-vllm-ray_ibext_v10-dmabuf_fragments.log",
                                  "64rank-ibext_v8-channels-no-gdrdma_fragment.log"])
def test_external_ib_plugins_count_as_ib_but_need_gdrdma(name):
    v = j(PUB / name)
    assert v.net_transport == "IB" and not v.gdrdma and v.verdict == "fail"


def test_ib_with_gdr_disabled_by_distance_fails():
    v = j(PUB / "horovod-2node-ib_gdr-disabled-distance_ring-net-ib-0_fragment.log")
    assert v.net_transport == "IB" and not v.gdrdma and v.verdict == "fail"


@pytest.mark.parametrize("name", ["ibext-plugin-loaded-yet-socket-channels_fragments.log",
                                  "vllm-ray-2node-rccl2.26.6_socket-fallback_no-libibverbs.log"])
def test_plugin_loaded_yet_socket_channels_fail(name):
    v = j(PUB / name)
    assert v.net_transport == "Socket" and v.verdict == "fail"


def test_ib_completion_error_fails_with_the_warning():
    v = j(PUB / "nccl-tests-2node-roce_ib-completion-error-vendor-err-81_fragment.log")
    assert v.verdict == "fail" and any("vendor err 81" in w for w in v.warnings)


def test_cli_judges_local_files_without_ssh_json_contract():
    r = inv_cmd("verify-rdma", "--log", str(NCCL / "sglang-dsr1-2node-8xroce-gdrdma-nccl2.27.5.log"),
                "--log", str(NCCL / "h200-two-hosts-one-gpu_default_nccl2.28.9_r0.log"), "--json")
    assert r.returncode == 1
    doc = json.loads(r.stdout)
    assert doc["ok"] is False and [x["verdict"] for x in doc["data"]["ranks"]] == ["pass", "fail"]
    assert set(doc["data"]["ranks"][0]) == {"source", "verdict", "net_transport", "gdrdma", "hcas", "nccl_version",
                                            "warnings", "reasons", "net_plugin", "roce", "notes"}
    assert [x["net_transport"] for x in doc["data"]["ranks"]] == ["IB", "Socket"]
    ok = inv_cmd("verify-rdma", "--log", str(NCCL / "sglang-dsr1-2node-8xroce-gdrdma-nccl2.27.5.log"))
    assert ok.returncode == 0 and "PASS" in ok.stdout
    missing = inv_cmd("verify-rdma", "--log", "/nonexistent/nccl.log")
    assert missing.returncode == 2 and "--log /nonexistent/nccl.log" in missing.stderr


# ---------------------------------------------------------------- real logs of shapes the judge had not seen (issue 15)

def test_ray_dedup_suffix_after_the_channel_path_still_reads_gdrdma():
    v = j(PUB / "vllm-ray-2node-ib_gdrdma-channels-ray-repeated-suffix_fragment.log")
    assert (v.verdict, v.net_transport, v.gdrdma, v.nccl_version) == ("pass", "IB", True, "2.21.5"), v.reasons
    assert "via NET/IB/0/GDRDMA [repeated 14x across cluster]" in (
        PUB / "vllm-ray-2node-ib_gdrdma-channels-ray-repeated-suffix_fragment.log").read_text()


def test_ib_verbs_plugins_that_do_not_call_themselves_ib_are_ib():
    v = j(PUB / "tencent-h20-2node_net-nccl-rdma-plugin-v6-gdrdma-shared_nccl2.26.5_fragments.log")
    assert (v.verdict, v.net_transport, v.gdrdma, v.net_plugin) == ("pass", "IB", True, "NCCL RDMA Plugin v6")
    assert v.hcas == ["mlx5_bond_6", "mlx5_bond_7"] and v.nccl_version == "2.26.5"
    # judged against a rail: every channel of the fragment runs via NET/.../0, [0]mlx5_bond_6; the other HCA
    # NCCL lists carries none, so it is a warning, never a failure and never a TCP fallback
    narrow = j(PUB / "tencent-h20-2node_net-nccl-rdma-plugin-v6-gdrdma-shared_nccl2.26.5_fragments.log", ["mlx5_bond_6"])
    assert narrow.verdict == "pass" and narrow.notes[0].startswith("lists mlx5_bond_7 beside the configured rail's")
    wrong = j(PUB / "tencent-h20-2node_net-nccl-rdma-plugin-v6-gdrdma-shared_nccl2.26.5_fragments.log", ["mlx5_bond_7"])
    assert wrong.verdict == "fail" and any("uses mlx5_bond_6, not the configured rail's" in r for r in wrong.reasons)
    v8 = j(PUB / "64rank-ibext_v8-channels-no-gdrdma_fragment.log")
    assert (v8.net_transport, v8.net_plugin, v8.verdict) == ("IB", "IBext_v8", "fail")
    assert "IB channel(s) without GPUDirect RDMA" in v8.reasons[0]


@pytest.mark.parametrize("name", ["aws-efa-nccl2.9.9_net-aws-libfabric-gdrdma_fragment.log",
                                  "sagemaker-efa_net-aws-libfabric-gdrdma-shared_cloudwatch-prefix_fragment.log"])
def test_libfabric_efa_is_named_never_a_tcp_fallback(name):
    v = j(PUB / name)
    assert (v.verdict, v.net_transport, v.gdrdma, v.net_plugin) == ("pass", "Libfabric", True, "AWS Libfabric")
    # railyard's own ranks run NCCL's IB on the rail HCA: there the plugin is the finding, named as such
    own = j(PUB / name, ["mlx5_1"])
    assert own.verdict == "fail" and "Libfabric (the aws-ofi-nccl plugin" in own.reasons[0]
    assert "NCCL_NET=IB" in own.reasons[0] and not any("TCP" in r for r in own.reasons)


def test_ucx_plugin_with_rccl_comm_suffix_is_named_and_its_error_fails():
    v = j(PUB / "rccl-ucx-plugin-2node_net-ucx-gdrdma-comm-suffix_ucx-error_fragment.log")
    assert (v.net_transport, v.gdrdma, v.net_plugin, v.verdict) == ("UCX", True, "UCX", "fail")
    assert v.reasons == ["UCX ERROR failed to insert region 0x1479900ba210 [0x0..0x0]: Invalid parameter (fix: the UCX "
                         "transport reported an error: read it (UCX_LOG_LEVEL=info shows more), check UCX_NET_DEVICES "
                         "names the rail HCA)"]


def test_bootstrap_connection_refused_gets_the_bootstrap_fix_not_gid():
    v = j(PUB / "espnet-4node_bootstrap-connect-refused_nccl-socket-h_fragment.log")
    assert v.verdict == "fail" and v.warnings == ["Connect to 10.38.10.112<21724> failed : Connection refused"]
    warn = next(r for r in v.reasons if r.startswith("NCCL WARN"))
    assert "NCCL_SOCKET_IFNAME" in warn and "before any RDMA" in warn and "GID" not in warn
    assert [r for r in v.reasons if r.startswith("error return trace")] == [
        "error return trace bootstrap.cc:100 -> 2, bootstrap.cc:326 -> 2, init.cc:695 -> 2 (3 frame(s)) (fix: it "
        "unwinds the WARN before it: " + warn.split("(fix: ", 1)[1]]     # the chain carries its WARN's fix
    closed = j(PUB / "nccl-bootstrap-closed-by-peer_async-thread-trace_fragment.log")
    assert any("peer rank closed the connection" in r for r in closed.reasons)
    # one chain of return frames, one reason, naming the async thread it went through
    trace = [r for r in closed.reasons if r.startswith("error return trace")]
    assert len(trace) == 1 and "(10 frame(s), through NCCL's Async thread)" in trace[0]
    sock = j(PUB / "nccl-tests-socket-transport-connect-abort_proxy-service-warn_fragment.log")
    assert sock.verdict == "fail" and not any("GID" in r for r in sock.reasons)


def test_ib_completion_error_wrapped_onto_two_lines_from_the_proxy_thread_gets_gid_mtu():
    v = j(PUB / "azure-ib-roce-mixed_net-ib-completion-error-12-wrapped-line_proxy-thread-trace_fragment.log")
    assert v.warnings == ["NET/IB : Got completion from peer 10.2.0.5<33092> with error 12, opcode 0, len 0, "
                          "vendor err 129 (Recv)"]
    assert any("NCCL_IB_GID_INDEX" in r and r.startswith("NCCL WARN") for r in v.reasons)
    assert any("through NCCL's Proxy Thread" in r for r in v.reasons)


def test_nccl_ib_hca_prefix_match_pulling_in_another_hca_is_flagged():
    v = j(PUB / "slurm-2node-16rank_nccl-ib-hca-prefix-pulls-mlx5_10_nccl2.29.3_fragment.log")
    assert "mlx5_10" in v.hcas and v.verdict == "fail"
    flag = [r for r in v.reasons if "matched by prefix" in r]
    assert len(flag) == 1 and "pulled in mlx5_10" in flag[0] and "NCCL_IB_HCA==mlx5_0," in flag[0]
    # judged against the rail: the cause is named once, not again as "uses mlx5_10, not the rail's"
    rail = j(PUB / "slurm-2node-16rank_nccl-ib-hca-prefix-pulls-mlx5_10_nccl2.29.3_fragment.log",
             [f"mlx5_{i}" for i in range(8)])
    assert sum("mlx5_10" in r for r in rail.reasons) == 1
    # the exact form and NCCL's own HCA set without a stray prefix are not flagged
    ok = j(NCCL / "sglang-dsr1-2node-8xroce-gdrdma-nccl2.27.5.log")
    assert ok.verdict == "pass" and not any("prefix" in r for r in ok.reasons)
    exact = judge("h:1:1 [0] NCCL INFO NCCL_IB_HCA set to =mlx5_1\n"
                  "h:1:1 [0] NCCL INFO NET/IB : Using [0]mlx5_1:1/RoCE [1]mlx5_10:1/RoCE [RO]; OOB e:1<0>\n", "x")
    assert not any("prefix" in r for r in exact.reasons)


def test_a_prefix_listed_hca_that_no_channel_runs_over_is_a_warning_not_a_failure():
    # the same job, with its channel lines: every NET/IB/<n> is an entry [0]-[7] (mlx5_0..mlx5_7), none [8] mlx5_10
    log = PUB / "slurm-2node-16rank_nccl-ib-hca-prefix-lists-mlx5_10-no-channel-on-it_nccl2.29.3_fragments.log"
    for rail in (None, [f"mlx5_{i}" for i in range(8)]):
        v = j(log, rail)
        assert (v.verdict, v.net_transport, v.gdrdma) == ("pass", "IB", True), v.reasons
        (note,) = v.notes
        assert "pulled in mlx5_10, which no channel runs over" in note and "NCCL_IB_HCA==mlx5_0," in note
    r = inv_cmd("verify-rdma", "--log", str(log), "--json")
    doc = json.loads(r.stdout)
    assert r.returncode == 0 and [c["status"] for c in doc["checks"]] == ["pass", "warn"], doc["checks"]
    assert "NCCL_IB_HCA==mlx5_0," in doc["checks"][1]["hint"]


def test_several_messages_on_one_physical_line_are_each_read():
    """A pasted log (newlines lost) and NCCL's own splices: every message on the line counts, so a WARN or a
    socket channel hidden after another message can never leave a pass standing."""
    src = PUB / "vllm-ray-2node-ib_gdrdma-channels-ray-repeated-suffix_fragment.log"
    pasted = " ".join(src.read_text().splitlines())
    v = judge(pasted, "pasted")
    assert (v.verdict, v.net_transport, v.gdrdma, v.nccl_version) == ("pass", "IB", True, "2.21.5"), v.reasons
    sock = (NCCL / "h200-two-hosts-one-gpu_default_nccl2.28.9_r0.log").read_text()
    bad = judge(" ".join(sock.splitlines()), "pasted-socket")
    assert (bad.verdict, bad.net_transport) == ("fail", "Socket")
    spliced = (PUB / "vllm-tp2-one-host_p2p-cumem_nccl2.28.9.log").read_text().splitlines()[41]
    assert spliced.count("NCCL INFO") == 2
    from railyard.checks.nccl import _messages
    assert [m for _, m, _ in _messages(spliced)] == ["NVLS multicast support is not available on",
                                                     "ENV/Plugin: Could not find: libnccl-env.so"]


# ---------------------------------------------------------------- one host: the intra-node judge

def intra(name):
    path = PUB / name
    return judge_intranode(path.read_text(errors="replace"), str(path))


@pytest.mark.parametrize("name,path,ranks", [
    ("vllm-tp2-one-host_p2p-cumem_nccl2.28.9.log", "P2P/CUMEM", 2),
    ("l20-8gpu-one-process_p2p-level-sys_p2p-direct-pointer_fragments.log", "P2P/direct pointer", 8),
])
def test_one_host_passes_on_peer_to_peer_channels(name, path, ranks):
    v = intra(name)
    assert (v.verdict, v.transport, v.paths, v.local_ranks, v.nodes) == ("pass", "P2P", [path], ranks, 1), v.reasons
    assert v.channels.get("SHM", 0) == 0 and not v.warnings


def test_one_host_vllm_on_h100_with_nvls_channels_passes():
    v = intra("vllm-h100-4gpu-docker_p2p-cumem_16-nvls-channels_fragments.log")
    assert (v.verdict, v.transport, v.paths, v.nvls) == ("pass", "P2P", ["P2P/CUMEM"], True)
    assert v.channels == {"P2P": 18}


def test_nvls_buffers_alone_count_as_nvlink_sharp():
    v = intra("vllm-nvls-comm-line_fragment.log")
    assert (v.verdict, v.nvls, v.transport) == ("pass", True, None)


def test_p2p_disabled_falls_back_to_shm_and_fails_naming_the_variable():
    v = intra("vllm-tp2-one-host_p2p-disabled_shm-direct_nccl2.28.9.log")
    assert (v.verdict, v.transport, v.paths, v.nvls) == ("fail", "SHM", ["SHM/direct/direct"], False)
    assert v.env == {"NCCL_P2P_DISABLE": "1"} and v.channels == {"SHM": 4}
    assert v.reasons == ["4 of 4 channel(s) via SHM (host shared memory), not GPU peer-to-peer (fix: NCCL_P2P_DISABLE=1 "
                         "is set (vllm_extra_env, the image's environment or /etc/nccl.conf): remove it; GPUs of one "
                         "host must talk peer-to-peer)"]
    # the trap: NCCL's own lines of two processes spliced into one, and a second communicator cut short
    assert "send 0.000proxmox:1495820:1495820 [1] NCCL INFO ENV/Plugin" in (PUB / "vllm-tp2-one-host_p2p-disabled_"
                                                                           "shm-direct_nccl2.28.9.log").read_text()


def test_shm_without_a_variable_points_at_the_hardware_path():
    v = intra("l20-8gpu-one-process_default_shm-direct_fragments.log")
    assert (v.verdict, v.transport, v.channels) == ("fail", "SHM", {"SHM": 11})
    assert "nvidia-smi topo -p2p r" in v.reasons[0] and "--ipc host" in v.reasons[0]


def test_net_between_ranks_of_one_host_fails_naming_what_turned_p2p_and_shm_off():
    v = intra("a100-nccl2.7.6_busid-channel-format_fragments.log")  # 4 ranks of one host, every channel NET/IB
    assert (v.verdict, v.transport, v.channels) == ("fail", "NET/IB", {"NET/IB": 12})
    assert v.env == {"NCCL_P2P_LEVEL": "LOC", "NCCL_SHM_DISABLE": "1"}
    assert "between ranks of one host" in v.reasons[0] and "NCCL_P2P_LEVEL=LOC, NCCL_SHM_DISABLE=1 set" in v.reasons[0]


def test_a_two_node_log_is_not_a_one_host_pass():
    v = intra("vllm-ray-2node-8xib-gdrdma_nccl2.21.5_ray-prefix-dedup.log")
    assert v.verdict == "fail" and v.nodes == 2 and "P2P/IPC/read" in v.paths
    assert v.reasons[0].startswith("NCCL counted 2 nodes, not one host")


def test_no_channel_line_is_never_a_pass():
    v = intra("horovod-nccl2.4.7_socket-using-at-init-then-net-ib_fragment.log")
    assert v.verdict == "fail" and v.transport is None and "no channel seen" in v.reasons[0]


@pytest.mark.parametrize("log,extra,old", [
    ("sglang-dsr1-2node-8xroce-gdrdma-nccl2.27.5.log", [], True),                        # RoCE, two nodes, graphs
    ("sglang-dsr1-2node-8xroce-gdrdma-nccl2.27.5.log", ["--enforce-eager"], False),      # no graphs captured
    ("sglang-dsr1-2node-8xroce-gdrdma-nccl2.27.5.log",
     ['--compilation-config={"cudagraph_mode":"NONE"}'], False),
    ("public/vllm-ray-2node-8xib-gdrdma_nccl2.21.5_ray-prefix-dedup.log", [], False),    # InfiniBand, not RoCE
    ("h200-two-hosts-one-gpu_default_nccl2.28.9_r0.log", [], False),                     # sockets: no RoCE channel
])
def test_the_minimum_nccl_applies_only_where_its_deadlock_lives(log, extra, old):
    """vLLM #52504: cross-node CUDA-graph replays over RoCE deadlock with NCCL 2.28.9 (fixed in 2.30.4), and the
    same setup serves with --enforce-eager: an older NCCL elsewhere is no reason to fail a rank."""
    from railyard.verbs.verify import old_nccl_reason

    from .test_plan import station_plan
    _, plan, _ = station_plan(f"vllm_extra_args={json.dumps(extra)}")
    v = judge((NCCL / log).read_text(), log)
    why = old_nccl_reason(v, plan.service("head"))
    assert (why is not None) == old, (v.roce, v.net_transport, v.nccl_version, why)
    if old:
        assert why.startswith(f"NCCL {v.nccl_version} is older than 2.30.7") and "--enforce-eager" in why


@pytest.mark.parametrize("log,network", [
    ("public/aws-efa-nccl2.9.9_net-aws-libfabric-gdrdma_fragment.log",
     "Libfabric (the aws-ofi-nccl plugin: AWS EFA or a libfabric provider)"),
    ("sglang-dsr1-2node-8xroce-gdrdma-nccl2.27.5.log", "NCCL's IB verbs over RoCE"),
    ("public/vllm-ray-2node-8xib-gdrdma_nccl2.21.5_ray-prefix-dedup.log", "NCCL's IB verbs over InfiniBand"),
])
def test_a_pass_names_the_network_it_saw(log, network):
    # GPUDirect RDMA over AWS EFA is the fast path there: a pass, said as what it is, not as IB
    r = inv_cmd("verify-rdma", "--log", str(NCCL / log))
    text = " ".join(r.stdout.split())
    assert r.returncode == 0 and f"OK: every rank uses {network} with GPUDirect RDMA" in text, r.stdout
    assert "on the rail" not in text      # local files: no rail was named to check them against
