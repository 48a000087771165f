"""serve_layout replicas on an hgx8 lab host, with the real LMCache server and the real LiteLLM
proxy: launch (2 x TP4, then 4 x TP2), health and the cache proof, a replica killed under load
with no request lost (each one's outcome counted across the kill), `inv recover` on both paths, a planned
restart that loses no request, and `inv render --compose` against the real host.

On the vLLM stand-in: a killed replica whose KV memory LMCache keeps mapped on its GPUs over CUDA
IPC (recover's long path) exists only on GPUs; the real engines' health, cache proof and planned
restart are in test_lab_real_replicas.py."""

import json
import re
import shutil
import subprocess
import time

import pytest

from railyard_lab.checkpoint import write_checkpoint

from .conftest import home, inv_cmd, on

pytestmark = pytest.mark.lab
DEP = "vllm-replicas"
NAMES = [f"{DEP}-{n}" for n in ("router", "r0", "r1", "r2", "r3", "lmcache")]
LAYOUT = ("--set", "serve_layout=replicas")

# Sequential chat completions through the router from host A for SECONDS: each one's end time,
# whether it succeeded and which replica answered (LiteLLM's x-litellm-model-id header).
LOAD = r"""
import json, sys, time, urllib.request
key = open("/root/.config/railyard/litellm-master-key").read().strip()
end = time.time() + float(sys.argv[1]); events = []
while time.time() < end:
    req = urllib.request.Request("http://127.0.0.1:4000/v1/chat/completions", method="POST",
        data=json.dumps({"model": "railyard-lab/tiny-qwen3", "max_tokens": 2,
                         "messages": [{"role": "user", "content": "hi"}]}).encode(),
        headers={"Authorization": "Bearer " + key, "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            events.append([time.time(), True, r.headers.get("x-litellm-model-id")])
    except Exception as e:
        events.append([time.time(), False, str(e)[:80]])
    time.sleep(0.05)
print(json.dumps(events))
"""


def inv(path, *args, timeout=300):
    return inv_cmd(*args, "-i", str(path), *LAYOUT, timeout=timeout)


def load(seconds: float) -> subprocess.Popen:
    import railyard_lab as lab
    root = lab.lab_dir()
    argv = lab.ssh_argv(root, lab.lab_host(root, "A"), [f"python3 - {seconds}"])
    p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    p.stdin.write(LOAD)
    p.stdin.close()
    return p


def events(p: subprocess.Popen) -> list:
    out = p.stdout.read()
    p.wait(timeout=300)
    assert out.strip(), p.stderr.read()
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def deployed(hgx8_inventory):
    write_checkpoint(home("A") / "models" / "tiny-qwen3", 0.002, 2)
    on("A", "docker rm -f " + " ".join(NAMES) + " >/dev/null 2>&1; true")
    assert inv(hgx8_inventory, "env").returncode == 0
    r = inv(hgx8_inventory, "launch")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr
    yield hgx8_inventory
    on("A", "docker rm -f " + " ".join(NAMES) + " >/dev/null 2>&1; true")
    shutil.rmtree(home("A") / "models", ignore_errors=True)


def test_launch_health_cache_proof_and_a_noop_relaunch(deployed):
    r = inv(deployed, "health", "--json", "--cache-proof", "--proof-words", "20000")
    doc = json.loads(r.stdout)
    assert r.returncode == 0, [c for c in doc["checks"] if c["status"] != "pass"]
    data = doc["data"]["metrics"]
    assert data["lmcache"]["healthcheck"] and len(data["lmcache"]["registered_gpu_ids"]) == 8
    assert sorted(data["router"]["healthy"]) == ["r0", "r1"] and data["router"]["answered_by"] in ("r0", "r1")
    proof = data["cache_proof"]
    assert proof["retrieved_tokens"] > 0 and proof["external_prefix_cache_hits"] > 0   # the stand-in's counts
    # the router's config on the host is the one rendered from the plan; the key file is 0600
    assert "model_info:\n    id: r1" in on("A", f"cat ~/.cache/railyard/serve/{DEP}/router/config.yaml").stdout
    assert on("A", "stat -c %a ~/.config/railyard/litellm-master-key").stdout.strip() == "600"
    assert "sk-" in on("A", "cut -c1-3 ~/.config/railyard/litellm-master-key").stdout
    key = (home("A") / ".config" / "railyard" / "litellm-master-key").read_text().strip()
    seen = {"health --json": r.stdout + r.stderr, "ps": on("A", "ps -eo args").stdout,
            "docker inspect": on("A", f"docker inspect {DEP}-router {DEP}-r0 {DEP}-lmcache").stdout,
            "router log": on("A", f"docker logs {DEP}-router 2>&1").stdout}
    assert len(key) > 20 and not [k for k, text in seen.items() if key in text]
    again = inv(deployed, "launch")
    assert again.returncode == 0 and "nothing to do" in again.stdout


