"""FlashInfer's kernels staged for offline hosts (vllm_kernels_path) in the lab: sync-model stages the folder on A in
the pinned image (the lab's image; real docker run flags, the lab's docker runs it), copies it to B over real rsync and
SSH and proves it equal by sha256; a launch refuses a host whose folder was never staged and mounts a staged one
read-only at /kernels; and the real vLLM 0.32 (the lab's CPU build) finds kernels staged by real pip at their version,
by its own check.

The lab's images hold no FlashInfer (no CUDA here): staging there records that nothing is needed. The staging with
packages to install runs against a package index of wheels made here (tests/test_kernels.py), since the lab has no
network: FlashInfer's own wheels are not fetched."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

import railyard_lab as lab
from railyard.engines import STAGED_MARK
from railyard_lab import components
from railyard_lab.checkpoint import write_checkpoint

from .conftest import home, inv_cmd, on, remove_containers
from .test_kernels import FI, image_env, stage, wheel

pytestmark = pytest.mark.lab
NAME = "glm53-full"
KERNELS = ("--set", "vllm_kernels_path=~/fi-kernels")
IMAGE, NEXT = f"{lab.LAB_IMAGE_NAME}@{lab.LAB_IMAGE_DIGEST}", f"{lab.LAB_IMAGE_NEXT}@{lab.LAB_IMAGE_NEXT_DIGEST}"
KEY, NEXT_KEY = lab.LAB_IMAGE_DIGEST[7:23], lab.LAB_IMAGE_NEXT_DIGEST[7:23]   # each image's own folder: its digest


@pytest.fixture(scope="module")
def stations(lab_inventory):
    write_checkpoint(home("A") / "models" / "tiny-qwen3", 0.002, 2)
    yield lab_inventory
    remove_containers(NAME)
    for h in ("A", "B"):
        for d in ("models", "fi-kernels"):
            shutil.rmtree(home(h) / d, ignore_errors=True)
        (home(h) / "glm53.env").unlink(missing_ok=True)


def staged(r) -> list[dict]:
    return [c for c in json.loads(r.stdout)["checks"] if c["check"] == "staged"]


def test_sync_model_stages_the_folder_in_the_image_and_proves_each_copy_equal(stations):
    for h in ("A", "B"):
        shutil.rmtree(home(h) / "fi-kernels", ignore_errors=True)
    r = inv_cmd("sync-model", "--json", "-i", str(stations), *KERNELS)
    assert r.returncode == 0, r.stdout + r.stderr
    a, b = staged(r)
    assert (a["host"], a["status"]) == ("A", "pass") and "the image holds no FlashInfer" in a["detail"], a
    assert (b["host"], b["status"]) == ("B", "pass") and "equal to A's by sha256" in b["detail"], b
    for h in ("A", "B"):
        assert json.loads((home(h) / "fi-kernels" / KEY / STAGED_MARK).read_text()) == {
            "cuda": None, "flashinfer": None, "packages": {}, "image": IMAGE}
    # what B holds beyond A's folder goes (a stale dist-info, another image's folder); a record changed on B is
    # sent again; then both are A's again
    stale = home("B") / "fi-kernels" / KEY / "flashinfer_cubin-0.6.0.dist-info"
    stale.mkdir()
    (stale / "METADATA").write_text("old\n")
    (home("B") / "fi-kernels" / "0123456789abcdef").mkdir()
    (home("B") / "fi-kernels" / "0123456789abcdef" / STAGED_MARK).write_text("{}")
    (home("B") / "fi-kernels" / KEY / STAGED_MARK).write_text("{}")
    r = inv_cmd("sync-model", "--json", "-i", str(stations), *KERNELS)
    assert r.returncode == 0 and staged(r)[1]["status"] == "pass", r.stdout
    assert sorted(p.name for p in (home("B") / "fi-kernels").iterdir() if p.name != ".cache") == [KEY]
    assert [p.name for p in (home("B") / "fi-kernels" / KEY).iterdir()] == [STAGED_MARK]
    assert (home("B") / "fi-kernels" / KEY / STAGED_MARK).read_text() == \
        (home("A") / "fi-kernels" / KEY / STAGED_MARK).read_text()


def test_a_launch_refuses_an_unstaged_folder_and_mounts_a_staged_one_read_only_on_pythonpath(stations):
    remove_containers(NAME)
    missing = ("--set", "vllm_kernels_path=~/fi-never-staged")
    assert inv_cmd("env", "-i", str(stations), *missing).returncode == 0
    r = inv_cmd("launch", "-i", str(stations), *missing, "--timeout", "60")
    assert r.returncode != 0 and "nothing staged (no railyard-staged.json)" in r.stderr, r.stdout + r.stderr
    assert f"A (/root/fi-never-staged/{KEY}), B (/root/fi-never-staged/{KEY})" in r.stderr, r.stderr
    assert "inv sync-model" in r.stderr
    assert on("A", f"docker ps -a --format '{{{{.Names}}}}' | grep -cx {NAME}").stdout.strip() == "0"
    assert inv_cmd("sync-model", "-i", str(stations), *KERNELS).returncode == 0
    assert inv_cmd("env", "-i", str(stations), *KERNELS).returncode == 0
    r = inv_cmd("launch", "-i", str(stations), *KERNELS, "--timeout", "60")
    assert r.returncode == 0, r.stdout + r.stderr
    for h in ("A", "B"):
        doc = json.loads(on(h, f"docker inspect {NAME}").stdout)[0]
        assert f"/root/fi-kernels/{KEY}:/kernels:ro" in doc["HostConfig"]["Binds"]
        assert "PYTHONPATH=/kernels" in doc["Config"]["Env"]
        seen = on(h, f"docker exec {NAME} cat /kernels/{STAGED_MARK}").stdout   # the container's own view
        assert json.loads(seen)["image"] == IMAGE, seen


def test_roll_to_a_new_image_stages_its_folder_beside_the_running_one_and_mounts_it(stations):
    """The old image's folder is not touched while its engines run (the new one is staged in a folder of its own),
    and the rolled engines mount the new image's."""
    old = {h: (home(h) / "fi-kernels" / KEY / STAGED_MARK).stat().st_mtime_ns for h in ("A", "B")}
    dry = inv_cmd("roll", "-i", str(stations), *KERNELS, "--image", NEXT, "--dry-run")
    assert dry.returncode == 0 and f"stage FlashInfer's kernels (in {NEXT_KEY}/, this image's)" in dry.stdout, dry.stdout
    r = inv_cmd("roll", "-i", str(stations), *KERNELS, "--image", NEXT, "--json", timeout=600)
    doc = json.loads(r.stdout)
    assert r.returncode == 0, doc["data"]
    assert any(d["step"].startswith("staged for the new image on every host: the image holds no FlashInfer")
               for d in doc["data"]["done"]), doc["data"]["done"]
    for h in ("A", "B"):
        assert json.loads((home(h) / "fi-kernels" / NEXT_KEY / STAGED_MARK).read_text())["image"] == NEXT
        assert (home(h) / "fi-kernels" / KEY / STAGED_MARK).stat().st_mtime_ns == old[h]
        assert f"/root/fi-kernels/{NEXT_KEY}:/kernels:ro" in json.loads(on(h, f"docker inspect {NAME}").stdout)[0][
            "HostConfig"]["Binds"]
    remove_containers(NAME)


