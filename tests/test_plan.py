"""The launch plan without the lab: goldens of the two-station commands, the one-host layouts'
plans, their static checks, and every rendered `docker run` parsed by the real docker CLI."""

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

from railyard.facts.gpu import Gpu
from railyard.errors import InventoryError
from railyard.inventory import load_inventory
from railyard.verbs.nccl_check import probe_lines
from railyard.render import docker, envfile
from railyard.plan import layout as layouts
from railyard.facts.host import HostFacts, cpu_list

from .conftest import FIXTURES, ROOT, inv_cmd

GOLDEN = FIXTURES / "golden" / "multinode_tp"
STATIONS = ROOT / "inventory" / "dgx-stations.yml"
HGX = ROOT / "inventory" / "hgx8-h200.yml"
CANNED = {"A": ("GPU-6f1c9a2e-53b4-4c1d-9e2a-0b7d8c3f4a11", 3), "B": ("GPU-0d4e7b19-8a62-4f35-b1c0-9e2d5a7c3b88", 5)}
NUMA = {0: list(range(0, 56)) + list(range(112, 168)), 1: list(range(56, 112)) + list(range(168, 224))}


def station_plan(*overrides, order=None):
    inv = load_inventory(STATIONS, list(overrides))
    facts = {h.name: HostFacts(h, home="/home/nvidia", gpus=[Gpu(1, CANNED[h.name][0], "NVIDIA GB300", 1, 284208)],
                               gid_index=CANNED[h.name][1]) for h in inv.hosts}
    return inv, layouts.validated(inv).plan(inv, facts, order), facts


