"""sync-model's pure parts: comparing, planning, model checks, rsync commands and output."""

import hashlib
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from railyard.inventory import Host, Rail, load_inventory
from railyard.verbs.sync import (FileInfo, Manifest, check_model, diff, download_command, parse_bytes_sent,
                                 parse_manifest, parse_progress, plan_copy, rsync_command, split_streams)
from railyard_lab.checkpoint import write_checkpoint
from railyard.verbs.sync import MANIFEST_SCRIPT

from .conftest import ROOT, real

# the lab's real model (write_checkpoint) is made by the lab's vLLM venv, which `inv lab.up` installs
# (minutes, once per machine): the tests that write it run in the lab stage, where it is there
LAB_MODEL = pytest.mark.lab

import ipaddress


def m(host, files, **kw):
    return Manifest(host, True, {p: FileInfo(*v) for p, v in files.items()}, **kw)


def test_diff_names_every_kind():
    src = m("A", {"a": (10, 1, "x"), "b": (10, 1, "y"), "c": (10, 1, "z")})
    dst = m("B", {"a": (10, 1, "x"), "b": (10, 1, "Y"), "c": (9, 1, "z"), "d": (1, 1, "w")})
    kinds = {(d.path, d.kind) for d in diff(src, dst, "content")}
    assert kinds == {("b", "content"), ("c", "size"), ("d", "extra")}
    assert {(d.path, d.kind) for d in diff(src, dst, "size")} == {("c", "size"), ("d", "extra")}
    assert {(d.path, d.kind) for d in diff(src, m("B", {}), "size")} == {("a", "missing"), ("b", "missing"), ("c", "missing")}


def test_plan_copy_quick_check_resume_and_force():
    src = m("A", {"same": (100, 5), "newer": (100, 6), "short": (100, 5), "gone": (100, 5), "big": (50, 5)})
    dst = m("B", {"same": (100, 5), "newer": (100, 1), "short": (40, 9), "big": (80, 5), "x": (1, 1)})
    p = plan_copy(src, dst)
    assert p.equal == 1 and sorted(p.send) == ["big", "gone", "newer"] and p.resume == ["short"]
    assert p.bytes == 100 + 100 + 50 + 60 and p.extra == ["x"]
    forced = plan_copy(src, dst, force=["same"])
    assert "same" in forced.send and forced.equal == 0


def test_split_streams_balances_bytes():
    sizes = {f"s{i}": s for i, s in enumerate([90, 80, 70, 10, 10, 10, 5])}
    streams = split_streams(list(sizes), sizes, 3)
    loads = sorted(sum(sizes[p] for p in s) for s in streams)
    assert len(streams) == 3 and loads[-1] - loads[0] <= 20
    assert sorted(p for s in streams for p in s) == sorted(sizes)
    assert split_streams(["a"], {"a": 1}, 4) == [["a"]]


def test_model_checks_from_the_checkpoint_itself():
    v = {"model_path": "~/m", "model_architectures": ["GlmMoeDsaForCausalLM"], "model_quant_algo": "MIXED_PRECISION"}
    good_cfg = {"architectures": ["GlmMoeDsaForCausalLM"], "quantization_config": {"quant_algo": "MIXED_PRECISION"}}
    files = {"model-00001-of-00002.safetensors": (1, 1), "model-00002-of-00002.safetensors": (1, 1), "config.json": (1, 1)}
    idx = {"shards": ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]}
    assert check_model(m("A", files, config=good_cfg, index=idx), v) == []
    bad = check_model(m("A", files, config={"architectures": ["Other"], "quantization_config": {"quant_algo": "FP8"}},
                        index={"shards": idx["shards"] + ["model-00003-of-00002.safetensors"]}), v)
    assert any("architectures ['Other']" in p for p in bad) and any("quant_algo 'FP8'" in p for p in bad)
    assert any("not present: model-00003-of-00002.safetensors" in p for p in bad)
    assert check_model(m("A", files, config={"_error": "config.json: Expecting value"}, index=idx), v) == \
        ["config.json does not parse (Expecting value)"]
    assert "model.safetensors.index.json missing (several shards)" in check_model(m("A", files, config=good_cfg), v)
    assert check_model(Manifest("B", False, {}), v) == ["no checkpoint at ~/m"]


