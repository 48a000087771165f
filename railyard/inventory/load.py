"""Reading the inventory: YAML with duplicate keys refused, the `all.children.<group>.hosts.<name>` tree
with its group_vars/ and host_vars/ files, and `load_inventory`, which merges each host's layers and
validates the hosts and the cluster."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import yaml

from ..errors import MISSING, InventoryError, Problem, UsageError
from .model import Host, Inventory
from .rules import HOST_ONLY_KEYS, NAME_RE
from .validate import _build_host, _validate_cluster
from .vars import ROLES_DIR, Layer, layout_layers, merge_vars, parse_overrides, role_layers

ENV_INVENTORY = "RAILYARD_INVENTORY"
MAX_YAML_BYTES = 4 << 20  # an inventory is kilobytes; refuse what no one wrote by hand


# ---------------------------------------------------------------- YAML reading

class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that reports a key given twice in one mapping instead of keeping the last."""

    duplicates: list[tuple[str, int]]


def _construct_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False):
    seen: set = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if isinstance(key, (str, int, float, bool)) and key in seen:
            loader.duplicates.append((str(key), key_node.start_mark.line + 1))
        seen.add(key if isinstance(key, (str, int, float, bool)) else id(key))
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _read_yaml(path: Path, problems: list[Problem], required: bool = True) -> Any:
    try:
        text = path.read_text()
    except FileNotFoundError:
        if required:
            problems.append(Problem(str(path), "-", MISSING, "file not found"))
        return None
    except OSError as e:
        problems.append(Problem(str(path), "-", MISSING, f"cannot read: {e.strerror}"))
        return None
    if len(text) > MAX_YAML_BYTES:
        problems.append(Problem(str(path), "-", MISSING, f"{len(text):,} characters: not an inventory (at most "
                                                          f"{MAX_YAML_BYTES:,})"))
        return None
    loader = None
    try:
        loader = _UniqueKeyLoader(text)
        loader.duplicates = []
        data = loader.get_single_data()
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark else "-"
        why = getattr(e, "problem", None) or str(e).splitlines()[0]
        problems.append(Problem(str(path), where, MISSING, f"invalid YAML: {why}"))
        return None
    except RecursionError:
        problems.append(Problem(str(path), "-", MISSING, "invalid YAML: nested too deeply"))
        return None
    finally:
        if loader is not None:
            loader.dispose()
    for key, line in loader.duplicates:
        problems.append(Problem(str(path), f"line {line}", key, "key given twice in one mapping"))
    return data


# ---------------------------------------------------------------- loading

def resolve_path(path: str | os.PathLike | None) -> Path:
    chosen = path or os.environ.get(ENV_INVENTORY)
    if not chosen:
        raise UsageError(f"no inventory: pass --inventory PATH or set {ENV_INVENTORY}")
    return Path(chosen).expanduser()


def load_inventory(path: str | os.PathLike | None, overrides: Iterable[str] | None = None,
                   roles_dir: Path = ROLES_DIR) -> Inventory:
    """Read, merge and validate. Raises InventoryError listing every problem found."""
    inv_path = resolve_path(path)
    problems: list[Problem] = []
    base = role_layers(roles_dir)
    defaults = Layer(str(roles_dir), "", {k: v for layer in base for k, v in layer.values.items()})
    by_layout = layout_layers()
    nullable = {k for layers in by_layout.values() for layer in layers for k, v in layer.values.items() if v is None}
    cli = parse_overrides(overrides)
    known = set(defaults.values)
    for k, v in cli.values.items():
        if k in HOST_ONLY_KEYS:
            problems.append(Problem("--set", k, v, "is per host: set it in the inventory"))
        elif k not in known:
            problems.append(Problem("--set", k, v, f"unknown variable{_suggest(k, known)}"))
    data = _read_yaml(inv_path, problems)
    if data is None:
        if not problems:
            problems.append(Problem(str(inv_path), "all", MISSING, "empty inventory"))
        raise InventoryError(problems)

    tree = _Tree(inv_path, known, problems)
    tree.walk(data)
    hosts: list[Host] = []
    for name, entry in tree.hosts.items():
        above = [layer for group in entry.groups for layer in tree.group_layers.get(group, [])]
        above += entry.layers + [cli]
        values, origins = merge_vars(base + above)
        # the layout's own defaults sit between the roles' and the inventory's
        values, origins = merge_vars(base + by_layout.get(str(values["serve_layout"]), []) + above)
        host = _build_host(name, entry, values, origins, defaults.values, inv_path, problems, nullable)
        if host:
            hosts.append(host)
    if not tree.hosts and not problems:
        problems.append(Problem(str(inv_path), "all", MISSING, "no hosts defined"))
    if not problems:
        _validate_cluster(hosts, tree, inv_path, problems)
    if problems:
        raise InventoryError(problems)
    hosts.sort(key=lambda h: h.rank)
    return Inventory(inv_path, hosts)


@dataclass
class _HostEntry:
    file: str
    keypath: str
    groups: list[str]
    body: dict[str, Any]
    layers: list[Layer]


