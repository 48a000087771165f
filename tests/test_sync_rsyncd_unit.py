"""sync-model's rsyncd transport without the lab: the rendered config and commands, their quoting, the
one-line errors, the inventory's checks, and one real daemon on loopback under a hostile path."""

import copy
import ipaddress
import os
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from railyard.verbs import rsyncd
from railyard.errors import InventoryError
from railyard.inventory import Host, Rail, load_inventory
from railyard.verbs.sync import rsync_args
from railyard.transport import LocalSession

from .test_inventory import BASE, write

HOSTILE = "models/it's $(touch pwned) `id` \"x\"; *"


def _host(name, ip, rail="cx8r1", **v):
    return Host(name, 1, ip, 22, "root", "local", "", {rail: Rail(rail, "mlx5_1", ipaddress.IPv4Interface(f"{ip}/24"))},
                {"cluster_serve_rail": rail, **v})


def test_config_binds_the_rail_address_and_admits_only_the_source():
    conf = rsyncd.render_config("198.18.101.12", "198.18.101.11", 4, 120)
    lines = [ln.strip() for ln in conf.splitlines()]
    for want in ("address = 198.18.101.12", "hosts allow = 198.18.101.11", "hosts deny = *", "max connections = 8",
                 "auth users = railyard", "secrets file = @DIR@/secrets", "use chroot = no", "read only = false",
                 "uid = @UID@", "gid = @GID@", "timeout = 120", "path = @DIR@/module", "reverse lookup = no"):
        assert want in lines, want
    assert "[railyard]" in lines
    with pytest.raises(ValueError):
        rsyncd.render_config("198.18.101.12\nhosts allow = *", "198.18.101.11", 4, 120)


def test_ports_are_the_configured_one_or_a_few_free_candidates():
    assert rsyncd.candidate_ports(8873) == [8873]
    ports = rsyncd.candidate_ports(0)
    assert len(set(ports)) == len(ports) == 6 and all(20000 <= p <= 32767 for p in ports)


def test_daemon_script_quotes_the_path_and_never_carries_the_secret():
    s = rsyncd.daemon_script("~/" + HOSTILE, "198.18.101.12", "198.18.101.11", [20001, 20002], 4, 60)
    assert subprocess.run(["sh", "-n", "-c", s]).returncode == 0
    assert "ln -s -- \"$HOME\"/" + shlex.quote(HOSTILE) + " \"$d/module\"" in s
    assert "--daemon --no-detach" in s and "for port in 20001 20002; do" in s
    assert "IFS= read -r secret" in s and "RSYNC_PASSWORD" not in s
    assert ": (0C6512C6|C612650C):$hp 00000000:0000 0A " in s  # 198.18.101.12 in /proc/net/tcp, both byte orders


def test_client_command_reads_the_secret_from_stdin_and_dials_from_the_rail():
    c = rsyncd.client_command("~/" + HOSTILE, "198.18.101.11", "198.18.101.12", 20001, rsync_args("whole", 12.5, 40), 40)
    assert c.startswith("cd \"$HOME\"/" + shlex.quote(HOSTILE) + " && IFS= read -r RSYNC_PASSWORD && "
                        "export RSYNC_PASSWORD && exec rsync ")
    argv = shlex.split(c.split(" && exec ", 1)[1])
    assert argv[:len(rsync_args("whole", 12.5, 40))] == rsync_args("whole", 12.5, 40)  # the SSH path's options
    assert "--whole-file" in argv and "--partial" in argv and "--contimeout=40" in argv
    assert argv[-3:] == ["--address=198.18.101.11", "./", "rsync://railyard@198.18.101.12:20001/railyard/"]
    assert "--append-verify" in rsyncd.client_command("/m", "10.0.0.1", "10.0.0.2", 1, rsync_args("append", 0))


def test_daemon_and_client_errors_are_one_line_naming_the_host_and_the_fix():
    b, a = _host("B", "198.18.101.12"), _host("A", "198.18.101.11")
    line, fix = rsyncd.start_error(b, "in-use", "8873", "bind() failed: Address already in use", 8873)
    assert line == "B: rsync daemon: port 8873 on 198.18.101.12 is in use (bind() failed: Address already in use)"
    assert "sync_rsyncd_port" in fix and "\n" not in line + fix
    line, fix = rsyncd.start_error(b, "start", "8873", "bind() failed: Cannot assign requested address", 0)
    assert "198.18.101.12 is not an address of the host" in line and "cluster_serve_rail" in fix
    line, fix = rsyncd.client_error("@ERROR: auth failed on module railyard\nrsync error: ...", b, a, 8873)
    assert line == "the rsync daemon on B (198.18.101.12:8873) refused the secret (auth failed)"
    line, fix = rsyncd.client_error("@ERROR: access denied to railyard from UNDETERMINED (198.18.0.11)\n", b, a, 8873)
    assert "refused 198.18.0.11: only 198.18.101.11" in line and "serve rail cx8r1" in fix
    line, _ = rsyncd.client_error("@ERROR: Unknown module 'railyard'\n", b, a, 8873)  # list = false hides it
    assert line.startswith("the rsync daemon on B (198.18.101.12:8873) refused the source: only 198.18.101.11")
    assert rsyncd.client_error("rsync: write failed: No space left on device (28)", b, a, 1) is None


