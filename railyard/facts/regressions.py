"""Host regressions no link check sees (issue 44, field notes 2026-12): the kernel's CMA accounting
(/proc/meminfo), what the host's own name resolves to (getent hosts), and two things inside the pinned
image: an /etc/nccl.conf and the libnccl.so.2 it would load. Parsers are pure."""

from __future__ import annotations

import re
from dataclasses import dataclass

from . import ParseError
from .probe import Section, split_blocks
from ..transport import Sh, cmd

# ---------------------------------------------------------------- /proc/meminfo


def meminfo_section() -> Section:
    """`cat /proc/meminfo` (what the kernel accounts: CmaTotal, CmaFree, MemFree)."""
    return Section("meminfo", cmd("cat", "/proc/meminfo"), None, 5)


def parse_meminfo(text: str) -> dict[str, int]:
    """`/proc/meminfo` -> {field: kB}: `CmaTotal:        0 kB` -> {"CmaTotal": 0}. Lines without a number
    (or anything else) are skipped; nothing at all read is a ParseError."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        m = re.match(r"^\s*([A-Za-z0-9_()]+):\s+(\d+)(?:\s+kB)?\s*$", line)
        if m:
            out[m.group(1)] = int(m.group(2))
    if not out:
        raise ParseError("no `Field: N kB` line")
    return out


# ---------------------------------------------------------------- the host's own name


def hostname_section() -> Section:
    """The host's name and what it resolves to through NSS (/etc/hosts first on a stock nsswitch.conf): what
    torch's Gloo binds when GLOO_SOCKET_IFNAME is not set (ProcessGroupGloo::createDefaultDevice)."""
    return Section("hostname", Sh('n=$(hostname) && printf \'@@name %s\\n\' "$n" && getent hosts "$n"'), "getent", 5)


@dataclass(frozen=True)
class Resolved:
    name: str | None
    addresses: list[str]  # in getent's order: the first is the one Gloo takes


def parse_hostname(text: str) -> Resolved:
    """`@@name A` then `getent hosts A` (`127.0.1.1       A` per line; nothing where it does not resolve)."""
    name = None
    addrs: list[str] = []
    for line in text.splitlines():
        if line.startswith("@@name "):
            name = line[len("@@name "):].strip() or None
            continue
        parts = line.split()
        if len(parts) >= 2 and re.match(r"^[0-9A-Fa-f:.]+$", parts[0]):
            addrs.append(parts[0])
    return Resolved(name, addrs)


def is_loopback(addr: str) -> bool:
    """127.0.0.0/8 (Debian's `127.0.1.1 HOST` line included) and ::1."""
    return addr.startswith("127.") or addr in ("::1", "0:0:0:0:0:0:0:1")


# ---------------------------------------------------------------- inside the pinned image

# What the image would load: the same path railyard's launch gives vLLM (engines.vllm.NCCL_SO_SETUP:
# VLLM_NCCL_SO_PATH), which is also the one a pip torch links through its RPATH. Read, never loaded:
# the build's own `NCCL version X+cudaY` string and the file's sha256.
NCCL_LIB_SCRIPT = (
    "import hashlib, os, sys\n"
    "try:\n"
    "    import nvidia.nccl as n\n"
    "except ImportError as e:\n"
    "    print('no nvidia.nccl module:', e); sys.exit(3)\n"
    "p = os.path.join(list(n.__path__)[0], 'lib', 'libnccl.so.2')\n"
    "h = hashlib.sha256()\n"
    "v = b''\n"
    "tail = b''\n"
    "try:\n"
    "    with open(p, 'rb') as f:\n"
    "        for chunk in iter(lambda: f.read(1 << 22), b''):\n"
    "            h.update(chunk)\n"
    "            if not v:\n"
    "                buf = tail + chunk\n"
    "                i = buf.find(b'NCCL version ')\n"
    "                if i >= 0 and buf.find(b'\\0', i) >= 0:\n"
    "                    v = buf[i:buf.find(b'\\0', i)]\n"
    "                tail = buf[-64:]\n"
    "except OSError as e:\n"
    "    print('path', p); print('error', e); sys.exit(4)\n"
    "print('path', p)\n"
    "print('sha256', h.hexdigest())\n"
    "print('version', v.decode('ascii', 'replace').strip() or '?')\n"
)

IMAGE_TIMEOUT = 30


def image_files_section(image: str) -> Section:
    """One container of the pinned image (never pulled, no network, removed at once) that prints its
    /etc/nccl.conf and the NCCL build its python3 would load, as `@@part KEY rc=N` blocks."""
    inner = ("if [ -e /etc/nccl.conf ]; then echo '@@part nccl_conf rc=0'; cat /etc/nccl.conf; echo; "
             "else echo '@@part nccl_conf rc=1'; fi\n"
             f"o=$(python3 -c {cmd(NCCL_LIB_SCRIPT)} 2>&1); printf '@@part nccl_lib rc=%s\\n%s\\n' \"$?\" \"$o\"\n")
    return Section("image_files", cmd("docker", "run", "--rm", "--pull", "never", "--network", "none",
                                      "--entrypoint", "sh", image, "-c", inner), "docker", IMAGE_TIMEOUT)


def image_parts(text: str) -> dict[str, tuple[int | None, str]]:
    """The image_files section's output by part: {"nccl_conf": (rc, text), "nccl_lib": (rc, text)}; {} where the
    container never ran (docker's error is then the section's text)."""
    return split_blocks(text, "@@part ")


@dataclass(frozen=True)
class ConfLine:
    number: int
    text: str
    key: str
    value: str


def parse_nccl_conf(text: str) -> list[ConfLine]:
    """An nccl.conf as NCCL reads it (misc/param.cc setEnvFile): a line starting with `#` is skipped, so is one
    without `=`; the key is everything before the first `=` (spaces kept), the value the rest. Each line as
    {number, text, key, value}."""
    out = []
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.rstrip("\r")
        if not line or line.startswith("#") or "=" not in line:
            continue
        key, _, value = line.partition("=")
        out.append(ConfLine(n, line, key, value))
    return out


@dataclass(frozen=True)
class NcclLib:
    path: str
    sha256: str
    version: str  # `NCCL version 2.27.3+cuda12.9`, or `?` where the build carries no such string


def parse_nccl_lib(text: str) -> NcclLib:
    """`path P` / `sha256 H` / `version NCCL version X` (NCCL_LIB_SCRIPT's output)."""
    got = {}
    for line in text.splitlines():
        k, _, v = line.partition(" ")
        if k in ("path", "sha256", "version"):
            got[k] = v.strip()
    if not got.get("sha256") or not got.get("path"):
        raise ParseError(f"no library read: {text.strip()[:200]}")
    return NcclLib(got["path"], got["sha256"], got.get("version") or "?")
