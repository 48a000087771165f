"""lab.down removes exactly what lab.up made. Runs last (file name) because it tears the lab down."""

import subprocess
from pathlib import Path

import pytest

import railyard_lab as lab

from .conftest import on

pytestmark = pytest.mark.lab


def _netns() -> set[str]:
    return {line.split()[0] for line in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                                         text=True).stdout.splitlines() if line.strip()}


def _links() -> set[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    return {line.split(":")[1].strip().split("@")[0] for line in out.splitlines()}


def test_resize_then_down_removes_everything(lab_inventory):
    # what is not a lab's (the other lab, where a second test worker runs one, may change meanwhile)
    stems = tuple(lab.stem(i) for i in lab.INSTANCES)
    links_before = {n for n in _links() if not n.startswith(stems)}
    ns_before = {n for n in _netns() if not n.startswith(stems)}
    lab.up(3, log=lambda *_: None)
    assert {f"{lab.NS_PREFIX}{h}" for h in "ABC"} <= _netns()
    pids = [int(p.read_text()) for p in Path(lab.lab_dir()).glob("hosts/*/*.pid")]
    assert pids
    # a container in a network namespace of its own (no --network host) goes with its host
    run = on("C", f"docker run -d --name own --entrypoint sleep {lab.LAB_IMAGE_NAME} 600")
    assert run.returncode == 0, run.stderr
    pids.append(int(on("C", "docker inspect -f '{{.State.Pid}}' own").stdout))
    lab.down(log=lambda *_: None)
    assert not any(n.startswith(lab.NS_PREFIX) for n in _netns()) and _netns() >= ns_before
    assert not any(n.startswith(lab.STEM) for n in _links()) and _links() >= links_before
    assert not lab.lab_dir().exists()
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split(") ")[1][:1]
    lab.up(2, log=lambda *_: None)  # leave a working lab behind for whoever runs next
