"""`inv hang-dump` without the lab: its readers on real captures (tests/fixtures/real/hang/, origins in
ORIGINS.md: a real NCCL hang on an H100, py-spy and gdb on a stopped Python process), the processes found
from the host side, and the whole dump of the two stations against fake hosts whose answers are those
captures, with the shared hung verdict monkeypatched."""

from __future__ import annotations

import json
import os
import pickle
import re
from dataclasses import dataclass, field

import pytest

from railyard.checks import stacks as S
from railyard.checks.hang import PS_LIMIT_S, parse_ps
from railyard.testing import FakeSession, answer
from railyard.transport.runner import Runner
from railyard.verbs import hang_dump as H

from .conftest import FIXTURES
from .test_plan import station_plan

HANG = FIXTURES / "real" / "hang"
ALLREDUCE = "h100-2rank-one-skips-allreduce_"


def text(name: str) -> str:
    return (HANG / name).read_text()


def spy_dumps() -> dict[tuple[int, bool], str]:
    """The capture's four dumps, (pid, native) -> py-spy's text (the file's `== pid` and `-- native` lines
    are the capturing script's, between py-spy's outputs)."""
    out = {}
    for block in text(ALLREDUCE + "py-spy-dump.txt").split("== pid ")[1:]:
        pid = int(block.split()[0])
        plain, _, native = block.partition("\n")[2].partition("-- native\n")
        out[(pid, False)], out[(pid, True)] = plain, native
    return out


def without_rc(name: str) -> str:
    """A capture of ours ends with the capturing shell's `rc=N` line."""
    return re.sub(r"^rc=\d+\n\Z", "", text(name), flags=re.M)


# ---------------------------------------------------------------- py-spy and gdb


def test_py_spy_reads_the_rank_in_the_collective_and_the_rank_that_skipped_it():
    d = spy_dumps()
    r0 = S.parse_py_spy(d[(530, False)])
    assert (r0.pid, r0.command, r0.python) == (530, "python3 /tmp/hang.py", "v3.12.3")
    main = r0.main()
    assert main is not None and (main.tid, main.state, main.name) == ("530", "active", "MainThread")
    assert str(S.waiting_frame(r0)) == "synchronize (torch/cuda/__init__.py:1162)"
    r1 = S.parse_py_spy(d[(531, False)])
    assert r1.main().state == "idle" and str(S.waiting_frame(r1)) == "<module> (hang.py:7)"


def test_py_spy_native_keeps_the_c_frames_and_still_waits_in_the_innermost_python_frame():
    d = spy_dumps()
    r0 = S.parse_py_spy(d[(530, True)])
    funcs = [f.func for f in r0.main().frames]
    assert funcs[9:14] == ["cuCtxSynchronize_v2", "0x7f795f00f57b", "cudaDeviceSynchronize",
                           "c10::cuda::device_synchronize", "THCPModule_cudaSynchronize"]
    assert r0.main().frames[9].where == "libcuda.so.580.159.04" and not r0.main().frames[9].python
    assert str(S.waiting_frame(r0)) == "synchronize (torch/cuda/__init__.py:1162)"
    r1 = S.parse_py_spy(d[(531, True)])
    assert str(r1.main().frames[0]) == "clock_nanosleep (libc.so.6)"
    assert str(S.waiting_frame(r1)) == "<module> (hang.py:7)"


def test_the_odd_rank_is_the_one_outside_the_collective_when_the_two_sides_tie():
    d = spy_dumps()
    g = S.group_ranks([("rank0 pid 530", S.waiting_frame(S.parse_py_spy(d[(530, True)]))),
                       ("rank1 pid 531", S.waiting_frame(S.parse_py_spy(d[(531, True)])))])
    assert [o.members for o in g.outliers] == [["rank1 pid 531"]]
    assert g.line() == "rank1 pid 531 in <module> (hang.py:7); 1 rank in synchronize (torch/cuda/__init__.py:1162)"


