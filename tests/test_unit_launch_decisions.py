"""railyard's own decisions in launch, stop, start and status, for every layout, against fake docker
hosts (railyard.testing.FakeDockerHost) on a fake clock: which containers start in what order, the
no-op by spec hash and the refusal without --recreate, what a failed launch names and what its
rollback removes, what stop stops in what order and whether it frees the GPUs, status's rows, and
what a dry run touches (nothing). The engines' logs are the real vLLM CPU captures of
tests/fixtures/real/vllm-cpu (ORIGINS.md there); the lab runs the same verbs against docker itself."""

from __future__ import annotations

import re

import pytest

from railyard.apply import executor as ops
from railyard.apply.envfiles import EnvFile
from railyard.errors import LaunchError
from railyard.render import docker
from railyard.testing import FakeClock, FakeDockerHost
from railyard.transport.runner import Runner

from .conftest import real
from .test_pd_plan import pd_plan
from .test_plan import hgx_plan, station_plan
from .test_replicas_plan import replicas_plan

NAME = "glm53-full"
UP = "INFO:     Application startup complete."
HEAD_LOG = real("vllm-cpu/tpA.log").split(UP)[0] + UP + "\n"        # the real head, up to its API being ready
WORKER_LOG = real("vllm-cpu/tpB.log")                                  # the real headless rank
WAITING = "Waiting for 1 remote node(s) to join"
# vLLM's words when another process holds the GPU (vllm/v1/worker/utils.py), as the lab's gpu-busy fault prints them
NO_MEMORY = ("ValueError: Free memory on device cuda:0 (1.17/79.19 GiB) on startup is less than desired GPU memory "
             "utilization (0.9, 71.27 GiB). Decrease GPU memory utilization or reduce GPU memory used by other processes.")
# docker 28's refusal of a --device the host lacks (ib_uverbs not loaded), the lab's no-uverbs fault
NO_DEVICE = ('docker: Error response from daemon: error gathering device information while adding custom device '
             '"/dev/infiniband": no such file or directory.')


@pytest.fixture(autouse=True)
def clock(monkeypatch):
    c = FakeClock()
    monkeypatch.setattr(ops, "clock", c)
    return c


def fake_hosts(inv, plan, facts=None, journal=None, total_mib=143771, **kw) -> dict[str, FakeDockerHost]:
    """A fake docker host for each host of the plan, with the GPUs its services were given (each
    total_mib, idle), and each service's processes on its GPUs while its container runs."""
    hosts = {}
    for h in plan.hosts():
        uuids = list(dict.fromkeys(u for svc in plan.on_host(h) for u in svc.spec.gpus.uuids))
        hosts[h] = FakeDockerHost(inv.host(h), gpus=[(i, u, "NVIDIA GPU", 0, total_mib) for i, u in enumerate(uuids)],
                                  journal=journal, **kw)
    for svc in plan.services():
        hosts[svc.host].behave(svc.spec.name, log=kw.get("log", ""),
                               gpu=[(u, f"VLLM::Worker_TP{i}", 60000) for i, u in enumerate(svc.spec.gpus.uuids)])
    return hosts


def runner_for(inv, hosts):
    return Runner([inv.host(n) for n in hosts], sessions={n: d.session for n, d in hosts.items()})


def current(plan):
    return [EnvFile(s.host, s.name, s.env_path, "x", "x") for s in plan.services()]


def apply(inv, plan, hosts, recreate=False, timeout=60, rollback=False):
    with runner_for(inv, hosts) as runner:
        return ops.apply(plan, runner, current(plan), "~/models/m", recreate, timeout, rollback, None)


def runs(journal):
    return [e.replace("run ", "") for e in journal if ": run " in e]


def clean(hosts):
    for h in hosts.values():
        assert not h.unexpected, h.unexpected


def stations(order=None, *overrides):
    return station_plan(*overrides, order=order)


def station_hosts(inv, plan, facts, journal):
    hosts = fake_hosts(inv, plan, facts, journal, total_mib=284208)
    hosts["A"].behave(NAME, log=HEAD_LOG, gpu=[(facts["A"].gpus[0].uuid, "VLLM::Worker_TP0", 60000)])
    hosts["B"].behave(NAME, log=WORKER_LOG, gpu=[(facts["B"].gpus[0].uuid, "VLLM::Worker_TP1", 60000)])
    return hosts


