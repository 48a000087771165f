"""The executor against FakeSession hosts: stage order, gates, no-op by spec hash, refusals, and
the facts it plans from, without the lab."""

import json
import re

import pytest

from railyard.errors import LaunchError
from railyard.apply import executor as ops
from railyard.apply.envfiles import EnvFile
from railyard.render import docker
from railyard.render.docker import run_line
from railyard.transport.runner import Runner
from railyard.facts import host as hostfacts
from railyard.testing import FakeClock, FakeDockerHost, FakeSession, answer

from .conftest import real
from .test_plan import hgx_plan, station_plan


@pytest.fixture(autouse=True)
def no_real_sleep(monkeypatch):
    """The executor's gates wait on the fake clock: a 20 s timeout takes no time."""
    clock = FakeClock()
    monkeypatch.setattr(ops, "clock", clock)
    return clock


def inspect_doc(running=True, config="", code=0):
    return json.dumps({"State": {"Running": running, "Status": "running" if running else "exited", "Pid": 42 if running else 0,
                                 "ExitCode": code, "StartedAt": "2026-12-01T08:00:00Z"},
                       "Config": {"Labels": {"railyard.config": config}}, "Image": "sha256:ab"})


class Docker:
    """The tiny docker host that tests/test_launch_timeline.py's TimedDocker extends (this module's tests use
    railyard.testing.FakeDockerHost): `docker run` creates the container, inspect shows it, logs say `log`."""

    def __init__(self, host, log="", exits=None):
        self.containers: dict[str, str] = {}
        self.log = log
        self.exits = exits
        self.session = FakeSession(host)
        s = self.session
        s.on(re.compile(r"^docker image inspect "), (0, '[{"Id": "sha256:ab", "RepoDigests": []}]'))
        s.on(re.compile(r"^test -[fs] "), (0, ""))
        s.on(re.compile(r"^docker inspect --format '\{\{json \.\}\}' (\S+)$"), self.inspect)
        s.on(re.compile(r"^docker run -d --name "), self.run)
        s.on(re.compile(r"^docker logs "), lambda c: (0, self.log + "\n@@last\n" + self.log.splitlines()[-1] + "\n"
                                                      if self.log else "@@last\n"))
        s.on(re.compile(r"^curl "), (0, "200"))
        s.on(re.compile(r"^docker (rm -f|stop --timeout 60) "), (0, ""))

    def inspect(self, command):
        name = command.rsplit(" ", 1)[1]
        if name not in self.containers:
            return 1, "", f"Error: No such object: {name}"
        return 0, inspect_doc(self.exits is None, self.containers[name], self.exits or 0) + "\n"

    def run(self, command):
        name = command.split("--name ", 1)[1].split(" ", 1)[0]
        label = re.search(r"railyard\.config=(\w+)", command)
        self.containers[name] = label.group(1) if label else ""
        return 0, "f00d\n"


def runner_for(inv, hosts):
    return Runner(inv.hosts, sessions={n: d.session for n, d in hosts.items()})


def current(plan):
    return [EnvFile(s.host, s.name, s.env_path, "x", "x") for s in plan.services()]


def test_stages_start_in_order_and_the_head_is_gated_on_its_log_and_health():
    inv, plan, _ = station_plan()
    hosts = {"A": FakeDockerHost(inv.host("A"), log="INFO:     Application startup complete."),
             "B": FakeDockerHost(inv.host("B"), log="waiting for the head")}
    with runner_for(inv, hosts) as runner:
        rep = ops.apply(plan, runner, current(plan), "~/models/m", False, 20, False, None)
    assert rep.ok and rep.order == ["B", "A"] and rep.started == ["worker-1", "head"]
    runs = [(n, c) for n, d in hosts.items() for c in d.session.calls if c.startswith("docker run")]
    assert {n for n, _ in runs} == {"A", "B"}
    assert any(c.startswith("curl ") and "/health" in c for c in hosts["A"].session.calls)
    assert not any(c.startswith("curl ") for c in hosts["B"].session.calls)  # a worker has no API


def test_the_same_plan_running_is_a_noop_and_runs_nothing():
    inv, plan, _ = station_plan()
    hosts = {h.name: FakeDockerHost(h) for h in inv.hosts}
    for svc in plan.services():
        hosts[svc.host].container(svc.spec.name, docker.config_hash(plan, svc))
    with runner_for(inv, hosts) as runner:
        rep = ops.apply(plan, runner, current(plan), "~/models/m", False, 20, False, None)
    assert rep.noop and not any(c.startswith("docker run") for d in hosts.values() for c in d.session.calls)


