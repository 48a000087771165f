"""The host-regression checks of `inv preflight` (cma, nccl_conf, nccl_lib, gloo_iface) on the lab: each passes
on the healthy lab and fails on its own fault, made for real where the lab can (a file in the host's copy of the
image, the host's own /etc/hosts) and bind-mounted where the kernel's own file cannot change (/proc/meminfo)."""

from __future__ import annotations

import json

import pytest

from railyard_lab import faults

from .conftest import inv_cmd

pytestmark = pytest.mark.lab

CHECKS = ("cma", "nccl_conf", "nccl_lib", "gloo_iface")
NO_GLOO_IFNAME = 'vllm_extra_env={"GLOO_SOCKET_IFNAME": ""}'


def _preflight(inventory, *sets: str) -> dict[tuple[str, str], dict]:
    args = ["preflight", "-i", str(inventory), "--json"]
    for s in sets:
        args += ["-s", s]
    r = inv_cmd(*args)
    doc = json.loads(r.stdout)
    return {(c["host"], c["check"]): c for c in doc["checks"]}


def test_healthy_lab_passes_every_regression_check(healthy_lab):
    got = _preflight(healthy_lab)
    for host in ("A", "B"):
        for check in CHECKS:
            assert got[(host, check)]["status"] == "pass", got[(host, check)]
    assert "2.30.7+cuda13.0" in got[("A", "nccl_lib")]["detail"]
    assert "GLOO_SOCKET_IFNAME" in got[("B", "gloo_iface")]["detail"]
    # without the variable, the host's own name: its management address, not loopback
    bare = _preflight(healthy_lab, NO_GLOO_IFNAME)
    assert bare[("B", "gloo_iface")]["status"] == "pass"
    import railyard_lab as lab
    mgmt = lab.lab_host(lab.lab_dir(), "B").mgmt_ip      # this lab instance's own address of B
    assert f"B resolves to {mgmt}" in bare[("B", "gloo_iface")]["detail"]


@pytest.mark.parametrize("fault, check, words", [
    ("cma-zero", "cma", ["CmaFree 9728 MiB exceeds CmaTotal 0 MiB", "GB300"]),
    ("nccl-conf", "nccl_conf", ["NCCL_IB_DISABLE=1 (line 1)", "NCCL_SOCKET_IFNAME there is overridden"]),
    ("nccl-lib", "nccl_lib", ["2.27.3+cuda12.9", "2.30.7+cuda13.0"]),
])
def test_each_fault_fails_its_own_check_on_that_host(healthy_lab, fault, check, words):
    faults.fault("B", fault)
    got = _preflight(healthy_lab)
    r = got[("B", check)]
    assert r["status"] == "fail", r
    for w in words:
        assert w in r["detail"], r["detail"]
    assert r["hint"]
    for other in CHECKS:  # its own check only (nccl_lib names the odd build on the other rank too)
        if other != check:
            assert got[("B", other)]["status"] == "pass", got[("B", other)]
        if other not in (check, "nccl_lib") or check != "nccl_lib":
            assert got[("A", other)]["status"] == "pass", got[("A", other)]
    faults.heal("B")
    assert _preflight(healthy_lab)[("B", check)]["status"] == "pass"


def test_gloo_loopback_fails_where_gloo_binds_by_the_host_name(healthy_lab):
    faults.fault("B", "gloo-loopback")
    rendered = _preflight(healthy_lab)[("B", "gloo_iface")]
    assert rendered["status"] == "pass" and "127.0.1.1" in rendered["evidence"]  # GLOO_SOCKET_IFNAME decides
    r = _preflight(healthy_lab, NO_GLOO_IFNAME)[("B", "gloo_iface")]
    assert r["status"] == "fail", r
    assert "B resolves to 127.0.1.1" in r["detail"] and "/etc/hosts" in r["hint"]
