"""sync-model over the rsyncd transport on the lab: a real one-time rsync daemon on B's rail address,
real rsync from A, verified on both; the secret in no argv and no output, nothing left behind."""

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

import railyard_lab as lab

from railyard.verbs import rsyncd
from railyard.inventory import load_inventory
from railyard.transport.runner import Runner
from railyard.verbs.sync import SyncOptions, rsync_args, sync_model

from .conftest import ROOT, as_a_terminal_job, home, inv_cmd, wait_for
from . import test_lab_sync
from .test_lab_sync import SHARDS, _kill_rsync_on_A, files_of_A, model_dir

pytestmark = pytest.mark.lab
checkpoint, fresh = test_lab_sync.checkpoint, test_lab_sync.fresh  # the sync tests' fixtures, shared
RSYNCD = ("--transport", "rsyncd")


def sync(inv_path, **kw):
    return sync_model(load_inventory(inv_path), SyncOptions(transport="rsyncd", **kw), None)


def _daemon_dirs():
    return glob.glob("/tmp/railyard-rsyncd.*")  # the lab hosts share this machine's /tmp


def _daemon_procs():
    """Processes of any railyard rsync daemon (its shell or the daemon) on this machine and so on every lab host."""
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if b"railyard-rsyncd" in open(f"/proc/{pid}/cmdline", "rb").read():
                    out.append(pid)
            except OSError:
                pass
    return out


def _all_cmdlines() -> bytes:
    text = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                text.append(open(f"/proc/{pid}/cmdline", "rb").read())
            except OSError:
                pass
    return b"\n".join(text)


def _nothing_left():
    wait_for(lambda: not _daemon_dirs() and not _daemon_procs(), "the daemon and its directory to be gone", timeout=10)


