"""Preflight issue 15: ACS judged on the exact PCIe path between each cluster GPU and the rail NIC (lspci -PP),
and the rail error counters from sysfs where `ethtool -S` shows none.

Origins: gdr/ in FORMATS-ORIGINS.md (a real PEX 8747 downstream port block, `lspci -vvv` as root); the -PP slot
form is pciutils' show_slot_path (`[dddd:]bb:dd.f/bb:dd.f/...`); sysfs-counters/ORIGINS.md (an H200 device
machine). The lab's stand-in lspci is run in-process over each lab host shape's PCIe tree."""

import contextlib
import importlib.util
import io
import json

import pytest

from railyard.checks.system import check_gdr
from railyard.facts.net import parse_rail_counters
from railyard.facts.system import PCI_PATHS_MARK, parse_lspci_devices, pci_bdf
import railyard_lab as lab

from .conftest import REAL
from .test_preflight_health import IBV, LSPCI, gdr_out, rail_host

MODS = (REAL / "gdr" / "web-lsmod-grep-nvidia-mlx5_peermem-loaded.txt").read_text()
SYSFS = (REAL / "sysfs-counters" / "h200-vm-net-statistics-grep-H.txt").read_text()
ETH0 = SYSFS.split("@@ eth0")[0]  # the first interface's block: eleven `name:value` lines


def test_lspci_devices_plain_and_with_paths():
    devs, denied, paths = parse_lspci_devices(LSPCI)  # the real block, plain -vvv: no path
    (d,) = devs.values()
    assert (d.bdf, d.slot, d.path, d.port, d.redirects) == ("0000:03:08.0", "03:08.0", ("0000:03:08.0",),
                                                            "Downstream Port", False)
    assert not denied and not paths
    # the same real block as `lspci -PP -vvv` names it below its root port and switch upstream port
    pp = LSPCI.replace("03:08.0 PCI bridge", "0002:00:02.0/02:00.0/03:08.0 PCI bridge", 1) + PCI_PATHS_MARK + "\n"
    devs, _, paths = parse_lspci_devices(pp)
    (d,) = devs.values()
    assert paths and d.bdf == "0002:03:08.0" and d.path == ("0002:00:02.0", "0002:02:00.0", "0002:03:08.0")
    assert d.slot == "0002:03:08.0" and d.acsctl["SrcValid"] is False
    assert pci_bdf("00000008:06:00.0") == "0008:06:00.0" == pci_bdf("8:6:0.0")  # nvidia-smi's form
    with pytest.raises(ValueError):
        pci_bdf("GPU-35842103")


def standin(shape, tmp_path, **state):
    """The lab's tools.py over one host of this shape: (module, its `lspci -PP -vvv` as preflight filters it)."""
    d = tmp_path / shape
    (d / "state").mkdir(parents=True)
    (d / "shape.json").write_text(json.dumps(lab.host_shape(shape, "H200", "A")))
    for k, v in state.items():
        (d / "state" / k.replace("_", "-")).write_text(v)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAILYARD_LAB_HOST_DIR", str(d))
        spec = importlib.util.spec_from_file_location("lab_tools", lab.SIM_SOURCE)
        m = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(m)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        m.lspci(["-PP", "-vvv"])
    keep = [line for line in buf.getvalue().splitlines()
            if line[:1].isalnum() or "Express" in line or "ACSCtl" in line]
    return m, "\n".join(keep + [PCI_PATHS_MARK]) + "\n"


def judge(m, lspci):
    h = rail_host()
    sh = m.shape()
    rail = sh["serve_rail"]
    h = h.__class__(**{**h.__dict__, "rails": {rail: h.rails["cx8r1"].__class__(rail, "mlx5_0", h.rails["cx8r1"].ipv4)},
                       "vars": {**h.vars, "cluster_serve_rail": rail}})
    gpus = [g["bus"] for g in sh["gpus"] if not g["display"]]
    return check_gdr(h, gdr_out(MODS, "", IBV, lspci, ETH0, ETH0), "6.8.0", gpus, m.nic_bus(rail))


def test_station_redirect_on_the_nic_switch_port_fails_and_off_path_is_a_note(tmp_path):
    m, text = standin("station", tmp_path)
    ok = judge(m, text)
    assert ok.status == "pass", ok
    assert "ACS off on the 1 switch downstream port(s) between GPU(s) 0008:06:00.0 and the rail NIC cx8r1 " \
           "(04:00.1)" in ok.detail
    m, text = standin("station", tmp_path / "p", acs_redirect="path")
    bad = judge(m, text)
    assert bad.status == "fail" and bad.detail == ("ACS redirects peer-to-peer on PCIe switch port(s) 03:00.0, on the "
                                                   "path between GPU(s) 0008:06:00.0 and the rail NIC cx8r1 (04:00.1)")
    assert "setpci -s BDF ECAP_ACS+0x6.w=0000" in bad.hint and "SrcValid-" in bad.hint and "03:00.0" in bad.hint
    assert "03:00.0 ACSCtl:\tSrcValid+ TransBlk- ReqRedir+ CmpltRedir+" in bad.evidence
    m, text = standin("station", tmp_path / "o", acs_redirect="off-path")
    note = judge(m, text)
    assert note.status == "pass" and "(ACS redirect on 1 other port(s), on no GPU-NIC path: 03:01.0)" in note.evidence