def test_progress_and_stats_from_real_rsync_output():
    text = real("rsync/progress2-stats-2files-local.txt")
    assert parse_progress(text) == 50_000_000
    assert parse_progress(text.split("(xfr#1")[0]) == 30_000_000
    assert parse_bytes_sent(text) == 50_012_353
    assert parse_bytes_sent("Total bytes sent: 1,234,567\n") == 1_234_567
    assert parse_progress("building file list ...\n") is None


def _host(user="root"):
    return Host("B", 1, "198.18.0.12", 22, user, "ssh", "", {"cx8r1": Rail("cx8r1", "mlx5_1",
                ipaddress.IPv4Interface("198.18.101.12/24"))}, {"cluster_serve_rail": "cx8r1"})


def test_rsync_command_flags_and_quoting():
    c = rsync_command("~/models/my model", _host(), "~/models/my model", "whole", "aes128-gcm@openssh.com", 0)
    assert c.startswith('cd "$HOME"/\'models/my model\' && rsync ')
    argv = shlex.split(c.split(" && ", 1)[1])
    for flag in ("--whole-file", "--no-compress", "--inplace", "--partial", "--files-from=-", "--from0", "--stats"):
        assert flag in argv
    assert argv[-1] == "root@198.18.101.12:models/my model/" and argv[-2] == "./"
    e = argv[argv.index("-e") + 1]
    assert "StrictHostKeyChecking=yes" in e and "BatchMode=yes" in e and "aes128-gcm@openssh.com" in e
    assert "--append-verify" in rsync_command("/m", _host(), "/m", "append", "c", 0)
    repair = rsync_command("/m", _host(), "/m", "repair", "c", 12.5)
    assert "--ignore-times" in repair and "--bwlimit=12500" in repair
    assert "--timeout" not in repair and "ServerAlive" not in repair


def test_a_stream_that_moves_nothing_gives_up_after_the_io_timeout():
    argv = shlex.split(rsync_command("/m", _host(), "/m", "whole", "c", 0, 40).split(" && ", 1)[1])
    assert "--timeout=40" in argv
    e = shlex.split(argv[argv.index("-e") + 1])
    assert "ServerAliveInterval=10" in e and "ServerAliveCountMax=4" in e and "ConnectTimeout=40" in e


def test_download_command_is_the_reference_one():
    v = {"model_repo": "nvidia/GLM-5.3-NVFP4", "model_revision": "a" * 40, "model_path": "~/models/GLM-5.3-NVFP4",
         "vllm_image": "vllm/vllm-openai:v0.30.0-aarch64@sha256:" + "b" * 64}
    c = download_command(v)
    assert "docker run --rm --network host -v \"$HOME\"/models/GLM-5.3-NVFP4:/model --entrypoint bash " in c
    assert c.endswith("-lc 'exec hf download nvidia/GLM-5.3-NVFP4 --revision " + "a" * 40 + " --local-dir /model'")


@LAB_MODEL
def test_manifest_script_on_a_real_tree(tmp_path):
    root = tmp_path / "model"
    write_checkpoint(root, 0.004, 3)
    run = lambda *a: json.loads(subprocess.run([sys.executable, "-", str(root), *a], input=MANIFEST_SCRIPT.read_text(),
                                               capture_output=True, text=True, check=True).stdout)
    size = run("size")
    assert ".cache/huggingface/download.lock" not in size["files"] and "config.json" in size["files"]
    assert all("sha256" not in f for f in size["files"].values())
    first = run("content")
    assert first["cache"]["hashed"] == len(first["files"]) and first["cache"]["hits"] == 0
    second = run("content")
    assert second["cache"]["hashed"] == 0 and second["files"] == first["files"]
    assert (root / ".cache" / "railyard" / "digests.json").exists()
    mf = parse_manifest("A", json.dumps(second))
    assert mf.index["shards"] == ["model.safetensors"]  # the index names the model's weights, not the padding
    assert {f"lab-padding-0000{i}-of-00003.safetensors" for i in (1, 2, 3)} <= set(mf.files)
    assert mf.config["architectures"] == ["Qwen3ForCausalLM"]
    assert run("content", "--rehash")["cache"]["hashed"] == len(first["files"])


