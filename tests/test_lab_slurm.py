"""`inv export --to slurm` on the lab's real Slurm (`lab.up(slurm=True)`: munged, slurmctld, a slurmd in
each host's namespaces): the exported two-station job brings the deployment up on the lab hosts,
`inv health` and `inv verify-rdma` pass against it (the rank, head address, rail address and GID index
were found on the nodes), `scancel` leaves no container and no GPU process; `sbatch --test-only`
refuses a layout that needs more GPUs per node than the nodes have, in one line.

On the vLLM stand-in (up in 2 s, not a minute): what is tested is the batch script's bring-up on
Slurm's nodes; the real engine's own bring-up of the same layout is in test_lab_real_stations.py."""

import json
import os
import subprocess
import time

import pytest
import yaml

from .conftest import inv_cmd, on, station_ready, wait_for

pytestmark = pytest.mark.lab
NAME = "glm53-full"


@pytest.fixture(scope="module")
def slurm(lab_inventory):
    import railyard_lab as lab
    from railyard_lab import slurm as slurm_lab
    t0 = time.monotonic()
    lab.up(2, log=lambda *_: None, slurm=True)
    print(f"\nlab Slurm up (2 idle nodes) in {time.monotonic() - t0:.1f} s")
    env = dict(os.environ, **slurm_lab.client_env(lab.lab_dir()))
    with station_ready(lab_inventory) as inv:
        yield inv, env


def _slurm(env, *argv, cwd=None):
    return subprocess.run(list(argv), capture_output=True, text=True, env=env, cwd=cwd, timeout=60)


def _gone(env, job):
    return _slurm(env, "squeue", "-h", "-j", job, "-o", "%T").stdout.strip() == ""


