"""Network checks: the rail's link, address, speed, MTU, jumbo frames, routes, RoCE GID, ssh and TCP
ports between the hosts.
"""

from __future__ import annotations

from . import FAIL, PASS, SKIP, WARN, CheckResult, first_lines, unusable
from ..facts import ParseError
from ..facts.net import (parse_ethtool, parse_ibdev2netdev, parse_ip_br_addr, parse_ip_link, parse_ping, parse_port_probe,
                         parse_route_get, parse_show_gids, ping_pair, roce_v2_index)
from ..facts.probe import Output, split_blocks
from ..inventory import Host


# ---------------------------------------------------------------- rails

def check_rail_link(host: Host, out: Output) -> CheckResult:
    bad = unusable(host, "rail_link", out, "ibdev2netdev")
    if bad:
        return bad
    rail = host.serve_rail
    rows = parse_ibdev2netdev(out.text)
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
    addrs = parse_ip_br_addr(out.text)
    iface = addrs.get(rail.name)
    want = str(rail.ipv4)
    fix = f"ip addr add {want} dev {rail.name} (and make it persistent in netplan)"
    if iface is None:
        return CheckResult(host.name, "rail_ip", FAIL, f"no interface {rail.name}", first_lines(out.text, 6),
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
    e = parse_ethtool(out.text)
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
        link = parse_ip_link(out.text).get(h.serve_rail.name)
        if link is None:
            res[h.name] = CheckResult(h.name, "mtu", FAIL, f"no interface {h.serve_rail.name}", first_lines(out.text))
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


# ---------------------------------------------------------------- jumbo ping

def _mtu_error(line: str) -> bool:
    low = line.lower()
    return "too long" in low or "frag needed" in low


def jumbo_frames_lost(out: Output | None, ip: str) -> bool:
    """Whether every jumbo ping to ip went unanswered (an MTU black hole or a dead path): an ssh to it that
    hung then has its cause in view, and waiting for it longer shows nothing new."""
    if out is None:
        return False
    _small, text = ping_pair(split_blocks(out.text).get(ip, (None, ""))[1])
    try:
        ping = parse_ping(text)
    except ParseError:
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
        _small, text = ping_pair(text)
        try:
            ping = parse_ping(text)
        except ParseError:
            fails.append(f"{p.name} {ip}: {first_lines(text, 2) or 'no answer'}")
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


# ---------------------------------------------------------------- route / gid

def check_route(host: Host, out: Output | None, peers: list[Host]) -> CheckResult:
    bad = unusable(host, "route", out, "ip route get")
    if bad:
        return bad
    assert out is not None  # unusable() fails a missing output
    rail = host.serve_rail.name
    routes = {r.dest: r for r in parse_route_get(out.text)}
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
    gids = parse_show_gids(out.text)
    index = roce_v2_index(gids, rail.hca, rail.ip)
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
        if first_lines(text, 2) not in evidence:
            evidence.append(first_lines(text, 2))
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