def test_another_configuration_needs_recreate():
    inv, plan, _ = station_plan()
    hosts = {h.name: FakeDockerHost(h) for h in inv.hosts}
    for svc in plan.services():
        hosts[svc.host].container(svc.spec.name, "0123456789abcdef")
    with runner_for(inv, hosts) as runner, pytest.raises(LaunchError, match="another configuration.*--recreate"):
        ops.apply(plan, runner, current(plan), "~/models/m", False, 20, False, None)


def test_stale_env_files_refuse_before_anything_starts():
    inv, plan, _ = station_plan()
    hosts = {h.name: FakeDockerHost(h) for h in inv.hosts}
    files = current(plan)
    files[0].current = "old"
    with runner_for(inv, hosts) as runner, pytest.raises(LaunchError, match="not current on B: run `inv env`"):
        ops.apply(plan, runner, files, "~/models/m", False, 20, False, None)
    assert not any(c.startswith("docker run") for d in hosts.values() for c in d.session.calls)


def test_a_service_that_exits_fails_the_launch_named_and_rollback_removes_it():
    inv, plan = hgx_plan()
    d = FakeDockerHost(inv.hosts[0], log="ValueError: Free memory on device cuda:0", exits=1)
    with Runner(inv.hosts, sessions={"G1": d.session}) as runner:
        rep = ops.apply(plan, runner, current(plan), "~/models/m", False, 20, True, None)
    assert not rep.ok and rep.failure == "G1 (engine): the container exited with code 1"
    assert "Free memory" in rep.logs["G1"] and rep.rolled_back == ["G1"]
    assert any(c.startswith("docker rm -f vllm-tp8") for c in d.session.calls)


def test_a_stages_containers_are_watched_together_so_its_start_gate_costs_one_window():
    from .test_replicas_plan import replicas_plan
    inv, plan = replicas_plan("vllm_replicas=4", "vllm_tensor_parallel_size=2")
    d = FakeDockerHost(inv.hosts[0], log="LMCache cache server is running\nRegistering kv caches\n"
                                 "INFO:     Application startup complete.")
    with Runner(inv.hosts, sessions={inv.hosts[0].name: d.session}) as runner:
        rep = ops.apply(plan, runner, current(plan), "~/models/m", False, 20, False, None)
    assert rep.ok, rep.failure
    engines = [s.spec.name for s in plan.stages[1].services]
    calls = d.session.calls
    last_run = max(i for i, c in enumerate(calls) if c.startswith("docker run") and any(e in c for e in engines))
    watched = [c.rsplit(" ", 1)[1] for c in calls[last_run + 1:] if c.startswith("docker inspect")]
    watched = [n for n in watched if n in engines]
    # each replica is looked at in the first round, before the first one's 1.5 s window closes: the
    # four windows overlap (one after another, a stage of N took N windows)
    assert sorted(watched[:len(engines)]) == sorted(engines) and len(engines) == 4


def test_a_ready_stage_asks_its_ready_gates_during_its_start_window():
    inv, plan = hgx_plan()
    d = FakeDockerHost(inv.hosts[0], log="INFO:     Application startup complete.")
    with Runner(inv.hosts, sessions={"G1": d.session}) as runner:
        rep = ops.apply(plan, runner, current(plan), "~/models/m", False, 20, False, None)
    assert rep.ok, rep.failure
    after = d.session.calls[next(i for i, c in enumerate(d.session.calls) if c.startswith("docker run")) + 1:]
    inspects = [i for i, c in enumerate(after) if c.startswith("docker inspect")]
    logs = [i for i, c in enumerate(after) if c.startswith("docker logs")]
    # the log and /health asked in the window's first round (after it, a launch took window + gates)
    assert inspects[0] < logs[0] < inspects[1] and len(inspects) >= 2


def test_dp_ep_is_ready_only_when_every_dp_rank_logged_its_kv_cache():
    inv, plan = hgx_plan("serve_layout=dp_ep")
    svc = plan.services()[0]
    seven = "\n".join(f"(EngineCore_DP{i} pid={100 + i}) INFO 12-01 08:00:0{i} [kv_cache_utils.py:1087] GPU KV cache "
                      f"size: 299,{i}00 tokens" for i in range(7)) + "\nINFO:     Application startup complete."
    d = FakeDockerHost(inv.hosts[0], log=seven)
    d.session.run(run_line(plan, svc))
    pending, _ = ops.pending_gates(d.session, svc)
    assert [g.kind for g in pending] == ["kv_engines", "http"]  # /health is asked once the log is complete
    d.behave(svc.spec.name, log=seven + "\n(EngineCore_DP7 pid=107) INFO x [kv_cache_utils.py:1087] GPU KV cache size: 301,000 tokens")
    pending, _ = ops.pending_gates(d.session, svc)
    assert pending == []