def test_the_odd_rank_is_the_smallest_group_when_the_others_agree_and_a_missing_stack_is_named():
    wait = S.Frame("dequeue", "vllm/distributed/device_communicators/shm_broadcast.py:495", True)
    stall = S.Frame("lab_stall", "engine_site.py:40", True)
    g = S.group_ranks([("A/head pid 1 VLLM::Worker_TP0", wait), ("B/w pid 2 VLLM::Worker_TP1", stall),
                       ("C/w pid 3 VLLM::Worker_TP2", wait), ("D/w pid 4 VLLM::Worker_TP3", None)])
    assert g.line() == ("B/w pid 2 VLLM::Worker_TP1 in lab_stall (engine_site.py:40); 2 ranks in dequeue "
                        "(vllm/distributed/device_communicators/shm_broadcast.py:495); no stack from D/w pid 4 "
                        "VLLM::Worker_TP3")
    same = S.group_ranks([("a", wait), ("b", wait)])
    assert same.line().startswith("all 2 ranks in dequeue") and not same.outliers


def test_py_spy_on_a_stopped_process_fails_to_pause_it_and_nonblocking_reads_it():
    """Captured here: py-spy 0.4.3 cannot pause a process that SIGSTOP already stopped (`--native` and plain
    alike); `--nonblocking` reads it (it stays stopped, so the read is consistent)."""
    failed = S.parse_py_spy(without_rc("python3.11-two-threads_py-spy-native_sigstopped.txt"))
    assert failed.pid is not None and not failed.threads          # the header only: no stack
    out = "".join(f"@@try {name}\n{without_rc(f)}@@rc {rc}\n" for name, f, rc in (
        ("py-spy --native", "python3.11-two-threads_py-spy-native_sigstopped.txt", 1),
        ("py-spy", "python3.11-two-threads_py-spy-native_sigstopped.txt", 1),
        ("py-spy --nonblocking", "python3.11-two-threads_py-spy-nonblocking_sigstopped.txt", 0)))
    tool, st, failures = H.read_dump(failed.pid, out)
    assert tool == "py-spy --nonblocking" and st is not None
    assert failures[0] == ("py-spy --native: Failed to get stack traces: unexpected waitpid result "
                           "PtraceEvent(Pid(10473), SIGSTOP, 128) to 10473")
    assert [t.name for t in st.threads] == ["MainThread", "heartbeat"]
    assert str(S.waiting_frame(st)) == "lab_stall (stall.py:4)"


def test_gdb_reads_every_thread_the_main_one_first_and_names_no_python_frame():
    st = S.parse_gdb(without_rc("python3.11-two-threads_gdb-bt_sigstopped.txt"), 10473)
    assert [(t.tid, t.name, len(t.frames)) for t in st.threads] == [("10473", "python3", 16), ("10475", "python3", 13)]
    first = st.threads[0].frames[0]
    assert (first.func, first.where, first.python) == ("__GI___clock_nanosleep", "clock_nanosleep.c:48", False)
    assert str(S.waiting_frame(st)) == "__GI___clock_nanosleep (clock_nanosleep.c:48)"  # nothing better to name
    tool, got, failures = H.read_dump(10473, "@@try gdb\n" + without_rc("python3.11-two-threads_gdb-bt_sigstopped.txt")
                                      + "@@rc 0\n")
    assert tool == "gdb" and got is not None and not failures


def test_a_native_frame_of_a_gdb_trace_names_the_library_call_under_the_lock_primitives():
    st = S.parse_gdb('Thread 1 (Thread 0x7f00 (LWP 77) "VLLM::Worker_TP"):\n'
                     "#0  0x00007f in __futex_abstimed_wait_common (futex_word=0x1) at ./nptl/futex-internal.c:57\n"
                     "#1  0x00007e in ncclCommCount () from /usr/lib/libnccl.so.2\n", 77)
    assert str(S.waiting_frame(st)) == "ncclCommCount (libnccl.so.2)"


# ---------------------------------------------------------------- NCCL RAS


def ras_queries() -> list[str]:
    return text(ALLREDUCE + "nccl-ras-status_nccl2.28.9.txt").split("== b'")[1:]