def test_inventory_checks_the_transport_and_the_port(tmp_path):
    def problems(**v):
        data = copy.deepcopy(BASE)
        data["all"]["vars"].update(v)
        with pytest.raises(InventoryError) as e:
            load_inventory(write(tmp_path, data))
        return [str(p) for p in e.value.problems]
    got = problems(sync_transport="rsync")
    assert len(got) == 1 and got[0].endswith("all.vars.sync_transport = 'rsync': must be ssh or rsyncd"), got
    assert str(tmp_path / "inv.yml") in got[0]
    assert any("sync_rsyncd_port = 70000: must be between 0 and 65535" in p for p in problems(sync_rsyncd_port=70000))
    inv = load_inventory(write(tmp_path, copy.deepcopy(BASE)))
    assert inv.head.vars["sync_transport"] == "ssh" and inv.head.vars["sync_rsyncd_port"] == 0


@pytest.mark.skipif(not os.path.exists("/usr/bin/rsync"), reason="needs rsync")
def test_a_real_daemon_on_loopback_copies_into_a_hostile_path_and_leaves_nothing(tmp_path):
    """The whole life of one daemon, on this machine (loopback stands in for the rail)."""
    src, dst = tmp_path / "src", tmp_path / HOSTILE
    src.mkdir()
    dst.mkdir(parents=True)
    (src / "model-00001.safetensors").write_bytes(os.urandom(300_000))
    (src / "odd name 'q'.json").write_text("{}")
    target = _host("T", "127.0.0.1", sync_rsyncd_port=0)
    d = rsyncd.Daemon(target, LocalSession(target))
    assert d.start(str(dst), target, 2, 30, 60, 0), d.error
    try:
        assert d.port and os.path.isdir(d.tmpdir) and oct(os.stat(d.tmpdir).st_mode & 0o777) == "0o700"
        assert oct(os.stat(os.path.join(d.tmpdir, "secrets")).st_mode & 0o777) == "0o600"
        assert d.secret not in open(os.path.join(d.tmpdir, "rsyncd.conf")).read()
        files = b"\0".join(p.name.encode() for p in src.iterdir()) + b"\0"
        c = rsyncd.client_command(str(src), "127.0.0.1", "127.0.0.1", d.port, rsync_args("whole", 0, 30), 30)
        wrong = subprocess.run(["sh", "-c", c], input=b"not-the-secret\n" + files, capture_output=True)
        assert wrong.returncode == 5
        assert rsyncd.client_error(wrong.stderr.decode(), target, target, d.port)[0].endswith("(auth failed)")
        r = subprocess.run(["sh", "-c", c], input=d.secret.encode() + b"\n" + files, capture_output=True)
        assert r.returncode == 0, r.stderr
        assert d.secret.encode() not in r.stdout + r.stderr
        for p in src.iterdir():
            assert (dst / p.name).read_bytes() == p.read_bytes()
            assert int((dst / p.name).stat().st_mtime) == int(p.stat().st_mtime)
        assert not (tmp_path / "pwned").exists() and not os.path.exists("pwned")
    finally:
        assert d.stop()
    assert not os.path.exists(d.tmpdir)
    assert d.secret not in d.result.stdout + d.result.stderr


def test_a_port_taken_on_every_address_fails_the_start_with_its_line(tmp_path):
    import socket
    holder = socket.socket()
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    holder.bind(("0.0.0.0", 0))
    holder.listen()
    port = holder.getsockname()[1]
    target = _host("T", "127.0.0.1")
    d = rsyncd.Daemon(target, LocalSession(target))
    try:
        assert not d.start(str(tmp_path), target, 1, 30, 60, port)
    finally:
        holder.close()
    assert d.error == f"T: rsync daemon: port {port} on 127.0.0.1 is in use (bind() failed: Address already in use " \
                      "(address-family 2))", d.error
    assert "sync_rsyncd_port" in d.hint
    d.stop()
    assert not os.path.exists(d.tmpdir)


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("runuser"), reason="needs root and runuser")
def test_a_daemon_of_a_user_that_is_not_root_runs_as_that_user():
    """An SSH user that is not root: no uid/gid lines (rsyncd's setgroups would refuse every transfer)."""
    with tempfile.TemporaryDirectory(prefix="railyard-test-") as tmp:  # not under root's 0700 pytest dir
        _as_nobody(Path(tmp))


def _as_nobody(tmp_path):
    for d in ("src", "dst"):
        (tmp_path / d).mkdir()
    (tmp_path / "src" / "f.safetensors").write_bytes(os.urandom(10_000))
    os.chmod(tmp_path, 0o755)
    subprocess.run(["chown", "-R", "nobody", str(tmp_path)], check=True)
    as_nobody = ["runuser", "-u", "nobody", "--", "sh", "-c"]
    script = rsyncd.daemon_script(str(tmp_path / "dst"), "127.0.0.1", "127.0.0.1", rsyncd.candidate_ports(0), 1, 30)
    p = subprocess.Popen(as_nobody + [script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        p.stdin.write("s3cret\n")
        p.stdin.flush()
        first, ready = p.stdout.readline().split(), p.stdout.readline().split()
        assert ready[:2] == [rsyncd.MARK, "ready"], ready
        conf = open(os.path.join(first[2], "rsyncd.conf")).read()
        assert "uid =" not in conf and "gid =" not in conf
        c = rsyncd.client_command(str(tmp_path / "src"), "127.0.0.1", "127.0.0.1", int(ready[2]), rsync_args("whole", 0, 30), 30)
        r = subprocess.run(as_nobody + [c], input=b"s3cret\nf.safetensors\0", capture_output=True)
        assert r.returncode == 0, r.stderr
        assert (tmp_path / "dst" / "f.safetensors").read_bytes() == (tmp_path / "src" / "f.safetensors").read_bytes()
    finally:
        subprocess.run(["kill", first[3]])
        assert f"{rsyncd.MARK} removed" in p.communicate(timeout=10)[0]
