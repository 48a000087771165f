"""Preflight's GPU health, parity, chrony and one-host clock checks on real captured output (issue 15).

Origins: tests/fixtures/real/gpu-health/ORIGINS.md (an H200 device machine), chronyc/ and dmesg/ in
FORMATS-ORIGINS.md."""

from railyard.checks import FAIL, PASS
from railyard.checks.gpu import check_gpu_health
from railyard.checks.net import check_ssh_peer
from railyard.checks.parity import ClockSample, check_clock_skew, check_parity
from railyard.checks.system import check_gdr, check_ntp
from railyard.facts.gpu import (HEALTH_UNSUPPORTED, parse_gpu_health, parse_gpus, parse_xids, pci_matches,
                                split_gpu_query)
from railyard.facts.system import parse_chrony_tracking, parse_versions
from railyard.inventory import Host
from railyard.facts.probe import Output

from .conftest import REAL

GH = REAL / "gpu-health"


def host(name="A", **vars):
    base = {"preflight_max_clock_skew_ms": 500}
    base.update(vars)
    return Host(name=name, rank=0, address="127.0.0.1", port=22, user="", connection="ssh", key_file="", rails={},
                vars=base)


def out(text, rc=0, missing=None):
    return Output(rc, text, missing)


H200_CSV = (GH / "h200-nvidia-smi-query-health-csv-noheader-nounits.txt").read_text()
H200_DMESG = (GH / "h200-dmesg-T-grep.txt").read_text()


def test_real_h200_health_row_parses_with_its_na_fields():
    (g,) = parse_gpu_health(H200_CSV)
    assert (g.index, g.uuid, g.bus_id, g.driver) == (0, "GPU-621b2938-8e28-8216-3d85-acfd0c90ba86", "00000000:00:06.0",
                                                     "580.159.04")
    assert (g.ecc_uncorrected_volatile, g.ecc_uncorrected_aggregate) == (0, 0)
    assert g.retired_pages_pending is None  # [N/A] on a row-remapping GPU
    assert (g.remapped_rows_pending, g.remapped_rows_failure) == (False, False)
    # the header form (same real capture with header) reads the same
    assert parse_gpu_health((GH / "h200-nvidia-smi-query-health-csv.txt").read_text()) == [g]
    # and nvidia-smi -q of the same GPU agrees: no pending remap, no uncorrectable DRAM error
    q = (GH / "h200-nvidia-smi-q-d-ecc-page-retirement-row-remapper.txt").read_text()
    assert "Pending                                        : No" in q and "DRAM Uncorrectable                         : 0" in q


def test_healthy_h200_passes_only_with_the_kernel_log_read():
    # the real dmesg lines of that host hold NVRM lines but no Xid: only the grep for Xid reaches the check
    xid_only = "".join(line + "\n" for line in H200_DMESG.splitlines() if "NVRM: Xid" in line)
    r = check_gpu_health(host(), out(H200_CSV), out(xid_only))
    assert r.status == "pass" and "no Xid since boot" in r.detail and "remapped_rows.pending=No" in r.evidence
    assert parse_xids(H200_DMESG) == []
    denied = (REAL / "dmesg" / "local-dmesg-restricted-nonroot.txt").read_text()
    w = check_gpu_health(host(), out(H200_CSV), out(denied, rc=1))
    assert w.status == "warn" and "Operation not permitted" in w.detail and "dmesg_restrict" in w.hint


def test_uncorrectable_ecc_and_pending_remap_fail_with_drain_and_reset():
    row = H200_CSV.strip().split(", ")
    row[4], row[5], row[7] = "2", "2", "Yes"  # the same row as the GPU would report after two DBEs
    r = check_gpu_health(host(), out(", ".join(row) + "\n"), out(""))
    assert r.status == "fail"
    assert "2 uncorrectable ECC error(s)" in r.detail and "row remapping pending" in r.detail
    assert "nvidia-smi -r -i 0" in r.hint and "RMA" in r.hint


