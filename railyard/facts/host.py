"""What a plan needs to know about each host, gathered in one round trip per host.

    facts = gather(runner, hosts, needs={"gids", "topology"})
    facts["A"].gpus            # the GPUs whose name matches cluster_gpu_name, by index
    facts["A"].cpus_of(gpus)   # their NUMA node's CPUs, e.g. "0-55,112-167"

Sections are commands plus the pure parsers of railyard.facts; a missing fact becomes a
problem line with its fix, never an exception.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from . import ParseError
from .gpu import (Gpu, apps_section, gpus_section, lscpu_section, parse_compute_apps, parse_cpu_list, parse_gpus,
                  parse_lscpu_numa, parse_topo_matrix, select_gpu, topo_section)
from .net import gids_section, parse_show_gids, roce_v2_index
from ..inventory import Host
from .probe import Section, joined_script, new_token, split_output
from ..transport.runner import Runner
from ..transport import Session, Sh


@dataclass
class HostFacts:
    host: Host
    home: str | None = None
    gpus: list[Gpu] = field(default_factory=list)
    gid_index: int | None = None
    cpus_by_gpu: dict[int, list[int]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def gpu_uuid(self) -> str | None:
        """The first selected GPU (one GPU per rank on a station)."""
        return self.gpus[0].uuid if self.gpus else None

    def cpus_of(self, gpus: list[Gpu]) -> str:
        """The CPUs of these GPUs' NUMA nodes as a cpuset list ("0-55,112-167"); "" when unknown."""
        cpus: set[int] = set()
        for g in gpus:
            if g.index not in self.cpus_by_gpu:
                return ""
            cpus.update(self.cpus_by_gpu[g.index])
        return cpu_list(sorted(cpus))