def test_the_cache_proof_fails_when_a_replica_keys_its_blocks_differently(deployed):
    # The inventory cannot give r1 another PYTHONHASHSEED (the static checks refuse it), so r1 is
    # started by hand with one, and with the lab's knob that makes a seed part of the cache key
    # (LMCache 0.5.6's MP server hashes token ids itself; the seed matters where the engine's
    # block hashes are the keys).
    line = on("A", f"docker inspect --format '{{{{json .Config.Env}}}}' {DEP}-r1").stdout
    assert "PYTHONHASHSEED=0" in line
    from dataclasses import replace
    from railyard.inventory import load_inventory
    from railyard.verbs.serve import build_plan
    from railyard.render.docker import run_line
    from railyard.transport.runner import Runner
    inv_ = load_inventory(deployed, ["serve_layout=replicas"])
    with Runner(inv_.hosts[:1]) as runner:
        plan = build_plan(inv_, runner)
    svc = plan.service("r1")
    env = tuple((k, "1" if k == "PYTHONHASHSEED" else v) for k, v in svc.spec.env)
    run_r1 = run_line(plan, replace(svc, spec=replace(svc.spec, env=env + (("RAILYARD_LAB_LMCACHE_SEEDED_KEYS", "1"),))))
    # stopped cleanly first: `docker rm -f` kills it, and LMCache would keep its GPU memory
    on("A", f"docker stop {DEP}-r1 >/dev/null && docker rm {DEP}-r1 >/dev/null")
    assert on("A", run_r1).returncode == 0
    try:
        assert on("A", "for i in $(seq 1 240); do curl -sf 127.0.0.1:8002/health >/dev/null && echo up && break; "
                       "sleep 0.25; done").stdout.strip() == "up"
        r = inv(deployed, "health", "--json", "--cache-proof", "--proof-words", "20000")
        doc = json.loads(r.stdout)
        proof = next(c for c in doc["checks"] if c["check"] == "cache_proof")
        assert r.returncode == 1 and proof["status"] == "fail", proof
        assert "did not reuse the first one's KV blocks" in proof["detail"] and "PYTHONHASHSEED" in proof["detail"]
        assert doc["data"]["metrics"]["cache_proof"]["retrieved_tokens"] == 0
    finally:
        assert inv(deployed, "launch", "--recreate").returncode == 0


def test_a_killed_replica_loses_no_request_the_retry_lands_on_the_other_then_recover_takes_the_long_path(deployed):
    p = load(16)
    time.sleep(3)
    killed = time.time()
    on("A", f"docker kill {DEP}-r1")
    ev = events(p)
    before = [e for e in ev if e[0] < killed]
    after = [e for e in ev if e[0] >= killed]
    failed = [e for e in after if not e[1]]
    last_r1_or_failure = max((e[0] for e in after if not e[1] or e[2] == "r1"), default=killed)
    # a request that reached the dead r1 is retried by LiteLLM, and railyard's routing filter leaves out
    # the replicas that already failed it: the retry lands on r0 (without the filter it picked r1 again
    # now and then: 1 of 209, 1 of 213, 0 of 206 failed); r1's health check (every 5 s in the lab) then
    # takes it out, and only r0 answers
    print(f"after the kill: {len(failed)} of {len(after)} requests failed; traffic only on r0 after "
          f"{last_r1_or_failure - killed:.1f} s")
    assert not failed, failed
    assert {e[2] for e in before if e[1]} == {"r0", "r1"}  # both served before
    assert last_r1_or_failure - killed < 5 + 6  # one interval, and the check itself
    tail = [e for e in after if e[0] > last_r1_or_failure]
    assert len(tail) > 10 and all(e[1] and e[2] == "r0" for e in tail)
    # LMCache still holds r1's GPUs: nvidia-smi shows its PID there, so r1 cannot start alone
    dry = inv(deployed, "recover", "--dry-run", "--json")
    doc = json.loads(dry.stdout)
    assert dry.returncode == 0 and doc["data"]["path"] == "long", doc
    assert any("LMCache still holds r1's GPUs" in w for w in doc["data"]["why"])
    assert on("A", f"docker inspect --format '{{{{.State.Running}}}}' {DEP}-r0").stdout.strip() == "true"  # untouched
    r = inv(deployed, "recover")
    assert r.returncode == 0 and "OK: r0, r1 recovered" in r.stdout, r.stdout[-2000:]
    assert re.search(r"done: started lmcache: ready.*done: started r0, r1: ready", r.stdout, re.S)
    health = inv(deployed, "health", "--json")
    assert health.returncode == 0, health.stdout[-2000:]