def test_ras_status_names_the_mismatched_communicator_and_the_rank_behind():
    for query in ras_queries():  # the first with CLIENT PROTOCOL 2, the second STATUS alone: the same report
        st = S.parse_ras_status(query)
        assert (st.version, st.nodes, st.processes) == ("2.28.9", 1, 2)
        assert st.communicators == [{"group": 0, "ranks": 2, "status": "RUNNING", "errors": "MISMATCH"}]
        [issue] = st.issues
        assert (issue.communicator, issue.kind) == ("#0-0 (096f7190a46ab9aa)", "MISMATCH")
        assert issue.message == "Communicator ranks have different AllReduce operation counts"
        assert [(r.rank, r.operation, r.gpu, r.pid, r.node) for r in issue.ranks] == [
            (0, 2, "0", 530, "192.0.2.2"), (1, 1, "0", 531, "192.0.2.2")]
        assert issue.line() == ("communicator #0-0 MISMATCH: Communicator ranks have different AllReduce operation "
                                "counts; rank 1 (pid 531 on 192.0.2.2) at operation 1, the others at 2")


def test_ras_answer_and_a_refused_connection_read_as_such():
    got = H.read_ras(ras_queries()[0].partition("\n")[2], ("127.0.0.1", 28028))
    assert got["listening"] and got["line"].startswith("NCCL RAS 2.28.9: 1 node(s), 2 process(es), 1 communicator "
                                                       "group(s): communicator #0-0 MISMATCH")
    off = H.read_ras("@@ras refused\n", ("127.0.0.1", 28028))
    assert off["listening"] is False and off["line"].startswith("NCCL RAS: nothing listens on 127.0.0.1:28028")


def test_ras_address_from_the_service_env():
    assert H.ras_address({}) == ("127.0.0.1", 28028)
    assert H.ras_address({"NCCL_RAS_ADDR": "localhost:29000"}) == ("localhost", 29000)
    assert H.ras_address({"NCCL_RAS_ENABLE": "0"}) is None


# ---------------------------------------------------------------- the flight recorder


def test_flight_recorder_dumps_read_with_no_class_allowed():
    r0 = S.flight_record(S.load_flight_recorder((HANG / (ALLREDUCE + "flight-recorder_rank0.pickle")).read_bytes()))
    assert r0.version == "2.10"
    assert r0.groups == {"0": {"desc": "default_pg", "ranks": "[0, 1]", "last_enqueued": 2, "last_started": -1,
                               "last_completed": 1}}
    assert [(e["seq"], e["op"], e["state"]) for e in r0.pending] == [(2, "nccl:all_reduce", "scheduled")]
    assert r0.line() == "flight recorder: nccl:all_reduce seq 2 scheduled (group 0)"
    r1 = S.flight_record(S.load_flight_recorder((HANG / (ALLREDUCE + "flight-recorder_rank1.pickle")).read_bytes()))
    assert not r1.pending and r1.line() == "flight recorder: every recorded collective completed (last: nccl:all_reduce seq 1)"


class _Runs:
    def __reduce__(self):
        return (os.system, ("touch /tmp/railyard-pwned",))


def test_a_pickle_that_names_a_function_is_refused_not_run():
    with pytest.raises(ValueError, match="refused: the pickle names"):
        S.load_flight_recorder(pickle.dumps(_Runs()))
    with pytest.raises(ValueError, match="no `entries` list"):
        S.load_flight_recorder(pickle.dumps(["a list"]))


def test_flight_recorder_prefix_only_where_it_is_on():
    assert H.flight_recorder_prefix({}) is None
    assert H.flight_recorder_prefix({"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_FR_DUMP_TEMP_FILE": "/tmp/ry_fr_"}) == "/tmp/ry_fr_"
    assert H.flight_recorder_prefix({"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000"}) == "/tmp/nccl_trace_rank_"


# ---------------------------------------------------------------- the processes, from the host side

