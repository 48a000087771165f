"""sync-model against the lab: real rsync over real SSH from A to B, verified on both."""

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

from railyard.inventory import load_inventory
import railyard_lab as lab
from railyard_lab import lab_dir
from railyard_lab.checkpoint import shard_name, write_checkpoint
from railyard.verbs.sync import SyncOptions, sync_model

from .conftest import ROOT, as_a_terminal_job, inv_cmd, wait_for

pytestmark = pytest.mark.lab

SHARDS, SIZE_GB = 8, 0.16  # 20 MB shards: big enough to interrupt, small enough for CI


def model_dir(host: str):
    return lab_dir() / "hosts" / host / "home" / "models" / "tiny-qwen3"


@pytest.fixture(scope="module")
def checkpoint(lab_inventory):
    shutil.rmtree(model_dir("A"), ignore_errors=True)
    write_checkpoint(model_dir("A"), SIZE_GB, SHARDS)
    yield lab_inventory
    shutil.rmtree(model_dir("A"), ignore_errors=True)


@pytest.fixture
def fresh(checkpoint):
    """A has the checkpoint, B has none."""
    shutil.rmtree(model_dir("B"), ignore_errors=True)
    yield checkpoint
    shutil.rmtree(model_dir("B"), ignore_errors=True)


def sync(inv_path, **kw):
    return sync_model(load_inventory(inv_path), SyncOptions(**kw), None)


def files_of_A() -> int:
    """The checkpoint's files that sync sends: shards, index, config, tokenizer (not the hub's .cache/)."""
    root = model_dir("A")
    return sum(1 for p in root.rglob("*") if p.is_file() and p.relative_to(root).parts[0] != ".cache")


def shard(i: int) -> str:
    return shard_name(i, SHARDS)


def flip_byte_keep_mtime(path, offset=4096):
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_size, after.st_mtime_ns) == (st.st_size, st.st_mtime_ns)


def test_fresh_copy_verifies_equal_then_a_rerun_sends_nothing(fresh):
    r = inv_cmd("sync-model", "-i", str(fresh), "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(r.stdout)
    b = next(h for h in doc["data"]["hosts"] if h["host"] == "B")
    assert doc["ok"] and doc["data"]["verify"] == "content" and b["differences"] == [] and b["model_problems"] == []
    assert b["copy"]["send"] == files_of_A() and b["copy"]["bytes_sent"] >= SIZE_GB * 1e9
    assert not (model_dir("B") / ".cache" / "huggingface").exists()  # .cache/ never copied
    for name in os.listdir(model_dir("A")):
        if name != ".cache":
            assert (model_dir("B") / name).read_bytes() == (model_dir("A") / name).read_bytes()
    again = inv_cmd("sync-model", "-i", str(fresh))
    assert again.returncode == 0
    assert "nothing to send" in again.stdout and "hashed 0, cached" in again.stdout


def test_flipped_byte_is_caught_by_content_and_honestly_not_by_size(fresh):
    assert sync(fresh).ok
    flip_byte_keep_mtime(model_dir("B") / shard(3))
    by_size = sync(fresh, verify="size")
    assert by_size.differences["B"] == [] and any("names and sizes only" in n for n in by_size.notes)
    rep = sync(fresh)
    assert not rep.ok
    assert [(d.path, d.kind) for d in rep.differences["B"]] == [(shard(3), "content")]
    assert rep.copies["B"].plan.empty  # rsync's quick check would never have noticed


def test_missing_and_extra_are_named_and_repair_fixes_only_them(fresh):
    assert sync(fresh).ok
    os.remove(model_dir("B") / shard(5))
    flip_byte_keep_mtime(model_dir("B") / shard(2))
    (model_dir("B") / "model-00099-of-00099.safetensors").write_bytes(b"stale")
    untouched = {n: os.stat(model_dir("B") / n).st_ino for n in (shard(1), shard(4), shard(8))}
    rep = sync(fresh, verify="size", to="B")  # the plain copy puts the missing one back by itself
    assert [(d.path, d.kind) for d in rep.differences["B"]] == [("model-00099-of-00099.safetensors", "extra")]
    os.remove(model_dir("B") / shard(5))
    rep = sync(fresh, repair=True)
    assert rep.ok, rep.differences
    fixed = sorted(rep.repaired["B"])
    assert any(shard(2) in f and "content" in f for f in fixed)
    assert any("extra: model-00099-of-00099.safetensors" in f for f in fixed)
    sent = rep.copies["B"].bytes_sent
    one = os.stat(model_dir("A") / shard(1)).st_size
    assert 2 * one <= sent < 2.2 * one  # shard 5 (missing) and shard 2 (content): nothing else
    assert not (model_dir("B") / "model-00099-of-00099.safetensors").exists()
    assert {n: os.stat(model_dir("B") / n).st_ino for n in untouched} == untouched


def _kill_rsync_on_A():
    out = subprocess.run(["ip", "netns", "pids", f"{lab.NS_PREFIX}A"], capture_output=True, text=True).stdout.split()
    killed = 0
    for pid in out:
        try:
            if open(f"/proc/{pid}/comm").read().strip() == "rsync":
                os.kill(int(pid), 15)
                killed += 1
        except (OSError, ValueError):
            pass
    return killed


def test_a_copy_killed_midway_resumes_without_resending_finished_shards(fresh):
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("rep", sync(fresh, streams=1, bwlimit_mbps=40)))
    t.start()
    deadline = time.time() + 30
    while time.time() < deadline:  # wait until a few shards have landed completely
        done = [n for n in (model_dir("B").glob("lab-padding-*.safetensors") if model_dir("B").exists() else [])
                if n.stat().st_size == (model_dir("A") / n.name).stat().st_size
                and int(n.stat().st_mtime) == int((model_dir("A") / n.name).stat().st_mtime)]
        if len(done) >= 3:
            break
        time.sleep(0.1)
    assert _kill_rsync_on_A() >= 1
    t.join(60)
    first = result["rep"]
    assert not first.ok and first.copies["B"].errors and "run sync-model again" in first.hint
    finished = {p.name: (p.stat().st_ino, p.stat().st_ctime_ns) for p in model_dir("B").glob("lab-padding-*.safetensors")
                if p.stat().st_size == (model_dir("A") / p.name).stat().st_size
                and int(p.stat().st_mtime) == int((model_dir("A") / p.name).stat().st_mtime)}
    assert 3 <= len(finished) < SHARDS
    total = sum(p.stat().st_size for p in model_dir("A").iterdir() if p.is_file())
    already = sum((model_dir("B") / n).stat().st_size for n in finished)
    partial = sum(p.stat().st_size for p in model_dir("B").glob("model-*") if p.name not in finished)
    second = sync(fresh)
    assert second.ok, second.differences
    sent = second.copies["B"].bytes_sent
    assert sent <= total - already - partial + 1_000_000  # finished shards not re-sent, partial ones continued
    assert second.copies["B"].plan.resume  # the cut shard was continued, not restarted
    assert {n: (os.stat(model_dir("B") / n).st_ino, os.stat(model_dir("B") / n).st_ctime_ns)
            for n in finished} == finished