def test_a_fresh_copy_is_equal_the_secret_in_no_argv_or_output_and_the_daemon_gone_after(fresh):
    p = subprocess.Popen([sys.executable, "-m", "invoke", "sync-model", "-i", str(fresh), *RSYNCD, "--json",
                          "--bwlimit", "60"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    secret_file = wait_for(lambda: glob.glob("/tmp/railyard-rsyncd.*/secrets") or p.poll() is not None,
                           "the daemon's secrets file")
    assert p.poll() is None, p.communicate()
    secret_file = secret_file[0]
    secret = open(secret_file).read().strip().split(":", 1)[1].encode()
    assert len(secret) == 64 and oct(os.stat(secret_file).st_mode & 0o777) == "0o600"
    assert oct(os.stat(os.path.dirname(secret_file)).st_mode & 0o777) == "0o700"
    seen_rsync = 0
    while p.poll() is None:  # every process's argv on this machine (the lab hosts' too) while the copy runs
        cmdlines = _all_cmdlines()
        assert secret not in cmdlines
        seen_rsync += b"rsync://railyard@" in cmdlines
        time.sleep(0.05)
    out, err = p.communicate()
    assert p.returncode == 0, out.decode()[-3000:] + err.decode()[-3000:]
    assert seen_rsync and secret not in out + err
    doc = json.loads(out)
    b = next(h for h in doc["data"]["hosts"] if h["host"] == "B")
    assert doc["ok"] and doc["data"]["transport"] == "rsyncd" and b["differences"] == []
    assert b["copy"]["send"] == files_of_A()
    for name in os.listdir(model_dir("A")):
        if name != ".cache":
            sa, sb = os.stat(model_dir("A") / name), os.stat(model_dir("B") / name)
            assert (model_dir("B") / name).read_bytes() == (model_dir("A") / name).read_bytes()
            assert (sb.st_mode, sb.st_uid, sb.st_gid, int(sb.st_mtime)) == (sa.st_mode, sa.st_uid, sa.st_gid,
                                                                              int(sa.st_mtime))  # as -a over SSH
    _nothing_left()
    again = inv_cmd("sync-model", "-i", str(fresh), *RSYNCD)
    assert again.returncode == 0 and "nothing to send" in again.stdout and not _daemon_procs()


def test_the_daemon_admits_only_the_sources_rail_address_and_the_secret(fresh):
    inv = load_inventory(fresh)
    a, b = inv.head, inv.host("B")
    with Runner([a, b]) as r:
        d = rsyncd.Daemon(b, r.session(b))
        assert d.start(b.vars["model_path"], a, 2, 20, 120, 0), d.error
        try:
            probe = "rsync --contimeout=3 --list-only {} rsync://railyard@{}:{}/railyard/ 2>&1; echo rc=$?"
            files = b"config.json\0"
            wrong = r.session(a).run(rsyncd.client_command(a.vars["model_path"], a.serve_rail.ip, b.serve_rail.ip,
                                                           d.port, rsync_args("whole", 0, 20), 20), stdin=b"0" * 64 + b"\n" + files)
            assert wrong.rc == 5 and rsyncd.client_error(wrong.stderr, b, a, d.port)[0] == \
                f"the rsync daemon on B ({b.serve_rail.ip}:{d.port}) refused the secret (auth failed)"
            mgmt = r.session(a).run(probe.format("", b.address, d.port))  # B's management address: not bound
            assert "Connection refused" in mgmt.stdout and "rc=0" not in mgmt.stdout, mgmt.stdout
            other = r.session(a).run(probe.format(f"--address={a.address}", b.serve_rail.ip, d.port))
            assert "rc=0" not in other.stdout, other.stdout  # from A's management address: refused
            assert rsyncd.client_error(other.stdout, b, a, d.port)[0].endswith(
                f"only {a.serve_rail.ip} (the source's rail address) may connect"), other.stdout
        finally:
            assert d.stop()
    assert not os.path.exists(d.tmpdir) and not _daemon_procs()


def test_a_copy_killed_midway_resumes_and_no_daemon_outlives_either_run(fresh):
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("rep", sync(fresh, streams=1, bwlimit_mbps=40)))
    t.start()

    def done():
        return [n for n in (model_dir("B").glob("lab-padding-*.safetensors") if model_dir("B").exists() else [])
                if n.stat().st_size == (model_dir("A") / n.name).stat().st_size
                and int(n.stat().st_mtime) == int((model_dir("A") / n.name).stat().st_mtime)]
    wait_for(lambda: len(done()) >= 3, "three shards on B", timeout=30)
    assert _kill_rsync_on_A() >= 1
    t.join(60)
    first = result["rep"]
    assert not first.ok and first.copies["B"].errors and "run sync-model again" in first.hint
    _nothing_left()
    finished = {p.name: p.stat().st_ino for p in done()}
    assert 3 <= len(finished) < SHARDS
    total = sum(p.stat().st_size for p in model_dir("A").iterdir() if p.is_file())
    on_b = sum(p.stat().st_size for p in model_dir("B").glob("model-*"))
    second = sync(fresh)
    assert second.ok, (second.differences, second.copies["B"].errors)
    assert second.copies["B"].plan.resume and second.copies["B"].bytes_sent <= total - on_b + 1_000_000
    assert {n: os.stat(model_dir("B") / n).st_ino for n in finished} == finished
    _nothing_left()


def test_ctrl_c_or_a_killed_railyard_leaves_no_daemon(fresh):
    for sig in (signal.SIGINT, signal.SIGKILL):
        p = subprocess.Popen([sys.executable, "-m", "invoke", "sync-model", *RSYNCD, "--streams", "2", "--bwlimit", "20"],
                             cwd=ROOT, env=dict(os.environ, RAILYARD_INVENTORY=str(fresh)), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True,
                             preexec_fn=as_a_terminal_job)
        wait_for(lambda: _daemon_dirs() and model_dir("B").exists() and
                 sum(f.stat().st_size for f in model_dir("B").glob("*")) > 5_000_000, "the copy under way")
        os.killpg(p.pid, sig)  # ^C; or a railyard killed outright (its SSH connections drop)
        t0 = time.monotonic()
        _, err = p.communicate(timeout=30)
        if sig == signal.SIGINT:
            assert p.returncode == 130 and time.monotonic() - t0 < 5 and "Traceback" not in err
        _nothing_left()
    shutil.rmtree(home("A") / ".cache" / "railyard" / "lock")  # the killed run's head lock (inv unlock's job)
    assert sync(fresh).ok


def test_a_port_in_use_is_one_line_naming_the_host_and_the_fix(fresh):
    inv = load_inventory(fresh)
    ip = inv.host("B").serve_rail.ip
    holder = subprocess.Popen(["ip", "netns", "exec", f"{lab.NS_PREFIX}B", sys.executable, "-c",
                               f"import socket, time; s = socket.socket(); s.bind(('{ip}', 28731)); s.listen(); "
                               "print('up', flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "up"
        r = inv_cmd("sync-model", "-i", str(fresh), *RSYNCD, "--set", "sync_rsyncd_port=28731", "--json")
        assert r.returncode == 1 and "Traceback" not in r.stderr
        check = next(c for c in json.loads(r.stdout)["checks"] if c["check"] == "sync")
        assert (check["host"], check["status"]) == ("B", "fail")
        assert check["detail"] == f"copy failed: B: rsync daemon: port 28731 on {ip} is in use (another process listens there)"
        assert check["hint"] == "set sync_rsyncd_port to a free port, or 0 to let railyard pick one"
        plan = inv_cmd("sync-model", "-i", str(fresh), *RSYNCD, "--dry-run")
        assert plan.returncode == 0 and "nothing was changed" in plan.stdout and not _daemon_procs()
        assert "rsync --daemon --no-detach" in plan.stdout and f"hosts allow {inv.head.serve_rail.ip}" in plan.stdout
        assert f"--address={inv.head.serve_rail.ip} ./ rsync://railyard@{ip}:PORT/railyard/" in plan.stdout
        bad = inv_cmd("sync-model", "-i", str(fresh), "--transport", "scp")
        assert bad.returncode == 2 and bad.stderr.startswith("error: --transport 'scp': must be ssh or rsyncd")
    finally:
        holder.kill()
        holder.wait()
    _nothing_left()
