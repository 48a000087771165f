"""The checkpoint compared by content before anything starts (railyard.verbs.sync.checkpoint_differs, which
`inv launch` runs and recover's group path takes): its judgement of manifests, and the function against the
station plan with a fake session per host that runs the real scripts/manifest.py on a local folder (the same
digest cache a host keeps), so the cache's stat pass and a rewrite that keeps size and mtime are the script's
own behaviour, not a fake's."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from railyard.testing import FakeSession
from railyard.transport.runner import Runner
from railyard.verbs.sync import MANIFEST_SCRIPT, FileInfo, Manifest, checkpoint_differs, judge_checkpoints

from .test_plan import station_plan
from .test_pd_plan import pd_plan

PATHS = {"A": "~/models/m", "B": "~/models/m", "C": "~/models/m"}
SHARD = "model-00001-of-00002.safetensors"


def m(host, files, **kw):
    return Manifest(host, True, {p: FileInfo(s, 1, d) for p, (s, d) in files.items()}, **kw)


GOOD = {"config.json": (10, "c" * 64), SHARD: (100, "a" * 64), "model-00002-of-00002.safetensors": (100, "b" * 64)}


def test_equal_content_everywhere_is_no_difference():
    assert judge_checkpoints([m("A", GOOD), m("B", GOOD), m("C", GOOD)], PATHS) == ""


def test_a_shard_of_other_content_is_named_with_its_host_and_both_digests():
    bad = {**GOOD, SHARD: (100, "f" * 64)}
    line = judge_checkpoints([m("A", GOOD), m("B", bad)], PATHS)
    assert line == f"B: {SHARD} differs by content from A's (sha256 ffffffffffff, A's aaaaaaaaaaaa)"
    assert "\n" not in line


def test_every_differing_host_is_named_with_its_first_file_and_the_count_of_the_rest():
    two = {**GOOD, SHARD: (100, "f" * 64), "model-00002-of-00002.safetensors": (100, "e" * 64)}
    missing = {k: v for k, v in GOOD.items() if k != SHARD}
    line = judge_checkpoints([m("A", GOOD), m("B", two), m("C", missing)], PATHS)
    assert line == (f"B: {SHARD} differs by content from A's (sha256 ffffffffffff, A's aaaaaaaaaaaa) "
                    f"(and 1 more file(s)); C: {SHARD} is missing (A has it)")


def test_a_size_an_extra_file_no_checkpoint_and_an_unread_host_are_each_one_clause():
    assert judge_checkpoints([m("A", GOOD), m("B", {**GOOD, SHARD: (99, "a" * 64)})], PATHS) == \
        f"B: {SHARD} is 99 bytes, 100 on A"
    assert judge_checkpoints([m("A", GOOD), m("B", {**GOOD, "stray.bin": (1, "0" * 64)})], PATHS) == \
        "B: stray.bin is not in A's checkpoint"
    assert judge_checkpoints([m("A", GOOD), Manifest("B", False, {})], PATHS) == "B: no checkpoint at ~/models/m"
    assert judge_checkpoints([m("A", GOOD), Manifest("B", False, {}, error="ssh_error: timed out")], PATHS) == \
        "B: checkpoint not read: ssh_error: timed out"
    # the first host is the reference: without a checkpoint there, nothing is compared against it
    assert judge_checkpoints([Manifest("A", False, {}), m("B", GOOD)], PATHS) == "A: no checkpoint at ~/models/m"


# ---------------------------------------------------------------- the function, the real manifest script

def _write(root: Path, zero_shard: bool = False) -> None:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"]}))
    for i in (1, 2):
        (root / f"model-0000{i}-of-00002.safetensors").write_bytes(bytes(range(256)) * 12288)   # 3 MiB each


def _zero_one_mib_keeping_size_and_mtime(path: Path) -> None:
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(1 << 20)
        f.write(b"\0" * (1 << 20))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns


def _sessions(inv, roots: dict[str, Path]) -> dict[str, FakeSession]:
    """A session per host whose manifest command runs the real script on that host's local folder."""
    def manifest(root):
        def reply(command):
            mode = command.split()[-1] if command.split()[-1] != "--rehash" else command.split()[-2]
            r = subprocess.run([sys.executable, "-", str(root), mode], input=MANIFEST_SCRIPT.read_text(),
                               capture_output=True, text=True, timeout=60)
            return r.returncode, r.stdout, r.stderr
        return reply
    return {h: FakeSession(inv.host(h), {re.compile(r"^python3 - "): manifest(root)}) for h, root in roots.items()}


def _differs(inv, plan, sessions) -> str:
    with Runner([inv.host(h) for h in sessions], sessions=sessions) as runner:
        return checkpoint_differs(inv, runner, plan)


def _cache(root: Path) -> dict:
    return json.loads((root / ".cache" / "railyard" / "digests.json").read_text())


def test_one_session_per_host_and_a_shard_zeroed_with_size_and_mtime_kept_is_named(tmp_path):
    inv, plan, _ = station_plan()
    roots = {h: tmp_path / h for h in ("A", "B")}
    for root in roots.values():
        _write(root)
    sessions = _sessions(inv, roots)
    assert _differs(inv, plan, sessions) == ""
    assert [len(s.calls) for s in sessions.values()] == [1, 1]         # one manifest per host, content mode
    assert all(c.rstrip().endswith("content") for s in sessions.values() for c in s.calls)
    cached = _cache(roots["B"])
    assert sorted(cached) == ["config.json", SHARD, "model-00002-of-00002.safetensors"]

    _zero_one_mib_keeping_size_and_mtime(roots["B"] / SHARD)
    line = _differs(inv, plan, _sessions(inv, roots))
    assert line.startswith(f"B: {SHARD} differs by content from A's (sha256 "), line
    assert "A:" not in line and "\n" not in line
    # the cache's key holds ctime and the inode besides size and mtime: the rewrite moved ctime, so it was
    # hashed again, not taken from the cache as the equal digest it had
    assert _cache(roots["B"])[SHARD][4] != cached[SHARD][4]


def test_an_unchanged_tree_is_a_stat_pass(tmp_path):
    inv, plan, _ = station_plan()
    roots = {h: tmp_path / h for h in ("A", "B")}
    for root in roots.values():
        _write(root)
    assert _differs(inv, plan, _sessions(inv, roots)) == ""
    run = subprocess.run([sys.executable, "-", str(roots["B"]), "content"], input=MANIFEST_SCRIPT.read_text(),
                         capture_output=True, text=True, timeout=60)
    assert json.loads(run.stdout)["cache"] == {"hits": 3, "hashed": 0, "bytes_hashed": 0, "saved": True}


def test_a_one_host_plan_reads_nothing():
    from .test_plan import hgx_plan
    inv, plan = hgx_plan()
    assert _differs(inv, plan, {inv.hosts[0].name: FakeSession(inv.hosts[0])}) == ""   # no command expected


def test_three_hosts_of_pd_each_read_once_and_the_third_named(tmp_path):
    inv, plan = pd_plan()
    roots = {h: tmp_path / h for h in plan.hosts()}                   # P1 (prefill and the proxy), P2, D1
    for root in roots.values():
        _write(root)
    (roots["D1"] / "config.json").write_text("{}")
    sessions = _sessions(inv, roots)
    assert _differs(inv, plan, sessions) == "D1: config.json is 2 bytes, 39 on P1"
    assert [len(s.calls) for s in sessions.values()] == [1, 1, 1]
