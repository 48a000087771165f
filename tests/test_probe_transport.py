"""The joined probe script and the local transport, run for real under /bin/sh; quoting."""

import subprocess

from railyard.inventory import Host
from railyard.facts.probe import Section, fan_out, joined_script, new_token, split_blocks, split_output
from railyard.transport.runner import Runner
from railyard.transport import LocalSession, RemotePath, cmd, q


def local_host(name="L", **vars_) -> Host:
    v = {"ssh_connect_timeout": 5, "ssh_command_timeout": 30, "ssh_parallel": 4}
    v.update(vars_)
    return Host(name, 0, "", 22, "", "local", "", {}, v)


def sh(script: str) -> str:
    return subprocess.run(["/bin/sh", "-c", script], capture_output=True, text=True).stdout


def test_sections_run_in_parallel_and_split_back():
    secs = [Section("one", cmd("printf", "a\\nb\\n")), Section("two", "echo two; exit 3"),
            Section("nl", cmd("printf", "no newline"))]
    tok = new_token()
    out = split_output(sh(joined_script(secs, tok)), secs, tok)
    assert out["one"].text == "a\nb\n" and out["one"].rc == 0
    assert out["two"].text == "two\n" and out["two"].rc == 3
    assert out["nl"].text == "no newline\n"


def test_missing_tool_is_named_and_timeout_is_reported():
    secs = [Section("gone", cmd("no-such-tool-xyz", "--flag"), "no-such-tool-xyz"),
            Section("slow", "sleep 5", None, timeout=1)]
    tok = new_token()
    out = split_output(sh(joined_script(secs, tok)), secs, tok)
    assert out["gone"].missing_tool == "no-such-tool-xyz" and out["gone"].rc == 127
    assert out["slow"].timed_out


def test_a_line_longer_than_a_pipe_write_comes_back_whole_and_loses_no_other_sections_line():
    """A `ps` line of a process with a long command line (a railyard probe's own `sh -c`, a vLLM serve with its
    JSON configs) printed while the other sections print theirs: stop 49's CI lost a `docker inspect` line
    (read as "container ... is unknown") into the middle of such a line, which `sed -u` wrote in two pieces."""
    long_lines = "i=0; while [ $i -lt 40 ]; do printf '%020000d\\n' $i; i=$((i+1)); done"
    secs = [Section("ps", long_lines)] + [Section(f"c{i}", f"sleep 0.0{i}; echo {i} running") for i in range(8)]
    for _ in range(5):
        tok = new_token()
        raw = sh(joined_script(secs, tok))
        assert max(len(line.encode()) + 1 for line in raw.splitlines()) <= 4096   # each one write, never interleaved
        out = split_output(raw, secs, tok)
        assert out["ps"].text.splitlines() == [f"{i:020000d}" for i in range(40)]
        assert [out[f"c{i}"].text for i in range(8)] == [f"{i} running\n" for i in range(8)]


def test_sections_do_not_read_stdin_and_foreign_lines_are_ignored():
    secs = [Section("cat", "cat")]
    tok = new_token()
    text = "garbage line\n" + subprocess.run(["/bin/sh", "-c", joined_script(secs, tok)], input="SECRET\n",
                                             capture_output=True, text=True).stdout
    out = split_output(text, secs, tok)
    assert out["cat"].text == "" and out["cat"].rc == 0


def test_fan_out_blocks():
    out = sh(fan_out([("x", cmd("echo", "hello")), ("y", "exit 4")]))
    blocks = split_blocks(out)
    assert blocks["x"] == (0, "hello") and blocks["y"][0] == 4


def test_hostile_values_stay_values(tmp_path):
    canary = tmp_path / "pwned"
    hostile = f"x; touch {canary}; echo $(id) `id` 'quote\" \\"
    out = sh(cmd("printf", "%s", hostile))
    assert out == hostile and not canary.exists()
    assert sh("echo " + q(RemotePath("~/models/a b;rm"))).strip().endswith("/models/a b;rm")
    assert q(RemotePath("~/x")).startswith('"$HOME"/')


def test_local_session_result_and_timeout():
    s = LocalSession(local_host())
    r = s.run("echo out; echo err >&2; exit 5")
    assert (r.rc, r.stdout, r.stderr, r.ok) == (5, "out\n", "err\n", False)
    r = s.run("sleep 10", timeout=0.5)
    assert r.error.kind == "timeout" and r.rc is None and r.duration < 5


def test_runner_fans_out_and_contains_a_crash():
    hosts = [local_host("L1"), local_host("L2")]
    with Runner(hosts) as r:
        res = r.run(lambda h: cmd("echo", h.name))
        assert {k: v.stdout.strip() for k, v in res.items()} == {"L1": "L1", "L2": "L2"}

        def boom(session):
            if session.host.name == "L2":
                raise RuntimeError("bug")
            return "fine"
        out = r.each(boom)
        assert out["L1"] == "fine" and out["L2"].error.kind == "ssh_error"


def test_runner_reports_each_host_as_it_finishes_and_keeps_the_hosts_order():
    hosts = [local_host("slow"), local_host("fast"), local_host("mid")]
    heard = []
    with Runner(hosts) as r:
        out = r.each(lambda s: s.run({"slow": "sleep 0.6", "fast": "true", "mid": "sleep 0.3"}[s.host.name]).rc,
                     on_done=lambda name, rc: heard.append((name, rc)))
    assert heard == [("fast", 0), ("mid", 0), ("slow", 0)] and list(out) == ["slow", "fast", "mid"]


def test_a_host_that_drops_the_handshake_is_one_classified_line_no_traceback(tmp_path):
    """paramiko logs a dropped banner with a traceback from its own thread; the user sees railyard's line."""
    import copy
    import socket
    import threading

    import yaml

    from .conftest import inv_cmd
    from .test_inventory import BASE
    stop = threading.Event()

    def drop(srv):
        while not stop.is_set():
            try:
                srv.accept()[0].close()
            except socket.timeout:
                pass

    data = copy.deepcopy(BASE)
    for h in data["all"]["children"]["stations"]["hosts"].values():
        srv = socket.socket()
        srv.bind(("127.0.0.1", 0))
        srv.listen(8)
        srv.settimeout(0.2)
        threading.Thread(target=drop, args=(srv,), daemon=True).start()
        h.update(ansible_host="127.0.0.1", ansible_port=srv.getsockname()[1])
    p = tmp_path / "inv.yml"
    p.write_text(yaml.safe_dump(data))
    try:
        r = inv_cmd("preflight", "-i", str(p), timeout=120)
    finally:
        stop.set()
    out = r.stdout + r.stderr
    assert r.returncode == 1 and "Traceback" not in out and "paramiko" not in out, out[-2000:]
    assert "dropped the connection" in out
