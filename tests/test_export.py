"""`inv export`: every layout as Kubernetes manifests (LeaderWorkerSet, DisaggregatedSet, Deployments) and
as a Slurm batch script, from the plan. Goldens; the same program, arguments and environment as the
docker run of `inv launch`, only the per-target values symbolic; the manifests checked offline by
kubernetes-validate --strict (core kinds and every pod template) and by a strict schema of the LWS
API types, each shown to catch a broken field; the scripts by shellcheck. sbatch itself runs in
tests/test_lab_slurm.py."""

import json
import os
import shlex
import shutil
import subprocess

import jsonschema
import pytest
import yaml

from railyard.verbs import export
from railyard.facts.gpu import Gpu
from railyard.inventory import load_inventory
from railyard.render import docker
from railyard.plan import layout as layouts
from railyard.facts.host import HostFacts
from railyard.render.lws import RAIL_ONLY_ENV
from railyard.plan.spec import Ref

from .conftest import FIXTURES, ROOT, inv_cmd

INV = ROOT / "inventory"
CASES = {
    "multinode_tp": ("dgx-stations.yml", ["vllm_bind=0.0.0.0"]),
    "single_node_tp": ("hgx8-h200.yml", ["vllm_bind=0.0.0.0"]),
    "dp_ep": ("hgx8-h200.yml", ["vllm_bind=0.0.0.0", "serve_layout=dp_ep"]),
    "replicas": ("hgx8-b200-replicas.yml", ["litellm_bind=0.0.0.0"]),
    "pd": ("pd-3x-b300.yml", ["pd_proxy_bind=0.0.0.0", "pd_proxy_unauthenticated_ok=true"]),
    # one prefill instance over both prefill hosts (multi-node data parallel): the example, its prefill
    # group's vars pd_instances_per_host 1, pd_hosts_per_instance 2, vllm_data_parallel_size 16
    "pd_wide": ("golden/export/pd_wide/inventory.yml", ["pd_proxy_bind=0.0.0.0", "pd_proxy_unauthenticated_ok=true"]),
}
GOLDEN = FIXTURES / "golden" / "export"
K8S = "1.33.0"
SCHEMA = json.loads((FIXTURES / "schemas" / "lws-v1.json").read_text())


def inventory(layout):
    name, overrides = CASES[layout]
    return load_inventory(INV / name if "/" not in name else FIXTURES / name, overrides)


def rendered(layout, to):
    return export.render(inventory(layout), to)


@pytest.mark.parametrize("to", ["lws", "slurm"])
@pytest.mark.parametrize("layout", list(CASES))
def test_every_layout_exports_as_its_golden(layout, to):
    files = rendered(layout, to)
    assert len(files) == 1
    for name, text in files.items():
        path = GOLDEN / layout / name
        if os.environ.get("RAILYARD_UPDATE_GOLDEN"):
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        assert text == path.read_text(), f"{path} differs (RAILYARD_UPDATE_GOLDEN=1 rewrites it)"


# ---------------------------------------------------------------- one plan, three renderings

def docker_plan(layout):
    """The plan `inv launch` would run, on hosts with canned facts."""
    inv = inventory(layout)
    lay = layouts.validated(inv)
    _, count = lay.needs(inv)
    facts = {}
    for k, h in enumerate(lay.hosts(inv)):
        gpus = [Gpu(i, f"GPU-{h.name}-{i:04d}", h.vars["cluster_gpu_name"], 0, 1000) for i in range(count)]
        facts[h.name] = HostFacts(h, home="/home/u", gpus=gpus, gid_index=3 + 2 * k,
                                  cpus_by_gpu={i: [i] for i in range(count)})
    return lay.plan(inv, facts)


def _program(script: str) -> list[str]:
    return shlex.split(script.rsplit("; exec ", 1)[1] if "; exec " in script else script.removeprefix("exec "))


