"""`inv rdma-test` on the lab: the two stations' rails measured alone and together, host and GPU memory, over the
perftest stand-in (lab/railyard_lab/sim/perftest.py: its two ends meet over a real TCP connection on the rail, its
figures follow the rail's real tc throttle); then 24 hosts paired in a ring. What is real: the connections, the
throttle, the timing; the figures are the stand-in's (railyard's judgment of them is what is tested)."""

from __future__ import annotations

import json
import time

import pytest

from railyard_lab import faults

from .conftest import inv_cmd

pytestmark = pytest.mark.lab


def rdma_test(inv, *args, timeout=300):
    began = time.monotonic()
    r = inv_cmd("rdma-test", "--json", *args, env={"RAILYARD_INVENTORY": str(inv)}, timeout=timeout)
    took = time.monotonic() - began
    assert "Traceback" not in r.stderr, r.stderr
    doc = json.loads(r.stdout)
    return r.returncode, doc, took


def rows(doc, **want):
    return [x for x in doc["data"]["results"] if all(x[k] == v for k, v in want.items())]


def test_two_stations_every_rail_alone_and_together_in_host_and_gpu_memory_pass_on_a_healthy_lab(healthy_lab):
    code, doc, took = rdma_test(healthy_lab, "--memory", "both", "--duration", "1")
    print(f"rdma-test, two stations, two rails, host and GPU memory: {took:.1f} s")
    assert code == 0 and doc["ok"], [c for c in doc["checks"] if c["status"] != "pass"]
    res = doc["data"]["results"]
    assert {(x["rail"], x["memory"], x["test"], x["together"]) for x in res} == {
        (r, m, t, g) for r in ("cx8r0", "cx8r1") for m, t, g in
        (("host", "bw", False), ("gpu", "bw", False), ("host", "lat", False), ("host", "bw", True), ("gpu", "bw", True))}
    assert all(x["client"] == "A" and x["server"] == "B" for x in res)
    assert all(x["expected_gbps"] == 400 and x["gbps"] > 300 for x in res if x["test"] == "bw")
    assert all(x["cuda"] == [1, 1] for x in res if x["memory"] == "gpu")   # the GB300, not the display GPU 0


def test_a_throttled_rail_on_b_fails_that_rail_alone_naming_b_the_hca_the_figure_and_the_rate(healthy_lab):
    faults.fault("B", "rail-slow", "cx8r1:0.4")
    code, doc, _ = rdma_test(healthy_lab, "--duration", "1")
    assert code == 1 and not doc["ok"]
    failed = [c for c in doc["checks"] if c["status"] == "fail"]
    assert len(failed) == 1, failed
    assert failed[0]["check"] == "rdma_bw" and failed[0]["detail"].startswith("A->B cx8r1 (mlx5_1), host memory: ")
    assert "of 400 Gb/s (0.3" in failed[0]["detail"] and "below 0.75 of the link's rate" in failed[0]["detail"]
    assert all(x["status"] == "pass" for x in rows(doc, rail="cx8r0"))
    [together] = rows(doc, rail="cx8r1", together=True)
    assert together["status"] == "warn"   # all rails at once: the rail alone's row is the verdict


def test_a_slow_gpu_path_fails_the_gpu_host_ratio_and_a_peer_that_never_serves_fails_in_seconds(healthy_lab):
    faults.fault("B", "acs-redirect", "path")   # P2P between the GB300 and the serving rail's NIC via the root complex
    code, doc, _ = rdma_test(healthy_lab, "--memory", "both", "--rails", "cx8r1", "--duration", "1")
    assert code == 1
    [gpu] = rows(doc, memory="gpu", together=False)
    assert gpu["status"] == "fail" and "of host memory's" in gpu["detail"] and "below 0.8" in gpu["detail"]
    assert rows(doc, memory="host", test="bw")[0]["status"] == "pass"
    faults.heal("B")
    faults.fault("B", "perftest-down")
    code, doc, took = rdma_test(healthy_lab, "--rails", "cx8r0", "--duration", "1")
    print(f"rdma-test with B's perftest server failing: {took:.1f} s")
    assert code == 1 and took < 40
    bw = rows(doc, test="bw")[0]
    assert bw["status"] == "fail" and bw["detail"].startswith("no bandwidth row: client on A: Couldn't connect to")
    assert "server on B: Couldn't get device attributes" in bw["error"]


def test_a_host_without_perftest_fails_its_row_saying_how_to_get_it_and_runs_no_pair(healthy_lab):
    faults.fault("A", "missing-tool", "ib_write_lat")
    code, doc, _ = rdma_test(healthy_lab, "--rails", "cx8r0", "--duration", "1")
    assert code == 1 and not doc["data"]["results"]
    [row] = [c for c in doc["checks"] if c["check"] == "perftest"]
    assert row["host"] == "A" and "ib_write_lat is not on A's PATH: install perftest" in row["detail"]



def test_24_hosts_every_rail_of_every_host_is_measured_from_both_sides_by_a_ring_in_parallel(wide_lab):
    code, doc, took = rdma_test(wide_lab, "--duration", "1", timeout=600)
    d = doc["data"]
    print(f"rdma-test, 24 hosts, rails {', '.join(d['rails'])}: {len(d['results'])} runs in {d['took_s']} s "
          f"({took:.1f} s with the command)")
    assert code == 0, [c for c in doc["checks"] if c["status"] != "pass"][:3]
    pairs = [(p["client"], p["server"]) for r in d["rounds"] for p in r]
    assert len(pairs) == 24 and len(d["rounds"]) == 2                       # a ring: N pairs, two rounds
    alone = [x for x in d["results"] if x["test"] == "bw" and not x["together"]]
    for rail in d["rails"]:
        seen = [x for x in alone if x["rail"] == rail]
        assert sorted(x["client"] for x in seen) == sorted(x["server"] for x in seen) == sorted(d["hosts"])
