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
"""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import AbstractSet, Any, Iterable

import yaml

from .errors import MISSING, InventoryError, Problem, UsageError

ENV_INVENTORY = "RAILYARD_INVENTORY"
ROLES_DIR = Path(__file__).resolve().parent / "roles"
LAYOUTS_DIR = Path(__file__).resolve().parent / "layouts"

# Connection variables in Ansible's spelling, settable at any level.
CONNECTION_DEFAULTS: dict[str, Any] = {
    "ansible_user": "",
    "ansible_port": 22,
    "ansible_connection": "ssh",
    "ansible_ssh_private_key_file": "",
}
# Keys that only make sense for one host.
HOST_ONLY_KEYS = {"ansible_host", "rank", "rails"}
RAIL_KEYS = {"hca", "ipv4"}
# Values that must be the same on every host for a multi-node launch to work.
CLUSTER_WIDE = (
    "serve_layout", "cluster_serve_rail", "model_path", "model_revision", "model_repo", "vllm_image",
    "vllm_port", "vllm_master_port", "vllm_tensor_parallel_size", "preflight_mtu",
)


MAX_YAML_BYTES = 4 << 20  # an inventory is kilobytes; refuse what no one wrote by hand

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
CONTAINER_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{1,62}$")  # docker's [a-zA-Z0-9][a-zA-Z0-9_.-]+
IFACE_RE = re.compile(r"^[A-Za-z0-9_.-]{1,15}$")
HCA_RE = re.compile(r"^[A-Za-z0-9_]{1,32}$")
IMAGE_RE = re.compile(r"^[a-z0-9][a-z0-9._/:-]*(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?@sha256:[0-9a-f]{64}$")
REVISION_RE = re.compile(r"^[0-9a-f]{40}$")
CPUSET_RE = re.compile(r"^\d+(-\d+)?(,\d+(-\d+)?)*$")
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
HOSTNAME_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]{0,252}[A-Za-z0-9])?$")
# Strings that become an address to bind or dial, a docker size, a name in a container name or a
# program's option value: refused before SSH when they cannot be one (they are quoted regardless).
ADDRESS_KEYS = ("vllm_bind", "litellm_bind", "lmcache_host", "lmcache_http_host", "pd_proxy_bind")
_WORD = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
VALUE_RULES = {
    **{k: (HOSTNAME_RE, "not an IP address or host name") for k in ADDRESS_KEYS},
    **{k: (re.compile(r"^\d+[bkmgBKMG]?[bB]?$"), "not a size like 32g") for k in ("vllm_shm_size", "lmcache_shm_size")},
    **{k: (_WORD, "not a name: letters, digits, _ . - (it is part of container names)")
       for k in ("litellm_container_suffix", "lmcache_container_suffix")},
    **{k: (_WORD, "not a value vLLM takes: letters, digits, _ . -")
       for k in ("vllm_kv_cache_dtype", "vllm_tool_call_parser", "vllm_reasoning_parser", "vllm_all2all_backend",
                 "model_quant_algo", "lmcache_eviction_policy", "litellm_routing_strategy", "pd_proxy_policy")},
    "ansible_user": (re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,31}$"), "not a user name"),
    "model_repo": (re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9_.-]+)?$"),
                   "not a model id like org/name (it is the served model name)"),
    "cluster_gpu_name": (re.compile(r"^[A-Za-z0-9 _.-]{1,64}$"), "not a GPU name like GB300 or H200"),
}


@dataclass(frozen=True)
class Rail:
    name: str
    hca: str
    ipv4: ipaddress.IPv4Interface

    @property
    def ip(self) -> str:
        return str(self.ipv4.ip)


@dataclass(frozen=True)
class Host:
    """One host of the inventory with its resolved variables."""

    name: str
    rank: int
    address: str  # ansible_host; "" for a local host without one
    port: int
    user: str
    connection: str  # "ssh" or "local"
    key_file: str
    rails: dict[str, Rail]
    vars: dict[str, Any] = field(repr=False)
    groups: tuple[str, ...] = ()  # the inventory groups it is in, outermost first
    origins: dict[str, tuple[str, str]] = field(repr=False, default_factory=dict)  # var -> (file, key path)

    @property
    def is_head(self) -> bool:
        return self.rank == 0

    @property
    def serve_rail(self) -> Rail:
        return self.rails[self.vars["cluster_serve_rail"]]

    @property
    def is_local(self) -> bool:
        return self.connection == "local"


@dataclass
class Inventory:
    path: Path
    hosts: list[Host]  # in rank order

    @property
    def head(self) -> Host:
        return self.hosts[0]

    @property
    def workers(self) -> list[Host]:
        return self.hosts[1:]

    def host(self, name: str) -> Host:
        for h in self.hosts:
            if h.name == name:
                return h
        raise UsageError(f"{self.path}: no host named {name!r} (hosts: {', '.join(self.names)})")

    @property
    def names(self) -> list[str]:
        return [h.name for h in self.hosts]

    def ordered(self, spec: str | None) -> list[Host]:
        """Hosts in the order `B,A`; default: workers first, the head last."""
        if not spec:
            return self.workers + [self.head]
        names = [n.strip() for n in spec.split(",") if n.strip()]
        if sorted(names) != sorted(self.names):
            raise UsageError(
                f"--rank-order {spec!r}: must name every host exactly once ({', '.join(self.names)})")
        return [self.host(n) for n in names]

    def select(self, spec: str | None) -> list[Host]:
        """Hosts named in `A,B` (rank order kept); all hosts when empty."""
        if not spec:
            return list(self.hosts)
        wanted = [n.strip() for n in spec.split(",") if n.strip()]
        for n in wanted:
            self.host(n)
        return [h for h in self.hosts if h.name in wanted]


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


# ---------------------------------------------------------------- variables

@dataclass
class Layer:
    """One source of variables: where it came from and its values."""

    file: str
    keypath: str
    values: dict[str, Any]


def role_layers(roles_dir: Path = ROLES_DIR) -> list[Layer]:
    """The connection defaults, then each role's defaults file: the lowest layers, in that order."""
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


