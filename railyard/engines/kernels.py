"""FlashInfer's precompiled kernels, staged for offline hosts (`vllm_kernels_path`).

vLLM 0.32 and later take FlashInfer's kernels from packages a first start otherwise downloads or compiles (its
`vllm download-kernels` installs flashinfer-cubin and flashinfer-jit-cache into the image's own environment, which
the next `docker run` does not keep). railyard stages them once, on sync-model's source, with the image's own pip
(scripts/stage_kernels.py run in the pinned image: the image says which FlashInfer and which CUDA), into a folder
of vllm_kernels_path of the image's own (`folder`: named by its digest), which sync-model copies to every host like
the checkpoint; every engine mounts its image's folder read-only at KERNELS_DIR and finds the packages on its
PYTHONPATH, where vLLM's own check (importlib: the distribution and its version) looks for them. A new image's
kernels are staged beside the running one's, which its engines keep reading until they are rolled.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ..facts.host import on_host
from ..plan.spec import Mount
from ..transport import Result, RemotePath, Sh, cmd, q
from . import Prefetch, Staged

KERNELS_DIR = "/kernels"     # in the container, beside /model
STAGE_SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "stage_kernels.py"
INDEX_DIR = "/tmp/railyard-stage/index"  # where a host's own index folder is seen by the staging container
SCRIPT_REMOTE = "~/.cache/railyard/stage_kernels.py"
SCRIPT_IN = "/tmp/railyard-stage/stage_kernels.py"


def folder(v: dict) -> str:
    """The image's own folder in vllm_kernels_path: its digest's first 16 hex (an image pinned by digest, as
    vllm_image is), else a hash of its reference."""
    image = str(v["vllm_image"])
    digest = image.rsplit("@sha256:", 1)[1] if "@sha256:" in image else hashlib.sha256(image.encode()).hexdigest()
    return str(v["vllm_kernels_path"]).rstrip("/") + "/" + digest[:16]


def mounts(v: dict, home: str | None) -> tuple[Mount, ...]:
    """The image's kernels folder, read-only, for an engine's container ('' staged nothing: no mount)."""
    return (Mount(on_host(folder(v), home), KERNELS_DIR, True, "staged"),) if v.get("vllm_kernels_path") else ()


def env(v: dict) -> tuple[tuple[str, str], ...]:
    """PYTHONPATH to the mounted folder, ahead of one the inventory sets in vllm_extra_env."""
    if not v.get("vllm_kernels_path"):
        return ()
    theirs = str((v.get("vllm_extra_env") or {}).get("PYTHONPATH") or "")
    return (("PYTHONPATH", KERNELS_DIR + (f":{theirs}" if theirs else "")),)


def stage_command(v: dict) -> Sh:
    """Run on sync-model's source, in one round trip: scripts/stage_kernels.py (on stdin) written to SCRIPT_REMOTE,
    then run in the pinned image with the image's kernels folder mounted read-write (and a host folder given as the
    index, read-only)."""
    path = RemotePath(folder(v))
    index = str(v["vllm_kernels_index"])
    argv: list = ["docker", "run", "--rm", "--network", "host", "-v", Sh(q(path) + q(":" + KERNELS_DIR)),
                  "-v", Sh(q(RemotePath(SCRIPT_REMOTE)) + q(f":{SCRIPT_IN}:ro"))]
    if index.startswith("/"):
        argv += ["-v", f"{index}:{INDEX_DIR}:ro"]
        index = "file://" + INDEX_DIR
    argv += ["--entrypoint", "python3", v["vllm_image"], SCRIPT_IN, KERNELS_DIR, index, v["vllm_image"]]
    script = q(RemotePath(SCRIPT_REMOTE))
    return Sh(cmd("mkdir", "-p", Sh(q(path)), Sh(q(RemotePath(SCRIPT_REMOTE.rsplit("/", 1)[0]))))
              + f" && cat > {script} && " + cmd(*argv))


def prefetch(v: dict) -> Prefetch | None:
    """The kernels folder to stage, where the inventory names one."""
    if not v.get("vllm_kernels_path"):
        return None
    return Prefetch(v["vllm_kernels_path"], f"FlashInfer's kernels (in {folder(v).rsplit('/', 1)[1]}/, this image's)",
                    stage_command(v), STAGE_SCRIPT.read_bytes(), parse_staged)


def line(doc: dict) -> str:
    """One line of what a staging run did (scripts/stage_kernels.py's JSON)."""
    if doc.get("flashinfer") is None:
        return "the image holds no FlashInfer (flashinfer-python): no kernels to stage"
    what = ", ".join(f"{n} {v}" for n, v in (doc.get("packages") or {}).items())
    cuda = f", torch CUDA {doc['cuda']}" if doc.get("cuda") else ""
    return f"{what} for FlashInfer {doc['flashinfer']}{cuda}: " + ("staged" if doc.get("staged") == "now"
                                                                   else "already staged")


def parse_staged(r: Result) -> Staged:
    """The staging run's result: its JSON line, or why there is none (docker's own last line)."""
    if r.error:
        return Staged("", {}, f"{r.error.kind}: {r.error.message}")
    lines = [ln for ln in r.stdout.strip().splitlines() if ln.strip()]
    try:
        doc = json.loads(lines[-1]) if lines else None
    except ValueError:
        doc = None
    if r.rc != 0 or not isinstance(doc, dict):
        said = ((r.stderr or r.stdout).strip().splitlines() or ["no output"])[-1]
        return Staged("", {}, f"staging in the image failed (exit {r.rc}): {said}")
    return Staged(line(doc), doc, doc.get("error"))
