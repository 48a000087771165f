"""env and launch against the lab's docker and vLLM stand-ins, where the lab's own behaviour is what is
tested: env files on the hosts, docker's refusal of a missing device, hostile values through a real shell,
the API key in no argv, log or file.

railyard's launch decisions (workers first, the gate, a relaunch that is a no-op, stop and start in rank
order, a busy GPU, a worker that never joins, rollback) are tested on fake sessions in
test_unit_launch_decisions.py, the lock between operators in test_lock.py, and each on the lab by its
runbook section (as is a wrong GID index's NCCL log); the real engine's bring-up, timeline, stop/start
and logs are in test_lab_real_stations.py."""

import json
import shlex
import shutil

import pytest

from railyard.inventory import load_inventory
import railyard_lab as lab
from railyard_lab import faults
from railyard_lab.checkpoint import write_checkpoint
from railyard.verbs.serve import LaunchError, launch

from .conftest import home, inv_cmd, on, remove_containers

pytestmark = pytest.mark.lab
NAME = "glm53-full"


@pytest.fixture(scope="module")
def stations(lab_inventory):
    for h in ("A", "B"):
        write_checkpoint(home(h) / "models" / "tiny-qwen3", 0.002, 2)
    yield lab_inventory
    remove_containers(NAME)
    for h in ("A", "B"):
        shutil.rmtree(home(h) / "models", ignore_errors=True)
        (home(h) / "glm53.env").unlink(missing_ok=True)


@pytest.fixture
def clean(stations):
    remove_containers(NAME)
    faults.heal()
    assert inv_cmd("env", "-i", str(stations)).returncode == 0
    yield stations
    faults.heal()
    remove_containers(NAME)


def inv(path, *overrides):
    return load_inventory(path, list(overrides))


def test_env_files_are_0600_current_files_untouched_and_check_changes_nothing(stations):
    for h in ("A", "B"):
        (home(h) / "glm53.env").unlink(missing_ok=True)
    r = inv_cmd("env", "-i", str(stations), "--check")
    assert r.returncode == 1 and "+GID_INDEX=3" in r.stdout and "nothing written" in r.stdout
    assert not (home("A") / "glm53.env").exists()
    r = inv_cmd("env", "-i", str(stations))
    assert r.returncode == 0 and "written on: A, B" in r.stdout
    for h, rank in (("A", 0), ("B", 1)):
        f = home(h) / "glm53.env"
        assert (f.stat().st_mode & 0o777) == 0o600
        text = f.read_text()
        assert f"RANK={rank}\n" in text and f"HEAD_IP={lab.rail_net(1)}.11\n" in text and "GID_INDEX=3\n" in text
        gpu = [line for line in text.splitlines() if line.startswith("GPU_UUID=")][0]
        smi = on(h, "nvidia-smi --query-gpu=uuid,name --format=csv,noheader").stdout
        assert gpu[9:] + ", NVIDIA GB300" in smi  # the GB300's UUID, never the display GPU's
    assert f"WORKER_IP={lab.rail_net(1)}.12" in (home("A") / "glm53.env").read_text()
    before = {h: (home(h) / "glm53.env").stat().st_mtime_ns for h in ("A", "B")}
    r = inv_cmd("env", "-i", str(stations))
    assert "none (all current)" in r.stdout
    assert {h: (home(h) / "glm53.env").stat().st_mtime_ns for h in ("A", "B")} == before
    assert inv_cmd("env", "-i", str(stations), "--check").returncode == 0


@pytest.mark.parametrize("fault,value,fact", [("no-gpu", None, "GPU_UUID: no GPU matches 'GB300'"),
                                              ("gid-index", "none", f"GID_INDEX: no RoCE v2 GID for {lab.rail_net(1)}.12")],
                         ids=["no-gpu", "gid-index"])
def test_env_refuses_when_a_fact_is_missing(clean, fault, value, fact):
    faults.fault("B", fault, value)
    r = inv_cmd("env", "-i", str(clean))
    assert r.returncode == 1 and f"B: {fact}" in r.stderr and "fix:" in r.stderr and "Traceback" not in r.stderr


def test_gid_index_is_discovered_into_the_env(clean):
    faults.fault("B", "gid-index", "5")
    r = inv_cmd("env", "-i", str(clean))
    assert "-GID_INDEX=3" in r.stdout and "+GID_INDEX=5" in r.stdout
    assert "GID_INDEX=5\n" in (home("B") / "glm53.env").read_text()


def test_dry_run_touches_nothing(clean):
    key = home("A") / ".config" / "railyard" / "vllm-api-key"
    key.unlink(missing_ok=True)
    r = inv_cmd("launch", "-i", str(clean), "--dry-run")
    assert r.returncode == 0 and r.stdout.count("docker run -d --name glm53-full") == 2
    assert r.stdout.index("# B (rank 1)") < r.stdout.index("# A (rank 0)")
    assert on("A", "docker ps -a --format '{{.Names}}'").stdout == ""
    assert on("B", "docker ps -a --format '{{.Names}}'").stdout == ""
    assert not key.exists()


