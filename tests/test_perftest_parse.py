"""railyard.checks.perftest on real perftest and ibstat output (tests/fixtures/real/perftest/, .../ibstat/;
origins in tests/fixtures/real/ORIGINS.md). Every figure is asserted as the capture prints it (or its exact
conversion to Gb/s)."""

from __future__ import annotations

import re

import pytest

from railyard.checks.perftest import (BwRow, LatRow, parse, parse_ibstat, parse_ibstat_rate, parse_sysfs_rate,
                                      waiting)
from railyard.facts import ParseError

from .conftest import real


def pt(name: str) -> str:
    return real(f"perftest/{name}")


def test_write_bw_gbits_four_qps_rdma_cm():
    run = parse(pt("spark-vllm-docker_ib_write_bw_q4_rdma-cm_gbits_client.txt"))
    assert (run.test, run.device, run.qps, run.gid_index, run.cm, run.cuda, run.unit) == \
        ("RDMA_Write BW Test", "rocep1s0f1", 4, None, True, None, "Gb/sec")
    assert run.bw == BwRow(65536, 20000, 111.72, 111.71, 0.213070)
    assert run.lat is None and run.error == ""
    assert not waiting(pt("spark-vllm-docker_ib_write_bw_q4_rdma-cm_gbits_client.txt"))


def test_write_lat_table():
    run = parse(pt("spark-vllm-docker_ib_write_lat_rdma-cm_client.txt"))
    assert (run.test, run.device, run.qps, run.cm, run.unit) == ("RDMA_Write Latency Test", "rocep1s0f1", 1, True, "usec")
    assert run.lat == LatRow(2, 1000, 1.42, 1.93, 1.47, 1.47, 0.00, 1.57, 1.93)
    assert run.bw is None


def test_send_lat_with_cpu_frequency_lines_between_header_and_row():
    run = parse(pt("csegpu_cx7-ndr400_ib_send_lat_client.txt"))
    assert (run.test, run.device, run.unit, run.cm) == ("Send Latency Test", "mlx5_0", "usec", False)
    assert run.lat == LatRow(2, 1000, 1.24, 5.19, 1.27, 1.27, 0.00, 1.37, 5.19)


def test_write_bw_gbits_ndr400_single_qp():
    run = parse(pt("csegpu_cx7-ndr400_ib_write_bw_gbits_client.txt"))
    assert (run.test, run.device, run.qps, run.unit) == ("RDMA_Write BW Test", "mlx5_0", 1, "Gb/sec")
    assert run.bw == BwRow(65536, 5000, 392.38, 392.34, 0.748336)


def test_send_bw_mib_converted_to_gbps():
    run = parse(pt("csegpu_cx7-ndr400_ib_send_bw_MiBsec_client.txt"))
    assert (run.test, run.unit) == ("Send BW Test", "MiB/sec")
    # 46567.34 MiB/s * 2^20 * 8 / 1e9; 46557.03 likewise
    assert run.bw == BwRow(65536, 1000, 390.6352, 390.5487, 0.744912)
    assert run.bw.avg_gbps == round(46557.03 * 1048576 * 8 / 1e9, 4)


def test_duration_run_peak_reads_zero():
    run = parse(pt("perftest-273_write_bw_postlist_D60_gbits_peak0.txt"))
    assert (run.test, run.device, run.gid_index, run.unit) == ("RDMA_Write Post List BW Test", "ib0", 2, "Gb/sec")
    assert run.bw == BwRow(8, 224958464, 0.0, 0.48, 7.498617)


def test_server_banner_mb_header_and_no_row_is_no_result():
    text = pt("perftest-234_write_bw_server_D10_MBsec_row-cut.txt")
    run = parse(text)
    assert waiting(text)
    assert (run.test, run.device, run.qps, run.gid_index, run.cm, run.unit) == \
        ("RDMA_Write BW Test", "mlx5_0", 1, 3, False, "MB/sec")
    assert run.bw is None and run.lat is None     # the verb fails it: no row, never a pass


def test_mb_rows_of_a_multi_size_run():
    run = parse(pt("ucx-8851_read_bw_a_MBsec_rows-cut.txt"))
    assert (run.test, run.device, run.unit) == ("RDMA_Read BW Test", "mlx5_1", "MB/sec")
    assert [r.size for r in run.bw_rows] == [2, 4, 8]
    # MB is 10^6 bytes: 19.51 MB/s = 0.15608 Gb/s
    assert run.bw == BwRow(8, 1000, round(19.51 * 8e6 / 1e9, 4), round(19.50 * 8e6 / 1e9, 4), 2.556366)
    assert run.bw_rows[0] == BwRow(2, 1000, 0.0389, 0.0374, 2.450225)


