"""A service's env file: its facts and settings as KEY=value lines a POSIX shell can source,
kept locally under env/<deployment>/<host>.<service>.env and written 0600 on the host."""

from __future__ import annotations

from pathlib import Path

from ..serving.spec import LaunchPlan, Service
from ..transport import q


def render(plan: LaunchPlan, svc: Service) -> str:
    head = (f"# Rendered by railyard for host {svc.host}, service {svc.name} (layout {plan.layout}): do not edit\n"
            "# here, change the inventory and run `inv env`. Sourceable by a POSIX shell.\n")
    return head + "".join(f"{k}={q(v)}\n" for k, v in svc.env_file)


def local_path(root: Path, plan: LaunchPlan, svc: Service) -> Path:
    return root / plan.deployment / f"{svc.host}.{svc.name}.env"
