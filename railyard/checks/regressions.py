"""Host regressions of 2026 (field notes, issue 44): CMA the kernel does not account, an /etc/nccl.conf inside
the pinned image, NCCL builds that differ across ranks, and Gloo bound to loopback. Pure: facts in, results out.
"""

from __future__ import annotations

import re

from . import FAIL, PASS, SKIP, WARN, CheckResult, first_lines, unusable
from ..facts import ParseError
from ..facts.net import parse_ip_br_addr
from ..facts.probe import Output
from ..facts.regressions import (NcclLib, image_parts, is_loopback, parse_hostname, parse_meminfo, parse_nccl_conf,
                                 parse_nccl_lib)
from ..inventory import Host

# ---------------------------------------------------------------- cma

# GPUs whose memory path runs through the kernel's page allocator: Grace-coupled parts (GB10 in the DGX Spark,
# GH200, GB200, GB300). On them the NIC's long-term pin of NCCL's buffers (ibv_reg_mr -> pin_user_pages
# FOLL_LONGTERM) must migrate pages out of CMA pageblocks, which fails with ENOMEM while the GPU driver holds them.
COHERENT_GPU = re.compile(r"\bG[BH]\d{2,3}\b", re.I)


def check_cma(host: Host, out: Output | None) -> CheckResult:
    """/proc/meminfo on a Grace-coupled GPU host: CmaFree must not exceed CmaTotal. More free CMA than the kernel
    accounts is memory handed out as MIGRATE_CMA pageblocks outside every CMA area (the KHO scratch area of the
    linux-nvidia 7.0 kernels: `CmaTotal: 0 kB` with GiBs in CmaFree); NCCL's ibv_reg_mr then fails with ENOMEM."""
    gpu = host.vars["cluster_gpu_name"]
    if not COHERENT_GPU.search(gpu):
        return CheckResult(host.name, "cma", SKIP, f"{gpu}: not a Grace-coupled GPU (its memory is its own; NCCL "
                           "registers it through peer memory or dma-buf, not from CMA)")
    bad = unusable(host, "cma", out, "cat /proc/meminfo")
    if bad:
        return bad
    assert out is not None  # unusable() fails a missing output
    try:
        m = parse_meminfo(out.text)
    except ParseError:
        return CheckResult(host.name, "cma", FAIL, "/proc/meminfo could not be read", first_lines(out.text),
                           "run `cat /proc/meminfo` on the host")
    if "CmaTotal" not in m:
        return CheckResult(host.name, "cma", PASS, "no CmaTotal in /proc/meminfo: this kernel has no CMA",
                           f"MemTotal: {m.get('MemTotal', '?')} kB")
    total, free = m["CmaTotal"], m.get("CmaFree", 0)
    ev = f"CmaTotal: {total} kB, CmaFree: {free} kB (/proc/meminfo)"
    if free > total:
        return CheckResult(host.name, "cma", FAIL,
                           f"CmaFree {free // 1024} MiB exceeds CmaTotal {total // 1024} MiB: pageblocks outside every "
                           f"CMA area are given out as CMA, and the NIC's long-term pin of NCCL's buffers on {gpu} then "
                           "fails (ibv_reg_mr_iova2 ... Cannot allocate memory)", ev,
                           "boot with kho=off (kernel command line; a kernel built with "
                           "CONFIG_KEXEC_HANDOVER_ENABLE_DEFAULT=n does the same), reboot, and see CmaFree <= CmaTotal "
                           "(docs/runbook.md: NCCL init fails with ENOMEM)")
    return CheckResult(host.name, "cma", PASS, f"CmaFree within CmaTotal ({total // 1024} MiB)", ev)


# ---------------------------------------------------------------- inside the image

def _image_unread(host: Host, check: str, out: Output | None, image_ok: bool) -> tuple[CheckResult | None, dict]:
    if not image_ok:
        return CheckResult(host.name, check, SKIP, "pinned image not usable here (see the image check)"), {}
    bad = unusable(host, check, out, "docker run IMAGE")
    if bad:
        return bad, {}
    assert out is not None
    parts = image_parts(out.text)
    if not parts:
        return CheckResult(host.name, check, FAIL, "a container of the pinned image did not run",
                           first_lines(out.text, 2), "run `docker run --rm --pull never --entrypoint sh IMAGE -c true` "
                           "by hand: the daemon's error says why"), {}
    return None, parts


