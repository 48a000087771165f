"""GPU checks: the cluster's GPUs present and idle, and healthy (ECC, row remapping, Xid).
"""

from __future__ import annotations

from . import FAIL, PASS, WARN, CheckResult, first_lines, unusable
from ..facts import ParseError
from ..facts.gpu import (HEALTH_UNSUPPORTED, parse_compute_apps, parse_gpu_health, parse_gpus, parse_xids, pci_matches,
                         select_gpu)
from ..facts.probe import Output
from ..inventory import Host


def check_gpu(host: Host, gpus_out: Output, apps_out: Output) -> CheckResult:
    bad = unusable(host, "gpu", gpus_out, "nvidia-smi")
    if bad:
        return bad
    selector = host.vars["cluster_gpu_name"]
    if gpus_out.rc != 0 or "No devices were found" in gpus_out.text:
        return CheckResult(host.name, "gpu", FAIL, "nvidia-smi found no GPU", first_lines(gpus_out.text, 2),
                           "is the NVIDIA driver loaded? `nvidia-smi`, `dmesg | grep -i nvrm`")
    try:
        gpus = parse_gpus(gpus_out.text)
    except ParseError as e:
        return CheckResult(host.name, "gpu", FAIL, f"cannot read nvidia-smi: {e}", first_lines(gpus_out.text, 2))
    chosen = select_gpu(gpus, selector)
    listing = "; ".join(f"{g.index}: {g.name}" for g in gpus)
    if not chosen:
        return CheckResult(host.name, "gpu", FAIL, f"no GPU matches {selector!r}", listing,
                           f"check cluster_gpu_name against `nvidia-smi -L`; is the {selector} visible to the driver?")
    try:
        apps = parse_compute_apps(apps_out.text) if apps_out and apps_out.ok else []
    except ParseError:
        apps = []
    uuids = {g.uuid for g in chosen}
    busy = [a for a in apps if a.gpu_uuid in uuids]
    names = ", ".join(f"{g.name} {g.uuid}" for g in chosen)
    if apps_out is None or not apps_out.ok:
        return CheckResult(host.name, "gpu", FAIL, f"{names}: cannot list compute processes",
                           first_lines(apps_out.text if apps_out else "", 2), "run `nvidia-smi` on the host")
    if busy:
        procs = "; ".join(f"pid {a.pid} {a.name} holds {a.used_mib} MiB" for a in busy)
        return CheckResult(host.name, "gpu", FAIL, f"{chosen[0].name} {chosen[0].uuid} is busy: {procs}", names,
                           "stop that process (or the container holding it: `docker ps`), then check `nvidia-smi` again")
    used = ", ".join(f"{g.memory_used_mib} MiB used of {g.memory_total_mib}" for g in chosen)
    return CheckResult(host.name, "gpu", PASS, f"{names} idle ({used})", listing)


# ---------------------------------------------------------------- GPU health

# Xid codes an application usually causes (an illegal address, a kernel stopped): worth a look, not a drained node.
APP_XIDS = {13, 31, 43, 45}


XID_FIX = {48: "uncorrectable ECC (DBE)", 63: "page retirement / row remap recorded", 64: "page retirement / row "
           "remap failed", 74: "NVLink error", 79: "GPU fell off the bus", 92: "high single-bit ECC rate",
           94: "contained ECC error", 95: "uncontained ECC error", 109: "context switch timeout",
           119: "GSP timeout", 120: "GSP error"}


DRAIN = ("drain the host (inv stop), then reset the GPU (sudo nvidia-smi -r -i {idx}, or reboot) so the pending "
         "repair applies; if uncorrectable errors come back, RMA the GPU")