def test_a_replica_that_exited_cleanly_comes_back_alone(deployed):
    pid = on("A", f"docker inspect --format '{{{{.State.Pid}}}}' {DEP}-r1").stdout.strip()
    on("A", f"kill -TERM {pid}")  # a clean exit: its connector unregisters, its GPUs are free
    on("A", f"for i in $(seq 1 100); do [ \"$(docker inspect --format '{{{{.State.Running}}}}' {DEP}-r1)\" = false ] "
            "&& break; sleep 0.1; done")
    lmc_started = on("A", f"docker inspect --format '{{{{.State.StartedAt}}}}' {DEP}-lmcache").stdout
    r = inv(deployed, "recover", "--json")
    doc = json.loads(r.stdout)
    assert r.returncode == 0 and doc["data"]["path"] == "short" and doc["data"]["services"] == ["r1"], doc
    assert on("A", f"docker inspect --format '{{{{.State.StartedAt}}}}' {DEP}-lmcache").stdout == lmc_started
    assert inv(deployed, "health").returncode == 0


def test_a_planned_restart_takes_the_replica_out_of_routing_first_and_loses_no_request(deployed):
    p = load(20)
    r = inv(deployed, "recover", "--replica", "r1")
    ev = events(p)
    print(f"during the planned restart: {sum(1 for e in ev if not e[1])} of {len(ev)} requests failed")
    assert r.returncode == 0 and "took r1 out of routing" in r.stdout and "put r1 back into routing" in r.stdout
    assert len(ev) > 20 and all(e[1] for e in ev), [e for e in ev if not e[1]]
    assert on("A", f"cat ~/.cache/railyard/serve/{DEP}/router/drained").stdout == ""


NEW_REV = "b" * 40


def new_revision(broken: bool = False) -> str:
    """The lab model's other seed (its other weights) beside the running checkpoint, as a new revision is
    downloaded; broken: its config.json cut short (the engine cannot start on it)."""
    from railyard_lab.faults import WRONG_SEED
    path = home("A") / "models" / f"tiny-qwen3-{NEW_REV[:12]}"
    shutil.rmtree(path, ignore_errors=True)
    write_checkpoint(path, 0.002, 2, model_seed=WRONG_SEED)
    if broken:
        (path / "config.json").write_text("{")
    return str(path)


def started_at(*names: str) -> dict[str, str]:
    return {n: on("A", f"docker inspect --format '{{{{.State.StartedAt}}}}' {DEP}-{n}").stdout.strip() for n in names}