class _Tree:
    """Walks `all.children.<group>.hosts.<name>` and collects host entries and group vars."""

    def __init__(self, inv_path: Path, known: set[str], problems: list[Problem]):
        self.path = inv_path
        self.file = str(inv_path)
        self.known = known
        self.problems = problems
        self.hosts: dict[str, _HostEntry] = {}
        self.group_layers: dict[str, list[Layer]] = {}

    def walk(self, data: Any) -> None:
        if not isinstance(data, dict) or set(data) != {"all"}:
            got = sorted(data) if isinstance(data, dict) else type(data).__name__
            self.problems.append(Problem(self.file, "(top)", got, "the inventory must have exactly one top-level key: all"))
            return
        self._group("all", data["all"], "all", [])

    def _group(self, name: str, body: Any, keypath: str, parents: list[str]) -> None:
        if body is None:
            body = {}
        if not isinstance(body, dict):
            self.problems.append(Problem(self.file, keypath, body, "a group must be a mapping with vars, children or hosts"))
            return
        for k in body:
            if k not in ("vars", "children", "hosts"):
                self.problems.append(Problem(self.file, f"{keypath}.{k}", body[k],
                                             "unknown key in a group (expected vars, children, hosts)"))
        layers = []
        gvars = body.get("vars") or {}
        if not isinstance(gvars, dict):
            self.problems.append(Problem(self.file, f"{keypath}.vars", gvars, "must be a mapping"))
            gvars = {}
        self._check_vars(gvars, self.file, f"{keypath}.vars", allow_host_only=False)
        layers.append(Layer(self.file, f"{keypath}.vars", gvars))
        gfile = self._side_file("group_vars", name)
        if gfile is not None:
            path, values = gfile
            self._check_vars(values, path, "", allow_host_only=False)
            layers.append(Layer(path, "", values))
        self.group_layers.setdefault(name, []).extend(layers)
        chain = parents + [name]
        hosts = body.get("hosts") or {}
        if not isinstance(hosts, dict):
            self.problems.append(Problem(self.file, f"{keypath}.hosts", hosts, "must be a mapping of host name to host"))
            hosts = {}
        for hname, hbody in hosts.items():
            self._host(str(hname), hbody, f"{keypath}.hosts.{hname}", chain)
        children = body.get("children") or {}
        if not isinstance(children, dict):
            self.problems.append(Problem(self.file, f"{keypath}.children", children, "must be a mapping of group name to group"))
            children = {}
        for cname, cbody in children.items():
            if not NAME_RE.match(str(cname)):
                self.problems.append(Problem(self.file, f"{keypath}.children.{cname}", cname, "group names use letters, digits, _ . -"))
                continue
            self._group(str(cname), cbody, f"{keypath}.children.{cname}", chain)

    def _host(self, name: str, body: Any, keypath: str, groups: list[str]) -> None:
        if not NAME_RE.match(name):
            self.problems.append(Problem(self.file, keypath, name, "host names use letters, digits, _ . - (at most 63)"))
            return
        if body is None:
            body = {}
        if not isinstance(body, dict):
            self.problems.append(Problem(self.file, keypath, body, "a host must be a mapping of variables"))
            return
        if name in self.hosts:
            prev = self.hosts[name]
            if body and prev.body:
                self.problems.append(Problem(self.file, keypath, name, f"host defined twice (also at {prev.keypath})"))
                return
            for g in groups:
                if g not in prev.groups:
                    prev.groups.append(g)
            if body:
                prev.body, prev.keypath = body, keypath
                prev.layers[0] = Layer(self.file, keypath, body)
            return
        self._check_vars(body, self.file, keypath, allow_host_only=True)
        layers = [Layer(self.file, keypath, body)]
        hfile = self._side_file("host_vars", name)
        if hfile is not None:
            path, values = hfile
            self._check_vars(values, path, "", allow_host_only=True)
            layers.append(Layer(path, "", values))
        self.hosts[name] = _HostEntry(self.file, keypath, list(groups), body, layers)

    def _side_file(self, kind: str, name: str) -> tuple[str, dict] | None:
        for ext in ("yml", "yaml"):
            p = self.path.parent / kind / f"{name}.{ext}"
            if p.exists():
                data = _read_yaml(p, self.problems) or {}
                if not isinstance(data, dict):
                    self.problems.append(Problem(str(p), "(top)", data, "must be a mapping of variables"))
                    return None
                return str(p), data
        return None

    def _check_vars(self, values: dict, file: str, keypath: str, allow_host_only: bool) -> None:
        for k, v in values.items():
            where = f"{keypath}.{k}" if keypath else str(k)
            if k in HOST_ONLY_KEYS:
                if not allow_host_only:
                    self.problems.append(Problem(file, where, v, "is per host: set it under the host"))
            elif k not in self.known:
                self.problems.append(Problem(file, where, v, f"unknown key{_suggest(str(k), self.known | HOST_ONLY_KEYS)}"))


def _suggest(key: str, known: set[str]) -> str:
    import difflib
    close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.75)
    return f" (did you mean {close[0]}?)" if close else ""
