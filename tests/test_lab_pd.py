"""serve_layout pd on three hgx8 lab hosts, the way a user runs it: two prefill instances (DP4 +
EP, 4 GPUs each) on A and on B, one decode instance (DP8 + EP) on C, the real vllm-router on A.
Launch with the P->D proof as its last gate, health with a timed request, verify-rdma's NIXL
judge, the canary on each prefill/decode pair, the proof refusing a short prompt, a KV dtype
mismatch forced at run time, a killed prefill instance that the proxy routes around and recover
brings back alone, a hung decode instance killed and brought back alone, and a decode instance
over two hosts (DP16: B's ranks headless) whose headless node, killed, takes its instance down. A
side channel left at localhost is the runbook's section "The proof fails: the NIXL side channel is
on localhost" (test_runbook.py runs its commands against this layout and checks the fix it names).

On the vLLM stand-in: DP4/DP8 with EP per instance, which the CPU build cannot serve, and faults
forced at run time; pd on the real engine and the real NIXL is in test_lab_real_pd.py."""

import json
import shutil
import time

import pytest
import yaml

from railyard.inventory import load_inventory
from railyard_lab.checkpoint import write_checkpoint
from railyard.layouts.pd import proof as P
from railyard.transport.runner import Runner

from .conftest import home, inv_cmd, on, pd_inventory

pytestmark = pytest.mark.lab
DEP = "vllm-pd"
INSTANCES = [f"{DEP}-prefill-{i}" for i in range(4)] + [f"{DEP}-decode-0", f"{DEP}-decode-0-node1", f"{DEP}-proxy"]


def inv(path, *args, timeout=300):
    return inv_cmd(*args, "-i", str(path), timeout=timeout)


def proxy_back():
    """Until the proxy's /health answers 200 (every instance healthy in the router's eyes)."""
    r = on("A", "for i in $(seq 1 120); do curl -sf 127.0.0.1:8192/health >/dev/null && echo ok && break; sleep 0.5; done")
    assert r.stdout.strip() == "ok"


def remove_all():
    for h in ("A", "B", "C"):
        on(h, "docker rm -f " + " ".join(INSTANCES) + " >/dev/null 2>&1; true")


@pytest.fixture(scope="module")
def pd(lab_inventory):
    import railyard_lab as lab
    from railyard_lab import faults
    faults.heal()
    path = lab.up(3, log=lambda *_: None, shape="hgx8")
    for h in ("A", "B", "C"):
        write_checkpoint(home(h) / "models" / "tiny-qwen3", 0.002, 2)
    p = pd_inventory(path, path.parent / "pd.yml")  # beside it: its key and known_hosts are relative
    remove_all()
    assert inv(p, "env").returncode == 0
    r = inv(p, "launch")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr
    assert "P->D path: a 64-word prompt through the proxy" in r.stdout and "over NIXL" in r.stdout
    yield p
    remove_all()
    for h in ("A", "B", "C"):
        shutil.rmtree(home(h) / "models", ignore_errors=True)
    faults.heal()
    lab.up(2, log=lambda *_: None)  # the shape every other lab test expects
    faults.heal()


def test_health_times_a_request_through_both_pools_and_verify_rdma_sees_rdma(pd):
    r = inv(pd, "health", "--json")
    doc = json.loads(r.stdout)
    assert r.returncode == 0, [c for c in doc["checks"] if c["status"] != "pass"]
    req = doc["data"]["metrics"]["request"]
    assert req["ttft_s"] > 0 and req["tpot_ms"] > 0 and req["decode"] == ["decode-0"] and len(req["prefill"]) == 1
    kv = doc["data"]["metrics"]["instances"]
    assert len(kv["decode-0"]["kv_per_rank"]) == 8 and len(kv["prefill-3"]["kv_per_rank"]) == 4
    v = inv(pd, "verify-rdma", "--json")
    doc = json.loads(v.stdout)
    assert v.returncode == 0, doc["checks"]
    checks = {(c["host"], c["check"]): c for c in doc["checks"]}
    assert checks[("C", "nixl")]["status"] == "pass" and "mlx5_0:1" in checks[("C", "nixl")]["detail"]
    assert {c["host"] for c in doc["checks"]} == {"A", "B", "C"}
    again = inv(pd, "launch")
    assert again.returncode == 0 and "nothing to do" in again.stdout


