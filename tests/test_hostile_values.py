"""Hostile values in every inventory variable of every example layout: each one is refused in
one-line problems (exit 2 at the command line), or it stays a value in everything railyard renders
from the plan. The rendered `docker run` lines and the entry scripts inside them are really run by
bash, against recording stand-ins of docker and the programs, and canary files prove that no
quote, `;`, `$(...)`, backtick, newline or leading `-` ran anything; env files are sourced,
rendered config files parsed, and each value comes back as it was given."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import yaml

from railyard.facts.gpu import Gpu
from railyard.errors import InventoryError
from railyard.inventory import load_inventory
from railyard.render import docker, envfile
from railyard.plan import layout as layouts
from railyard.facts.host import HostFacts

from .conftest import ROOT, inv_cmd

EXAMPLES = sorted((ROOT / "inventory").glob("*.yml"))
RECORDER = textwrap.dedent(f"""\
    #!{sys.executable}
    import json, os, sys
    with open(os.environ["RECORD"], "a") as f:
        f.write(json.dumps([os.path.basename(sys.argv[0])] + sys.argv[1:]) + "\\n")
    if os.path.basename(sys.argv[0]) == "python3":
        print("/opt/nccl/libnccl.so.2")
""")
PROGRAMS = ("docker", "vllm", "python3", "lmcache", "litellm", "vllm-router")


def hostile(canary):
    return f"-x'y\"z; touch {canary} $(touch {canary}) `touch {canary}`\n&& touch {canary} #"


def facts_for(inv):
    out = {}
    for h in inv.hosts:
        n = int(h.vars["cluster_gpus_per_host"])
        gpus = [Gpu(i, f"GPU-{h.name}-{i:04d}", "NVIDIA B300", 0, 275040) for i in range(n)]
        out[h.name] = HostFacts(h, home="/home/ubuntu", gpus=gpus, gid_index=3,
                                cpus_by_gpu={i: list(range(i * 4, i * 4 + 4)) for i in range(n)})
    return out


def string_vars(path):
    """Every variable the example's head carries as a string (its own, its layout's and the roles')."""
    inv = load_inventory(path)
    return sorted(k for k, v in inv.head.vars.items() if isinstance(v, str))


# and the values inside the lists and mappings that reach a command line
AS = {"vllm_extra_env": lambda v: {"X_HOSTILE": v}, "vllm_extra_args": lambda v: ["--x", v], "vllm_flags": lambda v: [v]}
CASES = [(p, k) for p in EXAMPLES for k in string_vars(p) + sorted(AS)]


@pytest.fixture(scope="module")
def programs(tmp_path_factory):
    d = tmp_path_factory.mktemp("bin")
    for name in PROGRAMS:
        (d / name).write_text(RECORDER)
        (d / name).chmod(0o755)
    return d


def run_recorded(line, programs, tmp_path):
    record = tmp_path / "argv.jsonl"
    record.unlink(missing_ok=True)
    env = dict(os.environ, PATH=f"{programs}:{os.environ['PATH']}", RECORD=str(record))
    r = subprocess.run(["bash", "-c", line], capture_output=True, text=True, env=env, timeout=30)
    assert r.returncode == 0, r.stderr
    return [json.loads(x) for x in record.read_text().splitlines()]


