"""A service's env file: its facts and settings as KEY=value lines a POSIX shell can source,
kept locally under env/<deployment>/<host>.<service>.env and written 0600 on the host."""

from __future__ import annotations

from pathlib import Path

from ..plan.spec import LaunchPlan, Service
from . import templates


def render(plan: LaunchPlan, svc: Service) -> str:
    return templates.render("vllm", "service.env.j2", host=svc.host, service=svc.name, layout=plan.layout,
                            values=svc.env_file)


def local_path(root: Path, plan: LaunchPlan, svc: Service) -> Path:
    return root / plan.deployment / f"{svc.host}.{svc.name}.env"