def restart(host: str, name: str) -> None:
    """docker stop and start, until the engine logs its startup again and the router has it back."""
    ready = "grep -c 'Application startup complete'"
    r = on(host, f"n=$(docker logs {name} 2>&1 | {ready}); docker stop {name} >/dev/null && docker start {name} "
                 f">/dev/null && for i in $(seq 1 240); do [ \"$(docker logs {name} 2>&1 | {ready})\" -gt \"$n\" ] && "
                 "echo ok && break; sleep 0.25; done")
    assert r.stdout.strip() == "ok", r.stdout + r.stderr
    time.sleep(2.5)   # one health check of the router (pd_proxy_health_interval_s: 2 s in the lab)
    proxy_back()


def test_the_canary_asks_each_prefill_decode_pair_and_names_the_prefill_on_other_weights(pd):
    """`health --canary record` asks each of the four prefill instances paired with decode-0, as the proxy asks
    them, and the proxy. `lab.fault A wrong-weights --value prefill-1` restarts prefill-1 on another seed of the
    lab model (prefill-0, on the same checkpoint, keeps the weights it loaded): the KV blocks it computes and
    moves carry other weights, and decode-0 answers otherwise from them (the stand-in's model of a real
    one). `--canary` fails that pair alone; through the proxy the answer comes from whichever pair its round
    robin picks: that verdict is printed, not asserted."""
    from railyard_lab import faults
    pairs = [f"prefill-{i}>decode-0" for i in range(4)]
    rec = inv(pd, "health", "--canary", "record", "--json")
    doc = json.loads(rec.stdout)
    canary = [c["detail"] for c in doc["checks"] if c["check"] == "canary"]
    assert rec.returncode == 0 and canary == [f"{t}: 3 answers recorded" for t in pairs + ["proxy"]], doc["checks"]
    try:
        faults.fault("A", "wrong-weights", "prefill-1")
        bad = inv(pd, "health", "--canary", "--json")
        got = {c["detail"].split(": ")[0]: c for c in json.loads(bad.stdout)["checks"] if c["check"] == "canary"}
        assert bad.returncode == 1 and {t: got[t]["status"] for t in pairs} == {
            t: "fail" if t == "prefill-1>decode-0" else "pass" for t in pairs}, got
        assert "differs from the record in 3 asks of 3" in got["prefill-1>decode-0"]["detail"], got
        print("through the proxy:", got["proxy"]["status"], got["proxy"]["detail"])
    finally:
        faults.heal("A")     # seed 0 back on disk; prefill-1 runs seed 1 until it restarts
        restart("A", f"{DEP}-prefill-1")
    assert inv(pd, "health", "--canary").returncode == 0


def test_a_short_prompt_is_not_taken_as_proof(pd):
    inventory = load_inventory(pd)
    from railyard.verbs.serve import build_plan
    with Runner(inventory.hosts) as runner:
        plan = build_plan(inventory, runner)
        short = P.prove(plan, runner, 8)
        long_ = P.prove(plan, runner, 40)
    assert long_.ok, long_.detail
    assert not short.ok and "without a NIXL transfer" in short.detail and "fills no 16-token block" in short.detail


def test_a_dtype_mismatch_is_refused_statically_and_at_run_time_names_the_hash(pd):
    data = yaml.safe_load(pd.read_text())
    data["all"]["children"]["decode"]["vars"] = {"vllm_kv_cache_dtype": "auto"}
    bad = pd.parent / "pd-bad.yml"
    bad.write_text(yaml.safe_dump(data))
    r = inv(bad, "launch")
    assert r.returncode == 2 and "the KV cache dtype differs from prefill host A ('fp8')" in r.stderr
    # forced past the check: the decode instance started by hand with another KV cache dtype
    try:
        inventory = load_inventory(pd)
        from dataclasses import replace

        from railyard.verbs.serve import build_plan
        from railyard.render.docker import run_line
        with Runner(inventory.hosts) as runner:
            plan = build_plan(inventory, runner)
            svc = plan.service("decode-0")
            cmd = tuple("auto" if a == "fp8" else a for a in svc.spec.command)
            on("C", f"docker rm -f {DEP}-decode-0 >/dev/null")
            assert on("C", run_line(plan, replace(svc, spec=replace(svc.spec, command=cmd)))).returncode == 0
            on("C", f"for i in $(seq 1 240); do curl -sf http://{svc.spec.bind}:{svc.spec.ports[0]}/health >/dev/null "
                    "&& break; sleep 0.25; done")
            proxy_back()  # the router readmits it after its health checks pass again
            proof = P.prove(plan, runner, 64)
        assert not proof.ok and "NIXL compatibility hash mismatch" in proof.detail, proof.detail
        assert "make the pools' settings equal" in proof.fix
    finally:
        assert inv(pd, "launch", "--recreate").returncode == 0


