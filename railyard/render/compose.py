"""A plan as a Docker Compose project, for users who run compose themselves: one service per
plan service (the same image, program, arguments, environment, GPUs by UUID, CPU set, mounts),
a healthcheck from each service's HTTP ready gates, and `depends_on: condition: service_healthy`
on every service of the stage before. No restart policy, as `inv launch` sets none: `inv recover` decides how a crashed
replica comes back (see railyard.layouts.replicas.recover). Secrets become compose secrets read at start (never in
the environment section); rendered files (the router's config) are written beside the file.

    files = render(plan)   # {relative path: content}; docker-compose.yml first
"""

from __future__ import annotations

import yaml

from ..plan.spec import LaunchPlan, Service
from . import walk
from .docker import refs
from .walk import value

COMPOSE_FILE = "docker-compose.yml"


def _healthcheck(svc: Service) -> dict | None:
    addr = walk.local_address(svc.spec.bind)
    urls = [f"http://{addr}:{port}{path}" for port, path in walk.http_gates(svc)]
    if not urls:
        return None
    probe = "; ".join(f"urllib.request.urlopen({u!r}, timeout=5).read()" for u in urls)
    return {"test": ["CMD", "python3", "-c", f"import urllib.request; {probe}"], "interval": "10s",
            "timeout": "10s", "retries": 360, "start_period": "60s"}


def _entry(plan: LaunchPlan, svc: Service) -> tuple[list[str], list[str]]:
    """entrypoint and command: the program itself, or its shell reading the secrets first."""
    words = walk.words(svc, refs(plan, svc))
    script = walk.entry(svc.spec, words, lambda s: f"/run/secrets/{_secret_name(s.env)}")
    if script is None:
        return [words[0]], words[1:]
    return [svc.spec.shell, "-c"], [script.replace("$", "$$")]  # $$: compose's own interpolation


def _secret_name(env: str) -> str:
    return env.lower().replace("_", "-")


def _local(path: str, plan: LaunchPlan, svc: Service) -> str:
    """Where a rendered file lives in the project folder."""
    return f"./{svc.name}/{path.rsplit('/', 1)[-1]}"


def render(plan: LaunchPlan) -> dict[str, str]:
    """Raises ValueError for a plan that spans hosts (a compose project runs on one)."""
    if len(plan.hosts()) != 1:
        raise ValueError(f"a compose project runs on one host; the {plan.layout} plan spans {', '.join(plan.hosts())}")
    services: dict[str, dict] = {}
    files: dict[str, str] = {}
    secrets: dict[str, dict] = {}
    for svc, before in walk.in_order(plan):
        spec = svc.spec
        entrypoint, command = _entry(plan, svc)
        doc: dict = {"image": spec.image, "container_name": spec.name, "entrypoint": entrypoint,
                     "command": command}
        if spec.host_network:
            doc["network_mode"] = "host"
        if spec.host_ipc:
            doc["ipc"] = "host"
        if spec.shm_size:
            doc["shm_size"] = spec.shm_size
        if spec.cpuset:
            doc["cpuset"] = spec.cpuset
        limits = {n: int(v) for n, v in spec.ulimits}
        if spec.rdma and spec.rdma.memlock_unlimited:
            limits["memlock"] = -1
        if limits:
            doc["ulimits"] = {n: {"soft": v, "hard": v} for n, v in limits.items()}
        if spec.rdma:
            doc["devices"] = list(spec.rdma.devices)
            if spec.rdma.ipc_lock:
                doc["cap_add"] = ["IPC_LOCK"]
        env = {k: value(v, refs(plan, svc)) for k, v in spec.env}
        if env:
            doc["environment"] = env
        mounted = {f.host_path.rsplit("/", 1)[0] for f in spec.files}
        vols = []
        for m in spec.mounts:
            if m.source in mounted:  # the folder of rendered files: this project's copy of it
                vols.append(f"./{svc.name}:{m.target}" + (":ro" if m.read_only else ""))
            else:
                vols.append(f"{m.source}:{m.target}" + (":ro" if m.read_only else ""))
        if vols:
            doc["volumes"] = vols
        for f in spec.files:
            files[_local(f.host_path, plan, svc)[2:]] = f.content
        if spec.secrets:
            doc["secrets"] = [_secret_name(s.env) for s in spec.secrets]
            for s in spec.secrets:
                secrets[_secret_name(s.env)] = {"file": s.host_file}
        if spec.gpus.count:
            dev: dict[str, object] = {"driver": "nvidia", "capabilities": ["gpu"]}
            dev.update({"device_ids": list(spec.gpus.uuids)} if spec.gpus.uuids else {"count": spec.gpus.count})
            doc["deploy"] = {"resources": {"reservations": {"devices": [dev]}}}
        if spec.labels:
            doc["labels"] = dict(spec.labels)
        hc = _healthcheck(svc)
        if hc:
            doc["healthcheck"] = hc
        if before:
            doc["depends_on"] = {b.name: {"condition": "service_healthy" if _healthcheck(b) else "service_started"}
                                 for b in before}
        services[svc.name] = doc
    project: dict = {"x-railyard": {"deployment": plan.deployment, "layout": plan.layout}, "services": services}
    if secrets:
        project["secrets"] = secrets
    head = (f"# Rendered by railyard from the {plan.layout} plan of {plan.deployment}: the same containers `inv "
            "launch` starts.\n# Run: docker compose up -d (secrets: the files named below, 0600, one value each).\n")
    return {COMPOSE_FILE: head + yaml.safe_dump(project, sort_keys=False, width=1000), **files}