def cpu_list(cpus: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5", the form docker --cpuset-cpus and lscpu use."""
    out: list[str] = []
    start: int | None = None
    prev: int | None = None
    for c in [*cpus, None]:
        if start is None:
            start = prev = c
        elif c is not None and prev is not None and c == prev + 1:
            prev = c
        else:
            out.append(f"{start}-{prev}" if prev != start else str(start))
            start = prev = c
    return ",".join(out)


def on_host(path: str, home: str | None) -> str:
    """A `~/...` path of the inventory as the absolute path on a host whose $HOME is home."""
    return (home or "~").rstrip("/") + path[1:] if path.startswith("~/") else path


def _sections(h: Host, needs: set[str]) -> list[Section]:
    out = [Section("home", Sh('printf "%s\\n" "$HOME"')), gpus_section()]
    if "gids" in needs:
        out.append(gids_section(h.serve_rail.hca))
    if "topology" in needs:
        out += [topo_section(), lscpu_section()]
    return out


def read(s: Session, needs: set[str], count: int = 1) -> HostFacts:
    h = s.host
    f = HostFacts(h)
    sections = _sections(h, needs)
    token = new_token()
    r = s.run(joined_script(sections, token), timeout=60)
    if r.error:
        f.problems.append(f"{h.name}: {r.error.kind}: {r.error.message} (fix: {r.error.hint})")
        return f
    out = split_output(r.stdout, sections, token)
    f.home = out["home"].text.strip() or None
    sel = h.vars["cluster_gpu_name"]
    if out["gpus"].missing_tool:
        f.problems.append(f"{h.name}: GPU_UUID: nvidia-smi not found (fix: install the NVIDIA driver utilities)")
    else:
        try:
            chosen = select_gpu(parse_gpus(out["gpus"].text), sel) if out["gpus"].ok else []
        except ParseError:
            chosen = []
        if not chosen:
            f.problems.append(f"{h.name}: GPU_UUID: no GPU matches {sel!r} (fix: check cluster_gpu_name against "
                              "`nvidia-smi -L`)")
        elif len(chosen) < count:
            f.problems.append(f"{h.name}: GPUs: {len(chosen)} GPU(s) match {sel!r}, the layout needs {count} (fix: "
                              "check cluster_gpus_per_host and the parallel sizes against `nvidia-smi -L`)")
        else:
            f.gpus = sorted(chosen, key=lambda g: g.index)
    if "gids" in needs:
        rail = h.serve_rail
        if out["gids"].missing_tool:
            f.problems.append(f"{h.name}: GID_INDEX: show_gids not found (fix: install DOCA-Host / MLNX_OFED tools)")
        else:
            f.gid_index = roce_v2_index(parse_show_gids(out["gids"].text), rail.hca, rail.ip)
            if f.gid_index is None:
                f.problems.append(f"{h.name}: GID_INDEX: no RoCE v2 GID for {rail.ip} on {rail.hca} (fix: put "
                                  f"{rail.ipv4} on {rail.name}; `inv preflight` shows the gid check)")
    if "topology" in needs and f.gpus:
        f.cpus_by_gpu = _gpu_cpus(out["topo"].text if out["topo"].ok else "",
                                  out["lscpu"].text if out["lscpu"].ok else "")
        if not f.cpus_of(f.gpus):
            f.problems.append(f"{h.name}: CPUSET: no NUMA affinity for the GPUs in `nvidia-smi topo -m` or `lscpu` "
                              "(fix: set vllm_cpuset to a CPU list, or \"\" for no pinning)")
    return f


def _gpu_cpus(topo: str, lscpu: str) -> dict[int, list[int]]:
    """GPU index -> CPUs: topo -m's CPU Affinity, or the CPUs lscpu lists for its NUMA Affinity."""
    try:
        matrix = parse_topo_matrix(topo) if topo else {}
        numa = parse_lscpu_numa(lscpu) if lscpu else {}
    except ParseError:
        return {}
    out: dict[int, list[int]] = {}
    for index, g in matrix.items():
        try:
            cpus = parse_cpu_list(g.cpu_affinity) if g.cpu_affinity and g.cpu_affinity != "N/A" else []
        except (ParseError, ValueError):
            cpus = []
        if not cpus and g.numa_affinity is not None:
            cpus = numa.get(g.numa_affinity, [])
        if cpus:
            out[index] = cpus
    return out


def gather(runner: Runner, hosts: list[Host], needs: set[str], count: int = 1) -> dict[str, HostFacts]:
    got = runner.each(lambda s: read(s, needs, count), hosts)
    return {name: got.ok[name] if name in got.ok
            else HostFacts(runner.session(name).host, problems=[f"{name}: {got.failed[name].error}"])
            for name in got}


@dataclass
class GpuUsage:
    used_mib: int | None
    total_mib: int | None
    processes: list  # facts.GpuProcess on these GPUs
    states: dict = field(default_factory=dict)  # pid -> its state letter in /proc/PID/stat (R, S, D, T, ...)


# the state letter of every compute process on the host's GPUs: /proc/PID/stat's third field, read
# after the last ") " (a process name may hold spaces and parentheses)
PROC_STATES = Sh("for p in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader); do "
                 "s=$(cat /proc/$p/stat 2>/dev/null) && printf '%s %s\\n' \"$p\" \"${s##*) }\" | cut -d' ' -f1,2; done")


def gpu_usage(s: Session, uuids: tuple[str, ...] | list[str]) -> GpuUsage:
    """Memory used on these GPUs (by UUID), the compute processes holding them and their process
    states, in one round trip."""
    sections = [gpus_section(), apps_section(), Section("states", PROC_STATES, "nvidia-smi")]
    token = new_token()
    r = s.run(joined_script(sections, token), timeout=60)
    if r.error:
        return GpuUsage(None, None, [])
    out = split_output(r.stdout, sections, token)
    wanted = set(uuids)
    try:
        gpus = [g for g in parse_gpus(out["gpus"].text) if g.uuid in wanted] if out["gpus"].ok else []
        procs = [a for a in parse_compute_apps(out["apps"].text) if a.gpu_uuid in wanted] if out["apps"].ok else []
    except ParseError:
        gpus, procs = [], []
    states = dict(ln.split() for ln in out["states"].text.splitlines() if len(ln.split()) == 2) if out["states"].ok else {}
    if not gpus:
        return GpuUsage(None, None, procs, states)
    return GpuUsage(sum(g.memory_used_mib for g in gpus), sum(g.memory_total_mib for g in gpus), procs, states)
