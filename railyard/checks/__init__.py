"""Preflight checks: pure functions (facts, vars) -> CheckResult. No I/O here.

Every result is {host, check, status, detail, evidence, hint}; status is pass, warn,
fail or skip. A fail always says what is wrong (detail), shows what the host printed
(evidence) and how to fix it (hint).
"""

from __future__ import annotations

import re
import statistics
from dataclasses import asdict, dataclass

from .. import facts as F
from ..inventory import Host
from ..facts.probe import Output, split_blocks

PASS, WARN, FAIL, SKIP = "pass", "warn", "fail", "skip"

CHECKS = ("ssh", "docker", "image", "rail_link", "rail_ip", "link_speed", "mtu", "jumbo_ping", "route",
          "gid", "ntp", "clock_skew", "disk", "gpu", "gpu_health", "gdr", "parity", "ssh_peer", "ports")


@dataclass(frozen=True)
class CheckResult:
    host: str
    check: str
    status: str
    detail: str
    evidence: str = ""
    hint: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


TOOL_HINTS = {
    "ibdev2netdev": "install the NVIDIA DOCA-Host / MLNX_OFED user tools (they ship ibdev2netdev)",
    "show_gids": "install the NVIDIA DOCA-Host / MLNX_OFED user tools (they ship show_gids)",
    "nvidia-smi": "install the NVIDIA driver utilities (nvidia-utils) or check the driver install",
    "docker": "install Docker Engine and the NVIDIA Container Toolkit",
    "timedatectl": "install systemd's timedatectl or chrony (chronyc tracking): preflight reads either",
    "dmesg": "apt-get install util-linux (dmesg)",
    "ethtool": "apt-get install ethtool",
    "ip": "apt-get install iproute2",
    "ping": "apt-get install iputils-ping",
    "ssh": "apt-get install openssh-client",
    "df": "coreutils is missing: the host is broken",
    "du": "coreutils is missing: the host is broken",
}


def _first_lines(text: str, n: int = 3) -> str:
    lines = [line.rstrip() for line in text.strip().splitlines() if line.strip()]
    return " | ".join(lines[:n])


def unusable(host: Host, check: str, out: Output | None, tool: str) -> CheckResult | None:
    """A fail for a probe that could not run: missing tool, timeout, no output."""
    if out is None or out.rc is None:
        return CheckResult(host.name, check, FAIL, f"`{tool}` gave no result (the probe was cut off)",
                           "", "rerun; if it repeats, run the command by hand on the host")
    if out.missing_tool:
        return CheckResult(host.name, check, FAIL, f"tool `{out.missing_tool}` not found on PATH", "",
                           TOOL_HINTS.get(out.missing_tool, f"install {out.missing_tool}"))
    if out.timed_out:
        return CheckResult(host.name, check, FAIL, f"`{tool}` did not finish within its timeout",
                           _first_lines(out.text), f"run `{tool}` by hand on {host.name}: something hangs")
    return None


# ---------------------------------------------------------------- docker / image

def check_docker(host: Host, out: Output) -> CheckResult:
    bad = unusable(host, "docker", out, "docker version")
    if bad:
        return bad
    v = F.parse_docker_version(out.text)
    if v.server:
        return CheckResult(host.name, "docker", PASS, f"daemon answers: server {v.server}, client {v.client}",
                           f"Server: Engine Version {v.server}")
    err = v.error or _first_lines(out.text, 2)
    if "permission denied" in err:
        hint = "add the SSH user to the docker group (sudo usermod -aG docker $USER), then log in again"
    else:
        hint = "start the daemon: sudo systemctl start docker (journalctl -u docker says why it stopped)"
    return CheckResult(host.name, "docker", FAIL, "no Server section: the Docker daemon is unreachable",
                       err, hint)


def check_image(host: Host, out: Output, docker_ok: bool) -> CheckResult:
    """One `docker image inspect IMAGE TAG` (the pinned reference and its tag): the pinned digest must be among
    the images found; when it is not, the tag's image (if any) is named."""
    image = host.vars["vllm_image"]
    if not docker_ok:
        return CheckResult(host.name, "image", SKIP, "Docker daemon unreachable (see the docker check)")
    bad = unusable(host, "image", out, "docker image inspect")
    if bad:
        return bad
    want = image.split("@", 1)[1]
    try:
        found = F.parse_image_inspect(out.text)
    except F.ParseError:
        found = []
    img = next((i for i in found if want in i.digests()), None)
    if img is not None:
        return CheckResult(host.name, "image", PASS, f"{_short(want)} present ({img.architecture}, id {_short(img.id)})",
                           f"RepoDigests {' '.join(img.repo_digests)}")
    tag = image.split("@", 1)[0]
    other = ""
    if found:  # the pinned one is missing, so what was found is the tag's image
        other = f"; {tag} here is {', '.join(_short(d) for d in sorted(found[0].digests())) or 'an unpinned build'}"
    errors = [line.strip() for line in out.text.splitlines() if "No such image" in line or "Error" in line]
    return CheckResult(host.name, "image", FAIL, f"pinned digest {_short(want)} not present{other}",
                       " | ".join(errors[:2]) or _first_lines(out.text, 2), f"docker pull {image}")


def _short(digest: str) -> str:
    algo, _, hexd = digest.partition(":")
    return f"{algo}:{hexd[:12]}" if hexd else digest[:19]


def cross_image(results: dict[str, CheckResult], ids: dict[str, str], image: str) -> dict[str, CheckResult]:
    """All ranks that have the image must have one and the same image id."""
    if len(set(ids.values())) > 1:
        ref_host = sorted(ids)[0]
        for h, i in ids.items():
            if i != ids[ref_host]:
                results[h] = CheckResult(h, "image", FAIL, f"image id {_short(i)} differs from {ref_host}'s "
                                         f"{_short(ids[ref_host])}", results[h].evidence,
                                         f"docker pull {image} on every host, and remove stale tags")
    return results


# ---------------------------------------------------------------- rails