def test_xids_from_real_kernel_logs():
    dbe = (REAL / "dmesg" / "web-syslog-kernel-xid48-dbe-xid64-gpu-operator.txt").read_text()
    assert [(x.pci, x.code) for x in parse_xids(dbe)] == [("0000:07:00", 48), ("0000:07:00", 64)]
    r = check_gpu_health(host(), out(H200_CSV), out(dbe))
    assert r.status == "fail" and "Xid 48 since boot (uncorrectable ECC (DBE))" in r.detail
    app = (REAL / "dmesg" / "web-dmesg-ctime-xid13-xid109-gpud.txt").read_text()
    assert check_gpu_health(host(), out(H200_CSV), out(app)).status == "fail"  # 109: context switch timeout
    only13 = "".join(line + "\n" for line in app.splitlines() if "): 13," in line)
    w = check_gpu_health(host(), out(H200_CSV), out(only13))
    assert w.status == "warn" and "Xid 13" in w.detail  # application-caused
    assert pci_matches("0000:00:06", "00000000:00:06.0") and not pci_matches("0000:07:00", "00000000:00:06.0")


def test_chrony_verdicts_from_real_tracking_output():
    d = REAL / "chronyc"
    ok = check_ntp(host(), out("@@chronyc\n" + (d / "web-chronyc-tracking-synced-stratum2-opensuse.txt").read_text()))
    assert ok.status == "pass" and "55C7D664 (85.199.214.100), stratum 2" in ok.detail
    t = parse_chrony_tracking((d / "web-chronyc-tracking-synced-stratum2-opensuse.txt").read_text())
    assert t.offset_s == -0.000052616 and t.leap == "Normal"  # `slow of NTP time`: behind
    bad = check_ntp(host(), out("@@chronyc\n" + (d / "web-chronyc-tracking-not-synchronised-refid-0.txt").read_text()))
    assert bad.status == "fail" and "not synchronised" in bad.detail and "chronyc sources" in bad.hint
    local = check_ntp(host(), out("@@chronyc\n" + (d / "web-chronyc-tracking-local-refclock-7F7F0101-no-leap-line.txt")
                                    .read_text()))
    assert local.status == "fail" and "local clock" in local.detail
    # `Leap status : Normal` yet further off than the ranks may be: not a pass
    off = check_ntp(host(preflight_max_clock_skew_ms=0.1),
                      out("@@chronyc\n" + (d / "web-chronyc-tracking-synced-fast-stratum3.txt").read_text()))
    assert off.status == "fail" and "0.000 s fast" in off.detail and "makestep" in off.hint
    # timedatectl failing without systemd, then chrony's answer: chrony decides
    td = (REAL / "timedatectl" / "local-timedatectl.txt").read_text()
    both = check_ntp(host(), out(td + "@@chronyc\n" + (d / "web-chronyc-tracking-synced-fast-stratum3.txt").read_text()))
    assert both.status == "pass"
    dead = check_ntp(host(), out("@@chronyc\n506 Cannot talk to daemon\n"))
    assert dead.status == "fail" and "no tracking data" in dead.detail


def test_clock_skew_with_one_host_skips_instead_of_passing():
    h = host()
    res = check_clock_skew([h], {"A": ClockSample(0.001, 0.0005)})
    assert res["A"].status == "skip" and "one host" in res["A"].detail
    two = check_clock_skew([h, host("B")], {"A": ClockSample(0.001, 0.0005), "B": ClockSample(0.0, 0.0005)})
    assert {r.status for r in two.values()} == {"pass"}


def test_a_clock_skew_counts_only_beyond_the_samples_own_uncertainty():
    """Each sample is known to half its round trip. A host 2 s off, read in a 10 ms round trip, is skewed; one
    that read 1.9 s off in a 4 s round trip (24 hosts probing on two cores) shows nothing either way."""
    hosts = [host(n) for n in "ABC"]
    res = check_clock_skew(hosts, {"A": ClockSample(2.0, 0.005), "B": ClockSample(0.0, 0.005),
                                     "C": ClockSample(0.01, 0.005)})
    assert res["A"].status == "fail" and "ahead of the others" in res["A"].detail and res["B"].status == "pass"
    loose = check_clock_skew(hosts, {"A": ClockSample(1.9, 2.0), "B": ClockSample(0.0, 0.005),
                                       "C": ClockSample(0.01, 0.005)})
    assert loose["A"].status == "warn" and "not measured closely enough" in loose["A"].detail
    assert "±2000 ms" in loose["A"].detail and loose["B"].status == "pass"


