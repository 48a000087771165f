"""The lab's second host shape, hgx8: what a user of an 8-GPU HGX server sees (GPUs, NUMA nodes, rails,
vLLM's parallel layouts in a container and on the host itself)."""

import json
import re
import shlex
import time
from pathlib import Path

import pytest

from railyard.facts.gpu import parse_compute_apps, parse_cpu_list, parse_gpus, parse_lscpu_numa, parse_topo_matrix
from railyard.facts.net import parse_ibdev2netdev, parse_ip_br_addr, parse_ip_link, parse_show_gids, roce_v2_index
import railyard_lab as lab
from railyard.inventory import load_inventory
from railyard_lab import faults
from railyard_lab.checkpoint import write_checkpoint

from .conftest import home, inv_cmd, on, remove_containers

pytestmark = pytest.mark.lab
IMAGE = lab.LAB_IMAGE_NAME
RAILS = ["enp24s0np0", "enp58s0np0", "enp75s0np0", "enp92s0np0", "enp154s0np0", "enp186s0np0", "enp202s0np0",
         "enp218s0np0"]
NAMES = ("tp8", "dp4", "busy")


@pytest.fixture(scope="module")
def hgx8(hgx8_inventory):
    write_checkpoint(home("A") / "models" / "m", 0.002, 2)
    yield hgx8_inventory
    remove_containers(*NAMES, hosts=("A",))


@pytest.fixture
def clean(hgx8):
    yield hgx8
    faults.heal()
    remove_containers(*NAMES, hosts=("A",))


def uuids(host="A"):
    return [g.uuid for g in parse_gpus(on(host, "nvidia-smi", "--query-gpu=index,uuid,name,memory.used,memory.total",
                                            "--format=csv,noheader,nounits").stdout)]


def apps(host="A"):
    return parse_compute_apps(on(host, "nvidia-smi", "--query-compute-apps=gpu_uuid,pid,process_name,used_memory",
                                   "--format=csv,noheader,nounits").stdout)


def wait_log(name, text, timeout=20):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = on("A", "docker", "logs", name).stdout
        if text in out:
            return out
        time.sleep(0.2)
    raise AssertionError(f"{name}: no {text!r} in its log:\n{out}")


def wait_exit(name, timeout=20):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = json.loads(on("A", "docker", "inspect", "-f", "{{json .State}}", name).stdout)
        if not st["Running"]:
            return st
        time.sleep(0.1)
    raise AssertionError(f"{name} still running")


def test_eight_gpus_on_two_numa_nodes(hgx8):
    gpus = parse_gpus(on("A", "nvidia-smi --query-gpu=index,uuid,name,memory.used,memory.total "
                                "--format=csv,noheader,nounits").stdout)
    assert [(g.index, g.name, g.memory_total_mib) for g in gpus] == [(i, "NVIDIA H200", 143771) for i in range(8)]
    assert on("A", "nvidia-smi -L").stdout.count("NVIDIA H200 (UUID: GPU-") == 8
    table = on("A", "nvidia-smi").stdout.splitlines()
    assert all(len(line) == 91 for line in table[1:] if line.startswith(("|", "+")))
    topo_out = on("A", "nvidia-smi topo -m").stdout
    assert topo_out.startswith("\tGPU0\tGPU1") and "\tNIC7\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\n" in topo_out
    topo = parse_topo_matrix(topo_out)
    numa = parse_lscpu_numa(on("A", "lscpu").stdout)
    assert sorted(numa) == [0, 1] and len(numa[0]) == len(numa[1]) == 112
    assert [topo[i].numa_affinity for i in range(8)] == [0] * 4 + [1] * 4
    for i in range(8):  # the CPUs nvidia-smi names for a GPU are its NUMA node's CPUs, as lscpu says
        assert parse_cpu_list(topo[i].cpu_affinity) == numa[topo[i].numa_affinity]
        assert [n for n, r in topo[i].nics.items() if r == "PIX"] == [f"mlx5_{i}"]
        assert set(topo[i].gpus.values()) == {"NV18"}
    assert topo[0].nics["mlx5_1"] == "NODE" and topo[0].nics["mlx5_4"] == "SYS"



def test_the_per_cpu_list_is_the_one_the_real_engine_reads(hgx8):
    """vLLM's CPU build lists the CPUs with `lscpu --json --extended=CPU,CORE,NODE --online` when a
    worker starts on the host (launch_server.sh runs it there): the lab's topology in util-linux's form."""
    out = on("A", "lscpu --json --extended=CPU,CORE,NODE --online").stdout
    real = (Path(__file__).parent / "fixtures/real/lscpu/lscpu-json-extended-cpu-core-node.txt").read_text()
    shape = {re.sub(r"\d+", "N", ln) for ln in real.splitlines()}
    assert {re.sub(r"\d+", "N", ln) for ln in out.splitlines()} == shape    # line for line the real form
    cpus = json.loads(out)["cpus"]
    numa = parse_lscpu_numa(on("A", "lscpu").stdout)
    assert [c["cpu"] for c in cpus] == list(range(224))
    assert all(c["cpu"] in numa[c["node"]] for c in cpus)
    assert {c["core"] for c in cpus} == set(range(112)) and cpus[112]["core"] == cpus[0]["core"]  # 2 threads a core

