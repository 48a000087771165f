"""`inv launch`'s bring-up timeline against FakeSession hosts whose docker answers with real vLLM CPU
logs (tests/fixtures/real/vllm-cpu/ORIGINS.md): what a user sees in the table and in --json, the
previous launch's figures beside this one's, and the file kept on the deployment's first host."""

from __future__ import annotations

import io
import json
import re

import pytest
from rich.console import Console

from railyard.cli import serve as cli
from railyard.verbs import serve as L
from railyard.apply import executor as ops
from railyard.apply import timeline as T
from railyard.verbs.serve import launch_report
from railyard.testing import FakeClock
from railyard.transport.runner import Runner
from railyard.engines.vllm import MILESTONE_GREP

from .conftest import real
from .test_ops_launch import Docker, current
from .test_plan import hgx_plan, station_plan

TP1 = {"weights_loaded": 78.19, "kv_cache_allocated": 79.41, "engine_initialised": 82.21, "api_ready": 84.07}
TP2 = {"weights_loaded": 40.75, "kv_cache_allocated": 42.08, "engine_initialised": 44.63, "api_ready": 46.43}


@pytest.fixture(autouse=True)
def clock(monkeypatch):
    """The executor's gates wait on a fake clock: no test here sleeps for real."""
    monkeypatch.setattr(ops, "clock", FakeClock())


def plain(log_t: str) -> str:
    """`docker logs` without -t: the same lines without docker's time."""
    return "".join(line.split(" ", 1)[1] + "\n" for line in log_t.splitlines() if " " in line)


class TimedDocker(Docker):
    """The tiny docker host, whose container logs one real capture: `docker logs -t` with docker's times,
    `docker inspect` with its StartedAt; and a head whose files railyard reads and writes."""

    def __init__(self, host, capture=None, untimed=None, started_at="2026-12-02T03:06:00Z"):
        self.log_t = real(f"vllm-cpu/{capture}/logs-t.txt") if capture else ""
        self.started_at = json.loads(real(f"vllm-cpu/{capture}/state.json"))["StartedAt"] if capture else started_at
        super().__init__(host, log=plain(self.log_t) if capture else real(f"vllm-cpu/{untimed}"))
        self.files: dict[str, str] = {}
        first = [(re.compile(r"^docker logs --timestamps "), self.logs_t),
                 (re.compile(r"^docker inspect --format '\{\{json \.\}\}' (\S+)$"), self.inspect_started),
                 (re.compile(r"^cat -- "), self.cat), (re.compile(r"^set -e; umask 077; f="), self.write)]
        self.session.rules[:0] = first

    def logs_t(self, command):
        text = self.log_t or self.log  # an untimed capture: lines without docker's time, as they were captured
        return 0, "".join(ln + "\n" for ln in text.splitlines() if any(p in ln for p in MILESTONE_GREP))

    def inspect_started(self, command):
        rc, out, *err = self.inspect(command)
        if rc:
            return (rc, out, *err)
        doc = json.loads(out)
        doc["State"]["StartedAt"] = self.started_at
        return 0, json.dumps(doc) + "\n"

    def cat(self, command):
        path = command.split("cat -- ", 1)[1].split(" 2>/dev/null", 1)[0]
        return 0, self.files.get(path, "@@railyard-missing\n")

    def write(self, command, stdin=None):
        return 0, ""


def head_files(d: TimedDocker):
    """Let the fake head keep what write_remote sends (FakeSession answers get no stdin: capture it here)."""
    session = d.session
    run = session.run

    def run_keeping(command, timeout=None, stdin=None, on_output=None):
        if command.startswith("set -e; umask 077; f=") and stdin is not None:
            target = command.split("f=", 1)[1].split(";", 1)[0]
            d.files[target] = stdin.decode()
            assert 'mv -f "$t" "$f"' in command  # written to a temporary file, then renamed: atomic
        return run(command, timeout=timeout, stdin=stdin, on_output=on_output)

    session.run = run_keeping


def launch_once(inv, plan, d, recreate=False):
    with Runner(inv.hosts, sessions={inv.hosts[0].name: d.session}) as runner:
        rep = ops.apply(plan, runner, current(plan), "~/models/m", recreate, 20, False, None)
        L.keep_timeline(inv, plan, runner, rep)
    return rep


def shown(rep) -> str:
    con = Console(record=True, width=220, file=io.StringIO())
    cli._print_launch(rep, con, "launch")
    return con.export_text()