def test_the_live_table_shows_every_service_and_ends_on_each_ones_phase():
    """The executor shows its wait through `show` (the cli's live table): each rank's row, and the last
    drawing has both ready, the head's detail its gates."""
    import io

    from rich.console import Console

    from railyard.cli import live_table
    inv, plan, facts = stations()
    hosts = station_hosts(inv, plan, facts, [])
    con = Console(record=True, width=200, file=io.StringIO(), force_terminal=False)
    with runner_for(inv, hosts) as runner:
        rep = ops.apply(plan, runner, current(plan), "~/models/m", False, 60, False, live_table(con, "launch"))
    assert rep.ok, rep.failure
    last = con.export_text().split("launch\n")[-1]
    rows = [ln.split("│")[1:6] for ln in last.splitlines() if ln.count("│") >= 6]
    assert [(r[0].strip(), r[1].strip(), r[3].strip()) for r in rows] == [("1", "B", "ready"), ("0", "A", "ready")]
    assert "/health" in rows[1][4] and live_table(None, "launch") is None


def test_the_live_table_is_titled_by_the_task_that_waits():
    """recover and start draw the executor's table too: its title names them, not launch."""
    import io

    from rich.console import Console

    from railyard.cli import live_table
    con = Console(record=True, width=200, file=io.StringIO(), force_terminal=False)
    with live_table(con, "recover")([]):
        pass
    assert con.export_text().splitlines()[0].strip() == "recover"


# ---------------------------------------------------------------- multinode_tp (the two stations)

def test_the_worker_starts_first_the_head_is_gated_and_the_same_plan_again_is_a_noop():
    inv, plan, facts = stations()
    journal: list[str] = []
    hosts = station_hosts(inv, plan, facts, journal)
    rep = apply(inv, plan, hosts)
    assert rep.ok, rep.failure
    assert rep.order == ["B", "A"] and runs(journal) == [f"B: {NAME}", f"A: {NAME}"]
    assert rep.api == plan.endpoint.url and rep.ready_seconds is not None
    assert [c for c in hosts["A"].session.calls if c.startswith("curl ")], "the head's API is asked before ready"
    assert not [c for c in hosts["B"].session.calls if c.startswith("curl ")]  # a headless rank has no API
    journal.clear()
    again = apply(inv, plan, hosts)
    assert again.noop and again.ok and journal == []                         # nothing started, stopped or removed
    clean(hosts)


def test_another_configuration_is_refused_without_recreate_and_replaced_with_it_head_first_by_rank_order():
    inv, plan, facts = stations()
    journal: list[str] = []
    hosts = station_hosts(inv, plan, facts, journal)
    assert apply(inv, plan, hosts).ok
    inv8, plan8, _ = stations(None, "vllm_max_num_seqs=8")
    with pytest.raises(LaunchError, match=r"container glm53-full already exists \(B: running, another configuration, "
                                          r"A: running, another configuration\): pass --recreate"):
        apply(inv8, plan8, hosts)
    assert [c.config for c in (hosts["A"].containers[NAME], hosts["B"].containers[NAME])] == [
        docker.config_hash(plan, plan.service("head")), docker.config_hash(plan, plan.service("worker-1"))]
    _, head_first, _ = stations("A,B", "vllm_max_num_seqs=8")
    journal.clear()
    rep = apply(inv8, head_first, hosts, recreate=True)
    assert rep.ok and rep.order == ["A", "B"]
    # the old ones removed head first (the reverse of the new start order is B, A: removal follows the plan's
    # teardown order), then started in the new order
    assert journal == ["B: rm glm53-full", "A: rm glm53-full", "A: run glm53-full", "B: run glm53-full"]
    assert "--max-num-seqs 8" in hosts["A"].containers[NAME].argv
    clean(hosts)


def test_a_launch_that_was_cut_short_resumes_keeping_what_runs_with_this_configuration():
    inv, plan, facts = stations()
    journal: list[str] = []
    hosts = station_hosts(inv, plan, facts, journal)
    hosts["B"].container(NAME, docker.config_hash(plan, plan.service("worker-1")))   # the worker came up, then ^C
    rep = apply(inv, plan, hosts)
    assert rep.ok and rep.started == ["head"] and rep.kept == ["B"] and runs(journal) == [f"A: {NAME}"]


