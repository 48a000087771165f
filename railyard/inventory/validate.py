"""A host's problems and the cluster's, one `Problem` line each, in the order they are found; the rules
they apply are data in `rules`."""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import TYPE_CHECKING, AbstractSet, Any

from ..errors import MISSING, Problem
from . import rules
from .model import Host, Rail
from .rules import CLUSTER_WIDE, ENV_NAME_RE, HCA_RE, HOSTNAME_RE, IFACE_RE, IMAGE_RE, RAIL_KEYS

if TYPE_CHECKING:
    from .load import _HostEntry, _Tree


def layout_names() -> tuple[str, ...]:
    """The values serve_layout takes: the registered layouts, as the registry (railyard.plan.layout) wrote
    them into `rules.LAYOUTS` (the layouts build on this module: it never imports them)."""
    return tuple(rules.LAYOUTS)


def _own_checks(name: str) -> tuple[str, ...]:
    """The cluster-wide variables a layout compares itself (pd's pools may differ in TP and ports)."""
    return rules.LAYOUTS.get(name, ())


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


def _mismatch(rule: rules.Match, value: Any) -> bool:
    """The value breaks the rule (an optional rule passes what is not a non-empty string)."""
    if rule.optional:
        if not isinstance(value, str) or not value:
            return False
        return not (rule.regex.match(value) or rule.or_ip and _is_ip(value))
    return not (rule.regex.match(str(value)) or rule.or_ip and _is_ip(str(value)))


def _build_host(name: str, entry: _HostEntry, values: dict, origins: dict, defaults: dict,
                inv_path: Path, problems: list[Problem], nullable: AbstractSet[str] = frozenset()) -> Host | None:
    start = len(problems)

    def bad(key: str, msg: str, value: Any = MISSING) -> None:
        file, where = origins.get(key, (entry.file, f"{entry.keypath}.{key}"))
        problems.append(Problem(file, where, values.get(key, MISSING) if value is MISSING else value, msg))

    def one_of(key: str) -> None:
        if values[key] not in rules.ONE_OF[key]:
            bad(key, rules.one_of_message(rules.ONE_OF[key]))

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
    one_of("ansible_connection")
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
    first_port, last_port = rules.PORT_RANGE
    if not first_port <= values["ansible_port"] <= last_port:
        bad("ansible_port", f"must be a TCP port {first_port}-{last_port}")
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
    for k, rule in rules.STRING_RULES.items():
        if _mismatch(rule, values.get(k) if rule.optional else values[k]):
            bad(k, rule.message)
    if len(problems) == start:  # the engines' own checks (the vLLM version's table), on well-formed values
        for check in rules.VALUE_CHECKS:
            for key, value, message in check(values):
                bad(key, message, value)
    if values["serve_layout"] not in layout_names():
        bad("serve_layout", f"unknown layout (one of: {', '.join(layout_names()) or 'none registered: import railyard.layouts'})")
    bad_env = [k for k in values["vllm_extra_env"] if not isinstance(k, str) or not ENV_NAME_RE.match(k)]
    if bad_env:
        bad("vllm_extra_env", f"{bad_env[0]!r} is not an environment variable name (letters, digits, _)")
    if values["vllm_cpuset"] not in rules.CPUSET_WORDS and not rules.CPUSET_RE.match(str(values["vllm_cpuset"])):
        bad("vllm_cpuset", 'must be "auto", "" or a CPU list like 0-55,112-167')
    one_of("sync_verify")
    one_of("sync_transport")
    if not all(isinstance(a, str) for a in values["model_architectures"]):
        bad("model_architectures", "must be a list of strings")
    if _mismatch(rules.SSH_CIPHER, values["sync_ssh_cipher"]):
        bad("sync_ssh_cipher", rules.SSH_CIPHER.message)
    if not _host_folder(values["model_path"]):
        bad("model_path", "must be an absolute path or start with ~/")
    kernels = values["vllm_kernels_path"]
    if kernels and not _host_folder(kernels):
        bad("vllm_kernels_path", 'must be an absolute path or start with ~/, or ""')
    elif kernels and kernels.rstrip("/") == values["model_path"].rstrip("/"):
        bad("vllm_kernels_path", "must not be model_path: the kernels are a folder of their own")
    for k, (lo, hi) in rules.RANGES.items():
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


def _host_folder(path: str) -> bool:
    """An absolute path on a host, or one under its home (`~/...`), naming a folder below either."""
    return (path.startswith("/") or path.startswith("~/")) and "\n" not in path and path.rstrip("/") not in ("", "~")


def _is_ip(s: str) -> bool:
    try:
        ipaddress.ip_address(s)
        return True
    except ValueError:
        return False


def _relative_to(inv_path: Path, p: str) -> Path:
    q = Path(p).expanduser()
    return q if q.is_absolute() else (inv_path.parent / q)
