"""nccl-check on a one-host layout, without the lab: the probe container derived from the engine's
service, nccl_probe.py's --local-ranks mode, and the report's checks on real NCCL logs."""

import json
import shlex
import subprocess
import sys
import time

from railyard.checks.nccl import judge_intranode
from railyard.verbs.nccl_check import (PROBE, OneHostReport, SizeResult, local_probe_line, nccl_report, parse_probe,
                                       summarize)

from .conftest import REAL
from .test_plan import docker_parses, hgx_plan

PUB = REAL / "nccl" / "public"


def argv_of(line):
    return shlex.split(line)


def flags(argv, name):
    return [argv[i + 1] for i, a in enumerate(argv) if a == name]


def test_the_probe_container_is_the_engines_gpus_env_ipc_and_shm():
    for layout in ("single_node_tp", "dp_ep"):
        _, plan = hgx_plan(f"serve_layout={layout}", "vllm_extra_env={NCCL_DEBUG: WARN, NCCL_P2P_DISABLE: '1'}")
        svc = plan.services()[0]
        argv = argv_of(local_probe_line(plan, svc, "/home/ubuntu", "1M,16M,256M,1G", 300, 29511))
        assert flags(argv, "--gpus") == ['"device=' + ",".join(svc.spec.gpus.uuids) + '"'] and len(svc.spec.gpus.uuids) == 8
        assert flags(argv, "--ipc") == ["host"] and flags(argv, "--network") == ["host"]
        assert flags(argv, "--shm-size") == [svc.spec.shm_size] and flags(argv, "--cpuset-cpus") == [svc.spec.cpuset]
        env = flags(argv, "-e")
        # the service's own variables stay (the fault a user injects); NCCL logs at INFO whatever they said
        assert "NCCL_P2P_DISABLE=1" in env and "NCCL_DEBUG=WARN" not in env
        assert env[-4:] == ["NCCL_DEBUG=INFO", "NCCL_DEBUG_SUBSYS=INIT,ENV,P2P,SHM,NET", "MASTER_ADDR=127.0.0.1",
                            "MASTER_PORT=29511"]
        assert flags(argv, "-v") == ["/home/ubuntu/.cache/railyard/nccl_probe.py:/railyard/nccl_probe.py:ro"]
        assert "VLLM_API_KEY" not in " ".join(argv) and "-p" not in argv and "--label" in argv
        assert argv[argv.index("--entrypoint") + 1:][:1] == ["python3"]
        assert argv[-7:] == ["/railyard/nccl_probe.py", "--local-ranks", "8", "--sizes", "1M,16M,256M,1G",
                             "--timeout", "300"]
        docker_parses(" ".join(shlex.quote(a) for a in argv))


def test_local_ranks_stops_the_others_when_one_rank_fails(tmp_path):
    """rank 2 has no GPU (torch raises at set_device); ranks 0 and 1 would wait in the rendezvous
    until --timeout: the probe stops them and exits 1 within seconds."""
    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text(
        "class cuda:\n    @staticmethod\n    def set_device(i):\n"
        "        if i >= 2:\n            raise RuntimeError('CUDA error: invalid device ordinal')\n")
    (fake / "distributed.py").write_text("import time\ndef init_process_group(*a, **k):\n    time.sleep(600)\n")
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, str(PROBE), "--local-ranks", "3", "--sizes", "1M", "--timeout", "600"],
                       capture_output=True, text=True, timeout=60,
                       env={"PYTHONPATH": str(tmp_path), "MASTER_PORT": "29599", "PATH": "/usr/bin:/bin"})
    assert r.returncode == 1 and time.monotonic() - t0 < 15
    results, errors = parse_probe(r.stdout, with_rank=True)
    assert results == [] and errors == ["rank 2: RuntimeError: CUDA error: invalid device ordinal"]


def test_the_multi_host_mode_is_unchanged_without_local_ranks(tmp_path):
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("raise ImportError('no torch here')\n")
    r = subprocess.run([sys.executable, str(PROBE), "--sizes", "1M"], capture_output=True, text=True, timeout=60,
                       env={"PYTHONPATH": str(tmp_path), "RANK": "1", "WORLD_SIZE": "2", "PATH": "/usr/bin:/bin"})
    assert r.returncode == 1
    assert [json.loads(x) for x in r.stdout.splitlines()] == [{"railyard_probe": 1, "rank": 1,
                                                              "error": "ImportError: no torch here"}]