def docker_parts(argv):
    """(program words, environment) of a docker run argv."""
    env, i = {}, 0
    while i < len(argv):
        if argv[i] == "-e":
            k, _, v = argv[i + 1].partition("=")
            env[k] = v
            i += 2
            continue
        i += 1
    ent = argv.index("--entrypoint")
    if argv[ent + 1] in ("bash", "sh"):
        return _program(argv[ent + 4]), env
    return [argv[ent + 1]] + argv[ent + 3:], env


def lws_parts(text, container):
    for doc in yaml.safe_load_all(text):
        for c in _containers(doc or {}):
            if c["name"] == container:
                env = {e["name"]: e["value"] for e in c.get("env", []) if "valueFrom" not in e}  # not the downward API
                if c["command"][0] in ("bash", "sh"):
                    script = c["command"][2].replace("$$", "$")
                    for part in shlex.split(script.replace(";", " ; ")):
                        if part.startswith(("NCCL_", "VLLM_")) and "=$RAILYARD_" in part:
                            k, _, v = part.partition("=")
                            env[k] = v
                    return _program(script), env
                return [w.replace("$$", "$") for w in c["command"]], env
    raise AssertionError(f"no container {container}")


def _containers(doc):
    for tpl in _templates(doc):
        yield from tpl["spec"]["containers"]


def _templates(doc):
    spec = doc.get("spec", {})
    if doc.get("kind") == "Deployment":
        yield spec["template"]
    lwss = [spec] if doc.get("kind") == "LeaderWorkerSet" else [r["spec"] for r in spec.get("roles", [])]
    for s in lwss:
        lwt = s["leaderWorkerTemplate"]
        yield lwt["leaderTemplate"]
        if lwt["workerTemplate"] is not lwt["leaderTemplate"]:
            yield lwt["workerTemplate"]


def slurm_parts(text, service):
    body = text.split(f"    {service}:run)\n", 1)[1]
    line = next(ln.strip() for ln in body.splitlines() if ln.strip().startswith("docker run"))
    return docker_parts(shlex.split(line))


SYMBOLS = {  # plan ref -> (its LWS value, its Slurm value)
    "head_addr": ("$(LWS_LEADER_ADDRESS)", "$HEAD_ADDR"),
    "node_rank": ("$(LWS_WORKER_INDEX)", "$NODE_RANK"),  # its place in $SLURM_JOB_NODELIST
    "group_size": ("$(LWS_GROUP_SIZE)", "$SLURM_JOB_NUM_NODES"),
    "node_addr": ("$RAILYARD_NODE_ADDR", "$NODE_ADDR"),
    "gid_index": ("$RAILYARD_GID_INDEX", "$GID_INDEX"),
}


def _ref_of(v, svc, key=""):
    """The plan's symbolic value at a position: a Ref, or (pd) the service's own rail address and its GID fact."""
    if isinstance(v, Ref) and v.name in SYMBOLS:
        return v.name
    if isinstance(v, str) and svc.address and v == svc.address:
        return "node_addr"
    if key == "NCCL_IB_GID_INDEX" and not isinstance(v, Ref):
        return "gid_index"
    return None


