#!/usr/bin/env python3
"""NCCL all-reduce probe, run inside the serving image on every rank (`inv nccl-check`).

    RANK=0 WORLD_SIZE=2 MASTER_ADDR=192.168.101.1 MASTER_PORT=29511 python3 nccl_probe.py --sizes 1M,16M,256M,1G

Uses the image's own PyTorch and NCCL, the GPU it is given, and the NCCL environment of the
container. For each size: warm-up, then timed all-reduces (float32, sum); prints one JSON line
per size, `{"railyard_probe": 1, "rank", "bytes", "time_s", "algbw_gbs", "busbw_gbs"}`, with the
nccl-tests definitions: algbw = bytes / time, busbw = algbw * 2 (n - 1) / n. Every result is
checked (the sum of 1..n in every element). Errors print `{"railyard_probe": 1, "error": ...}`
and exit 1. NCCL's own log goes where NCCL_DEBUG / NCCL_DEBUG_FILE say.

One host, N GPUs (the one-host layouts): `--local-ranks N` starts N processes of this script in the
one container, rank i on cuda:i, MASTER_ADDR 127.0.0.1 unless set; every rank prints its own lines,
as above. It exits 0 when every rank did; when one fails, the others are stopped (they would wait
in the collective until --timeout) and it exits 1.

    MASTER_PORT=29511 python3 nccl_probe.py --local-ranks 8 --sizes 1M,16M,256M,1G
"""

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import time

UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text):
    text = text.strip().upper().rstrip("B").rstrip("I")
    if text and text[-1] in UNITS:
        return int(float(text[:-1]) * UNITS[text[-1]])
    return int(text)


def emit(**kw):
    print(json.dumps(dict(railyard_probe=1, **kw)), flush=True)


def _without_local_ranks(argv):
    out, skip = [], False
    for x in argv:
        if skip:
            skip = False
        elif x == "--local-ranks":
            skip = True
        elif not x.startswith("--local-ranks="):
            out.append(x)
    return out


def run_local(n, argv, timeout):
    """N ranks of this host, each a process of this script with RANK/LOCAL_RANK i and WORLD_SIZE n."""
    procs = []
    for i in range(n):
        env = dict(os.environ, RANK=str(i), LOCAL_RANK=str(i), WORLD_SIZE=str(n))
        env.setdefault("MASTER_ADDR", "127.0.0.1")
        env.setdefault("MASTER_PORT", "29511")
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__)] + argv, env=env))

    def stop(*_):
        for p in procs:
            if p.poll() is None:
                p.terminate()

    signal.signal(signal.SIGTERM, lambda *_: (stop(), sys.exit(143)))
    deadline = time.monotonic() + timeout + 30
    stopped = False
    while True:
        codes = [p.poll() for p in procs]  # every one: poll() is what sets returncode
        if all(c is not None for c in codes):
            break
        if not stopped and any(c not in (None, 0) for c in codes):
            time.sleep(2)  # the others may still print their own error; then they would wait in vain
            stop()
            stopped = True
        elif not stopped and time.monotonic() > deadline:
            for i, c in enumerate(codes):
                if c is None:
                    emit(rank=i, error=f"TimeoutError: rank {i} still running after {timeout} s")
            stop()
            stopped = True
        time.sleep(0.1)
    for i, p in enumerate(procs):
        if p.returncode < 0 and not stopped:
            emit(rank=i, error=f"rank {i} was killed by signal {-p.returncode}")
    return 1 if any(p.returncode for p in procs) else 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1M,16M,256M,1G")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--timeout", type=int, default=300)
    ap.add_argument("--local-ranks", type=int, default=0, help="start this many ranks on this host, rank i on cuda:i")
    a = ap.parse_args()
    if a.local_ranks:
        raise SystemExit(run_local(a.local_ranks, _without_local_ranks(sys.argv[1:]), a.timeout))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    try:
        import torch
        import torch.distributed as dist
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl", init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
                                rank=rank, world_size=world, timeout=datetime.timedelta(seconds=a.timeout))
        want = world * (world + 1) / 2
        for size in [parse_size(s) for s in a.sizes.split(",") if s.strip()]:
            n = max(1, size // 4)
            x = torch.empty(n, dtype=torch.float32, device="cuda")
            for _ in range(a.warmup):
                x.fill_(rank + 1)
                dist.all_reduce(x)
            torch.cuda.synchronize()
            dist.barrier()
            times = []
            for _ in range(a.iters):
                x.fill_(rank + 1)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                dist.all_reduce(x)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
                if not bool((x == want).all()):
                    raise RuntimeError(f"wrong all-reduce result at {n * 4} bytes: expected {want}")
            t = sorted(times)[len(times) // 2]
            algbw = n * 4 / t / 1e9
            emit(rank=rank, bytes=n * 4, time_s=t, algbw_gbs=algbw, busbw_gbs=algbw * 2 * (world - 1) / world)
            del x
        dist.destroy_process_group()
    except Exception as e:  # the orchestrator reads this line; the traceback stays in the log
        emit(rank=rank, error=f"{type(e).__name__}: {e}")
        raise SystemExit(1)


if __name__ == "__main__":
    main()
