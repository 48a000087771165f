#!/usr/bin/env python3
"""Stage FlashInfer's precompiled kernels for the FlashInfer of the Python that runs this (the pinned image's).

    python3 stage_kernels.py DEST INDEX [IMAGE]

What vLLM 0.32 and later looks for (vllm/utils/flashinfer.py: has_flashinfer_cubin, warn_if_flashinfer_kernels_missing):
the distribution flashinfer-cubin, and flashinfer-jit-cache where torch's CUDA is 12.9 or later (FlashInfer publishes
it from there on, under INDEX/cu129 and the like), each at flashinfer-python's own version: FlashInfer refuses, or
ignores, kernels of another version. What the image lacks at that version (vLLM before 0.32 depended on
flashinfer-cubin: such an image lacks nothing) is installed with this Python's pip (or uv) into DEST/.railyard-new
(--target: the image's own environment is not touched), which then replaces DEST's content; DEST/MARK records what
DEST holds (IMAGE: the image it was staged for, as railyard names it), and a DEST whose record is this
image's is left as it is. Prints one JSON line; exit 0 unless it could
not write DEST. Standard library only, Python 3.8+.
"""

import importlib.metadata as md
import importlib.util
import json
import os
import shutil
import subprocess
import sys

MARK = "railyard-staged.json"  # railyard.engines.STAGED_MARK
NEW = ".railyard-new"


def installed(dist):
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def torch_cuda():
    try:
        import torch
    except ImportError:
        return None
    return torch.version.cuda


def installer():
    if importlib.util.find_spec("pip") is not None:
        return [sys.executable, "-m", "pip", "install", "--no-input", "--disable-pip-version-check"]
    uv = shutil.which("uv")
    return [uv, "pip", "install", "--python", sys.executable] if uv else None


def replace_content(dest, new):
    for entry in os.listdir(dest):
        if entry == NEW:
            continue
        path = os.path.join(dest, entry)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.remove(path)
    for entry in os.listdir(new):
        os.rename(os.path.join(new, entry), os.path.join(dest, entry))
    os.rmdir(new)


def record(dest, held):
    with open(os.path.join(dest, MARK), "w") as f:
        json.dump(held, f, sort_keys=True)


def wanted(version, cuda, index):
    """{distribution: the index URL it is read from} of what the image lacks at its FlashInfer's version."""
    base = index.rstrip("/")
    urls = {"flashinfer-cubin": base + "/"}
    if cuda and tuple(int(x) for x in cuda.split(".")[:2]) >= (12, 9):
        urls["flashinfer-jit-cache"] = f"{base}/cu{''.join(cuda.split('.')[:2])}/"
    # an image that holds one at that version already (vLLM before 0.32 depended on flashinfer-cubin) needs none
    return {name: url for name, url in urls.items() if (installed(name) or "").split("+")[0] != version}


def main(dest, index, image=""):
    version = installed("flashinfer-python")
    cuda = torch_cuda() if version else None
    urls = wanted(version, cuda, index) if version else {}
    held = {"flashinfer": version, "cuda": cuda, "packages": {name: version for name in urls}, "image": image}
    out = dict(held, staged="none", error=None)
    try:
        with open(os.path.join(dest, MARK)) as f:
            if json.load(f) == held:   # staged for this image already (or nothing to stage, and so recorded)
                out["staged"] = "already" if urls else "none"
                return out
    except (OSError, ValueError):
        pass
    new = os.path.join(dest, NEW)
    shutil.rmtree(new, ignore_errors=True)
    os.mkdir(new)
    if urls:
        pip = installer()
        if pip is None:
            out["error"] = "the image has neither pip nor uv to install the kernels with"
            return out
        first, *more = urls.values()
        argv = pip + ["--no-deps", "--target", new, "--index-url", first]
        for url in more:
            argv += ["--extra-index-url", url]
        r = subprocess.run(argv + [f"{name}=={version}" for name in urls], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, universal_newlines=True)
        if r.returncode != 0:
            shutil.rmtree(new, ignore_errors=True)
            lines = [ln.strip() for ln in r.stdout.splitlines() if ln.strip()]
            said = next((ln for ln in reversed(lines) if ln.startswith("ERROR")), lines[-1] if lines else "no output")
            tool = "pip" if pip[0] == sys.executable else "uv pip"
            out["error"] = f"{tool} install exit {r.returncode}: {said}"
            return out
        out["staged"] = "now"
    replace_content(dest, new)   # an image that needs nothing: an emptied folder whose record says so
    record(dest, held)
    return out


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:4])))