def test_eight_rails_are_real_9000_mtu_links(hgx8):
    rows = parse_ibdev2netdev(on("B", "ibdev2netdev").stdout)
    assert [(r.hca, r.netdev, r.up) for r in rows] == [(f"mlx5_{k}", n, True) for k, n in enumerate(RAILS)]
    links = parse_ip_link(on("B", "ip -o link show").stdout)
    addrs = parse_ip_br_addr(on("B", "ip -br addr").stdout)
    for k, n in enumerate(RAILS):
        assert len(n) <= 15 and links[n].mtu == 9000 and addrs[n].ipv4 == [f"{lab.rail_net(k)}.12/24"]
    # a jumbo frame crosses the last rail to the peer, and the rail's RoCE v2 GID follows its address
    r = on("A", f"ping -c 1 -W 2 -M do -s 8972 -I {RAILS[7]} {lab.rail_net(7)}.12")
    assert r.returncode == 0 and "1 received" in r.stdout
    gids = parse_show_gids(on("B", "show_gids mlx5_7").stdout)
    assert roce_v2_index(gids, "mlx5_7", f"{lab.rail_net(7)}.12") == 3
    inv = load_inventory(hgx8, [])
    a = inv.host("A")
    assert list(a.rails) == RAILS and a.vars["cluster_serve_rail"] == RAILS[0] and a.vars["cluster_gpu_name"] == "H200"
    faults.fault("B", "mtu", "1500")  # faults act on the serving rail of the shape
    try:
        assert parse_ip_link(on("B", "ip -o link show").stdout)[RAILS[0]].mtu == 1500
    finally:
        faults.heal("B")


def test_container_with_four_gpus_refuses_tp8_as_vllm_does(clean):
    four = uuids()[:4]
    gpus = '"device=' + ",".join(four) + '"'  # several devices: quoted inside the value, as docker needs
    r = on("A", f"docker run -d --name tp8 --gpus {shlex.quote(gpus)} -v /root/models/m:/model:ro {IMAGE} /model "
                "--tensor-parallel-size=8")
    assert r.returncode == 0, r.stderr
    st = wait_exit("tp8")
    log = on("A", "docker logs tp8").stdout
    assert st["ExitCode"] == 1
    assert "World size (8) is larger than the number of available GPUs (4) in this node." in log
    assert json.loads(on("A", "docker inspect -f '{{json .HostConfig.DeviceRequests}}' tp8").stdout)[0]["DeviceIDs"] == four
    assert apps() == []
    # unquoted, docker reads `device=A,B` as one device and then a count, and refuses (as the real CLI does)
    bad = on("A", f"docker run -d --name tp8x --gpus device={four[0]},{four[1]} {IMAGE} /model")
    assert bad.returncode == 125 and f'count must be an integer: strconv.Atoi: parsing "{four[1]}"' in bad.stderr
    bad = on("A", f"docker run -d --name tp8x --gpus device=0,1 {IMAGE} /model")
    assert bad.returncode == 125 and "cannot set both Count and DeviceIDs on device request" in bad.stderr


def test_dp4_expert_parallel_four_engines(clean):
    last4 = uuids()[4:]
    gpus = '"device=4,5,6,7"'
    r = on("A", f"docker run -d --name dp4 --gpus {shlex.quote(gpus)} --cpuset-cpus 56-111,168-223 "
                "--label railyard.rank=0 --label railyard.layout=dp_ep --network host "
                f"-v /root/models/m:/model:ro {IMAGE} /model -dp 4 -tp 1 --enable-expert-parallel "
                "--all2all-backend deepep_low_latency --kv-cache-dtype fp8 --max-num-batched-tokens 4096 "
                "--async-scheduling --port 8301")
    assert r.returncode == 0, r.stderr
    log = wait_log("dp4", "Application startup complete")
    kv = re.findall(r"^\(EngineCore_DP(\d) pid=\d+\) INFO .* \[kv_cache_utils\.py:\d+\] GPU KV cache size: ([\d,]+) "
                    r"tokens$", log, re.M)
    assert [d for d, _ in kv] == ["0", "1", "2", "3"]
    tokens = [int(t.replace(",", "")) for _, t in kv]
    assert len(set(tokens)) > 1 and max(tokens) - min(tokens) < 0.01 * max(tokens)  # ranks differ by some blocks
    assert log.count("Maximum concurrency for 98,304 tokens per request: ") == 4
    assert "Chunked prefill is enabled with max_num_batched_tokens=4096." in log
    held = apps()
    assert sorted((a.gpu_uuid, a.name) for a in held) == sorted(
        (u, f"VLLM::Worker_DP{d}_EP{d}") for d, u in enumerate(last4))
    doc = json.loads(on("A", "docker inspect dp4").stdout)[0]
    assert doc["HostConfig"]["CpusetCpus"] == "56-111,168-223"
    assert doc["Config"]["Labels"] == {"railyard.rank": "0", "railyard.layout": "dp_ep"}
    body = json.dumps({"model": "/model", "messages": [{"role": "user", "content": "hi"}]})
    for _ in range(2):
        chat = on("A", f"curl -s localhost:8301/v1/chat/completions -H 'content-type: application/json' "
                       f"-d {shlex.quote(body)}")
        assert json.loads(chat.stdout)["choices"][0]["finish_reason"] == "stop"
    metrics = on("A", "curl -s localhost:8301/metrics").stdout
    running = re.findall(r'^vllm:num_requests_running\{engine="(\d)",model_name="/model"\} ', metrics, re.M)
    assert running == ["0", "1", "2", "3"]
    done = re.findall(r'^vllm:prompt_tokens_total\{engine="(\d)",model_name="/model"\} (\S+)$', metrics, re.M)
    assert [e for e, v in done if float(v) > 0] == ["0", "1"]  # two requests, spread over the engines
    on("A", "docker stop dp4")
    assert apps() == []


