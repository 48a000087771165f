"""The LiteLLM proxy in front of a layout's replicas: its config rendered from the plan, its
command line, and its authenticated /health parsed.

Facts (LiteLLM 1.108.7, measured here: ../docs components notes): with no master key the proxy
refuses to start; /health/liveliness and /health/readiness answer without auth and do not
reflect the replicas; GET /health (auth) calls every replica and lists healthy_endpoints and
unhealthy_endpoints; the CLI reads HOST and PORT from the environment, so both are passed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib.resources import files

import yaml

CONFIG_TARGET = "/etc/litellm"           # the folder the container sees: config.yaml, the drain filter
MASTER_KEY_TARGET = "/run/secrets/litellm-master-key"
DRAIN_MODULE = "railyard_drain"
LIVE_PATH = "/health/liveliness"
READY_PATH = "/health/readiness"


@dataclass(frozen=True)
class LitellmConfig:
    image: str
    bind: str
    port: int
    num_workers: int
    routing_strategy: str
    num_retries: int
    allowed_fails: int
    cooldown_time_s: int
    health_check_interval_s: int
    request_timeout_s: float
    master_key_file: str

    @classmethod
    def from_vars(cls, v: dict) -> "LitellmConfig":
        return cls(image=v["litellm_image"], bind=v["litellm_bind"], port=int(v["litellm_port"]),
                   num_workers=int(v["litellm_num_workers"]), routing_strategy=v["litellm_routing_strategy"],
                   num_retries=int(v["litellm_num_retries"]), allowed_fails=int(v["litellm_allowed_fails"]),
                   cooldown_time_s=int(v["litellm_cooldown_time_s"]),
                   health_check_interval_s=int(v["litellm_health_check_interval_s"]),
                   request_timeout_s=float(v["litellm_request_timeout_s"]), master_key_file=v["litellm_master_key_file"])


@dataclass(frozen=True)
class Backend:
    id: str        # model_info.id: the replica's service name (r0, r1, ...)
    api_base: str  # http://127.0.0.1:8001/v1


def config_yaml(c: LitellmConfig, model: str, backends: list[Backend]) -> str:
    """One model group of that name, one deployment per replica; retries, cooldown, background health
    checks with health-check routing, the master key from the environment, railyard's drain filter."""
    doc = {
        "model_list": [{"model_name": model,
                        "litellm_params": {"model": f"hosted_vllm/{model}", "api_base": b.api_base, "api_key": "none"},
                        "model_info": {"id": b.id}} for b in backends],
        "router_settings": {"routing_strategy": c.routing_strategy, "num_retries": c.num_retries,
                            "allowed_fails": c.allowed_fails, "cooldown_time": c.cooldown_time_s},
        "litellm_settings": {"callbacks": [f"{DRAIN_MODULE}.drain"],
                             **({"request_timeout": c.request_timeout_s} if c.request_timeout_s else {})},
        "general_settings": {"master_key": "os.environ/LITELLM_MASTER_KEY", "background_health_checks": True,
                             "health_check_interval": c.health_check_interval_s,
                             "enable_health_check_routing": True},
    }
    return ("# Rendered by railyard from the plan: do not edit here, change the inventory and run `inv launch`.\n"
            + yaml.safe_dump(doc, sort_keys=False))


def drain_module() -> str:
    return files("railyard").joinpath("roles", "litellm", "files", f"{DRAIN_MODULE}.py").read_text()


def proxy_command(c: LitellmConfig) -> tuple[str, ...]:
    return ("litellm", "--config", f"{CONFIG_TARGET}/config.yaml", "--host", c.bind, "--port", str(c.port),
            "--num_workers", str(c.num_workers))


@dataclass(frozen=True)
class RouterHealth:
    healthy: tuple[str, ...]            # model ids
    unhealthy: dict[str, str]           # model id -> error (first line)


def parse_health(text: str) -> RouterHealth:
    """GET /health of the proxy (authenticated): healthy_endpoints and unhealthy_endpoints, each with
    model_id (what model_info.id says) and, for unhealthy ones, error. Raises ValueError otherwise."""
    doc = json.loads(text)
    if not isinstance(doc, dict) or "healthy_endpoints" not in doc:
        raise ValueError("not a LiteLLM /health document")

    def mid(e: dict) -> str:
        return str(e.get("model_id") or (e.get("model_info") or {}).get("id") or e.get("api_base") or "?")

    return RouterHealth(tuple(mid(e) for e in doc["healthy_endpoints"]),
                        {mid(e): str(e.get("error") or "").strip().splitlines()[0][:200] if e.get("error") else ""
                         for e in doc.get("unhealthy_endpoints") or []})
