"""The preflight checks that had no test of their own (issue 22), one domain at a time, on real captured output:
a pass on the healthy capture and the fail or warn text on a broken one. Origins: tests/fixtures/real/ORIGINS.md
(ibdev2netdev/, ip/, show_gids/), FORMATS-ORIGINS.md (docker/, ethtool/, ping/, timedatectl/) and
nvidia-smi-h200/ORIGINS.md (host/df-P-B1-tmp.txt, query-gpu-csv-noheader-nounits_idle.txt). Where no real capture
of a tool's output exists (`ip -o link`), the line is the one tests/test_facts.py reads, in iproute2's `-o`
layout; `du -sb` prints one `BYTES<TAB>PATH` line."""

import ipaddress

from railyard.checks import FAIL, PASS, SKIP, WARN, CheckResult
from railyard.checks.docker import check_docker
from railyard.checks.net import check_gid, check_link_speed, check_mtu, check_rail_ip, check_rail_link, check_route
from railyard.checks.parity import ClockSample, cross_image
from railyard.checks.gpu import check_gpu
from railyard.checks.system import check_disk, check_ntp
from railyard.facts.probe import Output
from railyard.inventory import Host, Rail, load_inventory
from railyard.verbs.preflight import CHECKS, HostProbe, evaluate

from .conftest import ROOT, real


def host(name="A", rail="cx8r1", hca="mlx5_1", ipv4="192.168.101.1/24", **vars):
    base = {"cluster_serve_rail": rail, "preflight_mtu": 9000, "preflight_link_speed_mbps": 400000,
            "preflight_gid_index": -1, "model_path": "/models/m", "model_size_gb": 10, "preflight_disk_margin_gb": 20}
    base.update(vars)
    return Host(name=name, rank=0, address="127.0.0.1", port=22, user="", connection="ssh", key_file="",
                rails={rail: Rail(name=rail, hca=hca, ipv4=ipaddress.ip_interface(ipv4))}, vars=base)


def out(text, rc=0, missing=None):
    return Output(rc, text, missing)


# ---------------------------------------------------------------- docker

def test_check_docker_passes_when_the_server_answers():
    r = check_docker(host(), out(real("docker/web-docker-version-23.0.1-linux-amd64-full.txt")))
    assert r.status == PASS and r.detail == "daemon answers: server 23.0.1, client 23.0.1"
    assert r.evidence == "Server: Engine Version 23.0.1"


def test_check_docker_fails_on_a_daemon_that_is_down_and_names_how_to_start_it():
    r = check_docker(host(), out(real("docker/local-docker-version-daemon-down.txt"), rc=1))
    assert r.status == FAIL and r.detail == "no Server section: the Docker daemon is unreachable"
    assert r.evidence.startswith("Cannot connect to the Docker daemon at unix:///var/run/docker.sock")
    assert "systemctl start docker" in r.hint


def test_check_docker_fails_on_permission_denied_with_the_docker_group_fix():
    r = check_docker(host(), out(real("docker/web-docker-version-18.06-permission-denied-old-Got-prefix.txt"), rc=1))
    assert r.status == FAIL and "permission denied" in r.evidence
    assert "usermod -aG docker" in r.hint


def test_check_docker_without_docker_names_the_missing_tool():
    r = check_docker(host(), out("@@missing docker\n", rc=127, missing="docker"))
    assert r.status == FAIL and r.detail == "tool `docker` not found on PATH" and "Docker Engine" in r.hint


# ---------------------------------------------------------------- parity: one image id on every rank

def test_cross_image_keeps_the_passes_when_every_rank_has_the_same_id_and_fails_the_odd_one():
    image = "vllm/vllm-openai:v0.11.0@sha256:" + "a" * 64
    ok = {n: CheckResult(n, "image", PASS, "present", f"RepoDigests {n}") for n in ("A", "B", "C")}
    same = {"A": "sha256:" + "1" * 64, "B": "sha256:" + "1" * 64, "C": "sha256:" + "1" * 64}
    assert cross_image(dict(ok), same, image) == ok
    odd = cross_image(dict(ok), {**same, "C": "sha256:" + "2" * 64}, image)
    assert odd["A"] == ok["A"] and odd["B"] == ok["B"]
    assert odd["C"].status == FAIL and odd["C"].detail == "image id sha256:222222222222 differs from A's sha256:111111111111"
    assert odd["C"].evidence == "RepoDigests C" and odd["C"].hint.startswith(f"docker pull {image} on every host")


