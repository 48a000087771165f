"""The rules a host's values and the cluster follow, as data: the names, patterns, allowed values and
ranges that `validate` reads. A rule's message is the text of its problem line.

Types are not here: a value must have the type of its role default (`validate._type_ok`)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

# Keys that only make sense for one host.
HOST_ONLY_KEYS = {"ansible_host", "rank", "rails"}
RAIL_KEYS = {"hca", "ipv4"}
# serve_layout's values: each registered layout's name -> the cluster-wide variables it compares itself (pd's
# pools may differ in TP and ports). The layout registry (railyard.plan.layout) writes it as each layout class
# registers; the inventory sits below the layouts and reads it, never importing them. A program that loads an
# inventory imports railyard.layouts first (the task layer's `load` does, and the tests' conftest).
LAYOUTS: dict[str, tuple[str, ...]] = {}
# Checks an engine adds to every host's values, each returning (key, value, message) problems: the vLLM version's
# table (railyard.engines.vllm_versions) registers one as it is imported. Like LAYOUTS, the inventory never imports
# the engines that register here (the task layer and the tests' conftest import railyard.layouts, which imports them).
VALUE_CHECKS: list[Callable[[dict[str, Any]], list[tuple[str, Any, str]]]] = []
# Values that must be the same on every host for a multi-node launch to work.
CLUSTER_WIDE = (
    "serve_layout", "cluster_serve_rail", "model_path", "model_revision", "model_repo", "vllm_image",
    "vllm_port", "vllm_master_port", "vllm_tensor_parallel_size", "preflight_mtu",
)

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
CONTAINER_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{1,62}$")  # docker's [a-zA-Z0-9][a-zA-Z0-9_.-]+
IFACE_RE = re.compile(r"^[A-Za-z0-9_.-]{1,15}$")
HCA_RE = re.compile(r"^[A-Za-z0-9_]{1,32}$")
IMAGE_RE = re.compile(r"^[a-z0-9][a-z0-9._/:-]*(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?@sha256:[0-9a-f]{64}$")
REVISION_RE = re.compile(r"^[0-9a-f]{40}$")
CPUSET_RE = re.compile(r"^\d+(-\d+)?(,\d+(-\d+)?)*$")
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
HOSTNAME_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]{0,252}[A-Za-z0-9])?$")
SSH_CIPHER_RE = re.compile(r"^[A-Za-z0-9@._-]+$")
_WORD = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


@dataclass(frozen=True)
class Match:
    """A string value that must match `regex` (`re.match`: the pattern anchors itself)."""

    regex: re.Pattern[str]
    message: str
    optional: bool = False  # only a non-empty string is checked ("" and a null mean unset)
    or_ip: bool = False  # an IP address passes too


# Strings that become an address to bind or dial, a docker size, a name in a container name or a
# program's option value: refused before SSH when they cannot be one (they are quoted regardless).
ADDRESS_KEYS = ("vllm_bind", "litellm_bind", "lmcache_host", "lmcache_http_host", "pd_proxy_bind")
# Checked in this order, after the host's rails, its GPU name and its image.
STRING_RULES: dict[str, Match] = {
    "vllm_container": Match(CONTAINER_RE, "not a container name: letters, digits, _ . - (docker's rule), up to 63"),
    **{k: Match(HOSTNAME_RE, "not an IP address or host name", optional=True, or_ip=True) for k in ADDRESS_KEYS},
    **{k: Match(re.compile(r"^\d+[bkmgBKMG]?[bB]?$"), "not a size like 32g", optional=True)
       for k in ("vllm_shm_size", "lmcache_shm_size")},
    **{k: Match(_WORD, "not a name: letters, digits, _ . - (it is part of container names)", optional=True)
       for k in ("litellm_container_suffix", "lmcache_container_suffix")},
    **{k: Match(_WORD, "not a value vLLM takes: letters, digits, _ . -", optional=True)
       for k in ("vllm_kv_cache_dtype", "vllm_tool_call_parser", "vllm_reasoning_parser", "vllm_all2all_backend",
                 "model_quant_algo", "lmcache_eviction_policy", "litellm_routing_strategy", "pd_proxy_policy")},
    "ansible_user": Match(re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,31}$"), "not a user name", optional=True),
    "model_repo": Match(re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9_.-]+)?$"),
                        "not a model id like org/name (it is the served model name)", optional=True),
    "cluster_gpu_name": Match(re.compile(r"^[A-Za-z0-9 _.-]{1,64}$"), "not a GPU name like GB300 or H200",
                              optional=True),
    "model_revision": Match(REVISION_RE, "must be a pinned 40-hex commit hash"),
    "vllm_kernels_index": Match(re.compile(r"^(https?://[^\s'\"]+|/[^\s'\"]*)$"),
                                "not a package index: an http(s):// URL or a host's absolute folder"),
    # the vLLM the image runs, where its tag does not say (railyard.engines.vllm_versions: one table per version)
    "vllm_version": Match(re.compile(r"^\d+\.\d+(\.\d+)?$"), 'not a vLLM version like "0.33" or "0.33.0" (quote it '
                          "in YAML: 0.30 unquoted is the number 0.3)", optional=True),
}
SSH_CIPHER = Match(SSH_CIPHER_RE, "not an SSH cipher name")

# Values that are one of a few words: the problem reads "must be a or b".
ONE_OF: dict[str, tuple[str, ...]] = {
    "ansible_connection": ("ssh", "local"),
    "sync_verify": ("size", "content"),
    "sync_transport": ("ssh", "rsyncd"),
}
# vllm_cpuset: one of these words, or a CPU list (CPUSET_RE)
CPUSET_WORDS = ("", "auto")

PORT_RANGE = (1, 65535)  # ansible_port
# Numbers within [lo, hi], checked in this order (last of a host's checks).
RANGES: dict[str, tuple[int | float, int | float]] = {
    "preflight_mtu": (576, 9216), "preflight_link_speed_mbps": (1, 10_000_000),
    "preflight_max_clock_skew_ms": (1, 3_600_000), "preflight_disk_margin_gb": (0, 100_000),
    "preflight_ping_count": (1, 20), "preflight_gid_index": (-1, 255),
    "ssh_connect_timeout": (1, 600), "ssh_command_timeout": (1, 86_400), "ssh_keepalive_s": (1, 600), "ssh_parallel": (1, 512),
    "model_size_gb": (0, 100_000), "vllm_port": (1, 65535), "vllm_master_port": (1, 65535),
    "vllm_tensor_parallel_size": (1, 1024), "vllm_gpu_memory_utilization": (0.01, 1.0),
    "vllm_pipeline_parallel_size": (1, 1024), "vllm_data_parallel_size": (1, 1024),
    "vllm_api_server_count": (0, 1024), "vllm_hung_after_s": (1, 110), "cluster_gpus_per_host": (1, 64),
    "nccl_check_timeout_s": (10, 86_400), "nccl_check_min_link_fraction": (0.0, 1.0),
    "sync_streams": (1, 64), "sync_bwlimit_mbps": (0, 1_000_000), "sync_timeout_s": (1, 604_800),
    "sync_io_timeout_s": (5, 86_400), "sync_rsyncd_port": (0, 65535), "pd_kv_lease_s": (0, 86_400),
    "recover_restart_budget": (1, 1000), "recover_budget_window_s": (1, 604_800),
    "rdma_test_duration_s": (1, 3600), "rdma_test_qps": (1, 64), "rdma_test_size": (2, 1 << 30),
    "rdma_test_port": (1024, 65000), "rdma_test_min_fraction": (0.0, 1.0), "rdma_test_min_gpu_ratio": (0.0, 1.0),
    "rdma_test_max_lat_us": (0.1, 100_000),
}


def one_of_message(allowed: tuple[str, ...]) -> str:
    return f"must be {' or '.join(allowed)}"
