"""`inv launch-script`: a self-contained launch_server.sh that passes shellcheck, refuses bad input
with one line, and execs exactly the plan's `vllm serve` (checked with a recording `vllm`)."""

import json
import os
import shutil
import subprocess

import pytest

from .conftest import ROOT, inv_cmd

HGX = ROOT / "inventory" / "hgx8-h200.yml"
RECORDER = """#!/usr/bin/env python3
import json, os, sys
print(json.dumps({"argv": sys.argv[1:], "env": {k: os.environ.get(k) for k in ("X_EXTRA", "VLLM_API_KEY")}}))
"""


@pytest.fixture
def script(tmp_path):
    r = inv_cmd("launch-script", "-i", str(HGX), "--out", str(tmp_path / "sub"), "--set", "vllm_extra_env={X_EXTRA: 'a b'}")
    assert r.returncode == 0, r.stderr
    path = tmp_path / "sub" / "launch_server.sh"
    assert list((tmp_path / "sub").iterdir()) == [path] and os.access(path, os.X_OK)
    return (path, *recorder_and_model(tmp_path))


def recorder_and_model(tmp_path):
    """A PATH folder whose `vllm` records what it was run with, and a checkpoint folder."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "vllm").write_text(RECORDER)
    (bin_dir / "vllm").chmod(0o755)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    return bin_dir, model


def run(path, bin_dir, **env):
    full = {"PATH": f"{bin_dir}:/usr/bin:/bin", **{k: str(v) for k, v in env.items()}}
    return subprocess.run(["bash", str(path)], capture_output=True, text=True, env=full, timeout=30)


def test_it_passes_shellcheck(script):
    if not shutil.which("shellcheck"):
        if os.environ.get("RAILYARD_REQUIRE_LAB"):
            pytest.fail("shellcheck is required (apt-get install shellcheck)")
        pytest.skip("no shellcheck")
    r = subprocess.run(["shellcheck", str(script[0])], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout


def test_it_execs_the_plans_vllm_serve_with_port_and_model_path(script):
    path, bin_dir, model = script
    r = run(path, bin_dir, PORT=9123, MODEL_PATH=model)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    argv = doc["argv"]
    assert argv[:2] == ["serve", str(model)]
    flags = " ".join(argv)
    assert "--port 9123" in flags and "--tensor-parallel-size 8" in flags and "--async-scheduling" in flags
    assert "--max-num-batched-tokens 8192" in flags and "--gpu-memory-utilization 0.92" in flags
    assert doc["env"]["X_EXTRA"] == "a b" and doc["env"]["VLLM_API_KEY"] is None


def test_every_value_can_be_overridden_from_the_environment(script):
    path, bin_dir, model = script
    r = run(path, bin_dir, PORT=8000, MODEL_PATH=model, SERVE_MAX_NUM_BATCHED_TOKENS=2048,
            SERVE_EXTRA_ARGS="--max-num-seqs 16 --enforce-eager")
    argv = json.loads(r.stdout)["argv"]
    assert "--max-num-batched-tokens 2048" in " ".join(argv) and argv[-3:] == ["--max-num-seqs", "16", "--enforce-eager"]


@pytest.mark.parametrize("env,message", [
    ({"MODEL_PATH": "MODEL"}, "set PORT"),
    ({"PORT": "8000"}, "set MODEL_PATH"),
    ({"PORT": "80a", "MODEL_PATH": "MODEL"}, "PORT=80a: not a port number"),
    ({"PORT": "70000", "MODEL_PATH": "MODEL"}, "PORT=70000: must be 1-65535"),
    ({"PORT": "8000", "MODEL_PATH": "/nonexistent"}, "MODEL_PATH=/nonexistent: no config.json there"),
])
def test_missing_or_bad_input_is_one_clear_line(script, env, message):
    path, bin_dir, model = script
    env = {k: (str(model) if v == "MODEL" else v) for k, v in env.items()}
    r = run(path, bin_dir, **env)
    assert r.returncode != 0 and r.stdout == ""
    assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_a_snapshot_of_another_revision_is_refused(script, tmp_path):
    path, bin_dir, _ = script
    snap = tmp_path / "snapshots" / ("ab" * 20)
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    r = run(path, bin_dir, PORT=8000, MODEL_PATH=snap)
    assert r.returncode == 2 and "not the pinned 0000000000000000000000000000000000000000" in r.stderr


def test_no_vllm_on_path_names_the_pinned_image(script, tmp_path):
    path, _, model = script
    empty = tmp_path / "empty"
    empty.mkdir()
    r = run(path, empty, PORT=8000, MODEL_PATH=model)
    assert r.returncode == 2 and "no vllm on PATH: run this inside vllm/vllm-openai:v0.30.0@sha256:" in r.stderr


def test_the_two_station_layout_has_no_script(tmp_path):
    r = inv_cmd("launch-script", "-i", str(ROOT / "inventory" / "dgx-stations.yml"), "--out", str(tmp_path))
    assert r.returncode == 2 and "runs 2 services" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "launch_server.sh").exists()


def test_hostile_values_stay_values(tmp_path):
    canary = tmp_path / "pwned"
    hostile = f"a'b \"c\" ; touch {canary} $(touch {canary}) `touch {canary}`"
    extra = json.dumps(["--x;touch " + str(canary), hostile, "--flag$(id)"])
    r = inv_cmd("launch-script", "-i", str(HGX), "--out", str(tmp_path / "s"), "--set", f"vllm_extra_args={extra}",
                "--set", f"vllm_extra_env={{X_EXTRA: {json.dumps(hostile)}}}")
    assert r.returncode == 0, r.stderr
    bin_dir, model = recorder_and_model(tmp_path)
    out = run(tmp_path / "s" / "launch_server.sh", bin_dir, PORT=8000, MODEL_PATH=model)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    argv = doc["argv"]
    i = argv.index("--x;touch " + str(canary))
    assert argv[i + 1] == hostile and "--flag$(id)" in argv and doc["env"]["X_EXTRA"] == hostile
    assert not canary.exists()