def check_nccl_conf(host: Host, out: Output | None, image_ok: bool, env: dict[str, str]) -> CheckResult:
    """An /etc/nccl.conf in the pinned image. NCCL reads it at init and sets each line's variable only where the
    environment lacks it (setenv without overwrite): lines for keys railyard renders are shadowed (warn: in effect
    in any container started without railyard's env); any other NCCL line changes every rank unseen by the env
    files railyard writes (fail)."""
    bad, parts = _image_unread(host, "nccl_conf", out, image_ok)
    if bad:
        return bad
    rc, text = parts.get("nccl_conf", (None, ""))
    if rc is None:
        return CheckResult(host.name, "nccl_conf", FAIL, "the image's /etc/nccl.conf was not read", "",
                           "rerun; if it repeats, `docker run --rm --entrypoint cat IMAGE /etc/nccl.conf` by hand")
    if rc != 0:
        return CheckResult(host.name, "nccl_conf", PASS, "no /etc/nccl.conf in the pinned image")
    lines = parse_nccl_conf(text)
    if not lines:
        return CheckResult(host.name, "nccl_conf", PASS, "/etc/nccl.conf in the image sets nothing (comments only)",
                           first_lines(text))
    live = [c for c in lines if c.key not in env]
    shadowed = [c for c in lines if c.key in env]
    ev = " | ".join(f"{c.number}: {c.text}" for c in lines)
    if live:
        return CheckResult(host.name, "nccl_conf", FAIL,
                           "/etc/nccl.conf in the pinned image sets " + ", ".join(f"{c.text} (line {c.number})" for c in live)
                           + ": NCCL applies it on every rank, outside the env files railyard renders"
                           + (f"; {', '.join(c.key for c in shadowed)} there is overridden by railyard's env" if shadowed
                              else ""), ev,
                           "remove the file from the image (or set what it needs in vllm_extra_env, where railyard "
                           "renders it and `inv render` shows it), then pin the new digest in vllm_image")
    return CheckResult(host.name, "nccl_conf", WARN,
                       "/etc/nccl.conf in the pinned image sets " + ", ".join(f"{c.text} (line {c.number})" for c in shadowed)
                       + ": overridden by railyard's env (NCCL keeps the environment's value), but in effect in any "
                       "container of this image started without it", ev,
                       "remove the file from the image: it is a second, hidden source of NCCL settings")


def nccl_lib_of(host: Host, out: Output | None, image_ok: bool) -> tuple[NcclLib | None, CheckResult | None]:
    """The image's libnccl.so.2 on one host, or the result that says why it was not read."""
    bad, parts = _image_unread(host, "nccl_lib", out, image_ok)
    if bad:
        return None, bad
    rc, text = parts.get("nccl_lib", (None, ""))
    if rc != 0:
        return None, CheckResult(host.name, "nccl_lib", FAIL, "the image's NCCL library could not be read",
                                 first_lines(text, 2), "the image needs python3 and the nvidia-nccl wheel "
                                 "(nvidia.nccl): the library railyard's launch loads (VLLM_NCCL_SO_PATH)")
    try:
        return parse_nccl_lib(text), None
    except ParseError as e:
        return None, CheckResult(host.name, "nccl_lib", FAIL, f"the image's NCCL library could not be read: {e}",
                                 first_lines(text, 2), "run the probe by hand (docs/preflight.md)")


def _build(lib: NcclLib) -> str:
    return f"{lib.version.removeprefix('NCCL version ')} (sha256:{lib.sha256[:12]})"


def check_nccl_lib(hosts: list[Host], libs: dict[str, NcclLib]) -> dict[str, CheckResult]:
    """The NCCL build each rank's image would load: one build (version string and file digest) on every rank
    that read one; a rank with another build fails, both builds named (vLLM #46097: a TP group spinning on
    mixed builds)."""
    res: dict[str, CheckResult] = {}
    by: dict[str, list[str]] = {}
    for h in hosts:
        if h.name in libs:
            by.setdefault(libs[h.name].sha256, []).append(h.name)
    if not by:
        return res
    common = max(by, key=lambda d: (len(by[d]), -min(hosts.index(next(x for x in hosts if x.name == n))
                                                       for n in by[d])))
    ref_host = by[common][0]
    for h in hosts:
        lib = libs.get(h.name)
        if lib is None:
            continue
        ev = f"{lib.path}: {lib.version}, sha256 {lib.sha256}"
        if lib.sha256 == common:
            res[h.name] = CheckResult(h.name, "nccl_lib", PASS, f"{_build(lib)}, the same on {len(by[common])} "
                                      f"rank(s)" if len(by) == 1 else f"{_build(lib)}, as on {len(by[common])} rank(s)", ev)
            continue
        other = libs[ref_host]
        res[h.name] = CheckResult(h.name, "nccl_lib", FAIL,
                                  f"this rank's image loads NCCL {_build(lib)}; {ref_host}"
                                  + (f" (and {len(by[common]) - 1} more)" if len(by[common]) > 1 else "")
                                  + f" load(s) {_build(other)}", ev,
                                  "run one image with one NCCL on every rank: docker pull the pinned vllm_image "
                                  f"everywhere, and remove whatever puts another libnccl.so.2 at {lib.path} here")
    if len(by) > 1:  # the majority is named too: the check's verdict is the group's
        for n in by[common]:
            r = res[n]
            res[n] = CheckResult(n, "nccl_lib", FAIL, f"{r.detail}; other builds on "
                                 + ", ".join(f"{x} ({_build(libs[x])})" for d, xs in by.items() if d != common for x in xs),
                                 r.evidence, "run one NCCL build on every rank (see the odd ranks' rows)")
    return res


