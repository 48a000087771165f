"""`inv launch` compares the checkpoint by content on every host before anything starts (the vLLM stand-in:
what is tested is railyard's refusal, not the engine). The fault is the issue's: 1 MiB of one padding
shard on B zeroed, its size and mtime put back, which a comparison by names and sizes (or rsync's quick
check) cannot see. The judgement itself is unit-tested in test_checkpoint_content.py."""

from __future__ import annotations

import json
import os

import pytest

from railyard_lab.checkpoint import shard_name, write_checkpoint

from .conftest import home, inv_cmd, on, station_ready

pytestmark = pytest.mark.lab
NAME = "glm53-full"
SHARD = shard_name(1, 2)


def run(*args, inv, timeout=180):
    return inv_cmd(*args, env={"RAILYARD_INVENTORY": str(inv)}, timeout=timeout)


def started_at(host: str) -> str:
    return on(host, f"docker inspect -f '{{{{.State.StartedAt}}}}' {NAME} 2>&1").stdout.strip()


def test_launch_refuses_a_shard_zeroed_on_b_with_its_size_and_mtime_kept(lab_inventory):
    with station_ready(lab_inventory) as inv:
        for h in ("A", "B"):   # shards of 3 MB: room for the 1 MiB the fault zeroes
            write_checkpoint(home(h) / "models" / "tiny-qwen3", 0.006, 2)
        r = run("launch", inv=inv)
        assert r.returncode == 0, r.stdout + r.stderr      # the same content everywhere: the launch goes on
        before = {h: started_at(h) for h in ("A", "B")}
        assert all(before.values()), before

        shard = home("B") / "models" / "tiny-qwen3" / SHARD
        st = shard.stat()
        with open(shard, "r+b") as f:
            f.seek(1 << 20)
            f.write(b"\0" * (1 << 20))
        os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert (shard.stat().st_size, shard.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)

        r = run("launch", "--recreate", inv=inv)
        assert r.returncode == 1, r.stdout + r.stderr
        line = r.stderr.strip()
        assert len(line.splitlines()) == 1 and "Traceback" not in line, r.stderr
        assert f"B: {SHARD} differs by content from A's (sha256 " in line and "nothing started" in line, line
        assert "inv sync-model --repair" in line
        # nothing taken down or started: --recreate would have replaced both containers
        assert {h: started_at(h) for h in ("A", "B")} == before
        j = run("launch", "--recreate", "--json", inv=inv)
        assert j.returncode == 1 and f"B: {SHARD} differs by content" in json.dumps(json.loads(j.stdout)), j.stdout
