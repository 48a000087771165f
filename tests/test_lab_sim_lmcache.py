"""The real LMCache server and the real LiteLLM proxy in the lab (hgx8), with the vLLM stand-in as a
real LMCache client: registration, shared-prefix hits between replicas, the memory LMCache holds on a
crashed replica's GPUs, and LiteLLM routing to a replica.

On the vLLM stand-in as LMCache's client, for the GPU-only state (the memory held on a crashed
replica's GPUs)."""

import json
import os
import random
import re
import shlex

import pytest

from railyard.facts.gpu import parse_compute_apps, parse_gpus
import railyard_lab as lab
from railyard_lab.checkpoint import write_checkpoint

from .conftest import home, on, remove_containers, wait_for

pytestmark = pytest.mark.lab
IMAGE = lab.LAB_IMAGE_NAME
LITELLM = f"{lab.LITELLM_IMAGE_NAME}@{lab.LITELLM_IMAGE_DIGEST}"
NAMES = ("lmc", "r0", "r1", "r2", "r3", "lr", "llm")
KV = ('{"kv_connector":"LMCacheMPConnector","kv_role":"kv_both","kv_connector_extra_config":'
      '{"lmcache.mp.host":"tcp://127.0.0.1","lmcache.mp.port":5555%s}}')
LMC = ("docker run -d --name lmc --network host --ipc host --gpus all -e PYTHONHASHSEED=0 --entrypoint lmcache "
       f"{IMAGE} server --host 127.0.0.1 --port 5555 --http-host 127.0.0.1 --http-port 8080 --l1-size-gb 0.25 "
       "--eviction-policy LRU --max-gpu-workers 4")
PROMPT = " ".join(f"w{random.Random(7).randrange(10 ** 6)}x{i % 97}" for i in range(20000))


def uuids():
    return [g.uuid for g in parse_gpus(on("A", "nvidia-smi --query-gpu=index,uuid,name,memory.used,memory.total "
                                                 "--format=csv,noheader,nounits").stdout)]


def apps():
    return parse_compute_apps(on("A", "nvidia-smi --query-compute-apps=gpu_uuid,pid,process_name,used_memory "
                                        "--format=csv,noheader,nounits").stdout)


def logs(name):
    return on("A", "docker", "logs", name).stdout


def lmc_status():
    return json.loads(on("A", "curl -s 127.0.0.1:8080/status").stdout)


def start_lmc():
    wait_for(lambda: on("A", "curl -sf 127.0.0.1:8080/healthcheck").returncode == 0, "LMCache /healthcheck", 90)


def replica(name, gpus, port, env="", extra=""):
    r = on("A", f"docker run -d --name {name} --network host --ipc host {env} --gpus {shlex.quote(gpus)} "
                f"-v /root/models/m:/model:ro {IMAGE} /model --port {port} -tp 2 "
                f"--kv-transfer-config {shlex.quote(KV % extra)}")
    assert r.returncode == 0, r.stderr
    wait_for(lambda: on("A", f"curl -sf 127.0.0.1:{port}/health").returncode == 0 or not
             json.loads(on("A", "docker", "inspect", "-f", "{{json .State}}", name).stdout)["Running"],
             f"{name} healthy or exited")
    return logs(name)


def ask(port):
    body = json.dumps({"model": "/model", "messages": [{"role": "user", "content": PROMPT}]})
    home("A").joinpath("prompt.json").write_text(body)
    r = on("A", f"curl -sf -H 'content-type: application/json' --data @/root/prompt.json 127.0.0.1:{port}"
                "/v1/chat/completions")
    assert r.returncode == 0, r.stderr


def ext_hits(port):
    m = on("A", f"curl -s 127.0.0.1:{port}/metrics").stdout
    return float(re.search(r'^vllm:external_prefix_cache_hits_total\{engine="0",model_name="/model"\} (\S+)$',
                           m, re.M).group(1))


