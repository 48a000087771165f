#!/usr/bin/python3 -SI
"""`litellm` in the lab's LiteLLM image: the real proxy (the lab's litellm venv), started the way the
image would start it, offline. A file the container was given by a bind mount outside /tmp and /run
(`-v HOSTDIR:/etc/litellm:ro`, `--config /etc/litellm/config.yaml`) is not mounted for real in the
lab: --config is mapped through the container's binds to the file on the host. Standard library only."""

import json
import os
import sys

VENV_LITELLM = "@LITELLM@"  # written by lab.up


def host_path(path):
    """A path inside the container -> the file on the host (the longest bind that holds it)."""
    cdir = os.environ.get("RAILYARD_LAB_CONTAINER")
    if not cdir:
        return path
    try:
        with open(os.path.join(cdir, "config.json")) as f:
            binds = json.load(f)["HostConfig"]["Binds"]
    except (OSError, ValueError, KeyError):
        return path
    best = None
    for b in binds:
        parts = b.split(":")
        if len(parts) < 2:
            continue
        src, dst = parts[0], parts[1].rstrip("/") or "/"
        if (path == dst or path.startswith(dst + "/")) and (best is None or len(dst) > len(best[1])):
            best = (src, dst)
    return best[0] + path[len(best[1]):] if best else path


def main():
    args = sys.argv[1:]
    for i, a in enumerate(args):
        if a in ("--config", "-c") and i + 1 < len(args):
            args[i + 1] = host_path(args[i + 1])
        elif a.startswith("--config="):
            args[i] = "--config=" + host_path(a.split("=", 1)[1])
    env = dict(os.environ)
    # offline: the bundled model cost map (no fetch from GitHub), no telemetry or feedback prompts
    env.update(LITELLM_LOCAL_MODEL_COST_MAP="True", LITELLM_TELEMETRY="False", DO_NOT_TRACK="1",
               LITELLM_DONT_SHOW_FEEDBACK_BOX="True", HF_HUB_OFFLINE="1", PYTHONNOUSERSITE="1")
    env.pop("PYTHONPATH", None)  # the image's site dir is the stand-ins', not LiteLLM's
    os.execve(VENV_LITELLM, [VENV_LITELLM] + args, env)


if __name__ == "__main__":
    main()
