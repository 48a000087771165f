"""`inv collect` on the two-station lab with the model served: one archive with every host's
state, the services' logs, NCCL logs and the judge's verdicts, preflight's document, and no key
anywhere in it; a host that cannot be reached is named in the manifest and the rest still lands.

On the vLLM stand-in (up in 2 s): collect reads containers, logs and NCCL logs, which the stand-in
writes as the real engine and the GPU layer do."""

import json
import tarfile

import pytest

from railyard_lab import faults

from .conftest import home, inv_cmd, station_ready

pytestmark = pytest.mark.lab


def run(*args, inv, timeout=300):
    return inv_cmd(*args, env={"RAILYARD_INVENTORY": str(inv)}, timeout=timeout)


def members(path):
    with tarfile.open(path) as tar:
        return {m.name.split("/", 1)[1]: tar.extractfile(m).read().decode(errors="replace")
                for m in tar.getmembers() if m.isfile()}


@pytest.fixture(scope="module")
def served(lab_inventory):
    with station_ready(lab_inventory) as inv:
        assert run("launch", inv=inv).returncode == 0
        yield inv


def test_the_archive_holds_every_hosts_state_the_logs_and_verdicts_and_no_key(served, tmp_path):
    out = tmp_path / "ticket.tar.gz"
    r = run("collect", "--out", str(out), inv=served)
    assert r.returncode == 0, r.stdout + r.stderr
    files = members(out)
    manifest = json.loads(files["manifest.json"])
    assert manifest["layout"] == "multinode_tp" and set(manifest["hosts"]) == {"A", "B"} and not manifest["skipped"]
    for h in ("A", "B"):
        for section in ("nvidia-smi-q", "ibdev2netdev", "show_gids", "ip-d-link", "dmesg", "docker-ps",
                        "ethtool-S.cx8r1"):
            assert f"{h}/{section}.txt" in files, (h, section)
    assert "mlx5_1 port 1 ==> cx8r1 (Up)" in files["A/ibdev2netdev.txt"]
    assert "mtu 9000" in files["B/ip-d-link.txt"]
    assert "Application startup complete" in files["A/head.log.txt"] and "GPU_UUID=" in files["B/worker-1.env.txt"]
    verdicts = json.loads(files["verdicts.json"])
    assert len(verdicts) == 2 and all(v["verdict"] == "pass" and v["net_transport"] == "IB" for v in verdicts)
    pre = json.loads(files["preflight.json"])  # while serving, its GPU check names the engine on the GPU
    assert set(pre) >= {"ok", "checks", "data"} and {c["host"] for c in pre["checks"]} >= {"A", "B"}
    assert {c["check"] for c in pre["checks"]} >= {"ssh", "mtu", "rail_link", "image"}
    key = (home("A") / ".config" / "railyard" / "vllm-api-key").read_text().strip()
    assert len(key) > 20 and not [n for n, text in files.items() if key in text]
    assert all(len(t.encode()) <= (2 << 20) + 200 for t in files.values())
    assert oct(out.stat().st_mode & 0o777) == "0o600"


def test_a_host_that_cannot_be_reached_is_named_and_the_rest_is_collected(served, tmp_path):
    faults.fault("B", "sshd-down")
    try:
        out = tmp_path / "partial.tar.gz"
        r = run("collect", "--out", str(out), "--no-preflight", inv=served)
        assert r.returncode == 1 and "B: " in r.stdout, r.stdout + r.stderr
        files = members(out)
        manifest = json.loads(files["manifest.json"])
        assert "error" in manifest["hosts"]["B"] and "A/head.log.txt" in files and "preflight.json" not in files
    finally:
        faults.heal()