def test_a_stopped_container_of_this_plan_is_refused_with_start_named():
    inv, plan, facts = stations()
    hosts = station_hosts(inv, plan, facts, [])
    for svc in plan.services():
        hosts[svc.host].container(svc.spec.name, docker.config_hash(plan, svc), status="exited")
    with pytest.raises(LaunchError, match=r"\(B: exited, A: exited\): pass --recreate .* use `inv start`"):
        apply(inv, plan, hosts)
    assert not any(e.startswith(("run", "rm")) for h in hosts.values() for e in h.events)


def test_a_head_that_dies_fails_the_launch_named_with_its_log_and_rollback_removes_every_container():
    inv, plan, facts = stations()
    journal: list[str] = []
    hosts = station_hosts(inv, plan, facts, journal)
    hosts["A"].behave(NAME, log=HEAD_LOG.split("(EngineCore")[0] + NO_MEMORY + "\n", exits=1)
    rep = apply(inv, plan, hosts, rollback=True)
    assert not rep.ok and rep.failed_rank == "A" and rep.failure == "A (rank 0): the container exited with code 1"
    assert NO_MEMORY in rep.logs["A"] and rep.logs["B"] == "".join(ln + "\n" for ln in WORKER_LOG.splitlines()[-20:])
    assert rep.rolled_back == ["A", "B"]                                       # the head first, then its worker
    assert hosts["A"].containers == {} and hosts["B"].containers == {}
    clean(hosts)


def test_without_rollback_a_failed_launch_leaves_its_containers_for_the_logs():
    inv, plan, facts = stations()
    hosts = station_hosts(inv, plan, facts, [])
    hosts["A"].behave(NAME, log=NO_MEMORY, exits=1)
    rep = apply(inv, plan, hosts)
    assert not rep.ok and rep.rolled_back == []
    assert hosts["A"].containers[NAME].status == "exited" and hosts["B"].containers[NAME].running


def test_a_run_docker_refuses_names_the_rank_with_dockers_words_and_rollback_removes_the_created_container():
    inv, plan, facts = stations()
    journal: list[str] = []
    hosts = station_hosts(inv, plan, facts, journal)
    hosts["B"].behave(NAME, log=NO_DEVICE, exits=125)
    rep = apply(inv, plan, hosts, rollback=True)
    assert not rep.ok and rep.failed_rank == "B"
    assert rep.failure == f"B (rank 1) did not start: {NO_DEVICE}"
    assert runs(journal) == [f"B: {NAME}"]                                    # the head was never started
    assert rep.rolled_back == ["B"] and hosts["B"].containers == {} and hosts["A"].containers == {}


def test_a_worker_that_never_joins_times_out_on_the_head_with_both_logs(clock):
    inv, plan, facts = stations()
    hosts = station_hosts(inv, plan, facts, [])
    hosts["A"].behave(NAME, log=HEAD_LOG.split(UP)[0].split("(EngineCore")[0] + WAITING + "\n")
    hosts["B"].behave(NAME, log="waiting for the head\n")
    hosts["B"].session.on(re.compile(r"^python3 -c "), (0, "dial 192.168.101.1 29501 connected 1 100.0 100.1\n"))
    rep = apply(inv, plan, hosts, timeout=8, rollback=True)
    assert not rep.ok and rep.failed_rank == "A"
    assert rep.failure == "A (rank 0): no `Application startup complete` and /health within 8 s"
    assert WAITING in rep.logs["A"] and "waiting for the head" in rep.logs["B"]
    assert 8 <= clock.now - 1000 < 10                                          # it waited its 8 s, no more
    clean(hosts)