def layout_names() -> tuple[str, ...]:
    """The values serve_layout takes: the registered layouts (railyard.plan.layout, imported when it is
    asked: the layouts build on this module)."""
    from .plan import layout
    return layout.names()


def _own_checks(name: str) -> tuple[str, ...]:
    """The cluster-wide variables a layout compares itself (pd's pools may differ in TP and ports)."""
    from .plan import layout
    return layout.by_name(name).own_checks if name in layout.names() else ()


def _suggest(key: str, known: set[str]) -> str:
    import difflib
    close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.75)
    return f" (did you mean {close[0]}?)" if close else ""


def _type_name(t: type) -> str:
    return {str: "a string", int: "an integer", float: "a number", bool: "true or false",
            dict: "a mapping", list: "a list"}.get(t, t.__name__)


def _type_ok(value: Any, default: Any) -> bool:
    want = type(default)
    if want is bool:
        return isinstance(value, bool)
    if want is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if want is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, want)


def _build_host(name: str, entry: _HostEntry, values: dict, origins: dict, defaults: dict,
                inv_path: Path, problems: list[Problem], nullable: AbstractSet[str] = frozenset()) -> Host | None:
    start = len(problems)

    def bad(key: str, msg: str) -> None:
        file, where = origins.get(key, (entry.file, f"{entry.keypath}.{key}"))
        problems.append(Problem(file, where, values.get(key, MISSING), msg))

    for k, v in values.items():
        if k in defaults and not _type_ok(v, defaults[k]) and not (v is None and k in nullable):
            bad(k, f"must be {_type_name(type(defaults[k]))}")
    if len(problems) > start:
        return None

    # rank
    rank = values.get("rank", MISSING)
    if rank is MISSING:
        problems.append(Problem(entry.file, f"{entry.keypath}.rank", MISSING, "missing: every host needs a rank (0 is the head)"))
    elif not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
        bad("rank", "must be an integer >= 0")

    # connection
    conn = values["ansible_connection"]
    if conn not in ("ssh", "local"):
        bad("ansible_connection", "must be ssh or local")
    address = values.get("ansible_host", "")
    if address is None:
        address = ""
    if not isinstance(address, str):
        bad("ansible_host", "must be a host name or an IP address")
    elif conn == "ssh" and not address:
        problems.append(Problem(entry.file, f"{entry.keypath}.ansible_host", MISSING,
                                "missing: the address railyard connects to (or ansible_connection: local)"))
    elif address and not (_is_ip(address) or HOSTNAME_RE.match(address)):
        bad("ansible_host", "not a valid host name or IP address")
    if not 1 <= values["ansible_port"] <= 65535:
        bad("ansible_port", "must be a TCP port 1-65535")
    key_file = values["ansible_ssh_private_key_file"]
    if key_file:
        key_file = str(_relative_to(inv_path, key_file))
        if not Path(key_file).is_file():
            bad("ansible_ssh_private_key_file", "file not found")
    kh = values["ssh_known_hosts"]
    if kh:
        values["ssh_known_hosts"] = str(_relative_to(inv_path, kh))
        if not Path(values["ssh_known_hosts"]).is_file():
            bad("ssh_known_hosts", f"file not found ({values['ssh_known_hosts']})")

    # rails
    rails: dict[str, Rail] = {}
    rail_problems = len(problems)
    raw_rails = values.get("rails", MISSING)
    rfile, rkey = origins.get("rails", (entry.file, f"{entry.keypath}.rails"))
    if raw_rails is MISSING or not raw_rails:
        problems.append(Problem(entry.file, f"{entry.keypath}.rails", MISSING, "missing: the host's RDMA rails (name: {hca, ipv4})"))
    elif not isinstance(raw_rails, dict):
        problems.append(Problem(rfile, rkey, raw_rails, "must be a mapping of rail interface to {hca, ipv4}"))
    else:
        for rname, rbody in raw_rails.items():
            rk = f"{rkey}.{rname}"
            if not IFACE_RE.match(str(rname)):
                problems.append(Problem(rfile, rk, rname, "not a valid interface name (at most 15 of letters, digits, _ . -)"))
                continue
            if not isinstance(rbody, dict):
                problems.append(Problem(rfile, rk, rbody, "must be a mapping with hca and ipv4"))
                continue
            for k in rbody:
                if k not in RAIL_KEYS:
                    problems.append(Problem(rfile, f"{rk}.{k}", rbody[k], "unknown key in a rail (expected hca, ipv4)"))
            hca, ipv4 = rbody.get("hca", MISSING), rbody.get("ipv4", MISSING)
            if hca is MISSING or ipv4 is MISSING:
                missing = "hca" if hca is MISSING else "ipv4"
                problems.append(Problem(rfile, f"{rk}.{missing}", MISSING, "missing"))
                continue
            if not isinstance(hca, str) or not HCA_RE.match(hca):
                problems.append(Problem(rfile, f"{rk}.hca", hca, "not an RDMA device name like mlx5_1"))
                continue
            try:
                if not isinstance(ipv4, str) or "/" not in ipv4:
                    raise ValueError
                iface = ipaddress.IPv4Interface(ipv4)
            except ValueError:
                problems.append(Problem(rfile, f"{rk}.ipv4", ipv4, "must be an IPv4 address with its prefix, like 192.168.101.1/24"))
                continue
            rails[str(rname)] = Rail(str(rname), hca, iface)

    # values
    serve = values["cluster_serve_rail"]
    if rails and serve not in rails and len(problems) == rail_problems:
        bad("cluster_serve_rail", f"no rail of that name on host {name} (rails: {', '.join(rails)})")
    if not str(values["cluster_gpu_name"]).strip():
        bad("cluster_gpu_name", "must not be empty: a substring of the GPU's nvidia-smi name, like GB300")
    if not values["vllm_image"]:
        bad("vllm_image", "required: the image pinned by digest, name:tag@sha256:<64 hex>")
    elif not IMAGE_RE.match(values["vllm_image"]):
        bad("vllm_image", "must be pinned by digest: name:tag@sha256:<64 hex>")
    if not CONTAINER_RE.match(str(values["vllm_container"])):
        bad("vllm_container", "not a container name: letters, digits, _ . - (docker's rule), up to 63")
    for k, (rule, what) in VALUE_RULES.items():
        v = values.get(k)
        if isinstance(v, str) and v and not (rule.match(v) or k in ADDRESS_KEYS and _is_ip(v)):
            bad(k, what)
    if not REVISION_RE.match(values["model_revision"]):
        bad("model_revision", "must be a pinned 40-hex commit hash")
    if values["serve_layout"] not in layout_names():
        bad("serve_layout", f"unknown layout (one of: {', '.join(layout_names())})")
    bad_env = [k for k in values["vllm_extra_env"] if not isinstance(k, str) or not ENV_NAME_RE.match(k)]
    if bad_env:
        bad("vllm_extra_env", f"{bad_env[0]!r} is not an environment variable name (letters, digits, _)")
    if values["vllm_cpuset"] not in ("", "auto") and not CPUSET_RE.match(str(values["vllm_cpuset"])):
        bad("vllm_cpuset", 'must be "auto", "" or a CPU list like 0-55,112-167')
    if values["sync_verify"] not in ("size", "content"):
        bad("sync_verify", "must be size or content")
    if values["sync_transport"] not in ("ssh", "rsyncd"):
        bad("sync_transport", "must be ssh or rsyncd")
    if not all(isinstance(a, str) for a in values["model_architectures"]):
        bad("model_architectures", "must be a list of strings")
    if not re.match(r"^[A-Za-z0-9@._-]+$", values["sync_ssh_cipher"]):
        bad("sync_ssh_cipher", "not an SSH cipher name")
    mp = values["model_path"]
    if not (mp.startswith("/") or mp.startswith("~/")) or "\n" in mp or mp.rstrip("/") in ("", "~"):
        bad("model_path", "must be an absolute path or start with ~/")
    ranges = {
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
    }
    for k, (lo, hi) in ranges.items():
        if not lo <= values[k] <= hi:
            bad(k, f"must be between {lo} and {hi}")
    if len(problems) > start:
        return None
    return Host(name=name, rank=rank, address=address or "", port=values["ansible_port"],
                user=values["ansible_user"], connection=conn, key_file=key_file, rails=rails,
                vars=values, origins=origins, groups=tuple(entry.groups))


