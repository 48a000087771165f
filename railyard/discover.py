"""`discover`'s decisions, pure: from what each host printed (ibdev2netdev, `ip -br addr`, show_gids, ethtool,
nvidia-smi) to its rails, the serving rail and the GPUs, and from those to an inventory's text. No I/O here; the
verb (railyard.verbs.discover) reads the hosts, one round trip each.

    hosts = [read_host("A", "10.0.0.11", outputs_of_A), ...]       # the tools' text, parsed
    found = decide(hosts)                                            # rails, serving rail, GPUs; or problems
    text = render(found, "railyard discover --hosts ...", overrides)  # the commented inventory

A rail is a subnet: the rail netdevs (ibdev2netdev's) of several hosts with an IPv4 address in one subnet. The
serving rail is the fastest rail every host has, the same netdev name on each (`cluster_serve_rail` names one
interface for all); between equals, the one nearest the serving GPUs (`nvidia-smi topo -m`: PIX before PXB, PHB,
NODE, SYS), then the first by HCA. What cannot be decided (a host with no RDMA device, an address no other host
pairs with, one host with two netdevs in one rail, GPUs that differ) is one problem line each, naming the host.
"""

from __future__ import annotations

import ipaddress
import json
import re
from dataclasses import dataclass, field

from .facts import ParseError
from .facts.gpu import Gpu, GpuTopo, parse_gpus, parse_topo_matrix, select_gpu
from .facts.net import (IbDevMap, RoceGid, parse_ethtool, parse_ibdev2netdev, parse_ip_br_addr, parse_show_gids,
                        roce_v2_index)
from .facts.probe import Output, split_blocks

# nvidia-smi topo -m's NIC relations, nearest first
DISTANCE = ("PIX", "PXB", "PHB", "NODE", "SYS")
PLACEHOLDER_REVISION = "0" * 40
PLACEHOLDER_IMAGE = "vllm/vllm-openai:v0.33.0@sha256:" + "0" * 64
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


@dataclass
class Netdev:
    """One rail netdev of a host: its HCAs (a bond can have two), link state, IPv4 addresses and speed."""
    name: str
    hcas: list[str]
    up: bool
    ipv4: list[ipaddress.IPv4Interface]
    speed_mbps: int | None = None


@dataclass
class HostRead:
    """What one host said about itself, parsed; problems: what it could not say."""
    address: str                 # as given to --hosts (ansible_host)
    hostname: str = ""
    netdevs: dict[str, Netdev] = field(default_factory=dict)
    gids: list[RoceGid] = field(default_factory=list)
    gpus: list[Gpu] = field(default_factory=list)
    topo: dict[int, GpuTopo] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    name: str = ""               # its name in the inventory (decide() sets it)


def read_host(address: str, out: dict[str, Output]) -> HostRead:
    """A host's read from its sections' outputs (keys: hostname, ibdev2netdev, ip_addr, gids, ethtool, gpus,
    topo: railyard.verbs.discover.SECTIONS)."""
    h = HostRead(address, hostname=out["hostname"].text.strip() if "hostname" in out else "")
    ib = out.get("ibdev2netdev")
    maps: list[IbDevMap] = parse_ibdev2netdev(ib.text) if ib and ib.ok else []
    if ib is None or ib.missing_tool:
        h.problems.append(f"{address}: ibdev2netdev not found: no RDMA tools (fix: install DOCA-Host or "
                          "MLNX_OFED, whose ibdev2netdev maps each HCA to its netdev)")
    elif not maps:
        h.problems.append(f"{address}: no RDMA device: ibdev2netdev lists none (fix: a ConnectX port with its "
                          "driver loaded, `ibv_devices`)")
    addrs = parse_ip_br_addr(out["ip_addr"].text) if "ip_addr" in out and out["ip_addr"].ok else {}
    speeds: dict[str, int | None] = {}
    if "ethtool" in out:
        for dev, (_, text) in split_blocks(out["ethtool"].text).items():
            speeds[dev] = parse_ethtool(text).speed_mbps
    for m in maps:
        nd = h.netdevs.get(m.netdev)
        if nd is None:
            a = addrs.get(m.netdev)
            ips = [ipaddress.IPv4Interface(x) for x in a.ipv4] if a else []
            nd = h.netdevs[m.netdev] = Netdev(m.netdev, [], m.up, ips, speeds.get(m.netdev))
        nd.hcas.append(m.hca)
        nd.up = nd.up or m.up
    if "gids" in out and out["gids"].ok:
        h.gids = parse_show_gids(out["gids"].text)
    g = out.get("gpus")
    if g is None or g.missing_tool:
        h.problems.append(f"{address}: nvidia-smi not found: no GPU to serve on (fix: the NVIDIA driver)")
    else:
        try:
            h.gpus = parse_gpus(g.text) if g.ok else []
        except ParseError as e:
            h.problems.append(f"{address}: nvidia-smi's GPU rows unreadable: {e}")
        if not h.gpus and g.ok:
            h.problems.append(f"{address}: nvidia-smi lists no GPU")
        elif not g.ok:
            h.problems.append(f"{address}: nvidia-smi failed: {g.text.strip().splitlines()[-1:] or g.rc}")
    t = out.get("topo")
    if t is not None and t.ok:
        try:
            h.topo = parse_topo_matrix(t.text)
        except ParseError:
            h.topo = {}  # the distance is a tie-break only: without it, the HCA order decides
    return h


