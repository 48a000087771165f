"""The lab's perftest stand-in (lab/railyard_lab/sim/perftest.py) between two stations: the server on B, the client
on A over a rail, for real over TCP; what either end prints parses with railyard.checks.perftest, the parser of the
real captures. A throttled rail (rail-slow, a real tc qdisc) reads lower on that rail only; a missing server, a
server that dies and mismatched flags fail in seconds."""

from __future__ import annotations

import subprocess
import time

import pytest

from railyard.checks.perftest import parse, parse_ibstat, waiting
from railyard_lab import faults

from .conftest import on

pytestmark = pytest.mark.lab

BW = "-F --report_gbits -s 1048576 -D 1 -q 4"


def rail_ip(host: str, rail: str) -> str:
    import railyard_lab as lab
    return lab.lab_host(lab.lab_dir(), host).rail_ip(rail)


def serve(host: str, line: str) -> subprocess.Popen:
    """Start a perftest server on a lab host over SSH and wait for its banner (perftest has no wait-for-peer)."""
    import railyard_lab as lab
    root = lab.lab_dir()
    p = subprocess.Popen(lab.ssh_argv(root, lab.lab_host(root, host), [line]), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    seen = ""
    while p.stdout is not None:
        ln = p.stdout.readline()
        seen += ln
        if not ln or (waiting(seen) and ln.startswith("*****")):   # the banner's closing line, or the end
            break
    p.seen = seen  # type: ignore[attr-defined]
    return p


def stop_server(host: str) -> None:
    """End the perftest server a test left listening on HOST (killing the local ssh leaves it running there):
    the one process on the port, found by `ss` in the host's own namespace."""
    import re
    for pid in re.findall(r"pid=(\d+)", on(host, "ss -ltnpH 'sport = :18515'").stdout):
        on(host, f"kill {pid}")


def finish(p: subprocess.Popen, host: str = "B") -> str:
    try:
        out, _ = p.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        stop_server(host)
        p.kill()
        out, _ = p.communicate()
    return p.seen + (out or "")  # type: ignore[attr-defined]


def pair(server_flags: str, client_flags: str, rail: str = "cx8r0", tool: str = "ib_write_bw"):
    hca = {"cx8r0": "mlx5_0", "cx8r1": "mlx5_1"}[rail]
    s = serve("B", f"{tool} -d {hca} {server_flags}")
    t = time.monotonic()
    c = on("A", f"{tool} -d {hca} {client_flags} {rail_ip('B', rail)} 2>&1")
    return c, finish(s), time.monotonic() - t


def test_write_bw_both_ends_parse_with_the_real_parser(healthy_lab):
    c, s, took = pair(BW, BW)
    assert c.returncode == 0, c.stdout
    client, server = parse(c.stdout), parse(s)
    assert waiting(s) and not waiting(c.stdout)
    for run in (client, server):
        assert (run.test, run.device, run.qps, run.unit, run.cm, run.cuda, run.gid_index) == \
            ("RDMA_Write BW Test", "mlx5_0", 4, "Gb/sec", False, None, 3)
        assert run.bw is not None and run.bw.size == 1048576 and run.bw.peak_gbps == 0.0   # -D: no peak
    # a healthy 400G ConnectX-8 rail with 4 QPs: about 0.95 of the line
    assert 370 < client.bw.avg_gbps < 390 and server.bw == client.bw
    assert 1.0 <= took < 8


def test_rdma_cm_single_qp_and_mib_without_report_gbits(healthy_lab):
    c, s, _ = pair("-F -s 1048576 -n 200 -R", "-F -s 1048576 -n 200 -R")
    run = parse(c.stdout)
    assert run.cm and run.unit == "MiB/sec" and run.bw is not None and run.bw.iterations == 200
    # one QP on a Station's ConnectX-8 reads 55-58 % of 400G (the two-Station playbook)
    assert 220 < run.bw.avg_gbps < 235 and run.bw.peak_gbps > 0


def test_latency_tables(healthy_lab):
    for tool in ("ib_write_lat", "ib_send_lat"):
        c, s, _ = pair("-F -n 1000", "-F -n 1000", tool=tool)
        run = parse(c.stdout)
        assert run.unit == "usec" and run.lat is not None and run.lat.iterations == 1000, c.stdout
        assert 1.0 < run.lat.typical_us < 3.0 and run.lat.min_us <= run.lat.typical_us <= run.lat.max_us
        assert parse(s).lat == run.lat


def test_rail_slow_on_b_lowers_that_rail_only(healthy_lab):
    faults.fault("B", "rail-slow", "cx8r0:0.4")
    assert "tbf" in on("B", "tc qdisc show dev cx8r0").stdout
    slow = parse(pair(BW, BW, rail="cx8r0")[0].stdout).bw
    fast = parse(pair(BW, BW, rail="cx8r1")[0].stdout).bw
    assert slow is not None and fast is not None
    assert 140 < slow.avg_gbps < 160 and fast.avg_gbps > 370      # 0.4 of ~380 on cx8r0; cx8r1 untouched
    assert parse_ibstat(on("B", "ibstat mlx5_0").stdout)["mlx5_0"][1].rate_gbps == 400.0   # still links at 400
    faults.heal("B")
    assert "tbf" not in on("B", "tc qdisc show dev cx8r0").stdout


def test_gpu_memory_slightly_below_host_and_acs_redirect_far_below(healthy_lab):
    cuda = BW + " --use_cuda=1 --use_cuda_dmabuf"
    c, s, _ = pair(cuda, cuda, rail="cx8r1")
    run = parse(c.stdout)
    assert run.cuda == 1 and run.bw is not None and 340 < run.bw.avg_gbps < 365
    assert "Picking device No. 1" in s and "NVIDIA GB300" in c.stdout
    faults.fault("B", "acs-redirect", "path")
    slow = parse(pair(cuda, cuda, rail="cx8r1")[0].stdout).bw
    assert slow is not None and slow.avg_gbps < 0.55 * run.bw.avg_gbps


def test_no_peermem_fails_gpu_memory_unless_dmabuf(healthy_lab):
    faults.fault("A", "no-peermem")
    s = serve("B", f"ib_write_bw -d mlx5_1 {BW} --use_cuda=1")
    c = on("A", f"ib_write_bw -d mlx5_1 {BW} --use_cuda=1 {rail_ip('B', 'cx8r1')} 2>&1")
    finish(s)
    run = parse(c.stdout)
    assert c.returncode != 0 and run.bw is None
    assert run.error.startswith("Couldn't allocate MR with error=14")
    c2, _, _ = pair(BW + " --use_cuda=1 --use_cuda_dmabuf", BW + " --use_cuda=1 --use_cuda_dmabuf", rail="cx8r1")
    assert parse(c2.stdout).bw is not None


def test_no_server_fails_in_seconds(healthy_lab):
    t = time.monotonic()
    c = on("A", f"ib_write_bw -d mlx5_0 {BW} {rail_ip('B', 'cx8r0')} 2>&1")
    took = time.monotonic() - t
    run = parse(c.stdout)
    assert c.returncode != 0 and run.bw is None and took < 8
    assert run.error.splitlines()[0] == f"Couldn't connect to {rail_ip('B', 'cx8r0')}:18515"


def test_link_down_and_blocked_port_fail_in_seconds(healthy_lab):
    for kind, value in (("link-down", None), ("port-block", "18515")):
        faults.fault("B", kind, value)
        s = serve("B", f"ib_write_bw -d mlx5_1 {BW}")
        t = time.monotonic()
        c = on("A", f"ib_write_bw -d mlx5_1 {BW} {rail_ip('B', 'cx8r1')} 2>&1")
        took = time.monotonic() - t
        stop_server("B")
        finish(s)
        faults.heal("B")
        assert c.returncode != 0 and parse(c.stdout).bw is None and took < 10, (kind, c.stdout)
        assert "Couldn't connect to" in parse(c.stdout).error


def test_perftest_down_server_dies_and_client_fails(healthy_lab):
    faults.fault("B", "perftest-down")
    s = on("B", f"ib_write_bw -d mlx5_0 {BW} 2>&1")
    assert s.returncode != 0 and waiting(s.stdout) and "Couldn't create IB resources" in parse(s.stdout).error
    c = on("A", f"ib_write_bw -d mlx5_0 {BW} {rail_ip('B', 'cx8r0')} 2>&1")
    assert c.returncode != 0 and "Couldn't connect to" in parse(c.stdout).error


def test_mismatched_flags_fail_both_ends(healthy_lab):
    c, s, took = pair(BW, BW.replace("-q 4", "-q 1"))
    assert c.returncode != 0 and parse(c.stdout).bw is None and parse(s).bw is None
    assert "-q differs" in c.stdout and "-q differs" in s and took < 8


def test_bad_device_help_and_ibstat(healthy_lab):
    r = on("A", "ib_write_bw -d mlx5_9 2>&1")
    assert r.returncode != 0 and parse(r.stdout).error == "IB device mlx5_9 not found\nUnable to find the Infiniband/RoCE device"
    assert "--use_cuda_dmabuf" in on("A", "ib_write_bw --help").stdout
    assert on("A", "ib_write_bw --out_json 2>&1").returncode != 0
    ports = parse_ibstat(on("A", "ibstat").stdout)
    assert set(ports) == {"mlx5_0", "mlx5_1"} and ports["mlx5_1"][1].state == "Active"
    faults.fault("A", "link-down")
    assert parse_ibstat(on("A", "ibstat mlx5_1").stdout)["mlx5_1"][1].state == "Down"
