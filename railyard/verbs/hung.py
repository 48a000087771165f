"""The reads behind the shared hung verdict (railyard.checks.hang judges them): `survey` looks at every
engine process group of a plan, every host in parallel, one session each, within one deadline:

1. in one round trip per host: each service's container (`docker inspect`), every process on the host
   (`ps`, from the host side: a container's processes are its main pid's tree), and each engine's hang
   lines (`docker logs --timestamps`, grepped there);
2. for each engine API that its processes and log have not judged already, all at once: its /metrics (its
   token counters, per `engine` label: a DP rank each), a short chat completion per DP rank it holds, each
   within the `vllm_hung_after_s` limit (20 s by default), then its /metrics again; then the verdict.
So a deployment whose every host answers is judged within about that limit, whatever hangs.

A headless rank (multinode_tp's rank 1, a multi-host pd instance's) has no API: it is judged on its own
container, processes and log, and shares its group's counters verdict (the group makes tokens together).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from .. import engines
from ..checks.hang import DEAD, HUNG, LOAD, OK, PS, PS_LIMIT_S, UNKNOWN, Proc, Sample, Verdict, by_engine, hang_lines, \
    judge_engines, parse_ps, ps_unread, role_of, stopped, tree
from ..checks.probes import CHAT_PROBE
from ..facts.probe import Output, Section, joined_script, new_token, split_output
from ..plan.spec import Endpoint, LaunchPlan, Service
from ..transport import Session, Sh, cmd
from ..transport.http import request
from ..transport.runner import Runner

LOG_GREP = ("Application startup complete", "No available shared memory broadcast block", "RPC call to",
            "Watchdog caught collective operation timeout")
LOG_LINES = 2000          # of each engine's log, grepped on the host
# curl's words when nothing listens on the port (exit 7): 8.x "Couldn't connect to server", older "Connection refused"
CONNECT_ERRORS = ("Failed to connect", "Connection refused", "Couldn't connect")
METRICS_LIMIT_S = 4       # /metrics answers in milliseconds; an API that does not is judged by its probe
WAITED = ("timed out", "did not finish within")   # curl's (28), the session's own timeout: the probe waited
RESEND_S = 1              # a probe that failed without waiting is sent again after this, while its limit lasts
INSPECT_LIMIT_S = PS_LIMIT_S   # docker inspect answers in milliseconds too; the same bound for a host under load
RECENT_S = 90             # a hang line counts while it is this recent (vLLM repeats it every 60 s while it waits)


@dataclass
class Answer:
    """What one engine API's probe got: HTTP code (0: none), milliseconds, body or curl's error."""
    code: int
    ms: float
    text: str


@dataclass
class Survey:
    verdicts: list[Verdict]

    @property
    def bad(self) -> list[Verdict]:
        return [v for v in self.verdicts if v.bad]


def api_of(plan: LaunchPlan, svc: Service) -> Endpoint | None:
    """The engine API a service serves (the plan's endpoint with its key, or its own), None for a headless
    rank or a service that runs no engine."""
    if engines.of(svc) is None or "--headless" in [str(w) for w in svc.spec.command] or not svc.spec.ports:
        return None
    return plan.endpoint if svc.name == plan.endpoint.service else Endpoint.of(svc, plan.endpoint.model)


def dp_ranks(svc: Service) -> int:
    """The DP ranks (engine cores) behind one API: one probe each (vLLM's X-data-parallel-rank header sends it to
    that rank), so a hung one holds a request of ours and its own counters say so."""
    return max(1, int(svc.expects("kv_engines", "1") or 1))


def target_of(svc: Service) -> str:
    return svc.name + (f" (rank {svc.rank})" if svc.rank is not None and svc.group_size > 1 else "")


def _look(s: Session, services: list[Service]) -> tuple[dict[int, Proc], dict[str, tuple[int, str, str]],
                                                         dict[str, str], str]:
    """One round trip: ({pid: Proc}, {service: (main pid, status, why not read)}, {service: hang-line log}, error);
    a container whose `docker inspect` was not read has status UNKNOWN."""
    sections = [Section("ps", Sh(PS), timeout=PS_LIMIT_S)]
    for i, svc in enumerate(services):
        sections.append(Section(f"c{i}", cmd("docker", "inspect", "--format", "{{.State.Pid}} {{.State.Status}}",
                                             svc.spec.name), timeout=INSPECT_LIMIT_S))
        if engines.of(svc) is not None:
            tail = cmd("docker", "logs", "--timestamps", "--tail", str(LOG_LINES), svc.spec.name)
            grep = cmd("grep", "-F", *(w for p in LOG_GREP for w in ("-e", p)))
            sections.append(Section(f"l{i}", Sh(f"{tail} 2>&1 | {grep} | tail -n 200"), timeout=30))
    token = new_token()
    r = s.run(joined_script(sections, token), timeout=PS_LIMIT_S + 30)
    if r.error:
        return {}, {}, {}, f"{r.error.kind}: {r.error.message}"
    out = split_output(r.stdout, sections, token)
    if unread := ps_unread(out["ps"]):
        return {}, {}, {}, unread
    procs = parse_ps(out["ps"].text)
    mains, logs = {}, {}
    for i, svc in enumerate(services):
        c = out[f"c{i}"]
        words = c.text.split()
        if c.rc == 0 and len(words) >= 2 and words[0].isdigit():
            mains[svc.name] = (int(words[0]), words[1], "")
        elif "No such" in c.text:
            mains[svc.name] = (0, "missing", "")
        else:
            mains[svc.name] = (0, UNKNOWN, _inspect_unread(c))
        if f"l{i}" in out:
            logs[svc.name] = out[f"l{i}"].text
    return procs, mains, logs, ""


def _inspect_unread(c: Output) -> str:
    """What a `docker inspect` section that gave no pid and status read instead, for the verdict's evidence."""
    if c.timed_out:
        return f"docker inspect did not finish in {INSPECT_LIMIT_S} s"
    if c.rc is None:
        return "docker inspect did not finish before the survey's command ended"
    return f"docker inspect exit {c.rc}: {c.text.strip()[-200:]!r}"


def _metrics(s: Session, ep: Endpoint, progress: tuple[str, ...]) -> Sample:
    code, _, text, _ = request(s, ep, "/metrics", timeout=METRICS_LIMIT_S)
    at = time.time()
    return Sample(by_engine(text, progress + LOAD) if code == 200 else None, at)


def _probe(s: Session, ep: Endpoint, limit: float, rank: int | None, into: dict[str, Answer]) -> None:
    """A chat completion held for `limit` s, to one DP rank (vLLM's X-data-parallel-rank header) or to the API:
    a request that got no HTTP answer and did not wait (its session's channel, a reset connection: not curl's
    timeout) is sent again within the limit, so the probe in flight is the load the verdict judges; a refused connection is the
    answer (nothing listens), as is any HTTP answer."""
    body = CHAT_PROBE | {"model": ep.model}
    deadline = time.monotonic() + limit
    while True:
        left = deadline - time.monotonic()
        code, ms, text, _ = request(s, ep, "/v1/chat/completions", body, timeout=max(1, round(left)),
                                    headers=(("X-data-parallel-rank", str(rank)),) if rank is not None else ())
        into[str(rank or 0)] = Answer(code, ms, text)
        if code or any(w in text for w in CONNECT_ERRORS + WAITED) or deadline - time.monotonic() < RESEND_S:
            return
        time.sleep(RESEND_S)


def _host_survey(s: Session, plan: LaunchPlan, window_s: float) -> list[Verdict]:
    services = plan.on_host(s.host.name)
    procs, mains, logs, error = _look(s, services)
    host = s.host.name
    if error:
        return [Verdict(host, svc.name, target_of(svc), UNKNOWN, [error], "host") for svc in services]
    now = time.time()
    verdicts: dict[str, Verdict] = {}
    for svc in services:   # what the processes and the log already say, before any request
        main, status, unread = mains[svc.name]
        target = target_of(svc)
        if status != "running":
            verdicts[svc.name] = Verdict(host, svc.name, target, UNKNOWN if status == UNKNOWN else DEAD,
                                         [f"container {svc.spec.name} is " + (f"not read: {unread}" if unread
                                                                               else status)], "container")
        elif halted := stopped(mine := tree(procs, main), main):
            verdicts[svc.name] = Verdict(host, svc.name, target, HUNG, [f"stopped: {', '.join(halted)}"], "stopped")
        elif api_of(plan, svc) is None:   # a headless rank, or no engine: its processes and its log are all it shows
            lines = hang_lines(logs.get(svc.name, ""), now, RECENT_S)
            verdicts[svc.name] = (Verdict(host, svc.name, target, HUNG, said(lines), "log") if lines else
                                  Verdict(host, svc.name, target, OK, [f"{len(mine)} process(es) running, none "
                                                                       "stopped"], "processes"))
    open_apis = {svc.name: ep for svc in services if svc.name not in verdicts and (ep := api_of(plan, svc))}
    judged: dict[str, Verdict] = {}
    threads = [threading.Thread(target=lambda n=name, e=ep: judged.__setitem__(n, _probe_engine(
        s, plan.service(n), e, window_s, hang_lines(logs.get(n, ""), now, RECENT_S))), daemon=True)
        for name, ep in open_apis.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(window_s + 30)
    for name in open_apis:
        v = judged.get(name) or Verdict(host, name, target_of(plan.service(name)), UNKNOWN,
                                        ["its probes did not return"], "probe")
        main = mains[name][0]
        ranks = [f"{role_of(p, main)} (pid {p.pid})" for p in tree(procs, main)
                 if role_of(p, main).startswith(("VLLM::", "EngineCore"))]
        if v.state == HUNG and ranks:   # the ranks of its container that wait with it: hang-dump names the odd one
            v.evidence.append(f"its ranks here: {', '.join(ranks)} (inv hang-dump shows where each waits)")
        verdicts[name] = v
    return [verdicts[svc.name] for svc in services]


def said(lines: list[str]) -> list[str]:
    """The engine's own hang lines as evidence: the last one, and how many more."""
    return [f"its log: {lines[-1]}"] + ([f"and {len(lines) - 1} more such line(s)"] if len(lines) > 1 else [])


def _probe_engine(s: Session, svc: Service, ep: Endpoint, window_s: float, lines: list[str]) -> Verdict:
    """/metrics, then one probe per DP rank at once (each within window_s), then /metrics again: the verdict. The
    engine's recent hang lines (`lines`) make it hung when a probe gets no answer, as still counters do; an engine
    that answers every probe is not hung, whatever its log said a minute ago."""
    engine = engines.of(svc)
    assert engine is not None  # api_of gave it an API: it runs an engine
    before = _metrics(s, ep, engine.progress)
    got: dict[str, Answer] = {}
    n = dp_ranks(svc)
    probes = [threading.Thread(target=_probe, args=(s, ep, window_s, r if n > 1 else None, got), daemon=True)
              for r in range(n)]
    for t in probes:
        t.start()
    for t in probes:
        t.join(window_s + 15)
    after = _metrics(s, ep, engine.progress)
    target = target_of(svc)
    refused = [a for a in got.values() if a.code == 0 and any(w in a.text for w in CONNECT_ERRORS)]
    if got and len(refused) == len(got):
        return Verdict(s.host.name, svc.name, target, DEAD,
                       [f"nothing answers on its API port {ep.port} while its container runs (the API process is "
                        f"gone): {refused[0].text[:120]}"], "api")
    # each probe: answered (200), held (no answer while it waited: curl's timeout, or none back), or failed (an
    # HTTP error, or no answer without waiting once resent within the limit): failed is judged on nothing
    failed = {label: a for label, a in got.items()
              if a.code not in (0, 200) or (a.code == 0 and not any(w in a.text for w in WAITED))}
    answered = {str(r): str(r) in got and got[str(r)].code == 200 for r in range(n) if str(r) not in failed}
    judged = judge_engines(before, after, engine.progress, window_s * 0.9, answered)
    for label, a in failed.items():
        judged[label] = (UNKNOWN, "its probe got " + (f"HTTP {a.code}: " if a.code else "no answer: ")
                         + (" ".join(a.text.split())[:160] or "nothing") + ": not judged")
    many = len(judged) > 1
    hung = {label: why for label, (state, why) in judged.items() if state == HUNG}
    if lines and not all(answered.values()):
        return Verdict(s.host.name, svc.name, target, HUNG, said(lines) + [
            (f"DP rank {label}: " if many else "") + why for label, (_, why) in judged.items()], "log")
    if hung:
        return Verdict(s.host.name, svc.name, target + (f" DP rank {', '.join(hung)}" if many else ""), HUNG,
                       [(f"DP rank {label}: " if many else "") + why for label, why in hung.items()], "counters")
    state = OK if all(st == OK for st, _ in judged.values()) else UNKNOWN
    return Verdict(s.host.name, svc.name, target, state,
                   [(f"DP rank {label}: " if many else "") + why for label, (_, why) in judged.items()], "counters")


def survey(runner: Runner, plan: LaunchPlan, window_s: float | None = None) -> Survey:
    """Every engine process group's verdict (railyard.checks.hang), every host at once within one deadline."""
    head = runner.session(plan.endpoint.host)
    window = float(window_s if window_s is not None else head.host.vars.get("vllm_hung_after_s", 20))
    got = runner.each(lambda s: _host_survey(s, plan, window))
    verdicts: list[Verdict] = []
    hung_groups: dict[str, Verdict] = {}
    for h in plan.report_hosts():
        if h not in got.ok:
            verdicts += [Verdict(h, svc.name, target_of(svc), UNKNOWN, [str(got.failed[h].error)], "host")
                         for svc in plan.on_host(h)]
            continue
        vs = got.ok[h]
        verdicts += vs
        for v in vs:
            svc = plan.service(v.service)
            if v.state == HUNG and v.source in ("counters", "log") and svc.group:
                hung_groups.setdefault(svc.group, v)
    # a headless rank of a group whose engine does not move waits with it (it has no API of its own to probe): its
    # verdict says so, naming the evidence; a rank that answered its own probe serves, whatever its group shows
    for i, v in enumerate(verdicts):
        svc = plan.service(v.service)
        g = hung_groups.get(svc.group) if svc.group else None
        if g is not None and v.state == OK and v.source == "processes" and v.service != g.service:
            verdicts[i] = Verdict(v.host, v.service, v.target, HUNG,
                                  [f"waits with its group {svc.group}: {g.host} {g.target} made no token "
                                   f"({g.evidence[0]})"] + v.evidence, "group")
    return Survey(verdicts)
