"""Topology parsers on real captures: `nvidia-smi topo -m` (GPU <-> CPU/NUMA/NIC) and `lscpu` (NUMA nodes)."""

import pytest

from railyard.facts import ParseError
from railyard.facts.gpu import parse_cpu_list, parse_lscpu_numa, parse_topo_matrix

from .conftest import real


def test_topo_single_numa_12_nics():
    topo = parse_topo_matrix(real("nvidia-smi/topo-m_h100-8gpu-12nic_tpgds-aihub0007.txt"))
    assert sorted(topo) == list(range(8))
    assert {t.cpu_affinity for t in topo.values()} == {"0-191"} and {t.numa_affinity for t in topo.values()} == {0}
    assert all(set(t.gpus.values()) == {"NV18"} and len(t.gpus) == 7 for t in topo.values())
    assert list(topo[0].nics) == [f"mlx5_{i}" for i in range(12)]  # named by the NIC legend, in column order
    # each GPU's PIX NIC, as the capture shows (mlx5_3 and mlx5_9 are the bond, no GPU's own)
    assert {i: [n for n, r in t.nics.items() if r == "PIX"] for i, t in topo.items()} == {
        0: ["mlx5_0"], 1: ["mlx5_1"], 2: ["mlx5_2"], 3: ["mlx5_5"], 4: ["mlx5_6"], 5: ["mlx5_7"], 6: ["mlx5_8"],
        7: ["mlx5_11"]}


def test_topo_two_numa_nodes_and_a_header_without_its_leading_tab():
    topo = parse_topo_matrix(real("nvidia-smi-topo/topo-m_h100-8gpu-12nic-2numa_hpe-xd670.txt"))
    assert [topo[i].cpu_affinity for i in range(8)] == ["0-55,112-167"] * 4 + ["56-111,168-223"] * 4
    assert [topo[i].numa_affinity for i in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert topo[0].nics["mlx5_0"] == "PIX" and topo[0].nics["mlx5_1"] == "PXB" and topo[0].nics["mlx5_6"] == "SYS"
    assert topo[4].nics["mlx5_6"] == "PIX" and topo[4].nics["mlx5_0"] == "SYS" and topo[7].nics["mlx5_9"] == "PIX"
    assert topo[5].gpus[2] == "NV18" and 5 not in topo[5].gpus


def test_topo_gpus_on_the_second_numa_node_only():
    topo = parse_topo_matrix(real("nvidia-smi-topo/topo-m_rtx4090d-2gpu-2nic-numa1_xeon-8481c.txt"))
    assert {i: (t.cpu_affinity, t.numa_affinity, t.gpus, t.nics) for i, t in topo.items()} == {
        0: ("56-111,168-223", 1, {1: "NODE"}, {"mlx5_0": "NODE", "mlx5_1": "NODE"}),
        1: ("56-111,168-223", 1, {0: "NODE"}, {"mlx5_0": "NODE", "mlx5_1": "NODE"})}


def test_topo_pasted_with_spaces_reads_the_same():
    text = real("nvidia-smi-topo/topo-m_h100-8gpu-12nic-2numa_hpe-xd670.txt")
    spaced = "\n".join("    ".join(c for c in line.split("\t")) for line in text.splitlines())
    a, b = parse_topo_matrix(text), parse_topo_matrix(spaced)
    assert {i: (t.cpu_affinity, t.numa_affinity, t.gpus, t.nics) for i, t in a.items()} == \
           {i: (t.cpu_affinity, t.numa_affinity, t.gpus, t.nics) for i, t in b.items()}


def test_topo_rejects_other_text():
    with pytest.raises(ParseError):
        parse_topo_matrix(real("lscpu/lscpu_xeon-8481c-2s-224cpu-2numa.txt"))


def test_lscpu_two_nodes_match_the_topology():
    numa = parse_lscpu_numa(real("lscpu/lscpu_xeon-8481c-2s-224cpu-2numa.txt"))
    assert sorted(numa) == [0, 1]
    assert numa[0] == list(range(0, 56)) + list(range(112, 168))
    assert numa[1] == list(range(56, 112)) + list(range(168, 224))
    # the same host's GPUs are on node 1: their CPU affinity is exactly node 1's CPUs
    topo = parse_topo_matrix(real("nvidia-smi-topo/topo-m_rtx4090d-2gpu-2nic-numa1_xeon-8481c.txt"))
    assert parse_cpu_list(topo[0].cpu_affinity) == numa[topo[0].numa_affinity]


def test_lscpu_memory_only_nodes_have_no_cpus():
    numa = parse_lscpu_numa(real("lscpu/web-lscpu-gh200-numa-section-9-nodes.txt"))
    assert sorted(numa) == list(range(9)) and numa[0] == list(range(72))
    assert all(numa[n] == [] for n in range(1, 9))


def test_cpu_list():
    assert parse_cpu_list("0-2,5,7-8") == [0, 1, 2, 5, 7, 8] and parse_cpu_list("") == []
    with pytest.raises(ParseError):
        parse_cpu_list("0-x")