def test_stop_stops_the_head_first_frees_the_gpus_and_start_resumes_workers_first():
    inv, plan, facts = stations()
    journal: list[str] = []
    hosts = station_hosts(inv, plan, facts, journal)
    assert apply(inv, plan, hosts).ok
    journal.clear()
    with runner_for(inv, hosts) as runner:
        res = ops.stop(plan, runner)
        assert [(r.host, r.status, r.gpu_free) for r in res] == [("A", "exited", True), ("B", "exited", True)]
        assert journal == [f"A: stop {NAME}", f"B: stop {NAME}"]
        assert all(h.gpu_procs == [] for h in hosts.values())
        journal.clear()
        rep = ops.start(plan, runner, 60, None)
        assert rep.ok and journal == [f"B: start {NAME}", f"A: start {NAME}"]
        assert all(r["running"] for r in ops.status(plan, runner))
        again = ops.start(plan, runner, 60, None)
        assert again.noop
    clean(hosts)


def test_stop_names_a_process_that_still_holds_the_gpu():
    inv, plan, facts = stations()
    hosts = station_hosts(inv, plan, facts, [])
    assert apply(inv, plan, hosts).ok
    from railyard.testing import FakeGpuProcess
    hosts["A"].gpu_procs.append(FakeGpuProcess(facts["A"].gpus[0].uuid, 777, "python3", 4096))  # not the container's
    with runner_for(inv, hosts) as runner:
        res = {r.host: r for r in ops.stop(plan, runner)}
    assert not res["A"].gpu_free and res["A"].detail == ("Status=exited Running=false; still on the GPU: pid 777 "
                                                         "python3 4096 MiB")
    assert res["B"].gpu_free


def test_start_without_containers_says_launch_and_a_head_that_crashes_on_start_is_named():
    inv, plan, facts = stations()
    hosts = station_hosts(inv, plan, facts, [])
    with runner_for(inv, hosts) as runner, pytest.raises(LaunchError, match="no container glm53-full on B, A: run "
                                                                            "`inv launch`"):
        ops.start(plan, runner, 20, None)
    assert apply(inv, plan, hosts).ok
    for h in hosts.values():
        h.kill(NAME, 0)
    hosts["A"].behave(NAME, log=NO_MEMORY, exits=1)
    with runner_for(inv, hosts) as runner:
        rep = ops.start(plan, runner, 20, None)
    assert not rep.ok and rep.failed_rank == "A" and "exited with code 1" in rep.failure


def test_status_rows_show_state_pinned_digest_configuration_and_gpu_memory():
    inv, plan, facts = stations()
    hosts = station_hosts(inv, plan, facts, [])
    assert apply(inv, plan, hosts).ok
    with runner_for(inv, hosts) as runner:
        rows = ops.status(plan, runner)
        assert [(r["host"], r["rank"], r["state"], r["config_current"], r["pinned_digest_ok"]) for r in rows] == [
            ("A", 0, "running", True, True), ("B", 1, "running", True, True)]
        assert rows[0]["gpu_memory"] == {"used_mib": 60000, "total_mib": 284208} and rows[0]["uptime_s"] is not None
        hosts["B"].session.run(f"docker rm -f {NAME}")
        hosts["A"].containers[NAME].config = "0123456789abcdef"
        rows = ops.status(plan, runner)
    assert [(r["state"], r["running"], r["config_current"]) for r in rows] == [("running", True, False),
                                                                             ("missing", False, False)]


# ---------------------------------------------------------------- single_node (tp on one hgx8 host)

def hgx():
    inv, plan = hgx_plan()
    return inv, plan, None


def test_single_node_tp_starts_one_container_on_every_gpu_stops_it_and_a_relaunch_is_a_noop():
    inv, plan, facts = hgx()
    hosts = fake_hosts(inv, plan, facts, log=HEAD_LOG)
    rep = apply(inv, plan, hosts)
    assert rep.ok and rep.started == ["engine"] and hosts["G1"].running() == ["vllm-tp8"]
    assert len({p.gpu_uuid for p in hosts["G1"].gpu_procs}) == 8
    assert apply(inv, plan, hosts).noop
    with runner_for(inv, hosts) as runner:
        assert [(r.service, r.status, r.gpu_free) for r in ops.stop(plan, runner)] == [("engine", "exited", True)]
        assert ops.start(plan, runner, 60, None).ok
    clean(hosts)


