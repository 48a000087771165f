"""Prefill/decode disaggregation in the lab (3 hgx8 hosts): two DP4 prefill instances on A, one DP8
decode on C, the real vllm-router on A in front, the stand-in's NixlConnector moving KV blocks over
A's and C's rail addresses.

On the vLLM stand-in: NIXL's RDMA transport lines (rc_mlx5 on the rail HCA) need an RDMA device; the
real NIXL over TCP is in test_lab_real_pd.py."""

import json
import re
import shlex
import time

import pytest

from railyard.facts.gpu import parse_gpus
import railyard_lab as lab
from railyard_lab.checkpoint import write_checkpoint

from .conftest import home, on, remove_containers, wait_for

pytestmark = pytest.mark.lab
IMAGE = lab.LAB_IMAGE_NAME
ROUTER = f"{lab.ROUTER_IMAGE_NAME}@{lab.ROUTER_IMAGE_DIGEST}"
NAMES = ("p1", "p2", "p3", "d1", "d2", "router")
HOSTS = ("A", "B", "C")
KV = "'{\"kv_connector\":\"NixlConnector\",\"kv_role\":\"%s\"}'"
RDMA = ("--device /dev/infiniband --cap-add IPC_LOCK --ulimit memlock=-1 -e UCX_LOG_LEVEL=info "
        "-e UCX_TLS=rc,ud,tcp -e UCX_NET_DEVICES=mlx5_0:1")
LONG = " ".join(f"word{i}" for i in range(40))  # 40 tokens: 2 full blocks of 16


def rail(host):
    return f"{lab.rail_net(0)}.{10 + HOSTS.index(host) + 1}"


def uuids(host):
    return [g.uuid for g in parse_gpus(on(host, "nvidia-smi --query-gpu=index,uuid,name,memory.used,memory.total "
                                                  "--format=csv,noheader,nounits").stdout)]


def logs(host, name):
    r = on(host, "docker", "logs", name)
    return r.stdout + r.stderr


def running(host, name):
    return json.loads(on(host, "docker", "inspect", "-f", "{{json .State}}", name).stdout or "{}").get("Running")


def serve(host, name, gpus, port, role, env="", extra="", lease=None):
    kv = KV % role if lease is None else shlex.quote(json.dumps(
        {"kv_connector": "NixlConnector", "kv_role": role, "kv_connector_extra_config": {"kv_lease_duration": lease}}))
    r = on(host, f"docker run -d --name {name} --network host --ipc host {RDMA} {env} "
                 f"--gpus {shlex.quote(chr(34) + 'device=' + ','.join(gpus) + chr(34))} -v /root/models/m:/model:ro "
                 f"{IMAGE} /model --port {port} {extra} --enable-log-requests --kv-transfer-config {kv}")
    assert r.returncode == 0, r.stderr
    wait_for(lambda: on(host, f"curl -sf {rail(host)}:{port}/health").returncode == 0 or not running(host, name),
             f"{name} healthy or exited")
    assert running(host, name), logs(host, name)


def post(host, url, body, headers=()):
    home(host).joinpath("req.json").write_text(json.dumps(body))
    h = " ".join(f"-H {shlex.quote(x)}" for x in headers)
    r = on(host, f"curl -s -w '\\n%{{http_code}}' -H 'content-type: application/json' {h} --data @/root/req.json {url}")
    out, _, code = r.stdout.rpartition("\n")
    return int(code or 0), out


def chat(prompt, **kw):
    return {"model": "/model", "messages": [{"role": "user", "content": prompt}], **kw}


def ask_router(prompt):
    return post("A", "http://127.0.0.1:8000/v1/chat/completions", chat(prompt, max_tokens=8))


def xfers(host, port):
    m = on(host, f"curl -s {rail(host)}:{port}/metrics").stdout
    return sum(float(v) for v in re.findall(r"^vllm:nixl_xfer_time_seconds_count\{[^}]*\} (\S+)$", m, re.M))


@pytest.fixture(scope="module")
def pd(lab_inventory):
    from railyard_lab import faults
    faults.heal()
    lab.up(3, log=lambda *_: None, shape="hgx8")
    for h in HOSTS:
        write_checkpoint(home(h) / "models" / "m", 0.002, 2)
        remove_containers(*NAMES, hosts=(h,))
    a, c = uuids("A"), uuids("C")
    pa = f"-e VLLM_NIXL_SIDE_CHANNEL_HOST={rail('A')}"
    serve("A", "p1", a[:4], 8100, "kv_producer", f"{pa} -e VLLM_NIXL_SIDE_CHANNEL_PORT=5600",
          f"--host {rail('A')} -ep -tp 1 -dp 4")
    serve("A", "p2", a[4:], 8101, "kv_producer", f"{pa} -e VLLM_NIXL_SIDE_CHANNEL_PORT=5604",
          f"--host {rail('A')} -ep -tp 1 -dp 4")
    serve("C", "d1", c, 8200, "kv_consumer", f"-e VLLM_NIXL_SIDE_CHANNEL_HOST={rail('C')} -e VLLM_LOG_STATS_INTERVAL=1",
          f"--host {rail('C')} -dp 8")
    r = on("A", f"docker run -d --name router --network host {ROUTER} --vllm-pd-disaggregation "
                f"--prefill http://{rail('A')}:8100 --prefill http://{rail('A')}:8101 --decode http://{rail('C')}:8200 "
                "--kv-connector nixl --policy round_robin --host 127.0.0.1 --port 8000 --prometheus-port 29000 "
                "--health-check-interval-secs 1 --health-failure-threshold 1 --retry-max-retries 2")
    assert r.returncode == 0, r.stderr
    wait_for(lambda: on("A", "curl -sf 127.0.0.1:8000/health").returncode == 0, "the router's /health", 60)
    yield
    for h in HOSTS:
        remove_containers(*NAMES, hosts=(h,))
    faults.heal()
    lab.up(2, log=lambda *_: None)  # the shape every other lab test expects
    faults.heal()


