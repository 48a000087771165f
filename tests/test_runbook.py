"""Run every command of docs/runbook.md against the lab, in the situation its section describes."""

import json
import os
import re
import shlex
import shutil
import subprocess
import time

import pytest

import railyard_lab as lab
from railyard_lab import faults
from railyard_lab.checkpoint import write_checkpoint

from .conftest import ROOT, home, inv_cmd, on, pd_inventory, remove_containers

pytestmark = pytest.mark.lab
RUNBOOK = ROOT / "docs" / "runbook.md"
NAME = "glm53-full"
ONE_HOST = ("vllm-tp8", "vllm-dp-ep", "vllm-replicas-router", "vllm-replicas-r0", "vllm-replicas-r1",
            "vllm-replicas-lmcache", "vllm-pd-proxy", "vllm-pd-decode-0") + tuple(
    f"vllm-pd-prefill-{i}" for i in range(4))  # the 8-GPU layouts' containers


def scenarios():
    """(title, [commands], {directives}) for each ```sh block followed by a lab comment."""
    text = RUNBOOK.read_text()
    out = []
    title = "intro"
    pattern = re.compile(r"^(#{2,3} [^\n]*)$|```sh\n(.*?)```\n<!-- lab: (.*?) -->", re.M | re.S)
    for m in pattern.finditer(text):
        if m.group(1):
            title = m.group(1).lstrip("# ").strip()
            continue
        commands = [c.strip() for c in m.group(2).splitlines() if c.strip().startswith("inv ")]
        # the runbook shows the default lab's addresses (198.18.*); a test worker's lab may be another one
        directives = dict(lab.translate(part.strip()).split("=", 1)
                          for part in m.group(3).split(";") if "=" in part)
        out.append((title, commands, directives))
    return out






def test_every_runbook_command_block_is_covered():
    blocks = re.findall(r"```sh\n(.*?)```", RUNBOOK.read_text(), re.S)
    inv_blocks = [b for b in blocks if "inv " in b]
    assert len(scenarios()) == len(inv_blocks) >= 15
    tested = {c.split()[1] for _, cmds, _ in scenarios() for c in cmds}
    assert {"preflight", "sync-model", "env", "launch", "verify-rdma", "health", "stop", "start", "status",
            "logs", "plan", "launch-script"} <= tested
    shapes = [d.get("shape", "station") for _, _, d in scenarios()]
    assert shapes == sorted(shapes, key=lambda s: s != "station")  # the 8-GPU sections come last: one lab rebuild


@pytest.fixture(scope="module")
def runbook_lab(lab_inventory):
    yield lab_inventory
    faults.heal()
    remove_containers(NAME, *ONE_HOST, hosts=sorted(p.name for p in (lab.lab_dir() / "hosts").iterdir()))
    for h in ("A", "B", "C"):
        shutil.rmtree(home(h) / "models", ignore_errors=True)
    shutil.rmtree("/tmp/railyard-submission", ignore_errors=True)
    lab.up(2, log=lambda *_: None)  # the station shape the other lab tests expect


def _shape(name: str, hosts: int = 2) -> None:
    """The lab in this shape and size (a rebuild of about a second when it changes; nothing otherwise)."""
    have = json.loads((lab.lab_dir() / "lab.json").read_text()).get("shape", "station")
    if have != name or len(list((lab.lab_dir() / "hosts").iterdir())) != hosts:
        lab.up(hosts, log=lambda *_: None, shape=name)


def _fresh(inv_path):
    faults.heal()
    remove_containers(NAME, *ONE_HOST, hosts=sorted(p.name for p in (lab.lab_dir() / "hosts").iterdir()))
    hosts = sorted(p.name for p in (lab.lab_dir() / "hosts").iterdir())
    for h in hosts:
        for d in ("models", "flashinfer-kernels"):   # the checkpoint, the kernels the offline section stages
            shutil.rmtree(home(h) / d, ignore_errors=True)
        shutil.rmtree(home(h) / ".cache" / "railyard" / "lock", ignore_errors=True)
        for record in (home(h) / ".cache" / "railyard" / "serve").glob("*/recoveries.json"):
            record.unlink()   # another section's recoveries would count against this one's restart budget
        (home(h) / "glm53.env").unlink(missing_ok=True)
    write_checkpoint(home("A") / "models" / "tiny-qwen3", 0.002, 2)
    if len(hosts) > 2:  # the pd pools serve from every host's own copy
        for h in hosts[1:]:
            write_checkpoint(home(h) / "models" / "tiny-qwen3", 0.002, 2)


def _run(cmds, inv_path, extra=(), usage_error=False):
    """The section's commands in order: the highest exit code, and their output ending in a line of each
    command's own exit code (a failure shows the output's tail: which command failed is read there)."""
    outputs, codes = "", []
    for c in cmds:
        argv = shlex.split(c)[1:] + list(extra)
        r = inv_cmd(*argv, env={"RAILYARD_INVENTORY": str(inv_path)}, timeout=180)
        assert "Traceback" not in r.stderr, (c, r.stderr)
        assert usage_error or r.returncode != 2, (c, r.stderr)
        outputs += r.stdout + r.stderr
        codes.append((c, r.returncode))
    return max(rc for _, rc in codes), outputs + "\nexit codes: " + "; ".join(f"{c}: {rc}" for c, rc in codes)


def _layout(d) -> list[str]:
    """layout=NAME: the section's serve_layout, for its set-up and its commands alike."""
    return ["--set", f"serve_layout={d['layout']}"] if "layout" in d else []


