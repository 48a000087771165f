#!/usr/bin/env python3
"""How long until a hung deployment is named, and what is named, on the two-station lab.

For each fault, R times, on the deployment serving (the stand-in engine unless the lab serves the real one):
  - railyard: `inv health --json` as on-call runs it: its seconds, whether it failed, and what its hung verdict
    named (the rank, and the evidence's source);
  - script:   the check an SRE's own script runs against the endpoint, from the head (`curl -m 10 /health`, then a
    short chat completion with `curl -m 60`, as vLLM's docs and most readiness probes do): its seconds, and
    whether it failed at all.
The faults, each healed before the next trial: B's worker parked in its collective while it runs
(`lab.fault B engine-stall`: no SIGSTOP), and the head's API server stopped (SIGSTOP). It prints the medians
side by side and their ratio.

    sudo python3 benchmarks/hung_verdict.py [--repeat 3]

Needs root (the lab). Launches the two-station layout if it is not serving; leaves it serving.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import railyard_lab as lab  # noqa: E402
from railyard_lab import faults  # noqa: E402
from benchmarks.bench_overhead import inv, serving  # noqa: E402  (the two-station lab served, as that one does)

CHAT = json.dumps({"model": "railyard-lab/tiny-qwen3", "max_tokens": 4, "temperature": 0,
                   "messages": [{"role": "user", "content": "Reply with the single word: ready."}]})


def on(host: str, command: str) -> subprocess.CompletedProcess:
    h = lab.lab_host(lab.lab_dir(), host)
    return lab.in_host(h, "env", *(f"{k}={v}" for k, v in lab.session_env(h).items()), "bash", "-c", command,
                       check=False)


def railyard(env) -> tuple[float, bool, str]:
    t = time.perf_counter()
    r = inv("health", "--json", env=env)
    took = time.perf_counter() - t
    hung = [v for v in json.loads(r.stdout)["data"]["metrics"]["hung"] if v["state"] in ("hung", "dead")]
    return took, r.returncode != 0, "; ".join(f"{v['host']} {v['target']} ({v['source']})" for v in hung) or "-"


def script(key: str) -> tuple[float, bool, str]:
    check = (f"curl -sf -m 10 http://127.0.0.1:8000/health >/dev/null && curl -sf -m 60 -H 'Content-Type: "
             f"application/json' -H 'Authorization: Bearer {key}' -d {shlex.quote(CHAT)} "
             "http://127.0.0.1:8000/v1/chat/completions >/dev/null")
    t = time.perf_counter()
    r = on("A", check)
    return time.perf_counter() - t, r.returncode != 0, "the endpoint" if r.returncode else "-"


def api_server() -> int:
    """The head's API server: the real `vllm serve` its container's main process (the lab image's wrapper) runs, or
    the stand-in, that main process itself. From the container's pid: the lab hosts share one PID namespace."""
    main = on("A", "docker inspect --format '{{.State.Pid}}' glm53-full").stdout.strip()
    real = [ln.split()[0] for ln in on("A", f"ps -o pid=,args= --ppid {main}").stdout.splitlines()
            if " serve /model" in ln]
    return int(real[0] if real else main)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    env = {**os.environ, "RAILYARD_INVENTORY": str(lab.up(log=lambda *_: None))}
    serving(env)
    key = (lab.lab_dir() / "hosts" / "A" / "home" / ".config" / "railyard" / "vllm-api-key").read_text().strip()

    def stall():
        faults.fault("B", "engine-stall")
        return faults.heal

    def stop_api():
        pid = api_server()
        os.kill(pid, 19)
        return lambda: os.kill(pid, 18)

    print(f"{'fault':<22} {'railyard':>9} {'script':>8} {'ratio':>6}  railyard named | script named")
    for name, inject in (("rank parked (stall)", stall), ("API server stopped", stop_api)):
        runs: dict[str, list[tuple[float, bool, str]]] = {"railyard": [], "script": []}
        for _ in range(args.repeat):
            for who, probe in (("railyard", lambda: railyard(env)), ("script", lambda: script(key))):
                heal = inject()
                try:
                    runs[who].append(probe())
                finally:
                    heal()
                if inv("health", "--json", env=env).returncode:     # a group the fault left wedged comes back
                    inv("recover", "--set", "recover_restart_budget=1000", env=env)
        ours, theirs = (statistics.median(r[0] for r in runs[k]) for k in ("railyard", "script"))
        failed = {k: sum(r[1] for r in v) for k, v in runs.items()}
        print(f"{name:<22} {ours:8.1f}s {theirs:7.1f}s {theirs / ours:5.1f}x  "
              f"{runs['railyard'][-1][2]} ({failed['railyard']}/{args.repeat} failed) | "
              f"{runs['script'][-1][2]} ({failed['script']}/{args.repeat} failed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