@pytest.mark.parametrize("layout", list(CASES))
def test_docker_lws_and_slurm_carry_the_same_program_arguments_and_environment(layout):
    plan = docker_plan(layout)
    lws_text, = rendered(layout, "lws").values()
    slurm_text, = rendered(layout, "slurm").values()
    leaders = {s.name for s in plan.services() if not s.group or s.rank == 0 or s.role in ("prefill", "decode")}
    checked = 0
    for svc in plan.services():
        d_words, d_env = docker_parts(docker.run_argv(plan, svc))
        s_words, s_env = slurm_parts(slurm_text, svc.name)
        assert len(d_words) == len(s_words) and d_env.keys() == s_env.keys(), svc.name
        plan_words = list(svc.spec.command)
        targets = [("slurm", s_words, s_env, 1)]
        pool_first = svc.role not in ("prefill", "decode") or svc.name.endswith("-0")
        if svc.name in leaders and pool_first or (svc.group and svc.rank == 1):
            from railyard.render.lws import k8s_name
            l_words, l_env = lws_parts(lws_text, k8s_name(svc.name))
            if svc.role == "proxy":  # its backends are the pools' Services in Kubernetes
                l_words = d_words
            if svc.expects("gpu_process", "required") != "required" and svc.spec.gpus.count:
                assert l_env.pop("NVIDIA_VISIBLE_DEVICES") == "all"  # the node's GPUs, none requested (LMCache)
            targets.append(("lws", l_words, l_env, 0))
        # a pd instance that is one pod has its own network namespace: its address is the pod's, the host's
        # rail interface and GID index are named nowhere (RAIL_ONLY_ENV)
        own_netns = svc.role in ("prefill", "decode") and not svc.group
        for target, words, env, col in targets:
            pod_ns = target == "lws" and own_netns
            assert len(words) == len(d_words), (target, svc.name, words, d_words)
            want_keys = {k for k in d_env if not (pod_ns and k in RAIL_ONLY_ENV)}
            assert env.keys() == want_keys, (target, svc.name, set(env) ^ want_keys)
            for i, (pw, dw, w) in enumerate(zip(plan_words, d_words, words)):
                ref = _ref_of(pw, svc) if not isinstance(pw, Ref) or pw.name in SYMBOLS else None
                want = SYMBOLS[ref][col] if ref else dw
                if target == "lws" and ref == "node_addr" and (plan_words[i - 1] == "--host" or pod_ns):
                    want = "$(POD_IP)"  # a rail-bound API listens on the pod's address in Kubernetes
                assert w == want, (target, svc.name, i, pw, dw, w)
            for k, pv in svc.spec.env:
                if k not in want_keys:
                    continue
                ref = _ref_of(pv, svc, k)
                want = SYMBOLS[ref][col] if ref else d_env[k]
                if pod_ns and ref == "node_addr":
                    want = "$(POD_IP)"
                assert env[k] == want, (target, svc.name, k, d_env[k], env[k])
            checked += 1
    assert checked >= len(plan.services())
    if layout == "multinode_tp":  # every symbol really occurs
        for sym_lws, sym_slurm in SYMBOLS.values():
            assert sym_lws.replace("$", "$$") in lws_text or sym_lws in lws_text
            assert sym_slurm in slurm_text


# ---------------------------------------------------------------- validators

