"""Preflight against the lab: real sshd, real links and MTUs, simulated GPU/RDMA tools. The faults here
are the ones the network and the kernel make for real (MTU, links, addresses, sshd, host keys, a firewall,
loss, a black hole, sysfs counters); a fault that only changes a stand-in's output (a busy GPU, a GID index,
NTP, disk, docker, ECC, Xid, ACS) is judged on real captures by the unit tests (test_checks_by_domain.py,
test_preflight_health.py, test_preflight_one_call.py) and run once on the lab by its runbook section."""

import hashlib
import json
import os
import re
from pathlib import Path

import pytest

from railyard.inventory import load_inventory
import railyard_lab as lab
from railyard_lab import faults, lab_dir, lab_host
from railyard.verbs.preflight import run_preflight

from .conftest import inv_cmd

pytestmark = pytest.mark.lab


def preflight(inv_path, *overrides):
    return run_preflight(load_inventory(inv_path, list(overrides)))


def by(results):
    return {(r.host, r.check): r for r in results}


def failing(results):
    return sorted((r.host, r.check) for r in results if r.status == "fail")


def test_healthy_lab_passes_every_check(healthy_lab):
    r = inv_cmd("preflight", "--inventory", str(healthy_lab), "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(r.stdout)  # exactly one JSON document on stdout
    assert doc["ok"] is True
    checks = {(c["host"], c["check"]): c for c in doc["checks"]}
    expected = {"ssh", "docker", "image", "rail_link", "rail_ip", "link_speed", "mtu", "jumbo_ping", "route",
                "gid", "ntp", "clock_skew", "disk", "gpu", "gpu_health", "gdr", "parity", "cma", "nccl_conf",
                "nccl_lib", "gloo_iface", "ports"}   # B dials the head's master port, A rdma-test's perftest ports on B
    assert {c for h, c in checks if h == "B"} == expected
    assert {c for h, c in checks if h == "A"} == expected | {"ssh_peer"}
    assert checks[("B", "ports")]["detail"] == f"B reaches every port the plan dials from it: A {lab.rail_net(1)}.11:29501"
    assert all(c["status"] == "pass" for c in doc["checks"])
    assert all(set(c) == {"host", "check", "status", "detail", "evidence", "hint"} for c in doc["checks"])
    # the GB300 was chosen, never the display GPU listed before it
    assert "NVIDIA GB300" in checks[("A", "gpu")]["detail"] and "RTX" not in checks[("A", "gpu")]["detail"]
    assert "index 3" in checks[("B", "gid")]["detail"]


def test_table_output_and_exit_code(healthy_lab):
    r = inv_cmd("preflight", "-i", str(healthy_lab))
    assert r.returncode == 0
    assert "jumbo_ping" in r.stdout and "PASS" in r.stdout and "OK: 45 pass across 2 host(s)" in r.stdout


def test_an_unreachable_host_is_said_at_once_and_the_rest_is_probed(healthy_lab):
    """The table comes when every host is judged; a host SSH cannot reach is said on stderr as soon as it is known,
    before the table, while the other hosts' probes go on."""
    faults.fault("B", "sshd-down")
    r = inv_cmd("preflight", "-i", str(healthy_lab))
    faults.heal()
    assert r.returncode == 1
    early = [line for line in r.stderr.splitlines() if line.startswith("preflight: B: ")]
    assert early and "connection refused" in early[0], r.stderr
    assert "OK" not in r.stdout and "jumbo_ping" in r.stdout and "A " in r.stdout


# (fault, value, host, check, words in detail or evidence)
FAULTS = [
    ("mtu", "1500", "B", "mtu", "mtu 1500, expected 9000"),
    ("link-down", None, "B", "rail_link", "is Down"),
    ("no-ip", None, "B", "rail_ip", f"no IPv4 address, expected {lab.rail_net(1)}.12/24"),
    ("clock-skew", "30", "B", "clock_skew", "ahead of the others"),
    ("sshd-down", None, "B", "ssh", "connection refused"),
    ("host-key-changed", None, "B", "ssh", "host_key_changed"),
]


@pytest.mark.parametrize("kind,value,host,check,words", FAULTS, ids=[f[0] for f in FAULTS])
def test_fault_fails_the_expected_check_and_heal_restores(healthy_lab, kind, value, host, check, words):
    faults.fault(host, kind, value)
    results = preflight(healthy_lab)
    r = by(results)[(host, check)]
    assert r.status == "fail", r
    assert words in r.detail + " " + r.evidence, r
    assert r.hint, "every fail says how to fix it"
    # the healthy host's own checks stay green (cross-host checks may name the broken peer)
    other = "A" if host == "B" else "B"
    assert (other, check) not in failing(results) or check in ("clock_skew",)
    faults.heal()
    assert failing(preflight(healthy_lab)) == []


def test_acs_redirect_off_the_gpu_nic_path_is_a_note_and_sysfs_counters_move_for_real(healthy_lab):
    """ACS redirect on a switch port with only an NVMe drive behind it is no failure, only a note; where
    `ethtool -S` shows no rail error counters, the kernel's (sysfs, real on the lab's veth rails) are read twice,
    and B's jumbo pings dropped by a bridge port below its MTU move its tx_dropped between the reads."""
    faults.fault("B", "acs-redirect", "off-path")
    faults.fault("A", "no-ethtool-stats")
    faults.fault("B", "no-ethtool-stats")
    faults.fault("B", "mtu-blackhole", "1500")
    res = by(preflight(healthy_lab, "preflight_ping_count=10"))  # 2 s of pings around the two reads
    a, b = res[("A", "gdr")], res[("B", "gdr")]
    assert "ACS redirect on 1 other port(s), on no GPU-NIC path: 03:01.0" in b.evidence
    assert "ACS redirects" not in b.detail
    assert a.status == "pass" and "cx8r1 counters (sysfs /sys/class/net/cx8r1/statistics" in a.evidence, a
    assert b.status == "fail" and re.search(r"cx8r1 error counters moving: tx_dropped \+\d+ \(sysfs\)", b.detail), b
    assert "ip -s link show cx8r1" in b.hint
    faults.heal()


def test_a_firewall_on_the_heads_master_port_fails_ports_alone_naming_host_address_and_port(healthy_lab):
    """The plan's worker dials the head's master port; A's firewall drops it (nftables): ping, jumbo frames and
    SSH over the same rail still pass, so only the port check can see it."""
    faults.fault("A", "port-block", "29501")
    results = preflight(healthy_lab)
    assert failing(results) == [("B", "ports")]
    r = by(results)[("B", "ports")]
    assert r.detail == (f"B cannot reach {lab.rail_net(1)}.11:29501 on A (the head's master port): no answer (the SYN was "
                        "dropped: a firewall on A or on the path)"), r
    assert "listen ok" in r.evidence and "allow TCP 29501 from B on A" in r.hint


def test_mtu_fault_also_breaks_the_jumbo_ping_both_ways(healthy_lab):
    faults.fault("B", "mtu", "1500")
    res = by(preflight(healthy_lab))
    assert res[("B", "jumbo_ping")].status == "fail"
    assert "message too long, mtu=1500" in res[("B", "jumbo_ping")].detail
    assert res[("A", "jumbo_ping")].status == "fail"  # received frames dropped silently on B
    assert "0/3 received" in res[("A", "jumbo_ping")].detail


def test_real_loss_on_the_rail_still_warns(healthy_lab):
    """The kernel on B drops every third large frame of its rail: a jumbo ping that loses one is a warning with the
    counts, never a pass, while small frames, SSH and the other checks still pass (nothing else is blamed)."""
    faults.fault("B", "rail-loss", "3")
    res = by(preflight(healthy_lab))
    lossy = [r for r in (res[("A", "jumbo_ping")], res[("B", "jumbo_ping")]) if r.status != "pass"]
    assert lossy and all(r.status == "warn" and "with loss to" in r.detail for r in lossy)
    assert all(re.search(r"[12]/3 received", r.detail) for r in lossy)
    assert [k for k, r in res.items() if r.check != "jumbo_ping" and r.status in ("warn", "fail")] == []
    faults.heal()
    assert failing(preflight(healthy_lab)) == []


def test_mtu_black_hole_on_the_path_is_named_once(healthy_lab):
    """Both rails at MTU 9000, a bridge port below it (a switch in the path): every jumbo ping to and from B is
    lost and ssh over the rail hangs; the report names the black hole once, the rest point at it."""
    faults.fault("B", "mtu-blackhole", "1500")
    results = preflight(healthy_lab)
    res = by(results)
    assert res[("A", "mtu")].status == res[("B", "mtu")].status == "pass"
    named = [r for r in results if "an MTU black hole between A and B" in r.detail]
    assert [(r.host, r.check) for r in named] == [("A", "jumbo_ping")] and "tracepath" in named[0].hint
    assert "the MTU black hole named on A's jumbo_ping" in res[("B", "jumbo_ping")].detail
    ssh = res[("A", "ssh_peer")]
    assert ssh.status == "fail" and "ssh hung" in ssh.detail and ssh.detail.endswith("not SSH")
    faults.heal()
    assert failing(preflight(healthy_lab)) == []


def test_a_healthy_24_host_lab_gives_no_warning():
    """A healthy 24-host lab gives no warning: 552 peer pairs, each with a small and three jumbo pings, 23 ssh from
    the head, 24 hosts' probes on the machine's cores at once (about 15 s with the resize)."""
    big = Path(inv_cmd("lab.up", "--hosts", "24", timeout=900).stdout.strip().splitlines()[-1])
    try:
        results = preflight(big)
        bad = [(r.host, r.check, r.status, r.detail) for r in results if r.status in ("warn", "fail")]
        assert bad == [], bad[:5]
        assert all("23 peer" in r.detail or r.check != "route" for r in results)
    finally:
        inv_cmd("lab.up", timeout=900)  # back to the 2-host lab the other tests share


def test_ssh_peer_fails_without_the_heads_key(healthy_lab):
    home = lab_host(lab_dir(), "B").home / ".ssh" / "authorized_keys"
    saved = home.read_text()
    try:
        home.write_text(saved.splitlines()[0] + "\n")  # only the control machine's key
        res = by(preflight(healthy_lab))
        r = res[("A", "ssh_peer")]
        assert r.status == "fail" and "key not accepted" in r.detail and "ssh-copy-id" in r.hint
    finally:
        home.write_text(saved)


def test_unknown_host_key_is_refused_with_fingerprint_then_trusted_on_request(healthy_lab, tmp_path):
    inv_text = Path(healthy_lab).read_text().replace("ssh_known_hosts: known_hosts",
                                                     f"ssh_known_hosts: {tmp_path / 'kh'}")
    inv_text = inv_text.replace("ansible_ssh_private_key_file: id_ed25519",
                                f"ansible_ssh_private_key_file: {lab_dir() / 'id_ed25519'}")
    (tmp_path / "kh").write_text("")
    p = tmp_path / "inv.yml"
    p.write_text(inv_text)
    res = by(preflight(p))
    r = res[("A", "ssh")]
    assert r.status == "fail" and r.detail.startswith("host_key_unknown")
    fp = lab_host(lab_dir(), "A").host_key.with_suffix(".pub").read_text().split()[1]
    import base64
    want = "SHA256:" + base64.b64encode(hashlib.sha256(base64.b64decode(fp)).digest()).decode().rstrip("=")
    assert want in r.detail and "trust-hosts" in r.hint
    assert (tmp_path / "kh").read_text() == ""  # nothing recorded behind the user's back

    shown = inv_cmd("trust-hosts", "-i", str(p))
    assert shown.returncode == 1 and want in shown.stdout and "--accept" in shown.stdout
    assert (tmp_path / "kh").read_text() == ""
    took = inv_cmd("trust-hosts", "-i", str(p), "--accept")
    assert took.returncode == 0 and "recorded" in took.stdout
    assert failing(preflight(p)) == []


def test_changed_host_key_is_refused_and_replaced_only_with_replace(healthy_lab, tmp_path):
    kh = tmp_path / "kh"
    kh.write_text((lab_dir() / "known_hosts").read_text())
    inv_text = Path(healthy_lab).read_text().replace("ssh_known_hosts: known_hosts", f"ssh_known_hosts: {kh}")
    inv_text = inv_text.replace("ansible_ssh_private_key_file: id_ed25519",
                                f"ansible_ssh_private_key_file: {lab_dir() / 'id_ed25519'}")
    p = tmp_path / "inv.yml"
    p.write_text(inv_text)
    faults.fault("B", "host-key-changed")
    r = by(preflight(p))[("B", "ssh")]
    assert r.status == "fail" and "records" in r.detail and "--replace" in r.hint
    assert inv_cmd("trust-hosts", "-i", str(p), "--accept").returncode == 1  # accept does not replace
    assert by(preflight(p))[("B", "ssh")].status == "fail"
    assert inv_cmd("trust-hosts", "-i", str(p), "--replace").returncode == 0
    assert by(preflight(p))[("B", "ssh")].status == "pass"


def _snapshot(root: Path) -> dict:
    snap = {}
    for dirpath, dirnames, files in os.walk(root):
        for name in files + dirnames:
            p = Path(dirpath) / name
            if p.name in ("sshd.pid", "anchor.pid") or p.parent.name == "docker" and p.name in ("containers", "removed"):
                continue   # the docker daemon's own bookkeeping (its /var/lib/docker): what is left in it, below
            st = p.lstat()
            data = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() and not p.is_symlink() else ""
            snap[str(p)] = (st.st_mode, st.st_size, st.st_mtime_ns, data)
    return snap


def test_preflight_changes_nothing_on_the_hosts(healthy_lab):
    from railyard_lab import in_host
    hosts_dir = lab_dir() / "hosts"
    net_before = {h: in_host(lab_host(lab_dir(), h), "ip", "-d", "addr").stdout for h in ("A", "B")}
    before = _snapshot(hosts_dir)
    containers = {h: sorted(os.listdir(hosts_dir / h / "docker" / "containers")) for h in ("A", "B")}
    preflight(healthy_lab)   # its one container of the pinned image per host is removed when it has printed
    assert _snapshot(hosts_dir) == before
    assert {h: sorted(os.listdir(hosts_dir / h / "docker" / "containers")) for h in ("A", "B")} == containers
    assert {h: in_host(lab_host(lab_dir(), h), "ip", "-d", "addr").stdout for h in ("A", "B")} == net_before


def test_local_connection_missing_tools_fail_cleanly(tmp_path):
    """`connection: local` runs on this machine, which has no ibdev2netdev or nvidia-smi: fails name the tool."""
    inv = tmp_path / "local.yml"
    inv.write_text(f"""
all:
  vars:
    model_revision: "{'a' * 40}"
    vllm_image: vllm/vllm-openai:v0.30.0@sha256:{'1' * 64}
    model_path: "{tmp_path}/my model; touch {tmp_path}/pwned"
  children:
    here:
      hosts:
        L: {{ansible_connection: local, rank: 0, rails: {{lo: {{hca: mlx5_0, ipv4: 127.0.0.1/8}}}}}}
""")
    os.environ.pop("RAILYARD_INVENTORY", None)
    res = by(preflight(inv, "cluster_serve_rail=lo", "cluster_gpu_name=H200"))
    assert res[("L", "ssh")].status == "pass" and "local" in res[("L", "ssh")].detail
    for check, tool in (("rail_link", "ibdev2netdev"), ("gid", "show_gids"), ("gpu", "nvidia-smi")):
        r = res[("L", check)]
        assert r.status == "fail" and f"tool `{tool}` not found" in r.detail, r
    assert res[("L", "disk")].status in ("pass", "fail") and "free" in res[("L", "disk")].evidence
    assert not (tmp_path / "pwned").exists()  # a hostile model_path stayed a path
