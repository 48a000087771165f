"""Parsers on real captured output (tests/fixtures/real/, origins in ORIGINS.md and FORMATS-ORIGINS.md)."""

import pytest

from railyard.facts import ParseError
from railyard.facts.docker import parse_docker_version, parse_image_inspect
from railyard.facts.gpu import Gpu, GpuProcess, _csv_rows, _mib, parse_compute_apps, parse_gpus, select_gpu
from railyard.facts.net import (parse_ethtool, parse_ibdev2netdev, parse_ip_br_addr, parse_ip_link, parse_ping,
                                parse_route_get, parse_show_gids, roce_v2_index)
from railyard.facts.system import parse_df, parse_timedatectl

from .conftest import real


# ---------------------------------------------------------------- ibdev2netdev

def test_ibdev2netdev_12_devices_two_down_text_sorted():
    rows = parse_ibdev2netdev(real("ibdev2netdev/tpgds-aihub0007_12dev_2down.txt"))
    assert len(rows) == 12
    assert [r.hca for r in rows][:3] == ["mlx5_0", "mlx5_1", "mlx5_10"]  # sorted as text
    assert sorted(r.hca for r in rows if not r.up) == ["mlx5_10", "mlx5_4"]
    assert [r.hca for r in rows if r.netdev == "bond0"] == ["mlx5_3", "mlx5_9"]
    assert all(r.port == 1 for r in rows)


@pytest.mark.parametrize("name,down", [
    ("tpgds-aihub0009_12dev_2down.txt", {"mlx5_2": "ens12f1np1", "mlx5_8": "ens20f1np1"}),
    ("tpgds-aihub0012_12dev_2down.txt", {"mlx5_11": "ens10f1np1", "mlx5_9": "ens12f1np1"}),
])
def test_ibdev2netdev_down_ports(name, down):
    rows = parse_ibdev2netdev(real(f"ibdev2netdev/{name}"))
    assert {r.hca: r.netdev for r in rows if not r.up} == down


# ---------------------------------------------------------------- ip

def test_ip_br_addr_rails_and_trailing_spaces():
    addrs = parse_ip_br_addr(real("ip/ip-br-a_tpgds-aihub0007_h100-8xroce.txt"))
    assert addrs["enp25s0np0"].ipv4 == ["10.99.91.59/31"]
    assert addrs["enp218s0np0"].ipv4 == ["10.99.98.59/31"]
    assert addrs["bond0"].ipv4 == ["10.73.175.137/29"]
    assert addrs["enp86s0f0"].state == "DOWN" and addrs["enp86s0f0"].ipv4 == []
    rails = [n for n, a in addrs.items() if a.ipv4 and a.ipv4[0].startswith("10.99.")]
    assert len(rails) == 8


def test_ip_br_addr_peer_and_ens_names():
    peer = parse_ip_br_addr(real("ip/ip-br-a_tpgds-aihub0008_h100-8xroce.txt"))
    assert peer["enp25s0np0"].ipv4 == ["10.99.91.63/31"]
    ens = parse_ip_br_addr(real("ip/ip-br-a_tpgds-aihub0009_ens-names.txt"))
    assert ens["ens108np0"].ipv4 == ["10.99.91.47/31"] and ens["ens115np0"].ipv4 == ["10.99.98.47/31"]


def test_ip_br_addr_down_interface_can_hold_an_address():
    addrs = parse_ip_br_addr(real("ip/ip-br-a_tpgds-aihub0001_with-docker0.txt"))
    assert addrs["docker0"].state == "DOWN" and addrs["docker0"].ipv4 == ["172.17.0.1/16"]
    other = parse_ip_br_addr(real("ip/ip-br-a_tpgds-aihub0012.txt"))
    assert other["eno1"].state == "DOWN" and other["ens3np0"].ipv4 == ["10.99.91.43/31"]


def test_ip_link_veth_names_and_mtu():
    text = ("1: lo: <LOOPBACK,UP,LOWER_UP> mtu 65536 qdisc noqueue state UNKNOWN mode DEFAULT group default qlen 1000\\"
            "    link/loopback 00:00:00:00:00:00 brd 00:00:00:00:00:00\n"
            "4: cx8r1@if13: <BROADCAST,MULTICAST,UP,LOWER_UP> mtu 9000 qdisc noqueue state UP mode DEFAULT group "
            "default qlen 1000\\    link/ether c6:12:b3:cb:2a:95 brd ff:ff:ff:ff:ff:ff link-netnsid 0\n"
            "5: enp25s0np0: <BROADCAST,MULTICAST> mtu 1500 qdisc mq state DOWN mode DEFAULT group default qlen 1000\\"
            "    link/ether 00:00:00:00:00:01 brd ff:ff:ff:ff:ff:ff\n")
    links = parse_ip_link(text)
    assert links["cx8r1"].mtu == 9000 and links["cx8r1"].up
    assert links["enp25s0np0"].mtu == 1500 and not links["enp25s0np0"].up and links["enp25s0np0"].state == "DOWN"