@dataclass(frozen=True)
class Member:
    host: str
    netdev: str
    hca: str
    ipv4: ipaddress.IPv4Interface
    speed_mbps: int | None


@dataclass
class Rail:
    """A subnet the rail netdevs of several hosts (or the one host) have an address in."""
    subnet: ipaddress.IPv4Network
    members: dict[str, Member]   # host name -> its netdev on this rail

    @property
    def name(self) -> str | None:
        """The netdev name, when it is the same on every member (else None: it cannot be cluster_serve_rail)."""
        names = {m.netdev for m in self.members.values()}
        return names.pop() if len(names) == 1 else None

    @property
    def speed_mbps(self) -> int:
        """The slowest member's speed (0 where one is unknown)."""
        return min((m.speed_mbps or 0) for m in self.members.values())


@dataclass
class Found:
    hosts: list[HostRead]
    rails: list[Rail] = field(default_factory=list)
    serve: Rail | None = None
    why: str = ""
    gpu_name: str = ""           # cluster_gpu_name
    gpu_model: str = ""          # nvidia-smi's name
    gpu_count: int = 0
    gpu_unused: list[str] = field(default_factory=list)
    layout: str = ""
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _natural(s: str) -> list:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", s)]


def _names(hosts: list[HostRead]) -> None:
    """Each host's inventory name: its short hostname where every one is unique and valid, else its address."""
    short = [h.hostname.split(".")[0] for h in hosts]
    ok = all(_NAME_RE.match(s) for s in short) and len(set(short)) == len(short)
    for h, s in zip(hosts, short):
        h.name = s if ok else re.sub(r"[^A-Za-z0-9_.-]", "-", h.address)


def group_rails(hosts: list[HostRead], found: Found) -> list[Rail]:
    """Rails from every host's rail netdevs with an address; problems for what does not pair."""
    by_subnet: dict[ipaddress.IPv4Network, dict[str, list[Member]]] = {}
    for h in hosts:
        for nd in h.netdevs.values():
            for ip in nd.ipv4:
                hca = nd.hcas[0]
                by_subnet.setdefault(ip.network, {}).setdefault(h.name, []).append(
                    Member(h.name, nd.name, hca, ip, nd.speed_mbps))
    # a rail netdev up without an address, where another host has one on the netdev of that name: that host's
    # address pairs with no one because of this one, which is the line to say
    bare = {(h.name, nd.name) for h in hosts for nd in h.netdevs.values() if nd.up and not nd.ipv4}
    addressed: dict[str, list[Member]] = {}
    rails = []
    for subnet, members in sorted(by_subnet.items(), key=lambda kv: (kv[0].network_address, kv[0].prefixlen)):
        for host, ms in members.items():
            addressed.setdefault(ms[0].netdev, []).append(ms[0])
            if len(ms) > 1:
                found.problems.append(
                    f"{host}: {' and '.join(f'{m.netdev} {m.ipv4}' for m in ms)} are both in {subnet}: which one is "
                    f"the rail? (fix: one address per subnet on a host; the other netdev on a subnet of its own)")
        if len(hosts) > 1 and len(members) == 1:
            ((host, (m, *_)),) = members.items()
            if any((h.name, m.netdev) in bare for h in hosts if h.name != host):
                continue  # said below, on the host without its address
            found.problems.append(
                f"{host}: {m.netdev} ({m.hca}) {m.ipv4} does not pair: no other host has an address in {subnet} "
                f"(fix: an address of that subnet on the peer's rail netdev; railyard's rails are one subnet "
                "across the hosts, not a routed /31 per port)")
            continue
        rails.append(Rail(subnet, {host: ms[0] for host, ms in members.items()}))
    for h in hosts:
        for nd in h.netdevs.values():
            if len(nd.hcas) > 1 and nd.ipv4:
                found.notes.append(f"{h.name}: {nd.name} is on {', '.join(nd.hcas)} (a bond): {nd.hcas[0]} taken as "
                                   "its HCA")
            if nd.ipv4:
                continue
            peers = [m for m in addressed.get(nd.name, []) if m.host != h.name]
            if nd.up and peers and len(hosts) > 1:
                found.problems.append(
                    f"{h.name}: {nd.name} ({', '.join(nd.hcas)}) is up with no IPv4 address, where {peers[0].host} has "
                    f"{peers[0].ipv4} on {nd.name} (fix: ip addr add <address in {peers[0].ipv4.network}> dev "
                    f"{nd.name}, and persist it in netplan)")
            else:
                found.notes.append(f"{h.name}: {nd.name} ({', '.join(nd.hcas)}) {'up' if nd.up else 'down'}, no IPv4: "
                                   "not a rail")
    return rails