def test_a_launch_shows_each_milestone_from_the_engines_own_log_and_keeps_it_on_the_head():
    inv, plan = hgx_plan()
    d = TimedDocker(inv.hosts[0], "timed-tp1")
    head_files(d)
    rep = launch_once(inv, plan, d)
    assert rep.ok and rep.timeline[0].seconds == TP1 and rep.timeline[0].previous is None
    path = '"$HOME"/.cache/railyard/serve/vllm-tp8/launch-timeline.json'
    assert rep.timeline_file == "G1:~/.cache/railyard/serve/vllm-tp8/launch-timeline.json"
    kept = json.loads(d.files[path])
    assert kept["deployment"] == "vllm-tp8" and kept["services"][0]["seconds"] == TP1
    out = shown(rep)
    assert "weights loaded" in out and "78.2 s" in out and "84.1 s" in out and "kept for the next launch" in out


def test_the_next_launch_shows_the_previous_launchs_figures_beside_its_own():
    inv, plan = hgx_plan()
    d = TimedDocker(inv.hosts[0], "timed-tp1")
    head_files(d)
    launch_once(inv, plan, d)
    d2 = TimedDocker(inv.hosts[0], "timed-tp2")
    d2.files = d.files  # the same head: a second operator, another machine, the same file
    head_files(d2)
    for svc in plan.services():
        d2.containers[svc.spec.name] = "0123456789abcdef"  # what the first launch left, another config
    rep = launch_once(inv, plan, d2, recreate=True)
    t = rep.timeline[0]
    assert t.seconds == TP2 and t.previous == TP1
    assert rep.timeline_previous["by"] and rep.timeline_previous["written_at"].endswith("Z")
    out = shown(rep)
    assert "40.8 s (78.2 s)" in out and "46.4 s (84.1 s)" in out and "previous launch:" in out
    doc = json.loads(launch_report(rep).json())
    row = doc["data"]["timeline"][0]
    assert doc["ok"] and row["seconds"] == TP2 and row["previous"] == TP1 and row["not_applicable"] == []
    assert [c["check"] for c in doc["checks"]] == ["launch"] and doc["checks"][0]["status"] == "pass"


def test_a_headless_rank_has_no_api_and_a_log_without_dockers_times_is_not_seen():
    inv, plan, _ = station_plan()
    a = TimedDocker(inv.host("A"), "timed-tp1")
    b = TimedDocker(inv.host("B"), untimed="tpB.log")  # captured without docker: no times to read
    head_files(a)
    with Runner(inv.hosts, sessions={"A": a.session, "B": b.session}) as runner:
        rep = ops.apply(plan, runner, current(plan), "~/models/m", False, 20, False, None)
        L.keep_timeline(inv, plan, runner, rep)
    by = {t.service: t for t in rep.timeline}
    assert by["head"].seconds == TP1
    assert by["worker-1"].seconds == {"weights_loaded": None, "kv_cache_allocated": None}
    assert by["worker-1"].not_applicable == ["engine_initialised", "api_ready"]
    out = shown(rep)
    row = next(ln for ln in out.splitlines() if "worker-1" in ln)
    assert row.count("not seen") == 2 and row.count("n/a") == 2


def test_a_failed_launch_shows_how_far_it_got_and_keeps_nothing():
    inv, plan = hgx_plan()
    d = TimedDocker(inv.hosts[0], "timed-tp1")
    cut = d.log_t[:d.log_t.index("init engine")].rsplit("\n", 1)[0] + "\n"
    d.log_t, d.log = cut, plain(cut)  # the engine never finished: no ready line
    head_files(d)
    with Runner(inv.hosts, sessions={"G1": d.session}) as runner:
        rep = ops.apply(plan, runner, current(plan), "~/models/m", False, 2, False, None)
        L.keep_timeline(inv, plan, runner, rep)
    assert not rep.ok and rep.timeline[0].seconds == {**TP1, "engine_initialised": None, "api_ready": None}
    assert not d.files and not rep.timeline_file
    doc = json.loads(launch_report(rep).json())
    assert not doc["ok"] and doc["checks"][0]["status"] == "fail" and doc["data"]["timeline"][0]["seconds"]["api_ready"] is None
    out = shown(rep)
    assert "not seen" in out and "FAILED" in out


def test_an_unreadable_kept_file_is_no_previous_launch():
    assert T.parse_document("{half") is None and T.parse_document('{"services": 3}') is None
    assert T.parse_document(None) is None


def test_launch_json_of_a_dry_run_skips_every_service():
    inv, plan = hgx_plan()
    rep = ops.LaunchReport(plan.hosts(), {s.name: "docker run ..." for s in plan.services()}, plan=plan)
    doc = json.loads(launch_report(rep, dry_run=True).json())
    assert doc["ok"] and {c["status"] for c in doc["checks"]} == {"skip"} and doc["data"]["dry_run"]
