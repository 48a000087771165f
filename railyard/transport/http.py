"""One HTTP request from a service's host to a service there, with curl over the host's session.

The API key is read from its file on that host into curl's config on fd 3 (a shell builtin
prints it), so it is never in any process's argv; the request body travels on stdin.
"""

from __future__ import annotations

import json
import re

from ..plan.spec import Endpoint
from . import Session, Sh, cmd, q


def request(s: Session, ep: Endpoint, path: str, body: dict | None = None, timeout: int = 60,
            header: str = "", headers: tuple[tuple[str, str], ...] = ()) -> tuple[int, float, str, str]:
    """(HTTP code or 0, milliseconds, body text or curl's error, the response header `header` or "");
    headers: request headers to send besides the key."""
    url = f"http://{ep.local_address}:{ep.port}{path}"
    args = ["curl", "-sS", "--max-time", str(int(timeout))]
    for k, v in headers:
        args += ["-H", f"{k}: {v}"]
    if body is not None:
        args += ["-H", "Content-Type: application/json", "--data-binary", "@-"]
    marker = "%header{" + header + "}" if header else ""
    args += ["-w", f"\n@@%{{http_code}} %{{time_total}} {marker}", url]
    line = cmd(*args)
    if ep.api_key_file:  # the key on fd 3 as curl config, printed by a builtin; the body stays on stdin
        line = Sh(f"exec 4<&0; printf 'header = \"Authorization: Bearer %s\"\\n' \"$(cat {q(ep.api_key_file)} "
                    f"2>/dev/null)\" | {line} -K /dev/fd/3 3<&0 0<&4")
    r = s.run(line, timeout=timeout + 10, stdin=json.dumps(body).encode() if body is not None else None)
    if r.error:
        return 0, 0.0, f"{r.error.kind}: {r.error.message}", ""
    text, _, tail = r.stdout.rpartition("\n@@")
    try:
        code, secs, *rest = tail.split(" ", 2)
        if int(code) == 0:  # no HTTP answer at all: curl's own error says why
            return 0, float(secs) * 1000, (r.stderr.strip().splitlines() or ["no answer"])[-1], ""
        return int(code), float(secs) * 1000, text, (rest[0].strip() if rest else "")
    except ValueError:
        return 0, 0.0, (r.stderr or r.stdout).strip()[:200], ""


def parse_metrics(text: str) -> dict:
    """Sum Prometheus samples by metric name (labels dropped)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^([A-Za-z_:][\w:]*)(?:\{[^}]*\})?\s+([-+0-9.eEinfNa]+)", line)
        if m:
            try:
                out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
            except ValueError:
                pass
    return out