def _pod_template(tpl):
    return {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": tpl}


def k8s_problems(text) -> list[str]:
    """Every problem kubernetes-validate --strict (core kinds, each pod template as a v1 PodTemplate)
    and the strict LWS schema find in a YAML stream."""
    import kubernetes_validate as kv
    out = []
    for doc in yaml.safe_load_all(text):
        if not doc:
            continue
        checks = []
        if doc["kind"] in ("LeaderWorkerSet", "DisaggregatedSet"):
            schema = dict(SCHEMA, **SCHEMA["definitions"][doc["kind"]])
            for e in jsonschema.Draft7Validator(schema).iter_errors(doc):
                out.append(f"{doc['kind']} {'.'.join(map(str, e.absolute_path))}: {e.message}")
            checks = [_pod_template(t) for t in _templates(doc)]
        else:
            checks = [doc]
        for obj in checks:
            try:
                kv.validate(obj, K8S, strict=True)
            except kv.ValidationError as e:
                out.append(f"{doc['kind']} {'.'.join(map(str, e.path))}: {e.message}")
    return out


@pytest.mark.parametrize("layout", list(CASES))
def test_the_manifests_pass_kubernetes_validate_strict_and_the_lws_schema(layout):
    text, = rendered(layout, "lws").values()
    kinds = [d["kind"] for d in yaml.safe_load_all(text) if d]
    assert k8s_problems(text) == []
    expect = {"multinode_tp": "LeaderWorkerSet", "pd": "DisaggregatedSet"}.get(layout, "Deployment")
    assert expect in kinds and "Service" in kinds
    assert "Secret" not in kinds  # never a value in a manifest


def _mutate(text, kind, change):
    docs = [d for d in yaml.safe_load_all(text) if d]
    change(next(d for d in docs if d["kind"] == kind))
    return "".join("---\n" + yaml.safe_dump(d) for d in docs)


@pytest.mark.parametrize("layout,kind,change,expect", [
    ("multinode_tp", "LeaderWorkerSet", lambda d: d["spec"]["leaderWorkerTemplate"].update(size="2"),
     "'2' is not of type 'integer'"),
    ("multinode_tp", "LeaderWorkerSet", lambda d: d["spec"]["leaderWorkerTemplate"].update(sizee=2),
     "'sizee' was unexpected"),
    ("multinode_tp", "LeaderWorkerSet", lambda d: d["spec"].update(startupPolicy="WorkersFirst"),
     "'WorkersFirst' is not one of"),
    ("multinode_tp", "LeaderWorkerSet",
     lambda d: d["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"][0].update(imagee="x"),
     "'imagee' was unexpected"),
    ("pd", "DisaggregatedSet", lambda d: d["spec"]["roles"][0].update(replica=2), "'replica' was unexpected"),
    ("single_node_tp", "Deployment",
     lambda d: d["spec"]["template"]["spec"]["containers"][0]["resources"].update(limitz={}), "'limitz' was unexpected"),
    ("replicas", "Service", lambda d: d["spec"]["ports"][0].update(port="abc"), "'abc' is not of type 'integer'"),
])
def test_the_validators_catch_a_broken_field(layout, kind, change, expect):
    text, = rendered(layout, "lws").values()
    problems = k8s_problems(_mutate(text, kind, change))
    assert any(expect in p for p in problems), problems


def test_secrets_are_secret_volumes_and_the_router_config_a_configmap():
    text, = rendered("replicas", "lws").values()
    docs = {d["metadata"]["name"]: d for d in yaml.safe_load_all(text) if d}
    router = docs["vllm-replicas-router"]["spec"]["template"]["spec"]
    vols = {v["name"]: v for v in router["volumes"]}
    assert vols["secret-0"]["secret"]["secretName"] == "vllm-replicas-litellm-master-key"
    assert vols["files"]["configMap"]["name"] == "vllm-replicas-router-files"
    assert "config.yaml" in docs["vllm-replicas-router-files"]["data"]
    assert "LITELLM_MASTER_KEY" not in json.dumps(router["containers"][0].get("env", []))
    assert "kubectl create secret generic vllm-replicas-litellm-master-key" in text
    # LMCache maps the replicas' GPUs: it requests none of its own; the replicas request theirs
    lmc = docs["vllm-replicas-lmcache"]["spec"]["template"]["spec"]["containers"][0]
    assert "resources" not in lmc and {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"} in lmc["env"]
    r0 = docs["vllm-replicas-r0"]["spec"]["template"]["spec"]
    assert r0["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": 4}
    assert r0["affinity"]["podAffinity"]  # beside LMCache: loopback and IPC


def test_pd_pools_are_roles_and_the_router_finds_their_pods_by_label():
    text, = rendered("pd", "lws").values()
    docs = [d for d in yaml.safe_load_all(text) if d]
    ds = next(d for d in docs if d["kind"] == "DisaggregatedSet")
    assert [(r["name"], r["spec"]["replicas"]) for r in ds["spec"]["roles"]] == [("prefill", 4), ("decode", 1)]
    inst = ds["spec"]["roles"][0]["spec"]["leaderWorkerTemplate"]["leaderTemplate"]
    c, = inst["spec"]["containers"]
    assert "--host '$(POD_IP)'" in c["command"][2] and c["readinessProbe"]["httpGet"] == {"path": "/health", "port": 8100}
    # one pod per instance, in its own network namespace: NIXL's side channel on the pod's address (the KV itself
    # over RDMA), no host network (two instances on a node would claim the same host ports)
    assert {"name": "VLLM_NIXL_SIDE_CHANNEL_HOST", "value": "$(POD_IP)"} in c["env"]
    assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} == c["env"][0]
    assert "hostNetwork" not in inst["spec"] and not {e["name"] for e in c["env"]} & set(RAIL_ONLY_ENV)
    assert inst["spec"]["nodeSelector"] == {"railyard.io/pool": "vllm-pd-prefill"}
    proxy = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]
    args = proxy["containers"][0]["command"]
    assert "--prefill" not in args and "--decode" not in args
    i = args.index("--prefill-selector")
    assert args[i:i + 4] == ["--prefill-selector", "railyard.io/deployment=vllm-pd", "railyard.io/pool=prefill",
                             "leaderworkerset.sigs.k8s.io/worker-index=0"]   # the leaders: a headless pod has no API
    assert args[args.index("--service-discovery-namespace") + 1] == "$(POD_NAMESPACE)"
    assert proxy["serviceAccountName"] == "vllm-pd-router"
    role = next(d for d in docs if d["kind"] == "Role")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    assert inst["metadata"]["labels"] == {"railyard.io/deployment": "vllm-pd", "railyard.io/pool": "prefill"}