def _inventory(d, inv_path):
    """inventory=pd: the 3-host lab as prefill (A, B) and decode (C) pools, beside the lab's own;
    inventory=pd-wide: prefill A, one decode instance over B and C."""
    if d.get("inventory") in ("pd", "pd-wide"):
        return pd_inventory(inv_path, inv_path.parent / f"{d['inventory']}.yml", wide=d["inventory"] == "pd-wide")
    return inv_path


def _setup(d, inv_path):
    _shape(d.get("shape", "station"), int(d.get("hosts", 2)))
    _fresh(inv_path)
    inv_path = _inventory(d, inv_path)
    state = d.get("state", "fresh")
    one_host = d.get("shape") == "hgx8"  # the checkpoint is where it serves: nothing to copy
    layout = _layout(d)
    if state in ("running", "handrun", "ready"):  # ready: synced and env written, not launched
        for c in (("env",) if one_host else ("sync-model --verify size", "env")):
            r = inv_cmd(*c.split(), *layout, env={"RAILYARD_INVENTORY": str(inv_path)}, timeout=180)
            assert r.returncode == 0, r.stdout + r.stderr
    if state == "running":
        extra = ["--set", d["set"]] if "set" in d else []
        r = inv_cmd("launch", *extra, *layout, env={"RAILYARD_INVENTORY": str(inv_path)}, timeout=180)
        assert r.returncode == 0, r.stdout + r.stderr
    if "canary" in d:  # canary=record: the answers recorded on the healthy deployment, before the fault
        r = inv_cmd("health", "--canary", "record", *layout, env={"RAILYARD_INVENTORY": str(inv_path)}, timeout=180)
        assert r.returncode == 0, r.stdout + r.stderr
    if state == "handrun":  # an operator started the containers by hand, without one flag
        r = inv_cmd("launch", "--dry-run", env={"RAILYARD_INVENTORY": str(inv_path)})
        cmds = [ln for ln in r.stdout.splitlines() if ln.startswith("docker run")]
        for host, c in zip(("B", "A"), cmds):
            argv = shlex.split(c)
            drop = shlex.split(d["without"])
            for i in range(len(argv) - len(drop) + 1):
                if argv[i:i + len(drop)] == drop:
                    del argv[i:i + len(drop)]
                    break
            assert on(host, shlex.join(argv)).returncode == 0
        on("A", "mkdir -p ~/.config/railyard && test -s ~/.config/railyard/vllm-api-key || echo k > ~/.config/railyard/vllm-api-key")
        for _ in range(60):
            if "Application startup complete" in on("A", f"docker logs {NAME}").stdout:
                break
            time.sleep(0.5)
    if "lock" in d:  # another operator's run holds the head
        user, machine = d["lock"].split("@")
        lockdir = home("A") / ".cache" / "railyard" / "lock"
        lockdir.mkdir(parents=True)
        (lockdir / "owner").write_text(json.dumps({"user": user, "machine": machine, "pid": 4242,
                                                   "since": "2026-12-01T08:00:00Z", "command": "inv launch"}))
    if "revision" in d:  # a new revision downloaded beside the running one: the lab model's other seed
        from railyard_lab.faults import WRONG_SEED
        write_checkpoint(home("A") / "models" / f"tiny-qwen3-{d['revision'][:12]}", 0.002, 2, model_seed=WRONG_SEED)
    if "fault" in d:
        host, kind, *value = d["fault"].split()
        faults.fault(host, kind, value[0] if value else None)
    if "corrupt" in d:
        r = inv_cmd("sync-model", env={"RAILYARD_INVENTORY": str(inv_path)}, timeout=180)
        assert r.returncode == 0
        shard = sorted((home(d["corrupt"]) / "models" / "tiny-qwen3").glob("*.safetensors"))[0]
        st = os.stat(shard)
        with open(shard, "r+b") as f:
            f.seek(100)
            b = f.read(1)
            f.seek(100)
            f.write(bytes([b[0] ^ 1]))
        os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    if "revoke" in d:
        ak = home(d["revoke"]) / ".ssh" / "authorized_keys"
        ak.write_text(ak.read_text().splitlines()[0] + "\n")
    if "kill" in d:  # HOST or HOST:CONTAINER
        host, _, container = d["kill"].partition(":")
        pid = on(host, f"docker inspect --format '{{{{.State.Pid}}}}' {container or NAME}").stdout.strip()
        subprocess.run(["kill", "-9", pid], check=True)
        time.sleep(2)
    return inv_path


@pytest.mark.parametrize("title,commands,directives", scenarios(), ids=[s[0] for s in scenarios()])
def test_runbook_section(runbook_lab, title, commands, directives):
    try:
        path = _setup(directives, runbook_lab)
        if title.startswith("The copies of the checkpoint differ"):
            code, out = _run(commands[:1], path)
            assert code == 1 and directives["expect"] in out
            code, out = _run(commands[1:], path)
            assert code == 0 and "OK: copies equal" in out
            return
        extra = ["--set", directives["set"]] if "set" in directives and directives.get("state") != "running" else []
        extra += _layout(directives)
        if "budget" in directives:  # a restart budget the section spends in a few commands
            extra += ["--set", f"recover_restart_budget={directives['budget']}"]
        code, out = _run(commands, path, extra, usage_error=directives.get("exit") == "2")
        if "expect" in directives:  # as printed, or across the line a long message wraps at
            assert directives["expect"] in out or " ".join(directives["expect"].split()) in " ".join(out.split()), \
                out[-3000:]
        if title == "Normal bring-up, in order" or directives.get("exit") == "0":
            assert code == 0, out[-3000:]
        else:
            assert code == int(directives["exit"]), out[-3000:]
    finally:
        if "revoke" in directives:
            lab.up(2, log=lambda *_: None)  # rewrites every host's authorized_keys
        faults.heal()
