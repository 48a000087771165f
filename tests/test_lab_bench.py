"""inv bench on the two-station lab: the real AIPerf 0.13.0 (railyard's own venv) against the vLLM
stand-in on A, through railyard's SSH tunnel, with the key from A's key file. Request counts are
tiny (2 x C measured, 1 x C warm-up): the suite runs on 2 cores.

On the vLLM stand-in: each test is a launch or a sweep's relaunches (2 s each, not a minute); AIPerf
against the real engine, c1,2 and a max_num_seqs sweep, is in test_lab_real_stations.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import ROOT, as_a_terminal_job, home, inv_cmd, station_ready
from .test_bench import _png_text

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
             "args = launcher.command(['profile', '--model', 'm', '--url', 'http://127.0.0.1:1'], sys.argv[2])\n"
             "_, bound, _ = app.parse_args(args, exit_on_error=False, print_error=False)\n"
             "print(bound.arguments['cli_config'].api_key)\n")
    venv = aiperf.ensure(log=lambda *_: None)
    for key in ("-Xy_9", "--x", "plain"):
        r = subprocess.run([str(venv / "bin" / "python"), "-I", "-c", probe, str(aiperf.LAUNCHER), key],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and r.stdout.strip() == key, r.stdout + r.stderr


def test_c_1_2_4_writes_aiperf_s_exports_the_table_the_json_and_the_plots(served, tmp_path):
    r = run("bench", "--concurrency", "1,2,4", *SMALL, "--out", str(tmp_path),
            "--slo", "per_user_tok_s>=1", "--slo", "ttft_p90_s<=0.000001", inv=served)
    assert r.returncode == 0, r.stdout + r.stderr          # a failed SLO without --require: shown, exit 0
    s = _summary(tmp_path)
    run_dir = Path(s["dir"])
    pts = s["series"][0]["points"]
    assert [p["concurrency"] for p in pts] == [1, 2, 4] and all(p["errors"] == 0 for p in pts)
    assert [p["requests"] for p in pts] == [4, 4, 8]      # 2 x C, at least 4
    for p in pts:
        assert (run_dir / p["dir"] / "profile_export_aiperf.json").is_file()
        assert (run_dir / p["dir"] / "server_metrics_export.json").is_file()   # vLLM's /metrics, scraped by AIPerf
    m = {p["concurrency"]: p["metrics"] for p in pts}
    # the stand-in's timing follows load: more concurrency, more overall and less per-user throughput
    assert m[4]["output_tok_s"] > m[1]["output_tok_s"] and m[4]["per_user_tok_s"] < m[1]["per_user_tok_s"]
    assert m[4]["itl_mean_ms"] > m[1]["itl_mean_ms"] > 0
    assert all(p["units"]["time_to_first_token"] == "ms" for p in pts)
    assert s["aiperf_version"] == "0.13.0" and s["endpoint"]["host"] == "A"
    assert "overall tok/s" in r.stdout and "fail: ttft_p90_s<=1e-06" in r.stdout
    assert "SLOs per_user_tok_s>=1, ttft_p90_s<=1e-06: met at no concurrency" in r.stdout
    lat = json.loads(_png_text(run_dir / "latency.png")["railyard:series"])
    assert [x["concurrency"] for x in lat["this run"]["ttft_mean_s"]] == [1, 2, 4]
    assert lat["_slos"] == {"ttft_mean_s": ["ttft_p90_s<=1e-06"]}
    thr = json.loads(_png_text(run_dir / "throughput.png")["railyard:series"])
    assert [x["concurrency"] for x in thr["this run"]] == [1, 2, 4]
    # the key: in no file of the run, and AIPerf's own record of its command line has it redacted
    key = (home("A") / ".config" / "railyard" / "vllm-api-key").read_text().strip()
    assert key and not [f for f in run_dir.rglob("*") if f.is_file() and key.encode() in f.read_bytes()]
    doc = json.loads((run_dir / "c1" / "profile_export_aiperf.json").read_text())
    assert "--api-key='<redacted>'" in doc["run_info"]["cli_command"]
    assert key not in r.stdout + r.stderr

    # --compare: the same table with deltas, both runs on the plots; --require makes the failed SLO exit 1
    r2 = run("bench", "--concurrency", "1", *SMALL, "--out", str(tmp_path), "--compare", str(run_dir),
             "--slo", "ttft_p90_s<=0.000001", "--require", inv=served)
    assert r2.returncode == 1, r2.stdout + r2.stderr
    assert f"vs {run_dir}" in r2.stdout.replace("\n", "") or "vs " in r2.stdout
    assert " %)" in r2.stdout                                  # a delta against the earlier C=1
    s2 = _summary(tmp_path)
    assert s2["compare"] == str(run_dir) and s2["dir"] != s["dir"]
    thr2 = json.loads(_png_text(Path(s2["dir"]) / "throughput.png")["railyard:series"])
    assert len(thr2) == 2 and any(s["stamp"] in label for label in thr2)


def test_json_is_one_document_with_a_check_per_concurrency_and_slo(served, tmp_path):
    r = run("bench", "--concurrency", "2", *SMALL, "--out", str(tmp_path), "--slo", "per_user_tok_s>=1",
            "--json", inv=served)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["ok"] and [(c["check"], c["status"]) for c in doc["checks"]] == [("aiperf", "pass"), ("slo", "pass")]
    assert doc["data"]["series"][0]["best_concurrency"] == 2


def test_sweep_relaunches_per_value_and_restores_the_original(served, tmp_path):
    # OSL 64: a request holds its sequence slot ~0.15 s, so waiting for one dwarfs the noise of a busy machine
    r = run("bench", "--concurrency", "4", "--isl", "64", "--osl", "64", "--requests", "2", "--warmup", "1",
            "--out", str(tmp_path), "--sweep", "max_num_seqs=1,4", inv=served, timeout=400)
    assert r.returncode == 0, r.stdout + r.stderr
    s = _summary(tmp_path)
    assert [x["label"] for x in s["series"]] == ["max_num_seqs=1", "max_num_seqs=4"] and s["restored"] is True
    ttft = {x["value"]: x["points"][0]["metrics"]["ttft_mean_s"] for x in s["series"]}
    assert ttft["1"] > 2 * ttft["4"], ttft   # one sequence at a time: the other three wait for their first token
    assert (Path(s["dir"]) / "max_num_seqs=1" / "c4" / "profile_export_aiperf.json").is_file()
    st = json.loads(run("status", "--json", inv=served).stdout)
    assert st["ok"], st                     # running with the inventory's configuration again
    line = subprocess.run(["python3", "-m", "invoke", "launch", "--dry-run"], cwd=ROOT, capture_output=True,
                          text=True, env={**__import__("os").environ, "RAILYARD_INVENTORY": str(served)}).stdout
    assert "--max-num-seqs 16" in line


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


def test_the_replicas_layout_is_benchmarked_through_its_router_with_the_master_key(hgx8_inventory, tmp_path):
    import shutil
    from railyard.lab.checkpoint import write_checkpoint
    from .conftest import on
    names = " ".join(f"vllm-replicas-{n}" for n in ("router", "r0", "r1", "r2", "r3", "lmcache"))
    layout = ("--set", "serve_layout=replicas")
    write_checkpoint(home("A") / "models" / "tiny-qwen3", 0.002, 2)
    on("A", f"docker rm -f {names} >/dev/null 2>&1; true")
    try:
        assert run("env", *layout, inv=hgx8_inventory).returncode == 0
        r = run("launch", *layout, inv=hgx8_inventory)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr
        r = run("bench", *layout, "--concurrency", "2", *SMALL, "--out", str(tmp_path), inv=hgx8_inventory)
        assert r.returncode == 0, r.stdout + r.stderr
        s = json.loads(sorted(tmp_path.glob("vllm-replicas/*/summary.json"))[-1].read_text())
        assert s["endpoint"]["service"] == "router" and s["endpoint"]["port"] == 4000
        p = s["series"][0]["points"][0]
        assert p["errors"] == 0 and p["requests"] == 4 and p["metrics"]["output_tok_s"] > 0
        assert not (Path(s["dir"]) / "c2" / "server_metrics_export.json").exists()   # LiteLLM's /metrics wants the key
        key = (home("A") / ".config" / "railyard" / "litellm-master-key").read_text().strip()
        assert key and not [f for f in Path(s["dir"]).rglob("*") if f.is_file() and key.encode() in f.read_bytes()]
    finally:
        on("A", f"docker rm -f {names} >/dev/null 2>&1; true")
        shutil.rmtree(home("A") / "models", ignore_errors=True)
