"""FlashInfer's kernels staged for offline hosts (vllm_kernels_path): the staging script run by a real pip against a
real (local) package index, every layout's engines mounting the folder on their PYTHONPATH, the inventory checks.

The staging script runs under this machine's Python standing in for the image's: a folder on its PYTHONPATH holds
the distribution metadata of flashinfer-python (and a torch package whose CUDA is 12.9), which is all the script
reads of them. The wheels in the index are made here (names, versions and layout as FlashInfer publishes them; no
kernels in them): what this proves is what pip --target and importlib make of them, as vLLM reads them
(importlib.metadata's version, find_spec), not that FlashInfer's own kernels load."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from railyard.engines import STAGED_MARK, kernels
from railyard.facts.gpu import Gpu
from railyard.facts.host import HostFacts
from railyard.inventory import load_inventory
from railyard.plan import layout as layouts
from railyard.render import docker
from railyard.transport import Result

from .conftest import inv_cmd
from .test_export import CASES, FIXTURES, INV

FI = "0.7.0.post1"


def wheel(index: Path, dist: str, version: str, files: dict[str, str], sub: str = "") -> None:
    """A wheel as FlashInfer's are named, in a folder laid out as a package index (PEP 503: one folder per project,
    an index.html linking its files)."""
    name = dist.replace("-", "_")
    di = f"{name}-{version}.dist-info"
    entries = dict(files)
    entries[f"{di}/METADATA"] = f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n"
    entries[f"{di}/WHEEL"] = "Wheel-Version: 1.0\nGenerator: railyard-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    record = [f"{k},sha256={base64.urlsafe_b64encode(hashlib.sha256(v.encode()).digest()).rstrip(b'=').decode()},"
              f"{len(v.encode())}" for k, v in entries.items()]
    entries[f"{di}/RECORD"] = "\n".join(record + [f"{di}/RECORD,,"]) + "\n"
    folder = index / sub / dist
    folder.mkdir(parents=True, exist_ok=True)
    fn = f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(folder / fn, "w") as z:
        for k, v in entries.items():
            z.writestr(k, v)
    links = "".join(f'<a href="{p.name}">{p.name}</a>\n' for p in sorted(folder.glob("*.whl")))
    (folder / "index.html").write_text(f"<html><body>\n{links}</body></html>\n")


def image_env(tmp: Path, flashinfer: str | None, cuda: str | None) -> Path:
    """The stand-in image's site: flashinfer-python's metadata at a version, and torch reporting a CUDA."""
    site = tmp / f"site-{flashinfer}-{cuda}"
    if flashinfer:
        di = site / f"flashinfer_python-{flashinfer}.dist-info"
        di.mkdir(parents=True)
        (di / "METADATA").write_text(f"Metadata-Version: 2.1\nName: flashinfer-python\nVersion: {flashinfer}\n")
    if cuda:
        (site / "torch").mkdir(parents=True)
        (site / "torch" / "__init__.py").write_text(f"class version:\n    cuda = {cuda!r}\n")
    site.mkdir(parents=True, exist_ok=True)
    return site


def stage(site: Path, dest: Path, index: Path) -> dict:
    dest.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PYTHONPATH=str(site), PIP_CONFIG_FILE=os.devnull)   # this machine's pip config is not the image's
    r = subprocess.run([sys.executable, str(kernels.STAGE_SCRIPT), str(dest), f"file://{index}"], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def seen(dest: Path) -> dict:
    """What a Python with the staged folder on its PYTHONPATH finds, as vLLM 0.32's vllm/utils/flashinfer.py asks
    it (importlib.metadata.version of each distribution, find_spec of flashinfer_cubin)."""
    code = ("import importlib.metadata as m, importlib.util as u, json\n"
            "def v(d):\n    try:\n        return m.version(d)\n    except m.PackageNotFoundError:\n        return None\n"
            "print(json.dumps({'cubin': v('flashinfer-cubin'), 'jit': v('flashinfer-jit-cache'), "
            "'spec': u.find_spec('flashinfer_cubin') is not None}))")
    r = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(dest)}, capture_output=True,
                       text=True, timeout=60)
    return json.loads(r.stdout)


@pytest.fixture
def index(tmp_path):
    idx = tmp_path / "index"
    for v in (FI, "0.7.2.post1"):
        wheel(idx, "flashinfer-cubin", v, {"flashinfer_cubin/__init__.py": "", f"flashinfer_cubin/cubins/{v}.cubin": v})
        wheel(idx, "flashinfer-jit-cache", f"{v}+cu129", {"flashinfer_jit_cache/__init__.py": ""}, sub="cu129")
    return idx


def test_the_image_flashinfer_and_cuda_choose_what_is_staged_and_python_then_finds_it_at_that_version(tmp_path, index):
    dest = tmp_path / "kernels"
    out = stage(image_env(tmp_path, FI, "12.9"), dest, index)
    assert (out["staged"], out["packages"]) == ("now", {"flashinfer-cubin": FI, "flashinfer-jit-cache": FI}), out
    assert seen(dest) == {"cubin": FI, "jit": f"{FI}+cu129", "spec": True}
    assert json.loads((dest / STAGED_MARK).read_text())["flashinfer"] == FI
    # the same image again: its record is there, nothing is installed
    assert stage(image_env(tmp_path / "again", FI, "12.9"), dest, index)["staged"] == "already"
    # a new image's FlashInfer replaces the folder: the old version's files are gone, not beside the new
    out = stage(image_env(tmp_path, "0.7.2.post1", "12.9"), dest, index)
    assert out["staged"] == "now" and seen(dest)["cubin"] == "0.7.2.post1"
    assert not list(dest.glob(f"*{FI}*")) and not (dest / ".railyard-new").exists()


def test_torch_before_cuda_12_9_gets_the_cubins_alone_as_flashinfer_publishes_no_jit_cache_for_it(tmp_path, index):
    dest = tmp_path / "kernels"
    out = stage(image_env(tmp_path, FI, "12.8"), dest, index)
    assert out["packages"] == {"flashinfer-cubin": FI} and seen(dest) == {"cubin": FI, "jit": None, "spec": True}


def test_an_image_that_holds_the_cubins_at_its_version_needs_none_staged(tmp_path, index):
    """vLLM before 0.32 depended on flashinfer-cubin: such an image lacks nothing, and its folder says so."""
    site = image_env(tmp_path, FI, "12.8")
    di = site / f"flashinfer_cubin-{FI}.dist-info"
    di.mkdir()
    (di / "METADATA").write_text(f"Metadata-Version: 2.1\nName: flashinfer-cubin\nVersion: {FI}\n")
    dest = tmp_path / "kernels"
    out = stage(site, dest, index)
    assert (out["staged"], out["packages"]) == ("none", {}) and [p.name for p in dest.iterdir()] == [STAGED_MARK]
    written = (dest / STAGED_MARK).stat().st_mtime_ns
    assert stage(site, dest, index)["staged"] == "none"
    assert (dest / STAGED_MARK).stat().st_mtime_ns == written   # not rewritten: a copy to the targets sends nothing


def test_an_image_without_flashinfer_empties_the_folder_and_records_that_nothing_is_needed(tmp_path, index):
    dest = tmp_path / "kernels"
    stage(image_env(tmp_path, FI, "12.9"), dest, index)
    out = stage(image_env(tmp_path, None, None), dest, index)
    assert out == {"flashinfer": None, "cuda": None, "packages": {}, "image": "", "staged": "none", "error": None}
    assert [p.name for p in dest.iterdir()] == [STAGED_MARK] and seen(dest)["cubin"] is None


def test_a_version_the_index_lacks_is_pips_own_error_and_the_folder_keeps_what_it_held(tmp_path, index):
    dest = tmp_path / "kernels"
    stage(image_env(tmp_path, FI, "12.9"), dest, index)
    out = stage(image_env(tmp_path, "0.7.9", "12.9"), dest, index)
    assert out["staged"] == "none" and out["error"].startswith("pip install exit 1: ERROR: "), out
    assert "0.7.9" in out["error"] and seen(dest)["cubin"] == FI


def test_the_staging_result_is_read_from_its_json_line_or_docker_s_last_line():
    ok = kernels.parse_staged(Result("A", "", 0, 'noise\n{"flashinfer": "0.7.0.post1", "cuda": "12.9", "packages": '
                                                  '{"flashinfer-cubin": "0.7.0.post1"}, "staged": "now", "error": null}\n',
                                     "", 1.0))
    assert ok.line == "flashinfer-cubin 0.7.0.post1 for FlashInfer 0.7.0.post1, torch CUDA 12.9: staged"
    bad = kernels.parse_staged(Result("A", "", 125, "", "docker: Error response from daemon: No such image: x.\n"
                                                      "See 'docker run --help'.\n", 1.0))
    assert bad.error == "staging in the image failed (exit 125): See 'docker run --help'."


def _plan(layout: str, *extra: str):
    name, overrides = CASES[layout]
    inv = load_inventory(INV / name if "/" not in name else FIXTURES / name, list(overrides) + list(extra))
    lay = layouts.validated(inv)
    _, count = lay.needs(inv)
    facts = {h.name: HostFacts(h, home="/home/u", gpus=[Gpu(i, f"GPU-{h.name}-{i}", h.vars["cluster_gpu_name"], 0, 1000)
                                                        for i in range(count)], gid_index=3,
                               cpus_by_gpu={i: [i] for i in range(count)}) for h in lay.hosts(inv)}
    return lay.plan(inv, facts)


@pytest.mark.parametrize("layout", list(CASES))
def test_every_engine_of_every_layout_mounts_the_staged_folder_read_only_on_its_pythonpath(layout):
    plan = _plan(layout, "vllm_kernels_path=~/fi-kernels", "vllm_extra_env={PYTHONPATH: /opt/mine}")
    engines = [s for s in plan.services() if any(m.kind == "model" for m in s.spec.mounts)]
    assert engines
    for svc in engines:
        argv = docker.run_argv(plan, svc)
        digest = svc.spec.image.rsplit("@sha256:", 1)[1]   # the image's own folder: another image's is not seen
        assert f"/home/u/fi-kernels/{digest[:16]}:/kernels:ro" in argv, argv
        assert [m.kind for m in svc.spec.mounts if m.target == "/kernels"] == ["staged"]
        assert dict(svc.spec.env)["PYTHONPATH"] == "/kernels:/opt/mine"
    plain = _plan(layout)
    assert not any(m.kind == "kernels" for s in plain.services() for m in s.spec.mounts)
    assert not any(k == "PYTHONPATH" for s in plain.services() for k, _ in s.spec.env)


@pytest.mark.parametrize("value,why", [
    ("fi-kernels", "all.children.stations.vars.vllm_kernels_path = 'fi-kernels': must be an absolute path or start "
                   'with ~/, or ""'),
    ("~/models/GLM-5.3-NVFP4", "all.children.stations.vars.vllm_kernels_path = '~/models/GLM-5.3-NVFP4': must not be "
                               "model_path"),
])
def test_a_kernels_folder_that_cannot_be_one_is_refused_naming_file_and_key_before_any_ssh(tmp_path, value, why):
    data = yaml.safe_load((INV / "dgx-stations.yml").read_text())
    data["all"]["children"]["stations"]["vars"]["vllm_kernels_path"] = value
    path = tmp_path / "inv.yml"
    path.write_text(yaml.safe_dump(data))
    r = inv_cmd("sync-model", "-i", str(path), "--dry-run")   # the example's addresses are never contacted
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert why in r.stderr and str(path) in r.stderr, r.stderr


def test_the_staging_docker_run_parses_with_the_real_docker_cli():
    from .test_plan import docker_parses
    line = str(kernels.stage_command({"vllm_kernels_path": "~/fi-kernels", "vllm_kernels_index": "/srv/flashinfer-whl",
                                      "vllm_image": "vllm/vllm-openai:v0.32.0@sha256:" + "b" * 64}))
    docker_parses(line.rsplit(" && ", 1)[1])
