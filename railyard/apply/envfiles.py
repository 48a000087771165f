"""Env files: render one per service, compare with what each host has, write only what changed.

Locally they land in env/<deployment>/<host>.<service>.env (RAILYARD_ENV_DIR overrides env/),
for review and diffing; on the host at the service's env_path, 0600, atomically.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import CommandFailed
from ..render import envfile
from ..transport.runner import Runner
from ..plan.spec import LaunchPlan
from ..transport import read_remote, write_remote

LOCAL_ENV_DIR = "env"


@dataclass
class EnvFile:
    host: str
    service: str
    path: str  # on the host
    rendered: str
    current: str | None  # what the host has (None: missing)
    local: Path | None = None

    @property
    def changed(self) -> bool:
        return self.current != self.rendered

    def diff(self) -> str:
        old = (self.current or "").splitlines(keepends=True)
        return "".join(difflib.unified_diff(old, self.rendered.splitlines(keepends=True),
                                            f"{self.host}:{self.path}" if self.current is not None else "/dev/null",
                                            f"{self.host}:{self.path} (rendered)"))


def local_dir(path: str | os.PathLike | None = None) -> Path:
    return Path(path or os.environ.get("RAILYARD_ENV_DIR") or LOCAL_ENV_DIR)


def plan_env(plan: LaunchPlan, runner: Runner) -> list[EnvFile]:
    """Each service's env file, rendered, next to what its host has now (read in parallel)."""
    services = [s for s in plan.by_rank() if s.env_path]

    def current(s) -> dict[str, str | None]:
        return {svc.name: read_remote(s, svc.env_path) for svc in services if svc.host == s.host.name}

    got = runner.each(current, [runner.session(h).host for h in plan.report_hosts()])
    out = []
    for svc in services:
        if svc.host in got.failed:
            raise CommandFailed(got.failed[svc.host], "could not read the env file")
        have = got.ok[svc.host]
        out.append(EnvFile(svc.host, svc.name, svc.env_path, envfile.render(plan, svc), have[svc.name],
                           envfile.local_path(local_dir(), plan, svc)))
    return out


def write_local(files: list[EnvFile]) -> list[Path]:
    out = []
    for f in files:
        if f.local is None:
            raise ValueError(f"{f.host}: {f.service}: the env file has no local path")
        f.local.parent.mkdir(parents=True, exist_ok=True)
        f.local.write_text(f.rendered)
        f.local.chmod(0o600)
        out.append(f.local)
    return out


def apply_env(runner: Runner, files: list[EnvFile]) -> list[str]:
    written = []
    for f in files:
        if f.changed:
            write_remote(runner.session(f.host), f.path, f.rendered)
            written.append(f.host)
    return written