def test_a_long_prompt_is_prefilled_on_a_and_decoded_on_c(pd):
    code, out = ask_router(LONG)
    assert code == 200, out
    assert json.loads(out)["choices"][0]["message"]["content"]
    d = wait_for(lambda: (lambda t: "KV Transfer metrics: Num successful transfers=1" in t and t)(logs("C", "d1")),
                 "the decode's transfer line", 15)
    rid = re.search(r"Received request (chatcmpl-___prefill_addr_\S+):", d).group(1)
    assert rid.endswith(re.search(r"_([0-9a-f]{32})$", rid).group(1))
    p = [logs("A", n) for n in ("p1", "p2")]
    served = [t for t in p if f"Received request {rid}:" in t]
    assert len(served) == 1  # the same id on the prefill that served it
    assert re.search(r"inter-node cfg#\d+ rma\(rc_mlx5/mlx5_0:1\)", served[0])  # its end of the connection
    assert "NIXL compatibility check passed (hash: " in d
    assert re.search(r"ucp_context_0 inter-node cfg#\d+ rma\(rc_mlx5/mlx5_0:1\) am\(rc_mlx5/mlx5_0:1\) "
                     r"ka\(ud_mlx5/mlx5_0:1\)", d), d
    for t in p + [d]:
        assert "Backend UCX was instantiated" in t and "Initialized NIXL agent: " in t
    assert xfers("C", 8200) == 1


def test_a_prompt_shorter_than_a_block_moves_nothing(pd):
    before = xfers("C", 8200)
    code, out = post("A", f"http://{rail('A')}:8100/v1/chat/completions",
                     chat("five words are too few", max_tokens=1, kv_transfer_params={"do_remote_decode": True}))
    assert code == 200, out
    params = json.loads(out)["kv_transfer_params"]
    assert params["remote_block_ids"] == [] and params["remote_host"] == rail("A")
    code, out = ask_router("five words are too few")
    assert code == 200, out
    assert xfers("C", 8200) == before


def test_a_killed_prefill_instance_leaves_the_router_on_the_other(pd):
    assert on("A", "docker kill p2").returncode == 0
    time.sleep(3)  # the router's health check (1 s, one failure) takes p2 out
    n0 = logs("A", "p1").count("Received request")
    codes = [ask_router(LONG)[0] for _ in range(6)]
    assert codes == [200] * 6
    assert logs("A", "p1").count("Received request") - n0 == 6
    assert "Unhealthy servers" in on("A", "curl -s 127.0.0.1:8000/health").stdout


def prefill_on(host, port, prompt=LONG):
    code, out = post(host, f"http://{rail(host)}:{port}/v1/chat/completions",
                     chat(prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True}),
                     ["X-Request-Id: lab-" + str(time.time_ns())])
    assert code == 200, out
    return json.loads(out)["kv_transfer_params"]


def test_a_kv_cache_dtype_mismatch_fails_the_handshake(pd):
    serve("B", "d2", uuids("B"), 8300, "kv_consumer", f"-e VLLM_NIXL_SIDE_CHANNEL_HOST={rail('B')}",
          f"--host {rail('B')} -dp 8 --kv-cache-dtype fp8")
    params = prefill_on("A", 8100)
    assert len(params["remote_block_ids"]) == 2 and params["remote_port"] in range(5600, 5604)
    code, out = post("B", f"http://{rail('B')}:8300/v1/chat/completions", chat(LONG, kv_transfer_params=params))
    assert code == 500 and "EngineCore encountered an issue" in out
    wait_for(lambda: not running("B", "d2"), "d2 to exit", 10)
    t = logs("B", "d2")
    assert "RuntimeError: NIXL compatibility hash mismatch. Local: " in t and "NIXL transfer failure: handshake_failed" in t
    assert f"KeyError: '{params['remote_engine_id']}'" in t


def test_a_localhost_side_channel_fails_across_hosts(pd):
    on("A", "docker rm -f p2 >/dev/null 2>&1; true")
    serve("A", "p3", uuids("A")[4:], 8101, "kv_producer", "", f"--host {rail('A')} -tp 1 -dp 4", lease=3)
    params = prefill_on("A", 8101)
    assert params["remote_host"] == "localhost"
    t0 = time.monotonic()
    code, out = post("C", f"http://{rail('C')}:8200/v1/chat/completions", chat(LONG, kv_transfer_params=params))
    assert code == 500 and time.monotonic() - t0 >= 5  # the side channel's 5 s receive timeout
    t = logs("C", "d1")
    assert "NIXL transfer failure: handshake_setup_failed" in t and "zmq.error.Again: Resource temporarily unavailable" in t
    assert f"KeyError: '{params['remote_engine_id']}'" in t
    p3 = wait_for(lambda: (lambda x: "Releasing expired KV blocks" in x and x)(logs("A", "p3")), "p3's expiry", 10)
    assert f"Releasing expired KV blocks for request {params['remote_request_id']} which were retrieved by 0 remote " \
           "worker(s) before lease expired." in p3
