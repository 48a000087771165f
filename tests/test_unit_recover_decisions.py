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


def survey(inv, plan, host, which=None):
    with Runner(inv.hosts, sessions={host.name: host.session}) as runner:
        rec, _ = R.survey(plan, runner, which)
    assert not host.unexpected, host.unexpected
    return rec


def r1(plan):
    return plan.service("r1")


def test_a_replica_that_exited_cleanly_with_its_gpus_free_comes_back_alone_on_the_short_path():
    inv, plan, host = deployed()
    host.kill(r1(plan).spec.name, 0)
    rec = survey(inv, plan, host)
    assert rec.path == "short" and rec.replicas == ["r1"]
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
    assert rec.path == "long" and rec.replicas == ["r0", "r1"]
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