def test_route_get():
    text = real("ping/local-ip-route-get-127.0.0.1.txt")
    routes = parse_route_get(text)
    assert routes[0].dest == "127.0.0.1" and routes[0].dev == "lo"
    batch = ("198.18.101.12 dev cx8r1 src 198.18.101.11 uid 0 \\    cache \n"
             "198.18.101.13 via 198.18.0.254 dev mgmt0 src 198.18.0.11 uid 0 \\    cache \n")
    a, b = parse_route_get(batch)
    assert (a.dev, a.src, a.via) == ("cx8r1", "198.18.101.11", None)
    assert (b.dev, b.via) == ("mgmt0", "198.18.0.254")


# ---------------------------------------------------------------- ethtool

def test_ethtool_link_down_speed_unknown():
    e = parse_ethtool(real("ethtool/web-ethtool-i40e-link-down-speed-unknown.txt"))
    assert e.speed_mbps is None and e.speed_text == "Unknown!" and e.link_detected is False


def test_ethtool_400g_and_200g():
    assert parse_ethtool(real("ethtool/web-ethtool-grep-400G-ens1f0-annotated-lab.txt")).speed_mbps == 400000
    assert parse_ethtool(real("ethtool/web-ethtool-grep-dgx-spark-cx7-200G-after.txt")).speed_mbps == 200000
    full = parse_ethtool(real("ethtool/web-ethtool-bond0-200G-2x100G-full.txt"))
    assert full.speed_mbps == 200000 and full.link_detected is True


def test_ethtool_loopback_has_no_speed():
    e = parse_ethtool(real("ethtool/local-ethtool-lo.txt"))
    assert e.speed_mbps is None and e.link_detected is True


# ---------------------------------------------------------------- ping

def test_ping_mtu_too_small_local_errors():
    p = parse_ping(real("ping/web-ping-M-do-s8992-mtu1500-local-error-100pct-loss.txt"))
    assert (p.transmitted, p.received, p.errors, p.loss_pct) == (4, 0, 4, 100.0)
    assert p.local_errors == ["ping: local error: message too long, mtu=1500"]
    assert p.rtt_avg_ms is None


def test_ping_jumbo_success():
    p = parse_ping(real("ping/web-ping-M-do-s8972-success-mtu9000.txt"))
    assert p.received == p.transmitted > 0 and p.loss_pct == 0.0 and p.rtt_avg_ms is not None


def test_ping_quiet_summary_and_no_statistics():
    p = parse_ping(real("ping/local-ping-c3-q-lo.txt"))
    assert (p.transmitted, p.received) == (3, 3) and p.rtt_avg_ms == pytest.approx(0.039)
    with pytest.raises(ParseError):
        parse_ping("ping: connect: Network is unreachable\n")


# ---------------------------------------------------------------- show_gids

def test_show_gids_classic_v2_index_3():
    gids = parse_show_gids(real("show_gids/tpgds-aihub0001_mlx5_0_v1v2.txt"))
    assert len(gids) == 4
    assert roce_v2_index(gids, "mlx5_0", "10.99.91.39") == 3
    assert gids[0].ipv4 is None and gids[0].netdev == "ens108np0"


def test_show_gids_v2_at_index_5_never_assume_3():
    gids = parse_show_gids(real("show_gids-more/web-show_gids-spaces-cx6-v2-ipv4-at-index5-6gids.txt"))
    assert roce_v2_index(gids, "mlx5_0", "172.19.0.60") == 5
    assert roce_v2_index(gids, "mlx5_0", "10.0.0.1") is None


def test_show_gids_indented_multi_device_and_empty():
    gids = parse_show_gids(real("show_gids-more/web-show_gids-tabs-3devs-12gids-indented-C-comment.txt"))
    assert len({g.dev for g in gids}) == 3 and len(gids) == 12
    assert parse_show_gids(real("show_gids-more/web-show_gids-tabs-no-gids-n0.txt")) == []