def _pods(doc):
    """(name, pod spec) of every pod an object makes: a Deployment's replicas, each LWS group's leader and workers."""
    spec = doc.get("spec", {})
    if doc["kind"] == "Deployment":
        return [(f"{doc['metadata']['name']}-{i}", spec["template"]["spec"]) for i in range(spec["replicas"])]
    sets = [(doc["metadata"]["name"], spec)] if doc["kind"] == "LeaderWorkerSet" else \
        [(r["name"], r["spec"]) for r in spec.get("roles", [])]
    out = []
    for name, s in sets:
        lwt = s["leaderWorkerTemplate"]
        for g in range(s["replicas"]):
            out += [(f"{name}-{g}-{w}", (lwt["leaderTemplate"] if w == 0 else lwt["workerTemplate"])["spec"])
                    for w in range(lwt["size"])]
    return out


def schedule(text, gpus_per_node):
    """Every pod of a manifest stream placed as kube-scheduler's filters decide (first fit, in apply order), on the
    nodes its header tells to label (`kubectl label nodes A B KEY=VALUE`): NodeAffinity (the nodeSelector),
    NodeResourcesFit (nvidia.com/gpu: what the device plugin advertises), NodePorts (a host-network pod's
    container ports are host ports: two pods claiming one never share a node). Returns (pod -> node, pending)."""
    nodes = {}
    for line in text.splitlines():
        if line.startswith("# Before applying: kubectl label nodes "):
            words = line.split("kubectl label nodes ", 1)[1].split(" (", 1)[0].split()
            key, _, value = words[-1].partition("=")
            for n in words[:-1]:
                nodes.setdefault(n, {"labels": {"kubernetes.io/hostname": n}, "gpus": gpus_per_node, "ports": set()})
                nodes[n]["labels"][key] = value
    placed, pending = {}, []
    for doc in yaml.safe_load_all(text):
        for name, pod in _pods(doc) if doc and doc["kind"] in ("Deployment", "LeaderWorkerSet", "DisaggregatedSet") \
                else []:
            c, = pod["containers"]
            want = int(c.get("resources", {}).get("requests", {}).get("nvidia.com/gpu", 0))
            ports = {p["containerPort"] for p in c.get("ports", [])} if pod.get("hostNetwork") else set()
            fit = [n for n, st in nodes.items() if all(st["labels"].get(k) == v for k, v in pod.get("nodeSelector",
                   {}).items()) and st["gpus"] >= want and not ports & st["ports"]]
            if not fit:
                pending.append(name)
                continue
            nodes[fit[0]]["gpus"] -= want
            nodes[fit[0]]["ports"] |= ports
            placed[name] = fit[0]
    return placed, pending