def _rsync_on_A():
    pids = subprocess.run(["ip", "netns", "pids", f"{lab.NS_PREFIX}A"], capture_output=True, text=True).stdout.split()
    return [p for p in pids if _comm(p) == "rsync"]


def _comm(pid):
    try:
        return open(f"/proc/{pid}/comm").read().strip()
    except OSError:
        return ""


def _bytes_on_B():
    return sum(f.stat().st_size for f in model_dir("B").glob("*")) if model_dir("B").exists() else 0


def test_ctrl_c_stops_the_copy_at_once_and_the_next_run_resumes(fresh):
    p = subprocess.Popen([sys.executable, "-m", "invoke", "sync-model", "--streams", "2", "--bwlimit", "20"],
                         cwd=ROOT, env=dict(os.environ, RAILYARD_INVENTORY=str(fresh)), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True, preexec_fn=as_a_terminal_job)
    wait_for(lambda: _bytes_on_B() > 20_000_000, "the copy under way")
    os.killpg(p.pid, signal.SIGINT)  # what the terminal sends the foreground job on ^C
    t0 = time.monotonic()
    _, err = p.communicate(timeout=30)
    assert p.returncode == 130 and time.monotonic() - t0 < 5 and "interrupted" in err and "Traceback" not in err
    wait_for(lambda: not _rsync_on_A(), "the streams on A to end with their connection", timeout=20)
    cut = _bytes_on_B()
    again = sync(fresh)  # not locked out by the interrupted run, and only the rest is sent
    assert again.ok, again.differences
    assert again.copies["B"].bytes_sent <= sum(f.stat().st_size for f in model_dir("A").iterdir()) - cut + 2_000_000


def test_a_rail_that_drops_mid_copy_fails_that_target_in_bounded_time(fresh):
    from railyard_lab import faults
    result = {}
    inv = load_inventory(fresh, ["sync_io_timeout_s=5"])
    t = threading.Thread(target=lambda: result.setdefault("rep", sync_model(inv, SyncOptions(streams=1, bwlimit_mbps=20),
                                                                            None)))
    t.start()
    try:
        wait_for(lambda: _bytes_on_B() > 10_000_000, "the copy under way")
        faults.fault("B", "link-down")  # the serving rail, which the copy runs over
        t0 = time.monotonic()
        t.join(60)
        assert not t.is_alive() and time.monotonic() - t0 < 30
    finally:
        faults.heal("B")
    rep = result["rep"]
    assert not rep.ok and any("stopped answering" in e for e in rep.copies["B"].errors), rep.copies["B"].errors
    assert "run sync-model again" in rep.hint
    again = sync(fresh)
    assert again.ok and again.copies["B"].plan.resume, again.differences


