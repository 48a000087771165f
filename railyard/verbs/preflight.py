"""`inv preflight`: every host in parallel, read-only, one connection and one round trip each (and one more
for the ports check, on the hosts the plan connects).

Exit codes: 0 every check passed (warnings allowed), 1 a check failed, 2 usage or
inventory error. `--json` prints exactly one document:

    {"ok": bool, "checks": [{"host", "check", "status", "detail", "evidence", "hint"}]}

status is one of pass, warn, fail, skip.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .. import checks as C
from ..inventory import Host, Inventory
from ..facts import (GPU_AND_HEALTH_FIELDS, GPU_FIELDS, PCI_PATHS_MARK, RAIL_ERROR_COUNTERS, compute_apps_csv,
                     parse_gpu_health, parse_gpus, parse_ibv_devinfo, parse_image_inspect, parse_smi_pids,
                     parse_versions, split_gpu_query)
from ..facts.probe import (MISSING_MARK, Output, Section, fan_out, joined_script, new_token, no_answer, split_blocks,
                           split_output)
from ..transport.runner import Runner
from ..plan.spec import Dial
from ..transport import RemotePath, Session, Sh, cmd, q

DOCKER_TIMEOUT = 15


PORT_WAIT_S = 4  # a dial is tried again for this long while refused or unanswered (its listener starts with it)
PORT_LISTEN_MORE_S = 2  # a listener waits this much longer for its dialers (it ends once every one came)
PORT_SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "port_probe.py"


def plan_dials(inv: Inventory) -> list[Dial]:
    """The connections the inventory's layout will open between its hosts; none where its variables have a
    problem (launch names it)."""
    from ..plan import layout as layouts
    layout = layouts.get(inv)
    return [] if layout.validate(inv) else layout.dials(inv)


def port_probe(wait: float, listen: list[tuple[str, int, int]], dial: list[tuple[str, int]]) -> Sh:
    """scripts/port_probe.py on the host's python3: listen on each (address, port) until its n peers came,
    dial each (address, port) for up to `wait` s."""
    args: list = [wait, PORT_LISTEN_MORE_S]
    for addr, port, n in listen:
        args += ["listen", addr, port, n]
    for addr, port in dial:
        args += ["dial", addr, port]
    return cmd("python3", "-c", PORT_SCRIPT.read_text(), *args)


def ports_section(host: Host, dials: list[Dial]) -> Section | None:
    """This host's part of the port check: a listener for each address and port the others dial on it, and
    its own dials; None when it has neither. Run on every host concerned at once, in a round of its own
    after the probes (both ends connected already, so each listener is up within the dialers' retries)."""
    peers: dict[tuple[str, int], set[str]] = {}
    for d in dials:
        if d.dst == host.name:
            peers.setdefault((d.address, d.port), set()).add(d.src)
    mine = list(dict.fromkeys((d.address, d.port) for d in dials if d.src == host.name))
    if not peers and not mine:
        return None
    return Section("ports", port_probe(PORT_WAIT_S, [(a, p, len(n)) for (a, p), n in peers.items()], mine),
                   "python3", PORT_WAIT_S + PORT_LISTEN_MORE_S + 8)


def sections_for(host: Host, inv: Inventory) -> list[Section]:
    """The probes for one host: read-only commands, each with the tool it needs."""
    v = host.vars
    rail = host.serve_rail
    peers = [p for p in inv.hosts if p.name != host.name]
    image = v["vllm_image"]
    model = q(RemotePath(v["model_path"]))  # quoted once, pasted below
    size = v["preflight_mtu"] - 28
    count = v["preflight_ping_count"]
    deadline = int(count * 0.2 + 3)
    # a small ping per peer first: it resolves the neighbour entry before the jumbo frames, and tells "small
    # frames pass" from "nothing passes" (an MTU black hole vs a dead path: checks.one_cause)
    pings = fan_out([(p.serve_rail.ip, Sh(cmd("ping", "-I", rail.name, "-c", "1", "-W", "1", p.serve_rail.ip)
                                          + f"; echo {q(C.JUMBO_MARK)}; "
                                          + cmd("ping", "-I", rail.name, "-M", "do", "-s", size, "-c", count,
                                                "-i", "0.2", "-W", "2", p.serve_rail.ip)))
                     for p in peers])
    routes = Sh(cmd("printf", "route get %s\\n", *[p.serve_rail.ip for p in peers]) + " | ip -o -force -batch -")
    sections = [
        # docker: `version` for the daemon, one `image inspect` for the pinned reference and its tag (a JSON array
        # of those found, an error line for each one missing); two calls: no docker command answers both
        Section("docker_version", cmd("docker", "version"), "docker", DOCKER_TIMEOUT),
        Section("image", cmd("docker", "image", "inspect", image, image.split("@", 1)[0]), "docker", DOCKER_TIMEOUT),
        Section("ibdev2netdev", cmd("ibdev2netdev"), "ibdev2netdev"),
        Section("ip_addr", cmd("ip", "-br", "addr", "show"), "ip"),
        Section("ip_link", cmd("ip", "-o", "link", "show"), "ip"),
        Section("ethtool", cmd("ethtool", rail.name), "ethtool"),
        gids_section(rail.hca),
        time_section(),
        Section("df", Sh(f"p={model}; while [ ! -e \"$p\" ]; do p=$(dirname \"$p\"); done; df -P -B1 \"$p\""), "df"),
        Section("du", Sh(f"if [ -d {model} ]; then du -sb --exclude=.cache {model}; fi"), "du", 60),
        Section("gpus", Sh(cmd("nvidia-smi", "--query-gpu=" + ",".join(GPU_AND_HEALTH_FIELDS),
                                   "--format=csv,noheader,nounits") + " 2>&1 || "
                           + cmd("nvidia-smi", "--query-gpu=" + ",".join(GPU_FIELDS), "--format=csv,noheader,nounits")),
                "nvidia-smi"),  # one nvidia-smi call for the gpu and gpu_health checks (a second only on an old driver)
        # the compute processes and the driver's CUDA version (parity) from a second call: nvidia-smi answers
        # one --query-* switch per call ("Only one --query-* switch can be used at a time.", exit 2: a real
        # capture in tests/fixtures/real/nvidia-smi-one-call/), and -q -d PIDS has both in one
        Section("gpu_pids", cmd("nvidia-smi", "-q", "-d", "PIDS"), "nvidia-smi"),
        Section("dmesg", Sh("o=$(dmesg 2>&1); rc=$?; if [ $rc -ne 0 ]; then printf '%s\\n' \"$o\" | head -n 3; "
                            "exit $rc; fi; printf '%s\\n' \"$o\" | grep -F 'NVRM: Xid' | tail -n 50; exit 0"), "dmesg"),
        versions_section(rail.name),
        gdr_section(rail.name, rail.hca),
    ]
    if peers:
        sections.append(Section("ping", pings, "ping", deadline + 6))
        sections.append(Section("route", routes, "ip"))
    if host.is_head and inv.workers:
        sections.append(ssh_peer_section(inv.workers))
    return sections


def time_section() -> Section:
    """timedatectl where it works; else `chronyc tracking` after a marker (containers and minimal images without
    systemd as PID 1); neither installed: the missing-tool mark for timedatectl."""
    td = cmd("timedatectl", "show") + " 2>/dev/null || " + cmd("timedatectl")
    return Section("time", Sh(
        f"{{ command -v timedatectl >/dev/null 2>&1 && {{ {td}; }}; }} || "
        f"{{ command -v chronyc >/dev/null 2>&1 && {{ echo {q(C.CHRONY_MARK)}; chronyc tracking; }}; }} || "
        f"{{ command -v timedatectl >/dev/null 2>&1 || echo {q(MISSING_MARK + 'timedatectl')}; exit 127; }}"))


def versions_section(rail: str) -> Section:
    """The versions compared across ranks (parity): kernel, the rail NIC's driver and firmware, OFED/DOCA."""
    return Section("versions", Sh(
        "echo \"@@kernel $(uname -r)\"; "
        f"ethtool -i {q(rail)} 2>/dev/null | grep -E '^(driver|version|firmware-version|bus-info):'; "
        "if command -v ofed_info >/dev/null 2>&1; then echo \"@@ofed $(ofed_info -s 2>/dev/null)\"; fi; exit 0"))


# the kernel's own counters, read where `ethtool -S` is missing or shows none of RAIL_ERROR_COUNTERS: the netdev's
# (every driver has them) and the RDMA port's (an HCA's IB counters; absent on a host without one)
SYSFS_NET_COUNTERS = ("rx_errors", "tx_errors", "rx_dropped", "tx_dropped", "rx_crc_errors", "rx_frame_errors",
                      "rx_fifo_errors", "rx_missed_errors", "rx_over_errors", "tx_carrier_errors", "tx_fifo_errors")
SYSFS_IB_COUNTERS = ("symbol_error", "link_downed", "link_error_recovery", "port_rcv_errors",
                     "port_rcv_remote_physical_errors", "port_xmit_discards", "local_link_integrity_errors",
                     "excessive_buffer_overrun_errors")


def counters_script(rail: str, hca: str) -> str:
    """One read of the rail's error counters: `ethtool -S` filtered to RAIL_ERROR_COUNTERS after `@@source ethtool`,
    or, where that shows none, `@@source sysfs` and, after `@@dir DIR`, the kernel's counters in DIR as `grep -H`
    prints them (`name:value`)."""
    net = f"/sys/class/net/{rail}/statistics"
    ib = f"/sys/class/infiniband/{hca}/ports/1/counters"
    return (f"o=$(ethtool -S {q(rail)} 2>/dev/null | grep -E {q(RAIL_ERROR_COUNTERS.pattern)}); "
            "if [ -n \"$o\" ]; then echo '@@source ethtool'; printf '%s\\n' \"$o\"; "
            "else echo '@@source sysfs'; "
            f"echo {q('@@dir ' + net)}; (cd {q(net)} 2>/dev/null && grep -H . {' '.join(SYSFS_NET_COUNTERS)} 2>/dev/null); "
            f"echo {q('@@dir ' + ib)}; (cd {q(ib)} 2>/dev/null && grep -H . {' '.join(SYSFS_IB_COUNTERS)} 2>/dev/null); fi")


def gdr_section(rail: str, hca: str) -> Section:
    """GPUDirect RDMA readiness in one shell: kernel modules, the NVIDIA driver flavour, the rail HCA's port,
    ACS on the PCIe bridges (lspci shows capabilities to root only; no sudo is tried: a read-only preflight leaves
    no auth-log trail), and the rail's error counters read twice, half a second apart (ethtool -S, else sysfs)."""
    stats = counters_script(rail, hca)
    # -PP names each device by its path through the bridges above it (pciutils >= 3.6), so the gdr check judges
    # the ports between each GPU and the rail NIC; an older lspci: the plain listing, every switch port judged
    pci = (f"{{ lspci -PP -vvv 2>/dev/null && echo {q(PCI_PATHS_MARK)} || lspci -vvv 2>/dev/null; }} "
           f"| grep -E '^[0-9a-f]|Express|ACSCtl|access denied|{PCI_PATHS_MARK}'")
    return Section("gdr", Sh(
        "echo '@@gdr modules'; if command -v lsmod >/dev/null 2>&1; then lsmod; else cat /proc/modules; fi; "
        "echo '@@gdr nvidia'; cat /proc/driver/nvidia/version 2>/dev/null; "
        f"echo '@@gdr ibv'; if command -v ibv_devinfo >/dev/null 2>&1; then ibv_devinfo -d {q(hca)} 2>&1; "
        "else echo @@missing; fi; "
        f"echo '@@gdr lspci'; if command -v lspci >/dev/null 2>&1; then {pci}; "
        "else echo @@missing; fi; "
        f"echo '@@gdr stats1'; {stats}; sleep 0.5; echo '@@gdr stats2'; {stats}; exit 0"), timeout=20)


def gpus_section() -> Section:
    return Section("gpus", cmd("nvidia-smi", "--query-gpu=index,uuid,name,memory.used,memory.total",
                               "--format=csv,noheader,nounits"), "nvidia-smi")


def gids_section(hca: str) -> Section:
    return Section("gids", cmd("show_gids", hca), "show_gids")


SSH_PEER_HANG_S = 8  # each ssh gets its own limit, so one that hangs (e.g. on an MTU black hole) is named alone


# OpenSSH 9's default key exchange (sntrup761x25519) cost the head 66 ms of CPU per connection here, curve25519
# 8 ms: N-1 of them at once on the head. Where the head's ssh takes a '^' list (OpenSSH >= 8.7; `ssh -G` only
# parses) curve25519 goes first, the defaults after it for a server that lacks it; else the defaults alone.
KEX_FIRST = "KexAlgorithms=^curve25519-sha256"


def ssh_peer_section(targets: list[Host], hang_s: int = SSH_PEER_HANG_S) -> Section:
    """From one host, a non-interactive ssh to each target's rail address, host keys checked."""
    detect = Sh(f"k=; ssh -G -o {q(KEX_FIRST)} railyard-probe >/dev/null 2>&1 && k={q(KEX_FIRST)}\n")
    return Section("ssh_peer", Sh(detect + fan_out([
        (t.serve_rail.ip, Sh(cmd("timeout", hang_s, "ssh", "-n") + ' ${k:+-o "$k"} '
                             + cmd("-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes",
                                   "-o", f"ConnectTimeout={hang_s - 3}",
                                   *(["-l", t.user] if t.user else []), t.serve_rail.ip, "hostname")))
        for t in targets])), "ssh", hang_s + 7)


def ssh_peer_again(workers: list[Host]):
    """The ssh_peer probe asked again: only the targets whose ssh hung, with twice the limit (every host of a
    large lab probing at once on few cores can starve a healthy one), their new answers put in place. A target
    to which every jumbo ping of the same probe was lost is not asked again: the hang has its cause in view
    (an MTU black hole stalls ssh's key exchange), and the longer wait would only delay the report."""
    def narrowed(first: Output, outputs: dict[str, Output]) -> tuple[Section, Callable[[Output], Output]] | None:
        blocks = split_blocks(first.text)
        hung = [w for w in workers if no_answer(*blocks.get(w.serve_rail.ip, (None, "")))
                and not C.jumbo_frames_lost(outputs.get("ping"), w.serve_rail.ip)]
        if not hung:
            return None

        def merge(second: Output) -> Output:
            new = split_blocks(second.text)
            text = "".join(f"@@peer {k} rc={rc2}\n{t2}\n" for k, (rc2, t2) in
                           ((k, new.get(k, v)) for k, v in blocks.items()))
            return Output(second.rc, text, second.missing_tool)
        return ssh_peer_section(hung, 2 * SSH_PEER_HANG_S), merge
    return narrowed


@dataclass
class HostProbe:
    host: Host
    outputs: dict[str, Output] | None  # None: we never got onto the host
    clock: C.ClockSample | None
    ssh: C.CheckResult


CLOCK_RETRIES = 3


def _tighter_clock(session: Session, clock: C.ClockSample | None, limit_s: float) -> C.ClockSample | None:
    """A clock sample is known to its round trip's half; one taken while this host started every probe at
    once (or while the machine ran many hosts' probes) may be too loose to judge a skew of limit_s. Then
    `date` alone, on the connection already open, up to CLOCK_RETRIES times; the tightest sample wins."""
    for _ in range(CLOCK_RETRIES):
        if clock is not None and clock.uncertainty_s <= limit_s / 4:
            break
        t0 = time.time()
        r = session.run("date +%s.%N", timeout=10)
        t1 = time.time()
        try:
            again = C.ClockSample(float(r.stdout.strip()) - (t0 + t1) / 2, (t1 - t0) / 2)
        except ValueError:
            continue
        if clock is None or again.uncertainty_s < clock.uncertainty_s:
            clock = again
    return clock


def probe_host(session: Session, inv: Inventory) -> HostProbe:
    h = session.host
    started = time.monotonic()
    err = session.connect()
    if err:
        return HostProbe(h, None, None, C.CheckResult(h.name, "ssh", C.FAIL, f"{err.kind}: {err.message}",
                                                      err.fingerprint, err.hint))
    connect_s = time.monotonic() - started
    sections = sections_for(h, inv)
    token = new_token()
    timeout = max(s.timeout for s in sections) + 10
    # one round trip: the clock sample and the host's name lead the probe's output; the sample is taken when
    # their first line arrives, not when the whole probe ends
    first: list[str] = []
    arrived: list[float] = []

    def seen(chunk: str) -> None:
        if not arrived:
            first.append(chunk)
            if "\n" in "".join(first):
                arrived.append(time.time())

    t0 = time.time()
    res = session.run("date +%s.%N; hostname\n" + joined_script(sections, token), timeout=timeout, on_output=seen)
    if res.error:
        return HostProbe(h, None, None, C.CheckResult(h.name, "ssh", C.FAIL, f"{res.error.kind}: {res.error.message}",
                                                      "", res.error.hint))
    lines = res.stdout.split("\n", 2)
    clock = None
    try:
        t1 = arrived[0]
        clock = C.ClockSample(float(lines[0]) - (t0 + t1) / 2, (t1 - t0) / 2)
    except (ValueError, IndexError):
        pass
    clock = _tighter_clock(session, clock, h.vars["preflight_max_clock_skew_ms"] / 1000)
    remote_name = lines[1].strip() if len(lines) > 1 and lines[1].strip() else "?"
    how = "local" if h.is_local else f"{h.user + '@' if h.user else ''}{h.address}:{h.port}"
    ssh = C.CheckResult(h.name, "ssh", C.PASS, f"{how} (hostname {remote_name})",
                        f"connected in {connect_s * 1000:.0f} ms" if not h.is_local else "connection: local")
    narrow = {"ssh_peer": ssh_peer_again(inv.workers)} if h.is_head and inv.workers else {}
    return HostProbe(h, _asked_again(session, sections, split_output(res.stdout, sections, token), narrow), clock, ssh)


def _unfinished(o: Output) -> bool:
    """No answer in time, from the probe or from one of its peers (`timeout` gives 124, or 137 once it had
    to kill): not a verdict yet."""
    return o.rc is None or o.timed_out or any(no_answer(rc, t) for rc, t in split_blocks(o.text).values())


def _asked_again(session: Session, sections: list[Section], outputs: dict[str, Output],
                 narrow: dict | None = None) -> dict[str, Output]:
    """The probes that did not answer in time, run once more on their own, after the rest: a host running
    every probe at once (or a controller driving many hosts on few cores) can make a healthy one miss its
    limit, and a timeout is not a verdict. Their second answer is the one judged; one that times out again
    is judged as it is. narrow: per section, what to ask again of it alone (its unanswered part) and how
    to put the answers back."""
    again, merges = [], {}
    for s in sections:
        if s.key not in outputs or not _unfinished(outputs[s.key]):
            continue
        part = (narrow or {}).get(s.key, lambda o, _: None)(outputs[s.key], outputs)
        if part:
            section, merges[s.key] = part
            again.append(section)
        else:
            again.append(s)
    if not again:
        return outputs
    token = new_token()
    res = session.run(joined_script(again, token), timeout=max(s.timeout for s in again) + 10)
    if res.error:
        return outputs
    second = split_output(res.stdout, again, token)
    return {**outputs, **{k: merges[k](o) if k in merges else o for k, o in second.items()}}


def evaluate(inv: Inventory, probes: dict[str, HostProbe], dials: list[Dial] | None = None) -> list[C.CheckResult]:
    """Turn every host's probe outputs into check results (cross-host checks included)."""
    per: dict[str, dict[str, C.CheckResult]] = {h.name: {} for h in inv.hosts}
    outs = {h.name: o for h in inv.hosts if (o := probes[h.name].outputs) is not None}
    reachable = [h for h in inv.hosts if h.name in outs]
    for h in inv.hosts:
        p = probes[h.name]
        per[h.name]["ssh"] = p.ssh
        if p.outputs is None:
            for name in C.CHECKS[1:]:
                if (name == "ssh_peer" and not h.is_head) or (name == "ports" and not any(d.src == h.name
                                                                                          for d in dials or [])):
                    continue
                per[h.name][name] = C.CheckResult(h.name, name, C.SKIP, "host not reachable (see the ssh check)")
    image_ids: dict[str, str] = {}
    for h in reachable:
        o = outs[h.name]
        peers = [p for p in inv.hosts if p.name != h.name]
        r = per[h.name]
        r["docker"] = C.check_docker(h, o["docker_version"])
        r["image"] = C.check_image(h, o["image"], r["docker"].status == C.PASS)
        if r["image"].status == C.PASS:
            want = h.vars["vllm_image"].partition("@")[2]
            image_ids[h.name] = next(i.id for i in parse_image_inspect(o["image"].text) if want in i.digests())
        r["rail_link"] = C.check_rail_link(h, o["ibdev2netdev"])
        r["rail_ip"] = C.check_rail_ip(h, o["ip_addr"])
        r["link_speed"] = C.check_link_speed(h, o["ethtool"])
        r["jumbo_ping"] = C.check_jumbo_ping(h, o.get("ping"), peers) if peers else \
            C.CheckResult(h.name, "jumbo_ping", C.SKIP, "no peers")
        r["route"] = C.check_route(h, o.get("route"), peers) if peers else \
            C.CheckResult(h.name, "route", C.SKIP, "no peers")
        r["gid"] = C.check_gid(h, o["gids"])
        r["ntp"] = C.check_ntp(h, o["time"])
        r["disk"] = C.check_disk(h, o["df"], o["du"])
        gpus, health = _gpu_outputs(o["gpus"])
        r["gpu"] = C.check_gpu(h, gpus, _apps_output(o["gpu_pids"], gpus, health))
        r["gpu_health"] = C.check_gpu_health(h, health, o.get("dmesg"))
        v = _versions(o)
        r["gdr"] = C.check_gdr(h, o["gdr"], v.get("kernel"), _cluster_gpu_buses(h, gpus, health), v.get("nic_bus"))
        if h.is_head:
            r["ssh_peer"] = C.check_ssh_peer(h, o.get("ssh_peer"), inv.workers) if inv.workers else \
                C.CheckResult(h.name, "ssh_peer", C.SKIP, "no workers")
    for name, res in C.cross_image({h.name: per[h.name]["image"] for h in reachable}, image_ids,
                                   inv.head.vars["vllm_image"]).items():
        per[name]["image"] = res
    for name, res in C.check_mtu(reachable, {h.name: outs[h.name]["ip_link"] for h in reachable}).items():
        per[name]["mtu"] = res
    seen = {h.name: _versions(outs[h.name], h.vars["vllm_image"].partition("@")[2]) for h in reachable}
    for name, res in C.check_parity(reachable, seen).items():
        per[name]["parity"] = res
    C.one_cause(reachable, per, {h.name: outs[h.name].get("ping") for h in reachable})
    for name, res in C.check_clock_skew(reachable, {h.name: probes[h.name].clock for h in reachable}).items():
        per[name]["clock_skew"] = res
    listeners = {h.name: outs[h.name].get("ports") for h in reachable}
    offsets = {h.name: clock.offset_s for h in reachable if (clock := probes[h.name].clock)}
    for h in reachable:
        mine = [d for d in dials or [] if d.src == h.name]
        if mine:  # a row on each host that dials (the hosts it dials show their listener there)
            per[h.name]["ports"] = C.check_ports(h, mine, listeners[h.name], listeners, offsets)
    out = []
    for h in inv.hosts:
        for name in C.CHECKS:
            if name in per[h.name]:
                out.append(per[h.name][name])
    return out


def _gpu_outputs(out: Output) -> tuple[Output, Output]:
    """The one nvidia-smi answer as the gpu check's and the gpu_health check's outputs."""
    if out.rc is None or out.missing_tool:
        return out, out
    base, health = split_gpu_query(out.text)
    if health is None:
        return Output(out.rc, base), Output(0, C.HEALTH_UNSUPPORTED + "\n")
    return Output(out.rc, base), Output(out.rc, health)


def _cluster_gpu_buses(h: Host, gpus: Output, health: Output) -> list[str]:
    """The PCI addresses of the GPUs the cluster serves on (cluster_gpu_name): names from the gpu rows, addresses
    from the health rows (pci.bus_id); [] where either is missing."""
    try:
        names = {g.uuid: g.name for g in parse_gpus(gpus.text)} if gpus.ok else {}
        rows = parse_gpu_health(health.text) if health.ok else []
    except ValueError:
        return []
    want = h.vars["cluster_gpu_name"].lower()
    return [g.bus_id for g in rows if want in names.get(g.uuid, "").lower()]


def _apps_output(pids: Output, gpus: Output, health: Output) -> Output:
    """`nvidia-smi -q -d PIDS` as the compute-apps listing the gpu check reads (each process's GPU by UUID)."""
    if not pids.ok or pids.missing_tool:
        return pids
    try:
        smi = parse_smi_pids(pids.text)
    except ValueError:
        return Output(1, pids.text)  # not what nvidia-smi -q prints: the processes were not listed
    try:
        rows = parse_gpus(gpus.text) if gpus.ok else []
    except ValueError:
        rows = []
    try:
        bus = {g.uuid: g.bus_id for g in parse_gpu_health(health.text)} if health.ok else {}
    except ValueError:
        bus = {}
    return Output(0, compute_apps_csv(smi, rows, bus))


def _versions(o: dict[str, Output], pinned: str | None = None) -> dict[str, str | None]:
    """What parity compares, from the probe's outputs; the image's NCCL_VERSION from the image with the pinned
    digest (`pinned`: sha256:...) only."""
    v = parse_versions(o["versions"].text) if o.get("versions") and o["versions"].rc is not None else {}
    g = o.get("gdr")
    if g is not None and g.rc is not None:
        ibv = C._gdr_parts(g.text).get("ibv", "")
        try:
            v["hca_firmware"] = parse_ibv_devinfo(ibv).fw_ver
        except ValueError:
            pass
    h = _gpu_outputs(o["gpus"])[1] if o.get("gpus") is not None else None
    if h is not None and h.ok:
        try:
            drivers = sorted({g.driver for g in parse_gpu_health(h.text)})
            v["driver"] = ",".join(drivers) or None
        except ValueError:
            pass
    p = o.get("gpu_pids")
    if p is not None and p.ok:
        try:
            v["cuda"] = parse_smi_pids(p.text).cuda
        except ValueError:
            pass
    img = o.get("image")
    if img is not None and img.rc is not None and img.text:
        try:
            mine = next((i for i in parse_image_inspect(img.text) if pinned and pinned in i.digests()), None)
            if mine is not None:
                v["nccl"] = mine.env_value("NCCL_VERSION")
        except ValueError:
            pass
    return v


def run_preflight(inv: Inventory, on_host=None) -> list[C.CheckResult]:
    """on_host(name, HostProbe or Result), if given, hears of each host as its probe lands (a progress display)."""
    with Runner(inv.hosts) as runner:
        probes: dict[str, HostProbe] = {}
        for name, p in runner.each(lambda s: probe_host(s, inv), on_done=on_host).items():
            if isinstance(p, HostProbe):
                probes[name] = p
            else:  # a bug inside one host's probe: report it, keep the rest
                assert p.error is not None  # the runner's Result for a probe that raised carries the error
                h = inv.host(name)
                probes[name] = HostProbe(h, None, None, C.CheckResult(name, "ssh", C.FAIL, str(p.error), "",
                                                                      p.error.hint))
        # a host not reached, or whose rail is down or without its address, has its cause named by those
        # checks: no connection is tried to or from it
        railed = {n for n, p in probes.items() if p.outputs is not None
                  and C.check_rail_link(p.host, p.outputs["ibdev2netdev"]).status != C.FAIL
                  and C.check_rail_ip(p.host, p.outputs["ip_addr"]).status != C.FAIL}
        dials = [d for d in plan_dials(inv) if d.src in railed and d.dst in railed]
        port_round(runner, probes, dials)
    return evaluate(inv, probes, dials)


def port_round(runner: Runner, probes: dict[str, HostProbe], dials: list[Dial]) -> None:
    """The ports check's own round, on the hosts that answered: every host concerned at once, each one's
    listeners and dials in one command; its output goes beside the host's other probes as `ports`."""
    sections = {h.name: sec for h in runner.hosts if h.name in probes and (sec := ports_section(h, dials))}
    todo = [h for h in runner.hosts if h.name in sections]

    def one(s: Session) -> Output:
        sec = sections[s.host.name]
        token = new_token()
        r = s.run(joined_script([sec], token), timeout=sec.timeout + 10)
        return split_output(r.stdout, [sec], token)["ports"] if not r.error else Output(None, "")
    for name, out in runner.each(one, todo).items():
        outputs = probes[name].outputs
        assert outputs is not None  # the dials join only hosts whose probe answered (run_preflight's railed)
        outputs["ports"] = out if isinstance(out, Output) else Output(None, "")
