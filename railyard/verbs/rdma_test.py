"""`inv rdma-test`: qualify every RDMA link with perftest before NCCL is trusted with it (the judging and
the pairing are railyard.checks.links, the output parser railyard.checks.perftest).

1. One round trip per host, all hosts at once: each selected rail's link rate (sysfs `rate`, else
   `ibstat HCA 1`), its RoCE v2 GID index (`show_gids`), whether perftest is there, and for GPU memory
   `ib_write_bw --help` (does it take `--use_cuda_dmabuf`), `nvidia-smi topo -m` and the GPUs' names
   (the cluster GPU nearest each NIC is the one `--use_cuda` names).
2. The pairs (links.rounds: one pair, a ring, or each host alone in loopback), round by round; in each
   round every pair at once, step by step: each rail alone (bandwidth in host memory, then GPU memory,
   then latency), then every rail at once. A host's runs of a step go as sections of one script
   (railyard.facts.probe), every server with the same flags as its client. perftest has no
   wait-for-peer, so a step runs as it is run by hand: the servers
   started and their banners seen (one command per server host), then the clients (one per client host),
   then the servers' output. A server that never comes up fails its run at once, without a client; a
   server whose client failed is stopped, not waited for: a peer that never serves costs seconds.
3. Each run judged (links.judge), GPU memory against the same rail's host memory.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Callable

from ..checks import FAIL, SKIP, WARN, CheckResult
from ..checks import perftest
from ..checks.links import BW, GPU, HOST, LAT, Limits, Measure, Pair, expected, judge, rounds
from ..errors import UsageError
from ..facts.gpu import parse_topo_matrix
from ..facts.net import parse_show_gids, roce_v2_index
from ..facts.probe import Output, Section, joined_script, new_token, split_output
from ..inventory import Host, Inventory
from ..plan.spec import Dial
from ..report import NO_HOST, Report
from ..transport import Session, Sh, cmd, q
from ..transport.runner import Runner

SERVER_UP_S = 15       # a server whose banner has not come by then is not up (perftest starts in milliseconds)
CONNECT_S = 3          # a client refused this long although its server's banner came: it cannot reach it
BANNER = "Waiting for client"   # the server's "Waiting for client to connect" (rdma_cm: "... rdma_cm QP to connect")
# a client whose server is not listening yet (tests/fixtures/real/perftest/perftest-228_*)
CONNECT_FAILED = ("Couldn't connect to", "Unable to open file descriptor for socket connection")
LAT_ITERS = 2000       # ib_write_lat -n: about 10 ms of a healthy link
LAT_SIZE = 2           # bytes (perftest's own default for latency)
RELATION = ("PIX", "PXB", "PHB", "NODE", "SYS")   # nvidia-smi topo -m, nearest first (NV# never names a NIC)
MEMORIES = {"host": (HOST,), "gpu": (GPU,), "both": (HOST, GPU)}


@dataclass
class Link:
    """What step 1 read of one host's rail."""
    rate_gbps: float | None
    rate_from: str
    gid: int | None
    cuda: int | None          # the cluster GPU nearest its NIC


@dataclass
class HostFacts:
    links: dict[str, Link] = field(default_factory=dict)
    tools: set[str] = field(default_factory=set)
    dmabuf: bool = False
    problems: list[tuple[str, str]] = field(default_factory=list)   # (status, what): fail or warn


@dataclass
class LinkTest:
    hosts: list[str]
    rails: list[str]
    memory: tuple[str, ...]
    rounds: list[list[Pair]]
    measures: list[Measure]
    checks: list[CheckResult]           # what stopped a pair before it ran (facts), as report rows
    limits: Limits
    settings: dict
    took_s: float


def selected(inv: Inventory, hosts: str | None, rails: str | None, memory: str) -> tuple[list[Host], list[str]]:
    if memory not in MEMORIES:
        raise UsageError(f"--memory {memory!r}: must be host, gpu or both")
    chosen = inv.select(hosts)
    common = [r for r in chosen[0].rails if all(r in h.rails for h in chosen)]
    if not rails:
        if not common:
            raise UsageError(f"{inv.path}: the hosts {', '.join(h.name for h in chosen)} share no rail (rails:)")
        return chosen, common
    want = [r.strip() for r in rails.split(",") if r.strip()]
    for r in want:
        lacking = [h.name for h in chosen if r not in h.rails]
        if lacking:
            raise UsageError(f"--rails {rails!r}: {lacking[0]} has no rail {r!r} in {inv.path} "
                             f"(its rails: {', '.join(next(h for h in chosen if h.name == lacking[0]).rails)})")
    return chosen, want


