"""System checks: NTP, disk space for the model, GPUDirect RDMA readiness.
"""

from __future__ import annotations

import re

from . import FAIL, PASS, WARN, CheckResult, first_lines, unusable
from ..facts import ParseError
from ..facts.net import parse_rail_counters
from ..facts.probe import Output
from ..facts.system import (CHRONY_MARK, gdr_parts, parse_chrony_tracking, parse_df, parse_du, parse_ibv_devinfo,
                            parse_lspci_devices, parse_modules, parse_timedatectl, pci_bdf)
from ..inventory import Host


# ---------------------------------------------------------------- time

def check_ntp(host: Host, out: Output) -> CheckResult:
    bad = unusable(host, "ntp", out, "timedatectl")
    if bad:
        return bad
    if CHRONY_MARK in out.text:  # no (working) timedatectl: the section fell back to `chronyc tracking`
        return _check_chrony(host, out.text.split(CHRONY_MARK, 1)[1])
    st = parse_timedatectl(out.text)
    if st.synchronized is None:
        return CheckResult(host.name, "ntp", FAIL, "cannot read the NTP state", first_lines(out.text, 2),
                           "check `timedatectl` (systemd) or `chronyc tracking`")
    if not st.synchronized:
        return CheckResult(host.name, "ntp", FAIL, "clock not synchronized", st.line,
                           "sudo systemctl restart systemd-timesyncd (or chrony); then `timedatectl timesync-status`")
    if st.service in ("inactive",):
        return CheckResult(host.name, "ntp", WARN, "synchronized, but the NTP service is inactive", st.line,
                           "sudo timedatectl set-ntp true, so it stays synchronized")
    return CheckResult(host.name, "ntp", PASS, "clock synchronized", st.line)


def _check_chrony(host: Host, text: str) -> CheckResult:
    """A real NTP verdict from `chronyc tracking`: a reference, a stratum, `Leap status : Normal`, and an offset
    within preflight_max_clock_skew_ms (chrony can say Normal while seconds off, stepping slowly)."""
    try:
        t = parse_chrony_tracking(text)
    except ParseError:
        return CheckResult(host.name, "ntp", FAIL, "chronyc tracking gave no tracking data", first_lines(text, 2),
                           "start chronyd (sudo systemctl start chrony), then `chronyc tracking`")
    limit = host.vars["preflight_max_clock_skew_ms"] / 1000
    src = f"{t.ref_id} ({t.ref_name})" if t.ref_name else f"{t.ref_id}"
    ev = f"{t.line}; Reference ID : {src}; Stratum : {t.stratum}" + \
        (f"; System time : {t.offset_s:+.9f} s" if t.offset_s is not None else "")
    fix_src = "check `chronyc sources -v` (a reachable server or pool in chrony.conf, UDP 123 open), then " \
              "sudo chronyc makestep"
    if t.ref_id in (None, "00000000") or t.leap == "Not synchronised" or t.stratum in (None, 0):
        return CheckResult(host.name, "ntp", FAIL, "chrony: clock not synchronised (no time source selected)", ev,
                           fix_src)
    if t.ref_id == "7F7F0101" or t.ref_name.upper() == "LOCAL":
        return CheckResult(host.name, "ntp", FAIL, "chrony follows its own local clock (`local` directive), "
                           "not an NTP source", ev, fix_src)
    if t.leap is None:
        return CheckResult(host.name, "ntp", FAIL, "chrony: no Leap status line (not yet synchronised)", ev, fix_src)
    if t.offset_s is not None and abs(t.offset_s) > limit:
        return CheckResult(host.name, "ntp", FAIL, f"chrony: synchronised to {src} but the clock is "
                           f"{abs(t.offset_s):.3f} s {'fast' if t.offset_s > 0 else 'slow'} (> {limit:.3f} s)", ev,
                           "sudo chronyc makestep (chrony slews slowly by default; add `makestep 1 3` to chrony.conf)")
    return CheckResult(host.name, "ntp", PASS, f"chrony: synchronised to {src}, stratum {t.stratum}", ev)


# ---------------------------------------------------------------- disk

def check_disk(host: Host, df: Output, du: Output) -> CheckResult:
    bad = unusable(host, "disk", df, "df")
    if bad:
        return bad
    try:
        d = parse_df(df.text)
    except ParseError:
        return CheckResult(host.name, "disk", FAIL, "cannot read `df`", first_lines(df.text, 2), "run `df -h` on the host")
    size = int(host.vars["model_size_gb"] * 1e9)
    margin = int(host.vars["preflight_disk_margin_gb"] * 1e9)
    present = parse_du(du.text) if du and du.ok else None
    path = host.vars["model_path"]
    ev = f"{d.filesystem} on {d.mount}: {d.avail / 1e9:.1f} GB free of {d.size / 1e9:.1f} GB"
    if present is not None and present >= size * 0.98:
        return CheckResult(host.name, "disk", PASS, f"model already at {path} ({present / 1e9:.1f} GB)", ev)
    need = size - (present or 0) + margin
    if d.avail >= need:
        return CheckResult(host.name, "disk", PASS, f"{d.avail / 1e9:.1f} GB free for the model (need {need / 1e9:.1f} GB)", ev)
    return CheckResult(host.name, "disk", FAIL,
                       f"{d.avail / 1e9:.1f} GB free at {path}, need {need / 1e9:.1f} GB (model {size / 1e9:.0f} GB "
                       f"+ margin {margin / 1e9:.0f} GB{f' - {present / 1e9:.1f} GB present' if present else ''})", ev,
                       f"free space on {d.mount}, or set model_path to a larger filesystem (`df -h`)")