def _distance(h: HostRead, hca: str, gpus: list[Gpu]) -> int:
    """How far the HCA is from the host's serving GPUs (DISTANCE's index; len(DISTANCE) when unknown)."""
    best = len(DISTANCE)
    for g in gpus:
        rel = h.topo.get(g.index)
        if rel and rel.nics.get(hca) in DISTANCE:
            best = min(best, DISTANCE.index(rel.nics[hca]))
    return best


def choose_serve_rail(found: Found, chosen_gpus: dict[str, list[Gpu]], wanted: str | None = None) -> None:
    """The fastest rail every host has, the same netdev on each; between equals the nearest the GPUs, then the
    first by HCA. `wanted`: cluster_serve_rail given with --set."""
    hosts = {h.name: h for h in found.hosts}
    everywhere = [r for r in found.rails if set(r.members) == set(hosts)]
    if wanted:
        pick = [r for r in everywhere if r.name == wanted]
        if not pick:
            found.problems.append(f"cluster_serve_rail {wanted}: no rail of that name on every host (rails every host "
                                  f"has: {', '.join(r.name or str(r.subnet) for r in everywhere) or 'none'})")
            return
        found.serve, found.why = pick[0], f"{wanted}: chosen with --set cluster_serve_rail"
        return
    if not everywhere:
        found.problems.append("no rail every host has: no subnet holds an address of each host's rail netdevs "
                              "(fix: one rail subnet across all the hosts)")
        return
    named = [r for r in everywhere if r.name]
    for r in everywhere:
        if not r.name:
            found.notes.append(f"{r.subnet}: netdev {', '.join(f'{m.netdev} on {h}' for h, m in r.members.items())}: "
                               "not one name on every host, so it cannot be cluster_serve_rail")
    if not named:
        found.problems.append(f"no rail every host has under one netdev name ({', '.join(str(r.subnet) for r in everywhere)}"
                              "): cluster_serve_rail names one interface for every host (fix: rename the netdevs, "
                              "udev or netplan `set-name`)")
        return

    def key(r: Rail) -> tuple:
        dist = sum(_distance(hosts[h], m.hca, chosen_gpus.get(h, [])) for h, m in r.members.items())
        head = r.members[found.hosts[0].name]
        return (-r.speed_mbps, dist, _natural(head.hca), _natural(head.netdev))

    ranked = sorted(named, key=key)
    best = ranked[0]
    speed = f"{best.speed_mbps} Mb/s" if best.speed_mbps else "speed unknown (ethtool)"
    rel = sorted({DISTANCE[d] if d < len(DISTANCE) else "?" for d in
                  (_distance(hosts[h], m.hca, chosen_gpus.get(h, [])) for h, m in best.members.items())})
    near = f", {'/'.join(rel)} to the GPUs" if rel != ["?"] else ""
    ties = [r for r in ranked[1:] if key(r)[:2] == key(best)[:2]]
    slower = [r for r in ranked[1:] if r not in ties]
    why = f"{best.name} ({best.subnet}): {'fastest' if len(ranked) > 1 else 'the'} rail every host has, {speed}{near}"
    if ties:
        why += (f"; ties with {', '.join(str(r.name) for r in ties)} (same speed and distance): first by HCA "
                f"({best.members[found.hosts[0].name].hca}); another: --set cluster_serve_rail=NAME")
    if slower:
        why += "; slower: " + ", ".join(f"{r.name} {r.speed_mbps or '?'} Mb/s" for r in slower)
    found.serve, found.why = best, why
    speeds = {h: m.speed_mbps for h, m in best.members.items()}
    if len(set(speeds.values())) > 1:
        each = ", ".join(f"{h} {s or '?'} Mb/s" for h, s in speeds.items())
        found.notes.append(f"{best.name}: speeds differ between hosts ({each}): the slowest is the rail's")
    for h, m in best.members.items():
        if hosts[h].gids and roce_v2_index(hosts[h].gids, m.hca, str(m.ipv4.ip)) is None:
            found.notes.append(f"{h}: no RoCE v2 GID for {m.ipv4.ip} on {m.hca}: preflight's gid check will fail "
                               "(RoCE v2 enabled?)")