PS = """\
   4100       1 Ssl  containerd-shim /usr/bin/containerd-shim-runc-v2 -namespace moby
   4120    4100 Ss   bash            /bin/bash -c export VLLM_NCCL_SO_PATH=x || exit 1; exec vllm serve /model --port 8000
   4121    4120 Sl   vllm            /usr/bin/python3 /usr/local/bin/vllm serve /model --port 8000
   4190    4121 Sl   VLLM::EngineCor VLLM::EngineCore
   4201    4190 Sl   VLLM::Worker_TP VLLM::Worker_TP0
   4202    4190 Tl   VLLM::Worker_TP VLLM::Worker_TP1
   4230    4121 S    python3         /usr/bin/python3 -c from multiprocessing.resource_tracker import main;main(7)
   4300    4121 Sl   VLLM::Worker_TP /usr/bin/python3 /usr/local/bin/vllm serve /model --port 8000
   5000       1 Ss   sshd            /usr/sbin/sshd -D
"""


def test_the_container_processes_are_vllms_titles_under_its_main_pid():
    """A forked worker that named itself only in the kernel (its args are still its parent's `vllm serve ...`,
    4300) is a worker by its comm, read in the same `ps` as its args: never a second API server dropped."""
    procs = H.container_processes(4120, parse_ps(PS))
    assert [(p.pid, p.kind, p.title, p.state) for p in procs] == [
        (4121, "api", "vllm serve", "Sl"), (4190, "engine", "VLLM::EngineCore", "Sl"),
        (4201, "worker", "VLLM::Worker_TP0", "Sl"), (4202, "worker", "VLLM::Worker_TP1", "Tl"),
        (4300, "worker", "VLLM::Worker_TP", "Sl")]


def test_a_title_only_the_kernel_knows_still_counts_and_a_headless_rank_is_no_api():
    assert H.kind_of("/usr/bin/python3 -m sim", "VLLM::Worker_TP") == ("worker", "VLLM::Worker_TP")
    assert H.kind_of("EngineCore_DP3", "EngineCore_DP3") == ("engine", "EngineCore_DP3")
    assert H.kind_of("vllm serve /model --headless --data-parallel-size 2", "vllm") == ("serve", "vllm serve")
    assert H.kind_of("/usr/sbin/sshd -D", "sshd") is None


def test_the_dump_command_tries_each_reader_in_turn_and_quotes_the_tool():
    c = H.dump_command(4202, "/home/o p/.cache/railyard/serve/tools/py-spy", True)
    assert c.index("--native") < c.index("'@@try py-spy'") < c.index("--nonblocking") < c.index("@@try gdb")
    assert "'/home/o p/.cache/railyard/serve/tools/py-spy' dump --native --pid 4202" in c
    assert "gdb -p 4202 --batch -ex 'thread apply all bt'" in c and 'S="sudo -n"' in c


# ---------------------------------------------------------------- the two stations, end to end


@dataclass
class V:
    host: str
    service: str
    target: str
    state: str
    evidence: list[str] = field(default_factory=list)


