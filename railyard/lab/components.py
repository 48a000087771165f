"""Real components the lab runs instead of stand-ins: the LMCache server, the LiteLLM proxy and the
vLLM router (vllm-project/router, the Rust prefill/decode router); and, made only when
benchmarks/fanout.py asks for it, ansible-core for its comparison.

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
# resolve to a CUDA wheel and its ~4 GB of nvidia-* libraries); lmcache leaves torch unpinned.
COMPONENTS = {
    "lmcache": ("torch==2.13.0+cpu", "lmcache==0.5.6"),
    "litellm": ("litellm[proxy]==1.108.7",),
    "vllm-router": ("vllm-router==0.1.17",),  # a Rust wheel (23 MB; the venv ~130 MB, ~10 s)
    "ansible": ("ansible-core==2.19.14",),  # benchmarks/fanout.py's comparison only: made on demand
}
ON_DEMAND = {"ansible"}  # not made by lab.up
# the program each venv provides, as the lab image's bin runs it
PROGRAMS = {"lmcache": "lmcache", "litellm": "litellm", "vllm-router": "vllm-router", "ansible": "ansible-playbook"}


def venvs_dir() -> Path:
    return Path(os.environ.get(VENVS_ENV) or DEFAULT_VENVS)


def venv(name: str) -> Path:
    return venvs_dir() / name


def program(name: str) -> Path:
    return venv(name) / "bin" / PROGRAMS[name]


def _spec(name: str) -> str:
    return "\n".join(COMPONENTS[name]) + "\n"


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
    _run([str(d / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check", *reqs], name)
    if not program(name).exists():
        raise LabError(f"lab: installing {name}: {program(name)} is missing after pip install")
    (d / MARKER).write_text(_spec(name))
    log(f"lab: {name} installed in {time.monotonic() - t0:.0f} s")
    return d


def ensure_all(log=print) -> dict[str, Path]:
    return {name: ensure(name, log) for name in COMPONENTS if name not in ON_DEMAND}
