"""`inv collect`: what an on-call engineer attaches to a ticket, as one .tar.gz.

    manifest.json              what was collected from where, sizes, what failed (and why)
    version.txt, inventory.yml railyard's version and the inventory as given (it holds no secret)
    preflight.json             the preflight document (the same as `inv preflight --json`)
    verdicts.json              the NCCL judge on every NCCL log collected (railyard.checks.nccl.judge)
    hang-dump.json             where the shared hung verdict says a service is hung or dead: `inv hang-dump
                               --json`'s document (every rank's stack, NCCL RAS, the flight recorder)
    <host>/<section>.txt       per host: nvidia-smi -q, ibdev2netdev, show_gids, ip -d link,
                               ethtool -S of each rail, dmesg lines (Xid, NVRM, mlx5, link), docker ps,
                               and per service of the plan: its container's inspect, log, NCCL logs
                               and env file

Every host in one round trip, all hosts in parallel. Each text is cut to MAX_SECTION bytes (its
tail: where the failure is) and the archive stops adding files at MAX_TOTAL. Secrets: key files
are never read; environment entries and lines that name a key, token, secret or password have
their value replaced, and a value read from no file can reach the archive only through a log.
"""

from __future__ import annotations

import io
import json
import re
import tarfile
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from ..errors import RailyardError
from ..inventory import Inventory
from ..facts.probe import Section, joined_script, new_token, split_output
from ..transport.runner import Runner
from ..plan.spec import LaunchPlan, Service
from ..transport import Session, Sh, cmd, q
from .verify import nccl_log_glob

MAX_SECTION = 2 << 20     # 2 MiB of text per section (the tail)
MAX_TOTAL = 64 << 20      # 64 MiB in the archive
LOG_LINES = 5000
DMESG = r"NVRM: Xid|NVRM:|mlx5|link (up|down)|Link is (Up|Down)|NETDEV WATCHDOG"
_SECRET_KEY = re.compile(r"(?i)(api[_-]?key|token|secret|passw(or)?d|master[_-]?key|authorization)")
_ENV_LINE = re.compile(r"^(?P<k>[A-Za-z_][A-Za-z0-9_]*)=(?P<v>.*)$")


def redact(text: str) -> str:
    """Values of KEY=VALUE lines, JSON "KEY=VALUE" entries and Bearer headers whose name says secret."""
    def env_entry(m: re.Match) -> str:
        k = m.group(1)
        return f'"{k}=<redacted>"' if _SECRET_KEY.search(k) else m.group(0)

    text = re.sub(r'"([A-Za-z_][A-Za-z0-9_]*)=[^"]*"', env_entry, text)
    text = re.sub(r"(?i)(bearer\s+)[A-Za-z0-9._~+/=-]{8,}", r"\1<redacted>", text)
    out = []
    for line in text.splitlines(keepends=True):
        m = _ENV_LINE.match(line.rstrip("\n"))
        if m and _SECRET_KEY.search(m.group("k")):
            line = f"{m.group('k')}=<redacted>\n"
        out.append(line)
    return "".join(out)


def _tail(text: str, limit: int = MAX_SECTION) -> str:
    data = text.encode(errors="replace")
    if len(data) <= limit:
        return text
    return f"[railyard collect: the first {len(data) - limit} bytes were cut]\n" + \
        data[-limit:].decode(errors="replace")


def host_sections(host, services: list[Service]) -> list[Section]:
    out = [Section("nvidia-smi-q", cmd("nvidia-smi", "-q"), "nvidia-smi", 60),
           Section("ibdev2netdev", cmd("ibdev2netdev"), "ibdev2netdev"),
           Section("show_gids", cmd("show_gids"), "show_gids"),
           Section("ip-d-link", cmd("ip", "-d", "link"), "ip"),
           Section("dmesg", Sh("dmesg -T 2>/dev/null | grep -E " + q(DMESG) + " | tail -n 400"), "dmesg"),
           Section("docker-ps", cmd("docker", "ps", "-a"), "docker", 30)]
    for rail in host.rails.values():
        out.append(Section(f"ethtool-S.{rail.name}", cmd("ethtool", "-S", rail.name), "ethtool"))
    for svc in services:
        name = svc.spec.name
        out.append(Section(f"{svc.name}.inspect", cmd("docker", "inspect", name), "docker", 30))
        out.append(Section(f"{svc.name}.log", Sh(cmd("docker", "logs", "--tail", str(LOG_LINES), name) + " 2>&1"),
                           "docker", 60))
        script = f'for f in {nccl_log_glob(svc)}; do [ -e "$f" ] || continue; printf "@@file %s\\n" "$f"; tail -n 3000 "$f"; done'
        out.append(Section(f"{svc.name}.nccl", cmd("docker", "exec", name, "sh", "-c", script), "docker", 60))
        if svc.env_path:  # `~/` is the host's home
            path = svc.env_path
            line = Sh('cat -- "$HOME"/' + q(path[2:])) if path.startswith("~/") else cmd("cat", "--", path)
            out.append(Section(f"{svc.name}.env", line))
    return out