def station_sessions(plan, inv, spy_on_path=True, b_dump=None, b_ps_rc=0):
    """A and B: each one container (head / worker-1), B's worker the rank that stalls, A's waiting in vLLM's
    shared-memory broadcast; NCCL RAS answers on B, refuses on A."""
    sessions = {}
    wait = ('Process {p}: VLLM::Worker_TP0\nPython v3.12.3 (/usr/bin/python3.12)\n\nThread {p} (idle): "MainThread"\n'
            "    dequeue (vllm/distributed/device_communicators/shm_broadcast.py:495)\n"
            "    worker_busy_loop (vllm/v1/executor/multiproc_executor.py:640)\n")
    stall = ('Process {p}: VLLM::Worker_TP1\nPython v3.12.3 (/usr/bin/python3.12)\n\nThread {p} (idle): "MainThread"\n'
             "    lab_stall (engine_site.py:40)\n    execute_model (vllm/v1/worker/gpu_worker.py:450)\n")
    for h, svc, title, main, dump in (("A", "head", "VLLM::Worker_TP0", 4120, wait), ("B", "worker-1", "VLLM::Worker_TP1", 7120, stall)):
        container = plan.service(svc).spec.name
        ps = (f"   {main}     1 Ss   bash /bin/bash -c exec vllm serve /model\n   {main + 1} {main} Sl   vllm "
              f"/usr/bin/python3 /usr/local/bin/vllm serve /model{' --headless' if h == 'B' else ''}\n"
              f"   {main + 70} {main + 1} Sl   VLLM::EngineCor VLLM::EngineCore\n"
              f"   {main + 81} {main + 70} Sl   VLLM::Worker_TP {title}\n") if h == "A" else \
             (f"   {main}     1 Ss   bash /bin/bash -c exec vllm serve /model --headless\n   {main + 1} {main} Sl   "
              f"vllm /usr/bin/python3 /usr/local/bin/vllm serve /model --headless\n"
              f"   {main + 81} {main + 1} Sl   VLLM::Worker_TP {title}\n")
        env = json.dumps(["PATH=/usr/bin", "NCCL_DEBUG=INFO", "VLLM_API_KEY=secret-value"])
        probe = {"ps": (b_ps_rc if h == "B" else 0, ps), "arch": "x86_64\n", "pyspy": "/usr/local/bin/py-spy\n" if spy_on_path else "",
                 "gdb": "", "ours": "", "c0": f"{main} true {env}\n"}
        pid = main + 81
        ras = ras_queries()[0].partition("\n")[2] if h == "B" else "@@ras refused\n"
        body = (b_dump if h == "B" and b_dump is not None else
                f"@@try py-spy --native\n{dump.format(p=pid)}@@rc 0\n")
        work = {f"d{main + 1}": "@@try py-spy --native\nError: Failed to find python version from target process\n@@rc 1\n"
                "@@try py-spy\nError: x\n@@rc 1\n@@try py-spy --nonblocking\nError: x\n@@rc 1\n",
                f"d{pid}": body, "r0": ras}
        if h == "A":
            work[f"d{main + 70}"] = (f"@@try py-spy --native\nProcess {main + 70}: VLLM::EngineCore\n\nThread 1 (idle): "
                                     '"MainThread"\n    acquire_read (vllm/distributed/device_communicators/'
                                     "shm_broadcast.py:420)\n@@rc 0\n")
        s = FakeSession(inv.host(h))
        s.on(re.compile(r"^ry ps ", re.M), answer(probe))
        s.on(re.compile(r"^ry d\d", re.M), answer(work))
        s.on(f"docker logs --tail 50 {container} 2>&1", (0, "INFO 12-07 15:45:02 [core.py:1] engine step\n"))
        s.on(re.compile(r"^set -e; umask 077; f=.*hang-dumps/\d{8}T\d{6}Z\.json"), (0, ""))
        s.on(re.compile(r"^cd .*hang-dumps.* head -n -10"), (0, ""))
        sessions[h] = s
    return sessions


def run_dump(monkeypatch, verdicts, **kw):
    inv, plan, _ = station_plan()
    monkeypatch.setattr(H, "survey", lambda inv, runner, plan: verdicts)
    sessions = station_sessions(plan, inv, **kw)
    with Runner(inv.hosts, sessions=sessions) as runner:
        rep = H.dump(inv, plan, runner)
    return rep, sessions


def test_a_hung_station_pair_names_the_odd_rank_keeps_the_dump_on_the_head_and_fails(monkeypatch):
    rep, sessions = run_dump(monkeypatch, [V("B", "worker-1", "VLLM::Worker_TP1 (pid 7201)", "hung", ["no token in 20 s"]),
                                           V("A", "head", "endpoint", "ok")])
    doc = json.loads(rep.json())                                   # one document
    assert rep.exit_code == 1 and doc["ok"] is False and doc["data"]["hung"]
    assert doc["data"]["summary"]["line"] == ("B/worker-1 pid 7201 VLLM::Worker_TP1 in lab_stall (engine_site.py:40); "
                                              "1 rank in dequeue (vllm/distributed/device_communicators/shm_broadcast.py:495)")
    assert doc["data"]["verdict"].startswith("HUNG: B/worker-1 hung -- B/worker-1 pid 7201")
    b = doc["data"]["hosts"]["B"]["services"][0]
    assert b["ras"]["line"].endswith("rank 1 (pid 531 on 192.0.2.2) at operation 1, the others at 2")
    assert doc["data"]["hosts"]["A"]["services"][0]["ras"]["listening"] is False
    api = doc["data"]["hosts"]["A"]["services"][0]["processes"][0]
    assert api["kind"] == "api" and api["stack"] is None and api["failures"][0].startswith("py-spy --native: Failed to find")
    assert re.fullmatch(r"A:~/\.cache/railyard/serve/glm53-full/hang-dumps/\d{8}T\d{6}Z\.json", doc["data"]["kept"])
    [kept] = [c for c in sessions["A"].calls if c.startswith("set -e; umask 077")]
    assert "secret-value" not in rep.json()                        # only the env keys hang-dump reads are kept
    hang = [c for c in doc["checks"] if c["check"] == "hang"]
    assert [(c["host"], c["status"]) for c in hang] == [("B", "fail"), ("A", "pass")]