def test_hgx8_every_gpus_path_to_the_rail_nic_is_judged(tmp_path):
    m, text = standin("hgx8", tmp_path, acs_redirect="path")
    bad = judge(m, text)
    # GPU 0 shares rail 0's switch: its two ports; GPUs 1-7 reach it through the root complex, past port 17:00.0
    assert bad.status == "fail" and "port(s) 17:00.0, 17:01.0, on the path between GPU(s) 19:00.0, 3b:00.0" \
        in bad.detail and "and the rail NIC enp24s0np0 (18:00.0)" in bad.detail
    m, text = standin("hgx8", tmp_path / "o", acs_redirect="off-path")
    note = judge(m, text)
    assert note.status == "pass" and "on no GPU-NIC path: 17:02.0" in note.evidence
    assert "ACS off on the 9 switch downstream port(s) between GPU(s)" in note.detail  # 8 GPU ports + the NIC's
    # a GPU the listing does not show: the path is unknown, so every switch port is judged (redirect fails)
    lost = judge(m, text.replace("/19:00.0 3D", "/1f:00.0 3D"))
    assert lost.status == "fail" and "every switch port judged (the GPU or the NIC not in lspci)" in lost.evidence


def test_sysfs_counters_are_read_where_ethtool_shows_none_and_movement_fails():
    # the H200 machine: the net statistics answer, its /sys/class/infiniband is empty (h200-vm-no-infiniband.txt):
    # evidence names the folder that was read, never the one that gave nothing
    src, c = parse_rail_counters("@@source sysfs\n@@dir /sys/class/net/eth0/statistics\n" + ETH0 +
                                   "@@dir /sys/class/infiniband/mlx5_0/ports/1/counters\n")
    assert src == "sysfs /sys/class/net/eth0/statistics"
    assert len(c) == 11 and set(c.values()) == {0} and "tx_dropped" in c
    first = "@@source sysfs\n@@dir /sys/class/net/cx8r1/statistics\n" + ETH0 + "@@dir /sys/class/infiniband/x\n"
    later = first.replace("tx_dropped:0", "tx_dropped:3").replace("rx_crc_errors:0", "rx_crc_errors:2")
    h = rail_host()
    steady = check_gdr(h, gdr_out(MODS, "", IBV, LSPCI, first, first), "6.8.0")
    assert steady.status == "pass" and "cx8r1 counters (sysfs /sys/class/net/cx8r1/statistics): all error " \
        "counters 0" in steady.evidence and "infiniband" not in steady.evidence
    moving = check_gdr(h, gdr_out(MODS, "", IBV, LSPCI, first, later), "6.8.0")
    assert moving.status == "fail" and "cx8r1 error counters moving: rx_crc_errors +2, tx_dropped +3 (sysfs)" \
        in moving.detail and "ethtool -m cx8r1" in moving.hint
    # a driver's ethtool -S counters still win where it has them (the real lossy optic)
    lossy = (REAL / "gdr" / "web-ethtool-S-grep-err-cx6dx-lossy-optic.txt").read_text()
    assert parse_rail_counters("@@source ethtool\n" + lossy)[0] == "ethtool -S"
    assert parse_rail_counters(lossy)[1]["rx_crc_errors_phy"] == 13147323


def test_the_probe_reads_sysfs_only_when_ethtool_shows_no_rail_counter(tmp_path):
    """The section's shell, run here against a fake ethtool and a fake sysfs tree: the first form prints the
    driver's counters, the second (only veth-like names) falls back to the statistics directory."""
    import subprocess
    from railyard.facts.net import counters_script
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    stats = tmp_path / "sys" / "statistics"
    stats.mkdir(parents=True)
    for k in ("rx_errors", "tx_dropped"):
        (stats / k).write_text("5\n")
    script = counters_script("cx8r1", "mlx5_0").replace("/sys/class/net/cx8r1/statistics", str(stats))
    fake = bin_ / "ethtool"
    ib = "@@dir /sys/class/infiniband/mlx5_0/ports/1/counters\n"   # no such folder here: nothing under it
    for body, want in (("     rx_crc_errors_phy: 7", "@@source ethtool\n     rx_crc_errors_phy: 7\n"),
                       ("     peer_ifindex: 5\n     rx_queue_0_xdp_tx_errors: 0",
                        f"@@dir {stats}\nrx_errors:5\ntx_dropped:5\n{ib}")):
        fake.write_text(f"#!/bin/sh\nprintf '%s\\n' '{body}'\n")
        fake.chmod(0o755)
        out = subprocess.run(["sh", "-c", script], capture_output=True, text=True,
                             env={"PATH": f"{bin_}:/usr/bin:/bin"}).stdout
        assert out.endswith(want), out
    assert parse_rail_counters(out)[0] == f"sysfs {stats}"    # the folder that answered, and only it