# ---------------------------------------------------------------- net: ibdev2netdev

IBDEV = real("ibdev2netdev/tpgds-aihub0007_12dev_2down.txt")


def test_check_rail_link_passes_on_an_up_port_of_the_real_listing():
    r = check_rail_link(host(rail="enp25s0np0", hca="mlx5_0"), out(IBDEV))
    assert r.status == PASS and r.detail == "mlx5_0 ==> enp25s0np0 Up" and r.evidence == "mlx5_0 port 1 ==> enp25s0np0 (Up)"


def test_check_rail_link_fails_on_a_down_port_a_wrong_netdev_and_an_unknown_hca():
    down = check_rail_link(host(rail="enp210s0f1np1", hca="mlx5_10"), out(IBDEV))
    assert down.status == FAIL and down.detail == "mlx5_10 ==> enp210s0f1np1 is Down"
    assert "cable and transceiver of enp210s0f1np1" in down.hint
    wrong = check_rail_link(host(rail="enp41s0np0", hca="mlx5_0"), out(IBDEV))
    assert wrong.status == FAIL and wrong.detail == "mlx5_0 maps to enp25s0np0, not enp41s0np0"
    gone = check_rail_link(host(rail="enp25s0np0", hca="mlx5_99"), out(IBDEV))
    assert gone.status == FAIL and gone.detail == "mlx5_99 is not listed by ibdev2netdev"
    assert gone.evidence.count("==>") == 12


# ---------------------------------------------------------------- net: ip -br addr

IPBR = real("ip/ip-br-a_tpgds-aihub0007_h100-8xroce.txt")


def test_check_rail_ip_passes_on_the_real_rail_address():
    r = check_rail_ip(host(rail="enp25s0np0", ipv4="10.99.91.59/31"), out(IPBR))
    assert r.status == PASS and r.detail == "enp25s0np0 has 10.99.91.59/31" and r.evidence == "enp25s0np0 UP 10.99.91.59/31"


def test_check_rail_ip_fails_on_a_wrong_prefix_a_missing_address_and_a_missing_interface():
    prefix = check_rail_ip(host(rail="enp25s0np0", ipv4="10.99.91.59/24"), out(IPBR))
    assert prefix.status == FAIL and prefix.detail == "enp25s0np0 has 10.99.91.59/31, expected prefix /24"
    assert prefix.hint.startswith("ip addr add 10.99.91.59/24 dev enp25s0np0")
    bare = check_rail_ip(host(rail="enp210s0f0np0", ipv4="10.99.99.59/31"), out(IPBR))  # UP, no address
    assert bare.status == FAIL and bare.detail == "enp210s0f0np0 has no IPv4 address, expected 10.99.99.59/31"
    other = check_rail_ip(host(rail="enp41s0np0", ipv4="10.99.91.59/31"), out(IPBR))
    assert other.status == FAIL and other.detail == "enp41s0np0 has 10.99.92.59/31, expected 10.99.91.59/31"
    gone = check_rail_ip(host(rail="cx8r1"), out(IPBR))
    assert gone.status == FAIL and gone.detail == "no interface cx8r1"


# ---------------------------------------------------------------- net: ethtool

def test_check_link_speed_passes_at_400g():
    r = check_link_speed(host(), out(real("ethtool/web-ethtool-grep-400G-ens1f0-annotated-lab.txt")))
    assert r.status == PASS and r.detail == "cx8r1 400000Mb/s, link detected"
    assert r.evidence == "Speed: 400000Mb/s; Link detected: yes"


def test_check_link_speed_fails_below_the_wanted_speed_without_link_and_without_a_speed():
    slow = check_link_speed(host(), out(real("ethtool/web-ethtool-grep-dgx-spark-cx7-100G-before.txt")))
    assert slow.status == FAIL and slow.detail == "cx8r1 runs at 100000Mb/s, expected >= 400000Mb/s"
    down = check_link_speed(host(), out(real("ethtool/web-ethtool-i40e-link-down-speed-unknown.txt")))
    assert down.status == FAIL and down.detail == "cx8r1: no link detected"
    assert down.evidence == "Speed: Unknown!; Link detected: no"
    unknown = check_link_speed(host(), out(real("ethtool/local-ethtool-lo.txt")))  # lo: no Speed line at all
    assert unknown.status == FAIL and unknown.detail == "cx8r1: speed unknown"