def check_gpu_health(host: Host, health_out: Output, dmesg_out: Output | None) -> CheckResult:
    """Uncorrectable ECC since the driver loaded, pending page retirement / row remapping, a failed remap, and
    Xid errors in the kernel log since boot, for the cluster GPUs. A pass needs both sources read."""
    bad = unusable(host, "gpu_health", health_out, "nvidia-smi")
    if bad:
        return bad
    if HEALTH_UNSUPPORTED in health_out.text:
        return CheckResult(host.name, "gpu_health", WARN, "this driver's nvidia-smi does not report the ECC / "
                           "retired-page / row-remap fields: GPU health not read",
                           "nvidia-smi --query-gpu=...,remapped_rows.pending: not a valid field",
                           "update the NVIDIA driver, or read `nvidia-smi -q -d ECC,PAGE_RETIREMENT` by hand")
    if health_out.rc != 0 or "No devices were found" in health_out.text:
        return CheckResult(host.name, "gpu_health", FAIL, "nvidia-smi could not report GPU health",
                           first_lines(health_out.text, 2), "`nvidia-smi -q -d ECC,PAGE_RETIREMENT,ROW_REMAPPER`")
    try:
        gpus = parse_gpu_health(health_out.text)
    except ParseError as e:
        return CheckResult(host.name, "gpu_health", FAIL, f"cannot read nvidia-smi: {e}", first_lines(health_out.text, 2))
    fails: list[str] = []
    warns: list[str] = []
    ev: list[str] = []
    for g in gpus:
        tag = f"GPU {g.index} {g.uuid}"
        if g.ecc_uncorrected_volatile:
            fails.append(f"{tag}: {g.ecc_uncorrected_volatile} uncorrectable ECC error(s) since the driver loaded")
        if g.remapped_rows_failure:
            fails.append(f"{tag}: row remapping failed (no spare rows left)")
        if g.remapped_rows_pending:
            fails.append(f"{tag}: row remapping pending (applies at the next GPU reset)")
        if g.retired_pages_pending:
            fails.append(f"{tag}: page retirement pending (applies at the next GPU reset)")
        ev.append(f"{g.index}: ecc.uncorrected.volatile={_na(g.ecc_uncorrected_volatile)} "
                  f"aggregate={_na(g.ecc_uncorrected_aggregate)} retired_pages.pending={_na(g.retired_pages_pending)} "
                  f"remapped_rows.pending={_na(g.remapped_rows_pending)} failure={_na(g.remapped_rows_failure)}")
    kernel_read = False
    if dmesg_out is not None and dmesg_out.rc == 0 and not dmesg_out.missing_tool:
        kernel_read = True
        for x in parse_xids(dmesg_out.text):
            hit = next((g for g in gpus if pci_matches(x.pci, g.bus_id)), None)
            tag = f"GPU {hit.index} ({x.pci})" if hit else f"PCI {x.pci}"
            what = XID_FIX.get(x.code, x.text[:80])
            (warns if x.code in APP_XIDS else fails).append(f"{tag}: Xid {x.code} since boot ({what})")
            ev.append(x.line[:200])
    fails, warns = list(dict.fromkeys(fails)), list(dict.fromkeys(warns))
    idx = ",".join(str(g.index) for g in gpus) or "N"
    if fails:
        hw = any("remapping failed" in f or "Xid 79" in f for f in fails)
        hint = DRAIN.format(idx=idx) if not hw else \
            "drain the host and RMA the GPU (row remap failure or fallen off the bus); reseat/power-cycle first for Xid 79"
        return CheckResult(host.name, "gpu_health", FAIL, "; ".join(fails[:4]) + ("; ..." if len(fails) > 4 else ""),
                           " | ".join(ev[:6]), hint)
    if not kernel_read:
        if dmesg_out is None or dmesg_out.rc is None:
            why = "dmesg gave no result"
        elif dmesg_out.missing_tool:
            why = f"`{dmesg_out.missing_tool}` not found"
        else:
            why = first_lines(dmesg_out.text, 1) or f"dmesg exit {dmesg_out.rc}"
        return CheckResult(host.name, "gpu_health", WARN, f"{len(gpus)} GPU(s) without ECC or remap faults; the kernel "
                           f"log could not be read for Xid errors ({why})", " | ".join(ev[:6]),
                           "allow the preflight user to read it: sudo sysctl kernel.dmesg_restrict=0, or add it to the "
                           "adm group (journalctl -k); then rerun")
    if warns:
        return CheckResult(host.name, "gpu_health", WARN, "; ".join(warns[:4]), " | ".join(ev[:6]),
                           "application-caused Xids (illegal address, kernel stopped): check the job that ran; "
                           "reset the GPU if they repeat with a known-good workload")
    return CheckResult(host.name, "gpu_health", PASS, f"{len(gpus)} GPU(s): no uncorrectable ECC, no pending retirement "
                       "or remap, no Xid since boot", " | ".join(ev[:4]))


def _na(v) -> str:
    return "N/A" if v is None else ("Yes" if v is True else "No" if v is False else str(v))
