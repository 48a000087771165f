"""The docker container model on a host: inspect, logs, uptime. Parsers are pure."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from ..errors import LaunchError
from ..transport import Session, cmd


@dataclass
class Container:
    host: str
    exists: bool
    running: bool = False
    status: str = "missing"
    config: str = ""
    started: str = ""
    image: str = ""
    exit_code: int = 0
    pid: int = 0


def parse_inspect(host: str, text: str) -> Container:
    """`docker inspect --format '{{json .}}' NAME` -> Container (the first document)."""
    try:
        doc = json.loads(text.strip().splitlines()[0])
        st = doc["State"]
    except (ValueError, IndexError, KeyError, TypeError):
        raise LaunchError(f"{host}: unexpected `docker inspect` output: {text.strip()[:200]}") from None
    labels = (doc.get("Config") or {}).get("Labels") or {}
    return Container(host, True, bool(st.get("Running")), st.get("Status", "?"), labels.get("railyard.config", ""),
                     st.get("StartedAt", ""), doc.get("Image", ""), int(st.get("ExitCode") or 0), int(st.get("Pid") or 0))


def inspect(s: Session, name: str) -> Container:
    r = s.run(cmd("docker", "inspect", "--format", "{{json .}}", name), timeout=30)
    if r.error:
        raise LaunchError(f"{s.host.name}: {r.error.kind}: {r.error.message}")
    if r.rc != 0:
        if "No such" in r.stderr:
            return Container(s.host.name, False)
        raise LaunchError(f"{s.host.name}: docker inspect failed: {r.stderr.strip() or r.stdout.strip()}")
    return parse_inspect(s.host.name, r.stdout)


def log_tail(s: Session, name: str, lines: int | None = 20) -> str:
    argv = ["docker", "logs"] + (["--tail", lines] if lines else []) + [name]
    r = s.run(cmd(*argv) + " 2>&1", timeout=30)
    return r.stdout if not r.error else f"({r.error.message})"


def uptime(stamp: str) -> float | None:
    """Seconds since docker's StartedAt (`2026-12-01T08:24:27.123Z`)."""
    try:
        t = time.mktime(time.strptime(stamp[:19], "%Y-%m-%dT%H:%M:%S")) - time.timezone
        return round(max(0.0, time.time() - t), 1)
    except (ValueError, TypeError):
        return None