def test_parity_names_the_odd_host_and_skips_one_host():
    seen = {"A": {"driver": "580.105.08", "kernel": "6.8.0-60-generic", "nic_firmware": "28.39.1002 (MT_0000000834)"},
            "B": {"driver": "580.105.08", "kernel": "6.8.0-60-generic", "nic_firmware": "28.39.1002 (MT_0000000834)"},
            "C": {"driver": "570.195.03", "kernel": "6.8.0-60-generic", "nic_firmware": "28.39.1002 (MT_0000000834)"}}
    hosts = [host(n) for n in "ABC"]
    res = check_parity(hosts, seen)
    assert res["A"].status == res["B"].status == "pass" and "NVIDIA driver 580.105.08" in res["A"].detail
    assert res["C"].status == "fail" and "NVIDIA driver 570.195.03 (others: A 580.105.08, B 580.105.08, C 570.195.03)" \
        in res["C"].detail and "hang at NCCL init" in res["C"].hint
    pair = check_parity(hosts[:2], {"A": {"kernel": "6.8.0-60-generic"}, "B": {"kernel": "6.8.0-31-generic"}})
    assert pair["A"].status == pair["B"].status == "fail"  # 1:1: both sides named
    assert check_parity(hosts[:1], seen)["A"].status == "skip"
    # a version one rank lacks is a difference too (OFED on one host only)
    ofed = check_parity(hosts[:2], {"A": {"ofed": "MLNX_OFED_LINUX-24.10-1.1.4.0"}, "B": {}})
    assert "OFED/DOCA not found" in ofed["B"].detail


def test_versions_section_reads_kernel_ethtool_and_ofed():
    text = ("@@kernel " + (GH / "h200-uname-r.txt").read_text() +  # the real H200 host's `uname -r`
            "driver: mlx5_core\nversion: 24.10-1.1.4\nfirmware-version: 28.39.1002 (MT_0000000834)\n"
            "@@ofed MLNX_OFED_LINUX-24.10-1.1.4.0:\n")
    v = parse_versions(text)
    assert v == {"kernel": "6.18.44-fc-v973-gpu", "nic_driver": "mlx5_core 24.10-1.1.4",
                 "nic_firmware": "28.39.1002 (MT_0000000834)", "ofed": "MLNX_OFED_LINUX-24.10-1.1.4.0"}
    assert parse_versions("@@kernel 6.1.0\ndriver: veth\nversion: 1.0\nfirmware-version: \n")["nic_firmware"] is None


# ---------------------------------------------------------------- GPUDirect RDMA readiness

def gdr_out(modules="", nvidia="", ibv="", lspci="", stats1="", stats2=""):
    parts = {"modules": modules, "nvidia": nvidia, "ibv": ibv, "lspci": lspci, "stats1": stats1, "stats2": stats2}
    return out("".join(f"@@gdr {k}\n{v}\n" for k, v in parts.items()))


def rail_host():
    from railyard.inventory import Rail
    h = host()
    import ipaddress
    rail = Rail(name="cx8r1", hca="mlx5_0", ipv4=ipaddress.ip_interface("198.18.101.11/24"))
    return h.__class__(**{**h.__dict__, "rails": {"cx8r1": rail}, "vars": {**h.vars, "cluster_serve_rail": "cx8r1"}})


GD = REAL / "gdr"
IBV = (REAL / "ibstat" / "ibv_devinfo_mlx5_0_roce_tpgds-aihub0001.txt").read_text()
LSPCI = (GD / "web-lspci-vvv-plx-pex8747-downstream-port_acs-off.txt").read_text()
LOSSY = (GD / "web-ethtool-S-grep-err-cx6dx-lossy-optic.txt").read_text()