def test_a_corrupt_config_or_a_shard_missing_from_the_index_fails_the_model_check(fresh):
    cfg = model_dir("A") / "config.json"
    idx = model_dir("A") / "model.safetensors.index.json"
    saved_cfg, saved_idx = cfg.read_bytes(), idx.read_bytes()
    try:
        cfg.write_text('{"architectures": ["GlmMoeDsaForCausalLM"], ')
        rep = sync(fresh)
        assert not rep.ok and any("config.json does not parse" in p for p in rep.model["A"])
        cfg.write_bytes(saved_cfg)
        doc = json.loads(saved_idx)
        doc["weight_map"]["lm_head.weight"] = "model-00009-of-00008.safetensors"
        idx.write_text(json.dumps(doc))
        r = inv_cmd("sync-model", "-i", str(fresh), "--json")
        assert r.returncode == 1
        problems = {h["host"]: h["model_problems"] for h in json.loads(r.stdout)["data"]["hosts"]}
        assert problems["A"] == problems["B"] == ["the index names 1 shard(s) not present: model-00009-of-00008.safetensors"]
    finally:
        cfg.write_bytes(saved_cfg)
        idx.write_bytes(saved_idx)


def test_no_ssh_from_the_head_fails_before_copying(fresh):
    ak = lab_dir() / "hosts" / "B" / "home" / ".ssh" / "authorized_keys"
    saved = ak.read_text()
    try:
        ak.write_text(saved.splitlines()[0] + "\n")  # only the control machine may log in
        r = inv_cmd("sync-model", "-i", str(fresh))
        assert r.returncode == 1
        assert "cannot ssh non-interactively to B" in r.stdout and f"ssh-copy-id root@{lab.rail_net(1)}.12" in r.stdout
        assert not model_dir("B").exists()
    finally:
        ak.write_text(saved)


def test_dry_run_shows_the_pinned_download_and_changes_nothing(fresh):
    r = inv_cmd("sync-model", "-i", str(fresh), "--dry-run", "--set", "model_path=~/models/not-there")
    assert r.returncode == 0, r.stdout + r.stderr
    rev = load_inventory(fresh).head.vars["model_revision"]
    assert "docker run --rm --network host -v \"$HOME\"/models/not-there:/model --entrypoint bash" in r.stdout
    assert f"hf download railyard-lab/tiny-qwen3 --revision {rev} --local-dir /model" in r.stdout
    assert "nothing was changed" in r.stdout
    assert not (lab_dir() / "hosts" / "A" / "home" / "models" / "not-there").exists()
    plan = inv_cmd("sync-model", "-i", str(fresh), "--dry-run")
    assert plan.returncode == 0 and f"would send {files_of_A()} file(s)" in plan.stdout and "rsync -aH" in plan.stdout
    assert not model_dir("B").exists()


def test_usage_errors_exit_2(fresh):
    for args in (["--to", "A"], ["--verify", "md5"], ["--to", "Z"], ["--streams", "0"]):
        r = inv_cmd("sync-model", "-i", str(fresh), *args)
        assert r.returncode == 2 and r.stderr.startswith("error: ") and "Traceback" not in r.stderr, (args, r.stderr)


def test_a_hugging_face_cache_snapshot_is_copied_as_real_files_and_verified(lab_inventory, tmp_path):
    from .test_sync_unit import hf_snapshot
    home_a, home_b = (lab_dir() / "hosts" / h / "home" for h in ("A", "B"))
    snap = hf_snapshot(tmp_path)
    shutil.copytree(tmp_path / "hub", home_a / "hub", symlinks=True)
    rel = "~/" + str((home_a / "hub").joinpath(snap.relative_to(tmp_path / "hub")).relative_to(home_a))
    try:
        r = inv_cmd("sync-model", "-i", str(lab_inventory), "--set", f"model_path={rel}", timeout=180)
        assert r.returncode == 0 and "OK: copies equal" in r.stdout, r.stdout + r.stderr
        assert "download" not in r.stdout.lower()
        target = home_b / rel[2:]
        copied = {p.relative_to(target) for p in target.rglob("*") if p.is_file() and ".cache" not in p.parts}
        assert {p.relative_to(snap) for p in snap.rglob("*") if p.is_file()} <= copied
        assert not any(p.is_symlink() for p in target.rglob("*"))  # real files, not links into a cache B lacks
        assert (target / "original" / "params v2 (draft).json").read_text() == '{"dim": 1}'
    finally:
        shutil.rmtree(home_a / "hub", ignore_errors=True)
        shutil.rmtree(home_b / "hub", ignore_errors=True)