def test_a_killed_prefill_instance_is_routed_around_and_named_by_health(pd):
    on("B", f"docker kill {DEP}-prefill-3")
    inventory = load_inventory(pd)
    from railyard.verbs.serve import build_plan
    with Runner(inventory.hosts) as runner:
        plan = build_plan(inventory, runner, strict=False)
        # the router's health check (every pd_proxy_health_interval_s, 2 s in the lab) takes it out
        time.sleep(5)
        proofs = [P.prove(plan, runner, 40) for _ in range(4)]
    assert all(p.ok for p in proofs), [p.detail for p in proofs]
    assert all("prefill-3" not in p.prefill for p in proofs)
    h = inv(pd, "health", "--json")
    doc = json.loads(h.stdout)
    assert h.returncode == 1
    dead = [c for c in doc["checks"] if c["status"] == "fail" and c["host"] == "B"]
    assert any("prefill-3" in c["detail"] for c in dead), dead
    started = {n: on(h, f"docker inspect -f '{{{{.State.StartedAt}}}}' {DEP}-{n}").stdout
               for h, n in (("A", "prefill-0"), ("B", "prefill-2"), ("C", "decode-0"), ("A", "proxy"))}
    r = inv(pd, "recover")
    done = [ln.strip().removeprefix("done: ") for ln in r.stdout.splitlines() if ln.strip().startswith("done: ")]
    assert r.returncode == 0 and "OK: prefill-3 recovered" in r.stdout, r.stdout[-3000:] + r.stderr
    assert done[:4] == ["the proxy's health check took prefill-3 out", "started prefill-3: ready",
                        "the proxy's health check has prefill-3 back",
                        "a 64-word request through prefill-3>decode-0 answered, its KV blocks moved over NIXL"], done
    # the others served on: none of them was restarted
    assert started == {n: on(h, f"docker inspect -f '{{{{.State.StartedAt}}}}' {DEP}-{n}").stdout
                       for h, n in (("A", "prefill-0"), ("B", "prefill-2"), ("C", "decode-0"), ("A", "proxy"))}
    assert inv(pd, "health").returncode == 0


def test_a_hung_decode_instance_is_killed_and_comes_back_alone(pd):
    """engine-hang stops decode-0's engine (SIGSTOP): /health still answers, so the proxy keeps it; recover
    names it hung, kills it, waits for the proxy's health check to take it out, starts it alone, and proves
    it with a request through prefill-0 and it."""
    from railyard_lab import faults
    try:
        faults.fault("C", "engine-hang", "decode-0")
        r = inv(pd, "recover")
    finally:
        faults.heal("C")
    done = [ln.strip().removeprefix("done: ") for ln in r.stdout.splitlines() if ln.strip().startswith("done: ")]
    assert r.returncode == 0 and done[:2] == ["killed decode-0", "the proxy's health check took decode-0 out"], \
        r.stdout[-3000:] + r.stderr
    assert "a 64-word request through prefill-0>decode-0 answered, its KV blocks moved over NIXL" in done, done
    assert inv(pd, "health").returncode == 0


