"""Preflight checks: pure functions (facts, vars) -> CheckResult. No I/O here.

Every result is {host, check, status, detail, evidence, hint}; status is pass, warn,
fail or skip. A fail always says what is wrong (detail), shows what the host printed
(evidence) and how to fix it (hint).

By domain, mirroring railyard.facts: checks.docker, checks.net, checks.gpu, checks.system, and checks.parity
for the comparisons across hosts; here only the result and what they all share.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

from ..inventory import Host
from ..facts.probe import Output

PASS, WARN, FAIL, SKIP = "pass", "warn", "fail", "skip"


@dataclass(frozen=True)
class CheckResult:
    host: str
    check: str
    status: str
    detail: str
    evidence: str = ""
    hint: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


_FIX = re.compile(r"^(.*?) \(fix: (.*)\)$", re.S)


def split_fixes(reasons: list[str]) -> tuple[str, str]:
    """A verdict's reasons `what (fix: how)` as one detail line and one hint line (each fix once)."""
    what, fixes = [], []
    for reason in reasons or ["no verdict"]:
        m = _FIX.match(reason)
        what.append(m.group(1) if m else reason)
        if m and m.group(2) not in fixes:
            fixes.append(m.group(2))
    return "; ".join(what), "; ".join(fixes)


TOOL_HINTS = {
    "ibdev2netdev": "install the NVIDIA DOCA-Host / MLNX_OFED user tools (they ship ibdev2netdev)",
    "show_gids": "install the NVIDIA DOCA-Host / MLNX_OFED user tools (they ship show_gids)",
    "nvidia-smi": "install the NVIDIA driver utilities (nvidia-utils) or check the driver install",
    "docker": "install Docker Engine and the NVIDIA Container Toolkit",
    "timedatectl": "install systemd's timedatectl or chrony (chronyc tracking): preflight reads either",
    "dmesg": "apt-get install util-linux (dmesg)",
    "ethtool": "apt-get install ethtool",
    "ip": "apt-get install iproute2",
    "ping": "apt-get install iputils-ping",
    "ssh": "apt-get install openssh-client",
    "df": "coreutils is missing: the host is broken",
    "du": "coreutils is missing: the host is broken",
}


def first_lines(text: str, n: int = 3) -> str:
    lines = [line.rstrip() for line in text.strip().splitlines() if line.strip()]
    return " | ".join(lines[:n])


def unusable(host: Host, check: str, out: Output | None, tool: str) -> CheckResult | None:
    """A fail for a probe that could not run: missing tool, timeout, no output."""
    if out is None or out.rc is None:
        return CheckResult(host.name, check, FAIL, f"`{tool}` gave no result (the probe was cut off)",
                           "", "rerun; if it repeats, run the command by hand on the host")
    if out.missing_tool:
        return CheckResult(host.name, check, FAIL, f"tool `{out.missing_tool}` not found on PATH", "",
                           TOOL_HINTS.get(out.missing_tool, f"install {out.missing_tool}"))
    if out.timed_out:
        return CheckResult(host.name, check, FAIL, f"`{tool}` did not finish within its timeout",
                           first_lines(out.text), f"run `{tool}` by hand on {host.name}: something hangs")
    return None

