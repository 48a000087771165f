#!/usr/bin/env python3
"""`inv rdma-test` against the way the two-Station playbook qualifies links, on the lab's N hosts.

Both measure every rail of every host in host memory, bandwidth then latency, over the same pairs
(a ring: each host the client of its successor), with the same perftest flags and duration:
  - railyard: `inv rdma-test --memory host --duration D --json` (pairs of a round and their hosts at
    once, every rail alone, then every rail together);
  - by hand:  what NVIDIA's `run_perftest_pair.sh` does for one pair, looped over the pairs: for each
    pair and rail, `ssh SERVER ib_write_bw ...` started in the background, a pause for it to listen,
    `ssh CLIENT ib_write_bw ... SERVER_IP`, then the same for `ib_write_lat`; one pair and rail at a
    time (OpenSSH, a new connection per command, as a script does).
It prints each one's wall time, the runs each made, and the ratio. The by-hand loop makes no
all-rails-together runs (the playbook has none); railyard's figure includes them.

    sudo python3 benchmarks/rdma_test.py [--hosts 24] [--duration 1]

Needs root (the lab). Brings the lab up with that many hosts (stand-in engine); leaves it up.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import railyard.layouts  # noqa: E402,F401  (the layouts register themselves)
import railyard_lab as lab  # noqa: E402
from railyard.checks.links import rounds  # noqa: E402
from railyard.inventory import load_inventory  # noqa: E402


def by_hand(inv_path: Path, duration: int) -> tuple[float, int]:
    """The playbook's pair script, looped: one pair and rail at a time, server then client over ssh."""
    inv = load_inventory(inv_path)
    root = lab.lab_dir()
    hosts = {h.name: h for h in inv.hosts}
    rails = list(inv.head.rails)
    runs = 0
    began = time.monotonic()
    for pairs in rounds(list(hosts)):
        for p in pairs:
            srv, cli = hosts[p.server], hosts[p.client]
            for rail in rails:
                for tool, flags in (("ib_write_bw", ["-F", "--report_gbits", "-D", str(duration), "-q", "4",
                                                     "-s", "1048576"]),
                                    ("ib_write_lat", ["-F", "-n", "2000", "-s", "2"])):
                    argv = [tool, "-d", srv.rails[rail].hca, *flags]
                    server = subprocess.Popen(lab.ssh_argv(root, lab.lab_host(root, srv.name), [" ".join(argv)]),
                                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                    time.sleep(1)   # the playbook's pause for the server to listen
                    client = [tool, "-d", cli.rails[rail].hca, *flags, srv.rails[rail].ip]
                    subprocess.run(lab.ssh_argv(root, lab.lab_host(root, cli.name), [" ".join(client)]),
                                   capture_output=True, timeout=60)
                    server.wait(timeout=60)
                    runs += 1
    return time.monotonic() - began, runs


def railyard(inv_path: Path, duration: int) -> tuple[float, int, bool]:
    env = dict(os.environ, RAILYARD_INVENTORY=str(inv_path))
    began = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "invoke", "rdma-test", "--memory", "host", "--duration", str(duration),
                        "--json"], cwd=ROOT, capture_output=True, text=True, env=env)
    took = time.monotonic() - began
    doc = json.loads(r.stdout)
    return took, len(doc["data"]["results"]), doc["ok"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hosts", type=int, default=24)
    ap.add_argument("--duration", type=int, default=1)
    a = ap.parse_args()
    inv_path = lab.up(a.hosts, log=lambda *_: None, engine="stand-in")
    ours, n_ours, ok = railyard(inv_path, a.duration)
    theirs, n_theirs = by_hand(inv_path, a.duration)
    print(f"{a.hosts} hosts, -D {a.duration}")
    print(f"  railyard rdma-test : {ours:7.1f} s  {n_ours} runs ({'all passed' if ok else 'NOT all passed'})")
    print(f"  pair script, looped: {theirs:7.1f} s  {n_theirs} runs (no all-rails runs)")
    print(f"  ratio              : {theirs / ours:7.1f}x")


if __name__ == "__main__":
    main()
