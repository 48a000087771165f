"""Variables in layers, each value with its origin: the roles' and layouts' defaults, `--set`, and
`merge_vars`, the one place precedence lives."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import yaml

from ..errors import InventoryError, Problem, UsageError
from .model import Host

# railyard/roles and railyard/layouts: this file is railyard/inventory/vars.py
ROLES_DIR = Path(__file__).resolve().parent.parent / "roles"
LAYOUTS_DIR = Path(__file__).resolve().parent.parent / "layouts"

# Connection variables in Ansible's spelling, settable at any level.
CONNECTION_DEFAULTS: dict[str, Any] = {
    "ansible_user": "",
    "ansible_port": 22,
    "ansible_connection": "ssh",
    "ansible_ssh_private_key_file": "",
}


@dataclass
class Layer:
    """One source of variables: where it came from and its values."""

    file: str
    keypath: str
    values: dict[str, Any]


def role_layers(roles_dir: Path = ROLES_DIR) -> list[Layer]:
    """The connection defaults, then each role's defaults file: the lowest layers, in that order."""
    from .load import _read_yaml  # imported when called: the loader builds on this module
    problems: list[Problem] = []
    if not roles_dir.is_dir():
        raise UsageError(f"{roles_dir}: roles directory not found (is railyard installed from its checkout?)")
    layers = [Layer("(connection defaults)", "", dict(CONNECTION_DEFAULTS))]
    for f in sorted(roles_dir.glob("*/defaults/main.yml")):
        layers.append(Layer(str(f), "", _read_yaml(f, problems) or {}))
    if problems:
        raise InventoryError(problems)
    return layers


def layout_layers(layouts_dir: Path = LAYOUTS_DIR) -> dict[str, list[Layer]]:
    """Each layout's own defaults (`layouts/<package>/<layout>.yml`, beside its plan), by layout name."""
    from .load import _read_yaml  # imported when called: the loader builds on this module
    problems: list[Problem] = []
    out: dict[str, list[Layer]] = {}
    for f in sorted(layouts_dir.glob("*/*.yml")):
        out.setdefault(f.stem, []).append(Layer(str(f), "", _read_yaml(f, problems) or {}))
    if problems:
        raise InventoryError(problems)
    return out


def merge_vars(layers: Iterable[Layer]) -> tuple[dict[str, Any], dict[str, tuple[str, str]]]:
    """The one place variable precedence lives: later layers win.

    Layers come in this order: role defaults < group vars (all, then outer to inner
    groups) < host vars < command line. Returns the values and, for each name, the
    (file, key path) it was last set at, so a problem can name where to fix it.
    """
    values: dict[str, Any] = {}
    origins: dict[str, tuple[str, str]] = {}
    for layer in layers:
        for k, v in layer.values.items():
            values[k] = v
            origins[k] = (layer.file, f"{layer.keypath}.{k}" if layer.keypath else k)
    return values, origins


def parse_overrides(pairs: Iterable[str] | None) -> Layer:
    """`--set KEY=VALUE` pairs; VALUE is read as YAML (`--set preflight_mtu=1500` is an int)."""
    values: dict[str, Any] = {}
    for pair in pairs or ():
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"--set {pair!r}: expected KEY=VALUE")
        try:
            values[key.strip()] = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            values[key.strip()] = raw
    return Layer("--set", "", values)


def origin_of(h: Host, key: str) -> tuple[str, str]:
    """Where a host's variable was last set, for a problem line."""
    return h.origins.get(key, ("(defaults)", key))


def set_by_default(h: Host, key: str) -> bool:
    """Only railyard's own defaults set this value (a role's or the layout's file), not the inventory or --set."""
    where = Path(origin_of(h, key)[0])
    return where.is_relative_to(ROLES_DIR) or where.is_relative_to(LAYOUTS_DIR)