def test_gdr_passes_on_real_peermem_port_and_acs_and_steady_counters():
    h = rail_host()
    r = check_gdr(h, gdr_out((GD / "web-lsmod-grep-nvidia-mlx5_peermem-loaded.txt").read_text(), "", IBV, LSPCI,
                               LOSSY, LOSSY), "6.8.0-60-generic")
    assert r.status == "pass", r
    assert "nvidia_peermem loaded" in r.detail and "mlx5_0 port 1 PORT_ACTIVE, link_layer Ethernet" in r.detail
    assert "ACS off on 1 switch downstream port(s)" in r.evidence
    assert "rx_crc_errors_phy=13147323" in r.evidence  # counted since boot, shown; only movement fails


def test_gdr_dma_buf_counts_without_peermem_and_fails_without_either():
    h = rail_host()
    mods = (GH / "h200-proc-modules.txt").read_text()           # the H200 host: no nvidia_peermem
    nv = (GH / "h200-proc-driver-nvidia-version.txt").read_text()  # but the open kernel module
    ok = check_gdr(h, gdr_out(mods, nv, IBV, LSPCI), "6.18.44-fc-v973-gpu")
    assert ok.status == "pass" and "DMA-BUF: NVIDIA open kernel module" in ok.detail
    old = check_gdr(h, gdr_out(mods, nv, IBV, LSPCI), "5.4.0-150-generic")
    assert old.status == "fail" and "nvidia_peermem not loaded and no DMA-BUF" in old.detail


def test_gdr_fails_on_moving_counters_and_acs_redirect():
    h = rail_host()
    mods = (GD / "web-lsmod-grep-nvidia-mlx5_peermem-loaded.txt").read_text()
    later = LOSSY.replace("13147323", "13147400")
    r = check_gdr(h, gdr_out(mods, "", IBV, LSPCI, LOSSY, later), "6.8.0")
    assert r.status == "fail" and "cx8r1 error counters moving: rx_crc_errors_phy +77" in r.detail
    redirect = LSPCI.replace("ACSCtl: SrcValid- TransBlk- ReqRedir- CmpltRedir-",
                             "ACSCtl: SrcValid+ TransBlk- ReqRedir+ CmpltRedir+")
    a = check_gdr(h, gdr_out(mods, "", IBV, redirect, LOSSY, LOSSY), "6.8.0")
    assert a.status == "fail" and "ACS redirects peer-to-peer on PCIe switch port(s) 03:08.0" in a.detail
    # the same bits on a root port are not the GPU-NIC switch path: not flagged
    root = redirect.replace("Downstream Port", "Root Port")
    assert check_gdr(h, gdr_out(mods, "", IBV, root, LOSSY, LOSSY), "6.8.0").status == "pass"
    down = check_gdr(h, gdr_out(mods, "", IBV.replace("PORT_ACTIVE (4)", "PORT_DOWN (1)")
                                  .replace("Ethernet", "InfiniBand"), LSPCI), "6.8.0")
    assert down.status == "fail" and "PORT_DOWN" in down.detail and "not Ethernet (RoCE)" in down.detail
    hidden = check_gdr(h, gdr_out(mods, "", IBV, "03:08.0 PCI bridge: PLX\n\tCapabilities: <access denied>\n"),
                         "6.8.0")
    assert hidden.status == "warn" and "ACS not read" in hidden.detail


