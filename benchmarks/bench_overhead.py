#!/usr/bin/env python3
"""What `inv bench` adds over calling AIPerf directly, on the two-station lab.

For each concurrency, alternating, R times each, the same load (ISL 64, OSL 16, 4 x C measured
requests, 1 x C warm-up, seed 1):
  - railyard: `inv bench --concurrency C --json` as a user runs it (process start, plan, the
    endpoint and key checks, the tokenizer fetched from A, railyard's SSH tunnel, the plots);
  - direct:   `aiperf profile` from the same venv against an OpenSSH tunnel (`ssh -L`) to A's
    loopback API, typed as AIPerf's docs show it (synthetic token means and stddevs, --streaming,
    the seed; ignore_eos so that both runs generate the same tokens), with the lab tokenizer directory
    and the key in argv (fine on this machine; railyard itself never puts it there).
It prints the median wall time of each and their ratio, and what AIPerf measured through each
tunnel (overall tok/s, mean TTFT), so the tunnel's own cost on the numbers shows too.

    sudo python3 benchmarks/bench_overhead.py [--concurrency 1,4] [--repeat 3]

Needs root (the lab). Launches the two-station layout if it is not serving; leaves it serving.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import railyard_lab as lab  # noqa: E402
from railyard.bench import aiperf  # noqa: E402
from railyard_lab.checkpoint import write_checkpoint  # noqa: E402

LOAD = ["--isl", "64", "--osl", "16", "--requests", "4", "--warmup", "1"]


def inv(*args, env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "invoke", *args], cwd=ROOT, capture_output=True, text=True, env=env)


def serving(env) -> None:
    if inv("health", "--json", env=env).returncode == 0:
        return
    for h in ("A", "B"):
        write_checkpoint(lab.lab_dir() / "hosts" / h / "home" / "models" / "tiny-qwen3", 0.002, 2)
    for step in (("env",), ("launch", "--recreate")):
        r = inv(*step, env=env)
        if r.returncode:
            sys.exit(f"inv {' '.join(step)} failed: {r.stderr.strip()[-300:]}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def railyard_run(c: int, out: Path, env) -> tuple[float, dict]:
    t = time.perf_counter()
    r = inv("bench", "--concurrency", str(c), *LOAD, "--out", str(out), "--json", env=env)
    wall = time.perf_counter() - t
    if r.returncode:
        sys.exit(f"inv bench failed: {r.stderr.strip()[-300:]}")
    return wall, json.loads(r.stdout)["data"]["series"][0]["points"][0]["metrics"]


def direct_run(c: int, out: Path, port: int, key: str, model: str) -> tuple[float, dict]:
    argv = ["profile", "-m", model, "--tokenizer", str(ROOT / "lab/railyard_lab/tokenizer"), "--endpoint-type", "chat",
            "--random-seed", "1", "--synthetic-input-tokens-mean", "64", "--synthetic-input-tokens-stddev", "0",
            "--output-tokens-mean", "16", "--output-tokens-stddev", "0", "--extra-inputs", "ignore_eos:true",
            "--concurrency", str(c), "--request-count", str(4 * c), "--warmup-request-count", str(c),
            "--url", f"localhost:{port}", "--streaming", "--api-key", key, "--artifact-dir", str(out)]
    env = {k: v for k, v in os.environ.items() if k not in aiperf.UNSET} | aiperf.ENV
    t = time.perf_counter()
    p = subprocess.run([str(aiperf.venv_dir() / "bin" / "aiperf"), *argv], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if p.returncode:
        sys.exit(f"aiperf failed: {p.stdout[-300:]}")
    return wall, aiperf.parse_export(json.loads((out / aiperf.EXPORT).read_text()), c).metrics


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    path = lab.up(2, log=lambda *_: None)
    env = dict(os.environ, RAILYARD_INVENTORY=str(path))
    serving(env)
    aiperf.ensure()
    root = lab.lab_dir()
    key = (root / "hosts" / "A" / "home" / ".config" / "railyard" / "vllm-api-key").read_text().strip()
    model = "railyard-lab/tiny-qwen3"
    port = free_port()
    host = lab.lab_host(root, "A")
    tunnel = subprocess.Popen(["ssh", "-N", "-i", str(root / "id_ed25519"), "-o", f"UserKnownHostsFile={root / 'known_hosts'}",
                               "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes", "-o", "ExitOnForwardFailure=yes",
                               "-L", f"127.0.0.1:{port}:127.0.0.1:8000", f"root@{host.mgmt_ip}"])
    try:
        time.sleep(1.0)
        rows = []
        with tempfile.TemporaryDirectory() as tmp:
            for c in [int(x) for x in a.concurrency.split(",")]:
                ry, di = [], []
                for i in range(a.repeat):
                    ry.append(railyard_run(c, Path(tmp) / "ry", env))
                    di.append(direct_run(c, Path(tmp) / f"direct-{c}-{i}", port, key, model))
                rows.append((c, ry, di))
        print(f"inv bench vs aiperf directly, two-station lab, median of {a.repeat} (ISL 64, OSL 16, 4 x C requests)")
        print(f"{'C':>3} | {'railyard s':>10} | {'direct s':>8} | {'ratio':>5} | {'+s':>5} | "
              f"{'tok/s ry':>8} | {'tok/s direct':>12} | {'TTFT ms ry':>10} | {'TTFT ms direct':>14}")
        for c, ry, di in rows:
            rw, dw = statistics.median(w for w, _ in ry), statistics.median(w for w, _ in di)
            rt = statistics.median(m["output_tok_s"] for _, m in ry)
            dt = statistics.median(m["output_tok_s"] for _, m in di)
            rf = statistics.median(m["ttft_mean_s"] for _, m in ry) * 1e3
            df = statistics.median(m["ttft_mean_s"] for _, m in di) * 1e3
            print(f"{c:>3} | {rw:>10.2f} | {dw:>8.2f} | {rw / dw:>5.2f} | {rw - dw:>5.2f} | {rt:>8.1f} | {dt:>12.1f} | "
                  f"{rf:>10.1f} | {df:>14.1f}")
    finally:
        tunnel.terminate()
        tunnel.wait()


if __name__ == "__main__":
    main()