def limits_of(v: dict) -> Limits:
    return Limits(float(v["rdma_test_min_fraction"]), float(v["rdma_test_min_gpu_ratio"]),
                  float(v["rdma_test_max_lat_us"]))


# ---------------------------------------------------------------- 1. facts


def fact_sections(h: Host, rails: list[str], memory: tuple[str, ...]) -> list[Section]:
    out = [Section("tools", Sh("for t in ib_write_bw ib_write_lat; do command -v \"$t\" >/dev/null && echo \"$t\"; "
                               "done; true"))]
    for r in rails:
        hca = h.rails[r].hca
        sysfs = f"/sys/class/infiniband/{hca}/ports/1/rate"
        out.append(Section(f"rate.{r}", Sh(f"if [ -r {q(sysfs)} ]; then echo \"sysfs: $(cat {q(sysfs)})\"; "
                                           f"else {cmd('ibstat', hca, '1')}; fi")))
        out.append(Section(f"gids.{r}", cmd("show_gids", hca), "show_gids"))
    if GPU in memory:
        out += [Section("help", Sh("ib_write_bw --help 2>&1; true")),
                Section("topo", cmd("nvidia-smi", "topo", "-m"), "nvidia-smi"),
                Section("gpus", cmd("nvidia-smi", "--query-gpu=index,name", "--format=csv,noheader"), "nvidia-smi")]
    return out


def read_facts(h: Host, rails: list[str], memory: tuple[str, ...], out: dict[str, Output]) -> HostFacts:
    f = HostFacts()
    f.tools = set(out["tools"].text.split()) if out["tools"].ok else set()
    for t in ("ib_write_bw", "ib_write_lat"):
        if t not in f.tools:
            f.problems.append((FAIL, f"{t} is not on {h.name}'s PATH: install perftest (Debian/Ubuntu: apt-get "
                                     "install perftest; RHEL: dnf install perftest; MLNX_OFED and DOCA ship it)"))
    topo, nearest = None, {}
    if GPU in memory:
        f.dmabuf = "--use_cuda_dmabuf" in out["help"].text
        if "--use_cuda" not in out["help"].text and "ib_write_bw" in f.tools:
            f.problems.append((WARN, f"{h.name}'s ib_write_bw was built without CUDA (its --help has no --use_cuda): "
                                     "GPU memory cannot be measured there"))
        try:
            topo = parse_topo_matrix(out["topo"].text) if out["topo"].ok else None
        except ValueError:
            topo = None
        names = dict(line.split(",", 1) for line in out["gpus"].text.splitlines() if "," in line) \
            if out["gpus"].ok else {}
        want = str(h.vars.get("cluster_gpu_name") or "")
        cluster = {int(i) for i, n in names.items() if i.strip().isdigit() and want in n} or \
            {int(i) for i in names if i.strip().isdigit()}
        if topo:
            for r in rails:
                hca = h.rails[r].hca
                ranked = sorted((RELATION.index(t.nics[hca]) if t.nics.get(hca) in RELATION else len(RELATION), i)
                                for i, t in topo.items() if i in cluster)
                nearest[r] = ranked[0][1] if ranked else None
        else:
            f.problems.append((WARN, f"{h.name}: `nvidia-smi topo -m` gave no matrix: the GPU nearest each NIC is "
                                     "not known"))
    for r in rails:
        hca, rate_text = h.rails[r].hca, out[f"rate.{r}"].text
        rate, source = None, ""
        if rate_text.startswith("sysfs: "):
            rate, source = perftest.parse_sysfs_rate(rate_text[7:]), f"/sys/class/infiniband/{hca}/ports/1/rate"
        elif out[f"rate.{r}"].ok:
            rate, source = perftest.parse_ibstat_rate(rate_text).get(hca), f"ibstat {hca} 1"
        gids = parse_show_gids(out[f"gids.{r}"].text) if out[f"gids.{r}"].ok else []
        gid = roce_v2_index(gids, hca, h.rails[r].ip)
        f.links[r] = Link(rate, source, gid, nearest.get(r))
    return f


# ---------------------------------------------------------------- 2. the runs


@dataclass(frozen=True)
class Run:
    """One perftest run of a step: its server and client flags are the same but for the address."""
    pair: Pair
    rail: str
    memory: str
    test: str
    together: bool
    port: int