def test_one_nvidia_smi_call_answers_both_the_gpu_and_the_health_check():
    both = (GH / "h200-nvidia-smi-query-gpus-and-health-csv-noheader-nounits.txt").read_text()
    base, health = split_gpu_query(both)
    (g,) = parse_gpus(base)
    assert (g.name, g.memory_used_mib, g.memory_total_mib) == ("NVIDIA H200", 0, 143771)
    (h,) = parse_gpu_health(health)
    assert (h.uuid, h.bus_id, h.driver, h.remapped_rows_pending) == (g.uuid, "00000000:00:06.0", "580.159.04", False)
    # a driver that lacks a field: nvidia-smi refuses the whole query (real wording, exit 2); the fallback's five
    # fields still feed the gpu check, and gpu_health says it was not read instead of passing
    bad = (GH / "h200-nvidia-smi-query-bad-field.txt").read_text()
    assert 'is not a valid field to query' in bad and "rc=2" in bad
    five = ", ".join(both.split(", ")[:5]) + "\n"
    base2, health2 = split_gpu_query(bad.replace("rc=2\n", "") + five)
    assert health2 is None and parse_gpus(base2) == [g]
    w = check_gpu_health(host(), out(HEALTH_UNSUPPORTED + "\n"), out(""))
    assert w.status == "warn" and "not read" in w.detail


def test_a_loose_clock_sample_is_taken_again_on_the_open_connection():
    import time
    from railyard.verbs.preflight import _tighter_clock
    from railyard.testing import FakeSession
    s = FakeSession(host(), {"date +%s.%N": lambda _: (0, f"{time.time() + 0.25:.6f}\n")})
    got = _tighter_clock(s, ClockSample(3.0, 1.5), 0.5)     # read in a 3 s round trip: too loose for 0.5 s
    assert s.calls == ["date +%s.%N"] and got.uncertainty_s < 0.05 and abs(got.offset_s - 0.25) < 0.05
    tight = ClockSample(0.01, 0.002)
    assert _tighter_clock(s, tight, 0.5) is tight and len(s.calls) == 1   # a close sample costs no round trip


def test_a_probe_that_missed_its_limit_is_asked_again_alone_and_its_second_answer_judged():
    """A healthy host that runs every probe at once on a loaded machine can miss a limit: a timeout is not a
    verdict, so the unfinished probes (a section, or one peer inside it) run once more, on their own."""
    import re
    from railyard.verbs.preflight import _asked_again
    from railyard.facts.probe import Output, Section
    from railyard.testing import FakeSession, answer
    sections = [Section("docker_version", "docker version", "docker"), Section("ip_link", "ip -o link show", "ip"),
                Section("ssh_peer", "fan out", "ssh")]
    first = {"docker_version": Output(124, ""), "ip_link": Output(0, "2: cx8r1: mtu 9000\n"),
             "ssh_peer": Output(0, "@@peer 198.18.101.12 rc=124\n\n@@peer 198.18.101.13 rc=0\nC\n")}
    s = FakeSession(host(), {re.compile(r"^T="): answer({"docker_version": "Server: Docker Engine\n",
                                                        "ssh_peer": "@@peer 198.18.101.12 rc=0\nB\n"})})
    got = _asked_again(s, sections, first)
    assert len(s.calls) == 1 and "ry docker_version" in s.calls[0] and "ry ssh_peer" in s.calls[0]
    assert "ry ip_link" not in s.calls[0]                        # what answered is not asked again
    assert got["docker_version"].ok and "Docker Engine" in got["docker_version"].text
    assert got["ssh_peer"].text.startswith("@@peer 198.18.101.12 rc=0") and got["ip_link"] is first["ip_link"]
    done = {k: Output(0, "") for k in first}
    assert _asked_again(s, sections, done) is done and len(s.calls) == 1   # nothing unfinished: no round trip