def _collect_host(s: Session, services: list[Service]) -> dict[str, str]:
    sections = host_sections(s.host, services)
    token = new_token()
    r = s.run(joined_script(sections, token), timeout=300)
    if r.error:
        return {"_error": f"{r.error.kind}: {r.error.message}"}
    got = split_output(r.stdout, sections, token)
    out = {}
    for sec in sections:
        o = got[sec.key]
        head = "" if o.ok else f"[exit {o.rc if o.rc is not None else 'none'}" + (
            f"; {o.missing_tool} is not installed" if o.missing_tool else "") + "]\n"
        out[sec.key] = redact(_tail(head + o.text))
    return out


def _nccl_verdicts(per_host: dict[str, dict[str, str]]) -> list[dict]:
    from ..checks.nccl import judge
    out = []
    for host, files in per_host.items():
        for key, text in files.items():
            if not key.endswith(".nccl"):
                continue
            for part in text.split("@@file ")[1:]:
                path, _, body = part.partition("\n")
                if body.strip():
                    out.append(judge(body, f"{host}:{path}").as_dict())
    return out


def hang_evidence(inv: Inventory, plan: LaunchPlan, runner: Runner) -> tuple[str | None, str]:
    """hang-dump's document where the shared hung verdict says a service is hung or dead (None otherwise), and
    one line saying which (for the manifest)."""
    from . import hang_dump
    try:
        verdicts = hang_dump.survey(inv, runner, plan)
    except RailyardError as e:
        return None, f"the hung verdict failed: {e}"
    bad = [f"{v.host}/{v.service} {v.state}" for v in verdicts if v.state in ("hung", "dead")]
    if not bad:
        return None, "nothing is hung"
    try:
        return hang_dump.dump(inv, plan, runner, verdicts=verdicts).json(), "; ".join(bad)
    except RailyardError as e:
        return None, f"{'; '.join(bad)}; the hang dump failed: {e}"


def collect(inv: Inventory, plan: LaunchPlan | None, out: Path, preflight_doc: str | None,
            hang: tuple[str | None, str] = (None, "")) -> dict:
    """Write the archive; the manifest it holds. hang: hang_evidence's answer."""
    started = time.time()
    services = plan.services() if plan else []
    with Runner(inv.hosts) as runner:
        got = runner.each(lambda s: _collect_host(s, [x for x in services if x.host == s.host.name]))
    per_host = {h: (got.ok[h] if h in got.ok else {"_error": str(got.failed[h].error)})
                for h in got}
    try:
        ver = version("railyard")
    except PackageNotFoundError:
        ver = "unknown"
    files: list[tuple[str, str]] = [("version.txt", f"railyard {ver}\n"),
                                    ("inventory.yml", redact(Path(inv.path).read_text(errors="replace")))]
    if preflight_doc is not None:
        files.append(("preflight.json", preflight_doc))
    files.append(("verdicts.json", json.dumps(_nccl_verdicts(per_host), indent=1)))
    if hang[0] is not None:
        files.append(("hang-dump.json", hang[0]))
    manifest: dict = {"created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)), "railyard": ver,
                      "inventory": str(inv.path), "layout": plan.layout if plan else None,
                      "hung": hang[1] or None, "hosts": {}, "files": [], "skipped": []}
    for host, secs in per_host.items():
        if "_error" in secs:
            manifest["hosts"][host] = {"error": secs["_error"]}
            continue
        manifest["hosts"][host] = {"sections": sorted(secs)}
        files += [(f"{host}/{key}.txt", text) for key, text in secs.items()]
    total = 0
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        def add(name: str, text: str) -> None:
            data = text.encode(errors="replace")
            info = tarfile.TarInfo(f"railyard-collect/{name}")
            info.size, info.mtime, info.mode = len(data), int(started), 0o600
            tar.addfile(info, io.BytesIO(data))

        for name, text in files:
            size = len(text.encode(errors="replace"))
            if total + size > MAX_TOTAL:
                manifest["skipped"].append({"file": name, "bytes": size, "why": f"the archive is capped at {MAX_TOTAL}"})
                continue
            total += size
            manifest["files"].append({"file": name, "bytes": size})
            add(name, text)
        manifest["seconds"] = round(time.time() - started, 1)
        add("manifest.json", json.dumps(manifest, indent=1))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_bytes(buf.getvalue())
    tmp.chmod(0o600)
    tmp.replace(out)
    return manifest