def test_the_exported_two_station_job_serves_passes_health_and_scancel_leaves_nothing(slurm, tmp_path):
    inv, env = slurm
    r = inv_cmd("export", "-i", str(inv), "--to", "slurm", "--out", str(tmp_path), "--test-only", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "fits: sbatch --test-only glm53-full.sbatch: Job" in r.stdout and "to start at" in r.stdout, r.stdout
    script = tmp_path / f"{NAME}.sbatch"
    t0 = time.monotonic()
    job = _slurm(env, "sbatch", "--parsable", str(script), cwd=tmp_path).stdout.strip().split(";")[0]
    assert job.isdigit()
    out = tmp_path / f"{NAME}-{job}.out"
    try:
        wait_for(lambda: "is ready" in (out.read_text() if out.exists() else "") or _gone(env, job),
                 "the job's head readiness", timeout=150)
        text = out.read_text()
        assert "railyard: glm53-full is ready: head on A, port 8000" in text, text
        ready_s = time.monotonic() - t0
        assert text.index("starting worker-1 on B") < text.index("starting head on A")  # workers first
        r = inv_cmd("health", "-i", str(inv), "--json", timeout=180)
        doc = json.loads(r.stdout)
        assert r.returncode == 0 and doc["ok"], r.stdout + r.stderr
        by = {(c["host"], c["check"]): c["status"] for c in doc["checks"]}
        assert by[("A", "service")] == by[("B", "service")] == "pass" and by[("A", "api_chat")] == "pass"
        r = inv_cmd("verify-rdma", "-i", str(inv), "--json", timeout=180)  # GDRDMA: the GID index found on the node
        assert r.returncode == 0 and json.loads(r.stdout)["ok"], r.stdout + r.stderr
        assert _slurm(env, "squeue", "-h", "-j", job, "-o", "%T %N").stdout.split() == ["RUNNING", "A,B"]
    finally:
        t1 = time.monotonic()
        _slurm(env, "scancel", job)
        wait_for(lambda: _gone(env, job), "the job gone after scancel", timeout=60)
        gone_s = time.monotonic() - t1
    for h in ("A", "B"):
        assert on(h, "docker ps -a --format '{{.Names}}'").stdout.split() == [], h
        assert on(h, "nvidia-smi --query-compute-apps=pid --format=csv,noheader").stdout.strip() == "", h
    print(f"sbatch -> head ready {ready_s:.1f} s; scancel -> job gone, containers removed {gone_s:.1f} s")


def test_test_only_refuses_a_layout_with_more_gpus_per_node_than_the_nodes_have(slurm, tmp_path):
    inv, env = slurm
    doc = yaml.safe_load(inv.read_text())
    hosts = doc["all"]["children"]["lab"]["hosts"]
    doc["all"]["children"] = {"serve": {"hosts": {"A": hosts["A"]}}}
    doc["all"]["vars"].update(serve_layout="single_node_tp", cluster_gpus_per_host=8, vllm_tensor_parallel_size=8,
                              ssh_known_hosts=str(inv.parent / "known_hosts"),
                              ansible_ssh_private_key_file=str(inv.parent / "id_ed25519"))
    one = tmp_path / "one-host.yml"
    one.write_text(yaml.safe_dump(doc))
    r = inv_cmd("export", "-i", str(one), "--to", "slurm", "--out", str(tmp_path / "job"), "--test-only", env=env)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stdout + r.stderr
    assert "#SBATCH --gpus-per-node=8" in (tmp_path / "job" / "vllm-tp8.sbatch").read_text()
    line, = r.stderr.strip().splitlines()
    assert line == ("does not fit: sbatch --test-only vllm-tp8.sbatch: allocation failure: Requested node "
                    "configuration is not available"), line


def test_a_rank_that_fails_its_gate_ends_the_job_and_leaves_nothing(slurm, tmp_path):
    import shutil

    from railyard_lab.checkpoint import write_checkpoint

    from .conftest import home
    inv, env = slurm
    model = home("B") / "models" / "tiny-qwen3"
    shutil.rmtree(model)  # B's vLLM fails as vLLM does without its checkpoint
    try:
        assert inv_cmd("export", "-i", str(inv), "--to", "slurm", "--out", str(tmp_path)).returncode == 0
        job = _slurm(env, "sbatch", "--parsable", str(tmp_path / f"{NAME}.sbatch"), cwd=tmp_path).stdout.strip()
        wait_for(lambda: _gone(env, job), "the job to end on its own", timeout=90)
        text = (tmp_path / f"{NAME}-{job}.out").read_text()
        assert "railyard: worker-1 failed its gates" in text and "starting head" not in text, text
        assert "railyard: B: glm53-full: exited" in text, text  # the rank and why, with its log's last lines
        for h in ("A", "B"):
            assert on(h, "docker ps -a --format '{{.Names}}'").stdout.split() == [], h
    finally:
        write_checkpoint(model, 0.002, 2)


def test_prefill_and_decode_run_as_a_heterogeneous_job_on_three_hosts(lab_inventory, tmp_path):
    """The pd layout (prefill A and B with two instances each, decode C, the real vllm-router on A): one
    component per pool; the pools start, then the proxy; inv health's request goes through the proxy."""
    import railyard_lab as lab
    from railyard_lab import faults
    from railyard_lab import slurm as slurm_lab
    from railyard_lab.checkpoint import write_checkpoint

    from .conftest import home, pd_inventory
    faults.heal()
    path = lab.up(3, log=lambda *_: None, shape="hgx8", slurm=True)
    env = dict(os.environ, **slurm_lab.client_env(lab.lab_dir()))
    job = None
    try:
        for h in ("A", "B", "C"):
            write_checkpoint(home(h) / "models" / "tiny-qwen3", 0.002, 2)
        p = pd_inventory(path, path.parent / "pd.yml")
        r = inv_cmd("export", "-i", str(p), "--to", "slurm", "--out", str(tmp_path), "--test-only", env=env)
        assert r.returncode == 0 and "fits: sbatch --test-only vllm-pd.sbatch: Job" in r.stdout, r.stdout + r.stderr
        text = (tmp_path / "vllm-pd.sbatch").read_text()
        assert text.count("#SBATCH hetjob") == 1 and "--het-group" in text
        t0 = time.monotonic()
        job = _slurm(env, "sbatch", "--parsable", str(tmp_path / "vllm-pd.sbatch"), cwd=tmp_path).stdout.strip()
        job = job.split(";")[0]
        out = tmp_path / f"vllm-pd-{job}.out"
        wait_for(lambda: "is ready" in (out.read_text() if out.exists() else "") or _gone(env, job),
                 "the proxy's readiness", timeout=150)
        log = out.read_text()
        assert "railyard: vllm-pd is ready: proxy on A, port 8192" in log, log
        assert log.index("starting decode-0 on C") < log.index("starting proxy on A")
        ready_s = time.monotonic() - t0
        r = inv_cmd("health", "-i", str(p), "--json", timeout=200)
        doc = json.loads(r.stdout)
        assert r.returncode == 0 and doc["ok"], r.stdout[-3000:] + r.stderr
        assert {c["host"] for c in doc["checks"] if c["check"] == "service" and c["status"] == "pass"} == {"A", "B", "C"}
        _slurm(env, "scancel", job)
        wait_for(lambda: _gone(env, job), "the job gone after scancel", timeout=60)
        for h in ("A", "B", "C"):
            assert on(h, "docker ps -a --format '{{.Names}}'").stdout.split() == [], h
        print(f"\npd heterogeneous job: sbatch -> proxy ready {ready_s:.1f} s")
    finally:
        if job:
            _slurm(env, "scancel", job)
        lab.up(2, log=lambda *_: None)  # the shape every other lab test expects
        faults.heal()
