#!/usr/bin/env python3
"""Copy and verification speed of `inv sync-model` on the lab, against plain tools.

    sudo python3 benchmarks/sync.py [--size-gb 4.3] [--shards 50] [--streams 4]

Copy, A -> B over the lab's rail (sender and receiver share this machine's cores):
  - one plain `rsync -aH` over SSH (OpenSSH defaults), run on A, as the reference does it;
  - like for like: one plain rsync with sync-model's cipher (aes128-gcm, no compression), and as many
    plain rsyncs in parallel as sync-model's streams (`xargs -P`), same cipher;
  - `inv sync-model --verify size` (its copy phase and its whole run), over SSH (the default) and over
    the opt-in rsyncd transport (a one-time rsync daemon on B's rail address, no cipher);
  - a local `cp -r` of the tree on A's filesystem: the ceiling, and each transport's fraction of it;
  - a no-op re-sync of identical trees.
Verification of B's tree:
  - one `sha256sum` process over every file, cold (caches dropped) and warm, and as many `sha256sum`
    processes as cores (`xargs -P`: the same hash, the same parallelism as railyard's manifest);
  - railyard's manifest (`content`, every core), cold and warm with --rehash, then with its digest cache.
Needs root (the lab, drop_caches). Writes ~4 copies of the checkpoint under /var/tmp; removes them.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import railyard_lab as lab  # noqa: E402
from railyard_lab.checkpoint import write_checkpoint  # noqa: E402
from railyard.verbs.sync import MANIFEST_SCRIPT  # noqa: E402

REL = "models/tiny-qwen3"


def on(host: str, command: str, stdin: str | None = None) -> tuple[float, subprocess.CompletedProcess]:
    root = lab.lab_dir()
    argv = lab.ssh_argv(root, lab.lab_host(root, host), [command])
    t = time.perf_counter()
    p = subprocess.run(argv, input=stdin, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"{host}: {command}: {p.stderr.strip()}")
    return time.perf_counter() - t, p


def drop_caches() -> None:
    subprocess.run(["sync"], check=True)
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def inv(*args: str) -> tuple[float, dict]:
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "invoke", *args, "--json"], cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t
    doc = json.loads(p.stdout)
    if not doc["ok"]:
        raise SystemExit(f"sync-model failed: {p.stdout[-2000:]}")
    return wall, doc.get("data", doc)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-gb", type=float, default=4.3)
    ap.add_argument("--shards", type=int, default=50)
    ap.add_argument("--streams", type=int, default=4)
    a = ap.parse_args()
    inv_path = str(lab.up(2, log=lambda *_: None))
    homes = lab.lab_dir() / "hosts"
    src, dst = homes / "A" / "home" / REL, homes / "B" / "home" / REL
    for d in (src, dst, homes / "A" / "home" / "models" / "cp-copy"):
        shutil.rmtree(d, ignore_errors=True)
    print(f"writing a {a.size_gb} GB checkpoint of {a.shards} shards on A ...", flush=True)
    info = write_checkpoint(src, a.size_gb, a.shards)
    size = sum(p.stat().st_size for p in src.iterdir() if p.is_file())
    gb = size / 1e9
    rows = []

    def row(name: str, seconds: float, note: str = "") -> None:
        rows.append((name, seconds, note))
        rate = "" if "no-op" in name or "cache" in name else f"{gb / seconds * 1000:7.0f} MB/s"
        print(f"{name:<46} {seconds:7.2f} s  {rate}  {note}", flush=True)

    drop_caches()
    on("B", f"mkdir -p ~/{REL}")  # as the reference does before its rsync
    t, _ = on("A", f"rsync -aH --exclude .cache/ ~/{REL}/ root@198.18.101.12:{REL}/")
    row("plain rsync -aH over ssh (1 stream)", t)
    plain = t
    shutil.rmtree(dst)
    aes = shlex.quote("ssh -c aes128-gcm@openssh.com -o Compression=no")
    drop_caches()
    on("B", f"mkdir -p ~/{REL}")
    t, _ = on("A", f"rsync -aH -e {aes} --exclude .cache/ ~/{REL}/ root@198.18.101.12:{REL}/")
    row("plain rsync -aH, aes128-gcm (1 stream)", t, f"x{plain / t:.2f} vs plain rsync")
    shutil.rmtree(dst)
    drop_caches()
    on("B", f"mkdir -p ~/{REL}")
    per = math.ceil(info["files"] / a.streams)
    one = shlex.quote(f'rsync -aHR -e "ssh -c aes128-gcm@openssh.com -o Compression=no" "$@" root@198.18.101.12:{REL}/')
    t, _ = on("A", f"cd ~/{REL} && find . -path ./.cache -prune -o -type f -print0 | xargs -0 -P {a.streams} -n {per} "
                   f"sh -c {one} rsync")
    row(f"plain rsync -aH, aes128-gcm, {a.streams} in parallel", t, f"x{plain / t:.2f} vs plain rsync")
    parallel_plain = t
    shutil.rmtree(dst)

    copies = {}
    for transport in ("ssh", "rsyncd"):
        shutil.rmtree(dst, ignore_errors=True)
        drop_caches()
        wall, doc = inv("sync-model", "-i", inv_path, "--verify", "size", "--streams", str(a.streams),
                        "--transport", transport)
        copy = next(h for h in doc["hosts"] if h["host"] == "B")["copy"]
        copies[transport] = copy["seconds"]
        row(f"sync-model copy phase, {transport} ({a.streams} streams)", copy["seconds"],
            f"x{plain / copy['seconds']:.2f} vs plain rsync, x{parallel_plain / copy['seconds']:.2f} vs "
            f"{a.streams} plain in parallel; whole run {wall:.2f} s")

    drop_caches()
    t, _ = on("A", f"cp -r ~/{REL} ~/models/cp-copy")
    row("local cp -r on A (ceiling)", t)
    shutil.rmtree(homes / "A" / "home" / "models" / "cp-copy")
    for transport, seconds in copies.items():
        print(f"  {transport}: {t / seconds:.2f} of the local-copy ceiling", flush=True)

    wall, doc = inv("sync-model", "-i", inv_path, "--verify", "size")
    b = next(h for h in doc["hosts"] if h["host"] == "B")
    row("no-op re-sync (verify size)", wall, f"sent {b['copy']['bytes_sent']} bytes; {info['files']} files")

    drop_caches()
    t_disk, _ = on("B", "find ~/" + REL + " -path '*/.cache' -prune -o -type f -print0 | xargs -0 cat > /dev/null")
    row("disk read, cold (cat, 1 process)", t_disk)
    files = "find ~/" + REL + " -path '*/.cache' -prune -o -type f -print0 | xargs -0 sha256sum > /dev/null"
    drop_caches()
    t_cold, _ = on("B", files)
    row("verify: sha256sum, 1 process, cold", t_cold)
    t_warm, _ = on("B", files)
    row("verify: sha256sum, 1 process, warm", t_warm)
    par = files.replace("xargs -0 sha256sum", "xargs -0 -P \"$(nproc)\" -n 1 sha256sum")
    drop_caches()
    t_pcold, _ = on("B", par)
    row("verify: sha256sum, a process per core, cold", t_pcold)
    t_pwarm, _ = on("B", par)
    row("verify: sha256sum, a process per core, warm", t_pwarm)
    script = MANIFEST_SCRIPT.read_text()
    drop_caches()
    t, _ = on("B", f"python3 - ~/{REL} content --rehash", stdin=script)
    row("verify: railyard manifest, every core, cold", t, f"x{t_cold / t:.2f} vs sha256sum cold, x{t_pcold / t:.2f} "
        f"vs a sha256sum per core; {t_disk / t:.2f} of the cold disk read rate")
    t, _ = on("B", f"python3 - ~/{REL} content --rehash", stdin=script)
    row("verify: railyard manifest, every core, warm", t, f"x{t_warm / t:.2f} vs sha256sum warm, x{t_pwarm / t:.2f} "
        "vs a sha256sum per core")
    t, p = on("B", f"python3 - ~/{REL} content", stdin=script)
    row("verify: railyard manifest, digest cache", t, f"hashed {json.loads(p.stdout)['cache']['hashed']} files")

    shutil.rmtree(dst, ignore_errors=True)
    shutil.rmtree(src, ignore_errors=True)
    print(f"\n{gb:.2f} GB, {info['files']} files; this machine: {subprocess.run(['nproc'], capture_output=True, text=True).stdout.strip()} cores")
    return 0


if __name__ == "__main__":
    sys.exit(main())
