"""`inv recover`'s look at a replicas deployment, end to end against a fake docker host (the containers'
states, nvidia-smi's compute processes, ps, the replicas' /health): the short path for a replica whose GPUs
are free, the long one while LMCache keeps a killed replica's memory mapped, blocked by a process of no
container, and nothing to do; the look itself changes nothing."""

from __future__ import annotations

from railyard.layouts.replicas import recover as R
from railyard.render import docker
from railyard.testing import FakeDockerHost, FakeGpuProcess
from railyard.transport.runner import Runner

from .test_replicas_plan import UUIDS, replicas_plan


def deployed():
    """Every service of the replicas layout running, each replica's workers on its own four GPUs."""
    inv, plan = replicas_plan()
    h = inv.hosts[0]
    host = FakeDockerHost(h, gpus=[(i, u, "NVIDIA B200", 0, 183359) for i, u in enumerate(UUIDS)])
    for svc in plan.services():
        gpu = [(u, f"VLLM::Worker_TP{i}", 160000) for i, u in enumerate(svc.spec.gpus.uuids)] if svc.role == "replica" else []
        host.behave(svc.spec.name, gpu=gpu)
        host.container(svc.spec.name, docker.config_hash(plan, svc))
    return inv, plan, host


def survey(inv, plan, host, which=None, verdicts=None):
    with Runner(inv.hosts, sessions={host.name: host.session}) as runner:
        rec, _ = R.survey(plan, runner, which, verdicts or [])
    assert not host.unexpected, host.unexpected
    return rec


def r1(plan):
    return plan.service("r1")


def test_a_replica_that_exited_cleanly_with_its_gpus_free_comes_back_alone_on_the_short_path():
    inv, plan, host = deployed()
    host.kill(r1(plan).spec.name, 0)
    rec = survey(inv, plan, host)
    assert rec.path == "short" and rec.services == ["r1"]
    assert rec.why == ["r1 is exited (exit code 0)", "r1: its GPUs hold no other process"]
    assert not any("restart LMCache" in s for s in rec.steps)               # LMCache is left alone
    assert host.events == [f"kill {r1(plan).spec.name}"]                    # the look itself touched nothing


def test_a_killed_replica_whose_gpus_lmcache_still_holds_takes_the_long_path():
    inv, plan, host = deployed()
    host.kill(r1(plan).spec.name, 137)
    lmcache = plan.service("lmcache").spec.name
    for i, u in enumerate(r1(plan).spec.gpus.uuids):   # its KV memory, mapped over CUDA IPC, outlives the crash
        host.gpu_procs.append(FakeGpuProcess(u, host.containers[lmcache].pid + 1, "python3", 52224, lmcache))
    rec = survey(inv, plan, host)
    assert rec.path == "long" and rec.services == ["r0", "r1"]
    assert any(w.startswith("LMCache still holds r1's GPUs") and "GPU 4: pid" in w and f"({lmcache})" in w
               for w in rec.why), rec.why
    assert rec.steps[:2] == ["wait for requests in flight on r0", "stop r0"]
    assert host.containers[plan.service("r0").spec.name].running            # r0 untouched by the look


def test_a_process_of_no_container_on_the_crashed_replicas_gpus_blocks_recover():
    inv, plan, host = deployed()
    host.kill(r1(plan).spec.name, 137)
    host.gpu_procs.append(FakeGpuProcess(r1(plan).spec.gpus.uuids[1], 999, "python3", 2048))
    rec = survey(inv, plan, host)
    assert rec.path == "blocked" and not rec.ok
    assert "GPU 5: pid 999 python3 2.0 GiB (no container)" in " ".join(rec.why)


def test_a_replica_that_runs_but_does_not_answer_health_is_restarted_and_all_well_is_nothing_to_do():
    inv, plan, host = deployed()
    assert survey(inv, plan, host).path == "none"
    host.http(r1(plan).spec.ports[0], "/health", (0, ""))
    rec = survey(inv, plan, host)
    assert rec.path == "short" and rec.why == ["r1 runs but /health does not answer"]
    assert rec.steps[1:3] == ["wait for r1's requests in flight", "stop r1"]