def test_the_real_vllm_finds_kernels_staged_by_pip_at_their_version(tmp_path):
    """vLLM 0.32's own check (vllm/utils/flashinfer.py: has_flashinfer_cubin, and the versions
    warn_if_flashinfer_kernels_missing compares with flashinfer-python's), run by the lab's real vLLM with the staged
    folder on its PYTHONPATH, as an engine container has it."""
    index = tmp_path / "index"
    wheel(index, "flashinfer-cubin", FI, {"flashinfer_cubin/__init__.py": "", "flashinfer_cubin/cubins/k.cubin": "k"})
    wheel(index, "flashinfer-jit-cache", f"{FI}+cu129", {"flashinfer_jit_cache/__init__.py": ""}, sub="cu129")
    dest = tmp_path / "kernels"
    assert stage(image_env(tmp_path, FI, "12.9"), dest, index)["staged"] == "now"
    python = components.venv("vllm") / "bin" / "python"
    code = ("from vllm.utils.flashinfer import has_flashinfer_cubin, _installed_version\n"
            "print(has_flashinfer_cubin(), _installed_version('flashinfer-cubin'), "
            "_installed_version('flashinfer-jit-cache'))")
    r = subprocess.run([str(python), "-c", code], env={"PYTHONPATH": str(dest), "PATH": "/usr/bin:/bin"},
                       capture_output=True, text=True, timeout=300)
    assert r.stdout.split() == ["True", FI, FI], r.stdout + r.stderr[-2000:]
    r = subprocess.run([str(python), "-c", code], env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
                       timeout=300)
    assert r.stdout.split() == ["False", "None", "None"], r.stdout + r.stderr[-2000:]   # without it: none
