"""`inv roll` for a layout that serves as one group: the two stations (multinode_tp, the stand-in engine) moved to
another tag of the lab's engine image. A planned restart: announced before it starts (--dry-run), the new image
on every host first, then every container down and up on the new plan in stage order, the downtime measured and
recorded; health passes after. (The replicas' roll, one replica at a time, is in test_lab_replicas.py; on the real
engine in test_lab_real_replicas.py.)"""

from __future__ import annotations

import json
import shutil

import pytest

import railyard_lab as lab
from railyard_lab.checkpoint import write_checkpoint

from .conftest import home, inv_cmd, on

pytestmark = pytest.mark.lab
NAME = "glm53-full"
NEXT = f"{lab.LAB_IMAGE_NEXT}@{lab.LAB_IMAGE_NEXT_DIGEST}"


def inv(path, *args, timeout=300):
    return inv_cmd(*args, env={"RAILYARD_INVENTORY": str(path)}, timeout=timeout)


@pytest.fixture(scope="module")
def serving(lab_inventory):
    write_checkpoint(home("A") / "models" / "tiny-qwen3", 0.002, 2)
    for c in ("sync-model", "env", "launch --recreate"):
        r = inv(lab_inventory, *c.split())
        assert r.returncode == 0, (c, r.stdout[-2000:], r.stderr[-2000:])
    yield lab_inventory
    for h in ("A", "B"):
        on(h, f"docker rm -f {NAME} >/dev/null 2>&1; true")
        shutil.rmtree(home(h) / "models", ignore_errors=True)


def test_a_group_layout_rolls_to_a_new_image_in_a_planned_restart_whose_downtime_is_measured(serving):
    dry = inv(serving, "roll", "--image", NEXT, "--dry-run")
    assert dry.returncode == 0 and "planned restart: multinode_tp serves as one group" in dry.stdout, dry.stdout
    r = inv(serving, "roll", "--image", NEXT, "--json", timeout=600)
    doc = json.loads(r.stdout)
    assert r.returncode == 0, doc["data"]
    d = doc["data"]
    print(f"roll --image on the two stations: {d['seconds']} s, downtime {d['downtime_s']} s")
    assert d["path"] == "planned restart" and 0 < d["downtime_s"] <= d["seconds"]
    assert d["done"][0]["step"].startswith("the new image on every host (A present, B present)")
    for host in ("A", "B"):
        assert NEXT in on(host, f"docker inspect {NAME}").stdout, host     # each rank runs the new image
    h = inv(serving, "health", "--set", f"vllm_image={NEXT}")
    assert h.returncode == 0, h.stdout[-2000:]
    last = json.loads(inv(serving, "status", "--json", "--set", f"vllm_image={NEXT}").stdout)["data"]["recoveries"][
        "last_roll"]
    assert last["ok"] and last["downtime_s"] == d["downtime_s"] and last["change"]["to"] == NEXT


def test_roll_refuses_two_changes_none_and_the_running_image_in_one_line(serving):
    for args, want in ((("--image", NEXT, "--revision", "c" * 40), "give exactly one of --revision"),
                       ((), "give exactly one of --revision"),
                       (("--image", f"{lab.LAB_IMAGE_NAME}@{lab.LAB_IMAGE_DIGEST}"), "already pins it"),
                       (("--revision", "xyz"), "model_revision")):
        r = inv(serving, "roll", *args)
        assert r.returncode == 2 and want in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