def test_busy_gpu_refuses_that_engine(clean):
    faults.fault("A", "gpu-busy", "30000@6")
    held = apps()
    assert [(a.gpu_uuid, a.name, a.used_mib) for a in held] == [(uuids()[6], "python3", 30000)]
    r = on("A", f"docker run -d --name busy --gpus all -v /root/models/m:/model:ro {IMAGE} /model -dp 8 -ep")
    assert r.returncode == 0
    assert wait_exit("busy")["ExitCode"] == 1
    log = on("A", "docker logs busy").stdout
    assert re.search(r"^\(EngineCore_DP6 pid=\d+\) .*ValueError: Free memory on device cuda:0 \(111\.10/140\.40 GiB\) "
                     r"on startup is less than desired GPU memory utilization \(0\.9, 126\.36 GiB\)", log, re.M), log
    assert [a.name for a in apps()] == ["python3"]  # the other engines let go of their GPUs


def test_host_level_vllm_serves_and_stops(clean):
    start = on("A", 'MODEL_PATH=/root/models/m PORT=8302; setsid nohup vllm serve "$MODEL_PATH" --port "$PORT" -tp 8 '
                    "--served-model-name glm > /root/host-vllm.log 2>&1 < /dev/null & echo $!")
    pid = int(start.stdout)
    try:
        deadline = time.monotonic() + 15
        while on("A", "curl -s -o /dev/null -w '%{http_code}' localhost:8302/health").stdout != "200":
            assert time.monotonic() < deadline, on("A", "cat /root/host-vllm.log").stdout
            time.sleep(0.2)
        assert sorted(a.name for a in apps()) == [f"VLLM::Worker_TP{i}" for i in range(8)]
        assert {a.gpu_uuid for a in apps()} == set(uuids())
        log = on("A", "cat /root/host-vllm.log").stdout
        assert log.count("GPU KV cache size: ") == 1 and "(EngineCore pid=" in log
    finally:
        on("A", f"kill -TERM {pid}")
    deadline = time.monotonic() + 10
    while apps() or on("A", f"test -d /proc/{pid} && ! grep -q '^State:.Z' /proc/{pid}/status").returncode == 0:
        assert time.monotonic() < deadline, "vllm did not stop on SIGTERM"
        time.sleep(0.1)
    assert "Shutting down (SIGTERM)" in on("A", "cat /root/host-vllm.log").stdout


def test_b200_by_option_then_h200_again(hgx8):
    t0 = time.monotonic()
    r = inv_cmd("lab.up", "--shape", "hgx8", "--gpu", "B200")  # same shape: only what the tools report changes
    assert r.returncode == 0 and r.stdout.strip() == str(hgx8)
    try:
        gpus = parse_gpus(on("B", "nvidia-smi --query-gpu=index,uuid,name,memory.used,memory.total "
                                    "--format=csv,noheader,nounits").stdout)
        assert [(g.name, g.memory_total_mib) for g in gpus] == [("NVIDIA B200", 183359)] * 8
        assert load_inventory(hgx8, []).host("B").vars["cluster_gpu_name"] == "B200"
        assert json.loads((lab.lab_dir() / "lab.json").read_text())["gpu"] == "B200"
    finally:
        lab.up(2, log=lambda *_: None, shape="hgx8")
    assert parse_gpus(on("B", "nvidia-smi --query-gpu=index,uuid,name,memory.used,memory.total "
                                "--format=csv,noheader,nounits").stdout)[0].name == "NVIDIA H200"
    assert time.monotonic() - t0 < 20