def test_the_pd_export_schedules_on_two_prefill_nodes_and_one_decode_node():
    """inventory/pd-3x-b300.yml: 4 prefill instances of 4 GPUs (two per prefill host, as `inv launch` runs them)
    and one 8-GPU decode instance fill P1, P2 and D1; each instance one pod in its own network namespace."""
    text, = rendered("pd", "lws").values()
    placed, pending = schedule(text, 8)
    assert pending == []
    assert sorted(n for p, n in placed.items() if p.startswith("prefill-")) == ["P1", "P1", "P2", "P2"]
    assert [n for p, n in placed.items() if p.startswith("decode-")] == ["D1"]
    # the export before: every pool pod on the host network, port 8100 each: two prefill pods stay Pending
    docs = [d for d in yaml.safe_load_all(text) if d]
    for role in next(d for d in docs if d["kind"] == "DisaggregatedSet")["spec"]["roles"]:
        role["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["hostNetwork"] = True
    head = "".join(ln + "\n" for ln in text.splitlines() if ln.startswith("#"))
    placed, pending = schedule(head + yaml.safe_dump_all(docs), 8)
    assert pending == ["prefill-2-0", "prefill-3-0"]


def test_an_instance_over_two_hosts_keeps_the_host_network_one_pod_per_node():
    """pd_wide: the prefill instance's DP ranks meet over the rail (host network, the rail's address found in the
    pod); its two pods land on the two prefill nodes; the one-pod decode instance has its own namespace."""
    text, = rendered("pd_wide", "lws").values()
    placed, pending = schedule(text, 8)
    assert pending == [] and sorted(n for p, n in placed.items() if p.startswith("prefill-")) == ["P1", "P2"]
    ds = next(d for d in yaml.safe_load_all(text) if d and d["kind"] == "DisaggregatedSet")
    prefill, decode = (r["spec"]["leaderWorkerTemplate"] for r in ds["spec"]["roles"])
    assert prefill["leaderTemplate"]["spec"]["hostNetwork"] and prefill["workerTemplate"]["spec"]["hostNetwork"]
    assert "RAILYARD_NODE_ADDR" in prefill["leaderTemplate"]["spec"]["containers"][0]["command"][2]
    assert "hostNetwork" not in decode["leaderTemplate"]["spec"]


def test_the_lws_group_is_the_stations_with_rdma_ipc_lock_shm_and_a_real_readiness_request():
    text, = rendered("multinode_tp", "lws").values()
    lws = next(d for d in yaml.safe_load_all(text) if d and d["kind"] == "LeaderWorkerSet")
    lwt = lws["spec"]["leaderWorkerTemplate"]
    assert lwt["size"] == 2 and lwt["restartPolicy"] == "RecreateGroupOnPodRestart"
    head, = lwt["leaderTemplate"]["spec"]["containers"]
    worker, = lwt["workerTemplate"]["spec"]["containers"]
    assert "--headless" in worker["command"][2] and "--headless" not in head["command"][2]
    for c in (head, worker):
        assert c["resources"]["limits"] == {"nvidia.com/gpu": 1, "rdma/rdma_shared_device_a": 1}
        assert c["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
        assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    assert head["readinessProbe"]["httpGet"] == {"path": "/health", "port": 8000}  # a GET, not a TCP connect
    assert "readinessProbe" not in worker
    svc = next(d for d in yaml.safe_load_all(text) if d and d["kind"] == "Service")
    assert svc["spec"]["selector"] == {"leaderworkerset.sigs.k8s.io/name": "glm53-full",
                                       "leaderworkerset.sigs.k8s.io/worker-index": "0"}


@pytest.mark.parametrize("layout", list(CASES))
def test_the_batch_scripts_pass_shellcheck(layout, tmp_path):
    text, = rendered(layout, "slurm").values()
    assert "#SBATCH --exclusive" in text and "#SBATCH --ntasks-per-node=1" in text
    exe = shutil.which("shellcheck")
    if exe is None:
        pytest.skip("shellcheck (Debian) is not installed")
    p = tmp_path / "job.sbatch"
    p.write_text(text)
    r = subprocess.run([exe, "-s", "bash", str(p)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout
    member = text.split("<<'RAILYARD_MEMBER_END'\n", 1)[1].split("\nRAILYARD_MEMBER_END", 1)[0]
    (tmp_path / "member.sh").write_text(member)
    r = subprocess.run([exe, "-s", "bash", str(tmp_path / "member.sh")], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout


def test_no_secret_reaches_a_command_line_in_the_batch_script():
    text, = rendered("multinode_tp", "slurm").values()
    assert "-v ''\"$HOME\"'/.config/railyard/vllm-api-key:/run/secrets/vllm-api-key:ro'" in text
    assert 'export VLLM_API_KEY="$(cat /run/secrets/vllm-api-key)"' in text
    assert "--api-key" not in text


@pytest.mark.parametrize("args,expect", [
    (["--to", "k8s"], "--to 'k8s': expected one of lws, slurm"),
    (["--to", "lws"], "the endpoint head binds 127.0.0.1"),
    (["--to", "lws", "--set", "vllm_bind=0.0.0.0", "--model-volume", "nfs:x"], "--model-volume 'nfs:x': expected"),
    (["--to", "slurm", "--model-volume", "pvc:x"], "--to slurm: --model-volume is for --to lws"),
])
def test_bad_export_flags_are_one_line_and_exit_2(tmp_path, args, expect):
    r = inv_cmd("export", "-i", str(INV / "dgx-stations.yml"), "--out", str(tmp_path), *args)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert expect in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.parametrize("length,ok", [(31, True), (32, False)])
def test_a_deployment_name_lws_would_refuse_is_refused_before_anything_is_written(tmp_path, length, ok):
    # LWS's webhook (validateGeneratedNames): <name>-0-<revision 8>-prefill plus "-<group index>-<hash 10>"
    # must fit 63 characters; with 4 prefill replicas the name has 31
    name = "v" * length
    r = inv_cmd("export", "-i", str(INV / "pd-3x-b300.yml"), "--to", "lws", "--out", str(tmp_path / "k8s"),
                *[x for kv in CASES["pd"][1] for x in ("--set", kv)], "--set", f"vllm_container={name}")
    if ok:
        assert r.returncode == 0, r.stderr
        return
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "k8s").exists(), r.stderr
    assert f"vllm_container = '{name}': with the role 'prefill', the names LWS generates reach 64" in r.stderr


def test_export_writes_the_files_and_contacts_no_host(tmp_path):
    r = inv_cmd("export", "-i", str(INV / "dgx-stations.yml"), "--to", "slurm", "--out", str(tmp_path / "job"),
                "--set", "vllm_bind=0.0.0.0")
    assert r.returncode == 0, r.stderr
    path = tmp_path / "job" / "glm53-full.sbatch"
    assert path.read_text() == rendered("multinode_tp", "slurm")["glm53-full.sbatch"]
    assert os.access(path, os.X_OK)


@pytest.mark.lab  # the lab's vllm-router venv, which `inv lab.up` installs
def test_the_real_vllm_router_takes_the_exported_arguments(tmp_path):
    """The proxy's arguments as the Deployment runs them, given to the real vllm-router 0.1.17 (the lab's venv):
    it parses them and starts, its discovery failing only for want of a cluster."""
    from railyard_lab import components
    exe = components.program("vllm-router")
    text, = rendered("pd", "lws").values()
    proxy = next(d for d in yaml.safe_load_all(text) if d and d["kind"] == "Deployment")
    args = [a.replace("$(POD_NAMESPACE)", "default") for a in proxy["spec"]["template"]["spec"]["containers"][0]["command"]]
    args[args.index("--port") + 1] = "18193"
    args[args.index("--host") + 1] = "127.0.0.1"
    p = subprocess.Popen([str(exe)] + args[1:], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=dict(os.environ, HOME=str(tmp_path)))
    seen = []
    try:
        for line in p.stdout:
            seen.append(line)
            if "Starting server on 127.0.0.1:18193" in line or len(seen) > 200:
                break
    finally:
        p.terminate()
        p.wait(timeout=10)
    out = "".join(seen)
    assert "Starting server on 127.0.0.1:18193" in out and "service discovery" in out, out[-2000:]