def test_show_gids_v2_only_table():
    gids = parse_show_gids(real("show_gids-more/web-show_gids-tabs-hrn3-v2only-ipv4-at-index1-plus-mlx5_bond.txt"))
    assert roce_v2_index(gids, "hrn3_bond_0", "27.105.180.3") == 1
    assert {g.ver for g in gids if g.dev == "hrn3_bond_0"} == {"v2"}
    assert [g.netdev for g in gids if g.dev == "mlx5_bond_0"] == ["bond1", "bond1"]


# ---------------------------------------------------------------- timedatectl

@pytest.mark.parametrize("name,synced", [
    ("web-timedatectl-systemd247-synced-ntp-active.txt", True),
    ("web-timedatectl-systemd247-synced-ntp-inactive.txt", True),
    ("web-timedatectl-unsynced-ntp-inactive.txt", False),
    ("web-timedatectl-unsynced-ntp-na-balena.txt", False),
    ("web-timedatectl-legacy-ntp-synchronized-2014.txt", True),
    ("web-timedatectl-chrony-ntp-service-N-A.txt", True),
])
def test_timedatectl_layouts(name, synced):
    assert parse_timedatectl(real(f"timedatectl/{name}")).synchronized is synced


def test_timedatectl_show_properties_and_no_systemd():
    st = parse_timedatectl("Timezone=Etc/UTC\nLocalRTC=no\nCanNTP=yes\nNTP=yes\nNTPSynchronized=no\n")
    assert st.synchronized is False and st.service == "active"
    assert parse_timedatectl(real("timedatectl/local-timedatectl.txt")).synchronized is None


# ---------------------------------------------------------------- nvidia-smi

def test_gpus_h200_idle_and_busy():
    idle = parse_gpus(real("nvidia-smi-h200/query-gpu-csv-noheader-nounits_idle.txt"))
    assert idle == [Gpu(0, "GPU-35842103-278f-873a-2444-0a148739cdf2", "NVIDIA H200", 0, 143771)]
    busy = parse_gpus(real("nvidia-smi-h200/query-gpu-csv-noheader-nounits_busy.txt"))
    assert busy[0].memory_used_mib == 8719


def test_compute_apps_idle_is_empty_busy_names_the_process():
    assert parse_compute_apps(real("nvidia-smi-h200/query-compute-apps-csv-noheader-nounits_idle.txt")) == []
    apps = parse_compute_apps(real("nvidia-smi-h200/query-compute-apps-csv-noheader-nounits_busy.txt"))
    assert apps == [GpuProcess("GPU-35842103-278f-873a-2444-0a148739cdf2", 456, "python3", 8710)]
    with_header = parse_compute_apps(real("nvidia-smi-h200/query-compute-apps-csv_busy.txt"))
    assert with_header[0].used_mib == 8710


def test_select_gpu_never_picks_the_display_gpu():
    gpus = [Gpu(0, "GPU-a", "NVIDIA RTX PRO 6000 Blackwell Workstation Edition", 24, 97887),
            Gpu(1, "GPU-b", "NVIDIA GB300", 1, 284208)]
    assert [g.uuid for g in select_gpu(gpus, "GB300")] == ["GPU-b"]
    assert [g.uuid for g in select_gpu(gpus, "gb300")] == ["GPU-b"]
    assert select_gpu(gpus, "H200") == []


def test_memory_csv_with_units():
    rows = _csv_rows(real("nvidia-smi/query-memory-used-free-csv_tpgds-aihub0008.txt"))
    assert rows[0] == ["memory.used [MiB]", "memory.free [MiB]"] and _mib(rows[1][0]) == 1718


# ---------------------------------------------------------------- df / docker

def test_df_h200_tmp():
    d = parse_df(real("nvidia-smi-h200/host/df-P-B1-tmp.txt"))
    assert d.size > d.avail > 0 and d.mount.startswith("/")


def test_docker_version_daemon_down_real_client():
    v = parse_docker_version(real("docker/local-docker-version-daemon-down.txt"))
    assert v.client == "28.2.2" and v.server is None
    assert v.error.startswith("Cannot connect to the Docker daemon")


def test_docker_version_full_server_section():
    v = parse_docker_version(real("docker/web-docker-version-23.0.1-linux-amd64-full.txt"))
    assert (v.client, v.server, v.error) == ("23.0.1", "23.0.1", None)


def test_docker_version_permission_denied_both_wordings():
    for name in ("web-docker-version-18.06-permission-denied-old-Got-prefix.txt",
                 "web-docker-permission-denied-new-no-Got-prefix-v1.47.txt"):
        v = parse_docker_version(real(f"docker/{name}"))
        assert v.server is None and "permission denied" in v.error


def test_image_inspect_missing_is_empty_array():
    assert parse_image_inspect(real("docker/local-image-inspect-missing-daemon-down.stdout")) == []