# ---------------------------------------------------------------- GPUDirect RDMA readiness

def _kernel_at_least(release: str | None, major: int, minor: int) -> bool:
    m = re.match(r"(\d+)\.(\d+)", release or "")
    return m is not None and (int(m.group(1)), int(m.group(2))) >= (major, minor)


ACS_FIX = ("disable ACS redirect on {ports}: in the BIOS (PCIe ACS Control off) or at boot, as root, "
           "`setpci -s BDF ECAP_ACS+0x6.w=0000` for each (lspci -vvv then shows ACSCtl: SrcValid- ... ReqRedir- "
           "CmpltRedir-); GPUDirect RDMA needs the GPU and the NIC to talk through the switch, not the root complex")


def _acs(host: Host, lspci: str, gpu_buses: list[str] | None, nic_bus: str | None
         ) -> tuple[list[str], list[str], list[str], list[str]]:
    """ACS on the PCIe switch downstream ports between each cluster GPU and the rail NIC: (fails, warns, hints,
    evidence). The path is the bridges above the GPU and above the NIC below their common ancestor (lspci -PP);
    redirect there fails, elsewhere it is a note. Without a path (an old lspci, the GPU or the NIC not found)
    every switch downstream port is judged."""
    rail = host.serve_rail
    devs, denied, with_paths = parse_lspci_devices(lspci)
    downs = [d for d in devs.values() if d.port == "Downstream Port"]
    if denied and not any(d.acsctl is not None for d in devs.values()):
        return [], ["PCI capabilities hidden (lspci not run as root): ACS not read"], [
            "run preflight as root (ansible_user: root) to read ACS, or check by hand: "
            "sudo lspci -vvv | grep -E 'Downstream Port|ACSCtl'"], []
    try:
        found = [devs.get(pci_bdf(b)) for b in gpu_buses or []]
        nic = devs.get(pci_bdf(nic_bus)) if nic_bus else None
    except ValueError:
        found, nic = [], None
    gpus = [g for g in found if g is not None]
    if with_paths and nic is not None and gpus and len(gpus) == len(found):
        on_path: set[str] = set()
        for g in gpus:
            on_path |= set(g.path[:-1]) ^ set(nic.path[:-1])
        path_ports = [d for d in downs if d.bdf in on_path]
        bad = [d for d in path_ports if d.redirects]
        other = [d for d in downs if d.redirects and d.bdf not in on_path]
        between = f"GPU(s) {', '.join(g.slot for g in gpus)} and the rail NIC {rail.name} ({nic.slot})"
        note = (f" (ACS redirect on {len(other)} other port(s), on no GPU-NIC path: "
                f"{', '.join(d.slot for d in other[:4])})" if other else "")
        if bad:
            ports = ", ".join(d.slot for d in bad[:6])
            return ([f"ACS redirects peer-to-peer on PCIe switch port(s) {ports}, on the path between {between}"],
                    [], [ACS_FIX.format(ports=ports)], [f"{d.slot} {d.line}" for d in bad[:2]] + ([note.strip(" ()")]
                                                                                                 if note else []))
        if path_ports:
            return [], [], [], [f"ACS off on the {len(path_ports)} switch downstream port(s) between {between}{note}"]
        return [], [], [], [f"no PCIe switch port between {between}{note}"]
    redirect = [d for d in downs if d.redirects]
    why = "lspci without -PP paths" if not with_paths else \
        "the GPU or the NIC not in lspci" if (gpu_buses and nic_bus) else "the GPU or NIC address unknown"
    if redirect:
        ports = ", ".join(d.slot for d in redirect[:6])
        return ([f"ACS redirects peer-to-peer on PCIe switch port(s) {ports}"], [], [ACS_FIX.format(ports=ports)],
                [f"{d.slot} {d.line}" for d in redirect[:2]] + [f"every switch port judged ({why})"])
    acs = [d for d in downs if d.acsctl is not None]
    return [], [], [], [f"ACS off on {len(acs)} switch downstream port(s)" if acs else "no PCIe switch with ACS"]