@pytest.fixture(scope="module")
def lmc(hgx8_inventory):
    write_checkpoint(home("A") / "models" / "m", 0.002, 2)
    remove_containers(*NAMES, hosts=("A",))
    r = on("A", LMC)
    assert r.returncode == 0, r.stderr
    start_lmc()
    yield
    remove_containers(*NAMES, hosts=("A",))


def test_replicas_share_the_prefix_through_lmcache(lmc):
    u = uuids()
    assert json.loads(on("A", "curl -s 127.0.0.1:8080/healthcheck").stdout) == {"status": "healthy"}
    for name, gpus, port in (("r0", u[0:2], 8001), ("r1", u[2:4], 8002)):
        out = replica(name, f'"device={",".join(gpus)}"', port, "-e PYTHONHASHSEED=0")
        assert out.count("LMCache INFO: Registering kv caches!") == 2, out
        assert "PYTHONHASHSEED is not set" not in out
    ids = [int(i) for n in ("r0", "r1") for i in re.findall(r"instance_id=(\d+)", logs(n))]
    assert len(ids) == 4 and sorted(lmc_status()["registered_gpu_ids"]) == sorted(ids)
    assert logs("lmc").count("Registered KV cache for GPU ID") == 4
    ask(8001)
    ask(8002)
    # the reuse as both sides count it (the stand-in's timings follow them, and a loaded machine's do not)
    assert ext_hits(8002) >= 19968 and ext_hits(8001) == 0
    out = logs("lmc")
    assert re.search(r"Stored 19968 tokens", out) and re.search(r"Retrieved 19968 tokens", out)


def test_other_seed_keys_miss_only_where_the_keys_take_the_seed(lmc):
    """LMCache 0.5.6's MP server hashes the token ids itself (blake3): a replica's PYTHONHASHSEED changes
    vLLM's own block hashes, not LMCache's keys. RAILYARD_LAB_LMCACHE_SEEDED_KEYS=1 makes the keys
    depend on it (salted with vLLM's root hash), as the LMCache docs' warning describes."""
    u = uuids()
    if on("A", "curl -sf 127.0.0.1:8001/health").returncode != 0:  # run alone: no replica of seed 0 yet
        replica("r0", f'"device={u[0]},{u[1]}"', 8001, "-e PYTHONHASHSEED=0")
    ask(8001)  # the prompt in LMCache, stored by a replica of seed 0 (again: a hit in its own cache)
    out = replica("r2", f'"device={u[4]},{u[5]}"', 8003, "-e RAILYARD_LAB_LMCACHE_SEEDED_KEYS=1")
    assert "PYTHONHASHSEED is not set. This will lead to non-reproducible block-hashes" in out
    ask(8003)
    assert ext_hits(8003) == 0
    replica("r3", f'"device={u[6]},{u[7]}"', 8004, "-e PYTHONHASHSEED=1")
    ask(8004)
    assert ext_hits(8004) >= 19968
    assert on("A", "docker stop r2 r3").returncode == 0
    gone = [int(i) for n in ("r2", "r3") for i in re.findall(r"instance_id=(\d+)", logs(n))]
    assert not set(gone) & set(lmc_status()["registered_gpu_ids"])
    assert not {a.gpu_uuid for a in apps()} & set(u[4:8])  # a clean stop leaves its GPUs free