def test_a_new_revision_rolls_one_replica_at_a_time_under_load_with_no_request_lost(deployed):
    """issue 45: the other seed's weights as a new revision; `inv roll` takes r0 out of routing, drains it, starts
    it on the new checkpoint, gates it, back in; then r1. Every request of a steady load is counted; the canary is
    recorded again for the new revision (other weights answer otherwise); `inv status` shows the roll."""
    new_revision()
    before = json.loads(on("A", f"cat ~/.cache/railyard/serve/{DEP}/canary.json 2>/dev/null || echo null").stdout)
    lmc = started_at("lmcache", "router")
    p = load(25)
    r = inv(deployed, "roll", "--revision", NEW_REV, "--json", timeout=600)
    ev = events(p)
    doc = json.loads(r.stdout)
    print(f"during the roll: {sum(1 for e in ev if not e[1])} of {len(ev)} requests failed; roll {doc['data']['seconds']} s")
    assert r.returncode == 0, doc
    assert len(ev) > 20 and all(e[1] for e in ev), [e for e in ev if not e[1]]
    done = [d["step"] for d in doc["data"]["done"]]
    assert [d for d in done if d.startswith(("r0: started", "r1: started"))] == [
        "r0: started on the new plan, gated, and answered a request", "r1: started on the new plan, gated, and answered a request"]
    assert started_at("lmcache", "router") == lmc                     # only the replicas restarted
    record = json.loads(on("A", f"cat ~/.cache/railyard/serve/{DEP}/canary.json").stdout)
    assert record["model_revision"] == NEW_REV and (before is None or record["answers"] != before["answers"])
    st = json.loads(inv(deployed, "status", "--json").stdout)
    last = st["data"]["recoveries"]["last_roll"]
    assert last["ok"] and last["change"]["to"] == NEW_REV and last["path"] == "one replica at a time"
    assert f"tiny-qwen3-{NEW_REV[:12]}" in on("A", f"docker inspect {DEP}-r1").stdout   # its checkpoint mounted


def test_a_revision_that_does_not_start_stops_the_roll_at_the_first_replica_on_the_old_weights(deployed):
    # the inventory's revision again (its env files, then its containers)
    assert inv(deployed, "env").returncode == 0 and inv(deployed, "launch", "--recreate").returncode == 0
    assert inv(deployed, "health", "--canary", "record").returncode == 0
    new_revision(broken=True)
    r1 = started_at("r1")
    r = inv(deployed, "roll", "--revision", NEW_REV, "--json", timeout=600)
    doc = json.loads(r.stdout)
    assert r.returncode == 1 and doc["data"]["failure"].startswith("r0 on the new plan: "), doc["data"]
    assert "r0 is back on the old plan and in routing" in doc["data"]["failure"]
    assert started_at("r1") == r1                                      # the roll stopped before r1
    assert f"tiny-qwen3-{NEW_REV[:12]}" not in on("A", f"docker inspect {DEP}-r0").stdout
    h = inv(deployed, "health", "--canary", "--json")
    assert h.returncode == 0, [c for c in json.loads(h.stdout)["checks"] if c["status"] != "pass"]
    last = json.loads(inv(deployed, "status", "--json").stdout)["data"]["recoveries"]["last_roll"]
    assert not last["ok"] and last["failure"].startswith("r0 on the new plan")
    shutil.rmtree(home("A") / "models" / f"tiny-qwen3-{NEW_REV[:12]}", ignore_errors=True)


def test_stop_start_and_four_tp2_replicas(deployed):
    stop = inv(deployed, "stop")
    assert stop.returncode == 0
    start = inv(deployed, "start")
    assert start.returncode == 0 and "ready" in start.stdout, start.stdout[-2000:]
    four = ("--set", "vllm_replicas=4", "--set", "vllm_tensor_parallel_size=2")
    assert inv(deployed, "env", *four).returncode == 0
    r = inv(deployed, "launch", "--recreate", *four)
    assert r.returncode == 0, r.stdout[-2000:]
    h = inv(deployed, "health", "--json", *four)
    doc = json.loads(h.stdout)
    assert h.returncode == 0 and sorted(doc["data"]["metrics"]["router"]["healthy"]) == ["r0", "r1", "r2", "r3"]
    assert len(doc["data"]["metrics"]["lmcache"]["registered_gpu_ids"]) == 8


def test_render_compose_from_the_hosts_facts(deployed, tmp_path):
    r = inv(deployed, "render", "--compose", str(tmp_path))
    assert r.returncode == 0, r.stderr
    text = (tmp_path / "docker-compose.yml").read_text()
    uuid = on("A", "nvidia-smi --query-gpu=uuid --format=csv,noheader | sed -n 5p").stdout.strip()
    assert uuid in text and (tmp_path / "router" / "railyard_drain.py").exists()
    exe = shutil.which("docker-compose")
    if exe:
        c = subprocess.run([exe, "config", "-q"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert c.returncode == 0, c.stderr