@pytest.mark.parametrize("path,key", CASES, ids=[f"{p.stem}:{k}" for p, k in CASES])
def test_a_hostile_value_is_refused_or_stays_a_value(path, key, programs, tmp_path):
    canary = tmp_path / "pwned"
    value = hostile(canary)
    try:
        inv = load_inventory(path, [f"{key}={json.dumps(AS.get(key, lambda v: v)(value))}"])
        plan = layouts.validated(inv).plan(inv, facts_for(inv))
    except InventoryError as e:
        assert len(str(e).splitlines()) == len(e.problems) >= 1, str(e)  # a newline in a value stays escaped
        assert not canary.exists()
        return
    seen = []
    for svc in plan.services():
        calls = run_recorded(docker.run_line(plan, svc), programs, tmp_path)
        assert [c[:2] for c in calls] == [["docker", "run"]]
        argv = calls[0]
        seen += argv
        entry = argv[argv.index("--entrypoint") + 1]
        image = argv.index("--entrypoint") + 2
        if entry in ("bash", "sh"):  # the entry script the image runs: setup lines, secrets, then the program
            inner = run_recorded(argv[image + 2], programs, tmp_path)
            seen += [a for c in inner for a in c]
        rendered = envfile.render(plan, svc)
        (tmp_path / "svc.env").write_text(rendered)
        dump = subprocess.run(["bash", "-c", 'set -a; . "$0"; env -0', str(tmp_path / "svc.env")],
                              capture_output=True, text=True, timeout=30)
        assert dump.returncode == 0, dump.stderr
        sourced = dict(x.split("=", 1) for x in dump.stdout.split("\0") if "=" in x)
        for k, v in svc.env_file:
            assert sourced[k] == v, k
        for f in svc.spec.files:
            if f.host_path.endswith((".yaml", ".yml")):
                yaml.safe_load(f.content)
                seen.append(f.content)
    assert not canary.exists(), f"{key}: the hostile value ran"
    assert not list(tmp_path.glob("*touch*")), "a file named after the value appeared"


def test_the_sweep_covers_every_layout_and_its_own_variables():
    by_layout = {load_inventory(p).head.vars["serve_layout"]: p for p in EXAMPLES}
    assert {"multinode_tp", "replicas", "pd"} <= set(by_layout)
    keys = {k for _, k in CASES}
    for k in ("model_path", "model_repo", "vllm_container", "vllm_image", "vllm_env_file", "litellm_master_key_file",
              "pd_proxy_bind", "lmcache_host", "vllm_extra_env", "vllm_extra_args", "vllm_flags"):
        assert k in keys, k


def test_a_refused_hostile_value_is_one_line_at_the_command_line(tmp_path):
    canary = tmp_path / "pwned"
    r = inv_cmd("launch", "--dry-run", "-i", str(ROOT / "inventory" / "dgx-stations.yml"),
                "--set", f"vllm_container={json.dumps(hostile(canary))}")
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "vllm_container" in r.stderr and not canary.exists()


def test_a_hostile_nccl_debug_file_stays_a_glob_in_verify_rdmas_script(tmp_path):
    """verify-rdma and collect read the NCCL logs inside the container with `sh -c 'for f in GLOB ...'`:
    the value of NCCL_DEBUG_FILE (vllm_extra_env may set it) is quoted there, only %h and %p become `*`."""
    from railyard.verbs.verify import nccl_log_glob
    canary = tmp_path / "pwned"
    logs = tmp_path / "l o g s"
    logs.mkdir()
    (logs / "nccl_A_7.log").write_text("x")
    (logs / "other.txt").write_text("x")
    inv = load_inventory(ROOT / "inventory" / "dgx-stations.yml")
    for value, found in ((f"{logs}/nccl_%h_%p.log", ["nccl_A_7.log"]),
                         (f"{logs}/$(touch {canary})_%p;touch {canary}`touch {canary}`.log", [])):
        inv = load_inventory(ROOT / "inventory" / "dgx-stations.yml",
                             [f"vllm_extra_env={json.dumps({'NCCL_DEBUG_FILE': value})}"])
        svc = layouts.validated(inv).plan(inv, facts_for(inv)).services()[0]
        assert dict(svc.spec.env)["NCCL_DEBUG_FILE"] == value
        script = f'for f in {nccl_log_glob(svc)}; do [ -e "$f" ] && basename "$f"; done; true'
        r = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=10)
        assert r.returncode == 0 and r.stdout.split() == found, (value, r)
    assert not canary.exists()