def flags(run: Run, end: Host, facts: HostFacts, settings: dict) -> list[str]:
    """The perftest command of one end (the client's takes the server's address after these)."""
    link = facts.links[run.rail]
    tool = "ib_write_lat" if run.test == LAT else "ib_write_bw"
    argv = [tool, "-d", end.rails[run.rail].hca, "-F", "-p", str(run.port)]
    if run.test == BW:
        argv += ["--report_gbits", "-D", str(settings["duration_s"]), "-q", str(settings["qps"]),
                 "-s", str(settings["size"])]
    else:
        argv += ["-n", str(LAT_ITERS), "-s", str(LAT_SIZE)]
    if settings["rdma_cm"]:
        argv.append("-R")
    elif link.gid is not None:
        argv += ["-x", str(link.gid)]
    if run.memory == GPU:
        argv.append(f"--use_cuda={link.cuda if link.cuda is not None else 0}")
        if facts.dmabuf:
            argv.append("--use_cuda_dmabuf")
    return argv


def server_start(argv: list[str], log: str, limit: int) -> Sh:
    """Start one server detached (it outlives this command; its output in `log`), then wait up to SERVER_UP_S
    for its banner: `up`, or what it printed before it died or the wait ended."""
    return Sh(f"setsid timeout -k 2 {int(limit)} {cmd(*argv)} </dev/null >{q(log)} 2>&1 & p=$!; "
              f"echo $p >{q(log + '.pid')}; "
              f"end=$(($(date +%s) + {SERVER_UP_S})); "
              f"until grep -q {q(BANNER)} {q(log)} 2>/dev/null || ! kill -0 $p 2>/dev/null "
              "|| [ $(date +%s) -ge $end ]; do sleep 0.1; done; "
              f"if grep -q {q(BANNER)} {q(log)}; then echo up; else cat {q(log)}; rm -f {q(log)} {q(log + '.pid')}; "
              "kill $p 2>/dev/null; exit 1; fi")


def server_end(log: str, stop: bool, wait: int) -> Sh:
    """The server's output once it has ended (stopped at once where its client failed: it would wait for one)."""
    pid, out = q(log + ".pid"), q(log)
    return Sh(f"p=$(cat {pid} 2>/dev/null); "
              + ("[ -n \"$p\" ] && kill $p 2>/dev/null; " if stop else "")
              + f"end=$(($(date +%s) + {wait})); while [ -n \"$p\" ] && kill -0 $p 2>/dev/null && "
              "[ $(date +%s) -lt $end ]; do sleep 0.2; done; "
              "if [ -n \"$p\" ] && kill -0 $p 2>/dev/null; then kill $p; echo 'railyard: stopped: still running'; fi; "
              f"cat {out}; rm -f {out} {pid}")


def client_body(argv: list[str], address: str) -> Sh:
    """The client, tried again for a moment while its server's port refuses it (the banner can come just
    before the listen)."""
    line = cmd(*argv, address)
    waits = "|".join(re.escape(w) for w in CONNECT_FAILED)
    return Sh(f"end=$(($(date +%s) + {CONNECT_S})); while :; do o=$({line} 2>&1); rc=$?; "
              f"if [ $rc -eq 0 ] || ! printf '%s' \"$o\" | grep -Eq {q(waits)} || [ $(date +%s) -ge $end ]; "
              "then break; fi; sleep 0.3; done; printf '%s\\n' \"$o\"; exit $rc")


def _round_trip(runner: Runner, hosts: dict[str, Host], sections: dict[str, list[Section]],
                limit: int) -> dict[str, dict[str, Output]]:
    """One command per host, all hosts at once: {host: {section: output}}."""
    token = new_token()

    def one(s: Session) -> dict[str, Output]:
        secs = sections[s.host.name]
        res = s.run(joined_script(secs, token), timeout=limit + 15)
        if res.error:
            return {sec.key: Output(None, f"{res.error.kind}: {res.error.message}") for sec in secs}
        return split_output(res.stdout, secs, token)

    got = runner.each(one, [hosts[n] for n in sections])
    return {name: got.ok[name] if name in got.ok else
            {sec.key: Output(None, str(got.failed[name].error)) for sec in secs} for name, secs in sections.items()}


