"""The lab itself: private homes, simulated tools that follow the kernel, faults, inv lab.*."""

import json
import subprocess

import pytest

from railyard.facts.docker import parse_docker_version
from railyard.facts.gpu import parse_compute_apps, parse_gpus
from railyard.facts.net import parse_ibdev2netdev, parse_show_gids, roce_v2_index
import railyard_lab as lab
from railyard_lab import faults

from .conftest import inv_cmd, on

pytestmark = pytest.mark.lab




def test_each_host_has_its_own_home_and_hostname(healthy_lab):
    root = lab.lab_dir()
    assert on("A", "hostname").stdout.strip() == "A" and on("B", "hostname").stdout.strip() == "B"
    on("A", "echo from-A > ~/copied.txt")  # ssh hands the remote shell one string
    # copied from A to B over the rail with rsync, as sync-model will do
    r = on("A", "rsync", "-a", "/root/copied.txt", f"root@{lab.rail_net(1)}.12:/root/landed.txt")
    assert r.returncode == 0, r.stderr
    assert (root / "hosts" / "B" / "home" / "landed.txt").read_text() == "from-A\n"
    assert not (root / "hosts" / "A" / "home" / "landed.txt").exists()
    assert on("B", "cat", "/root/landed.txt").stdout == "from-A\n"
    on("A", "rm", "-f", "/root/copied.txt")
    on("B", "rm", "-f", "/root/landed.txt")


def test_simulated_tools_follow_the_kernel(healthy_lab):
    rows = parse_ibdev2netdev(on("B", "ibdev2netdev").stdout)
    assert [(r.hca, r.netdev, r.up) for r in rows] == [("mlx5_0", "cx8r0", True), ("mlx5_1", "cx8r1", True)]
    subprocess.run(["ip", "-n", f"{lab.NS_PREFIX}B", "link", "set", "cx8r1", "down"], check=True)
    try:
        rows = parse_ibdev2netdev(on("B", "ibdev2netdev").stdout)
        assert [r.up for r in rows] == [True, False]
    finally:
        subprocess.run(["ip", "-n", f"{lab.NS_PREFIX}B", "link", "set", "cx8r1", "up"], check=True)
    subprocess.run(["ip", "-n", f"{lab.NS_PREFIX}B", "addr", "add", f"{lab.rail_net(1)}.99/24", "dev", "cx8r1"], check=True)
    try:
        gids = parse_show_gids(on("B", "show_gids", "mlx5_1").stdout)
        assert roce_v2_index(gids, "mlx5_1", f"{lab.rail_net(1)}.12") == 3
        assert roce_v2_index(gids, "mlx5_1", f"{lab.rail_net(1)}.99") == 5  # a second address: next pair
    finally:
        subprocess.run(["ip", "-n", f"{lab.NS_PREFIX}B", "addr", "del", f"{lab.rail_net(1)}.99/24", "dev", "cx8r1"], check=True)


def test_nvidia_smi_stand_in_matches_the_real_format(healthy_lab):
    table = on("A", "nvidia-smi").stdout.splitlines()
    assert all(len(line) == 91 for line in table[1:] if line.startswith(("|", "+")))
    assert "Driver Version: " in table[2] and "CUDA Version: 13.0" in table[2]
    gpus = parse_gpus(on("A", "nvidia-smi", "--query-gpu=index,uuid,name,memory.used,memory.total",
                           "--format=csv,noheader,nounits").stdout)
    assert [g.name for g in gpus] == ["NVIDIA RTX PRO 6000 Blackwell Workstation Edition", "NVIDIA GB300"]
    faults.fault("A", "gpu-busy", "1234")
    apps = parse_compute_apps(on("A", "nvidia-smi", "--query-compute-apps=gpu_uuid,pid,process_name,used_memory",
                                   "--format=csv,noheader,nounits").stdout)
    assert [(a.gpu_uuid, a.name, a.used_mib) for a in apps] == [(gpus[1].uuid, "python3", 1234)]
    assert on("A", "kill", "-0", str(apps[0].pid)).returncode == 0  # a real process on that host
    faults.heal("A")
    assert on("A", "nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader").stdout == ""
    state = on("A", f"cat /proc/{apps[0].pid}/stat 2>/dev/null | cut -d' ' -f3").stdout.strip()
    assert state in ("", "Z")  # gone (or a zombie nobody reaped: no longer running)


def test_docker_stand_in(healthy_lab):
    v = on("A", "docker", "version")
    assert v.returncode == 0 and parse_docker_version(v.stdout).server == "28.2.2"
    miss = on("A", "docker", "image", "inspect", "nope:1")
    assert miss.returncode == 1 and miss.stdout.strip() == "[]" and "No such image: nope:1" in miss.stderr
    fmt = on("A", "docker", "image", "inspect", lab.LAB_IMAGE_NAME, "--format", "{{.Architecture}} {{.RepoDigests}}")
    assert fmt.stdout.strip() == f"arm64 [vllm/vllm-openai@{lab.LAB_IMAGE_DIGEST}]"
    faults.fault("A", "docker-down")
    down = on("A", "docker", "version")
    assert down.returncode == 1 and down.stdout.startswith("Client:") and "Is the docker daemon running?" in down.stderr