# ---------------------------------------------------------------- net: ip -o link (mtu)

def link_line(name, mtu):
    return (f"4: {name}@if13: <BROADCAST,MULTICAST,UP,LOWER_UP> mtu {mtu} qdisc noqueue state UP mode DEFAULT group "
            "default qlen 1000\\    link/ether c6:12:b3:cb:2a:95 brd ff:ff:ff:ff:ff:ff link-netnsid 0\n")


def test_check_mtu_passes_at_the_inventory_mtu_and_fails_the_host_that_differs():
    a, b = host("A"), host("B", ipv4="192.168.101.2/24")
    ok = check_mtu([a, b], {"A": out(link_line("cx8r1", 9000)), "B": out(link_line("cx8r1", 9000))})
    assert ok["A"].status == ok["B"].status == PASS and ok["A"].detail == "cx8r1 mtu 9000"
    assert ok["A"].evidence.startswith("4: cx8r1@if13: <BROADCAST,MULTICAST,UP,LOWER_UP> mtu 9000")
    bad = check_mtu([a, b], {"A": out(link_line("cx8r1", 9000)), "B": out(link_line("cx8r1", 1500))})
    assert bad["B"].status == FAIL and bad["B"].detail == "cx8r1 mtu 1500, expected 9000"
    assert bad["B"].hint.startswith("ip link set dev cx8r1 mtu 9000")
    assert bad["A"].status == PASS and bad["A"].detail == "cx8r1 mtu 9000 (not equal on all hosts: A=9000, B=1500)"
    gone = check_mtu([a], {"A": out(link_line("cx8r0", 9000))})
    assert gone["A"].status == FAIL and gone["A"].detail == "no interface cx8r1"
    missing = check_mtu([a], {"A": out("@@missing ip\n", rc=127, missing="ip")})
    assert missing["A"].status == FAIL and missing["A"].hint == "apt-get install iproute2"


# ---------------------------------------------------------------- net: ip route get

ROUTE = real("ping/local-ip-route-get-127.0.0.1.txt")  # `local 127.0.0.1 dev lo src 127.0.0.1 uid 0` + `cache <local>`


def test_check_route_passes_when_every_peer_leaves_by_the_rail():
    peer = host("B", rail="lo", ipv4="127.0.0.1/8")
    r = check_route(host("A", rail="lo", ipv4="127.0.0.2/8"), out(ROUTE), [peer])
    assert r.status == PASS and r.detail == "1 peer(s) leave by lo"
    assert r.evidence == "local 127.0.0.1 dev lo src 127.0.0.1 uid 0"


def test_check_route_fails_a_peer_that_leaves_by_another_device_or_has_no_route():
    me = host("A")
    wrong = check_route(me, out(ROUTE), [host("B", ipv4="127.0.0.1/8")])
    assert wrong.status == FAIL and wrong.detail == "127.0.0.1 leaves by lo"
    assert "must be on-link on cx8r1" in wrong.hint
    none = check_route(me, out(ROUTE), [host("C", ipv4="192.168.101.3/24")])
    assert none.status == FAIL and none.detail == "192.168.101.3: no route"


# ---------------------------------------------------------------- net: show_gids

GIDS = real("show_gids/tpgds-aihub0001_mlx5_0_v1v2.txt")


def test_check_gid_finds_the_roce_v2_index_of_the_rail_address():
    r = check_gid(host(rail="ens108np0", hca="mlx5_0", ipv4="10.99.91.39/31"), out(GIDS))
    assert r.status == PASS and r.detail == "RoCE v2 GID index 3 for 10.99.91.39 on mlx5_0"
    pinned = check_gid(host(rail="ens108np0", hca="mlx5_0", ipv4="10.99.91.39/31", preflight_gid_index=3), out(GIDS))
    assert pinned.status == PASS


