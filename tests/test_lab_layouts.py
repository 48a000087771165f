"""The one-host layouts on an hgx8 lab host (8 x H200, two NUMA nodes): launch, health, no-op
relaunch, stop and start; dp_ep's KV cache per DP rank; a busy GPU failing the launch as vLLM
fails. On the stand-in engine (up in 2 s): launch_server.sh serving is proven on the real engine
(test_lab_real_one_host.py)."""

import json
import shutil

import pytest

from railyard_lab import faults
from railyard_lab.checkpoint import write_checkpoint

from .conftest import home, inv_cmd, on

pytestmark = pytest.mark.lab
TP8 = "vllm-tp8"
DPEP = "vllm-dp-ep"


@pytest.fixture(scope="module")
def hgx(hgx8_inventory):
    write_checkpoint(home("A") / "models" / "tiny-qwen3", 0.002, 2)
    yield hgx8_inventory
    on("A", f"docker rm -f {TP8} {DPEP} >/dev/null 2>&1; true")
    shutil.rmtree(home("A") / "models", ignore_errors=True)


@pytest.fixture
def clean(hgx):
    on("A", f"docker rm -f {TP8} {DPEP} >/dev/null 2>&1; true")
    faults.heal()
    yield hgx
    faults.heal()
    on("A", f"docker rm -f {TP8} {DPEP} >/dev/null 2>&1; true")


def inv(path, *args, timeout=120):
    return inv_cmd(*args, "-i", str(path), timeout=timeout)


def test_single_node_tp_launches_on_all_eight_gpus_pinned_to_their_cpus_and_relaunch_is_a_noop(clean):
    assert inv(clean, "env").returncode == 0
    r = inv(clean, "launch", "--timeout", "60")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ready in" in r.stdout
    doc = json.loads(on("A", f"docker inspect {TP8}").stdout)[0]
    gpus = doc["HostConfig"]["DeviceRequests"][0]["DeviceIDs"]
    smi = on("A", "nvidia-smi --query-gpu=uuid --format=csv,noheader").stdout.split()
    assert sorted(gpus) == sorted(smi) and len(gpus) == 8
    topo = on("A", "nvidia-smi topo -m").stdout
    assert doc["HostConfig"]["CpusetCpus"] and doc["HostConfig"]["CpusetCpus"].split(",")[0].split("-")[0] == "0"
    assert "--tensor-parallel-size 8" in doc["Args"][-1] and "GPU0" in topo
    apps = on("A", "nvidia-smi --query-compute-apps=gpu_uuid --format=csv,noheader").stdout.split()
    assert sorted(set(apps)) == sorted(smi)  # a serving process on every GPU
    h = inv(clean, "health", "--json")
    assert h.returncode == 0, h.stdout + h.stderr
    again = inv(clean, "launch")
    assert again.returncode == 0 and "already running with this configuration" in again.stdout
    st = json.loads(inv(clean, "status", "--json").stdout)
    assert st["ok"]
    assert inv(clean, "stop").returncode == 0
    assert on("A", "nvidia-smi --query-compute-apps=pid --format=csv,noheader").stdout == ""
    r = inv(clean, "start")
    assert r.returncode == 0 and "start: ready" in r.stdout, r.stdout + r.stderr
    v = inv(clean, "verify-rdma")
    assert v.returncode == 0 and "SKIP" in v.stdout and "one host" in v.stdout


def test_dp_ep_reports_the_kv_cache_of_every_dp_rank_and_every_engine_in_metrics(clean):
    args = ("--set", "serve_layout=dp_ep")
    assert inv_cmd("env", "-i", str(clean), *args).returncode == 0
    r = inv_cmd("launch", "-i", str(clean), *args, "--timeout", "60")
    assert r.returncode == 0, r.stdout + r.stderr
    args_of = json.loads(on("A", f"docker inspect {DPEP}").stdout)[0]["Args"][-1]
    assert "--data-parallel-size 8 --enable-expert-parallel" in args_of
    h = inv_cmd("health", "-i", str(clean), *args, "--json")
    assert h.returncode == 0, h.stdout + h.stderr
    doc = json.loads(h.stdout)
    kv = doc["data"]["metrics"]["kv_per_rank"]
    assert sorted(kv["per_rank"]) == [str(i) for i in range(8)] and kv["sum"] == sum(kv["per_rank"].values())
    assert kv["min"] == min(kv["per_rank"].values()) and 0 <= kv["spread"] < 0.2
    text = inv_cmd("health", "-i", str(clean), *args).stdout
    assert "KV tokens per DP rank" in text and "engine labels 0, 1, 2, 3, 4, 5, 6, 7" in text
    again = inv_cmd("launch", "-i", str(clean), *args)
    assert again.returncode == 0 and "already running with this configuration" in again.stdout
    assert inv_cmd("stop", "-i", str(clean), *args).returncode == 0
    assert on("A", "nvidia-smi --query-compute-apps=pid --format=csv,noheader").stdout == ""


def test_fewer_gpus_than_the_layout_needs_are_named_with_the_count(clean):
    r = inv(clean, "launch", "--set", "cluster_gpu_name=NoSuchGPU", "--dry-run")
    assert r.returncode == 1 and "no GPU matches 'NoSuchGPU'" in r.stderr
