"""The operator lock: one launch, start, stop or sync at a time; a second is refused naming the
first; a stale lock is reported as such and only `inv unlock` removes it."""

import json
import subprocess
import sys

import pytest

from railyard.errors import LaunchError
from railyard.apply import lock
from railyard.transport import LocalSession

from .test_probe_transport import local_host


@pytest.fixture
def session(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    return LocalSession(local_host("H"))


def test_a_second_operator_is_refused_naming_the_first_and_the_lock_goes_with_the_first(session, tmp_path):
    with lock.HeadLock(session, "inv launch"):
        owner = json.loads((tmp_path / ".cache" / "railyard" / "lock" / "owner").read_text())
        assert owner["command"] == "inv launch" and owner["pid"] > 0
        with pytest.raises(LaunchError, match=r"H is locked by .*`inv launch`.*inv unlock"):
            with lock.HeadLock(session, "inv stop"):
                pass
    assert not (tmp_path / ".cache" / "railyard" / "lock").exists()
    with lock.HeadLock(session, "inv stop"):  # free again
        pass


def test_the_lock_is_released_when_the_run_fails_or_is_interrupted(session, tmp_path):
    for exc in (LaunchError("boom"), KeyboardInterrupt()):
        with pytest.raises(type(exc)):
            with lock.HeadLock(session, "inv launch"):
                raise exc
        assert not (tmp_path / ".cache" / "railyard" / "lock").exists()


def test_a_dead_owner_is_reported_stale_and_only_unlock_removes_it(session, tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = lock.me("inv sync-model")
    stale.pid = dead.pid
    d = tmp_path / ".cache" / "railyard" / "lock"
    d.mkdir(parents=True)
    (d / "owner").write_text(json.dumps(stale.__dict__))
    with pytest.raises(LaunchError, match="that process is gone, the lock is stale"):
        with lock.HeadLock(session, "inv launch"):
            pass
    assert d.exists()  # never broken on its own
    holder = lock.unlock(session)
    assert holder.command == "inv sync-model" and holder.stale and not d.exists()
    assert lock.unlock(session) is None


def test_someone_elses_lock_is_not_removed_on_exit(session, tmp_path):
    held = lock.HeadLock(session, "inv launch").__enter__()
    other = lock.HeadLock(session, "inv stop")
    other.held = True  # a run that believes it holds the lock, with another token
    other.__exit__(None, None, None)
    assert (tmp_path / ".cache" / "railyard" / "lock").exists()
    held.__exit__(None, None, None)
    assert not (tmp_path / ".cache" / "railyard" / "lock").exists()
