"""nccl-check on an hgx8 lab host (single_node_tp by default, dp_ep): one probe container with the
engine's 8 GPUs, 8 local ranks, NCCL's intra-node transport and the bus bandwidth; the container is
always removed.

NCCL's log is the GPU layer's stand-in by nature (the CPU engine talks gloo, no NCCL)."""

import json

import pytest

from railyard_lab import faults

from .conftest import inv_cmd, on, remove_containers

pytestmark = pytest.mark.lab
PROBE = "railyard-nccl-check"


def no_probe_left():
    return all(PROBE not in on(h, "docker ps -a --format '{{.Names}}'").stdout for h in ("A", "B"))


@pytest.fixture
def hgx(hgx8_inventory):
    faults.heal()
    remove_containers(PROBE)
    yield hgx8_inventory
    faults.heal()
    remove_containers(PROBE)


def check(inv, *args):
    r = inv_cmd("nccl-check", "-i", str(inv), "--json", *args)
    doc = json.loads(r.stdout)
    return r.returncode, doc, {c["check"]: c for c in doc["checks"]}


def test_a_healthy_host_passes_with_8_ranks_over_p2p_and_nvlink(hgx):
    rc, doc, checks = check(hgx)
    assert rc == 0 and doc["ok"], doc["checks"]
    d = doc["data"]
    assert (d["layout"], d["host"], d["local_ranks"], d["removed"]) == ("single_node_tp", "A", 8, ["A"])
    t = d["transport"]
    assert (t["verdict"], t["transport"], t["paths"], t["local_ranks"], t["nodes"], t["nvls"]) == (
        "pass", "P2P", ["P2P/CUMEM/read"], 8, 1, True)
    assert [s["bytes"] for s in d["sizes"]] == [1 << 20, 16 << 20, 256 << 20, 1 << 30]
    big = d["sizes"][-1]
    assert big["busbw_gbs"] >= d["min_busbw_gbs"] == 200.0
    assert big["busbw_gbs"] == pytest.approx(big["algbw_gbs"] * 2 * 7 / 8)  # nccl-tests' busbw for n = 8
    assert [checks[c]["status"] for c in ("probe", "p2p", "bandwidth")] == ["pass"] * 3
    assert no_probe_left()


def test_p2p_disabled_fails_naming_shm_and_the_fix(hgx):
    rc, doc, checks = check(hgx, "--sizes", "1M,1G", "--set", "vllm_extra_env={NCCL_P2P_DISABLE: '1'}")
    assert rc == 1 and not doc["ok"]
    assert checks["probe"]["status"] == "pass"
    assert checks["p2p"]["status"] == "fail" and "via SHM (host shared memory)" in checks["p2p"]["detail"]
    assert "NCCL_P2P_DISABLE=1 is set" in checks["p2p"]["hint"] and "remove it" in checks["p2p"]["hint"]
    assert doc["data"]["transport"]["env"] == {"NCCL_P2P_DISABLE": "1"}
    assert checks["bandwidth"]["status"] == "fail"  # host memory is far below NVLink
    assert no_probe_left()


def test_dp_ep_with_p2p_and_shm_off_goes_over_the_network_and_fails(hgx):
    r = inv_cmd("nccl-check", "-i", str(hgx), "--sizes", "1M,1G", "--set", "serve_layout=dp_ep",
                "--set", "vllm_extra_env={NCCL_P2P_DISABLE: '1', NCCL_SHM_DISABLE: '1'}")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "via NET/Socket between ranks of one host" in r.stdout and "NCCL_SHM_DISABLE=1" in r.stdout
    assert "FAILED: NET/Socket" in r.stdout and "8 GPUs of A (dp_ep)" in r.stdout
    assert no_probe_left()


def test_ranks_without_a_gpu_fail_the_probe_and_the_container_is_removed(hgx):
    rc, doc, checks = check(hgx, "--sizes", "1M", "--set", "vllm_extra_env={CUDA_VISIBLE_DEVICES: '0,1,2,3'}")
    assert rc == 1 and checks["probe"]["status"] == "fail"
    assert "rank 4: AcceleratorError: CUDA error: invalid device ordinal" in checks["probe"]["detail"]
    assert doc["data"]["removed"] == ["A"] and no_probe_left()