def hf_snapshot(tmp_path) -> Path:
    """The layout `hf download` leaves in its cache: snapshots/<rev>/ holds symlinks into ../../blobs/,
    nested folders (original/) too, and unusual names."""
    repo = tmp_path / "hub" / "models--nvidia--GLM-5.3-NVFP4"
    flat = tmp_path / "flat"
    write_checkpoint(flat, 0.003, 2)
    (flat / "original").mkdir()
    (flat / "original" / "params v2 (draft).json").write_text('{"dim": 1}')
    snap = repo / "snapshots" / ("c0ffee" * 6 + "abcd")
    blobs = repo / "blobs"
    blobs.mkdir(parents=True)
    for f in sorted(flat.rglob("*")):
        if f.is_file() and ".cache" not in f.parts:
            rel = f.relative_to(flat)
            blob = blobs / hashlib.sha256(f.read_bytes()).hexdigest()
            blob.write_bytes(f.read_bytes())
            link = snap / rel
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(os.path.relpath(blob, link.parent))
    return snap


@LAB_MODEL
def test_a_hugging_face_cache_snapshot_is_a_checkpoint_read_through_its_links(tmp_path):
    snap = hf_snapshot(tmp_path)
    (snap / "dangling.safetensors").symlink_to("../../blobs/missing")
    assert all(p.is_symlink() for p in snap.glob("*.json"))
    doc = json.loads(subprocess.run([sys.executable, "-", str(snap), "content"], input=MANIFEST_SCRIPT.read_text(),
                                    capture_output=True, text=True, check=True).stdout)
    files = doc["files"]
    assert "config.json" in files and "original/params v2 (draft).json" in files and "dangling.safetensors" not in files
    for shard in ("model.safetensors", "lab-padding-00001-of-00002.safetensors"):
        assert files[shard]["size"] == (snap / shard).stat().st_size
        assert files[shard]["sha256"] == hashlib.sha256((snap / shard).read_bytes()).hexdigest()
    assert doc["config"]["architectures"] == ["Qwen3ForCausalLM"]


def test_rsync_copies_the_files_a_link_points_to():
    h = load_inventory(ROOT / "inventory" / "dgx-stations.yml").hosts[1]
    assert "--copy-links" in rsync_command("~/m", h, "~/m", "whole", "aes128-gcm@openssh.com", 0)


def test_the_bars_sum_every_stream_of_a_target_and_all_targets_as_rsync_reports_them():
    """The cli's bars, fed by the verb's Progress from several streams' threads as _copy_target feeds it:
    each target's bar is its streams' bytes (each capped at its share), the overall bar their sum."""
    import io
    import threading
    from rich.console import Console
    from railyard.cli.sync import View
    from railyard.verbs.sync import CopyPlan, Progress
    out = io.StringIO()
    plans = {"B": CopyPlan("B", send=["a", "b"], bytes=3000), "C": CopyPlan("C", send=["a"], bytes=1000),
             "D": CopyPlan("D", equal=2)}   # nothing to send: no bar of its own
    bars = View(Console(file=out, width=120, force_terminal=False)).bars(plans)
    progress = Progress(bars)
    with progress:
        feeds = [("B", (0,), 1200, 1500), ("B", (1,), 1500, 1500), ("B", (0,), 1600, 1500), ("C", (0,), 400, 1000)]
        threads = [threading.Thread(target=progress.update, args=f) for f in feeds]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    assert set(bars.tasks) == {"B", "C"}
    assert {t: bars.rich.tasks[i].completed for t, i in bars.tasks.items()} == {"B": 3000, "C": 400}
    assert bars.overall is not None and bars.rich.tasks[bars.overall].completed == 3400
    assert "-> B" in out.getvalue() and "all targets" in out.getvalue()