def check_rail_link(host: Host, out: Output) -> CheckResult:
    bad = unusable(host, "rail_link", out, "ibdev2netdev")
    if bad:
        return bad
    rail = host.serve_rail
    rows = F.parse_ibdev2netdev(out.text)
    row = next((r for r in rows if r.hca == rail.hca), None)
    listing = " | ".join(r.line for r in rows) or out.text.strip()
    if row is None:
        return CheckResult(host.name, "rail_link", FAIL, f"{rail.hca} is not listed by ibdev2netdev", listing,
                           f"check the HCA name in the inventory (rails.{rail.name}.hca) against `ibdev2netdev`")
    if row.netdev != rail.name:
        return CheckResult(host.name, "rail_link", FAIL, f"{rail.hca} maps to {row.netdev}, not {rail.name}", row.line,
                           f"fix rails.{rail.name}.hca in the inventory, or rename the interface")
    if not row.up:
        return CheckResult(host.name, "rail_link", FAIL, f"{rail.hca} ==> {rail.name} is Down", row.line,
                           f"check the cable and transceiver of {rail.name}; `ip link set {rail.name} up`; "
                           f"`ethtool {rail.name}`")
    return CheckResult(host.name, "rail_link", PASS, f"{rail.hca} ==> {rail.name} Up", row.line)


def check_rail_ip(host: Host, out: Output) -> CheckResult:
    bad = unusable(host, "rail_ip", out, "ip -br addr")
    if bad:
        return bad
    rail = host.serve_rail
    addrs = F.parse_ip_br_addr(out.text)
    iface = addrs.get(rail.name)
    want = str(rail.ipv4)
    fix = f"ip addr add {want} dev {rail.name} (and make it persistent in netplan)"
    if iface is None:
        return CheckResult(host.name, "rail_ip", FAIL, f"no interface {rail.name}", _first_lines(out.text, 6),
                           f"check rails.{rail.name} in the inventory against `ip -br addr`")
    if want in iface.ipv4:
        return CheckResult(host.name, "rail_ip", PASS, f"{rail.name} has {want}", iface.line)
    same_ip = [a for a in iface.ipv4 if a.split("/")[0] == rail.ip]
    if same_ip:
        return CheckResult(host.name, "rail_ip", FAIL, f"{rail.name} has {same_ip[0]}, expected prefix /{rail.ipv4.network.prefixlen}",
                           iface.line, fix)
    have = ", ".join(iface.ipv4) or "no IPv4 address"
    return CheckResult(host.name, "rail_ip", FAIL, f"{rail.name} has {have}, expected {want}", iface.line, fix)


def check_link_speed(host: Host, out: Output) -> CheckResult:
    bad = unusable(host, "link_speed", out, "ethtool")
    if bad:
        return bad
    rail = host.serve_rail
    want = host.vars["preflight_link_speed_mbps"]
    e = F.parse_ethtool(out.text)
    ev = f"Speed: {e.speed_text or '?'}; Link detected: {'yes' if e.link_detected else 'no' if e.link_detected is False else '?'}"
    if e.link_detected is False:
        return CheckResult(host.name, "link_speed", FAIL, f"{rail.name}: no link detected", ev,
                           f"check the cable and transceiver of {rail.name} and the peer's port")
    if e.speed_mbps is None:
        return CheckResult(host.name, "link_speed", FAIL, f"{rail.name}: speed unknown", ev,
                           f"`ethtool {rail.name}` as root; check the link partner")
    if e.speed_mbps < want:
        return CheckResult(host.name, "link_speed", FAIL, f"{rail.name} runs at {e.speed_mbps}Mb/s, expected >= {want}Mb/s",
                           ev, "check the cable/transceiver rating and the negotiated mode (`ethtool`), reseat or replace")
    return CheckResult(host.name, "link_speed", PASS, f"{rail.name} {e.speed_mbps}Mb/s, link detected", ev)


def check_mtu(hosts: list[Host], outs: dict[str, Output]) -> dict[str, CheckResult]:
    res: dict[str, CheckResult] = {}
    seen: dict[str, int] = {}
    for h in hosts:
        out = outs.get(h.name)
        bad = unusable(h, "mtu", out, "ip -o link")
        if bad:
            res[h.name] = bad
            continue
        assert out is not None  # unusable() fails a missing output
        link = F.parse_ip_link(out.text).get(h.serve_rail.name)
        if link is None:
            res[h.name] = CheckResult(h.name, "mtu", FAIL, f"no interface {h.serve_rail.name}", _first_lines(out.text))
            continue
        seen[h.name] = link.mtu
        want = h.vars["preflight_mtu"]
        if link.mtu != want:
            res[h.name] = CheckResult(h.name, "mtu", FAIL, f"{link.name} mtu {link.mtu}, expected {want}", link.line,
                                      f"ip link set dev {link.name} mtu {want} (and persist it in netplan)")
        else:
            res[h.name] = CheckResult(h.name, "mtu", PASS, f"{link.name} mtu {link.mtu}", link.line)
    if len(set(seen.values())) > 1:
        listing = ", ".join(f"{n}={m}" for n, m in seen.items())
        for name, r in res.items():
            if r.status == PASS:
                res[name] = CheckResult(name, "mtu", PASS, f"{r.detail} (not equal on all hosts: {listing})", r.evidence)
    return res


JUMBO_MARK = "@@jumbo"


def _mtu_error(line: str) -> bool:
    low = line.lower()
    return "too long" in low or "frag needed" in low


def _ping_pair(text: str) -> tuple[str | None, str]:
    """A peer's block: the small warm-up ping, the marker, the jumbo ping (an older block is all jumbo)."""
    if JUMBO_MARK in text:
        small, _, jumbo = text.partition(JUMBO_MARK)
        return small, jumbo
    return None, text


def jumbo_frames_lost(out: Output | None, ip: str) -> bool:
    """Whether every jumbo ping to ip went unanswered (an MTU black hole or a dead path): an ssh to it that
    hung then has its cause in view, and waiting for it longer shows nothing new."""
    if out is None:
        return False
    _small, text = _ping_pair(split_blocks(out.text).get(ip, (None, ""))[1])
    try:
        ping = F.parse_ping(text)
    except F.ParseError:
        return False
    return ping.transmitted > 0 and ping.received == 0