def one_host(name, busbw=(40.0, 300.0, 360.0), errors=()):
    text = (PUB / name).read_text()
    v = judge_intranode(text, "A:railyard-nccl-check")
    rows = {r: [{"rank": r, "bytes": b, "time_s": b / (bw * 4 / 7) / 1e9, "algbw_gbs": bw * 4 / 7, "busbw_gbs": bw}
                for b, bw in zip((1 << 20, 256 << 20, 1 << 30), busbw)] for r in range(8)}
    sizes = summarize(rows)
    ok = not errors and v.verdict == "pass" and sizes[-1].busbw_gbs >= 200
    return OneHostReport(ok, "single_node_tp", "A", 8, v, sizes, 200.0, list(errors), ["A"])


def shape(rep):
    doc = json.loads(nccl_report(rep).json())
    assert set(doc) == {"ok", "checks", "data"}
    return doc


def test_report_of_a_healthy_host_checks_probe_p2p_and_bandwidth():
    doc = shape(one_host("vllm-h100-4gpu-docker_p2p-cumem_16-nvls-channels_fragments.log"))
    assert doc["ok"] and [(c["host"], c["check"], c["status"]) for c in doc["checks"]] == [
        ("A", "probe", "pass"), ("A", "p2p", "pass"), ("A", "bandwidth", "pass")]
    assert "via P2P/CUMEM; NVLink SHARP (NVLS) in use" in doc["checks"][1]["detail"]
    assert set(doc["data"]) == {"layout", "host", "local_ranks", "transport", "sizes", "min_busbw_gbs", "errors",
                                "removed"}
    assert doc["data"]["transport"]["transport"] == "P2P" and doc["data"]["sizes"][-1]["busbw_gbs"] == 360.0


def test_report_of_shm_names_the_variable_and_a_slow_bus_fails_the_bandwidth():
    doc = shape(one_host("vllm-tp2-one-host_p2p-disabled_shm-direct_nccl2.28.9.log", busbw=(2.0, 11.0, 13.5)))
    checks = {c["check"]: c for c in doc["checks"]}
    assert not doc["ok"] and checks["probe"]["status"] == "pass"
    assert checks["p2p"]["status"] == "fail" and "via SHM (host shared memory)" in checks["p2p"]["detail"]
    assert checks["p2p"]["hint"].startswith("NCCL_P2P_DISABLE=1 is set")
    assert checks["bandwidth"]["status"] == "fail" and "13.5 GB/s" in checks["bandwidth"]["detail"]


def test_report_of_a_probe_error_fails_the_probe_row():
    rep = one_host("vllm-tp2-one-host_p2p-cumem_nccl2.28.9.log",
                   errors=["A: rank 4: AcceleratorError: CUDA error: invalid device ordinal"])
    checks = {c["check"]: c for c in shape(rep)["checks"]}
    assert checks["probe"]["status"] == "fail" and checks["probe"]["detail"].startswith("rank 4: AcceleratorError")


def test_size_results_are_the_slowest_rank():
    rows = {0: [{"rank": 0, "bytes": 8, "time_s": 1.0, "algbw_gbs": 8e-9, "busbw_gbs": 1.4e-8}],
            1: [{"rank": 1, "bytes": 8, "time_s": 2.0, "algbw_gbs": 4e-9, "busbw_gbs": 7e-9}]}
    assert summarize(rows) == [SizeResult(8, 2000.0, 4e-9, 7e-9)]


H200 = REAL / "h200-validation"


def test_real_h200_local_ranks_runs():
    """On the lent one-GPU H200: rank 1 has no GPU and the probe ends at once; one rank moves nothing."""
    results, errors = parse_probe(H200.joinpath("probe-local-ranks-2-on-one-gpu.log").read_text(), with_rank=True)
    assert results == [] and errors == ["rank 1: AcceleratorError: CUDA error: invalid device ordinal"]
    text = H200.joinpath("probe-local-ranks-1.log").read_text()
    results, errors = parse_probe(text, with_rank=True)
    assert errors == [] and [(r["rank"], r["bytes"], r["busbw_gbs"]) for r in results] == [(0, 1 << 20, 0.0),
                                                                                        (0, 1 << 30, 0.0)]
    v = judge_intranode(text, "h200")
    assert (v.verdict, v.local_ranks, v.nodes, v.nccl_version) == ("fail", 1, 1, "2.28.9")
    assert "no channel seen" in v.reasons[0]