def step(runner: Runner, hosts: dict[str, Host], facts: dict[str, HostFacts], runs: list[Run],
         settings: dict) -> dict[Run, tuple[Output, Output]]:
    """Every run of one step at once, as perftest is run by hand: the servers started and their banners
    seen (one command per server host), then the clients (one per client host), then the servers' output
    (a server whose client failed is stopped, not waited for). {run: (server output, client output)}."""
    duration = int(settings["duration_s"])
    limit = SERVER_UP_S + CONNECT_S + duration + 30
    tag = new_token()[:12]
    logs = {i: f"/tmp/railyard-rdma-test-{tag}-{i}.log" for i in range(len(runs))}
    starts: dict[str, list[Section]] = {}
    for i, r in enumerate(runs):
        srv = hosts[r.pair.server]
        starts.setdefault(srv.name, []).append(
            Section(f"s{i}", server_start(flags(r, srv, facts[srv.name], settings), logs[i], limit),
                    timeout=SERVER_UP_S + 5))
    started = _round_trip(runner, hosts, starts, SERVER_UP_S + 5)
    up = {i for i, r in enumerate(runs) if started[r.pair.server][f"s{i}"].ok}
    clients: dict[str, list[Section]] = {}
    for i, r in enumerate(runs):
        if i in up:
            srv, cli = hosts[r.pair.server], hosts[r.pair.client]
            clients.setdefault(cli.name, []).append(
                Section(f"c{i}", client_body(flags(r, cli, facts[cli.name], settings), srv.rails[r.rail].ip),
                        timeout=CONNECT_S + duration + 30))
    ran = _round_trip(runner, hosts, clients, CONNECT_S + duration + 30) if clients else {}
    ends: dict[str, list[Section]] = {}
    for i, r in enumerate(runs):
        if i in up:
            failed = not ran[r.pair.client][f"c{i}"].ok
            ends.setdefault(r.pair.server, []).append(Section(f"e{i}", server_end(logs[i], failed, 15), timeout=25))
    ended = _round_trip(runner, hosts, ends, 25) if ends else {}
    never = Output(None, "not run: its server did not come up")
    return {r: ((ended[r.pair.server][f"e{i}"] if i in up else started[r.pair.server][f"s{i}"]),
                ran[r.pair.client][f"c{i}"] if i in up else never) for i, r in enumerate(runs)}


def steps_of(pairs: list[Pair], rails: list[str], memory: tuple[str, ...], port: int) -> list[list[Run]]:
    """A round's steps: each rail alone (bandwidth per memory kind, then latency), then every rail at once."""
    out = []
    for k, rail in enumerate(rails):
        for mem in memory:
            out.append([Run(p, rail, mem, BW, False, port + k) for p in pairs])
        out.append([Run(p, rail, HOST, LAT, False, port + k) for p in pairs])
    if len(rails) > 1:
        for mem in memory:
            out.append([Run(p, rail, mem, BW, True, port + k) for p in pairs for k, rail in enumerate(rails)])
    return out


def measured(run: Run, outs: tuple[Output, Output], hosts: dict[str, Host], facts: dict[str, HostFacts]) -> Measure:
    srv, cli = hosts[run.pair.server], hosts[run.pair.client]
    rates = {n: facts[n].links[run.rail].rate_gbps for n in {srv.name, cli.name}}
    m = Measure(run.pair, run.rail, srv.rails[run.rail].hca, cli.rails[run.rail].hca, run.memory, run.test,
                run.together, expected(rates))
    if run.memory == GPU:
        m.cuda = (facts[srv.name].links[run.rail].cuda, facts[cli.name].links[run.rail].cuda)
    server, client = outs
    parsed = perftest.parse(client.text)
    if run.test == BW and parsed.bw is not None:
        m.gbps = parsed.bw.avg_gbps
    elif run.test == LAT and parsed.lat is not None:
        m.lat_us = parsed.lat.avg_us
    else:
        mine, theirs = _one_line(parsed.error) or _last(client), _one_line(perftest.parse(server.text).error)
        m.error = f"client on {cli.name}: {mine or 'no output'}" + (
            f"; server on {srv.name}: {theirs or _last(server)}" if (theirs or _last(server)) else "")
    return m


def _one_line(text: str) -> str:
    return " / ".join(ln.strip() for ln in text.splitlines() if ln.strip())


def _last(o: Output) -> str:
    lines = [ln.strip() for ln in o.text.splitlines() if ln.strip() and not ln.startswith("@@")]
    if o.rc is None:
        return "it printed nothing before its limit" if not lines else lines[-1]
    return lines[-1] if lines else ""


def perftest_dials(inv: Inventory) -> list[Dial]:
    """The TCP connections rdma-test's pairs open (each client to its server's rail address, rail k on
    rdma_test_port + k), for preflight's port plan."""
    hosts = {h.name: h for h in inv.hosts}
    shared = [r for r in inv.head.rails if all(r in h.rails for h in inv.hosts)]
    port = int(inv.head.vars["rdma_test_port"])
    return [Dial(p.client, p.server, hosts[p.server].rails[r].ip, port + k, f"rdma-test's perftest on {r}")
            for pairs in rounds(list(hosts)) for p in pairs if p.client != p.server for k, r in enumerate(shared)]


# ---------------------------------------------------------------- the verb