def check_jumbo_ping(host: Host, out: Output | None, peers: list[Host]) -> CheckResult:
    bad = unusable(host, "jumbo_ping", out, "ping")
    if bad:
        return bad
    assert out is not None  # unusable() fails a missing output
    if not peers:
        return CheckResult(host.name, "jumbo_ping", SKIP, "no peers")
    size = host.vars["preflight_mtu"] - 28
    blocks = split_blocks(out.text)
    fails, oks, lossy, evidence = [], [], [], []
    mtu_errors = False
    for p in peers:
        ip = p.serve_rail.ip
        rc, text = blocks.get(ip, (None, ""))
        _small, text = _ping_pair(text)
        try:
            ping = F.parse_ping(text)
        except F.ParseError:
            fails.append(f"{p.name} {ip}: {_first_lines(text, 2) or 'no answer'}")
            continue
        if ping.received == ping.transmitted and ping.transmitted > 0:
            oks.append(f"{p.name} {ping.received}/{ping.transmitted}" + (f" {ping.rtt_avg_ms:.2f}ms" if ping.rtt_avg_ms else ""))
        elif ping.received > 0 and not any(_mtu_error(e) for e in ping.local_errors):
            # jumbo frames do pass; losing some of them is worth a look but is not an MTU fault
            why = f" ({ping.local_errors[0]})" if ping.local_errors else ""
            lossy.append(f"{p.name} {ip}: {ping.received}/{ping.transmitted} received{why}")
            evidence.append(ping.summary)
        else:
            mtu_errors |= any(_mtu_error(e) for e in ping.local_errors)
            why = f" ({ping.local_errors[0]})" if ping.local_errors else ""
            fails.append(f"{p.name} {ip}: {ping.received}/{ping.transmitted} received{why}")
            evidence.append(ping.summary)
    rail = host.serve_rail.name
    if fails:
        if mtu_errors:
            hint = (f"an MTU below {host.vars['preflight_mtu']} on the path: compare `ip link show {rail}` on both "
                    f"ends (mtu check) and any switch in between")
        else:
            hint = (f"the peer does not answer over {rail}: check rail_link, rail_ip and mtu on both ends; "
                    f"a smaller MTU on the receiving side drops jumbo frames silently")
        return CheckResult(host.name, "jumbo_ping", FAIL,
                           f"{size}-byte unfragmented ping over {rail} fails to " + "; ".join(fails),
                           " | ".join(e for e in evidence if e), hint)
    if lossy:
        return CheckResult(host.name, "jumbo_ping", WARN,
                           f"{size}-byte frames pass over {rail}, with loss to " + "; ".join(lossy),
                           " | ".join(e for e in evidence if e),
                           f"rerun preflight; persistent loss points at the cable, transceiver or a congested {rail}")
    return CheckResult(host.name, "jumbo_ping", PASS, f"{size} bytes, DF set, over {rail} to " + ", ".join(oks),
                       f"ping -I {rail} -M do -s {size}")


def check_route(host: Host, out: Output | None, peers: list[Host]) -> CheckResult:
    bad = unusable(host, "route", out, "ip route get")
    if bad:
        return bad
    assert out is not None  # unusable() fails a missing output
    rail = host.serve_rail.name
    routes = {r.dest: r for r in F.parse_route_get(out.text)}
    wrong, good = [], []
    for p in peers:
        ip = p.serve_rail.ip
        r = routes.get(ip)
        if r is None:
            wrong.append(f"{ip}: no route")
        elif r.dev != rail:
            wrong.append(f"{ip} leaves by {r.dev}" + (f" via {r.via}" if r.via else ""))
        else:
            good.append(r.line)
    if wrong:
        return CheckResult(host.name, "route", FAIL, "; ".join(wrong), " | ".join(r.line for r in routes.values()),
                           f"the peers' rail addresses must be on-link on {rail}: check `ip route` and "
                           f"the address/prefix of {rail}")
    return CheckResult(host.name, "route", PASS if peers else SKIP,
                       f"{len(good)} peer(s) leave by {rail}" if peers else "no peers", " | ".join(good[:3]))


def check_gid(host: Host, out: Output) -> CheckResult:
    bad = unusable(host, "gid", out, "show_gids")
    if bad:
        return bad
    rail = host.serve_rail
    gids = F.parse_show_gids(out.text)
    index = F.roce_v2_index(gids, rail.hca, rail.ip)
    rows = [g for g in gids if g.dev == rail.hca]
    listing = " | ".join(f"{g.index} {g.ipv4 or '-'} {g.ver}" for g in rows) or "no GIDs"
    if index is None:
        v1 = [g for g in rows if g.ipv4 == rail.ip]
        why = "only RoCE v1 entries" if v1 else "the address is not in the GID table"
        return CheckResult(host.name, "gid", FAIL, f"no RoCE v2 GID for {rail.ip} on {rail.hca} ({why})", listing,
                           f"put {rail.ipv4} on {rail.name} (rail_ip check) and make sure RoCE v2 is enabled "
                           f"(cma_roce_mode); NCCL_IB_GID_INDEX cannot be set without it")
    pinned = host.vars["preflight_gid_index"]
    if pinned >= 0 and pinned != index:
        return CheckResult(host.name, "gid", FAIL, f"RoCE v2 GID index for {rail.ip} is {index}, inventory expects {pinned}",
                           listing, f"set preflight_gid_index: {index} (or -1 to discover), and NCCL_IB_GID_INDEX={index}")
    return CheckResult(host.name, "gid", PASS, f"RoCE v2 GID index {index} for {rail.ip} on {rail.hca}",
                       f"{rail.hca} {index} {rail.ip} v2")


# ---------------------------------------------------------------- one cause, one message

