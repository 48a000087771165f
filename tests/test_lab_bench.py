"""inv bench on the two-station lab: the real AIPerf 0.13.0 (railyard's own venv) against the vLLM
stand-in on A, through railyard's SSH tunnel, with the key from A's key file. Request counts are
tiny (2 x C measured, 1 x C warm-up): the suite runs on 2 cores.

On the vLLM stand-in: the faults of a sweep (a value that does not come up, Ctrl-C), refused keys,
stopped endpoints and a deployment of another configuration: a stand-in launch takes 2 s, a real one
a minute, and a sweep relaunches once per value and once more to restore. AIPerf against the real
engine (c1,2 with SLOs, plots and --compare) is in test_lab_real_stations.py; through the replicas'
router, in test_lab_real_replicas.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import ROOT, as_a_terminal_job, home, inv_cmd, station_ready

pytestmark = pytest.mark.lab
SMALL = ("--isl", "64", "--osl", "16", "--requests", "2", "--warmup", "1")


def run(*args, inv, timeout=300):
    return inv_cmd(*args, env={"RAILYARD_INVENTORY": str(inv)}, timeout=timeout)


@pytest.fixture(scope="module")
def served(lab_inventory):
    with station_ready(lab_inventory) as inv:
        r = run("launch", inv=inv)
        assert r.returncode == 0, r.stdout + r.stderr
        yield inv


def _summary(out: Path) -> dict:
    found = sorted(out.glob("glm53-full/*/summary.json"))
    assert found, f"no summary under {out}"
    return json.loads(found[-1].read_text())


def test_a_key_that_starts_with_a_dash_reaches_aiperf_s_own_parser_as_the_key():
    # token_urlsafe draws "-" first one time in 64: AIPerf 0.13's parser then took `--api-key -KEY` for two
    # options and every bench of that deployment failed ("parameter --api-key requires an argument")
    from railyard.bench import aiperf
    probe = ("import importlib.util, sys\n"
             "spec = importlib.util.spec_from_file_location('launcher', sys.argv[1])\n"
             "launcher = importlib.util.module_from_spec(spec); spec.loader.exec_module(launcher)\n"
             "from aiperf.cli import app\n"
             "for key in sys.argv[2:]:\n"
             "    args = launcher.command(['profile', '--model', 'm', '--url', 'http://127.0.0.1:1'], key)\n"
             "    _, bound, _ = app.parse_args(args, exit_on_error=False, print_error=False)\n"
             "    print(bound.arguments['cli_config'].api_key)\n")
    venv = aiperf.ensure(log=lambda *_: None)
    keys = ["-Xy_9", "--x", "plain"]
    r = subprocess.run([str(venv / "bin" / "python"), "-I", "-c", probe, str(aiperf.LAUNCHER), *keys],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.split() == keys, r.stdout + r.stderr


def test_json_is_one_document_with_a_check_per_concurrency_and_slo(served, tmp_path):
    r = run("bench", "--concurrency", "2", *SMALL, "--out", str(tmp_path), "--slo", "per_user_tok_s>=1",
            "--json", inv=served)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["ok"] and [(c["check"], c["status"]) for c in doc["checks"]] == [("aiperf", "pass"), ("slo", "pass")]
    assert doc["data"]["series"][0]["best_concurrency"] == 2


def test_a_value_that_does_not_come_up_fails_the_sweep_and_the_original_is_back(served, tmp_path):
    # the stand-in needs ~3 s to serve: a 0.5 s start timeout fails the value's launch gate
    r = run("bench", "--concurrency", "1", *SMALL, "--out", str(tmp_path), "--sweep", "max_num_seqs=2",
            "--timeout", "0.5", inv=served, timeout=400)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "max_num_seqs=2: the launch failed" in r.stderr and "Traceback" not in r.stderr
    assert "restoring the original configuration" in r.stderr
    assert json.loads(run("status", "--json", inv=served).stdout)["ok"]
    assert not list(tmp_path.glob("glm53-full/*/summary.json"))      # nothing half-written presented as a result


def test_a_refused_key_and_a_stopped_endpoint_are_one_clear_error_each(served, tmp_path):
    keyfile = home("A") / ".config" / "railyard" / "vllm-api-key"
    good = keyfile.read_text()
    keyfile.write_text("not-the-key\n")
    try:
        r = run("bench", "--concurrency", "1", *SMALL, "--out", str(tmp_path), inv=served)
    finally:
        keyfile.write_text(good)
    assert r.returncode == 1 and r.stderr.startswith("error: auth refused: head on A answers HTTP 401"), r.stderr
    assert "not-the-key" not in r.stdout + r.stderr
    assert run("stop", inv=served).returncode == 0
    try:
        r = run("bench", "--concurrency", "1", *SMALL, "--out", str(tmp_path), inv=served)
        assert r.returncode == 1, r.stdout + r.stderr
        assert r.stderr.strip().splitlines() == [r.stderr.strip()] and "endpoint down" in r.stderr
        assert "(run `inv health`)" in r.stderr and r.stdout == ""
        j = run("bench", "--concurrency", "1", "--json", "--out", str(tmp_path), inv=served)
        assert j.returncode == 1 and json.loads(j.stdout)["checks"][0]["status"] == "fail"
    finally:
        assert run("start", inv=served).returncode == 0


def test_a_deployment_running_another_configuration_is_not_benchmarked_as_this_one(served, tmp_path):
    r = run("bench", "--concurrency", "1", *SMALL, "--out", str(tmp_path), "--set", "vllm_max_num_seqs=8", inv=served)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "glm53-full on A" in r.stderr and "another configuration than the inventory's" in r.stderr
    assert "inv launch --recreate" in r.stderr


def test_ctrl_c_during_a_sweep_puts_the_original_configuration_back(served, tmp_path):
    import os
    import signal
    import time
    p = subprocess.Popen([sys.executable, "-m", "invoke", "bench", "--concurrency", "4", *SMALL, "--out", str(tmp_path),
                          "--sweep", "max_num_seqs=2,4"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True, preexec_fn=as_a_terminal_job,
                         env={**os.environ, "RAILYARD_INVENTORY": str(served)})
    seen = ""
    deadline = time.monotonic() + 120
    while "bench: C=4:" not in seen and time.monotonic() < deadline:   # AIPerf is running on the swept value
        line = p.stderr.readline()
        if not line:
            break
        seen += line
    assert "bench: C=4:" in seen, seen
    time.sleep(1.0)
    os.killpg(p.pid, signal.SIGINT)                                    # the terminal's Ctrl-C: the whole group
    out, err = p.communicate(timeout=180)
    err = seen + err
    assert p.returncode == 130, err
    assert "restoring the original configuration" in err and "Traceback" not in err
    assert json.loads(run("status", "--json", inv=served).stdout)["ok"]
    assert not list(tmp_path.glob("glm53-full/*/summary.json"))


def test_aiperf_on_the_head_reads_the_key_there_and_brings_its_exports_back(served, tmp_path):
    from railyard.bench import aiperf
    assert aiperf.ensure(log=lambda *_: None) == aiperf.SHARED   # as root: the venv the lab's hosts see too
    r = run("bench", "--where", "head", "--concurrency", "2", *SMALL, "--out", str(tmp_path), inv=served)
    assert r.returncode == 0, r.stdout + r.stderr
    s = _summary(tmp_path)
    assert s["where"] == "head" and s["series"][0]["points"][0]["requests"] == 4
    d = Path(s["dir"]) / "c2"
    assert (d / "profile_export_aiperf.json").is_file() and (d / "aiperf.out").is_file()
    assert "--api-key='<redacted>'" in json.loads((d / "profile_export_aiperf.json").read_text())["run_info"]["cli_command"]
    key = (home("A") / ".config" / "railyard" / "vllm-api-key").read_text().strip()
    assert not [f for f in Path(s["dir"]).rglob("*") if f.is_file() and key.encode() in f.read_bytes()]
    bad = run("bench", "--where", "head", "--concurrency", "1", "--out", str(tmp_path), "--set",
              "bench_aiperf_venv=/opt/no-aiperf", inv=served)
    assert bad.returncode == 1 and "A: bench_aiperf_venv /opt/no-aiperf: no AIPerf there" in bad.stderr, bad.stderr
