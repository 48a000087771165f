"""Run many read-only probes on a host in one round trip.

Each probe is a `Section`: a key, a shell command and the tool it needs. `joined_script`
runs all of a host's sections in parallel in one `sh -c`, each under `timeout`, every
output line prefixed with a per-run token and the section key, so one SSH channel
carries them all and the outputs are split apart again by `split_output`.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass

from ..transport import Sh, q, quote_text

MISSING_MARK = "@@missing "


@dataclass(frozen=True)
class Section:
    key: str
    command: Sh
    tool: str | None = None
    timeout: int = 20


@dataclass(frozen=True)
class Output:
    rc: int | None  # None: the section printed no end marker (killed with its host command)
    text: str
    missing_tool: str | None = None

    @property
    def timed_out(self) -> bool:
        return self.rc in (124, 137)

    @property
    def ok(self) -> bool:
        return self.rc == 0


def section_body(s: Section) -> str:
    if not s.tool:
        return s.command
    return (f"command -v {q(s.tool)} >/dev/null 2>&1 || "
            f"{{ echo {q(MISSING_MARK + s.tool)}; exit 127; }}; {s.command}")


def new_token() -> str:
    return "@@ry" + secrets.token_hex(4)


def joined_script(sections: list[Section], token: str) -> str:
    """One POSIX sh script that runs every section at once and tags each output line."""
    lines = [
        f"T={q(token)}",
        "ry() { ( timeout -k 2 \"$2\" sh -c \"$3\" </dev/null 2>&1; printf '\\n@@rc=%s\\n' \"$?\" )"
        " | sed -u \"s/^/$T $1|/\"; }",
    ]
    for s in sections:
        if not re.match(r"^[A-Za-z0-9_.:-]+$", s.key):
            raise ValueError(f"bad section key {s.key!r}")
        lines.append(f"ry {s.key} {int(s.timeout)} {quote_text(section_body(s))} &")
    lines.append("wait")
    return "\n".join(lines) + "\n"


def split_output(stdout: str, sections: list[Section], token: str) -> dict[str, Output]:
    """Undo the tagging: {key: Output}. Sections that printed nothing get rc None."""
    buf: dict[str, list[str]] = {s.key: [] for s in sections}
    prefix = token + " "
    for line in stdout.splitlines():
        if not line.startswith(prefix):
            continue
        key, _, content = line[len(prefix):].partition("|")
        if key in buf:
            buf[key].append(content)
    out: dict[str, Output] = {}
    for key, lines in buf.items():
        rc = None
        if lines and lines[-1].startswith("@@rc="):
            rc = int(lines[-1][5:] or -1)
            lines = lines[:-1]
            if lines and lines[-1] == "":
                lines = lines[:-1]
        missing = None
        if lines and lines[0].startswith(MISSING_MARK):
            missing = lines[0][len(MISSING_MARK):].strip()
        out[key] = Output(rc, "\n".join(lines) + ("\n" if lines else ""), missing)
    return out


def split_blocks(text: str, marker: str = "@@peer ") -> dict[str, tuple[int | None, str]]:
    """Blocks `@@peer KEY rc=N` + lines, as printed by the per-peer fan-out loops."""
    blocks: dict[str, tuple[int | None, list[str]]] = {}
    current = None
    for line in text.splitlines():
        if line.startswith(marker):
            parts = line[len(marker):].split()
            key = parts[0] if parts else ""
            rc = None
            for p in parts[1:]:
                if p.startswith("rc="):
                    rc = int(p[3:]) if p[3:].lstrip("-").isdigit() else None
            current = key
            blocks[key] = (rc, [])
        elif current is not None:
            blocks[current][1].append(line)
    return {k: (rc, "\n".join(lines)) for k, (rc, lines) in blocks.items()}


def no_answer(rc: int | None, text: str) -> bool:
    """A peer's block that timed out: `timeout` killed it (124, 137), or ssh gave up waiting for the server's
    banner (255, `Connection timed out during banner exchange`: the peer's kernel took the connection, its
    sshd was too busy to answer in time). A connect that timed out (no SYN-ACK) is an answer: unreachable."""
    return rc in (124, 137) or (rc == 255 and "during banner exchange" in text)


def fan_out(items: list[tuple[str, Sh]]) -> Sh:
    """Run several commands in parallel in one section; each result is an `@@peer KEY rc=N` block."""
    parts = []
    for key, command in items:
        parts.append(f"( o=$({command} 2>&1); printf '@@peer %s rc=%s\\n%s\\n' {q(key)} \"$?\" \"$o\" ) &")
    parts.append("wait")
    return Sh("\n".join(parts))


def answer(outputs: dict[str, str | tuple[int, str]]):
    """A FakeSession answer to a joined script: each section's output (or (rc, output)) tagged as a
    host would print it; a section not in outputs reports its tool missing. For unit tests."""
    def reply(script: str) -> tuple[int, str]:
        m = re.search(r"^T='?([^'\n]+)'?$", script, re.M)
        assert m, f"not a joined script (no token line): {script[:80]!r}"
        token = m.group(1)
        out = []
        for key in re.findall(r"^ry (\S+) \d+ ", script, re.M):
            got = outputs.get(key, (127, MISSING_MARK + key + "\n"))
            rc, text = got if isinstance(got, tuple) else (0, got)
            out += [f"{token} {key}|{line}" for line in text.splitlines()] + [f"{token} {key}|", f"{token} {key}|@@rc={rc}"]
        return 0, "\n".join(out) + "\n"
    return reply
