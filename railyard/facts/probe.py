"""Run many read-only probes on a host in one round trip.

Each probe is a `Section`: a key, a shell command and the tool it needs. `joined_script`
runs all of a host's sections in parallel in one `sh -c`, each under `timeout`, every
output line prefixed with a per-run token and the section key, so one SSH channel
carries them all and the outputs are split apart again by `split_output`.

The sections write into one pipe at once, so each tagged record is written whole in one
write() of at most PIPE_BUF (4096) bytes, which the kernel never interleaves: a longer line
(a `ps` line of a process with a long command line) goes out in pieces of PIECE characters,
each tagged `+` after the first (`|`). Written in one piece past that size, it was split by
the writer's buffer, and another section's line landing in between was lost.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass

from ..transport import Sh, q, quote_text

MISSING_MARK = "@@missing "
KEY_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
# a record at most: token (12) + space + key (64) + tag + PIECE characters of up to 4 bytes + newline <= 4096
PIECE = 1000
# awk, not `sed -u`: GNU sed writes a line longer than its 8 KiB buffer in two write() calls
TAG_AWK = ('{ n = length($0); t = "|"; i = 1; '
           f'do {{ printf "%s%s%s\\n", p, t, substr($0, i, {PIECE}); fflush(); t = "+"; i += {PIECE} }} '
           'while (i <= n) }')
RECORD_RE = re.compile(r"(?P<key>[A-Za-z0-9_.:-]+)(?P<tag>[|+])(?P<text>.*)", re.S)  # after the token


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
    """One POSIX sh script that runs every section at once and tags each output line (or piece of one)."""
    lines = [
        f"T={q(token)}",
        "ry() { ( timeout -k 2 \"$2\" sh -c \"$3\" </dev/null 2>&1; printf '\\n@@rc=%s\\n' \"$?\" )"
        f" | awk -v p=\"$T $1\" {q(TAG_AWK)}; }}",
    ]
    for s in sections:
        if not KEY_RE.match(s.key):
            raise ValueError(f"bad section key {s.key!r}")
        lines.append(f"ry {s.key} {int(s.timeout)} {quote_text(section_body(s))} &")
    lines.append("wait")
    return "\n".join(lines) + "\n"


def split_output(stdout: str, sections: list[Section], token: str) -> dict[str, Output]:
    """Undo the tagging: {key: Output}. Sections that printed nothing get rc None."""
    buf: dict[str, list[str]] = {s.key: [] for s in sections}
    prefix = token + " "
    for line in stdout.splitlines():
        m = RECORD_RE.match(line, len(prefix)) if line.startswith(prefix) else None
        if m is None or m["key"] not in buf:
            continue
        lines = buf[m["key"]]
        if m["tag"] == "+" and lines:   # the next piece of a long line
            lines[-1] += m["text"]
        else:
            lines.append(m["text"])
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