def test_a_hung_replica_takes_the_short_path_and_is_killed_not_drained():
    """/health still answers 200 for a replica whose engine is stopped: the stopped process on its GPU says hung."""
    inv, plan, host = deployed()
    for p in host.gpu_procs:
        if p.container == r1(plan).spec.name:
            p.state = "T"
    rec = survey(inv, plan, host)
    assert rec.path == "short" and rec.services == ["r1"] and rec.hung == ["r1"]
    assert rec.why[0].startswith("r1 is hung: VLLM::Worker_TP0 (pid ") and "is stopped (state Tl)" in rec.why[0]
    assert any(s.startswith("kill r1") for s in rec.steps) and not any(s.startswith("wait for") for s in rec.steps)


def test_a_replica_whose_counters_stand_still_under_its_probe_is_hung_and_killed_whatever_its_processes_say():
    """The shared verdict (railyard.checks.hang): every process of r1 runs (state S), /health answers 200, but a
    request runs on it and its token counters did not move: hung, so killed, never drained."""
    from railyard.checks.hang import Verdict
    inv, plan, host = deployed()
    why = "1 request(s) running and 0 waiting, and its token counters did not move in 20 s (...)"
    rec = survey(inv, plan, host, verdicts=[Verdict(host.name, "r1", "r1", "hung", [why], "counters"),
                                            Verdict(host.name, "r0", "r0", "ok", ["answered 1 probe(s)"], "counters")])
    assert rec.path == "short" and rec.services == ["r1"] and rec.hung == ["r1"]
    assert rec.why[0] == f"r1 is hung: {why}, whatever /health answers"
    assert any(s.startswith("kill r1") for s in rec.steps) and not any(s.startswith("wait for") for s in rec.steps)


# ---------------------------------------------------------------- the group path (every other layout)

def two_stations():
    """The two stations' fake hosts, each running its rank with its worker on its GPU."""
    from .test_plan import station_plan
    inv, plan, facts = station_plan()
    hosts = {}
    for svc in plan.services():
        gpu = facts[svc.host].gpus[0]
        h = FakeDockerHost(inv.host(svc.host), gpus=[(gpu.index, gpu.uuid, gpu.name, 0, gpu.memory_total_mib)])
        h.behave(svc.spec.name, gpu=[(gpu.uuid, f"VLLM::Worker_TP{svc.rank}", 60000)])
        h.container(svc.spec.name, docker.config_hash(plan, svc))
        hosts[svc.host] = h
    return inv, plan, hosts


def group_survey(inv, plan, hosts, verdicts=()):
    from railyard.verbs.hung import Survey
    from railyard.verbs.recover import survey_group
    with Runner(inv.hosts, sessions={n: h.session for n, h in hosts.items()}) as runner:
        return survey_group(plan, runner, Survey(list(verdicts)))


def test_a_hung_rank_takes_the_whole_group_down_the_head_first_and_up_in_rank_order():
    inv, plan, hosts = two_stations()
    hosts["B"].gpu_procs[0].state = "T"
    rec = group_survey(inv, plan, hosts)
    head, worker = plan.service(plan.endpoint.service), next(s for s in plan.services() if s.host == "B")
    assert rec.path == "group" and rec.hung == [worker.name] and set(rec.services) == {head.name, worker.name}
    assert rec.why[0].startswith(f"{worker.name} on B: hung: VLLM::Worker_TP1 (pid ")
    assert rec.steps[0] == (f"stop {head.name}, {worker.name}, in that order; kill {worker.name} (a hung rank never "
                            "finishes its collective, a stopped process never sees SIGTERM)")
    assert rec.steps[1] == ("compare the checkpoint on B with A's (by content; the digest cache makes an unchanged tree "
                            "a stat pass)")
    starts = [s for s in rec.steps if s.startswith("start ")]
    assert starts[0].startswith(f"start {worker.name} ") and starts[-1].startswith(f"start {head.name} ")
    assert all(not h.events for h in hosts.values())                 # the look changed nothing