def test_check_gid_fails_on_a_pinned_index_that_differs_a_missing_address_and_v1_only():
    wrong = check_gid(host(rail="ens108np0", hca="mlx5_0", ipv4="10.99.91.39/31", preflight_gid_index=2), out(GIDS))
    assert wrong.status == FAIL and wrong.detail == "RoCE v2 GID index for 10.99.91.39 is 3, inventory expects 2"
    assert "NCCL_IB_GID_INDEX=3" in wrong.hint
    absent = check_gid(host(rail="ens108np0", hca="mlx5_0", ipv4="10.99.91.40/31"), out(GIDS))
    assert absent.status == FAIL
    assert absent.detail == "no RoCE v2 GID for 10.99.91.40 on mlx5_0 (the address is not in the GID table)"
    assert absent.evidence == "0 - v1 | 1 - v2 | 2 10.99.91.39 v1 | 3 10.99.91.39 v2"
    v1 = "".join(line + "\n" for line in GIDS.splitlines() if not line.startswith("mlx5_0\t1\t3\t"))  # the v2 row gone
    only_v1 = check_gid(host(rail="ens108np0", hca="mlx5_0", ipv4="10.99.91.39/31"), out(v1))
    assert only_v1.status == FAIL and "(only RoCE v1 entries)" in only_v1.detail


# ---------------------------------------------------------------- system: df / du

DF = real("nvidia-smi-h200/host/df-P-B1-tmp.txt")  # /dev/vda on /: 68701855744 bytes available


def test_check_disk_passes_with_room_for_the_model_and_with_the_model_already_there():
    r = check_disk(host(model_size_gb=10), out(DF), out(""))
    assert r.status == PASS and r.detail == "68.7 GB free for the model (need 30.0 GB)"
    assert r.evidence == "/dev/vda on /: 68.7 GB free of 270.6 GB"
    there = check_disk(host(model_size_gb=464), out(DF), out("464000000000\t/models/m\n"))
    assert there.status == PASS and there.detail == "model already at /models/m (464.0 GB)"


def test_check_disk_fails_without_room_and_counts_what_is_already_there():
    r = check_disk(host(model_size_gb=464), out(DF), out(""))
    assert r.status == FAIL
    assert r.detail == "68.7 GB free at /models/m, need 484.0 GB (model 464 GB + margin 20 GB)"
    assert r.hint.startswith("free space on /, or set model_path")
    part = check_disk(host(model_size_gb=464), out(DF), out("400000000000\t/models/m\n"))
    assert part.status == FAIL and part.detail.endswith("(model 464 GB + margin 20 GB - 400.0 GB present)")
    assert "need 84.0 GB" in part.detail
    bad = check_disk(host(), out("df: /models: No such file or directory\n"), out(""))
    assert bad.status == FAIL and bad.detail == "cannot read `df`"


# ---------------------------------------------------------------- preflight.evaluate

def probes_for(inv, a_outputs):
    a, b = inv.host("A"), inv.host("B")
    return {"A": HostProbe(a, a_outputs, ClockSample(0.002, 0.001), CheckResult("A", "ssh", PASS, "local")),
            "B": HostProbe(b, None, None, CheckResult("B", "ssh", FAIL, "timeout: no answer"))}


def a_outputs(**over):
    """Station A's probe outputs: the real captures where a test reads them, every other tool missing."""
    keys = ("docker_version", "image", "ibdev2netdev", "ip_addr", "ip_link", "ethtool", "gids", "time", "df", "du",
            "gpus", "gpu_pids", "dmesg", "versions", "gdr", "ping", "route", "ssh_peer")
    base = {k: Output(127, f"@@missing {k}\n", k) for k in keys}
    return {**base, **over}