def _silent_losses(hosts: list[Host], pings: dict[str, Output | None]) -> dict[tuple[str, str], bool | None]:
    """(host, peer) -> whether small pings passed, for every pair whose jumbo frames were all lost without a local
    error (the sender's own MTU did not refuse them: they vanished on the path or at the receiver)."""
    lost: dict[tuple[str, str], bool | None] = {}
    for h in hosts:
        out = pings.get(h.name)
        if out is None or out.rc is None:
            continue
        blocks = split_blocks(out.text)
        for p in hosts:
            if p.name == h.name or p.serve_rail.ip not in blocks:
                continue
            small, jumbo = _ping_pair(blocks[p.serve_rail.ip][1])
            try:
                j = F.parse_ping(jumbo)
            except F.ParseError:
                continue
            if j.transmitted and not j.received and not j.local_errors:
                try:
                    s = F.parse_ping(small) if small is not None else None
                except F.ParseError:
                    s = None
                lost[(h.name, p.name)] = (s.received > 0) if s else None
    return lost


def one_cause(hosts: list[Host], per: dict[str, dict[str, CheckResult]], pings: dict[str, Output | None]) -> None:
    """When several checks fail for one reason, name the likely cause once and point the others at it: jumbo
    frames lost to a host whose own MTU is wrong (the mtu check names it), or lost on the path while small frames
    pass and both ends are set right (an MTU black hole: a switch port, cable or VLAN below the rails' MTU), and an
    ssh over the rail that hangs for the same reason."""
    lost = _silent_losses(hosts, pings)
    if not lost:
        return
    by = {h.name: h for h in hosts}
    mtu_bad = {n for n in per if per[n].get("mtu") is not None and per[n]["mtu"].status == FAIL}
    notes: dict[str, list[str]] = {}
    owner_hint: dict[str, str] = {}
    blackhole = {frozenset(k) for k, small in lost.items() if small and not (set(k) & mtu_bad)}
    hub = None
    if len(blackhole) > 1:
        common = set.intersection(*(set(pr) for pr in blackhole))
        hub = min(common) if common else None
    for pair in sorted(blackhole, key=sorted):
        a, b = sorted(pair)
        owner = hub or a
        mtu = by[a].vars["preflight_mtu"]
        where = f"on the path to {hub}'s rail" if hub else f"between {a} and {b}"
        if owner not in notes:
            notes[owner] = [f"likely cause: an MTU black hole {where}: {mtu - 28}-byte frames are lost while small "
                            f"pings pass, and both ends are set to mtu {mtu} (a switch port, cable or VLAN on the path "
                            f"is below {mtu})"]
            owner_hint[owner] = (f"find the hop that drops them: `tracepath -n {by[b if owner == a else a].serve_rail.ip}` "
                                 f"from {owner}; set every switch port on the rail to MTU >= {mtu + 216} (jumbo)")
        for n in (a, b):
            if n != owner and not any("MTU black hole" in x for x in notes.get(n, [])):
                notes.setdefault(n, []).append(f"likely cause: the MTU black hole named on {owner}'s jumbo_ping")
    for h, p in lost:
        bad = sorted({h, p} & mtu_bad)
        if bad and bad[0] != h:  # a host whose own MTU is wrong already says so in its mtu and jumbo_ping checks
            note = f"likely cause: {bad[0]}'s MTU ({per[bad[0]]['mtu'].detail}; see {bad[0]}'s mtu check)"
            if note not in notes.setdefault(h, []):
                notes[h].append(note)
    for n, ns in notes.items():
        r = per[n].get("jumbo_ping")
        if r is not None and r.status == FAIL and ns:
            per[n]["jumbo_ping"] = CheckResult(n, "jumbo_ping", FAIL, f"{r.detail}; {'; '.join(ns)}", r.evidence,
                                               owner_hint.get(n, r.hint))
    for n, checks in per.items():
        r = checks.get("ssh_peer")
        if r is None or r.status != FAIL or "ssh hung" not in r.detail:
            continue
        hung = [w for w in hosts if f"{w.name} (" in r.detail and frozenset((n, w.name)) in blackhole]
        if hung:
            owner = hub or min(n, hung[0].name)
            checks["ssh_peer"] = CheckResult(n, "ssh_peer", FAIL, f"{r.detail}; likely cause: the MTU black hole "
                                             f"named on {owner}'s jumbo_ping, not SSH", r.evidence,
                                             "fix the path MTU (jumbo_ping), then rerun")


# ---------------------------------------------------------------- time

CHRONY_MARK = "@@chronyc"


