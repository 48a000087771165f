"""`inv health`'s verdicts on each service and on the API, against fake docker hosts: a dead container
named, a stopped (hung) serving process named with its pid and state, a container with nothing on its
GPU, and the API's answers: the real vLLM answers of tests/fixtures/real/vllm-api (ORIGINS.md there), a
bad one failing the probe with the server's words. Whether an engine moves is the shared hung verdict's
(tests/test_health_progress.py)."""

from __future__ import annotations


from railyard.testing import FakeDockerHost
from railyard.engines import by_name
from railyard.verbs import health

from .conftest import real
from .test_plan import station_plan

VLLM = by_name("vllm")

NAME = "glm53-full"


def station(name="B"):
    """One station's host with the service it runs (B: the headless rank, A: the head and its API)."""
    inv, plan, facts = station_plan()
    svc = next(s for s in plan.services() if s.host == name)
    gpu = facts[name].gpus[0]
    host = FakeDockerHost(inv.host(name), gpus=[(gpu.index, gpu.uuid, gpu.name, 0, gpu.memory_total_mib)])
    host.behave(NAME, gpu=[(gpu.uuid, f"VLLM::Worker_TP{svc.rank}", 60000)])
    host.container(NAME, "x")
    return plan, svc, host


def test_a_running_rank_with_its_process_on_its_gpu_is_healthy():
    _, svc, host = station()
    h = health.service_health(host.session, svc)
    assert h.ok and h.state == "running" and h.serving_process == "VLLM::Worker_TP1" and h.gpu_used_mib == 60000


def test_a_rank_whose_container_died_is_named_with_its_state():
    _, svc, host = station()
    host.kill(NAME, 137)
    h = health.service_health(host.session, svc)
    assert not h.ok and h.reasons == ["container glm53-full is exited"] and h.state == "exited"
    host.session.run(f"docker rm -f {NAME}")
    assert health.service_health(host.session, svc).reasons == ["container glm53-full is missing"]


def test_a_stopped_serving_process_is_hung_named_with_its_pid_and_state():
    _, svc, host = station()
    p = host.gpu_procs[0]
    p.state = "T"
    h = health.service_health(host.session, svc)
    assert not h.ok and h.reasons == [f"hung: VLLM::Worker_TP1 (pid {p.pid}) is stopped (state T in /proc/{p.pid}/stat)"]


def test_a_running_container_with_nothing_on_its_gpu_is_not_serving():
    _, svc, host = station()
    host.gpu_procs.clear()
    h = health.service_health(host.session, svc)
    assert not h.ok and h.reasons == ["no serving process on the GPU"]


def api(chat, metrics="vllm:prompt_tokens_total 10\nvllm:generation_tokens_total 20\n", served=True):
    plan, svc, host = station("A")
    ep = plan.endpoint
    models = real("vllm-cpu/v1-models.json")   # the lab's engine: served as the plan's model, or as it was
    host.http(ep.port, "/health", (200, ""))
    host.http(ep.port, "/v1/models", (200, models.replace("railyard-lab/tiny-qwen3", ep.model) if served else models))
    host.http(ep.port, "/v1/chat/completions", chat)
    host.http(ep.port, "/metrics", (200, metrics))
    probes, _ = health._api_probes(host.session, ep, VLLM)
    assert not host.unexpected, host.unexpected
    return {p.name: p for p in probes}, ep


def test_the_real_answer_of_a_healthy_engine_passes_every_probe():
    probes, ep = api((200, real("vllm-api/chat-length-16.json")))
    assert all(p.ok for p in probes.values()), probes
    assert probes["chat completion"].detail.startswith("HTTP 200; finish_reason length; 16 token(s)")


def test_an_engine_that_serves_another_model_fails_the_models_probe_naming_both():
    probes, ep = api((200, real("vllm-api/chat-length-16.json")), served=False)
    assert not probes["/v1/models"].ok
    assert probes["/v1/models"].detail == f"HTTP 200; serves railyard-lab/tiny-qwen3 (expected {ep.model})"


def test_a_bad_answer_fails_the_chat_probe_with_the_servers_words():
    body, code = real("vllm-api/chat-unknown-model.txt").rsplit("\n", 2)[:2]
    probes, _ = api((int(code), body))
    assert probes["/health"].ok and not probes["chat completion"].ok
    assert probes["chat completion"].detail.startswith("HTTP 404: {\"error\":{\"message\":\"The model `nope` does not exist.")