def hgx_plan(*overrides):
    inv = load_inventory(HGX, list(overrides))
    h = inv.hosts[0]
    gpus = [Gpu(i, f"GPU-{i:08x}-0000-4000-8000-00000000000{i}", "NVIDIA H200", 0, 143771) for i in range(8)]
    facts = {h.name: HostFacts(h, home="/home/ubuntu", gpus=gpus, cpus_by_gpu={i: NUMA[i // 4] for i in range(8)})}
    return inv, layouts.validated(inv).plan(inv, facts)


def real_docker() -> str:
    """The real docker client (not the lab's stand-in); with no daemon it parses every flag, then fails."""
    for p in ("/usr/local/bin/docker", "/usr/bin/docker"):
        if os.access(p, os.X_OK):
            return p
    if os.environ.get("RAILYARD_REQUIRE_LAB"):
        pytest.fail("the docker client is required (apt-get install docker.io)")
    pytest.skip("no docker client")


def docker_parses(line: str) -> None:
    argv = shlex.split(line)
    assert argv[:2] == ["docker", "run"]
    env = dict(os.environ, DOCKER_HOST="unix:///nonexistent/railyard-test.sock")
    r = subprocess.run([real_docker()] + argv[1:], capture_output=True, text=True, env=env, timeout=30)
    # parsed, then stopped for want of a daemon: "Cannot connect ..." or, once --device needs the
    # server's OS to be validated, "unknown server OS" (docker 28.2.2, both seen here)
    assert r.returncode == 125 and ("Cannot connect to the Docker daemon" in r.stderr
                                    or "unknown server OS" in r.stderr), r.stderr
    assert "unknown flag" not in r.stderr and "invalid argument" not in r.stderr, r.stderr


def test_the_two_station_commands_and_env_files_match_the_goldens():
    inv, plan, _ = station_plan()
    assert [s.host for s in plan.services()] == ["B", "A"]  # workers first
    for svc in plan.services():
        assert docker.run_line(plan, svc) + "\n" == (GOLDEN / f"{svc.host}.docker-run").read_text()
        assert envfile.render(plan, svc) == (GOLDEN / f"{svc.host}.env").read_text()


def test_the_nccl_probe_lines_match_the_goldens():
    inv, plan, facts = station_plan()
    lines = probe_lines(plan, {n: f.home for n, f in facts.items()}, "1M,16M,256M,1G", 120, 29511)
    for svc in plan.services():
        assert lines[svc.name] + "\n" == (GOLDEN / f"{svc.host}.nccl-check-run").read_text()


def test_every_rendered_docker_run_parses_with_the_real_docker_cli():
    inv, plan, facts = station_plan()
    for svc in plan.services():
        docker_parses(docker.run_line(plan, svc))
    for line in probe_lines(plan, {n: f.home for n, f in facts.items()}, "1M", 60, 29511).values():
        docker_parses(line)
    for layout in ((), ("serve_layout=dp_ep",), ("serve_layout=dp_ep", "vllm_cpuset=", "vllm_data_parallel_size=4",
                                                 "cluster_gpus_per_host=4")):
        _, hplan = hgx_plan(*layout)
        for svc in hplan.services():
            docker_parses(docker.run_line(hplan, svc))


def test_docker_parse_check_catches_a_bad_flag():
    with pytest.raises(AssertionError):
        docker_parses("docker run -d --gpus-all x img")


def test_rank_order_is_the_stage_order_and_values_stay_symbolic_in_the_plan():
    inv, plan, _ = station_plan(order="A,B")
    assert [st.services[0].host for st in plan.stages] == ["A", "B"]
    worker = plan.service("worker-1")
    assert [a for a in worker.spec.command if not isinstance(a, str)] != []  # head address, rank, size: Refs
    argv = docker.run_argv(plan, worker)
    entry = argv[-1]
    assert "--node-rank 1 --master-addr 192.168.101.1" in entry and entry.endswith("--headless")
    assert plan.endpoint.host == "A" and plan.endpoint.url == "http://127.0.0.1:8000/v1"


def test_api_server_count_is_never_given_to_a_headless_rank():
    # vLLM 0.30's `vllm serve --headless` raises "api_server_count can't be set in headless mode" (> 1)
    _, plan, _ = station_plan("vllm_api_server_count=2")
    head, worker = (docker.run_argv(plan, plan.service(n))[-1] for n in ("head", "worker-1"))
    assert "--api-server-count 2" in head and "--api-server-count" not in worker and worker.endswith("--headless")


def test_a_changed_value_changes_the_spec_hash_and_the_same_plan_does_not():
    _, p1, _ = station_plan()
    _, p2, _ = station_plan()
    _, p3, _ = station_plan("vllm_max_num_seqs=8")
    h = [docker.config_hash(p, p.service("head")) for p in (p1, p2, p3)]
    assert h[0] == h[1] != h[2]


def test_single_node_tp_plan_uses_all_eight_gpus_one_numa_pinned_container():
    inv, plan = hgx_plan()
    (svc,) = plan.services()
    argv = docker.run_argv(plan, svc)
    gpus = argv[argv.index("--gpus") + 1]
    assert gpus.startswith('"device=') and gpus.count("GPU-") == 8  # docker's quoted multi-device form
    assert argv[argv.index("--cpuset-cpus") + 1] == "0-223"
    assert "--device" not in argv and "IPC_LOCK" not in argv  # one host: no RDMA needs
    serve = argv[-1]
    for flag in ("--tensor-parallel-size 8", "--kv-cache-dtype fp8", "--max-num-batched-tokens 8192",
                 "--gpu-memory-utilization 0.92", "--async-scheduling"):
        assert flag in serve
    assert "--speculative-config" not in serve and "--nnodes" not in serve and "--max-model-len" not in serve
    assert plan.stages[0].wait == "ready" and [g.kind for g in svc.ready] == ["log", "http"]
    assert plan.verifiers == ()


def test_dp_ep_plan_gates_on_every_dp_rank_and_a_half_node_pins_one_socket():
    inv, plan = hgx_plan("serve_layout=dp_ep", "vllm_all2all_backend=deepep_low_latency", "vllm_api_server_count=4")
    (svc,) = plan.services()
    serve = docker.run_argv(plan, svc)[-1]
    assert ("--tensor-parallel-size 1 --data-parallel-size 8 --enable-expert-parallel --all2all-backend "
            "deepep_low_latency --api-server-count 4") in serve
    kv = [g for g in svc.ready if g.kind == "kv_engines"]
    assert kv and kv[0].count == 8 and plan.verifiers == ("kv_engines",)
    _, half = hgx_plan("serve_layout=dp_ep", "vllm_data_parallel_size=4", "cluster_gpus_per_host=4")
    (svc,) = half.services()
    argv = docker.run_argv(half, svc)
    assert argv[argv.index("--cpuset-cpus") + 1] == "0-55,112-167"  # GPUs 0-3 are all on NUMA node 0
    assert svc.spec.gpus.count == 4


@pytest.mark.parametrize("backend", ["deepep_v2", "mori_high_throughput", "mori_low_latency"])
def test_the_all2all_backends_vllm_0_30_added_are_planned(backend):
    _, plan = hgx_plan("serve_layout=dp_ep", f"vllm_all2all_backend={backend}")
    assert f"--all2all-backend {backend} " in docker.run_argv(plan, plan.services()[0])[-1] and plan.notes == ()


def test_a_removed_all2all_backend_is_planned_with_a_note_of_what_vllm_runs_instead():
    # vLLM 0.30 accepts pplx and naive, logs "The 'pplx' all2all backend has been removed. Falling back to
    # 'allgather_reducescatter'." and serves: nothing fails, so railyard says it
    _, plan = hgx_plan("serve_layout=dp_ep", "vllm_all2all_backend=pplx")
    (note,) = plan.notes
    assert note.startswith("vllm_all2all_backend = 'pplx': removed in vLLM 0.30, which runs allgather_reducescatter")


def test_env_file_of_a_one_host_layout_names_its_gpus_and_cpus():
    _, plan = hgx_plan("serve_layout=dp_ep")
    text = envfile.render(plan, plan.services()[0])
    assert "LAYOUT=dp_ep\n" in text and "DP=8\n" in text and "EP=1\n" in text and "CPUSET=0-223\n" in text
    assert text.count("GPU-") == 8
    assert envfile.local_path(Path("env"), plan, plan.services()[0]) == Path("env/vllm-dp-ep/G1.engine.env")


def test_cpu_list_is_the_form_lscpu_and_docker_use():
    assert cpu_list([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert cpu_list(NUMA[1]) == "56-111,168-223"


def _write(tmp_path, mutate):
    data = yaml.safe_load(HGX.read_text())
    mutate(data)
    p = tmp_path / "inv.yml"
    p.write_text(yaml.safe_dump(data))
    return p


SERVE = lambda d: d["all"]["children"]["serve"]["vars"]  # noqa: E731


@pytest.mark.parametrize("mutate,expect", [
    (lambda d: SERVE(d).update(vllm_tensor_parallel_size=4),
     "vllm_tensor_parallel_size = 4: tensor 4 x pipeline 1 x data 1 parallel = 4 must equal the GPUs"),
    (lambda d: SERVE(d).update(serve_layout="dp_ep", vllm_enable_expert_parallel=False),
     "vllm_enable_expert_parallel = False: dp_ep needs expert parallel"),
    (lambda d: SERVE(d).update(serve_layout="dp_ep", vllm_all2all_backend="deepep"),
     "vllm_all2all_backend = 'deepep': not an --all2all-backend vLLM 0.30 knows"),
    # vLLM 0.30's parser refuses it (its MoRI backends are mori_high_throughput and mori_low_latency)
    (lambda d: SERVE(d).update(serve_layout="dp_ep", vllm_all2all_backend="mori"),
     "vllm_all2all_backend = 'mori': not an --all2all-backend vLLM 0.30 knows"),
    (lambda d: SERVE(d).update(serve_layout="dp_ep", vllm_data_parallel_size=4),
     "data 4 parallel = 4 must equal the GPUs the host gives it (cluster_gpus_per_host: 8)"),
    (lambda d: SERVE(d).update(serve_layout="single_node_tp", vllm_data_parallel_size=2, vllm_tensor_parallel_size=4),
     "single_node_tp runs one engine: use serve_layout dp_ep"),
    (lambda d: SERVE(d).update(serve_layout="tp8"), "serve_layout = 'tp8': unknown layout"),
    (lambda d: d["all"]["children"]["serve"]["hosts"].update(G2=dict(
        d["all"]["children"]["serve"]["hosts"]["G1"], ansible_host="10.30.0.22", rank=1,
        rails={k: {"hca": v["hca"], "ipv4": v["ipv4"].replace(".21/", ".22/")}
               for k, v in d["all"]["children"]["serve"]["hosts"]["G1"]["rails"].items()})),
     "runs on one host: list exactly one in a group `serve`"),
])
def test_a_bad_layout_is_refused_before_any_ssh_with_exit_2(tmp_path, mutate, expect):
    p = _write(tmp_path, mutate)
    r = inv_cmd("launch", "-i", str(p), "--dry-run")  # 10.30.0.x is never contacted: the check is static
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert expect in r.stderr and str(p) in r.stderr, r.stderr
    assert all(line.startswith("error: ") for line in r.stderr.splitlines())


def test_layout_defaults_sit_under_the_inventory_and_name_their_file(tmp_path):
    inv = load_inventory(HGX)
    h = inv.hosts[0]
    assert h.vars["vllm_gpu_memory_utilization"] == 0.92
    assert h.origins["vllm_gpu_memory_utilization"][0].endswith("layouts/single_node/single_node_tp.yml")
    inv = load_inventory(HGX, ["vllm_gpu_memory_utilization=0.8"])
    assert inv.hosts[0].vars["vllm_gpu_memory_utilization"] == 0.8
    stations = load_inventory(STATIONS)
    assert stations.hosts[0].vars["vllm_max_model_len"] == 98304  # no layout file: the role defaults


def test_layout_files_only_set_known_variables():
    known = set()
    for f in (ROOT / "railyard" / "roles").glob("*/defaults/main.yml"):
        known |= set(yaml.safe_load(f.read_text()))
    for f in (ROOT / "railyard" / "layouts").glob("*/*.yml"):
        assert set(yaml.safe_load(f.read_text())) <= known, f
        assert f.stem in layouts.names()


def test_a_station_worker_no_longer_reads_an_api_key():
    _, plan, _ = station_plan()
    assert "vllm-api-key" not in docker.run_line(plan, plan.service("worker-1"))
    assert re.search(r"-v \S+vllm-api-key:/run/secrets/vllm-api-key:ro", docker.run_line(plan, plan.service("head")))


def test_golden_dir_has_every_file():
    assert sorted(p.name for p in GOLDEN.iterdir()) == sorted(
        f"{h}.{k}" for h in "AB" for k in ("docker-run", "env", "nccl-check-run"))


def test_invalid_inventory_raises_one_problem_per_line():
    with pytest.raises(InventoryError) as e:
        load_inventory(HGX, ["serve_layout=nope"])
    assert len(e.value.problems) == 1
