"""The package works installed, without the checkout: roles, templates and host scripts ship in it, the lab does not."""

import subprocess
import sys
import zipfile

from .conftest import ROOT

CHECK = """
import pathlib, sys
import railyard
assert not pathlib.Path(railyard.__file__).resolve().is_relative_to(pathlib.Path(sys.argv[1])), railyard.__file__
import railyard.layouts  # a program registers the layouts before it loads an inventory
from railyard.inventory import load_inventory
from railyard.verbs.serve import launch_script
from railyard.verbs.nccl_check import PROBE
from railyard.verbs.sync import MANIFEST_SCRIPT
from railyard.verbs.capacity import HEADER_SCRIPT
inv = load_inventory(sys.argv[2])
print(launch_script(inv, sys.argv[3]))
assert PROBE.is_file() and MANIFEST_SCRIPT.is_file() and HEADER_SCRIPT.is_file()
"""


def test_an_installed_wheel_has_its_roles_templates_and_scripts(tmp_path):
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w",
                        str(tmp_path / "dist"), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    (wheel,) = (tmp_path / "dist").glob("railyard-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for want in ("railyard/roles/vllm/defaults/main.yml", "railyard/layouts/single_node/dp_ep.yml",
                 "railyard/roles/vllm/templates/launch_server.sh.j2", "railyard/scripts/nccl_probe.py",
                 "railyard/scripts/manifest.py", "railyard/scripts/port_probe.py", "railyard/py.typed"):
        assert want in names
    # the lab is test tooling, its own distribution (lab/): none of it, stand-ins included, ships in railyard's wheel
    lab = [n for n in names if n.startswith("railyard_lab/") or "/lab/" in n
           or n.rsplit("/", 1)[-1] in ("memlock.c", "tokenizer.json", "tools.py")]
    assert not lab, lab
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    r = subprocess.run([sys.executable, "-c", CHECK, str(ROOT), str(ROOT / "inventory" / "hgx8-h200.yml"),
                        str(tmp_path / "out")], capture_output=True, text=True, cwd=tmp_path,
                       env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}, timeout=60)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "out" / "launch_server.sh").read_text().startswith("#!/usr/bin/env bash")