def test_single_node_a_busy_gpu_fails_the_engine_named_and_rollback_removes_it():
    inv, plan, facts = hgx()
    hosts = fake_hosts(inv, plan, facts)
    hosts["G1"].behave("vllm-tp8", log=NO_MEMORY, exits=1)
    rep = apply(inv, plan, hosts, rollback=True)
    assert rep.failure == "G1 (engine): the container exited with code 1" and NO_MEMORY in rep.logs["G1"]
    assert rep.rolled_back == ["G1"] and hosts["G1"].containers == {}


def test_a_missing_image_or_checkpoint_refuses_before_anything_starts():
    inv, plan, facts = hgx()
    hosts = fake_hosts(inv, plan, facts)
    hosts["G1"].images[plan.services()[0].spec.image] = None
    with pytest.raises(LaunchError, match="the pinned image is not on G1: docker pull"):
        apply(inv, plan, hosts)
    hosts["G1"].images.clear()
    hosts["G1"].missing_files.add('~/models/m/config.json')
    with pytest.raises(LaunchError, match="no checkpoint .* on G1: run `inv sync-model`"):
        apply(inv, plan, hosts)
    assert hosts["G1"].events == []


# ---------------------------------------------------------------- replicas (LMCache, the replicas, the router)

def replicas():
    inv, plan = replicas_plan()
    return inv, plan, None


REPLICA_LOG = "LMCache cache server is running\nRegistering kv caches\n" + UP


def test_replicas_start_lmcache_then_the_replicas_together_then_the_router_and_stop_in_reverse():
    inv, plan, facts = replicas()
    journal: list[str] = []
    hosts = fake_hosts(inv, plan, facts, journal, log=REPLICA_LOG)
    h = inv.hosts[0].name
    rep = apply(inv, plan, hosts)
    assert rep.ok, rep.failure
    dep = plan.deployment
    assert runs(journal) == [f"{h}: {dep}-{n}" for n in ("lmcache", "r0", "r1", "router")]
    # the router's config and the master key were written before the router started
    assert any(p.endswith("/router/config.yaml") for p in hosts[h].files)
    assert any(p.endswith("litellm-master-key") for p in hosts[h].files)
    journal.clear()
    assert apply(inv, plan, hosts).noop and journal == []
    with runner_for(inv, hosts) as runner:
        ops.stop(plan, runner)
    assert journal == [f"{h}: stop {dep}-{n}" for n in ("router", "r0", "r1", "lmcache")]
    clean(hosts)


def test_a_replica_that_never_registers_with_lmcache_times_out_naming_the_gate():
    inv, plan, facts = replicas()
    hosts = fake_hosts(inv, plan, facts, log=REPLICA_LOG)
    h = inv.hosts[0].name
    hosts[h].behave(f"{plan.deployment}-r1", log=UP)
    rep = apply(inv, plan, hosts, timeout=30, rollback=True)
    assert rep.failure == f"{h} (r1): no `Registering kv caches` and /health within 30 s"
    assert sorted(rep.rolled_back) == [h] * 3 and hosts[h].containers == {}   # lmcache, r0, r1: the router never ran


# ---------------------------------------------------------------- pd (prefill and decode pools, the proxy)

# the real DP2 engine's KV cache line (vllm-cpu/moe2.log), once for each of eight DP ranks
_KV = next(ln for ln in real("vllm-cpu/moe2.log").splitlines() if ln.startswith("(EngineCore_DP1") and "KV cache size" in ln)
DP8_LOG = "".join(_KV.replace("DP1", f"DP{i}") + "\n" for i in range(8)) + UP + "\n"


def test_pd_starts_both_pools_together_before_the_proxy_and_stops_the_proxy_first():
    inv, plan = pd_plan()
    journal: list[str] = []
    hosts = fake_hosts(inv, plan, None, journal, log=DP8_LOG)
    with runner_for(inv, hosts) as runner:
        rep = ops.run_stages(plan, runner, 60, None, lambda svc: None if runner.session(svc.host).run(
            docker.run_line(plan, svc)).ok else "refused")
        assert rep.ok, rep.failure
        assert runs(journal)[-1] == "P1: vllm-pd-proxy" and len(runs(journal)) == 6
        journal.clear()
        ops.stop(plan, runner)
    assert journal[0] == "P1: stop vllm-pd-proxy" and len(journal) == 6
    clean(hosts)
