"""Inventory loading: the shipped example, precedence, and one clear line per problem."""

import copy
from pathlib import Path

import pytest
import yaml

from railyard.errors import InventoryError, UsageError
from railyard.inventory import load_inventory, merge_vars, Layer

from .conftest import ROOT, inv_cmd

DIGEST = "sha256:" + "ab" * 32
BASE = {
    "all": {
        "vars": {"ansible_user": "nvidia", "model_revision": "c" * 40,
                 "vllm_image": f"vllm/vllm-openai:v0.30.0-aarch64@{DIGEST}"},
        "children": {"stations": {"hosts": {
            "A": {"ansible_host": "10.20.0.11", "rank": 0,
                  "rails": {"cx8r0": {"hca": "mlx5_0", "ipv4": "192.168.100.1/24"},
                            "cx8r1": {"hca": "mlx5_1", "ipv4": "192.168.101.1/24"}}},
            "B": {"ansible_host": "10.20.0.12", "rank": 1,
                  "rails": {"cx8r0": {"hca": "mlx5_0", "ipv4": "192.168.100.2/24"},
                            "cx8r1": {"hca": "mlx5_1", "ipv4": "192.168.101.2/24"}}},
        }}},
    }
}


def write(tmp_path: Path, data, name="inv.yml") -> Path:
    p = tmp_path / name
    p.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return p


def problems(tmp_path, mutate=None, overrides=None) -> list[str]:
    data = copy.deepcopy(BASE)
    if mutate:
        mutate(data)
    with pytest.raises(InventoryError) as e:
        load_inventory(write(tmp_path, data), overrides)
    return [str(p) for p in e.value.problems]


def hosts(d):
    return d["all"]["children"]["stations"]["hosts"]


def test_shipped_dgx_stations_inventory_loads():
    inv = load_inventory(ROOT / "inventory" / "dgx-stations.yml")
    assert [h.name for h in inv.hosts] == ["A", "B"]
    a, b = inv.hosts
    assert a.is_head and not b.is_head
    assert (a.serve_rail.name, a.serve_rail.hca, a.serve_rail.ip) == ("cx8r1", "mlx5_1", "192.168.101.1")
    assert set(a.rails) == {"cx8r0", "cx8r1"} and b.rails["cx8r0"].ip == "192.168.100.2"
    assert a.vars["cluster_gpu_name"] == "GB300"
    assert a.vars["preflight_mtu"] == 9000 and a.vars["preflight_link_speed_mbps"] == 400000
    assert a.vars["model_size_gb"] == 464 and a.vars["vllm_image"].startswith("vllm/vllm-openai:v0.30.0-aarch64@sha256:")
    assert [h.name for h in inv.ordered(None)] == ["B", "A"]  # workers first, head last
    assert [h.name for h in inv.ordered("A,B")] == ["A", "B"]


def test_precedence_defaults_group_host_cli(tmp_path):
    data = copy.deepcopy(BASE)
    data["all"]["vars"]["preflight_mtu"] = 9000
    data["all"]["children"]["stations"]["vars"] = {"preflight_mtu": 4200, "preflight_ping_count": 5}
    hosts(data)["B"]["preflight_disk_margin_gb"] = 3
    (tmp_path / "host_vars").mkdir()
    (tmp_path / "host_vars" / "A.yml").write_text("preflight_ping_count: 7\n")
    inv = load_inventory(write(tmp_path, data))
    a, b = inv.hosts
    assert a.vars["preflight_mtu"] == b.vars["preflight_mtu"] == 4200
    assert a.vars["preflight_disk_margin_gb"] == 20 and b.vars["preflight_disk_margin_gb"] == 3
    assert a.vars["preflight_ping_count"] == 7 and b.vars["preflight_ping_count"] == 5
    assert a.vars["preflight_link_speed_mbps"] == 400000  # role default
    inv = load_inventory(write(tmp_path, data), ["preflight_ping_count=2"])
    assert inv.hosts[0].vars["preflight_ping_count"] == 2  # command line wins


def test_merge_vars_reports_where_a_value_came_from():
    values, origins = merge_vars([Layer("roles", "defaults", {"x": 1, "y": 2}), Layer("inv.yml", "all.vars", {"x": 3})])
    assert values == {"x": 3, "y": 2} and origins["x"] == ("inv.yml", "all.vars.x")


