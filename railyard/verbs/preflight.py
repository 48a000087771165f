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
from typing import Callable

from ..checks import FAIL, PASS, SKIP, CheckResult
from ..checks.docker import check_docker, check_image
from ..checks.gpu import check_gpu, check_gpu_health
from ..checks.net import (check_gid, check_jumbo_ping, check_link_speed, check_mtu, check_ports, check_rail_ip,
                          check_rail_link, check_route, check_ssh_peer, jumbo_frames_lost)
from ..checks.parity import ClockSample, check_clock_skew, check_parity, cross_image, one_cause
from ..checks.regressions import check_cma, check_gloo_iface, check_nccl_conf, check_nccl_lib, nccl_lib_of
from ..checks.system import check_disk, check_gdr, check_ntp
from ..facts import docker, gpu, net, regressions, system
from ..facts.gpu import (HEALTH_UNSUPPORTED, compute_apps_csv, parse_gpu_health, parse_gpus, parse_smi_pids,
                         split_gpu_query)
from ..facts.docker import parse_image_inspect
from ..facts.net import SSH_PEER_HANG_S, ports_section, ssh_peer_section
from ..facts.probe import Output, Section, joined_script, new_token, no_answer, split_blocks, split_output
from ..facts.system import gdr_parts, parse_ibv_devinfo, parse_versions
from ..inventory import Host, Inventory
from ..transport.runner import Runner
from ..plan.spec import Dial
from ..report import Report
from ..transport import Session

CHECKS = ("ssh", "docker", "image", "rail_link", "rail_ip", "link_speed", "mtu", "jumbo_ping", "route",
          "gid", "ntp", "clock_skew", "disk", "gpu", "gpu_health", "gdr", "parity", "cma", "nccl_conf", "nccl_lib",
          "gloo_iface", "ssh_peer", "ports")


def plan_dials(inv: Inventory) -> list[Dial]:
    """The connections the inventory's layout will open between its hosts (none where its variables have a
    problem: launch names it), then those `inv rdma-test`'s perftest pairs open."""
    from ..plan import layout as layouts
    from .rdma_test import perftest_dials
    layout = layouts.get(inv)
    return ([] if layout.validate(inv) else layout.dials(inv)) + perftest_dials(inv)


def sections_for(host: Host, inv: Inventory) -> list[Section]:
    """The probes for one host: read-only commands, each with the tool it needs (railyard.facts.*)."""
    v = host.vars
    rail = host.serve_rail
    peers = [p for p in inv.hosts if p.name != host.name]
    sections = [
        docker.version_section(),
        docker.image_section(v["vllm_image"]),
        net.ibdev2netdev_section(),
        net.ip_addr_section(),
        net.ip_link_section(),
        net.ethtool_section(rail.name),
        net.gids_section(rail.hca),
        system.time_section(),
        system.df_section(v["model_path"]),
        system.du_section(v["model_path"]),
        gpu.gpus_and_health_section(),
        gpu.gpu_pids_section(),
        gpu.xid_section(),
        system.versions_section(rail.name),
        system.gdr_section(rail.name, rail.hca),
        regressions.meminfo_section(),
        regressions.hostname_section(),
        regressions.image_files_section(v["vllm_image"]),
    ]
    if peers:
        sections.append(net.ping_section(rail.name, [p.serve_rail.ip for p in peers], v["preflight_mtu"],
                                         v["preflight_ping_count"]))
        sections.append(net.route_section([p.serve_rail.ip for p in peers]))
    if host.is_head and inv.workers:
        sections.append(ssh_peer_section(inv.workers))
    return sections


def ssh_peer_again(workers: list[Host]):
    """The ssh_peer probe asked again: only the targets whose ssh hung, with twice the limit (every host of a
    large lab probing at once on few cores can starve a healthy one), their new answers put in place. A target
    to which every jumbo ping of the same probe was lost is not asked again: the hang has its cause in view
    (an MTU black hole stalls ssh's key exchange), and the longer wait would only delay the report."""
    def narrowed(first: Output, outputs: dict[str, Output]) -> tuple[Section, Callable[[Output], Output]] | None:
        blocks = split_blocks(first.text)
        hung = [w for w in workers if no_answer(*blocks.get(w.serve_rail.ip, (None, "")))
                and not jumbo_frames_lost(outputs.get("ping"), w.serve_rail.ip)]
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
    clock: ClockSample | None
    ssh: CheckResult