def test_a_group_whose_engine_makes_no_token_is_hung_on_every_rank_and_killed_whole():
    """Tried on the real engine: after the serving rail came back the TP group stayed wedged, every process
    running; the shared verdict names it from the counters, and recover no longer says "nothing to recover"."""
    from railyard.checks.hang import Verdict
    inv, plan, hosts = two_stations()
    head, worker = plan.service(plan.endpoint.service), next(s for s in plan.services() if s.host == "B")
    why = "1 request(s) running and 0 waiting, and its token counters did not move in 20 s (...)"
    rec = group_survey(inv, plan, hosts, [
        Verdict("A", head.name, "head (rank 0)", "hung", [why], "counters"),
        Verdict("B", worker.name, "worker-1 (rank 1)", "hung", ["waits with its group"], "group")])
    assert rec.path == "group" and rec.hung == [head.name, worker.name]
    assert rec.why[0] == f"{head.name} on A: hung: head (rank 0): {why}"
    assert "kill head, worker-1" in rec.steps[0]


def test_a_dead_api_process_is_a_failed_service_for_the_group_path():
    from railyard.checks.hang import Verdict
    inv, plan, hosts = two_stations()
    gone = "nothing answers on its API port 8000 while its container runs (the API process is gone): curl: (7)"
    rec = group_survey(inv, plan, hosts, [Verdict("A", plan.endpoint.service, "head (rank 0)", "dead", [gone], "api")])
    assert rec.path == "group" and rec.hung == []
    assert rec.why[0] == f"{plan.endpoint.service} on A: dead: head (rank 0): {gone}"


def test_a_healthy_group_has_nothing_to_recover_and_an_unreachable_host_blocks_it():
    from railyard.verbs.recover import decide_group
    inv, plan, hosts = two_stations()
    assert group_survey(inv, plan, hosts).path == "none"
    rec = decide_group(plan, [], {"A": True, "B": False})
    assert rec.path == "blocked" and rec.why == ["B did not answer: its services' state is not known"]


def test_nothing_to_recover_stands_only_on_read_verdicts_an_unread_one_blocks_recover():
    """CI saw it once on the real pd engines: health named prefill-0 hung, then recover's look could not judge
    it and answered "nothing to recover" with a pass. An unknown verdict is no pass: recover is blocked, naming it."""
    from railyard.checks.hang import Verdict
    from railyard.verbs.hung import Survey
    from railyard.verbs.recover import unless_unread
    inv, plan, hosts = two_stations()
    seen = [Verdict("A", "head", "head (rank 0)", "unknown", ["its /metrics could not be read twice"], "counters")]
    rec = unless_unread(group_survey(inv, plan, hosts, seen), Survey(seen))
    assert rec.path == "blocked" and not rec.ok and not rec.services
    assert rec.why == ["A head (rank 0): unknown: its /metrics could not be read twice"]
    read = [Verdict("A", "head", "head (rank 0)", "ok", ["answered its probe"], "counters")]
    assert unless_unread(group_survey(inv, plan, hosts, read), Survey(read)).path == "none"


# ---------------------------------------------------------------- the restart budget

def test_the_budget_counts_restarts_of_a_service_inside_the_window_only():
    from railyard.apply.recovery import Recovery, add_record, budget_left, spent
    now = 100_000.0
    records: list = []
    for at in (now - 4000, now - 1200, now - 600):       # the first is outside a 30-minute window
        records = add_record(records, Recovery("group", ["rank0", "rank1"], ["rank1 on B: exited"], []), at, at + 80)
    records = add_record(records, Recovery("budget", [], [], [], failure="spent"), now - 5, now - 5)  # restarted nothing
    assert budget_left(records, ["rank0", "r9"], now, 3, 1800) == {"rank0": 1, "r9": 3}
    assert spent(records, ["rank0"], now, 3, 1800) == ""
    records = add_record(records, Recovery("group", ["rank0", "rank1"], [], [], failure="rank1 exited"), now - 60,
                         now - 1)                        # a failed restart is a restart too
    line = spent(records, ["rank0", "rank1"], now, 3, 1800)
    assert line == ("restart budget spent: rank0 was restarted 3 times in the last 30 min (budget 3; last 60 s ago): a "
                    "crash loop is not fixed by another restart; read why it dies (inv logs --rank rank0 --lines 50)")
    assert records[-1]["ok"] is False and records[-1]["seconds"] == 59.0 and "\n" not in line