def choose_gpus(found: Found) -> dict[str, list[Gpu]]:
    """The serving GPUs: on each host those of the model with the most memory (a DGX Station's display GPU has
    less), the same model on every host; cluster_gpu_name a part of its name that matches no other GPU."""
    chosen: dict[str, list[Gpu]] = {}
    models: dict[str, str] = {}
    for h in found.hosts:
        if not h.gpus:
            continue
        top = max(g.memory_total_mib for g in h.gpus)
        names = sorted({g.name for g in h.gpus if g.memory_total_mib == top})
        if len(names) > 1:
            found.problems.append(f"{h.name}: GPUs {' and '.join(names)} are equal candidates ({top} MiB each): "
                                  "which one serves? (fix: --set cluster_gpu_name=PART_OF_ITS_NAME)")
            continue
        models[h.name] = names[0]
        chosen[h.name] = sorted((g for g in h.gpus if g.name == names[0]), key=lambda g: g.index)
        found.gpu_unused += sorted({f"{g.name} on {h.name}" for g in h.gpus if g.name != names[0]})
    if len(set(models.values())) > 1:
        found.problems.append("GPU models differ: " + ", ".join(f"{h} {m}" for h, m in models.items())
                              + " (fix: discover hosts of one model together)")
        return chosen
    counts = {h: len(gs) for h, gs in chosen.items()}
    if len(set(counts.values())) > 1:
        found.problems.append("GPU counts differ: " + ", ".join(f"{h} {n} x {models[h]}" for h, n in counts.items())
                              + " (fix: a GPU missing from nvidia-smi, or hosts of another kind)")
    if not models:
        return chosen
    model = next(iter(models.values()))
    others = [g for h in found.hosts for g in h.gpus if g.name != model]
    short = model.removeprefix("NVIDIA ").strip()
    sel = next((s for s in (short, model) if not select_gpu(others, s)), None)
    if sel is None:
        found.problems.append(f"cluster_gpu_name: no part of {model!r} leaves out {others[0].name!r} (fix: "
                              "--set cluster_gpu_name=...)")
    found.gpu_name, found.gpu_model, found.gpu_count = sel or "", model, min(counts.values(), default=0)
    return chosen


def decide(hosts: list[HostRead], overrides: dict | None = None) -> Found:
    """Rails, the serving rail, the GPUs and the layout from every host's read; `found.problems` lists what
    could not be decided (nothing is to be written then). overrides: the --set values (those given decide)."""
    overrides = overrides or {}
    _names(hosts)
    found = Found(hosts)
    for h in hosts:
        found.problems += h.problems
    found.rails = group_rails(hosts, found)
    if overrides.get("cluster_gpu_name"):
        sel = str(overrides["cluster_gpu_name"])
        chosen = {h.name: sorted(select_gpu(h.gpus, sel), key=lambda g: g.index) for h in hosts}
        for name, gs in chosen.items():
            if not gs:
                found.problems.append(f"{name}: no GPU matches cluster_gpu_name {sel!r}")
        found.gpu_name = sel
        found.gpu_model = next((gs[0].name for gs in chosen.values() if gs), "")
        found.gpu_count = min((len(gs) for gs in chosen.values()), default=0)
    else:
        chosen = choose_gpus(found)
    choose_serve_rail(found, chosen, overrides.get("cluster_serve_rail"))
    layout = overrides.get("serve_layout")
    if layout:
        found.layout = str(layout)
    elif len(hosts) == 1:
        found.layout = "single_node_tp"
    elif found.gpu_count <= 1:
        found.layout = "multinode_tp"
    else:
        found.problems.append(f"{len(hosts)} hosts of {found.gpu_count} GPUs each: no layout serves them all by "
                              "default (multinode_tp: one GPU per host) (fix: --set serve_layout=pd with its pools, "
                              "or discover one host at a time)")
    return found


# ---------------------------------------------------------------- the inventory's text

def _v(value) -> str:
    """A YAML value: JSON is YAML, and quotes every string that needs it."""
    return json.dumps(value)