CLOCK_RETRIES = 3


def _tighter_clock(session: Session, clock: ClockSample | None, limit_s: float) -> ClockSample | None:
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
            again = ClockSample(float(r.stdout.strip()) - (t0 + t1) / 2, (t1 - t0) / 2)
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
        return HostProbe(h, None, None, CheckResult(h.name, "ssh", FAIL, f"{err.kind}: {err.message}",
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
        return HostProbe(h, None, None, CheckResult(h.name, "ssh", FAIL, f"{res.error.kind}: {res.error.message}",
                                                      "", res.error.hint))
    lines = res.stdout.split("\n", 2)
    clock = None
    try:
        t1 = arrived[0]
        clock = ClockSample(float(lines[0]) - (t0 + t1) / 2, (t1 - t0) / 2)
    except (ValueError, IndexError):
        pass
    clock = _tighter_clock(session, clock, h.vars["preflight_max_clock_skew_ms"] / 1000)
    remote_name = lines[1].strip() if len(lines) > 1 and lines[1].strip() else "?"
    how = "local" if h.is_local else f"{h.user + '@' if h.user else ''}{h.address}:{h.port}"
    ssh = CheckResult(h.name, "ssh", PASS, f"{how} (hostname {remote_name})",
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


def evaluate(inv: Inventory, probes: dict[str, HostProbe], dials: list[Dial] | None = None) -> list[CheckResult]:
    """Turn every host's probe outputs into check results (cross-host checks included)."""
    per: dict[str, dict[str, CheckResult]] = {h.name: {} for h in inv.hosts}
    outs = {h.name: o for h in inv.hosts if (o := probes[h.name].outputs) is not None}
    reachable = [h for h in inv.hosts if h.name in outs]
    for h in inv.hosts:
        p = probes[h.name]
        per[h.name]["ssh"] = p.ssh
        if p.outputs is None:
            for name in CHECKS[1:]:
                if (name == "ssh_peer" and not h.is_head) or (name == "ports" and not any(d.src == h.name
                                                                                          for d in dials or [])):
                    continue
                per[h.name][name] = CheckResult(h.name, name, SKIP, "host not reachable (see the ssh check)")
    image_ids: dict[str, str] = {}
    for h in reachable:
        o = outs[h.name]
        peers = [p for p in inv.hosts if p.name != h.name]
        r = per[h.name]
        r["docker"] = check_docker(h, o["docker_version"])
        r["image"] = check_image(h, o["image"], r["docker"].status == PASS)
        if r["image"].status == PASS:
            want = h.vars["vllm_image"].partition("@")[2]
            image_ids[h.name] = next(i.id for i in parse_image_inspect(o["image"].text) if want in i.digests())
        r["rail_link"] = check_rail_link(h, o["ibdev2netdev"])
        r["rail_ip"] = check_rail_ip(h, o["ip_addr"])
        r["link_speed"] = check_link_speed(h, o["ethtool"])
        r["jumbo_ping"] = check_jumbo_ping(h, o.get("ping"), peers) if peers else \
            CheckResult(h.name, "jumbo_ping", SKIP, "no peers")
        r["route"] = check_route(h, o.get("route"), peers) if peers else \
            CheckResult(h.name, "route", SKIP, "no peers")
        r["gid"] = check_gid(h, o["gids"])
        r["ntp"] = check_ntp(h, o["time"])
        r["disk"] = check_disk(h, o["df"], o["du"])
        gpus, health = _gpu_outputs(o["gpus"])
        r["gpu"] = check_gpu(h, gpus, _apps_output(o["gpu_pids"], gpus, health))
        r["gpu_health"] = check_gpu_health(h, health, o.get("dmesg"))
        v = _versions(o)
        r["gdr"] = check_gdr(h, o["gdr"], v.get("kernel"), _cluster_gpu_buses(h, gpus, health), v.get("nic_bus"))
        if h.is_head:
            r["ssh_peer"] = check_ssh_peer(h, o.get("ssh_peer"), inv.workers) if inv.workers else \
                CheckResult(h.name, "ssh_peer", SKIP, "no workers")
    for name, res in cross_image({h.name: per[h.name]["image"] for h in reachable}, image_ids,
                                   inv.head.vars["vllm_image"]).items():
        per[name]["image"] = res
    for name, res in check_mtu(reachable, {h.name: outs[h.name]["ip_link"] for h in reachable}).items():
        per[name]["mtu"] = res
    seen = {h.name: _versions(outs[h.name], h.vars["vllm_image"].partition("@")[2]) for h in reachable}
    for name, res in check_parity(reachable, seen).items():
        per[name]["parity"] = res
    _regressions(inv, reachable, outs, per)
    one_cause(reachable, per, {h.name: outs[h.name].get("ping") for h in reachable})
    for name, res in check_clock_skew(reachable, {h.name: probes[h.name].clock for h in reachable}).items():
        per[name]["clock_skew"] = res
    listeners = {h.name: outs[h.name].get("ports") for h in reachable}
    offsets = {h.name: clock.offset_s for h in reachable if (clock := probes[h.name].clock)}
    for h in reachable:
        mine = [d for d in dials or [] if d.src == h.name]
        if mine:  # a row on each host that dials (the hosts it dials show their listener there)
            per[h.name]["ports"] = check_ports(h, mine, listeners[h.name], listeners, offsets)
    out = []
    for h in inv.hosts:
        for name in CHECKS:
            if name in per[h.name]:
                out.append(per[h.name][name])
    return out


def _regressions(inv: Inventory, reachable: list[Host], outs: dict[str, dict[str, Output]],
                 per: dict[str, dict[str, CheckResult]]) -> None:
    """cma, nccl_conf, nccl_lib (across the ranks) and gloo_iface: the host regressions of checks.regressions."""
    from ..plan import layout as layouts
    layout = layouts.get(inv)
    spans = layout.ranks_span_hosts and len(inv.hosts) > 1
    libs = {}
    for h in reachable:
        o, r = outs[h.name], per[h.name]
        image_ok = r["image"].status == PASS
        r["cma"] = check_cma(h, o.get("meminfo"))
        env = layout.rank_env(inv, h)
        r["nccl_conf"] = check_nccl_conf(h, o.get("image_files"), image_ok, env)
        lib, bad = nccl_lib_of(h, o.get("image_files"), image_ok)
        if lib is not None:
            libs[h.name] = lib
        elif bad is not None:
            r["nccl_lib"] = bad
        r["gloo_iface"] = check_gloo_iface(h, env, spans, o.get("hostname"), o.get("ip_addr"))
    for name, res in check_nccl_lib(reachable, libs).items():
        per[name]["nccl_lib"] = res


def _gpu_outputs(out: Output) -> tuple[Output, Output]:
    """The one nvidia-smi answer as the gpu check's and the gpu_health check's outputs."""
    if out.rc is None or out.missing_tool:
        return out, out
    base, health = split_gpu_query(out.text)
    if health is None:
        return Output(out.rc, base), Output(0, HEALTH_UNSUPPORTED + "\n")
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
        ibv = gdr_parts(g.text).get("ibv", "")
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


def run_preflight(inv: Inventory, on_host=None) -> list[CheckResult]:
    """on_host(name, HostProbe or Result), if given, hears of each host as its probe lands (a progress display)."""
    with Runner(inv.hosts) as runner:
        probes: dict[str, HostProbe] = {}
        got = runner.each(lambda s: probe_host(s, inv), on_done=on_host)
        for name in got:
            if name in got.ok:
                probes[name] = got.ok[name]
            else:  # a bug inside one host's probe: report it, keep the rest
                p = got.failed[name]
                assert p.error is not None  # the runner's Result for a probe that raised carries the error
                h = inv.host(name)
                probes[name] = HostProbe(h, None, None, CheckResult(name, "ssh", FAIL, str(p.error), "",
                                                                      p.error.hint))
        # a host not reached, or whose rail is down or without its address, has its cause named by those
        # checks: no connection is tried to or from it
        railed = {n for n, p in probes.items() if p.outputs is not None
                  and check_rail_link(p.host, p.outputs["ibdev2netdev"]).status != FAIL
                  and check_rail_ip(p.host, p.outputs["ip_addr"]).status != FAIL}
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
    got = runner.each(one, todo)
    for name in got:
        outputs = probes[name].outputs
        assert outputs is not None  # the dials join only hosts whose probe answered (run_preflight's railed)
        outputs["ports"] = got.ok.get(name, Output(None, ""))


def preflight_report(results: list[CheckResult]) -> Report:
    return Report(list(results), {})
