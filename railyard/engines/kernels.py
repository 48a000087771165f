"""FlashInfer's precompiled kernels, staged for offline hosts (`vllm_kernels_path`).

vLLM 0.32 and later take FlashInfer's kernels from packages a first start otherwise downloads or compiles (its
`vllm download-kernels` installs flashinfer-cubin and flashinfer-jit-cache into the image's own environment, which
the next `docker run` does not keep). railyard stages them once, on sync-model's source, with the image's own pip
(scripts/stage_kernels.py run in the pinned image: the image says which FlashInfer and which CUDA), into a folder
that sync-model copies to every host like the checkpoint; every engine mounts the folder read-only at KERNELS_DIR
and finds the packages on its PYTHONPATH, where vLLM's own check (importlib: the distribution and its version)
looks for them.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..plan.spec import Mount
from ..transport import Result, RemotePath, Sh, cmd, q
from . import Prefetch, Staged

KERNELS_DIR = "/kernels"     # in the container, beside /model
STAGE_SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "stage_kernels.py"
INDEX_DIR = "/tmp/railyard-stage/index"  # where a host's own index folder is seen by the staging container
SCRIPT_REMOTE = "~/.cache/railyard/stage_kernels.py"
SCRIPT_IN = "/tmp/railyard-stage/stage_kernels.py"


def mounts(v: dict, home: str | None) -> tuple[Mount, ...]:
    """The kernels folder, read-only, for an engine's container ('' staged nothing: no mount)."""
    from ..facts.host import on_host
    path = v.get("vllm_kernels_path") or ""
    return (Mount(on_host(path, home), KERNELS_DIR, True, "staged"),) if path else ()


def env(v: dict) -> tuple[tuple[str, str], ...]:
    """PYTHONPATH to the mounted folder, ahead of one the inventory sets in vllm_extra_env."""
    if not v.get("vllm_kernels_path"):
        return ()
    theirs = str((v.get("vllm_extra_env") or {}).get("PYTHONPATH") or "")
    return (("PYTHONPATH", KERNELS_DIR + (f":{theirs}" if theirs else "")),)


def stage_command(v: dict) -> Sh:
    """Run on sync-model's source, in one round trip: scripts/stage_kernels.py (on stdin) written to SCRIPT_REMOTE,
    then run in the pinned image with the host's kernels folder mounted read-write (and a host folder given as the
    index, read-only)."""
    path = RemotePath(v["vllm_kernels_path"])
    index = str(v["vllm_kernels_index"])
    argv: list = ["docker", "run", "--rm", "--network", "host", "-v", Sh(q(path) + q(":" + KERNELS_DIR)),
                  "-v", Sh(q(RemotePath(SCRIPT_REMOTE)) + q(f":{SCRIPT_IN}:ro"))]
    if index.startswith("/"):
        argv += ["-v", f"{index}:{INDEX_DIR}:ro"]
        index = "file://" + INDEX_DIR
    argv += ["--entrypoint", "python3", v["vllm_image"], SCRIPT_IN, KERNELS_DIR, index]
    script = q(RemotePath(SCRIPT_REMOTE))
    return Sh(cmd("mkdir", "-p", Sh(q(path)), Sh(q(RemotePath(SCRIPT_REMOTE.rsplit("/", 1)[0]))))
              + f" && cat > {script} && " + cmd(*argv))


def prefetch(v: dict) -> Prefetch | None:
    """The kernels folder to stage, where the inventory names one."""
    if not v.get("vllm_kernels_path"):
        return None
    return Prefetch(v["vllm_kernels_path"], "FlashInfer's kernels", stage_command(v), STAGE_SCRIPT.read_bytes(),
                    parse_staged)


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