def test_a_killed_replica_leaves_lmcache_holding_its_gpus(lmc):
    u = uuids()
    lmc_pid = int(on("A", "docker", "inspect", "-f", "{{.State.Pid}}", "lmc").stdout)
    assert on("A", "docker kill r1").returncode == 0
    held = [a for a in apps() if a.pid == lmc_pid]
    assert sorted(a.gpu_uuid for a in held) == sorted(u[2:4]) and all(a.used_mib > 100_000 for a in held)
    assert all(a.pid != lmc_pid for a in apps() if a.gpu_uuid in u[0:2])  # r0 lives: no double count
    gpus = parse_gpus(on("A", "nvidia-smi --query-gpu=index,uuid,name,memory.used,memory.total "
                                "--format=csv,noheader,nounits").stdout)
    assert gpus[2].memory_used_mib > 100_000
    assert on("A", "docker start r1").returncode == 0
    wait_for(lambda: not json.loads(on("A", "docker", "inspect", "-f", "{{json .State}}", "r1").stdout)["Running"],
             "r1 to fail")
    assert "ValueError: Free memory on device cuda:0" in logs("r1")
    on("A", "docker stop lmc")
    assert on("A", "docker start lmc").returncode == 0
    start_lmc()
    assert not [a for a in apps() if a.gpu_uuid in u[2:4]]
    assert on("A", "docker start r1").returncode == 0
    wait_for(lambda: on("A", "curl -sf 127.0.0.1:8002/health").returncode == 0, "r1 healthy again")
    assert len(lmc_status()["registered_gpu_ids"]) == 2  # r1's two new instances (r0 registered before)


def test_litellm_proxy_routes_to_a_replica(lmc):
    u = uuids()
    inspect = on("A", "docker", "image", "inspect", "-f", "{{json .Config.Entrypoint}}", LITELLM, IMAGE).stdout
    assert inspect.split() == ['["docker/prod_entrypoint.sh"]', '["vllm","serve"]']
    on("A", "docker rm -f r0 >/dev/null")
    r = on("A", f"docker run -d --name lr --network host --gpus '\"device={u[0]},{u[1]}\"' -v /root/models/m:/model:ro "
                f"{IMAGE} /model --port 8005 -tp 2")
    assert r.returncode == 0, r.stderr
    cfg = home("A") / "litellm"
    cfg.mkdir(exist_ok=True)
    (cfg / "config.yaml").write_text(
        "model_list:\n  - model_name: m\n    litellm_params: {model: hosted_vllm//model, "
        "api_base: 'http://127.0.0.1:8005/v1', api_key: none}\n    model_info: {id: lr}\n")
    secret = home("A") / "litellm-secret"
    secret.mkdir(exist_ok=True)
    key = "sk-lab-" + "".join(random.choice("abcdef0123456789") for _ in range(32))
    (secret / "key").write_text(key)
    line = ('LITELLM_MASTER_KEY="$(cat /run/secrets/litellm_key)"; export LITELLM_MASTER_KEY; '
            "exec litellm --config /etc/litellm/config.yaml --host 127.0.0.1 --port 4000")
    r = on("A", f"docker run -d --name llm --network host -v /root/litellm:/etc/litellm:ro "
                f"-v /root/litellm-secret/key:/run/secrets/litellm_key:ro --entrypoint sh {LITELLM} -c "
                f"{shlex.quote(line)}")
    assert r.returncode == 0, r.stderr
    wait_for(lambda: on("A", "curl -sf 127.0.0.1:4000/health/liveliness").returncode == 0, "LiteLLM up", 120)
    body = shlex.quote(json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}))
    out = on("A", f"curl -s -i -H 'Authorization: Bearer {key}' -H 'content-type: application/json' --data {body} "
                  "127.0.0.1:4000/v1/chat/completions").stdout
    assert re.search(r"^x-litellm-model-id: lr\r?$", out, re.M | re.I), out
    assert re.search(r"The two stations answer over the \w+\.", out), out   # its last word: the weights' own
    assert key not in on("A", "docker", "inspect", "llm").stdout


def test_lab_up_sweeps_the_kv_segments_of_lmcache_clients_that_are_gone(tmp_path):
    from railyard_lab import _sweep_shm
    dead = 4194304 + 7  # above Linux's pid_max: never a live process
    for name in (f"lmcache_kv_{dead}_0", f"lmcache_kv_{dead}_1", f"lmcache_kv_{os.getpid()}_0", "faketime_shm_1"):
        (tmp_path / name).write_bytes(b"\0" * 16)
    _sweep_shm(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["faketime_shm_1", f"lmcache_kv_{os.getpid()}_0"]
