"""discover's decisions (railyard.discover: rails, the serving rail, the GPUs, the inventory's text) on real
captured tool outputs (tests/fixtures/real/, ORIGINS.md there): ibdev2netdev, `ip -br addr`, `nvidia-smi topo -m`
and nvidia-smi's GPU rows of real hosts. Where a case needs what no capture holds (two hosts whose rails share a
subnet), a capture is changed in one stated way and the test says so."""

from __future__ import annotations

import re

import pytest

from railyard.discover import DISTANCE, decide, read_host, render
from railyard.facts.probe import Output
from railyard.inventory import load_inventory

from .conftest import real

IB_0007 = real("ibdev2netdev/tpgds-aihub0007_12dev_2down.txt")
IP_0007 = real("ip/ip-br-a_tpgds-aihub0007_h100-8xroce.txt")
IP_0008 = real("ip/ip-br-a_tpgds-aihub0008_h100-8xroce.txt")   # the same model of server: the same netdev names
TOPO_0007 = real("nvidia-smi/topo-m_h100-8gpu-12nic_tpgds-aihub0007.txt")
H200_ROW = real("nvidia-smi-h200/query-gpu-csv-noheader-nounits_idle.txt")
# a DGX Station's two GPUs, as nvidia-smi's query prints them: the names and memory.total of the real tables in
# nvidia-smi-more/ (the GB300 of the OCI capture, the RTX PRO 6000 Blackwell workstation card)
STATION_ROWS = ("0, GPU-5d3f0b4c-0000-0000-0000-000000000001, NVIDIA RTX PRO 6000 Blackwell Workstation Edition, "
                "20, 97887\n1, GPU-5d3f0b4c-0000-0000-0000-000000000002, NVIDIA GB300, 1, 284208\n")


def out(**texts: str) -> dict[str, Output]:
    return {k: Output(0, v) for k, v in texts.items()}


def as_24(ip_text: str) -> str:
    """The capture as if its routed /31 rails were one /24 per rail (the only change: the prefix length)."""
    return re.sub(r"(10\.99\.9\d\.\d+)/31", r"\1/24", ip_text)


def host(address, hostname, ip, ib=IB_0007, gpus=H200_ROW, topo=TOPO_0007, **more):
    return read_host(address, out(hostname=hostname + "\n", ibdev2netdev=ib, ip_addr=ip, gpus=gpus, topo=topo, **more))


def test_a_real_host_its_rail_netdevs_from_ibdev2netdev_and_ip():
    h = host("10.73.175.137", "tpgds-aihub0007", IP_0007)
    assert h.problems == []
    # 11 netdevs: 9 rail ports (8 with a /31, one without an address), bond0 over mlx5_3 and mlx5_9, two down ports
    assert len(h.netdevs) == 11
    assert h.netdevs["bond0"].hcas == ["mlx5_3", "mlx5_9"]
    assert [str(a) for a in h.netdevs["enp25s0np0"].ipv4] == ["10.99.91.59/31"]
    assert not h.netdevs["enp210s0f1np1"].up and not h.netdevs["enp210s0f1np1"].ipv4


def test_one_host_the_serving_rail_is_the_one_beside_the_gpu():
    """Eight rails alike (no speed read): the NIC on GPU 0's PCIe switch (topo: PIX) wins, the others are NODE."""
    f = decide([host("10.73.175.137", "tpgds-aihub0007", IP_0007)])
    assert f.problems == []
    assert f.serve.name == "enp25s0np0" and f.serve.members["tpgds-aihub0007"].hca == "mlx5_0"
    assert "PIX to the GPUs" in f.why
    assert f.layout == "single_node_tp" and (f.gpu_name, f.gpu_count) == ("H200", 1)
    assert any("bond0 is on mlx5_3, mlx5_9" in n for n in f.notes)
    assert DISTANCE[0] == "PIX"


def test_two_real_hosts_on_routed_31s_do_not_pair_one_line_each():
    """aihub0009 and aihub0012: a /31 per port on a routed fabric, and bond0 in two different /29s: no rail is
    one subnet across the hosts, which railyard's inventory needs; each address is named, nothing is decided."""
    a = host("10.73.175.121", "tpgds-aihub0009", real("ip/ip-br-a_tpgds-aihub0009_ens-names.txt"),
             ib=real("ibdev2netdev/tpgds-aihub0009_12dev_2down.txt"))
    b = host("10.73.175.161", "tpgds-aihub0012", real("ip/ip-br-a_tpgds-aihub0012.txt"),
             ib=real("ibdev2netdev/tpgds-aihub0012_12dev_2down.txt"))
    f = decide([a, b])
    unpaired = [p for p in f.problems if "does not pair" in p]
    assert len(unpaired) == 18  # 8 rails and bond0, on each host
    assert any(p.startswith("tpgds-aihub0009: ens108np0 (mlx5_0) 10.99.91.47/31 does not pair") for p in unpaired)
    assert any(p.startswith("tpgds-aihub0012: bond0 (mlx5_10) 10.73.175.161/29 does not pair") for p in unpaired)
    assert any(p.startswith("no rail every host has") for p in f.problems)
    assert f.serve is None


