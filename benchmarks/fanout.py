#!/usr/bin/env python3
"""Fan-out speed: `inv preflight` against the plain-ssh floor, on 2, 8 and 24 lab hosts.

For each N the lab is resized to N hosts, then, alternating, R times each:
  - railyard: `inv preflight --json` as a user runs it (process start included),
  - floor:    the very same probe script per host, one plain `ssh` per host, all in parallel
              (OpenSSH client, its default key exchange), output only collected.
It prints the median wall time of each, their ratio, and the cost per host.

    sudo python3 benchmarks/fanout.py [--sizes 2,8,24] [--repeat 5]

Needs root (the lab). Leaves a 2-host lab behind.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from railyard import lab  # noqa: E402
from railyard.inventory import load_inventory  # noqa: E402
from railyard.preflight import sections_for  # noqa: E402
from railyard.probe import joined_script, new_token  # noqa: E402


def time_preflight(inv_path: Path) -> tuple[float, bool]:
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "invoke", "preflight", "--json", "-i", str(inv_path)], cwd=ROOT,
                       capture_output=True, text=True)
    return time.perf_counter() - t, p.returncode == 0


def time_plain_ssh(inv_path: Path) -> float:
    inv = load_inventory(inv_path)
    root = lab.lab_dir()
    scripts = {h.name: joined_script(sections_for(h, inv), new_token()) for h in inv.hosts}
    t = time.perf_counter()
    procs = []
    for h in inv.hosts:
        argv = ["ssh", "-i", str(root / "id_ed25519"), "-o", f"UserKnownHostsFile={root / 'known_hosts'}",
                "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes", f"root@{h.address}",
                "date +%s.%N; hostname; sh -c " + __import__("shlex").quote(scripts[h.name])]
        procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL))
    for p in procs:
        p.communicate()
    return time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="2,8,24")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    rows = []
    for n in sizes:
        inv_path = lab.up(n, log=lambda *_: None)
        time_preflight(inv_path)  # warm: ARP tables, page cache
        ours, floor, oks = [], [], []
        for _ in range(args.repeat):
            t, ok = time_preflight(inv_path)
            ours.append(t)
            oks.append(ok)
            floor.append(time_plain_ssh(inv_path))
        o, f = statistics.median(ours), statistics.median(floor)
        rows.append((n, o, f, all(oks)))
        print(f"N={n:>3}  railyard preflight {o:6.2f} s   plain parallel ssh {f:6.2f} s   "
              f"ratio {o / f:4.2f}   per host {o / n * 1000:6.1f} ms vs {f / n * 1000:6.1f} ms   "
              f"(median of {args.repeat}; preflight {'passed' if all(oks) else 'FAILED'})", flush=True)
    lab.up(2, log=lambda *_: None)
    print()
    print("N, railyard_s, plain_ssh_s, ratio")
    for n, o, f, _ in rows:
        print(f"{n}, {o:.3f}, {f:.3f}, {o / f:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
