"""`railyard discover` against the lab: real sshd (host keys checked), real addresses and links, the simulated
RDMA and GPU tools. What discover reads it decides itself (the rails, the serving rail, the GPU name and count,
the layout's sizes, the link speed); what no host can tell (the image, the model) comes with --set, as a user
gives it. Its decisions on real captures: tests/test_discover.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from railyard_lab import faults

from .conftest import ROOT

pytestmark = pytest.mark.lab

DISCOVERED = {"cluster_serve_rail", "cluster_gpu_name", "cluster_gpus_per_host", "preflight_link_speed_mbps",
              "vllm_tensor_parallel_size", "serve_layout", "ansible_user"}


def railyard(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("RAILYARD_INVENTORY", None)
    return subprocess.run([sys.executable, "-m", "railyard", *args], cwd=cwd, capture_output=True, text=True,
                          env=env, timeout=180)


def given(lab_path: Path) -> tuple[list[str], list[str]]:
    """The lab hosts' management addresses, and --set for what the lab's own inventory holds that no host says."""
    doc = yaml.safe_load(lab_path.read_text())
    top = doc["all"]["vars"]
    sets = []
    for k, v in top.items():
        if k in DISCOVERED:
            continue
        if k in ("ssh_known_hosts", "ansible_ssh_private_key_file"):
            v = str(lab_path.parent / v)
        sets += ["--set", f"{k}={json.dumps(v)}"]
    hosts = [h["ansible_host"] for h in doc["all"]["children"]["lab"]["hosts"].values()]
    return hosts, sets


def test_the_two_stations_discovered_pass_preflight(healthy_lab, tmp_path):
    hosts, sets = given(healthy_lab)
    out = tmp_path / "inventory.yml"
    r = railyard("discover", "--hosts", ",".join(hosts), "--user", "root", "--out", str(out), *sets)
    assert r.returncode == 0, r.stderr
    doc = yaml.safe_load(out.read_text())
    v = doc["all"]["vars"]
    assert v["cluster_gpu_name"] == "GB300" and v["serve_layout"] == "multinode_tp"
    assert v["vllm_tensor_parallel_size"] == 2 and v["cluster_serve_rail"] in ("cx8r0", "cx8r1")
    first = doc["all"]["children"]["discovered"]["hosts"]["A"]
    assert first["rank"] == 0 and set(first["rails"]) == {"cx8r0", "cx8r1"}
    pre = railyard("preflight", "--inventory", str(out), "--json")
    assert pre.returncode == 0, pre.stdout[-3000:] + pre.stderr
    assert json.loads(pre.stdout)["ok"]


def test_a_host_without_its_rail_address_is_named_and_nothing_written(healthy_lab, tmp_path):
    hosts, sets = given(healthy_lab)
    faults.fault("B", "no-ip")
    try:
        out = tmp_path / "inventory.yml"
        r = railyard("discover", "--hosts", ",".join(hosts), "--user", "root", "--out", str(out), *sets)
    finally:
        faults.heal()
    assert r.returncode == 1, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert errors and all(line.startswith("error: B: ") for line in errors), r.stderr
    assert "no IPv4 address" in errors[0] and "nothing written" in r.stderr
    assert not out.exists()


def test_the_8_gpu_host_discovered_passes_preflight(hgx8_inventory, tmp_path):
    hosts, sets = given(hgx8_inventory)
    out = tmp_path / "inventory.yml"
    r = railyard("discover", "--hosts", hosts[0], "--user", "root", "--out", str(out), *sets)
    assert r.returncode == 0, r.stderr
    v = yaml.safe_load(out.read_text())["all"]["vars"]
    assert (v["serve_layout"], v["cluster_gpus_per_host"], v["vllm_tensor_parallel_size"]) == ("single_node_tp", 8, 8)
    assert v["cluster_gpu_name"] == "H200"
    pre = railyard("preflight", "--inventory", str(out), "--json")
    assert pre.returncode == 0, pre.stdout[-3000:] + pre.stderr



def test_24_hosts_discovered_pass_preflight(wide_lab, tmp_path):
    hosts, sets = given(wide_lab)
    out = tmp_path / "inventory.yml"
    r = railyard("discover", "--hosts", ",".join(hosts), "--user", "root", "--out", str(out), *sets)
    assert r.returncode == 0, r.stderr
    doc = yaml.safe_load(out.read_text())
    found = doc["all"]["children"]["discovered"]["hosts"]
    assert len(found) == 24 and [h["rank"] for h in found.values()] == list(range(24))
    assert all(set(h["rails"]) == {"cx8r0", "cx8r1"} for h in found.values())
    pre = railyard("preflight", "--inventory", str(out), "--json")
    assert pre.returncode == 0, [c for c in json.loads(pre.stdout)["checks"] if c["status"] != "pass"][:5]