def test_two_hosts_sharing_rails_are_decided_and_written_as_preflight_loads_them(tmp_path):
    a = host("10.73.175.137", "tpgds-aihub0007", as_24(IP_0007))
    b = host("10.73.175.138", "tpgds-aihub0008", as_24(IP_0008))
    f = decide([a, b])
    assert f.problems == []
    assert len(f.rails) == 9 and f.serve.name == "enp25s0np0"      # 8 rails and bond0 (a /29 in both captures)
    assert f.layout == "multinode_tp"
    text = render(f, "railyard discover --hosts 10.73.175.137,10.73.175.138")
    path = tmp_path / "inventory.yml"
    path.write_text(text)
    import railyard.layouts  # noqa: F401  (serve_layout is checked against the registered layouts)
    inv = load_inventory(path)
    assert [h.name for h in inv.hosts] == ["tpgds-aihub0007", "tpgds-aihub0008"]
    head = inv.head
    assert head.address == "10.73.175.137" and head.serve_rail.hca == "mlx5_0"
    assert str(head.serve_rail.ipv4) == "10.99.91.59/24" and str(inv.hosts[1].serve_rail.ipv4) == "10.99.91.63/24"
    assert head.vars["cluster_gpu_name"] == "H200" and head.vars["vllm_tensor_parallel_size"] == 2
    assert "# Serving rail: enp25s0np0 (10.99.91.0/24)" in text and "Placeholder: replace it." in text


def test_a_host_whose_rail_lost_its_address_is_named():
    """aihub0008 with enp25s0np0's address removed (ip addr del): up, no IPv4, where the peer has one there."""
    ip = "\n".join(line for line in as_24(IP_0008).splitlines() if not line.startswith("enp25s0np0"))
    f = decide([host("10.73.175.137", "tpgds-aihub0007", as_24(IP_0007)), host("10.73.175.138", "tpgds-aihub0008", ip)])
    named = [p for p in f.problems if p.startswith("tpgds-aihub0008: enp25s0np0")]
    assert len(named) == 1 and "no IPv4 address" in named[0] and "10.99.91.59/24" in named[0]
    # the peer's address on that rail now pairs with no one: that is this host's line, not a second one
    assert not any(p.startswith("tpgds-aihub0007") for p in f.problems)


def test_a_station_serves_on_its_gb300_never_the_display_gpu():
    f = decide([host("10.20.0.11", "station-a", as_24(IP_0007), gpus=STATION_ROWS),
                host("10.20.0.12", "station-b", as_24(IP_0008), gpus=STATION_ROWS)])
    assert (f.gpu_name, f.gpu_model, f.gpu_count) == ("GB300", "NVIDIA GB300", 1)
    assert any("RTX PRO 6000" in u for u in f.gpu_unused)


def test_hosts_without_rdma_or_gpus_are_one_line_each():
    no_tools = {"hostname": Output(0, "x\n"), "ibdev2netdev": Output(127, "", "ibdev2netdev"),
                "ip_addr": Output(0, IP_0007), "gpus": Output(127, "", "nvidia-smi")}
    h = read_host("10.0.0.9", no_tools)
    assert any("ibdev2netdev not found" in p for p in h.problems)
    assert any("nvidia-smi not found" in p for p in h.problems)
    empty = read_host("10.0.0.8", out(hostname="y\n", ibdev2netdev="", ip_addr=IP_0007, gpus=H200_ROW))
    assert empty.problems == ["10.0.0.8: no RDMA device: ibdev2netdev lists none (fix: a ConnectX port with its "
                              "driver loaded, `ibv_devices`)"]


def test_equal_gpus_of_two_models_are_not_guessed():
    rows = STATION_ROWS.replace("284208", "97887")
    f = decide([host("10.20.0.11", "station-a", IP_0007, gpus=rows)])
    assert any("equal candidates" in p for p in f.problems)


@pytest.mark.parametrize("speeds,want", [({"enp41s0np0": "400000"}, "enp41s0np0")])
def test_the_fastest_rail_wins_over_the_nearest(speeds, want):
    """ethtool's speed (a real 400G capture for one rail, the 100G capture for the rest) before the distance."""
    fast = real("ethtool/web-ethtool-grep-400G-ens1f0-annotated-lab.txt")
    slow = real("ethtool/web-ethtool-grep-dgx-spark-cx7-100G-before.txt")
    names = ["enp25s0np0", "enp41s0np0", "enp59s0np0", "enp92s0np0", "enp155s0np0", "enp170s0np0", "enp187s0np0",
             "enp218s0np0", "bond0"]
    blocks = "".join(f"@@peer {n} rc=0\n{fast if n in speeds else slow}" for n in names)
    f = decide([host("10.73.175.137", "tpgds-aihub0007", IP_0007, ethtool=blocks)])
    assert f.serve.name == want and "400000 Mb/s" in f.why and "slower:" in f.why