# ---------------------------------------------------------------- gloo

def check_gloo_iface(host: Host, env: dict[str, str], spans: bool, hostname: Output | None,
                     ip_addr: Output | None) -> CheckResult:
    """The address torch's Gloo binds on this host: the interface(s) in GLOO_SOCKET_IFNAME as railyard renders it
    for the layout, else the first address the host's own name resolves to (ProcessGroupGloo::createDefaultDevice;
    none: it falls back to loopback). Loopback fails where the layout's ranks span hosts: the peers are told to
    connect to it (`Gloo connectFullMesh failed ... remote=[127.0.0.1]`)."""
    resolved = parse_hostname(hostname.text) if hostname is not None and hostname.rc is not None else None
    said = (f"`getent hosts {resolved.name}`: {', '.join(resolved.addresses) or 'nothing'}" if resolved and resolved.name
            else "the host's name was not read")
    ifname = env.get("GLOO_SOCKET_IFNAME", "")
    if len(ifname) > 1:  # torch takes the variable only when longer than one character
        bad = unusable(host, "gloo_iface", ip_addr, "ip -br addr")
        if bad:
            return bad
        assert ip_addr is not None
        addrs = parse_ip_br_addr(ip_addr.text)
        problems, bound = [], []
        for name in ifname.split(","):
            a = addrs.get(name)
            ips = [ip.split("/")[0] for ip in a.ipv4] if a else []
            if a is None:
                problems.append(f"{name} does not exist")
            elif not ips or all(is_loopback(ip) for ip in ips):
                problems.append(f"{name} has {', '.join(ips) or 'no IPv4 address'}")
            else:
                bound.append(f"{name} ({', '.join(ips)})")
        if problems:
            return CheckResult(host.name, "gloo_iface", FAIL, f"GLOO_SOCKET_IFNAME={ifname} as railyard renders it: "
                               + "; ".join(problems), said, "set GLOO_SOCKET_IFNAME (vllm_extra_env) to the rail "
                               "interface, or leave it to railyard (it renders cluster_serve_rail)")
        return CheckResult(host.name, "gloo_iface", PASS, f"Gloo binds {', '.join(bound)} (GLOO_SOCKET_IFNAME as railyard "
                           "renders it)", said)
    if resolved is None or not resolved.name:
        bad = unusable(host, "gloo_iface", hostname, "getent hosts $(hostname)")
        return bad or CheckResult(host.name, "gloo_iface", FAIL, "the host's name was not read", first_lines(
            hostname.text if hostname else ""), "run `getent hosts $(hostname)` on the host")
    first = resolved.addresses[0] if resolved.addresses else None
    where = f"{resolved.name} resolves to {first}" if first else f"{resolved.name} does not resolve (Gloo falls back " \
                                                                  "to loopback)"
    if first is None or is_loopback(first):
        if not spans:
            return CheckResult(host.name, "gloo_iface", PASS, f"{where}: the layout's ranks share this host, loopback "
                               "serves them", said)
        return CheckResult(host.name, "gloo_iface", FAIL, f"Gloo would bind loopback: no GLOO_SOCKET_IFNAME, and {where}; "
                           "its peers on other hosts cannot reach it (Gloo connectFullMesh failed ... remote=[127.0.0.1])",
                           said, f"map {resolved.name} to its rail or management address in /etc/hosts (Debian's "
                           "`127.0.1.1 HOST` line is the usual culprit), or set GLOO_SOCKET_IFNAME in vllm_extra_env")
    return CheckResult(host.name, "gloo_iface", PASS, f"Gloo binds {first} (no GLOO_SOCKET_IFNAME; {where})", said)