def test_cuda_preamble_names_the_gpu():
    text = pt("perftest-241_write_bw_server_use_cuda0_preamble.txt")
    run = parse(text)
    assert waiting(text)
    assert (run.cuda, run.test, run.device, run.error) == (0, "RDMA_Write BW Test", "mlx5_0", "")


def test_old_cuda_preamble_and_mr_registration_failure():
    text = pt("perftest-31_write_bw_server_use_cuda_couldnt_allocate_mr.txt")
    run = parse(text)
    assert run.cuda == 0 and run.bw is None
    assert run.error == "Couldn't allocate MR\nfailed to create mr\nFailed to create MR\nCouldn't create IB resources"


def test_newer_mr_registration_failure():
    run = parse(pt("perftest-346_use_cuda_couldnt_allocate_mr_error14.txt"))
    assert run.error.splitlines()[0] == "Couldn't allocate MR with error=14"
    assert run.bw is None


def test_client_without_server():
    run = parse(pt("perftest-228_write_bw_client_couldnt_connect.txt"))
    assert run.error == ("Couldn't connect to 192.168.125.211:18515\n"
                         "Unable to open file descriptor for socket connection Unable to init the socket connection")
    assert (run.bw, run.lat, run.test) == (None, None, "")


def test_parser_errors_and_refusals():
    assert parse(pt("perftest-336_use_cuda_dmabuf_before_use_cuda.txt")).error == \
        "CUDA DMA-BUF cannot be used without CUDA\nParser function exited with Error"
    assert parse(pt("perftest-276_write_lat_use_cuda_refused.txt")).error == \
        "Perftest supports CUDA latency tests with read/send verbs only"
    text = pt("perftest-336_write_bw_server_use_cuda1_dmabuf_waiting.txt")
    assert waiting(text) and parse(text).error == ""     # the inline warning is no failure


def test_bidirectional_header_without_row():
    run = parse(pt("ngc_multinode_perf-108_write_bw_bidir_D30_peak-warning.txt"))
    assert (run.test, run.device, run.qps, run.bw, run.unit) == ("RDMA_Write Bidirectional BW Test", "mlx5_3", 2, None, "")


def test_empty_output():
    run = parse("")
    assert (run.bw, run.lat, run.error, run.unit, run.test) == (None, None, "", "", "")
    assert not waiting("")


def test_ibstat_rates_and_states():
    assert parse_ibstat_rate(real("ibstat/l2fwd-nv-6_ibstat_cx6dx_2x100_roce.txt")) == {"mlx5_0": 100.0, "mlx5_1": 100.0}
    text = real("ibstat/sbc-reviews-92_ibstat_gb10-cx7_200_one-down.txt")
    assert parse_ibstat_rate(text) == {"roceP2p1s0f0": 200.0, "roceP2p1s0f1": 40.0, "rocep1s0f0": 200.0}
    ports = parse_ibstat(text)
    assert ports["roceP2p1s0f1"][1].state == "Down" and ports["roceP2p1s0f1"][1].physical_state == "Disabled"
    assert ports["rocep1s0f0"][1].state == "Active" and ports["rocep1s0f0"][1].link_layer == "Ethernet"
    with pytest.raises(ParseError):
        parse_ibstat("ibstat: command not found")


def test_sysfs_rate_values_as_ibstatus_prints_them():
    text = real("ibstat/nccl-1866_ibstatus_rate-100-EDR_roce.txt")
    values = re.findall(r"^\s*rate:\s+(.*)$", text, re.M)
    assert values == ["100 Gb/sec (4X EDR)", "100 Gb/sec (4X EDR)"]
    assert [parse_sysfs_rate(v) for v in values] == [100.0, 100.0]
    assert parse_sysfs_rate("400 Gb/sec (4X NDR)\n") == 400.0
    with pytest.raises(ParseError):
        parse_sysfs_rate("")


def test_server_that_dies_after_its_banner():
    text = pt("libfabric-5149_write_bw_server_couldnt_create_qp.txt")
    run = parse(text)
    assert waiting(text) and run.bw is None
    assert run.error == ("Couldn't get device attributes\nUnable to create QP.\nFailed to create QP.\n"
                         "Couldn't create IB resources")