def _validate_cluster(hosts: list[Host], tree: _Tree, inv_path: Path, problems: list[Problem]) -> None:
    file = str(inv_path)

    def where(h: Host, key: str) -> str:
        return f"{tree.hosts[h.name].keypath}.{key}"

    by_rank: dict[int, Host] = {}
    for h in sorted(hosts, key=lambda h: h.name):
        if h.rank in by_rank:
            problems.append(Problem(file, where(h, "rank"), h.rank, f"duplicate rank (also host {by_rank[h.rank].name})"))
        else:
            by_rank[h.rank] = h
    if 0 not in by_rank and not problems:
        problems.append(Problem(file, "all", MISSING, "no head: one host must have rank 0"))
    for r in range(len(hosts)):
        if r not in by_rank and r != 0 and not problems:
            problems.append(Problem(file, "all", MISSING, f"missing rank {r}: ranks must be 0..{len(hosts) - 1}"))
    head = by_rank.get(0, hosts[0])
    own = _own_checks(head.vars["serve_layout"])
    for key in CLUSTER_WIDE:
        if key in own:  # the layout compares these itself
            continue
        for h in hosts:
            if h.vars[key] != head.vars[key]:
                problems.append(Problem(file, where(h, key), h.vars[key],
                                        f"differs from the head {head.name} ({head.vars[key]!r}); must be equal on every host"))
    serve = head.vars["cluster_serve_rail"]
    addr_seen: dict[tuple[str, int], str] = {}
    for h in hosts:
        if h.connection == "ssh":
            k = (h.address, h.port)
            if k in addr_seen:
                problems.append(Problem(file, where(h, "ansible_host"), h.address, f"same address and port as host {addr_seen[k]}"))
            addr_seen[k] = h.name
    rail_names = sorted({r for h in hosts for r in h.rails})
    for rname in rail_names:
        members = [h for h in hosts if rname in h.rails]
        if rname == serve and len(members) != len(hosts):
            continue  # already reported per host
        ref = members[0]
        ips: dict[str, str] = {}
        for h in members:
            rail = h.rails[rname]
            if rail.ipv4.network != ref.rails[rname].ipv4.network:
                problems.append(Problem(file, where(h, f"rails.{rname}.ipv4"), str(rail.ipv4),
                                        f"not in the subnet of host {ref.name} on this rail ({ref.rails[rname].ipv4.network})"))
            if rail.ip in ips:
                problems.append(Problem(file, where(h, f"rails.{rname}.ipv4"), str(rail.ipv4), f"same address as host {ips[rail.ip]}"))
            ips[rail.ip] = h.name
            if rail.ipv4.ip in (rail.ipv4.network.network_address, rail.ipv4.network.broadcast_address) \
                    and rail.ipv4.network.prefixlen < 31:
                problems.append(Problem(file, where(h, f"rails.{rname}.ipv4"), str(rail.ipv4), "is the network or broadcast address"))


def origin_of(h: Host, key: str) -> tuple[str, str]:
    """Where a host's variable was last set, for a problem line."""
    return h.origins.get(key, ("(defaults)", key))


def set_by_default(h: Host, key: str) -> bool:
    """Only railyard's own defaults set this value (a role's or the layout's file), not the inventory or --set."""
    where = Path(origin_of(h, key)[0])
    return where.is_relative_to(ROLES_DIR) or where.is_relative_to(LAYOUTS_DIR)


def _is_ip(s: str) -> bool:
    try:
        ipaddress.ip_address(s)
        return True
    except ValueError:
        return False


def _relative_to(inv_path: Path, p: str) -> Path:
    q = Path(p).expanduser()
    return q if q.is_absolute() else (inv_path.parent / q)
