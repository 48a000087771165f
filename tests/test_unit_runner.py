"""Runner.each's HostResults (fabric's GroupResult for railyard's sessions): by host name in the hosts'
order, split into .ok (what fn returned) and .failed (the error Result of a host whose work raised).
Local hosts only, and fn runs no command: nothing here starts a process or opens a connection."""

from __future__ import annotations

import pytest

from railyard.facts.host import gather
from railyard.inventory import Host
from railyard.transport import Result
from railyard.transport import hostkeys
from railyard.transport.runner import HostResults, Runner


def local_host(name: str, **vars_) -> Host:
    v = {"ssh_connect_timeout": 5, "ssh_command_timeout": 30, "ssh_parallel": 4}
    v.update(vars_)
    return Host(name, 0, "", 22, "", "local", "", {}, v)


def work(session):
    if session.host.name.startswith("bad"):
        raise RuntimeError(f"broke on {session.host.name}")
    return session.host.name.lower()


@pytest.mark.parametrize("names", [["good", "bad"], ["bad", "good"]])
def test_one_host_ok_one_failing(names):
    heard = []
    with Runner([local_host(n) for n in names]) as r:
        got = r.each(work, on_done=lambda name, v: heard.append(name))
    assert isinstance(got, HostResults)
    assert got.ok == {"good": "good"}
    assert list(got.failed) == ["bad"]
    failed = got.failed["bad"]
    assert isinstance(failed, Result) and failed.host == "bad" and failed.rc is None
    assert failed.error is not None and failed.error.kind == "ssh_error"
    assert str(failed.error) == "ssh_error: RuntimeError: broke on bad"      # what the user reads: unchanged
    assert failed.error.hint == "this is a railyard bug: please report it"
    # the mapping by host name, in the hosts' order, as before
    assert list(got) == names and len(got) == 2
    assert got["good"] == "good" and got["bad"] is failed
    assert dict(got.items()) == {"good": "good", "bad": failed} and got == {"good": "good", "bad": failed}
    assert "bad" in got and "nope" not in got and got.get("nope") is None
    assert sorted(heard) == sorted(names)


def test_order_is_the_hosts_order_in_all_three_views():
    names = ["bad1", "A", "bad2", "B", "C", "bad3"]
    with Runner([local_host(n) for n in names]) as r:
        got = r.each(work)
    assert list(got) == names
    assert list(got.ok) == ["A", "B", "C"] and list(got.ok.values()) == ["a", "b", "c"]
    assert list(got.failed) == ["bad1", "bad2", "bad3"]


def test_a_chosen_subset_and_a_single_host():
    hosts = [local_host("bad"), local_host("good")]
    with Runner(hosts) as r:
        one = r.each(work, hosts[:1])
        none = r.each(work, [])
    assert list(one) == ["bad"] and one.ok == {} and list(one.failed) == ["bad"]
    assert len(none) == 0 and none.ok == {} and none.failed == {}


def test_a_result_that_fn_returns_is_ok_not_failed():
    """T may itself be Result (Runner.run): failed means only that the host's work raised."""
    mine = Result("good", "true", 3, "", "", 0.0)
    with Runner([local_host("good"), local_host("bad")]) as r:
        got = r.each(lambda s: mine if s.host.name == "good" else work(s))
    assert got.ok == {"good": mine} and list(got.failed) == ["bad"]


def test_gather_turns_a_failed_host_into_its_problem_line(monkeypatch):
    monkeypatch.setattr("railyard.facts.host.read", lambda s, needs, count: work(s))
    with Runner([local_host("bad")]) as r:
        out = gather(r, r.hosts, set())
    assert list(out) == ["bad"] and out["bad"].problems == ["bad: ssh_error: RuntimeError: broke on bad"]


def test_trust_hosts_scan_fans_out_through_runner_and_skips_local_hosts(monkeypatch):
    def scan(h):
        if h.name == "bad":
            raise OSError("boom")
        return hostkeys.KeyStatus(h.name, h.address, None, "unreachable", "ok", hostkeys.known_hosts_path(h))
    monkeypatch.setattr(hostkeys, "scan", scan)
    ssh = [Host(n, 0, "10.0.0.1", 22, "u", "ssh", "", {}, {}) for n in ("bad", "good")]
    got = hostkeys.scan_all([local_host("L")] + ssh)
    assert [s.host for s in got] == ["bad", "good"]
    assert got[1].detail == "ok"
    assert got[0].status == "unreachable" and got[0].detail == "ssh_error: OSError: boom" and got[0].name == "10.0.0.1"