def test_ssh_peer_is_asked_again_only_for_the_peers_that_hung_with_twice_the_limit():
    """24 hosts probing at once on two cores: one ssh of 23 can miss its 8 s. Asked again: only that peer, with
    16 s, and the others' first answers kept beside its second one."""
    import re
    from railyard.inventory import load_inventory
    from railyard.facts.net import SSH_PEER_HANG_S, ssh_peer_section
    from railyard.verbs.preflight import _asked_again, ssh_peer_again
    from railyard.testing import FakeSession, answer
    from .conftest import ROOT
    inv = load_inventory(ROOT / "inventory" / "pd-3x-b300.yml")
    (slow, fine) = inv.workers
    a, b = slow.serve_rail.ip, fine.serve_rail.ip
    section = ssh_peer_section(inv.workers)
    first = {"ssh_peer": Output(0, f"@@peer {a} rc=124\n\n@@peer {b} rc=0\n{fine.name}\n")}
    s = FakeSession(inv.head, {re.compile(r"^T="): answer({"ssh_peer": f"@@peer {a} rc=0\n{slow.name}\n"})})
    got = _asked_again(s, [section], first, {"ssh_peer": ssh_peer_again(inv.workers)})
    (script,) = s.calls
    assert f"timeout {2 * SSH_PEER_HANG_S} ssh" in script and a in script and b not in script
    from railyard.facts.probe import split_blocks
    assert split_blocks(got["ssh_peer"].text) == {a: (0, slow.name), b: (0, fine.name)}
    res = check_ssh_peer(inv.head, got["ssh_peer"], inv.workers)
    assert res.status == PASS, res


def test_many_hung_peers_are_named_once_grouped_with_one_hint():
    import ipaddress
    from railyard.inventory import Rail
    workers = [Host(name=f"W{i}", rank=i + 1, address="127.0.0.1", port=22, user="", connection="ssh", key_file="",
                    rails={"cx8r1": Rail("cx8r1", "mlx5_1", ipaddress.IPv4Interface(f"198.18.101.{20 + i}/24"))},
                    vars={"cluster_serve_rail": "cx8r1"}) for i in range(21)]
    out = Output(0, "".join(f"@@peer {w.serve_rail.ip} rc=124\n\n" for w in workers))
    res = check_ssh_peer(host("A"), out, workers)
    assert res.status == FAIL and res.detail.count("ssh hung, no answer within its limit") == 1, res.detail
    assert "21 peers" in res.detail and "W0 (198.18.101.20)" in res.detail and "W20 (198.18.101.40)" in res.detail
    assert res.hint.count("ssh -vvv") == 1, res.hint


def test_ssh_s_own_connect_timeout_is_asked_again_and_named_for_what_it_is():
    # seen on a 24-host lab with a core kept busy: every peer's sshd too slow for ConnectTimeout=5
    import re
    from railyard.inventory import load_inventory
    from railyard.facts.net import ssh_peer_section
    from railyard.verbs.preflight import _asked_again, ssh_peer_again
    from railyard.testing import FakeSession, answer
    from .conftest import ROOT
    inv = load_inventory(ROOT / "inventory" / "pd-3x-b300.yml")
    a, b = (w.serve_rail.ip for w in inv.workers)
    slow = "Connection timed out during banner exchange\nConnection to {} port 22 timed out"
    first = {"ssh_peer": Output(0, f"@@peer {a} rc=255\n{slow.format(a)}\n@@peer {b} rc=0\nP2\n")}
    again = {"ssh_peer": f"@@peer {a} rc=255\n{slow.format(a)}\n"}
    s = FakeSession(inv.head, {re.compile(r"^T="): answer(again)})
    got = _asked_again(s, [ssh_peer_section(inv.workers)], first, {"ssh_peer": ssh_peer_again(inv.workers)})
    assert len(s.calls) == 1 and b not in s.calls[0]
    res = check_ssh_peer(inv.head, got["ssh_peer"], inv.workers)
    assert res.status == FAIL and "no answer in time (sshd's banner; asked twice)" in res.detail
    assert "unreachable" not in res.detail
    # a connect that timed out (nothing took the connection: the rail down, no address) is no load: not asked again
    dead = {"ssh_peer": Output(0, f"@@peer {a} rc=255\nssh: connect to host {a} port 22: Connection timed out\n"
                                  f"@@peer {b} rc=0\nP2\n")}
    s2 = FakeSession(inv.head, {re.compile(r"^T="): answer(again)})
    assert _asked_again(s2, [ssh_peer_section(inv.workers)], dead, {"ssh_peer": ssh_peer_again(inv.workers)}) is dead
    assert s2.calls == []
