"""`inv roll`'s decisions before any host is touched (railyard.verbs.roll.target, the replicas' steps, the report):
what the change is, where the new revision lives, and the one-line refusals."""

from __future__ import annotations

import pytest

import railyard.layouts  # noqa: F401  (the layouts register themselves)
from railyard.errors import InventoryError, UsageError
from railyard.inventory import load_inventory
from railyard.layouts.replicas.roll import steps
from railyard.verbs.roll import Roll, roll_report, target

from .test_plan import STATIONS
from .test_replicas_plan import replicas_plan

REV = "c" * 40
IMAGE = "vllm/vllm-openai:v0.32.0@sha256:" + "2" * 64


def loader(extra_base=()):
    return lambda extra: load_inventory(STATIONS, list(extra_base) + list(extra))


def test_a_new_revision_goes_beside_the_running_one_and_the_change_is_named():
    inv = load_inventory(STATIONS)
    new, change = target(inv, loader(), REV, None, None)
    old_path = inv.head.vars["model_path"]
    assert new.head.vars["model_revision"] == REV and new.head.vars["model_path"] == f"{old_path}-{REV[:12]}"
    assert change == {"what": "revision", "from": inv.head.vars["model_revision"], "to": REV,
                      "from_path": old_path, "to_path": f"{old_path}-{REV[:12]}"}
    digits = "1" * 40    # a revision of digits alone stays a string (the --set values are YAML)
    assert target(inv, loader(), digits, None, None)[0].head.vars["model_revision"] == digits
    new, change = target(inv, loader(), None, IMAGE, None)
    assert new.head.vars["vllm_image"] == IMAGE and change["what"] == "image" and change["to"] == IMAGE


def test_refusals_are_one_line_and_a_bad_value_is_the_inventorys_own_error():
    inv = load_inventory(STATIONS)
    for args, want in (((REV, IMAGE, None), "give exactly one of"), ((None, None, None), "give exactly one of"),
                       ((inv.head.vars["model_revision"], None, "/x"), "already pins it"),
                       ((REV, None, inv.head.vars["model_path"]), "the running revision's own directory"),
                       ((None, inv.head.vars["vllm_image"], None), "already pins it")):
        with pytest.raises(UsageError, match=want):
            target(inv, loader(), *args)
    with pytest.raises(InventoryError, match="model_revision"):
        target(inv, loader(), "not-a-hash", None, None)


def test_replicas_roll_one_at_a_time_and_say_what_stops_it():
    _, plan = replicas_plan()
    s = steps(plan)
    assert s[:4] == ["r0: out of routing, its requests in flight finished (within the drain timeout)",
                     "r0: removed and started on the new plan, gated (startup, LMCache, /health)",
                     "r0: one request answered by it alone",
                     "r0: back into routing, until the router's health check lists it healthy"]
    assert s[4].startswith("r1: out of routing") and "the roll stops there" in s[-1]


def test_the_report_names_the_change_the_path_and_the_downtime_and_fails_a_failed_roll():
    _, plan = replicas_plan()
    r = Roll({"what": "image", "from": "a", "to": "b"}, "planned restart", [], downtime_s=41.0, seconds=52.0)
    rep = roll_report(plan, r, False)
    assert rep.ok and rep.checks[0].detail == "image a -> b: planned restart in 52 s; downtime 41 s"
    r.failure = "r0 on the new plan: HTTP 500"
    assert not roll_report(plan, r, False).ok
