"""Load and validate an Ansible-shaped inventory, before any host is touched.

    all:
      vars: {cluster_serve_rail: cx8r1}
      children:
        stations:
          hosts:
            A: {ansible_host: 10.0.0.11, rank: 0, rails: {cx8r1: {hca: mlx5_1, ipv4: 192.168.101.1/24}}}

Variables come from `roles/<role>/defaults/main.yml`, then the chosen layout's own
defaults (`layouts/<package>/<serve_layout>.yml`, beside its plan), and are overridden, in this order,
by group vars (`all` first, then each group down to the host's own), host vars, and
finally `--set KEY=VALUE` on the command line: see `merge_vars`.
Every problem found is reported as one line naming the file, the key path and
the value (`InventoryError`, exit code 2).

The package, by stage: `load` (YAML, the tree, `load_inventory`), `vars` (layers, precedence, origins),
`model` (Inventory, Host, Rail), `rules` (the value rules, as data) and `validate` (host and cluster problems).
"""

from .load import ENV_INVENTORY, load_inventory, resolve_path
from .model import Host, Inventory, Rail
from .rules import IMAGE_RE
from .validate import layout_names
from .vars import LAYOUTS_DIR, ROLES_DIR, Layer, merge_vars, origin_of, parse_overrides, set_by_default

__all__ = [
    "ENV_INVENTORY", "IMAGE_RE", "LAYOUTS_DIR", "ROLES_DIR",
    "Host", "Inventory", "Layer", "Rail",
    "layout_names", "load_inventory", "merge_vars", "origin_of", "parse_overrides", "resolve_path",
    "set_by_default",
]
