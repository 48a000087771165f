"""What a failed lab test leaves for its reader: the lab host and command it was waiting on when it
failed (a time limit cuts a test inside such a wait), and the last lines of the lab hosts' logs
that moved during the test (each container's docker log, each host's sshd log)."""

from __future__ import annotations

import contextlib
import json
import re
import time
from dataclasses import dataclass
from pathlib import Path

TAIL_LINES = 8          # per log
MAX_LOGS = 6            # the most recently written ones
# what sshd logs for a connection dropped before the key exchange: lab.up's readiness check makes one
# per start of sshd (it reads the banner and closes), so it says nothing about the test
_SSHD_NOISE = "kex_exchange_identification: read: Connection reset by peer"
_COLOUR = re.compile(r"\x1b\[[0-9;]*m")     # LMCache's and others' terminal colours


@dataclass(frozen=True)
class Wait:
    host: str           # a lab host, or "-" where the wait spans the inventory's hosts (an `inv` task)
    what: str
    started: float      # time.monotonic()

    def describe(self, ended: float) -> str:
        where = f"lab host {self.host}" if self.host != "-" else "the lab hosts"
        return f"waiting on {where}: {self.what} ({ended - self.started:.0f} s)"


_cut: Wait | None = None            # the innermost wait an exception left, for this test's report
_cut_at = 0.0


def reset() -> None:
    global _cut
    _cut = None


@contextlib.contextmanager
def waiting(host: str, what: str):
    """Mark a wait on a lab host; the innermost one an exception (a failed check, a time limit) leaves is
    kept for the test's report."""
    global _cut, _cut_at
    w = Wait(host, what if len(what) <= 160 else what[:157] + "...", time.monotonic())
    try:
        yield
    except BaseException:
        if _cut is None:
            _cut, _cut_at = w, time.monotonic()
        raise


def cut_wait() -> str | None:
    """The wait the failure interrupted, described, or None."""
    return _cut.describe(_cut_at) if _cut else None


def cut_host() -> str | None:
    """The lab host of the wait the failure interrupted ("-": the inventory's hosts), or None."""
    return _cut.host if _cut else None


def _json_log_tail(path: Path, n: int) -> list[str]:
    lines = []
    for raw in path.read_bytes().splitlines()[-n:]:
        try:
            lines.append(json.loads(raw)["log"].rstrip("\n"))
        except (ValueError, KeyError, TypeError):
            lines.append(raw.decode("utf-8", "replace"))
    return lines


# a file's mtime comes from the kernel's coarse clock, up to a tick (4 ms at HZ=250) behind time.time(): a log
# written in a test's first milliseconds can carry an mtime before the test's start
MTIME_SLACK_S = 0.05


def log_tails(lab_root: Path, since: float, host: str | None = None) -> list[str]:
    """The last lines of every lab host log written since `since` (epoch seconds), newest first; only
    `host`'s when the failure was a wait on it."""
    found: list[tuple[float, str, Path, bool]] = []
    for hdir in sorted((lab_root / "hosts").glob("*")):
        if host not in (None, "-") and hdir.name != host:
            continue
        for path, is_json in [(hdir / "sshd.log", False)] + [(p, True) for p in
                                                              (hdir / "docker" / "containers").glob("*/log")]:
            try:
                st = path.stat()
            except OSError:
                continue
            mtime = st.st_mtime
            if mtime >= since - MTIME_SLACK_S and st.st_size:
                label = "sshd" if not is_json else f"docker logs {path.parent.name}"
                found.append((mtime, f"{hdir.name}: {label}", path, is_json))
    out = []
    for _, label, path, is_json in sorted(found, reverse=True)[:MAX_LOGS]:
        try:
            tail = _json_log_tail(path, TAIL_LINES) if is_json else \
                [ln for ln in path.read_text(errors="replace").splitlines() if not ln.startswith(_SSHD_NOISE)][-TAIL_LINES:]
        except OSError:
            continue
        if tail:
            out.append(f"--- {label} (last {len(tail)} lines)")
            out.extend("    " + _COLOUR.sub("", ln)[:240] for ln in tail)
    return out
