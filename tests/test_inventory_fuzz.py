"""The inventory loader under fuzzing: any YAML, wrong types, huge, nested, unicode values, duplicate
keys: one-line problems (InventoryError / UsageError, exit 2) and never another exception."""

import copy

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from railyard.errors import UsageError
from railyard.inventory import load_inventory

from .conftest import ROOT

BASE = yaml.safe_load((ROOT / "inventory" / "dgx-stations.yml").read_text())
scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                    st.text(max_size=40), st.sampled_from(["~/", "-rf", "$(id)", "a\nb", "0.0.0.0", "ü" * 300]))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.one_of(st.text(max_size=12), st.integers()),
                                                                       inner, max_size=4)), max_leaves=12)
PATHS = [("all",), ("all", "vars"), ("all", "children"), ("all", "children", "stations"),
         ("all", "children", "stations", "vars"), ("all", "children", "stations", "hosts"),
         ("all", "children", "stations", "hosts", "A"), ("all", "children", "stations", "hosts", "A", "rails"),
         ("all", "children", "stations", "hosts", "B", "rails", "cx8r1")]


def load(tmp_path, text):
    p = tmp_path / "inv.yml"
    p.write_text(text)
    try:
        load_inventory(p)
    except UsageError as e:  # InventoryError is one: exit 2, one line per problem
        assert str(e) and all(line.strip() for line in str(e).splitlines())


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(where=st.sampled_from(PATHS), key=st.one_of(st.text(max_size=20), st.sampled_from(
    ["rank", "rails", "vllm_port", "serve_layout", "vllm_extra_env", "model_path", "vllm_tensor_parallel_size",
     "cluster_gpus_per_host", "vllm_cpuset", "ansible_host"])), value=values)
def test_a_mutated_inventory_is_loaded_or_refused_in_lines(tmp_path, where, key, value):
    data = copy.deepcopy(BASE)
    node = data
    for k in where:
        node = node[k] if isinstance(node, dict) and isinstance(node.get(k), dict) else node
    if isinstance(node, dict):
        node[key] = value
    load(tmp_path, yaml.safe_dump(data, allow_unicode=True))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=300))
def test_any_text_is_loaded_or_refused_in_lines(tmp_path, text):
    load(tmp_path, text)


def test_deep_nesting_and_duplicate_keys_are_refused_in_lines(tmp_path):
    load(tmp_path, "all:\n  vars: " + "[" * 500 + "]" * 500 + "\n")
    load(tmp_path, "all:\n  vars: {a: 1, a: 2}\n  vars: {}\n")