@pytest.mark.parametrize("mutate,expect", [
    (lambda d: hosts(d)["B"].update(rank=0), "all.children.stations.hosts.B.rank = 0: duplicate rank (also host A)"),
    (lambda d: hosts(d)["B"].pop("rank"), "all.children.stations.hosts.B.rank: missing"),
    (lambda d: hosts(d)["B"].update(rank=2), "missing rank 1"),
    (lambda d: [hosts(d)[n].update(rank=r) for n, r in (("A", 1), ("B", 2))], "no head: one host must have rank 0"),
    (lambda d: hosts(d)["B"]["rails"]["cx8r1"].update(ipv4="192.168.102.2/24"),
     "hosts.B.rails.cx8r1.ipv4 = '192.168.102.2/24': not in the subnet of host A on this rail (192.168.101.0/24)"),
    (lambda d: hosts(d)["B"]["rails"]["cx8r1"].update(ipv4="192.168.101.1/24"), "same address as host A"),
    (lambda d: hosts(d)["B"]["rails"]["cx8r1"].update(ipv4="192.168.101.2"), "must be an IPv4 address with its prefix"),
    (lambda d: hosts(d)["B"].update(mtu=9000), "hosts.B.mtu = 9000: unknown key"),
    (lambda d: d["all"]["vars"].update(preflight_mut=9000), "all.vars.preflight_mut = 9000: unknown key (did you mean preflight_mtu?)"),
    (lambda d: d["all"]["vars"].update(preflight_mtu="9000"), "all.vars.preflight_mtu = '9000': must be an integer"),
    (lambda d: d["all"]["vars"].update(vllm_image="vllm/vllm-openai:latest"), "must be pinned by digest"),
    (lambda d: d["all"]["vars"].update(model_revision="main"), "model_revision = 'main': must be a pinned 40-hex commit hash"),
    (lambda d: d["all"]["vars"].update(cluster_serve_rail="cx8r9"), "no rail of that name on host A"),
    (lambda d: d["all"]["vars"].update(model_path="models/x"), "must be an absolute path or start with ~/"),
    (lambda d: d["all"]["vars"].update(rank=0), "all.vars.rank = 0: is per host"),
    (lambda d: hosts(d)["A"].pop("ansible_host"), "hosts.A.ansible_host: missing"),
    (lambda d: hosts(d)["B"].update(ansible_connection="winrm"), "must be ssh or local"),
    (lambda d: hosts(d)["B"].update(model_path="/srv/m"), "must be equal on every host"),
    (lambda d: hosts(d)["B"]["rails"]["cx8r1"].update(hca="mlx5 1"), "not an RDMA device name"),
    (lambda d: hosts(d)["B"]["rails"]["cx8r1"].pop("hca"), "hosts.B.rails.cx8r1.hca: missing"),
    (lambda d: d["all"].update(hostz={}), "all.hostz = {}: unknown key in a group"),
    (lambda d: d["all"]["vars"].update(vllm_cpuset="0-3;reboot"), "vllm_cpuset = '0-3;reboot': must be \"auto\""),
    (lambda d: d["all"]["vars"].update(vllm_extra_env={"A;touch x": "1"}),
     "'A;touch x' is not an environment variable name"),
])
def test_each_problem_is_one_line_with_file_key_value(tmp_path, mutate, expect):
    lines = problems(tmp_path, mutate)
    assert any(expect in line for line in lines), lines
    assert all(line.startswith(str(tmp_path / "inv.yml")) for line in lines)
    assert all("\n" not in line for line in lines)


def test_launch_refuses_a_tp_size_other_than_the_ranks_before_ssh(tmp_path):
    data = copy.deepcopy(BASE)
    data["all"]["vars"]["vllm_tensor_parallel_size"] = 4
    p = write(tmp_path, data)
    r = inv_cmd("launch", "--inventory", str(p), "--dry-run")  # hosts at 10.20.0.x are never contacted
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "all.vars.vllm_tensor_parallel_size = 4: must equal the number of ranks (2)" in r.stderr
    load_inventory(p)  # preflight of such an inventory is still fine


def test_unknown_override_and_bad_yaml(tmp_path):
    assert any("--set: preflight_mtux = 1: unknown variable" in p
               for p in problems(tmp_path, overrides=["preflight_mtux=1"]))
    bad = write(tmp_path, "all:\n  vars: {a: 1\n")
    with pytest.raises(InventoryError) as e:
        load_inventory(bad)
    assert "invalid YAML" in str(e.value) and str(bad) in str(e.value)


def test_duplicate_key_in_yaml_is_reported(tmp_path):
    text = yaml.safe_dump(BASE).replace("    B:\n", "    A:\n", 1)
    with pytest.raises(InventoryError) as e:
        load_inventory(write(tmp_path, text))
    assert "key given twice in one mapping" in str(e.value)


def test_no_inventory_given(monkeypatch):
    monkeypatch.delenv("RAILYARD_INVENTORY", raising=False)
    with pytest.raises(UsageError, match="RAILYARD_INVENTORY"):
        load_inventory(None)


def test_env_var_selects_the_inventory(tmp_path, monkeypatch):
    monkeypatch.setenv("RAILYARD_INVENTORY", str(write(tmp_path, BASE)))
    assert load_inventory(None).head.name == "A"


def test_cli_bad_inventory_exit_2_one_line_each_no_traceback(tmp_path):
    data = copy.deepcopy(BASE)
    hosts(data)["B"]["rank"] = 0
    data["all"]["vars"]["preflight_mtu"] = "big"
    p = write(tmp_path, data)
    r = inv_cmd("preflight", "--inventory", str(p))
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    # all.vars reaches both hosts: its bad value is named once
    assert len(errors) == 1 and str(p) in errors[0] and "all.vars.preflight_mtu = 'big'" in errors[0], errors


def test_cli_rank_order_and_missing_file(tmp_path):
    r = inv_cmd("preflight", "--inventory", str(tmp_path / "nope.yml"))
    assert r.returncode == 2 and "nope.yml" in r.stderr and "file not found" in r.stderr
    assert "Traceback" not in r.stderr
    inv = load_inventory(write(tmp_path, BASE))
    with pytest.raises(UsageError, match="must name every host exactly once"):
        inv.ordered("A,A")


def test_vllm_hung_after_s_beyond_the_probes_two_minutes_is_refused_with_file_key_and_value(tmp_path):
    got = problems(tmp_path, overrides=["vllm_hung_after_s=120"])   # the busy engine's second ask needs some
    assert got == ["--set: vllm_hung_after_s = 120: must be between 1 and 110"]          # named where it came from
    ok = load_inventory(write(tmp_path, copy.deepcopy(BASE)), ["vllm_hung_after_s=8"])
    assert ok.head.vars["vllm_hung_after_s"] == 8