def check_gdr(host: Host, out: Output, kernel: str | None, gpu_buses: list[str] | None = None,
              nic_bus: str | None = None) -> CheckResult:
    """Before the model loads: GPU peer memory for the NIC (nvidia_peermem, or DMA-BUF: the open kernel module on
    Linux >= 5.12), the rail HCA's port PORT_ACTIVE with link layer Ethernet (RoCE), no ACS redirect on the PCIe
    switch downstream ports between each cluster GPU (gpu_buses) and the rail NIC (nic_bus) (it sends GPU<->NIC
    traffic up through the root complex), and the rail's error counters steady across the probe."""
    bad = unusable(host, "gdr", out, "lsmod/ibv_devinfo/lspci")
    if bad:
        return bad
    rail = host.serve_rail
    p = gdr_parts(out.text)
    fails, warns, hints, ev = [], [], [], []
    mods = parse_modules(p.get("modules", ""))
    nvver = p.get("nvidia", "")
    open_module = "Open Kernel Module" in nvver
    if "nvidia_peermem" in mods:
        ev.append("nvidia_peermem loaded")
    elif open_module and _kernel_at_least(kernel, 5, 12):
        ev.append(f"DMA-BUF: NVIDIA open kernel module on {kernel}")
    else:
        why = "the proprietary module" if nvver.strip() else "no /proc/driver/nvidia/version"
        fails.append(f"no GPU peer memory for the NIC: nvidia_peermem not loaded and no DMA-BUF ({why}"
                     f"{', kernel ' + kernel if kernel else ''})")
        hints.append("sudo modprobe nvidia_peermem (and persist it in /etc/modules-load.d/), or use the open kernel "
                     "module (nvidia-driver-NNN-open) on Linux >= 5.12 for DMA-BUF")
    ibv = p.get("ibv", "")
    if "@@missing" in ibv or not ibv.strip():
        warns.append("ibv_devinfo not found: the port state and link layer were not read")
        hints.append("install the DOCA-Host / MLNX_OFED user tools (ibv_devinfo)")
    else:
        try:
            info = parse_ibv_devinfo(ibv)
            port = info.ports.get(1) or next(iter(info.ports.values()), None)
            if port is None:
                fails.append(f"{rail.hca}: no port in ibv_devinfo")
            else:
                ev.append(f"{info.hca} port {port.port} {port.state}, link_layer {port.link_layer}")
                if port.state != "PORT_ACTIVE":
                    fails.append(f"{info.hca} port {port.port} is {port.state}, not PORT_ACTIVE")
                    hints.append(f"bring the rail up: cable/transceiver, `ip link set {rail.name} up`, then "
                                 f"`ibv_devinfo -d {rail.hca}`")
                if port.link_layer != "Ethernet":
                    fails.append(f"{info.hca} link layer is {port.link_layer or 'unknown'}, not Ethernet (RoCE)")
                    hints.append(f"set the port to Ethernet: mlxconfig -d {rail.hca} set LINK_TYPE_P1=2, then reboot")
        except ParseError:
            fails.append(f"ibv_devinfo -d {rail.hca} gave no device: {first_lines(ibv, 1)}")
            hints.append(f"check the HCA name ({rail.hca}) against `ibv_devices`")
    lspci = p.get("lspci", "")
    if "@@missing" in lspci:
        warns.append("lspci not found: ACS on the GPU-NIC path was not read")
        hints.append("apt-get install pciutils")
    else:
        f, w, h, e = _acs(host, lspci, gpu_buses, nic_bus)
        fails += f
        warns += w
        hints += h
        ev += e
    (src1, err1), (src, err2) = parse_rail_counters(p.get("stats1", "")), parse_rail_counters(p.get("stats2", ""))
    if src1 != src:  # the two reads came from different sources: nothing to compare
        err1 = err2
    moved = {k: err2[k] - err1.get(k, 0) for k in err2 if err2[k] > err1.get(k, 0)}
    sysfs = src.startswith("sysfs")
    if moved:
        fails.append(f"{rail.name} error counters moving: " +
                     ", ".join(f"{k} +{d}" for k, d in sorted(moved.items())[:5]) + (" (sysfs)" if sysfs else ""))
        hints.append(f"a bad cable, transceiver or switch port on {rail.name}: `ethtool -S {rail.name}`, "
                     f"`ethtool -m {rail.name}` (optics), reseat or replace; check the switch port's counters"
                     + (f"; drops without errors: `ip -s link show {rail.name}` and a frame larger than a hop's MTU "
                        "(jumbo_ping)" if sysfs and not any("error" in k for k in moved) else ""))
    nonzero = {k: v for k, v in err2.items() if v}
    if err2:
        ev.append(f"{rail.name} counters ({src}): " + (", ".join(f"{k}={v}" for k, v in sorted(nonzero.items())[:4])
                                                       if nonzero else "all error counters 0"))
    else:
        ev.append(f"{rail.name}: no error counters exposed by its driver (ethtool -S) nor in sysfs")
    if fails:
        return CheckResult(host.name, "gdr", FAIL, "; ".join(fails), " | ".join(ev), "; ".join(dict.fromkeys(hints)))
    if warns:
        return CheckResult(host.name, "gdr", WARN, "; ".join(warns), " | ".join(ev), "; ".join(dict.fromkeys(hints)))
    return CheckResult(host.name, "gdr", PASS, "GPUDirect RDMA ready: " + "; ".join(ev[:3]), " | ".join(ev))