def test_a_healthy_pair_says_nothing_is_hung_and_exits_0_with_the_stacks(monkeypatch):
    rep, _ = run_dump(monkeypatch, [V("B", "worker-1", "rank 1", "ok"), V("A", "head", "endpoint", "ok")])
    assert rep.exit_code == 0 and rep.data["verdict"] == "nothing is hung"
    assert rep.data["summary"]["groups"] and rep.data["hosts"]["B"]["services"][0]["processes"][-1]["stack"]


def test_a_process_list_cut_short_is_a_host_not_read_never_a_rank_left_out(monkeypatch):
    """`ps` killed by its section's timeout on a loaded host printed only its first lines: B is named not read
    (a fail), never shown with its rank missing."""
    rep, _ = run_dump(monkeypatch, [V("B", "worker-1", "rank 1", "ok"), V("A", "head", "endpoint", "ok")], b_ps_rc=124)
    assert "B" not in rep.data["hosts"] and rep.data["failed"]["B"].endswith(f"B: ps did not finish: timed out after {PS_LIMIT_S} s")
    assert [(c.host, c.status) for c in rep.checks if c.check == "host"] == [("B", "fail")] and rep.exit_code == 1


def test_a_stack_that_did_not_come_back_is_named_never_invented(monkeypatch):
    stopped = "".join(f"@@try {n}\nError: Failed to get stack traces\n@@rc 1\n" for n in ("py-spy --native", "py-spy"))
    stopped += "@@try py-spy --nonblocking\n@@rc 124\n"
    rep, _ = run_dump(monkeypatch, [V("B", "worker-1", "rank 1", "hung")], b_dump=stopped)
    worker = rep.data["hosts"]["B"]["services"][0]["processes"][-1]
    assert worker["stack"] is None and worker["failures"][-1] == "py-spy --nonblocking: timed out"
    assert rep.data["summary"]["missing"] == ["B/worker-1 pid 7201 VLLM::Worker_TP1"]
    assert "no stack from B/worker-1 pid 7201" in rep.data["summary"]["line"]
    stacks = next(c for c in rep.checks if c.check == "stacks")
    assert stacks.status == "warn"


def test_railyard_brings_its_own_py_spy_where_the_host_has_none(monkeypatch, tmp_path):
    binary = tmp_path / "py-spy"
    binary.write_bytes(b"\x7fELF static py-spy")
    monkeypatch.setattr(H, "local_py_spy", lambda: binary)
    monkeypatch.setattr(H, "machine_arch", lambda: "x86_64")
    inv, _, _ = station_plan()
    s = FakeSession(inv.host("B"))
    got = {}

    def copy(command):
        got["command"] = command
        return 0, ""
    s.on(re.compile(r"^set -e; f=.*tools/py-spy"), copy).on('printf %s "$HOME"', (0, "/home/nvidia"))
    spy, note = H._provision(s, "~/.cache/railyard/serve", "x86_64", "", "")
    assert spy == "/home/nvidia/.cache/railyard/serve/tools/py-spy" and note.startswith("py-spy: copied railyard's to")
    assert 'f="$HOME"/.cache/railyard/serve/tools/py-spy' in got["command"]
    spy, note = H._provision(FakeSession(inv.host("B")), "~/.cache/railyard/serve", "aarch64", "", "")
    assert spy is None and note == ("py-spy: none on the host, and railyard's is for x86_64, the host is aarch64: "
                                    "gdb only (install py-spy for aarch64 on the host)")


# ---------------------------------------------------------------- the flight recorder's opt-in