def test_evaluate_gives_every_check_in_order_and_skips_an_unreachable_host():
    inv = load_inventory(ROOT / "inventory" / "dgx-stations.yml")
    rows = evaluate(inv, probes_for(inv, a_outputs(
        docker_version=out(real("docker/local-docker-version-daemon-down.txt"), rc=1),
        ethtool=out(real("ethtool/web-ethtool-grep-400G-ens1f0-annotated-lab.txt")),
        df=out(DF), du=out(""))))
    a = {r.check: r for r in rows if r.host == "A"}
    b = {r.check: r for r in rows if r.host == "B"}
    # the head: every check but ports (no dials given), in CHECKS order, before B's rows
    assert [r.check for r in rows if r.host == "A"] == [c for c in CHECKS if c != "ports"]
    assert [r.host for r in rows] == ["A"] * len(a) + ["B"] * len(b)
    assert a["docker"].status == FAIL and a["docker"].detail == "no Server section: the Docker daemon is unreachable"
    assert a["image"].status == SKIP and a["image"].detail == "Docker daemon unreachable (see the docker check)"
    assert a["link_speed"].status == PASS and a["link_speed"].detail == "cx8r1 400000Mb/s, link detected"
    assert a["disk"].status == FAIL and a["disk"].detail.startswith("68.7 GB free at ~/models/GLM-5.3-NVFP4, need ")
    assert a["rail_link"].status == FAIL and a["rail_link"].detail == "tool `ibdev2netdev` not found on PATH"
    # the checks across hosts, with B not read: nothing to compare A with
    assert a["parity"].status == SKIP and a["parity"].detail == "one host: nothing to compare"
    assert a["clock_skew"].status == SKIP and a["clock_skew"].detail.startswith("one host: no other clock")
    # B, a worker never reached: its ssh row as probed, every other check skipped (no ssh_peer: not the head)
    assert b["ssh"].status == FAIL and b["ssh"].detail == "timeout: no answer"
    assert list(b) == [c for c in CHECKS if c not in ("ssh_peer", "ports")]
    assert all(r.status == SKIP and r.detail == "host not reachable (see the ssh check)"
               for c, r in b.items() if c != "ssh")


def test_evaluate_passes_the_docker_check_on_a_daemon_that_answers():
    inv = load_inventory(ROOT / "inventory" / "dgx-stations.yml")
    rows = evaluate(inv, probes_for(inv, a_outputs(
        docker_version=out(real("docker/web-docker-version-23.0.1-linux-amd64-full.txt")),
        image=out("[]\nError response from daemon: No such image: vllm/vllm-openai:v0.30.0-aarch64\n", rc=1))))
    a = {r.check: r for r in rows if r.host == "A"}
    assert a["docker"].status == PASS
    assert a["image"].status == FAIL and a["image"].detail == "pinned digest sha256:4864d4660000 not present"
    assert a["image"].hint.startswith("docker pull vllm/vllm-openai:v0.30.0-aarch64@sha256:4864d466")


# ---------------------------------------------------------------- gpu: the cluster's GPU present

H200 = real("nvidia-smi-h200/query-gpu-csv-noheader-nounits_idle.txt")  # one idle H200


def test_check_gpu_fails_without_a_gpu_of_the_cluster_and_without_any_gpu():
    none = check_gpu(host(cluster_gpu_name="GB300"), out(H200), out(""))
    assert none.status == FAIL and none.detail == "no GPU matches 'GB300'"
    assert none.evidence == "0: NVIDIA H200" and "nvidia-smi -L" in none.hint
    idle = check_gpu(host(cluster_gpu_name="H200"), out(H200), out(""))
    assert idle.status == PASS and idle.detail.endswith("idle (0 MiB used of 143771)"), idle
    gone = check_gpu(host(cluster_gpu_name="H200"), out("No devices were found\n", rc=6), out(""))
    assert gone.status == FAIL and gone.detail == "nvidia-smi found no GPU"


# ---------------------------------------------------------------- system: timedatectl

def test_check_ntp_fails_an_unsynchronized_clock_and_warns_on_an_inactive_service():
    bad = check_ntp(host(), out(real("timedatectl/web-timedatectl-unsynced-ntp-inactive.txt")))
    assert bad.status == FAIL and bad.detail == "clock not synchronized" and "systemd-timesyncd" in bad.hint
    idle = check_ntp(host(), out(real("timedatectl/web-timedatectl-systemd247-synced-ntp-inactive.txt")))
    assert idle.status == WARN and idle.detail == "synchronized, but the NTP service is inactive"
    ok = check_ntp(host(), out(real("timedatectl/web-timedatectl-systemd247-synced-ntp-active.txt")))
    assert ok.status == PASS and ok.detail == "clock synchronized"