def check_ntp(host: Host, out: Output) -> CheckResult:
    bad = unusable(host, "ntp", out, "timedatectl")
    if bad:
        return bad
    if CHRONY_MARK in out.text:  # no (working) timedatectl: the section fell back to `chronyc tracking`
        return _check_chrony(host, out.text.split(CHRONY_MARK, 1)[1])
    st = F.parse_timedatectl(out.text)
    if st.synchronized is None:
        return CheckResult(host.name, "ntp", FAIL, "cannot read the NTP state", _first_lines(out.text, 2),
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
        t = F.parse_chrony_tracking(text)
    except F.ParseError:
        return CheckResult(host.name, "ntp", FAIL, "chronyc tracking gave no tracking data", _first_lines(text, 2),
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


@dataclass(frozen=True)
class ClockSample:
    offset_s: float  # remote clock minus control clock, at the midpoint of the round trip
    uncertainty_s: float


def check_clock_skew(hosts: list[Host], samples: dict[str, ClockSample | None]) -> dict[str, CheckResult]:
    """Compare every host's clock against the others (and this machine's), through one round trip each."""
    limit = hosts[0].vars["preflight_max_clock_skew_ms"] / 1000 if hosts else 0.5
    have = {n: s for n, s in samples.items() if s is not None}
    res: dict[str, CheckResult] = {}
    if not have:
        return res
    if len(hosts) < 2:  # a clock compared with nothing but this machine's proves nothing about the ranks
        return {h.name: CheckResult(h.name, "clock_skew", SKIP, "one host: no other clock to compare with "
                                    "(the ntp check covers its own time)") for h in hosts}
    ref = statistics.median([0.0] + [s.offset_s for s in have.values()])
    spread = max(s.offset_s for s in have.values()) - min(s.offset_s for s in have.values())
    for h in hosts:
        s = samples.get(h.name)
        if s is None:
            res[h.name] = CheckResult(h.name, "clock_skew", FAIL, "could not read the clock", "",
                                      "run `date` on the host")
            continue
        dev = s.offset_s - ref
        u = s.uncertainty_s  # the sample is known to half its round trip: a skew counts only beyond it
        ev = f"offset {s.offset_s * 1000:+.1f} ms vs this machine (±{u * 1000:.1f} ms)"
        if spread > limit and abs(dev) - u > limit / 2:
            res[h.name] = CheckResult(h.name, "clock_skew", FAIL,
                                      f"clock {abs(dev):.3f} s {'ahead of' if dev > 0 else 'behind'} the others "
                                      f"(spread {spread:.3f} s > {limit:.3f} s)", ev,
                                      "fix NTP on this host (ntp check) and step the clock: sudo chronyc makestep "
                                      "or restart systemd-timesyncd")
        elif spread > limit and abs(dev) + u > limit / 2:  # neither shown skewed nor shown within the limit
            res[h.name] = CheckResult(h.name, "clock_skew", WARN,
                                      f"not measured closely enough: {abs(dev) * 1000:.0f} ms from the others, "
                                      f"±{u * 1000:.0f} ms (the round trip's half)", ev,
                                      "run inv preflight again on a less loaded controller; compare `date +%s.%N` "
                                      "on the hosts")
        else:
            res[h.name] = CheckResult(h.name, "clock_skew", PASS,
                                      f"within {abs(dev) * 1000:.1f} ms of the others (spread {spread * 1000:.1f} ms)", ev)
    return res


# ---------------------------------------------------------------- disk / gpu

def check_disk(host: Host, df: Output, du: Output) -> CheckResult:
    bad = unusable(host, "disk", df, "df")
    if bad:
        return bad
    try:
        d = F.parse_df(df.text)
    except F.ParseError:
        return CheckResult(host.name, "disk", FAIL, "cannot read `df`", _first_lines(df.text, 2), "run `df -h` on the host")
    size = int(host.vars["model_size_gb"] * 1e9)
    margin = int(host.vars["preflight_disk_margin_gb"] * 1e9)
    present = F.parse_du(du.text) if du and du.ok else None
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


def check_gpu(host: Host, gpus_out: Output, apps_out: Output) -> CheckResult:
    bad = unusable(host, "gpu", gpus_out, "nvidia-smi")
    if bad:
        return bad
    selector = host.vars["cluster_gpu_name"]
    if gpus_out.rc != 0 or "No devices were found" in gpus_out.text:
        return CheckResult(host.name, "gpu", FAIL, "nvidia-smi found no GPU", _first_lines(gpus_out.text, 2),
                           "is the NVIDIA driver loaded? `nvidia-smi`, `dmesg | grep -i nvrm`")
    try:
        gpus = F.parse_gpus(gpus_out.text)
    except F.ParseError as e:
        return CheckResult(host.name, "gpu", FAIL, f"cannot read nvidia-smi: {e}", _first_lines(gpus_out.text, 2))
    chosen = F.select_gpu(gpus, selector)
    listing = "; ".join(f"{g.index}: {g.name}" for g in gpus)
    if not chosen:
        return CheckResult(host.name, "gpu", FAIL, f"no GPU matches {selector!r}", listing,
                           f"check cluster_gpu_name against `nvidia-smi -L`; is the {selector} visible to the driver?")
    try:
        apps = F.parse_compute_apps(apps_out.text) if apps_out and apps_out.ok else []
    except F.ParseError:
        apps = []
    uuids = {g.uuid for g in chosen}
    busy = [a for a in apps if a.gpu_uuid in uuids]
    names = ", ".join(f"{g.name} {g.uuid}" for g in chosen)
    if apps_out is None or not apps_out.ok:
        return CheckResult(host.name, "gpu", FAIL, f"{names}: cannot list compute processes",
                           _first_lines(apps_out.text if apps_out else "", 2), "run `nvidia-smi` on the host")
    if busy:
        procs = "; ".join(f"pid {a.pid} {a.name} holds {a.used_mib} MiB" for a in busy)
        return CheckResult(host.name, "gpu", FAIL, f"{chosen[0].name} {chosen[0].uuid} is busy: {procs}", names,
                           "stop that process (or the container holding it: `docker ps`), then check `nvidia-smi` again")
    used = ", ".join(f"{g.memory_used_mib} MiB used of {g.memory_total_mib}" for g in chosen)
    return CheckResult(host.name, "gpu", PASS, f"{names} idle ({used})", listing)


# ---------------------------------------------------------------- GPU health

# Xid codes an application usually causes (an illegal address, a kernel stopped): worth a look, not a drained node.
APP_XIDS = {13, 31, 43, 45}
XID_FIX = {48: "uncorrectable ECC (DBE)", 63: "page retirement / row remap recorded", 64: "page retirement / row "
           "remap failed", 74: "NVLink error", 79: "GPU fell off the bus", 92: "high single-bit ECC rate",
           94: "contained ECC error", 95: "uncontained ECC error", 109: "context switch timeout",
           119: "GSP timeout", 120: "GSP error"}
DRAIN = ("drain the host (inv stop), then reset the GPU (sudo nvidia-smi -r -i {idx}, or reboot) so the pending "
         "repair applies; if uncorrectable errors come back, RMA the GPU")


HEALTH_UNSUPPORTED = "@@health-fields-unsupported"


def check_gpu_health(host: Host, health_out: Output, dmesg_out: Output | None) -> CheckResult:
    """Uncorrectable ECC since the driver loaded, pending page retirement / row remapping, a failed remap, and
    Xid errors in the kernel log since boot, for the cluster GPUs. A pass needs both sources read."""
    bad = unusable(host, "gpu_health", health_out, "nvidia-smi")
    if bad:
        return bad
    if HEALTH_UNSUPPORTED in health_out.text:
        return CheckResult(host.name, "gpu_health", WARN, "this driver's nvidia-smi does not report the ECC / "
                           "retired-page / row-remap fields: GPU health not read",
                           "nvidia-smi --query-gpu=...,remapped_rows.pending: not a valid field",
                           "update the NVIDIA driver, or read `nvidia-smi -q -d ECC,PAGE_RETIREMENT` by hand")
    if health_out.rc != 0 or "No devices were found" in health_out.text:
        return CheckResult(host.name, "gpu_health", FAIL, "nvidia-smi could not report GPU health",
                           _first_lines(health_out.text, 2), "`nvidia-smi -q -d ECC,PAGE_RETIREMENT,ROW_REMAPPER`")
    try:
        gpus = F.parse_gpu_health(health_out.text)
    except F.ParseError as e:
        return CheckResult(host.name, "gpu_health", FAIL, f"cannot read nvidia-smi: {e}", _first_lines(health_out.text, 2))
    fails: list[str] = []
    warns: list[str] = []
    ev: list[str] = []
    for g in gpus:
        tag = f"GPU {g.index} {g.uuid}"
        if g.ecc_uncorrected_volatile:
            fails.append(f"{tag}: {g.ecc_uncorrected_volatile} uncorrectable ECC error(s) since the driver loaded")
        if g.remapped_rows_failure:
            fails.append(f"{tag}: row remapping failed (no spare rows left)")
        if g.remapped_rows_pending:
            fails.append(f"{tag}: row remapping pending (applies at the next GPU reset)")
        if g.retired_pages_pending:
            fails.append(f"{tag}: page retirement pending (applies at the next GPU reset)")
        ev.append(f"{g.index}: ecc.uncorrected.volatile={_na(g.ecc_uncorrected_volatile)} "
                  f"aggregate={_na(g.ecc_uncorrected_aggregate)} retired_pages.pending={_na(g.retired_pages_pending)} "
                  f"remapped_rows.pending={_na(g.remapped_rows_pending)} failure={_na(g.remapped_rows_failure)}")
    kernel_read = False
    if dmesg_out is not None and dmesg_out.rc == 0 and not dmesg_out.missing_tool:
        kernel_read = True
        for x in F.parse_xids(dmesg_out.text):
            hit = next((g for g in gpus if F.pci_matches(x.pci, g.bus_id)), None)
            tag = f"GPU {hit.index} ({x.pci})" if hit else f"PCI {x.pci}"
            what = XID_FIX.get(x.code, x.text[:80])
            (warns if x.code in APP_XIDS else fails).append(f"{tag}: Xid {x.code} since boot ({what})")
            ev.append(x.line[:200])
    fails, warns = list(dict.fromkeys(fails)), list(dict.fromkeys(warns))
    idx = ",".join(str(g.index) for g in gpus) or "N"
    if fails:
        hw = any("remapping failed" in f or "Xid 79" in f for f in fails)
        hint = DRAIN.format(idx=idx) if not hw else \
            "drain the host and RMA the GPU (row remap failure or fallen off the bus); reseat/power-cycle first for Xid 79"
        return CheckResult(host.name, "gpu_health", FAIL, "; ".join(fails[:4]) + ("; ..." if len(fails) > 4 else ""),
                           " | ".join(ev[:6]), hint)
    if not kernel_read:
        if dmesg_out is None or dmesg_out.rc is None:
            why = "dmesg gave no result"
        elif dmesg_out.missing_tool:
            why = f"`{dmesg_out.missing_tool}` not found"
        else:
            why = _first_lines(dmesg_out.text, 1) or f"dmesg exit {dmesg_out.rc}"
        return CheckResult(host.name, "gpu_health", WARN, f"{len(gpus)} GPU(s) without ECC or remap faults; the kernel "
                           f"log could not be read for Xid errors ({why})", " | ".join(ev[:6]),
                           "allow the preflight user to read it: sudo sysctl kernel.dmesg_restrict=0, or add it to the "
                           "adm group (journalctl -k); then rerun")
    if warns:
        return CheckResult(host.name, "gpu_health", WARN, "; ".join(warns[:4]), " | ".join(ev[:6]),
                           "application-caused Xids (illegal address, kernel stopped): check the job that ran; "
                           "reset the GPU if they repeat with a known-good workload")
    return CheckResult(host.name, "gpu_health", PASS, f"{len(gpus)} GPU(s): no uncorrectable ECC, no pending retirement "
                       "or remap, no Xid since boot", " | ".join(ev[:4]))


def _na(v) -> str:
    return "N/A" if v is None else ("Yes" if v is True else "No" if v is False else str(v))


# ---------------------------------------------------------------- GPUDirect RDMA readiness

def _gdr_parts(text: str) -> dict[str, str]:
    parts: dict[str, list[str]] = {}
    cur = None
    for line in text.splitlines():
        if line.startswith("@@gdr "):
            cur = line[6:].strip()
            parts[cur] = []
        elif cur is not None:
            parts[cur].append(line)
    return {k: "\n".join(v) for k, v in parts.items()}


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
    devs, denied, with_paths = F.parse_lspci_devices(lspci)
    downs = [d for d in devs.values() if d.port == "Downstream Port"]
    if denied and not any(d.acsctl is not None for d in devs.values()):
        return [], ["PCI capabilities hidden (lspci not run as root): ACS not read"], [
            "run preflight as root (ansible_user: root) to read ACS, or check by hand: "
            "sudo lspci -vvv | grep -E 'Downstream Port|ACSCtl'"], []
    try:
        found = [devs.get(F.pci_bdf(b)) for b in gpu_buses or []]
        nic = devs.get(F.pci_bdf(nic_bus)) if nic_bus else None
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
    p = _gdr_parts(out.text)
    fails, warns, hints, ev = [], [], [], []
    mods = F.parse_modules(p.get("modules", ""))
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
            info = F.parse_ibv_devinfo(ibv)
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
        except F.ParseError:
            fails.append(f"ibv_devinfo -d {rail.hca} gave no device: {_first_lines(ibv, 1)}")
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
    (src1, err1), (src, err2) = F.parse_rail_counters(p.get("stats1", "")), F.parse_rail_counters(p.get("stats2", ""))
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


# ---------------------------------------------------------------- parity across ranks

PARITY_WHAT = {"driver": "NVIDIA driver", "cuda": "driver CUDA version", "kernel": "kernel",
               "nic_firmware": "rail NIC firmware", "hca_firmware": "rail HCA firmware (ibv_devinfo)",
               "nic_driver": "rail NIC driver", "ofed": "OFED/DOCA", "nccl": "image NCCL_VERSION"}
UNSEEN_IS_ANOTHER_CHECKS = {"nccl"}  # read from the pinned image, which the image check requires on every host
PARITY_FIX = {"driver": "install the same NVIDIA driver on every rank (a mismatch is a classic hang at NCCL init)",
              "cuda": "install the same NVIDIA driver on every rank: the CUDA version nvidia-smi shows is the "
                      "driver's (its libcuda), and a rank whose driver CUDA is older than the image's CUDA fails "
                      "at init",
              "nccl": "run one image on every rank: docker pull the pinned vllm_image everywhere (the image check "
                      "names the odd one)",
              "kernel": "boot every rank into the same kernel (and its matching driver modules)",
              "nic_firmware": "flash the same ConnectX firmware on every rank (mlxfwmanager / mstflint)",
              "hca_firmware": "flash the same ConnectX firmware on every rank (mlxfwmanager / mstflint)",
              "nic_driver": "install the same mlx5 driver (DOCA-Host / MLNX_OFED) on every rank",
              "ofed": "install the same DOCA-Host / MLNX_OFED release on every rank"}


def check_parity(hosts: list[Host], seen: dict[str, dict[str, str | None]]) -> dict[str, CheckResult]:
    """Driver and its CUDA version, kernel, rail NIC firmware/driver, OFED/DOCA and the image's NCCL_VERSION (where
    the image sets it) compared across the ranks: every difference named host by host. One host: skip. The image
    itself is compared by the image check."""
    if len(hosts) < 2:
        return {h.name: CheckResult(h.name, "parity", SKIP, "one host: nothing to compare") for h in hosts}
    res: dict[str, CheckResult] = {}
    diffs: dict[str, list[tuple[str, str]]] = {h.name: [] for h in hosts}
    keys = [k for k in PARITY_WHAT if any(seen.get(h.name, {}).get(k) for h in hosts)]
    for k in keys:
        vals = {h.name: seen.get(h.name, {}).get(k) or "not found" for h in hosts}
        if k in UNSEEN_IS_ANOTHER_CHECKS:  # e.g. no pinned image on a host: the image check says so, once
            vals = {n: v for n, v in vals.items() if v != "not found"}
        if len(set(vals.values())) < 2:
            continue
        counts: dict[str, int] = {}
        for v in vals.values():
            counts[v] = counts.get(v, 0) + 1
        common = max(counts, key=lambda v: (counts[v], v != "not found"))
        listing = ", ".join(f"{n} {v}" for n, v in vals.items())
        for n, v in vals.items():
            if v != common or counts[v] == len(vals) - counts[v]:  # a 1:1 split: both sides are named
                diffs[n].append((k, f"{PARITY_WHAT[k]} {v} (others: {listing})"))
    for h in hosts:
        mine = seen.get(h.name, {})
        have = ", ".join(f"{PARITY_WHAT[k]} {mine[k]}" for k in keys if mine.get(k))
        if diffs[h.name]:
            res[h.name] = CheckResult(h.name, "parity", FAIL, "; ".join(d for _, d in diffs[h.name]), have,
                                      "; ".join(dict.fromkeys(PARITY_FIX[k] for k, _ in diffs[h.name])))
        elif not keys:
            res[h.name] = CheckResult(h.name, "parity", WARN, "no versions could be read", "",
                                      "check nvidia-smi, uname and ethtool -i on the hosts")
        else:
            res[h.name] = CheckResult(h.name, "parity", PASS, f"same as the other {len(hosts) - 1} rank(s): {have}", have)
    return res


# ---------------------------------------------------------------- ssh from the head

def check_ssh_peer(head: Host, out: Output | None, workers: list[Host]) -> CheckResult:
    bad = unusable(head, "ssh_peer", out, "ssh")
    if bad:
        return bad
    assert out is not None  # unusable() fails a missing output
    if not workers:
        return CheckResult(head.name, "ssh_peer", SKIP, "no workers")
    blocks = split_blocks(out.text)
    oks, evidence = [], []
    failed: dict[str, list[str]] = {}   # what went wrong -> the peers it went wrong for: each named once, grouped
    hints: dict[str, str] = {}          # one hint per kind, its first peer as the example
    for w in workers:
        ip = w.serve_rail.ip
        rc, text = blocks.get(ip, (None, ""))
        target = f"{w.user + '@' if w.user else ''}{ip}"
        if rc == 0:
            oks.append(f"{w.name} ({target}) answers as {text.strip() or '?'}")
            continue
        if _first_lines(text, 2) not in evidence:
            evidence.append(_first_lines(text, 2))
        if "Host key verification failed" in text or "REMOTE HOST IDENTIFICATION HAS CHANGED" in text:
            kind = "host key not trusted"
            hint = (f"on {head.name}: compare `ssh-keyscan -t ed25519 {ip} | ssh-keygen -lf -` with "
                    f"`ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub` on {w.name}, then add the key to ~/.ssh/known_hosts")
        elif "Permission denied" in text:
            kind = "key not accepted"
            hint = f"on {head.name}: ssh-keygen -t ed25519 (no passphrase), then ssh-copy-id {target}"
        elif rc == 255 and "during banner exchange" in text:
            kind = "no answer in time (sshd's banner; asked twice)"
            hint = (f"is {w.name} overloaded, or is its rail address {ip} filtered? `ssh -vvv {target} true` from "
                    f"{head.name}")
        elif rc == 124:
            kind = "ssh hung, no answer within its limit (asked twice)"
            hint = (f"something on the path to {ip} drops larger packets (see jumbo_ping), or sshd on {w.name} "
                    f"hangs: `ssh -vvv {target} true` from {head.name}")
        else:
            kind = "unreachable"
            hint = f"is sshd on {w.name} listening on its rail address {ip}?"
        failed.setdefault(kind, []).append(f"{w.name} ({target})")
        hints.setdefault(kind, hint)
    if failed:
        parts = [(f"{len(names)} peers: " if len(names) > 3 else "") + ", ".join(names) + f": {kind}"
                 for kind, names in failed.items()]
        hint = "; ".join(hints[k] + (f" (and likewise for the {len(failed[k]) - 1} other(s))" if len(failed[k]) > 1
                                     else "") for k in failed)
        return CheckResult(head.name, "ssh_peer", FAIL, f"{head.name} cannot ssh non-interactively to " + "; ".join(parts),
                           " | ".join(e for e in evidence if e), hint)
    return CheckResult(head.name, "ssh_peer", PASS, f"{head.name} -> " + ", ".join(oks), "ssh -o BatchMode=yes")


# ---------------------------------------------------------------- ports

@dataclass(frozen=True)
class PortLine:
    """One line of scripts/port_probe.py: a listener's or a dial's outcome, its times on that host's clock."""
    status: str
    detail: str  # a listener: the peers that connected; a dial: its tries
    start: float
    end: float


def parse_port_probe(text: str) -> tuple[dict[tuple[str, int], PortLine], dict[tuple[str, int], PortLine]]:
    """`listen|dial ADDR PORT STATUS DETAIL START END` lines -> (listeners, dials), by (address, port)."""
    listens: dict[tuple[str, int], PortLine] = {}
    dials: dict[tuple[str, int], PortLine] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) != 7 or parts[0] not in ("listen", "dial") or not parts[2].isdigit():
            continue
        try:
            item = PortLine(parts[3], parts[4], float(parts[5]), float(parts[6]))
        except ValueError:
            continue
        (listens if parts[0] == "listen" else dials)[(parts[1], int(parts[2]))] = item
    return listens, dials


PORT_FAILURES = {
    "timeout": "no answer (the SYN was dropped: a firewall on {dst} or on the path)",
    "refused": "refused while {dst} listened (a firewall rule rejecting it with a TCP reset)",
    "unreachable": "unreachable (an ICMP unreachable: a firewall rejecting it, or no route)",
    "error": "could not connect",
}


def check_ports(h: Host, dials: list, out: Output | None, listeners: dict[str, Output | None],
                offsets: dict[str, float]) -> CheckResult:
    """Each connection the plan opens from h (dials: spec.Dial), tried by h while its target host held a
    listener on that address and port (or a service already did). A failed dial fails only where the target
    was listening while h tried; otherwise nothing was shown either way (warn). offsets: each host's clock
    minus this machine's, to line the two hosts' times up."""
    bad = unusable(h, "ports", out, "python3")
    if bad:  # the probe could not run: nothing was shown about the ports
        return CheckResult(h.name, "ports", WARN, bad.detail + ": the ports were not tried", bad.evidence, bad.hint)
    assert out is not None  # unusable() fails a missing output
    _, mine = parse_port_probe(out.text)
    ok, failed, unseen, hints, evidence = [], [], [], [], []
    for d in dials:
        where = f"{d.address}:{d.port} on {d.dst} ({d.what})"
        got = mine.get((d.address, d.port))
        lo = listeners.get(d.dst)
        theirs = parse_port_probe(lo.text)[0].get((d.address, d.port)) if lo is not None and lo.rc is not None else None
        if got is None:
            unseen.append(f"{where}: no answer from the probe")
            continue
        if got.status == "connected":
            ok.append(d)
            continue
        if theirs is None:
            unseen.append(f"{where}: {got.status}, but {d.dst} held no listener (not probed)")
            continue
        if theirs.status == "no-address":
            failed.append(f"{where}: {d.address} is not an address of {d.dst}")
            hints.append(f"the plan dials {d.address} on {d.dst}: its rail address (see rail_ip)")
            continue
        if theirs.status == "error":
            unseen.append(f"{where}: {d.dst} could not listen there")
            continue
        # both on this machine's clock: the listener was up (ok) or the port held (in-use) while h kept trying
        up = theirs.start - offsets.get(d.dst, 0.0)
        down = theirs.end - offsets.get(d.dst, 0.0) if theirs.status == "ok" else float("inf")
        tried = (got.start - offsets.get(h.name, 0.0), got.end - offsets.get(h.name, 0.0))
        if up > tried[1] - 1 or down < tried[1]:
            unseen.append(f"{where}: {got.status}, but {d.dst}'s listener was not up while it tried")
            continue
        failed.append(f"{where}: " + PORT_FAILURES.get(got.status, got.status).format(dst=d.dst))
        evidence.append(f"dial {d.address}:{d.port} {got.status} after {got.detail} tries; {d.dst}: listen "
                        f"{theirs.status}")
        hints.append(f"allow TCP {d.port} from {h.name} on {d.dst} (`nft list ruleset`, `iptables -S` there)")
    if failed:
        return CheckResult(h.name, "ports", FAIL, f"{h.name} cannot reach " + "; ".join(failed),
                           " | ".join(evidence[:3]), "; ".join(dict.fromkeys(hints)))
    if unseen:
        return CheckResult(h.name, "ports", WARN, f"{h.name}: not shown either way: " + "; ".join(unseen), "",
                           "run inv preflight again; from the host: `timeout 3 bash -c '</dev/tcp/ADDR/PORT'` while "
                           "the service (or `python3 -m http.server PORT --bind ADDR`) listens")
    shown = ", ".join(f"{d.dst} {d.address}:{d.port}" for d in ok[:4]) + (f" and {len(ok) - 4} more" if len(ok) > 4 else "")
    return CheckResult(h.name, "ports", PASS, f"{h.name} reaches every port the plan dials from it: {shown}",
                       f"TCP connect to each, {len(ok)} in all, while its host listened")