def render(found: Found, command: str, overrides: dict | None = None) -> str:
    """The commented inventory of a decided `found` (no problems). overrides: --set values, written in all.vars
    (they win over what was discovered)."""
    overrides = dict(overrides or {})
    assert found.serve is not None and not found.problems
    serve = found.serve
    n = len(found.hosts)
    lines = [f"# Written by `{command}`: what the hosts said about themselves (ibdev2netdev, ip addr,",
             "# show_gids, ethtool, nvidia-smi). Check it, replace the placeholders, then:",
             "#   railyard preflight --inventory THIS_FILE",
             "#",
             "# Rails (a rail is a subnet every member has an address in; speeds from ethtool):"]
    for r in found.rails:
        lines.append(f"#   {r.name or '(names differ)'} {r.subnet}: " + ", ".join(
            f"{h} {m.netdev} {m.hca} {m.ipv4.ip} {m.speed_mbps or '?'} Mb/s" for h, m in r.members.items()))
    lines.append(f"# Serving rail: {found.why}")
    gpus = f"# GPUs: {found.gpu_count} x {found.gpu_model} per host"
    if found.gpu_unused:
        gpus += f"; not for serving (less memory): {', '.join(found.gpu_unused)}"
    lines.append(gpus)
    for note in found.notes:
        lines.append(f"# Note: {note}")
    lines.append("#")
    lines.append("# Precedence, lowest first: role defaults < layout defaults < all.vars < group vars < host vars")
    lines.append("# < `--set KEY=VALUE`.")
    discovered: list[tuple[str, object, str]] = [
        ("serve_layout", found.layout, "one host: one engine on its GPUs" if n == 1
         else "one rank per host, tensor parallel across the hosts over the serving rail"),
        ("cluster_serve_rail", serve.name, "the rail NCCL and the copy use (see the top)"),
        ("cluster_gpu_name", found.gpu_name, f"matches {found.gpu_model}" + (", never the display GPU"
                                                                             if found.gpu_unused else "")),
        ("cluster_gpus_per_host", found.gpu_count, "GPUs of that name on each host"),
    ]
    if found.layout == "multinode_tp":
        discovered.append(("vllm_tensor_parallel_size", n, "one GPU per rank: the number of hosts"))
    elif found.layout == "single_node_tp":
        discovered.append(("vllm_tensor_parallel_size", found.gpu_count, "every GPU of the host"))
    if serve.speed_mbps:
        discovered.append(("preflight_link_speed_mbps", serve.speed_mbps,
                           "the serving rail's speed as measured now (slowest host): preflight fails below it"))
    placeholders: list[tuple[str, object, str]] = [
        ("model_revision", PLACEHOLDER_REVISION, "Pin the exact commit you validated. Placeholder: replace it."),
        ("vllm_image", PLACEHOLDER_IMAGE, "The image pinned by its full digest (`docker image inspect IMAGE "
                                          "--format '{{.RepoDigests}}'`). Placeholder: replace it."),
    ]
    lines += ["all:", "  vars:"]
    conn = {k: overrides.pop(k) for k in ("ansible_user", "ansible_port", "ansible_ssh_private_key_file",
                                          "ssh_known_hosts") if k in overrides}
    for k, v in conn.items():
        lines.append(f"    {k}: {_v(v)}")
    lines.append("    # discovered")
    for k, v, why in discovered:
        if k in overrides:
            continue
        lines.append(f"    {k}: {_v(v)}  # {why}")
    left = [(k, v, why) for k, v, why in placeholders if k not in overrides]
    if left:
        lines.append("    # not on the hosts: yours to fill in (model_repo, model_path, model_size_gb too: their")
        lines.append("    # defaults are the GLM-5.3 reference, roles/model/defaults/main.yml)")
        for k, v, why in left:
            lines.append(f"    # {why}")
            lines.append(f"    {k}: {_v(v)}")
    if overrides:
        lines.append("    # given with --set")
        for k, v in overrides.items():
            lines.append(f"    {k}: {_v(v)}")
    lines += ["  children:", "    discovered:", "      hosts:"]
    for rank, h in enumerate(found.hosts):
        lines.append(f"        {h.name}:")
        lines.append(f"          ansible_host: {_v(h.address)}")
        lines.append(f"          rank: {rank}" + ("  # the head: the first of --hosts" if rank == 0 else ""))
        lines.append("          rails:")
        written = set()
        for r in found.rails:
            m = r.members.get(h.name)
            if m and m.netdev not in written:
                written.add(m.netdev)
                lines.append(f"            {m.netdev}: {{hca: {_v(m.hca)}, ipv4: {_v(str(m.ipv4))}}}")
    return "\n".join(lines) + "\n"