def rdma_test(inv: Inventory, hosts: str | None = None, rails: str | None = None, memory: str = "host",
              duration: int | None = None, say: Callable[[str], None] | None = None,
              sessions: dict[str, Session] | None = None) -> LinkTest:
    """sessions: ready-made sessions by host name (FakeSessions in unit tests)."""
    started = time.monotonic()
    chosen, rail_names = selected(inv, hosts, rails, memory)
    v = inv.head.vars
    settings = {"duration_s": int(duration or v["rdma_test_duration_s"]), "qps": int(v["rdma_test_qps"]),
                "size": int(v["rdma_test_size"]), "rdma_cm": bool(v["rdma_test_rdma_cm"]),
                "port": int(v["rdma_test_port"])}
    if duration is not None and not 1 <= duration <= 3600:
        raise UsageError(f"--duration {duration}: must be 1 to 3600 seconds")
    kinds = MEMORIES[memory]
    by_name = {h.name: h for h in chosen}
    plan = rounds([h.name for h in chosen])
    checks: list[CheckResult] = []
    measures: list[Measure] = []
    with Runner(chosen, sessions=sessions) as runner:
        token = new_token()
        secs = {h.name: fact_sections(h, rail_names, kinds) for h in chosen}

        def look(s: Session) -> HostFacts:
            res = s.run(joined_script(secs[s.host.name], token), timeout=40)
            if res.error:
                raise RuntimeError(f"{res.error.kind}: {res.error.message}")
            return read_facts(s.host, rail_names, kinds, split_output(res.stdout, secs[s.host.name], token))

        got = runner.each(look)
        facts: dict[str, HostFacts] = dict(got.ok)
        for name, r in got.failed.items():
            checks.append(CheckResult(name, "rdma_test", FAIL, f"not read: {r.error}"))
        for name, f in facts.items():
            for status, problem in f.problems:
                checks.append(CheckResult(name, "perftest", status, problem))
        ready = {n for n, f in facts.items() if {"ib_write_bw", "ib_write_lat"} <= f.tools}
        for i, pairs in enumerate(plan, 1):
            runnable = [p for p in pairs if p.server in ready and p.client in ready]
            for p in pairs:
                if p not in runnable:
                    checks.append(CheckResult(p.client, "rdma_test", FAIL, f"{p.name}: not run: perftest is missing "
                                              "or the host was not read (its own row says which)"))
            for runs in steps_of(runnable, rail_names, kinds, settings["port"]):
                if not runs:
                    continue
                if say:
                    r0 = runs[0]
                    say(f"round {i}/{len(plan)}: {len(runs)} run(s) at once: "
                        f"{'every rail' if r0.together else r0.rail}, {r0.memory} memory, "
                        f"{'bandwidth' if r0.test == BW else 'latency'}")
                for run, outs in step(runner, by_name, facts, runs, settings).items():
                    measures.append(measured(run, outs, by_name, facts))
    lim = limits_of(v)
    host_bw = {(m.pair, m.rail, m.together): m.gbps for m in measures if m.test == BW and m.memory == HOST}
    for m in measures:
        judge(m, lim, host_bw.get((m.pair, m.rail, m.together)))
    return LinkTest([h.name for h in chosen], rail_names, kinds, plan, measures, checks, lim, settings,
                    time.monotonic() - started)


def link_report(t: LinkTest) -> Report:
    rows = list(t.checks)
    for m in t.measures:
        rows.append(CheckResult(m.pair.client, f"rdma_{m.test}", m.status, f"{m.where}: {m.detail}",
                                evidence=m.error))
    if not t.measures and not rows:
        rows.append(CheckResult(NO_HOST, "rdma_test", SKIP, "nothing to run"))
    data = {
        "hosts": t.hosts, "rails": t.rails, "memory": list(t.memory),
        "rounds": [[{"server": p.server, "client": p.client} for p in r] for r in t.rounds],
        "settings": t.settings,
        "limits": {"min_fraction": t.limits.min_fraction, "min_gpu_ratio": t.limits.min_gpu_ratio,
                   "max_lat_us": t.limits.max_lat_us},
        "results": [{"server": m.pair.server, "client": m.pair.client, "rail": m.rail, "hca": m.hca,
                     "client_hca": m.client_hca, "memory": m.memory, "test": m.test, "together": m.together,
                     "gbps": m.gbps, "lat_us": m.lat_us, "expected_gbps": m.expected_gbps,
                     "cuda": list(m.cuda) if m.memory == GPU else None, "status": m.status, "detail": m.detail,
                     "error": m.error} for m in t.measures],
        "took_s": round(t.took_s, 1),
    }
    return Report(rows, data)