def test_the_flight_recorder_is_rendered_on_only_where_asked():
    _, plan, _ = station_plan()
    assert not any(k.startswith("TORCH_FR_") for svc in plan.services() for k, _ in svc.spec.env)
    _, plan, _ = station_plan("vllm_flight_recorder=true", "vllm_extra_env={TORCH_FR_BUFFER_SIZE: '500'}")
    for svc in plan.services():
        env = dict(svc.spec.env)
        assert (env["TORCH_FR_BUFFER_SIZE"], env["TORCH_NCCL_DUMP_ON_TIMEOUT"]) == ("500", "1")   # extra_env overrides
        assert H.flight_recorder_prefix(env) == "/tmp/railyard_fr_rank_"


# ---------------------------------------------------------------- kept on the first host, shown by status, collected


def test_the_dumps_kept_are_the_newest_ten_and_status_points_to_the_newest(tmp_path):
    """keep() and latest() run their real shell (here, in a home of the test's own)."""
    import subprocess
    inv, _, _ = station_plan()
    s = FakeSession(inv.host("A"))
    s.on(re.compile(r"."), lambda c: (lambda r: (r.returncode, r.stdout, r.stderr))(
        subprocess.run(["sh", "-c", c], capture_output=True, text=True, env={"HOME": str(tmp_path), "PATH": os.environ["PATH"]})))
    assert H.latest(s, "~/.cache/railyard/serve", "glm53-full") is None
    for i in range(12):
        where = H.keep(s, "~/.cache/railyard/serve", "glm53-full", 1796658302 + i * 3600, '{"ok": true}\n')
    d = tmp_path / ".cache/railyard/serve/glm53-full/hang-dumps"
    names = sorted(p.name for p in d.iterdir())
    assert len(names) == 10 and names[0] == "20261207T174502Z.json" and names[-1] == "20261208T024502Z.json"
    assert where == "A:~/.cache/railyard/serve/glm53-full/hang-dumps/20261208T024502Z.json"
    assert H.latest(s, "~/.cache/railyard/serve", "glm53-full") == where


def test_collect_takes_the_hang_dump_only_where_a_service_is_hung(monkeypatch):
    from railyard.verbs import collect as C
    inv, plan, _ = station_plan()
    monkeypatch.setattr(H, "survey", lambda inv, runner, plan: [V("A", "head", "endpoint", "ok")])
    with Runner(inv.hosts, sessions=station_sessions(plan, inv)) as runner:
        assert C.hang_evidence(inv, plan, runner) == (None, "nothing is hung")
    monkeypatch.setattr(H, "survey", lambda inv, runner, plan: [V("B", "worker-1", "rank 1", "hung")])
    with Runner(inv.hosts, sessions=station_sessions(plan, inv)) as runner:
        doc, why = C.hang_evidence(inv, plan, runner)
    assert why == "B/worker-1 hung" and json.loads(doc)["data"]["summary"]["outliers"][0]["members"] == [
        "B/worker-1 pid 7201 VLLM::Worker_TP1"]


def test_a_tie_of_two_ranks_is_broken_by_the_engine_core_that_waits_with_one_side():
    """The lab's stand-in on the two stations, read by hang-dump (engine-stall on B): the idle worker and the
    engine core wait in the same loop, the parked rank alone in its handler; a majority of ranks is never
    outvoted."""
    loop, parked = S.Frame("spawn", "vllm:353", True), S.Frame("spawn.<locals>.lab_fault_engine_stall", "vllm:335", True)
    g = S.group_ranks([("A/head pid 18601 VLLM::Worker_TP", loop), ("B/worker-1 pid 18600 VLLM::Worker_TP", parked)],
                      [loop])
    assert [o.members for o in g.outliers] == [["B/worker-1 pid 18600 VLLM::Worker_TP"]]
    g = S.group_ranks([("a", loop), ("b", loop), ("c", parked)], [parked, parked, parked])
    assert [o.members for o in g.outliers] == [["c"]]
    assert S.parse_py_spy('Thread 1 (idle): "MainThread"\n    spawn (vllm:353)\n').threads[0].frames[0].python
