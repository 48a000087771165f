"""Checks across hosts: one image id, the same versions, clocks that agree, and one cause named once
where several checks fail for it.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from . import FAIL, PASS, SKIP, WARN, CheckResult
from .docker import _short
from ..facts import ParseError
from ..facts.net import parse_ping, ping_pair
from ..facts.probe import Output, split_blocks
from ..inventory import Host


# ---------------------------------------------------------------- image

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


# ---------------------------------------------------------------- versions

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


# ---------------------------------------------------------------- clocks

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
            small, jumbo = ping_pair(blocks[p.serve_rail.ip][1])
            try:
                j = parse_ping(jumbo)
            except ParseError:
                continue
            if j.transmitted and not j.received and not j.local_errors:
                try:
                    s = parse_ping(small) if small is not None else None
                except ParseError:
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
