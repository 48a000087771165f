"""Preflight checks: pure functions (facts, vars) -> CheckResult. No I/O here.

Every result is {host, check, status, detail, evidence, hint}; status is pass, warn,
fail or skip. A fail always says what is wrong (detail), shows what the host printed
(evidence) and how to fix it (hint).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass

from . import facts as F
from .inventory import Host
from .probe import Output, split_blocks

PASS, WARN, FAIL, SKIP = "pass", "warn", "fail", "skip"

CHECKS = ("ssh", "docker", "image", "rail_link", "rail_ip", "link_speed", "mtu", "jumbo_ping", "route",
          "gid", "ntp", "clock_skew", "disk", "gpu", "ssh_peer")


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
    "timedatectl": "install systemd's timedatectl, or check NTP with chronyc tracking",
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


def check_image(host: Host, pinned: Output, by_tag: Output, docker_ok: bool) -> CheckResult:
    image = host.vars["vllm_image"]
    if not docker_ok:
        return CheckResult(host.name, "image", SKIP, "Docker daemon unreachable (see the docker check)")
    bad = unusable(host, "image", pinned, "docker image inspect")
    if bad:
        return bad
    want = image.split("@", 1)[1]
    try:
        found = F.parse_image_inspect(pinned.text)
    except F.ParseError:
        found = []
    if found and want in found[0].digests():
        img = found[0]
        return CheckResult(host.name, "image", PASS, f"{_short(want)} present ({img.architecture}, id {_short(img.id)})",
                           f"RepoDigests {' '.join(img.repo_digests)}")
    tag = image.split("@", 1)[0]
    other = ""
    try:
        tagged = F.parse_image_inspect(by_tag.text) if by_tag and by_tag.text else []
    except F.ParseError:
        tagged = []
    if tagged:
        other = f"; {tag} here is {', '.join(_short(d) for d in sorted(tagged[0].digests())) or 'an unpinned build'}"
    return CheckResult(host.name, "image", FAIL, f"pinned digest {_short(want)} not present{other}",
                       _first_lines(pinned.text + "\n" + (by_tag.text if by_tag else ""), 2),
                       f"docker pull {image}")


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


def check_jumbo_ping(host: Host, out: Output, peers: list[Host]) -> CheckResult:
    bad = unusable(host, "jumbo_ping", out, "ping")
    if bad:
        return bad
    if not peers:
        return CheckResult(host.name, "jumbo_ping", SKIP, "no peers")
    size = host.vars["preflight_mtu"] - 28
    blocks = split_blocks(out.text)
    fails, oks, lossy, evidence = [], [], [], []
    mtu_errors = False
    for p in peers:
        ip = p.serve_rail.ip
        rc, text = blocks.get(ip, (None, ""))
        try:
            ping = F.parse_ping(text)
        except F.ParseError:
            fails.append(f"{p.name} {ip}: {_first_lines(text, 2) or 'no answer'}")
            continue
        if ping.received == ping.transmitted and ping.transmitted > 0:
            oks.append(f"{p.name} {ping.received}/{ping.transmitted}" + (f" {ping.rtt_avg_ms:.2f}ms" if ping.rtt_avg_ms else ""))
        elif ping.received > 0 and not ping.local_errors:
            # jumbo frames do pass; losing some of them is worth a look but is not an MTU fault
            lossy.append(f"{p.name} {ip}: {ping.received}/{ping.transmitted} received")
            evidence.append(ping.summary)
        else:
            mtu_errors |= any("too long" in e.lower() or "frag needed" in e.lower() for e in ping.local_errors)
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


def check_route(host: Host, out: Output, peers: list[Host]) -> CheckResult:
    bad = unusable(host, "route", out, "ip route get")
    if bad:
        return bad
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


# ---------------------------------------------------------------- time

def check_ntp(host: Host, out: Output) -> CheckResult:
    bad = unusable(host, "ntp", out, "timedatectl")
    if bad:
        return bad
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
    ref = statistics.median([0.0] + [s.offset_s for s in have.values()])
    spread = max(s.offset_s for s in have.values()) - min(s.offset_s for s in have.values())
    for h in hosts:
        s = samples.get(h.name)
        if s is None:
            res[h.name] = CheckResult(h.name, "clock_skew", FAIL, "could not read the clock", "",
                                      "run `date` on the host")
            continue
        dev = s.offset_s - ref
        ev = f"offset {s.offset_s * 1000:+.1f} ms vs this machine (±{s.uncertainty_s * 1000:.1f} ms)"
        if spread > limit and abs(dev) > limit / 2:
            res[h.name] = CheckResult(h.name, "clock_skew", FAIL,
                                      f"clock {abs(dev):.3f} s {'ahead of' if dev > 0 else 'behind'} the others "
                                      f"(spread {spread:.3f} s > {limit:.3f} s)", ev,
                                      "fix NTP on this host (ntp check) and step the clock: sudo chronyc makestep "
                                      "or restart systemd-timesyncd")
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


# ---------------------------------------------------------------- ssh from the head

def check_ssh_peer(head: Host, out: Output, workers: list[Host]) -> CheckResult:
    bad = unusable(head, "ssh_peer", out, "ssh")
    if bad:
        return bad
    if not workers:
        return CheckResult(head.name, "ssh_peer", SKIP, "no workers")
    blocks = split_blocks(out.text)
    oks, fails, evidence, hints = [], [], [], []
    for w in workers:
        ip = w.serve_rail.ip
        rc, text = blocks.get(ip, (None, ""))
        target = f"{w.user + '@' if w.user else ''}{ip}"
        if rc == 0:
            oks.append(f"{w.name} ({target}) answers as {text.strip() or '?'}")
            continue
        evidence.append(_first_lines(text, 2))
        if "Host key verification failed" in text or "REMOTE HOST IDENTIFICATION HAS CHANGED" in text:
            fails.append(f"{w.name} ({target}): host key not trusted")
            hints.append(f"on {head.name}: compare `ssh-keyscan -t ed25519 {ip} | ssh-keygen -lf -` with "
                         f"`ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub` on {w.name}, then add the key to ~/.ssh/known_hosts")
        elif "Permission denied" in text:
            fails.append(f"{w.name} ({target}): key not accepted")
            hints.append(f"on {head.name}: ssh-keygen -t ed25519 (no passphrase), then ssh-copy-id {target}")
        else:
            fails.append(f"{w.name} ({target}): unreachable")
            hints.append(f"is sshd on {w.name} listening on its rail address {ip}?")
    if fails:
        return CheckResult(head.name, "ssh_peer", FAIL, f"{head.name} cannot ssh non-interactively to " + "; ".join(fails),
                           " | ".join(e for e in evidence if e), "; ".join(dict.fromkeys(hints)))
    return CheckResult(head.name, "ssh_peer", PASS, f"{head.name} -> " + ", ".join(oks), "ssh -o BatchMode=yes")
