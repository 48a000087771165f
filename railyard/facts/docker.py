"""Docker facts: the daemon (`docker version`), the pinned image (`docker image inspect`), and the container
model on a host: inspect, logs, uptime. Parsers are pure."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from . import ParseError
from .probe import Section
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


# ---------------------------------------------------------------- preflight: docker version, docker image inspect

DOCKER_TIMEOUT = 15


def version_section() -> Section:
    """`docker version`: the daemon answers only where it runs and the user may reach it."""
    return Section("docker_version", cmd("docker", "version"), "docker", DOCKER_TIMEOUT)


def image_section(image: str) -> Section:
    """One `image inspect` for the pinned reference and its tag (a JSON array of those found, an error line for
    each one missing); no docker command answers this and `version` both."""
    return Section("image", cmd("docker", "image", "inspect", image, image.split("@", 1)[0]), "docker", DOCKER_TIMEOUT)


@dataclass(frozen=True)
class DockerVersion:
    client: str | None
    server: str | None
    error: str | None


def parse_docker_version(text: str) -> DockerVersion:
    """`docker version`: a Client section, then a Server section only when the daemon answered."""
    client = server = err = None
    section = None
    for line in text.splitlines():
        if line.startswith("Client"):
            section = "client"
        elif line.startswith("Server"):
            section = "server"
        elif line.strip().startswith("Version:"):
            v = line.split(":", 1)[1].strip()
            if section == "client" and client is None:
                client = v
            elif section == "server" and server is None:
                server = v
        elif ("Cannot connect to the Docker daemon" in line or "permission denied" in line
              or "Error response from daemon" in line or line.startswith("error during connect")):
            err = line.strip()
    return DockerVersion(client, server, err)


@dataclass(frozen=True)
class DockerImage:
    id: str
    repo_digests: list[str]
    repo_tags: list[str]
    architecture: str
    os: str
    env: tuple[str, ...] = ()  # Config.Env, `KEY=value`

    def env_value(self, key: str) -> str | None:
        return next((e.split("=", 1)[1] for e in self.env if e.split("=", 1)[0] == key and "=" in e), None)

    def digests(self) -> set[str]:
        return {d.split("@", 1)[1] for d in self.repo_digests if "@" in d}


def parse_image_inspect(text: str) -> list[DockerImage]:
    """`docker image inspect REF [REF...]`: one JSON array of the refs found, in order (`[]` when none; the
    CLI prints `Error response from daemon: No such image: REF` on stderr for each one missing, exit 1)."""
    start = text.find("[")
    if start < 0:
        raise ParseError("no JSON array")
    try:
        docs, _ = json.JSONDecoder().raw_decode(text[start:])
    except ValueError as e:
        raise ParseError(f"bad JSON: {e}") from None
    return [DockerImage(d.get("Id", ""), d.get("RepoDigests") or [], d.get("RepoTags") or [],
                        d.get("Architecture", ""), d.get("Os", ""), tuple((d.get("Config") or {}).get("Env") or ()))
            for d in docs]