def test_docker_stand_in_takes_names_whole(healthy_lab):
    # what a process of a removed container left behind once (CI, stop 17): its folder, no config
    half = lab.lab_dir() / "hosts" / "A" / "docker" / "containers" / "half"
    half.mkdir(parents=True)
    (half / "state.json").write_text("{}")
    logs = on("A", "docker logs half")
    assert logs.returncode == 1 and "No such container: half" in logs.stderr
    run = on("A", f"docker run -d --name half --entrypoint sleep {lab.LAB_IMAGE_NAME} 30")
    assert run.returncode == 0, run.stderr
    assert on("A", "docker inspect --format '{{.State.Running}}' half").stdout.strip() == "true"
    assert on("A", "docker rm -f half").returncode == 0
    assert not half.exists() and on("A", "docker logs half").returncode == 1


def test_docker_stand_in_is_as_strict_as_docker(healthy_lab):
    """What real docker does that a launch relies on: `ps -q` prints ids only; a --device that does not exist
    fails the run (exit 125, its daemon's words) and leaves the container Created under its name; without
    --ipc host a container has its own /dev/shm of --shm-size (64 MB by default), without --network host its
    own network (loopback only here); /dev/infiniband exists where the host has RDMA devices."""
    img = lab.LAB_IMAGE_NAME
    bad = on("A", f"docker run -d --name nodev --device /dev/nope --entrypoint sleep {img} 30")
    assert bad.returncode == 125 and bad.stderr.strip() == (
        'docker: Error response from daemon: error gathering device information while adding custom device '
        '"/dev/nope": no such file or directory.'), bad.stderr
    assert on("A", "docker ps -a --format '{{.Names}} {{.State}}'").stdout.split("\n").count("nodev created") == 1
    try:
        own = on("A", f"docker run -d --name own --entrypoint sleep {img} 30").stdout.strip()
        wide = on("A", f"docker run -d --name wide --shm-size 1g --ipc host --network host --device /dev/infiniband "
                       f"--entrypoint sleep {img} 30")
        assert wide.returncode == 0, wide.stderr
        ids = on("A", "docker ps -q").stdout.split()
        assert own[:12] in ids and len(ids) == 2 and all(len(i) == 12 for i in ids)   # no header, no names
        assert on("A", "docker ps -aq").stdout.split() == on("A", "docker ps -a --format '{{.ID}}'").stdout.split()
        shm = on("A", "docker exec own df -k --output=size /dev/shm").stdout.split()
        assert shm[-1] == "65536"
        links = on("A", "docker exec own ip -o link show").stdout.splitlines()
        assert len(links) == 1 and links[0].startswith("1: lo: ")                    # lo, no rail
        assert "cx8r1" in on("A", "docker exec wide ip -o link show").stdout
        host_shm = on("A", "df -k --output=size /dev/shm").stdout.split()[-1]
        assert on("A", "docker exec wide df -k --output=size /dev/shm").stdout.split()[-1] == host_shm
        assert "uverbs0" in on("A", "docker exec wide ls /dev/infiniband").stdout
    finally:
        on("A", "docker rm -f nodev own wide")


def test_clock_skew_is_real_for_the_hosts_processes(healthy_lab):
    faults.fault("B", "clock-skew", "120")
    a = float(on("A", "date", "+%s").stdout)
    b = float(on("B", "date", "+%s").stdout)
    assert 110 < b - a < 130


def test_inv_lab_tasks(healthy_lab):
    r = inv_cmd("lab.ssh", "B", "--", "cat", "/proc/sys/kernel/hostname")
    assert r.returncode == 0 and r.stdout.strip() == "B"
    r = inv_cmd("lab.fault", "B", "mtu", "--value", "4000")
    assert r.returncode == 0 and "B: mtu 4000" in r.stdout
    assert "mtu 4000" in on("B", "ip", "link", "show", "cx8r1").stdout
    r = inv_cmd("lab.heal", "--host", "B")
    assert "healed mtu" in r.stdout and "mtu 9000" in on("B", "ip", "link", "show", "cx8r1").stdout
    r = inv_cmd("lab.fault", "B", "melt=1")
    assert r.returncode == 2 and "unknown fault 'melt'" in r.stderr and "Traceback" not in r.stderr
    r = inv_cmd("lab.up")  # idempotent: same hosts, same keys, same inventory path
    assert r.returncode == 0 and r.stdout.strip() == str(healthy_lab)
    assert json.loads((lab.lab_dir() / "lab.json").read_text())["hosts"] == ["A", "B"]


def test_inv_list_names_every_task():
    r = inv_cmd("--list")
    for t in ("preflight", "trust-hosts", "lab.up", "lab.down", "lab.fault", "lab.heal", "lab.ssh"):
        assert t in r.stdout
    assert "--inventory" in inv_cmd("--help", "preflight").stdout