def test_a_new_revision_rolls_through_pd_in_one_planned_restart_never_mixing_revisions(pd):
    """issue 45: pd never runs a prefill of one revision beside a decode of another (the KV it hands over would be
    another model's), so its roll is a planned restart: every instance and the proxy down, then up on the new
    checkpoint (copied from A to B and C and verified first). Requests through the proxy are counted across it:
    those in the downtime fail, and the figure is printed; after it every instance mounts the new revision."""
    from railyard_lab.faults import WRONG_SEED
    rev = "e" * 40
    write_checkpoint(home("A") / "models" / f"tiny-qwen3-{rev[:12]}", 0.002, 2, model_seed=WRONG_SEED)
    loop = ("n=0; f=0; end=$(($(date +%s) + 40)); while [ $(date +%s) -lt $end ]; do n=$((n+1)); "
            "c=$(curl -s -m 20 -o /dev/null -w '%{http_code}' -H 'Content-Type: application/json' -d '{\"model\": "
            "\"railyard-lab/tiny-qwen3\", \"max_tokens\": 2, \"messages\": [{\"role\": \"user\", \"content\": "
            "\"hi\"}]}' http://127.0.0.1:8192/v1/chat/completions); [ \"$c\" = 200 ] || f=$((f+1)); sleep 0.2; done; "
            "echo \"$n $f\"")
    import railyard_lab as lab
    import subprocess
    root = lab.lab_dir()
    load = subprocess.Popen(lab.ssh_argv(root, lab.lab_host(root, "A"), [loop]), stdout=subprocess.PIPE, text=True)
    time.sleep(2)
    r = inv(pd, "roll", "--revision", rev, "--json", timeout=600)
    sent, failed = map(int, load.communicate(timeout=120)[0].split())
    doc = json.loads(r.stdout)
    d = doc["data"]
    print(f"pd roll: {d['seconds']} s, downtime {d['downtime_s']} s; {failed} of {sent} requests through the proxy "
          "failed (the downtime's)")
    assert r.returncode == 0 and d["path"] == "planned restart", d
    assert "planned restart: pd serves as one group" in " ".join(d["steps"])
    for h, n in (("A", "prefill-0"), ("A", "prefill-1"), ("B", "prefill-2"), ("B", "prefill-3"), ("C", "decode-0")):
        assert f"tiny-qwen3-{rev[:12]}" in on(h, f"docker inspect {DEP}-{n}").stdout, (h, n)
    assert 0 < failed < sent
    rolled = ("--set", f'model_revision="{rev}"', "--set", f"model_path=~/models/tiny-qwen3-{rev[:12]}")
    assert inv(pd, "health", *rolled).returncode == 0
    # the inventory's revision for the tests after (its env files, then its containers)
    assert inv(pd, "env").returncode == 0 and inv(pd, "launch", "--recreate").returncode == 0


def test_a_decode_instance_over_two_hosts_serves_and_dies_whole(pd):
    two = pd_inventory(pd.parent / "inventory.yml", pd.parent / "pd-wide.yml", wide=True)
    remove_all()
    assert inv(two, "env").returncode == 0
    r = inv(two, "launch")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr
    assert "over NIXL" in r.stdout and "decode-0-node1" in r.stdout
    h = inv(two, "health", "--json")
    doc = json.loads(h.stdout)
    assert h.returncode == 0, [c for c in doc["checks"] if c["status"] != "pass"]
    kv = doc["data"]["metrics"]["instances"]
    assert sorted(map(int, kv["decode-0"]["kv_per_rank"])) == list(range(8))
    assert sorted(map(int, kv["decode-0-node1"]["kv_per_rank"])) == list(range(8, 16))
    # the head's /metrics carries every rank's NIXL transfers, the headless ones' too
    inventory = load_inventory(two)
    from railyard.verbs.serve import build_plan
    with Runner(inventory.hosts) as runner:
        plan = build_plan(inventory, runner)
        assert P.exercise(plan, runner, 40) == 32
        text = on("B", f"curl -s http://{plan.service('decode-0').spec.bind}:8100/metrics").stdout
    moved = {ln.split('engine="')[1].split('"')[0] for ln in text.splitlines()
             if ln.startswith("vllm:nixl_xfer_time_seconds_count") and not ln.endswith(" 0.0")}
    assert {"0", "15"} <= moved, sorted(moved)
    # a headless node's engines die: the instance's head shuts down, and health names both
    on("C", f"docker kill {DEP}-decode-0-node1")
    h = inv(two, "health", "--json")
    doc = json.loads(h.stdout)
    failed = " ".join(c["detail"] for c in doc["checks"] if c["status"] == "fail")
    assert h.returncode == 1 and f"{DEP}-decode-0-node1 is exited" in failed and f"{DEP}-decode-0 is exited" in failed, \
        failed
