"""What railyard renders for each vLLM release it knows, one table per version, and where the version comes from.

Every fact below was read from that release's own files: the PyPI wheel `vllm-X.Y.Z-cp38-abi3-manylinux_2_28_x86_64.whl`,
whose `vllm/_version.py` names the tag's commit (v0.30.0 ced6857af, v0.32.0 5df63a720, v0.33.0 4ba787ec9), cited
as `path@vX.Y.Z`. The flags each version's `vllm serve` parser accepts are in tests/fixtures/vllm-versions/ (its
own parser, extracted; 0.32's also compared with the real engine's `--help=all`), and tests/test_vllm_versions.py
checks every rendered command against them.

The version: `vllm_version` in the inventory ("0.33" or "0.33.0"), else the tag of the pinned official image
(`vllm/vllm-openai:v0.30.0-aarch64@sha256:...`), else a problem asking to state it. A patch release renders from its
minor release's table (0.32.1 as 0.32). A setting the version no longer reads is a problem naming its replacement.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from ..inventory import rules

# The `vllm serve` flags railyard itself writes (engines/vllm.py's PARALLEL_FLAGS and TUNING_FLAGS, the multi-node
# and data-parallel group arguments of the layouts, --headless, --kv-transfer-config). Each is an option string of
# the v0.30.0, v0.32.0 and v0.33.0 parsers alike (vllm/engine/arg_utils.py EngineArgs.add_cli_args,
# vllm/entrypoints/openai/cli_args.py FrontendArgs, vllm/entrypoints/cli/serve.py; the extracted sets in
# tests/fixtures/vllm-versions/serve-flags-*.json).
RENDERED_FLAGS = frozenset({
    "--served-model-name", "--host", "--port", "--tensor-parallel-size", "--pipeline-parallel-size",
    "--data-parallel-size", "--enable-expert-parallel", "--all2all-backend", "--api-server-count",
    "--speculative-config", "--max-model-len", "--max-num-batched-tokens", "--block-size", "--max-num-seqs",
    "--kv-cache-dtype", "--gpu-memory-utilization", "--kernel-config", "--compilation-config",
    "--distributed-timeout-seconds", "--tool-call-parser", "--reasoning-parser", "--async-scheduling",
    "--nnodes", "--node-rank", "--master-addr", "--master-port", "--headless", "--data-parallel-size-local",
    "--data-parallel-address", "--data-parallel-rpc-port", "--data-parallel-start-rank", "--kv-transfer-config",
    "--enable-prefix-caching",
})

# The vLLM variables railyard's environment sets (engines/vllm.py NCCL_ENV and NCCL_SO_SETUP, the pd layout's NIXL
# side channel, the pd layout's default vllm_extra_env): each is a key of vllm/envs.py's environment_variables in
# v0.30.0, v0.32.0 and v0.33.0.
RENDERED_ENV = frozenset({
    "VLLM_ALLREDUCE_USE_FLASHINFER", "VLLM_ALLREDUCE_USE_SYMM_MEM", "VLLM_HOST_IP",
    "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "VLLM_ALLOW_LONG_MAX_MODEL_LEN", "VLLM_NCCL_SO_PATH",
    "VLLM_NIXL_SIDE_CHANNEL_HOST", "VLLM_NIXL_SIDE_CHANNEL_PORT", "VLLM_USE_V2_MODEL_RUNNER",
})

# Variables no 0.3x release reads, and what took their place. vllm/envs.py@v0.30.0, @v0.32.0 and @v0.33.0 define
# neither, and no file of those packages reads either name (searched); both flags are in each version's parser.
# Set, they change nothing and say nothing, hence a problem rather than a silent render.
ENV_REPLACED_0_3X = {
    "VLLM_ATTENTION_BACKEND": "--attention-backend (in vllm_extra_args)",
    "VLLM_ALL2ALL_BACKEND": "--all2all-backend (vllm_all2all_backend)",
    # the single 480 s abort timeout: gone from vllm/envs.py@v0.30.0 on; NIXL's lease replaced it
    # (kv_lease_duration in kv_connector_extra_config, read by nixl/base_worker.py@v0.30.0, default 30)
    "VLLM_NIXL_ABORT_REQUEST_TIMEOUT": "the NIXL lease, kv_lease_duration (pd_kv_lease_s)",
}

# --all2all-backend: ParallelConfig's All2AllBackend, the parser's choices (vllm/config/parallel.py)
_ALL2ALL_0_30 = ("naive", "pplx", "deepep_high_throughput", "deepep_low_latency", "deepep_v2",
                 "mori_high_throughput", "mori_low_latency", "nixl_ep", "allgather_reducescatter",
                 "flashinfer_all2allv", "flashinfer_nvlink_two_sided", "flashinfer_nvlink_one_sided")
_ALL2ALL_0_32 = _ALL2ALL_0_30 + ("moonep",)  # new in vllm/config/parallel.py@v0.32.0, still @v0.33.0


@dataclass(frozen=True)
class KvConnector:
    """The shape of one connector's --kv-transfer-config: its name, the module path at the JSON's root (None: not
    written; vLLM resolves the name through its KVConnectorFactory) and the keys railyard may set beside them."""

    name: str
    module_path: str | None
    root_keys: tuple[str, ...]
    extra_keys: tuple[str, ...]


# NixlConnector (vllm/distributed/kv_transfer/kv_connector/factory.py, registered in v0.30.0/v0.32.0/v0.33.0); kv_role,
# kv_buffer_device are KVTransferConfig fields (vllm/config/kv_transfer.py); kv_lease_duration is read from
# kv_connector_extra_config (nixl/base_worker.py: get_from_extra_config("kv_lease_duration", 30)) in all three.
NIXL = KvConnector("NixlConnector", None, ("kv_role", "kv_buffer_device"), ("kv_lease_duration",))
# LMCacheMPConnector: registered by vLLM's factory in all three (factory.py), and in all three the registered name
# already resolves to LMCache's own class, lmcache.integration.vllm.lmcache_mp_connector.LMCacheMPConnector, when the
# image's lmcache ships it, falling back silently to vLLM's builtin one otherwise
# (kv_connector/v1/lmcache_mp_connector.py: _resolve_lmcache_mp_connector, the same text @v0.30.0, @v0.32.0, @v0.33.0).
# `kv_connector_module_path` (a KVTransferConfig root field in all three) is therefore not needed by 0.33 either;
# railyard writes the name alone for every version, which renders 0.32 and 0.33 alike.
LMCACHE = KvConnector("LMCacheMPConnector", None, ("kv_role",), ("lmcache.mp.host", "lmcache.mp.port"))


@dataclass(frozen=True)
class VllmVersion:
    """What railyard renders for one vLLM release."""

    version: str                        # "0.32": the minor release; its patch releases render alike
    release: str                        # the release the facts were read from
    torch: str                          # Requires-Dist of the wheel's METADATA
    flashinfer: str
    flags: frozenset[str]               # the flags railyard renders that this version's parser takes
    env: frozenset[str]                 # the vLLM variables railyard sets that this version reads
    env_replaced: dict[str, str]        # a variable it no longer reads -> what replaced it (refused)
    all2all_backends: tuple[str, ...]   # --all2all-backend's choices
    all2all_removed: tuple[str, ...]    # accepted, then replaced by allgather_reducescatter with a log line only
    nixl: KvConnector
    lmcache: KvConnector
    # what a first start fetches unless it is staged (None: the image brings it)
    kernels_command: tuple[str, ...] | None
    # what differs from the previous table, each with why
    changes: tuple[str, ...] = field(default=())
    # the rendered words (flags, env names) that may differ from the previous table's renders, each for a change
    # above; tests/test_vllm_versions.py holds the goldens to it
    render_diff: frozenset[str] = field(default=frozenset())


TABLES: dict[str, VllmVersion] = {t.version: t for t in (
    VllmVersion(
        "0.30", "v0.30.0 (ced6857af)", torch="2.13.0", flashinfer="0.6.18.post1",
        flags=RENDERED_FLAGS, env=RENDERED_ENV, env_replaced=ENV_REPLACED_0_3X,
        all2all_backends=_ALL2ALL_0_30,
        # vllm/config/parallel.py@v0.30.0: "The '%s' all2all backend has been removed. Falling back to
        # 'allgather_reducescatter'." (a warning, nothing else)
        all2all_removed=("naive", "pplx"), nixl=NIXL, lmcache=LMCACHE,
        # no download-kernels subcommand in vllm/entrypoints/cli@v0.30.0
        kernels_command=None),
    VllmVersion(
        "0.32", "v0.32.0 (5df63a720)", torch="2.13.0", flashinfer="0.7.0.post1",
        flags=RENDERED_FLAGS, env=RENDERED_ENV, env_replaced=ENV_REPLACED_0_3X,
        all2all_backends=_ALL2ALL_0_32, all2all_removed=("naive", "pplx"),  # parallel.py@v0.32.0, same warning
        nixl=NIXL, lmcache=LMCACHE,
        # vllm/entrypoints/cli/download_kernels.py@v0.32.0: `vllm download-kernels` installs FlashInfer's
        # precompiled kernels (`python -m flashinfer download-kernels`, or install-cubin-wheel) that a start would
        # otherwise download or compile; FlashInfer's cubins are no longer a dependency of the wheel
        kernels_command=("vllm", "download-kernels"),
        changes=("--all2all-backend takes moonep too (vllm/config/parallel.py@v0.32.0): accepted by validation, "
                 "nothing rendered differs",
                 "FlashInfer kernels come from `vllm download-kernels` "
                 "(vllm/entrypoints/cli/download_kernels.py@v0.32.0): an offline host needs them staged")),
    VllmVersion(
        "0.33", "v0.33.0 (4ba787ec9)", torch="2.14.0", flashinfer="0.7.2.post1",
        flags=RENDERED_FLAGS, env=RENDERED_ENV, env_replaced=ENV_REPLACED_0_3X,
        all2all_backends=_ALL2ALL_0_32, all2all_removed=("naive", "pplx"),  # parallel.py@v0.33.0
        nixl=NIXL, lmcache=LMCACHE,
        kernels_command=("vllm", "download-kernels"),  # download_kernels.py@v0.33.0, the same file as 0.32's
        changes=("boolean flags pair --enable-x with --disable-x (vllm/utils/argparse_utils.py@v0.33.0 "
                 "EnableDisableAction); --no-enable-x is still accepted, hidden from --help. railyard renders "
                 "no negated flag: nothing rendered differs",
                 "torch 2.14.0 and FlashInfer 0.7.2.post1 (the wheel's METADATA): the image, not the command, "
                 "changes")),
)}

# The official image's tag: vllm/vllm-openai:v0.30.0, :v0.30.0-aarch64 (any registry or namespace before it).
_IMAGE_TAG_RE = re.compile(r"^(?:[^@]*/)?vllm-openai:v(?P<v>\d+\.\d+)(?:\.\d+)?(?:[-+][A-Za-z0-9_.-]*)?(?:@|$)")
VERSION_RE = re.compile(r"^(?P<v>\d+\.\d+)(?:\.\d+)?$")


def from_image(image: str) -> str | None:
    """The minor version an official image's tag names, or None.

        vllm/vllm-openai:v0.30.0-aarch64@sha256:4864... -> "0.30"     myorg/vllm:prod@sha256:... -> None"""
    m = _IMAGE_TAG_RE.match(image or "")
    return m.group("v") if m else None


def minor(stated: str) -> str | None:
    """"0.33" or "0.33.1" -> "0.33"; anything else None."""
    m = VERSION_RE.match(stated)
    return m.group("v") if m else None


def known() -> str:
    return ", ".join(TABLES)


def version_problem(values: dict[str, Any]) -> tuple[str, Any, str] | None:
    """(key, value, message) when no table can be chosen for these variables, else None."""
    stated = values.get("vllm_version") or ""
    if stated:
        m = minor(str(stated))
        if m is None:
            return "vllm_version", stated, 'not a vLLM version like "0.33" or "0.33.0" (quote it in YAML)'
        if m not in TABLES:
            return "vllm_version", stated, f"railyard has no table for vLLM {m} (it renders for {known()})"
        return None
    image = values.get("vllm_image") or ""
    m = from_image(image)
    if m is None:
        return "vllm_version", "", (f"required: vllm_image's tag ({image or 'none'}) names no vLLM version; state "
                                    f'it, like vllm_version: "0.33" (railyard renders for {known()})')
    if m not in TABLES:
        return "vllm_image", image, (f"its tag is vLLM {m}, which railyard has no table for (it renders for "
                                     f"{known()}); pin one of those, or state vllm_version")
    return None


def for_vars(values: dict[str, Any]) -> VllmVersion:
    """The table for a host's variables (validated first: see version_problem)."""
    stated = values.get("vllm_version") or ""
    m = minor(str(stated)) if stated else from_image(values.get("vllm_image") or "")
    if m is None or m not in TABLES:
        raise ValueError(version_problem(values) or ("vllm_version", stated, "no table"))
    return TABLES[m]


def replaced_settings(values: dict[str, Any], table: VllmVersion) -> list[tuple[str, Any, str]]:
    """(key, value, message) for each setting this version no longer reads, naming what replaced it."""
    out = []
    for name in values.get("vllm_extra_env") or {}:
        if name in table.env_replaced:
            out.append(("vllm_extra_env", name, f"vLLM {table.version} does not read {name} (set, it is silently "
                                                f"ignored): use {table.env_replaced[name]} instead"))
    return out


def host_problems(values: dict[str, Any]) -> list[tuple[str, Any, str]]:
    """The inventory's check (rules.VALUE_CHECKS): no table for the vLLM these values run, or a setting that version
    no longer reads, naming its replacement."""
    why = version_problem(values)
    return [why] if why else replaced_settings(values, for_vars(values))


if host_problems not in rules.VALUE_CHECKS:
    rules.VALUE_CHECKS.append(host_problems)
