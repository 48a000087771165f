"""The small error tree. Expected failures carry a one-line message and an exit code."""

from __future__ import annotations

from dataclasses import dataclass


class RailyardError(Exception):
    """An expected failure: printed as one line, never as a traceback."""

    exit_code = 1


class UsageError(RailyardError):
    """Bad input from the user (flags, inventory, files). Exit code 2; no host was touched."""

    exit_code = 2


@dataclass(frozen=True)
class Problem:
    """One inventory problem: the file, the key path and the offending value."""

    file: str
    key: str
    value: object
    message: str

    def __str__(self) -> str:
        shown = "" if self.value is _MISSING else f" = {_printable(repr(self.value))}"
        return f"{_printable(self.file)}: {_printable(self.key)}{shown}: {_printable(self.message)}"


def _printable(text: object) -> str:
    """One line whatever the inventory held: control and line-breaking characters escaped."""
    s = str(text)
    return s if s.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1] for c in s)


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"


_MISSING = _Missing()
MISSING = _MISSING


class InventoryError(UsageError):
    """One or more problems found while loading or validating an inventory."""

    def __init__(self, problems: list[Problem]):
        # a value of all.vars or --set that every host carries is checked on each: one problem, once
        self.problems = list({str(p): p for p in reversed(problems)}.values())[::-1]
        super().__init__("\n".join(str(p) for p in self.problems))


class LaunchError(RailyardError):
    """A launch-time refusal with its fix."""


class CommandFailed(RailyardError):
    """A remote command that had to succeed did not: the message names the host and why."""

    def __init__(self, result, what: str = ""):
        self.result = result
        why = (f"{result.error.kind}: {result.error.message} (fix: {result.error.hint})" if result.error
               else (result.stderr or result.stdout).strip().splitlines()[-1:] or [f"exit {result.rc}"])
        if isinstance(why, list):
            why = why[0]
        super().__init__(f"{result.host}: {what + ': ' if what else ''}{why}")