def test_a_host_without_its_rdma_device_files_fails_its_rank_and_rollback_leaves_no_container(clean):
    """ib_uverbs not loaded on B: its HCAs are in sysfs, /dev/infiniband is not; docker refuses the worker's run
    in its daemon's words (exit 125) and leaves the container Created under its name: the rollback removes it."""
    faults.fault("B", "no-uverbs")
    r = inv_cmd("launch", "-i", str(clean), "--timeout", "30", "--rollback")
    assert r.returncode == 1
    assert "FAILED: B (rank 1)" in r.stdout, r.stdout
    assert 'error gathering device information while adding custom device "/dev/infiniband"' in r.stdout
    assert "rolled back (stopped and removed) on: B" in r.stdout
    for h in ("A", "B"):
        assert "No such" in on(h, f"docker inspect {NAME}").stderr


def test_hostile_values_stay_values(clean):
    hostile = "a'b \"c\" ; touch /root/pwned $(id) `id`"
    r = inv_cmd("launch", "-i", str(clean), "--set", f"vllm_extra_env={{X_HOSTILE: {json.dumps(hostile)}}}",
                "--timeout", "60")
    assert r.returncode == 0, r.stdout + r.stderr
    env = on("A", f"docker exec {NAME} printenv X_HOSTILE").stdout
    assert env == hostile + "\n"
    assert not (home("A") / "pwned").exists() and not (home("B") / "pwned").exists()
    dry = inv_cmd("launch", "-i", str(clean), "--dry-run", "--set", f"vllm_extra_env={{X_HOSTILE: {json.dumps(hostile)}}}")
    line = [ln for ln in dry.stdout.splitlines() if ln.startswith("docker run")][0]
    assert f"X_HOSTILE={hostile}" in shlex.split(line)


def test_launch_refuses_stale_env_files(clean):
    faults.fault("B", "gid-index", "7")
    with pytest.raises(LaunchError, match="not current on B: run `inv env`"):
        launch(inv(clean), None, False, False, 60, False, None)
    assert "No such" in on("B", f"docker inspect {NAME}").stderr


def test_the_api_key_is_in_no_argv_log_json_or_readable_file(clean):
    r = inv_cmd("launch", "-i", str(clean), "--timeout", "60")
    assert r.returncode == 0, r.stdout + r.stderr
    keyfile = home("A") / ".config" / "railyard" / "vllm-api-key"
    assert (keyfile.stat().st_mode & 0o777) == 0o600
    health = on("A", "curl -s -o /dev/null -w '%{http_code}' http://127.0.0.1:8000/v1/models")
    assert health.stdout == "401"  # no key, no API
    key = keyfile.read_text().strip()
    seen = {"launch output": r.stdout + r.stderr}
    for verb in ("status", "health"):
        out = inv_cmd(verb, "-i", str(clean), "--json")
        seen[f"{verb} --json"] = out.stdout + out.stderr
    for h in ("A", "B"):
        seen[f"ps on {h}"] = on(h, "ps -eo args").stdout  # every process's argv, the serving ones included
        seen[f"docker inspect on {h}"] = on(h, f"docker inspect {NAME}").stdout
        seen[f"docker logs on {h}"] = on(h, f"docker logs {NAME} 2>&1").stdout
    assert [where for where, text in seen.items() if key in text] == []
    holders = [p for h in ("A", "B") for p in home(h).rglob("*")
               if p.is_file() and not p.is_symlink() and key.encode() in p.read_bytes()]
    assert holders and all((p.stat().st_mode & 0o777) == 0o600 for p in holders), holders


def test_a_launch_records_the_canary_and_a_relaunch_of_the_same_deployment_keeps_it(clean):
    """canary_at_launch (on by default; the lab's inventory turns it off for the suite's many launches): the
    launch that brought the stations up records the canary's answers, `inv health --canary` judges against
    them with no `--canary record` before it, and a relaunch of the same deployment keeps the record."""
    for f in (home("A") / ".cache" / "railyard" / "serve").glob("*/canary.json"):
        f.unlink()
    r = inv_cmd("launch", "-i", str(clean), "--set", "canary_at_launch=true", "--timeout", "60")
    assert r.returncode == 0 and "canary: 3 answers of head recorded at A:" in r.stdout, r.stdout + r.stderr
    assert inv_cmd("health", "--canary", "-i", str(clean)).returncode == 0
    remove_containers(NAME)
    again = inv_cmd("launch", "-i", str(clean), "--set", "canary_at_launch=true", "--timeout", "60")
    assert again.returncode == 0 and "is of this deployment: kept" in again.stdout, again.stdout + again.stderr