def test_a_gate_that_never_holds_times_out_naming_what_is_missing():
    inv, plan = hgx_plan()
    d = FakeDockerHost(inv.hosts[0], log="loading weights")
    with Runner(inv.hosts, sessions={"G1": d.session}) as runner:
        rep = ops.apply(plan, runner, current(plan), "~/models/m", False, 2, False, None)
    assert rep.failure == "G1 (engine): no `Application startup complete` and /health within 2 s"


def test_a_timed_out_launch_tries_the_plans_ports_again_and_names_the_one_that_did_not_connect():
    """The head waits for its worker; from B, the head's master port gets no answer (the line is what
    scripts/port_probe.py prints, tests/test_ports.py runs it on real sockets)."""
    inv, plan, _ = station_plan()

    def launch(dial_line):
        hosts = {"A": FakeDockerHost(inv.host("A"), log="Waiting for 1 remote node(s) to join"),
                 "B": FakeDockerHost(inv.host("B"), log="waiting for the head")}
        hosts["B"].session.on(re.compile(r"^python3 -c "), (0, dial_line))
        with runner_for(inv, hosts) as runner:
            return ops.apply(plan, runner, current(plan), "~/models/m", False, 6, False, None), hosts["B"].session
    rep, b = launch("dial 192.168.101.1 29501 timeout 3 100.0 103.0\n")
    [probe] = [c for c in b.calls if c.startswith("python3 -c ")]
    assert probe.endswith(" 3 2 dial 192.168.101.1 29501")
    timed_out = "A (rank 0): no `Application startup complete` and /health within 6 s"
    assert rep.failure == (timed_out + "; B cannot reach 192.168.101.1:29501 on A (the head's master port): no "
                           "answer (dropped: a firewall on the rail?)")
    assert rep.hint.startswith("allow TCP 29501 from B on A")
    rep, _ = launch("dial 192.168.101.1 29501 connected 1 100.0 100.1\n")
    assert rep.failure == timed_out  # reached: the timeout's own words alone


def test_fake_session_fails_on_an_unexpected_command():
    inv, plan = hgx_plan()
    with pytest.raises(AssertionError, match="unexpected command: rm -rf /"):
        FakeSession(inv.hosts[0]).run("rm -rf /")


def test_host_facts_from_real_h200_output_need_enough_gpus():
    inv, _ = hgx_plan()
    h = inv.hosts[0]
    gpus = real("nvidia-smi-h200/query-gpu-csv-noheader-nounits_idle.txt")
    s = FakeSession(h).on(re.compile("^T="), answer({"home": "/home/x\n", "gpus": gpus}))
    f = hostfacts.read(s, set(), 8)
    assert f.problems == ["G1: GPUs: 1 GPU(s) match 'H200', the layout needs 8 (fix: check cluster_gpus_per_host "
                          "and the parallel sizes against `nvidia-smi -L`)"]
    f = hostfacts.read(s, set(), 1)
    assert not f.problems and f.gpus[0].uuid == "GPU-35842103-278f-873a-2444-0a148739cdf2" and f.home == "/home/x"


def test_a_station_display_gpu_is_never_chosen():
    inv, _, _ = station_plan()
    h = inv.host("A")
    both = ("0, GPU-aaaaaaaa-0000-0000-0000-000000000000, NVIDIA RTX PRO 6000 Blackwell Workstation Edition, 12, 97887\n"
            "1, GPU-bbbbbbbb-0000-0000-0000-000000000000, NVIDIA GB300, 1, 284208\n")
    s = FakeSession(h).on(re.compile("^T="), answer({"home": "/home/nvidia\n", "gpus": both,
                                                      "gids": real("show_gids/tpgds-aihub0001_mlx5_0_v1v2.txt")}))
    f = hostfacts.read(s, {"gids"}, 1)
    assert [g.name for g in f.gpus] == ["NVIDIA GB300"]


def test_the_cpu_set_comes_from_topo_m_on_a_real_dual_numa_host():
    inv, _ = hgx_plan()
    h = inv.hosts[0]
    gpus = "".join(f"{i}, GPU-{i:08x}-0000-4000-8000-000000000000, NVIDIA H200, 0, 143771\n" for i in range(8))
    s = FakeSession(h).on(re.compile("^T="), answer({
        "home": "/root\n", "gpus": gpus, "lscpu": real("lscpu/lscpu_xeon-8481c-2s-224cpu-2numa.txt"),
        "topo": real("nvidia-smi-topo/topo-m_h100-8gpu-12nic-2numa_hpe-xd670.txt")}))
    f = hostfacts.read(s, {"topology"}, 8)
    assert not f.problems
    assert f.cpus_of(f.gpus[:4]) == "0-55,112-167" and f.cpus_of(f.gpus) == "0-223"
