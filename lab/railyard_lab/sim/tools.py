#!/usr/bin/python3 -SI
"""Stand-ins for tools a lab host cannot have: ibdev2netdev, show_gids, nvidia-smi, lscpu, timedatectl, docker.

Installed on each lab host's PATH as symlinks to this one file; the name it is called by
picks the tool. Output formats are copied from real captures (tests/fixtures/real/).
Where a kernel state exists the output follows it: link state, addresses and MACs come
from the host's own network namespace (/sys/class/net, `ip`). The hardware (GPUs, HCAs,
CPUs, NUMA nodes) is the host's shape, read from $RAILYARD_LAB_HOST_DIR/shape.json (written
by `lab.up`). Faults the kernel cannot show (a busy GPU, NTP, Docker) are read from the host's
lab state directory, $RAILYARD_LAB_HOST_DIR/state; GPU memory held by running processes from
$RAILYARD_LAB_HOST_DIR/gpu-held. Standard library only: this runs on the test host.
"""

import hashlib
import json
import re
import shlex
import shutil
import os
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.realpath(__file__))
HOST_DIR = os.environ.get("RAILYARD_LAB_HOST_DIR", "")
STATE = os.path.join(HOST_DIR, "state")
HELD = os.path.join(HOST_DIR, "gpu-held")  # one file per live process holding GPU memory: PID.json
_SHAPE = []


def shape():
    """This host's hardware, as `lab.up` wrote it: GPUs, HCA -> rail netdev, NICs, CPUs and NUMA nodes."""
    if not _SHAPE:
        try:
            with open(os.path.join(HOST_DIR, "shape.json")) as f:
                _SHAPE.append(json.load(f))
        except (OSError, ValueError):
            print("lab: this host has no shape.json (run `inv lab.up`)", file=sys.stderr)
            sys.exit(70)
    return _SHAPE[0]


def _hcas():
    """RDMA device -> rail netdev."""
    return shape()["hcas"]


def _lab():
    with open(os.path.join(HERE, "lab.json")) as f:
        return json.load(f)


def _state(name, default=None):
    try:
        with open(os.path.join(STATE, name)) as f:
            return f.read().strip()
    except OSError:
        return default


def _host():
    return socket.gethostname()


def _sys(iface, attr):
    try:
        with open(f"/sys/class/net/{iface}/{attr}") as f:
            return f.read().strip()
    except OSError:
        return None


def _ipv4s(iface):
    out = subprocess.run(["ip", "-4", "-o", "addr", "show", "dev", iface], capture_output=True, text=True).stdout
    return [line.split()[3].split("/")[0] for line in out.splitlines() if " inet " in line]


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


def _start_time(pid):
    """A process's start time (clock ticks since boot): with the pid, it names one process for good."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(") ", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def hold(pid, name, mib, uuid):
    """Record that process `pid` holds `mib` MiB on the GPU `uuid` (nvidia-smi shows it while it lives)."""
    os.makedirs(HELD, exist_ok=True)
    tmp = os.path.join(HELD, f".{pid}.{uuid}.tmp")
    with open(tmp, "w") as f:
        json.dump({"pid": pid, "start": _start_time(pid), "name": name, "mib": mib, "uuid": uuid}, f)
    os.replace(tmp, os.path.join(HELD, f"{pid}.{uuid}.json"))


IPC_NAME = "/usr/bin/python3"  # nvidia-smi's process_name for the LMCache server (python, as in the vLLM image)


def hold_ipc(server, mib, uuid, of_pid, instance_id, log=None):
    """Record that the LMCache server `server` maps `mib` MiB of process `of_pid`'s KV cache on GPU `uuid`
    through CUDA IPC (registered as LMCache instance `instance_id`). nvidia-smi shows it under the
    server's PID only once `of_pid` is gone (before that the memory is the worker's own), and forgets it
    when the server exits or lets go of the instance: `Unregistered KV cache for GPU ID <id>` or
    `Reaped GPU instance <id>` in the server's container log `log` after this point. Returns the file."""
    os.makedirs(HELD, exist_ok=True)
    path = os.path.join(HELD, f"ipc.{server}.{uuid}.json")
    try:
        log_from = os.path.getsize(log) if log else 0
    except OSError:
        log_from = 0
    rec = {"pid": server, "start": _start_time(server), "name": IPC_NAME, "mib": mib, "uuid": uuid,
           "ipc_of": of_pid, "ipc_of_start": _start_time(of_pid), "instance_id": instance_id, "log": log,
           "log_from": log_from}
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(rec, f)
    os.replace(tmp, path)
    return path


def _ipc_released(rec):
    """Whether the server's log says it let go of the record's instance since the record was made."""
    if not rec.get("log"):
        return False
    try:
        with open(rec["log"], "rb") as f:
            f.seek(rec.get("log_from", 0))
            text = f.read().decode(errors="replace")
    except OSError:
        return False
    iid = rec["instance_id"]
    import re
    return re.search(rf"(Unregistered KV cache for GPU ID|Reaped GPU instance) {iid}\b", text) is not None


def release(pid):
    for n in _held_files():
        if n.startswith(f"{pid}."):
            try:
                os.unlink(os.path.join(HELD, n))
            except OSError:
                pass


def _held_files():
    try:
        return sorted(os.listdir(HELD))
    except OSError:
        return []


def held():
    """Live processes holding GPU memory: [{pid, name, mib, uuid}], oldest first; dead ones are forgotten."""
    out = []
    for n in _held_files():
        if not n.endswith(".json"):
            continue
        try:
            with open(os.path.join(HELD, n)) as f:
                rec = json.load(f)
        except (OSError, ValueError):
            continue
        alive = _alive(rec["pid"]) and _start_time(rec["pid"]) == rec.get("start")
        if alive and "ipc_of" in rec:
            if _ipc_released(rec):
                alive = False
            elif _alive(rec["ipc_of"]) and _start_time(rec["ipc_of"]) == rec.get("ipc_of_start"):
                continue  # the worker lives: the memory is its own, counted once
        if alive:
            out.append(rec)
        else:
            try:
                os.unlink(os.path.join(HELD, n))
            except OSError:
                pass
    return sorted(out, key=lambda r: (r.get("start") or 0, r["pid"]))


# ---------------------------------------------------------------- ibdev2netdev

def ibdev2netdev(args):
    # real: "mlx5_1 port 1 ==> cx8r1 (Up)", sorted by device name as text
    hcas = _hcas()
    for hca in sorted(hcas):
        netdev = hcas[hca]
        if _sys(netdev, "operstate") is None:
            continue
        up = _sys(netdev, "operstate") == "up" and _sys(netdev, "carrier") == "1"
        print(f"{hca} port 1 ==> {netdev} ({'Up' if up else 'Down'})")
    return 0


# ---------------------------------------------------------------- show_gids

def _link_local(mac):
    b = [int(x, 16) for x in mac.split(":")]
    eui = [b[0] ^ 0x02, b[1], b[2], 0xFF, 0xFE, b[3], b[4], b[5]]
    words = [f"{eui[i]:02x}{eui[i + 1]:02x}" for i in range(0, 8, 2)]
    return "fe80:0000:0000:0000:" + ":".join(words)


def _mapped(ip):
    a, b, c, d = (int(x) for x in ip.split("."))
    return f"0000:0000:0000:0000:0000:ffff:{a:02x}{b:02x}:{c:02x}{d:02x}"


def show_gids(args):
    wanted = args[0] if args else None
    rows = []
    hcas = _hcas()
    for hca in sorted(hcas):
        netdev = hcas[hca]
        if wanted and hca != wanted:
            continue
        mac = _sys(netdev, "address")
        if mac is None:
            continue
        gids = [(_link_local(mac), "")]
        # `gid-index N` moves the IPv4 RoCE v2 entry to index N (odd) by adding
        # link-local entries before it, as a host with more IPv6 addresses has
        shift = _state("gid-index", "3")
        extra = (int(shift) - 3) // 2 if shift.isdigit() else 0
        for k in range(extra):
            h = hashlib.sha256(f"{mac}{k}".encode()).hexdigest()
            gids.append(("fe80:0000:0000:0000:" + ":".join(h[i:i + 4] for i in range(0, 16, 4)), ""))
        for ip in _ipv4s(netdev):
            gids.append((_mapped(ip), ip))
        index = 0
        for gid, ip in gids:
            for ver in ("v1", "v2"):
                if ver == "v2" and ip and shift == "none":
                    index += 1
                    continue
                ipcol = f"{ip}  " if ip else ""
                rows.append(f"{hca}\t1\t{index}\t{gid}\t{ipcol}\t{'' if ip else chr(9)}{ver}\t{netdev}")
                index += 1
    print("DEV\tPORT\tINDEX\tGID\t\t\t\t\tIPv4  \t\tVER\tDEV")
    print("---\t----\t-----\t---\t\t\t\t\t------------  \t---\t---")
    for r in rows:
        print(r)
    print(f"n_gids_found={len(rows)}")
    return 0


# ---------------------------------------------------------------- nvidia-smi

DRIVER = "580.105.08"
CUDA = "13.0"  # the driver's CUDA version, as nvidia-smi prints it
DRIVER_CUDA = {"535": "12.2", "550": "12.4", "570": "12.8", "575": "12.9"}  # older branches (driver-mismatch)


def _cuda(driver):
    return DRIVER_CUDA.get(driver.split(".", 1)[0], CUDA)


def _gpus():
    """The host's GPUs as nvidia-smi numbers them: the shape's GPUs, each with the processes holding
    memory on it (the gpu-busy fault's process, serving processes) and its memory used."""
    nogpu = _state("no-gpu", "")
    gpus = [dict(g, slot=k, procs=[tuple(p) for p in g["procs"]]) for k, g in enumerate(shape()["gpus"])]
    busy = _state("gpu-busy")
    if busy:
        info = json.loads(busy)
        idx = info.get("index")
        target = gpus[idx] if isinstance(idx, int) and idx < len(gpus) else next(g for g in gpus if not g["display"])
        if _alive(info["pid"]):
            target["procs"].append((info["pid"], "C", info.get("name", "python3"), info.get("mib", 8710)))
    by_uuid = {g["uuid"]: g for g in gpus}
    for rec in held():  # serving processes, in containers or on the host itself
        if rec["uuid"] in by_uuid:
            by_uuid[rec["uuid"]]["procs"].append((rec["pid"], "C", rec["name"], rec["mib"]))
    if nogpu == "all":
        return []
    if nogpu == "gb300":  # the compute GPUs are gone; a display GPU stays
        gpus = [g for g in gpus if g["display"]]
    elif nogpu.isdigit() and int(nogpu) < len(gpus):
        del gpus[int(nogpu)]
    for i, g in enumerate(gpus):
        g["index"] = i
        g["used"] = g["base"] + sum(p[3] for p in g["procs"]) + (9 if any(p[1] == "C" for p in g["procs"]) else 0)
    return gpus


def _csv(args, header_names, rows, unit_cols):
    fmt = next((a.split("=", 1)[1] for a in args if a.startswith("--format=")), "")
    opts = set(fmt.split(","))
    if "csv" not in opts:
        print("Invalid combination of input arguments. Please run 'nvidia-smi -h' for help.")
        return 2
    if "noheader" not in opts:
        print(", ".join(header_names))
    for row in rows:
        cells = [f"{v} MiB" if i in unit_cols and "nounits" not in opts else str(v) for i, v in enumerate(row)]
        print(", ".join(cells))
    return 0


def _driver():
    return _state("driver-mismatch") or DRIVER  # the driver-mismatch fault: this host runs another driver


def _health(g, target):
    """The gpu-ecc fault's numbers on the compute GPU (target): uncorrectable ECC and a pending row remap,
    as a real H200/GB300 reports them (`retired_pages.pending` is [N/A] on row-remapping GPUs)."""
    ecc = _state("gpu-ecc")
    n = int(ecc) if ecc and ecc.isdigit() and g is target else 0
    return {"ecc": n, "pending": "Yes" if n else "No"}


def nvidia_smi(args):
    gpus = _gpus()
    target = next((x for x in gpus if not x["display"]), None)
    driver = _driver()
    if "--version" in args:
        print(f"NVIDIA-SMI version  : {driver}\nNVML version        : {driver.rsplit('.', 1)[0]}\n"
              f"DRIVER version      : {driver}\nCUDA Version        : {_cuda(driver)}")
        return 0
    if not gpus:
        print("No devices were found")
        return 6
    queries = [a for a in args if a.startswith("--query-")]
    if len(queries) > 1:
        print("Only one --query-* switch can be used at a time.")  # real: tests/fixtures/real/nvidia-smi-one-call
        return 2
    if args[:1] in (["-q"], ["--query"]):
        return _query_report(gpus, driver, args[1:])
    q = next((a for a in args if a.startswith("--query-gpu=") or a.startswith("--query-compute-apps=")), None)
    if q:
        kind, fields = q[2:].split("=", 1)
        names = fields.split(",")
        if kind == "query-gpu":
            table = {"index": ("index", lambda g: g["index"]), "uuid": ("uuid", lambda g: g["uuid"]),
                     "name": ("name", lambda g: g["name"]), "pci.bus_id": ("pci.bus_id", lambda g: g["bus"]),
                     "memory.used": ("memory.used [MiB]", lambda g: g["used"]),
                     "memory.total": ("memory.total [MiB]", lambda g: g["total"]),
                     "memory.free": ("memory.free [MiB]", lambda g: g["total"] - g["used"]),
                     "driver_version": ("driver_version", lambda g: driver),
                     "ecc.errors.uncorrected.volatile.total": ("ecc.errors.uncorrected.volatile.total",
                                                               lambda g: _health(g, target)["ecc"]),
                     "ecc.errors.uncorrected.aggregate.total": ("ecc.errors.uncorrected.aggregate.total",
                                                                lambda g: _health(g, target)["ecc"]),
                     "retired_pages.pending": ("retired_pages.pending", lambda g: "[N/A]"),
                     "remapped_rows.pending": ("remapped_rows.pending", lambda g: _health(g, target)["pending"]),
                     "remapped_rows.failure": ("remapped_rows.failure", lambda g: "No")}
            items = gpus
        else:
            table = {"gpu_uuid": ("gpu_uuid", lambda p: p[0]["uuid"]), "pid": ("pid", lambda p: p[1][0]),
                     "process_name": ("process_name", lambda p: p[1][2]),
                     "used_memory": ("used_gpu_memory [MiB]", lambda p: p[1][3]),
                     "gpu_bus_id": ("gpu_bus_id", lambda p: p[0]["bus"])}
            items = [(g, p) for g in gpus for p in g["procs"] if p[1] == "C"]
        for n in names:
            if n not in table:
                print(f'Field "{n}" is not a valid field to query.')
                return 2
        units = {i for i, n in enumerate(names) if table[n][0].endswith("[MiB]")}
        return _csv(args, [table[n][0] for n in names], [[table[n][1](it) for n in names] for it in items], units)
    if "-L" in args:
        for g in gpus:
            print(f"GPU {g['index']}: {g['name']} (UUID: {g['uuid']})")
        return 0
    if args[:1] == ["topo"]:
        if not any(a in ("-m", "--matrix") for a in args[1:]):
            print("Invalid combination of input arguments. Please run 'nvidia-smi -h' for help.")
            return 2
        _topo(gpus)
        return 0
    _table(gpus)
    return 0


def _query_report(gpus, driver, args):
    """`nvidia-smi -q -d PIDS`, laid out as the real H200 capture (tests/fixtures/real/nvidia-smi-one-call/): the
    header with the driver's CUDA version, then per GPU its processes (compute and graphics). Other -q forms are
    not simulated."""
    d = args[args.index("-d") + 1].upper().split(",") if "-d" in args and args.index("-d") + 1 < len(args) else []
    if d != ["PIDS"]:
        print("lab: only `nvidia-smi -q -d PIDS` is simulated", file=sys.stderr)
        return 2
    w = 55
    print(f"\n==============NVSMI LOG==============\n\n{'Timestamp':<{w}}: {time.strftime('%a %b %e %H:%M:%S %Y')}")
    print(f"{'Driver Version':<{w}}: {driver}\n{'CUDA Version':<{w}}: {_cuda(driver)}\n\n{'Attached GPUs':<{w}}: {len(gpus)}")
    for g in gpus:
        print(f"GPU {g['bus']}")
        if not g["procs"]:
            print(f"    {'Processes':<{w - 4}}: None")
        else:
            print("    Processes")
        for pid, typ, name, mib in g["procs"]:
            print(f"        {'GPU instance ID':<34}: N/A\n        {'Compute instance ID':<34}: N/A\n"
                  f"        {'Process ID':<34}: {pid}\n            {'Type':<30}: {typ}\n"
                  f"            {'Name':<30}: {name}\n            {'Used GPU Memory':<30}: {mib} MiB")
        print()
    return 0


LEGEND = """Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)
  NODE = Connection traversing PCIe as well as the interconnect between PCIe Host Bridges within a NUMA node
  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)
  PXB  = Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)
  PIX  = Connection traversing at most a single PCIe bridge
  NV#  = Connection traversing a bonded set of # NVLinks"""


def _topo(gpus):
    """`nvidia-smi topo -m`: tab-separated, as the real captures in tests/fixtures/real/nvidia-smi*/ are.
    GPUs on one NVLink fabric are NV#; a GPU and the NIC on its PCIe switch PIX; else NODE within a NUMA
    node and SYS across nodes. A GPU row has an empty cell before GPU NUMA ID, a NIC row four empty cells."""
    sh_ = shape()
    nics = sh_["nics"]
    numa_cpus = sh_["lscpu"]["numa"]

    def pci(a, b):
        return "NODE" if a == b else "SYS"

    head = [f"GPU{i}" for i in range(len(gpus))] + [f"NIC{j}" for j in range(len(nics))]
    print("\t" + "\t".join(head + ["CPU Affinity", "NUMA Affinity", "GPU NUMA ID"]))
    for g in gpus:
        cells = [" X " if o is g else (sh_["nvlink"] if sh_["nvlink"] and not (g["display"] or o["display"])
                                       else pci(g["numa"], o["numa"])) for o in gpus]
        cells += ["PIX" if n["near_gpu"] == g["slot"] else pci(g["numa"], n["numa"]) for n in nics]
        print(f"GPU{g['index']}\t" + "\t".join(cells) + f"\t{numa_cpus[g['numa']]}\t{g['numa']}\t\tN/A")
    for j, n in enumerate(nics):
        cells = ["PIX" if n["near_gpu"] == g["slot"] else pci(g["numa"], n["numa"]) for g in gpus]
        cells += [" X " if m is n else pci(n["numa"], m["numa"]) for m in nics]
        print(f"NIC{j}\t" + "\t".join(cells) + "\t\t\t\t")
    print()
    print(LEGEND)
    print()
    print("NIC Legend:")
    print()
    for j, n in enumerate(nics):
        print(f"  NIC{j}: {n['hca']}")
    print()


# ---------------------------------------------------------------- lscpu

def _lscpu_rows():
    cpu = shape()["lscpu"]
    rows = [tuple(r) for r in cpu["head"]]
    rows.append(("NUMA node(s):", str(len(cpu["numa"]))))
    rows += [(f"NUMA node{i} CPU(s):", cpus) for i, cpus in enumerate(cpu["numa"])]
    return rows + [tuple(r) for r in cpu["tail"]]


def _cpu_ranges(text: str) -> list[int]:
    out = []
    for part in filter(None, text.split(",")):
        a, _, b = part.partition("-")
        out += range(int(a), int(b or a) + 1)
    return out


# the columns of `lscpu --extended` the lab knows, per CPU of the shape's topology
_EXTENDED = ("CPU", "CORE", "NODE", "SOCKET")


def _lscpu_extended(columns: str, as_json: bool) -> int:
    """`lscpu --extended=COLS [--json]`, one row per CPU of the shape: its core (threads of a core are
    the CPUs one core count apart, as Linux numbers them) and NUMA node (the node lists); util-linux
    2.38's forms (tests/fixtures/real/lscpu/lscpu-json-extended-cpu-core-node.txt)."""
    cols = [c.upper() for c in columns.split(",")] if columns else ["CPU", "CORE", "NODE", "SOCKET"]
    bad = [c for c in cols if c not in _EXTENDED]
    if bad:
        print(f"lscpu: unknown column: {bad[0]}", file=sys.stderr)
        return 1
    head = dict(shape()["lscpu"]["head"])
    cores = int(head["Core(s) per socket:"]) * int(head["Socket(s):"])
    per_socket = int(head["Core(s) per socket:"])
    node = {c: i for i, cpus in enumerate(shape()["lscpu"]["numa"]) for c in _cpu_ranges(cpus)}
    rows = [{"CPU": c, "CORE": c % cores, "NODE": node[c], "SOCKET": (c % cores) // per_socket}
            for c in sorted(node)]
    if as_json:
        body = "},{".join("\n" + ",\n".join(f'         "{k.lower()}": {r[k]}' for k in cols) + "\n      "
                          for r in rows)
        print('{\n   "cpus": [\n      {' + body + "}\n   ]\n}")
        return 0
    width = {k: max(len(k), *(len(str(r[k])) for r in rows)) for k in cols}
    print(" ".join(k.rjust(width[k]) for k in cols))
    for r in rows:
        print(" ".join(str(r[k]).rjust(width[k]) for k in cols))
    return 0


def lscpu(args):
    """util-linux lscpu as it prints to a pipe (one flat list; the label column as wide as the longest
    label and one space, as in tests/fixtures/real/lscpu/), or with -J/--json; -e/--extended[=COLS]
    lists the CPUs (vLLM's CPU build reads `lscpu --json --extended=CPU,CORE,NODE --online`)."""
    for i, a in enumerate(args):
        if a in ("-e", "--extended") or a.startswith(("-e=", "--extended=")):
            cols = a.partition("=")[2]
            if not cols and a in ("-e", "--extended") and i + 1 < len(args) and not args[i + 1].startswith("-"):
                cols = args[i + 1]
            return _lscpu_extended(cols, any(x in ("-J", "--json") for x in args))
    rows = _lscpu_rows()
    if any(a in ("-J", "--json") for a in args):
        print(json.dumps({"lscpu": [{"field": k, "data": v} for k, v in rows]}, indent=3))
        return 0
    width = max(len(k) for k, _ in rows) + 1
    for k, v in rows:
        print(f"{k:<{width}}{v}")
    return 0


def _table(gpus):
    bar = "+-----------------------------------------+------------------------+----------------------+"
    print(time.strftime("%a %b %d %H:%M:%S %Y") + "       ")
    print("+-----------------------------------------------------------------------------------------+")
    print(f"| NVIDIA-SMI {_driver()}             Driver Version: {_driver()}     CUDA Version: {_cuda(_driver())}     |")
    print(bar)
    print("| GPU  Name                 Persistence-M | Bus-Id          Disp.A | Volatile Uncorr. ECC |")
    print("| Fan  Temp   Perf          Pwr:Usage/Cap |           Memory-Usage | GPU-Util  Compute M. |")
    print("|                                         |                        |               MIG M. |")
    print("|=========================================+========================+======================|")
    for g in gpus:
        disp = "On " if g["procs"] and g["procs"][0][1] == "G" else "Off"
        print(f"| {g['index']:>3}  {g['short']:<28}{g['persist']:>5}  |   {g['bus']} {disp} |"
              f" {g['ecc']:>20} |")
        mem = f"{g['used']}MiB / {g['total']}MiB"
        print(f"| {g['fan']:>3}   33C    P0            {g['power']} | {mem:>22} |      0%      Default |")
        mig = "Disabled" if g["ecc"] == "0" else "N/A"
        print(f"|                                         |                        | {mig:>20} |")
        print(bar)
    print()
    print("+-----------------------------------------------------------------------------------------+")
    print("| Processes:                                                                              |")
    print("|  GPU   GI   CI              PID   Type   Process name                        GPU Memory |")
    print("|        ID   ID                                                               Usage      |")
    print("|=========================================================================================|")
    procs = [(g["index"], p) for g in gpus for p in g["procs"]]
    if not procs:
        print("|  No running processes found                                                             |")
    for idx, (pid, typ, name, mib) in procs:
        print(f"| {idx:>4}   N/A  N/A  {pid:>14}      {typ}   {name:<36}{str(mib) + 'MiB':>10} |")
    print("+-----------------------------------------------------------------------------------------+")


# ---------------------------------------------------------------- timedatectl

def timedatectl(args):
    synced = _state("ntp", "yes") == "yes"
    now = time.time()
    stamp = time.strftime("%a %Y-%m-%d %H:%M:%S UTC", time.gmtime(now))
    if args[:1] == ["show"]:
        props = {"Timezone": "Etc/UTC", "LocalRTC": "no", "CanNTP": "yes", "NTP": "yes",
                 "NTPSynchronized": "yes" if synced else "no", "TimeUSec": stamp, "RTCTimeUSec": stamp}
        wanted = [args[i + 1] for i, a in enumerate(args) if a == "-p" and i + 1 < len(args)]
        wanted += [a[2:] for a in args if a.startswith("-p") and len(a) > 2]
        wanted += [a.split("=", 1)[1] for a in args if a.startswith("--property=")]
        for k, v in props.items():
            if wanted and k not in wanted:
                continue
            print(v if "--value" in args else f"{k}={v}")
        return 0
    print(f"               Local time: {stamp}")
    print(f"           Universal time: {stamp}")
    print(f"                 RTC time: {stamp[:-4]}")
    print("                Time zone: Etc/UTC (UTC, +0000)")
    print(f"System clock synchronized: {'yes' if synced else 'no'}")
    print("              NTP service: active")
    print("          RTC in local TZ: no")
    return 0


# ---------------------------------------------------------------- chronyc (hosts that keep time with chrony)

def chronyc(args):
    """`chronyc tracking` as chrony 4 prints it (tests/fixtures/real/chronyc): synchronised to a lab NTP server,
    or, under the ntp-unsynced fault, no source selected. The clock-skew fault shows as the offset."""
    if args[:1] != ["tracking"]:
        print("Unrecognized command")
        return 1
    skew = float(_state("clock-skew", "0") or 0)
    if _state("ntp", "yes") != "yes":
        print("Reference ID    : 00000000 ()\nStratum         : 0\nRef time (UTC)  : Thu Jan 01 00:00:00 1970\n"
              "System time     : 0.000000000 seconds fast of NTP time\nLast offset     : +0.000000000 seconds\n"
              "RMS offset      : 0.000000000 seconds\nFrequency       : 0.000 ppm slow\n"
              "Residual freq   : +0.000 ppm\nSkew            : 0.000 ppm\nRoot delay      : 1.000000000 seconds\n"
              "Root dispersion : 1.000000000 seconds\nUpdate interval : 0.0 seconds\nLeap status     : Not synchronised")
        return 0
    off = skew + 0.000052616
    ref = time.strftime("%a %b %d %H:%M:%S %Y", time.gmtime(time.time() - 64))
    print(f"Reference ID    : C6120001 (ntp.lab)\nStratum         : 2\nRef time (UTC)  : {ref}\n"
          f"System time     : {abs(off):.9f} seconds {'fast' if off >= 0 else 'slow'} of NTP time\n"
          "Last offset     : -0.000193872 seconds\nRMS offset      : 0.000803415 seconds\n"
          "Frequency       : 18.484 ppm slow\nResidual freq   : -0.085 ppm\nSkew            : 1.881 ppm\n"
          "Root delay      : 0.011188857 seconds\nRoot dispersion : 0.001274664 seconds\n"
          "Update interval : 129.2 seconds\nLeap status     : Normal")
    return 0


# ---------------------------------------------------------------- dmesg (the kernel log's NVIDIA lines)

def dmesg(args):
    """The NVRM lines a real H200 host's kernel log holds after boot (tests/fixtures/real/gpu-health), plus the
    xid fault's `NVRM: Xid (PCI:...): N, ...` line for the compute GPU, in dmesg's `[secs]` or `-T` form."""
    boot = time.time() - 3600
    lines = [(0.515025, f"NVRM: loading NVIDIA UNIX Open Kernel Module for x86_64  {_driver()}  Release Build  "
                        "(dvs-builder@U22-I3-B10-02-5)  Mon Jun  2 13:13:04 UTC 2025"),
             (3.543276, "NVRM: Persistence mode is deprecated and will be removed in a future release. Please use "
                        "nvidia-persistenced instead.")]
    xid = _state("xid")
    if xid:
        gpu = next((g for g in _gpus() if not g["display"]), None)
        if gpu:
            bus = gpu["bus"].lower()[4:].rsplit(".", 1)[0]  # 00000000:0A:00.0 -> 0000:0a:00
            msg = {"79": "GPU has fallen off the bus.", "48": "An uncorrectable double bit error (DBE) has been "
                   "detected on GPU in the framebuffer at physAddr 0x7fffa8860 partition 7, subpartition 1.",
                   "13": "Graphics SM Warp Exception on (GPC 7, TPC 7, SM 0): Illegal Instruction Parameter"}
            lines.append((1843.308145, f"NVRM: Xid (PCI:{bus}): {xid}, pid='<unknown>', name=<unknown>, "
                                       f"{msg.get(xid, 'Ch 00000008, errorString CTX SWITCH TIMEOUT, Info 0x58005')}"))
    for secs, text in lines:
        if "-T" in args or "--ctime" in args:
            print(time.strftime("[%a %b %e %H:%M:%S %Y] ", time.localtime(boot + secs)) + text)
        else:
            print(f"[{secs:12.6f}] {text}")
    return 0


# ---------------------------------------------------------------- GPUDirect RDMA readiness: lsmod, ibv_devinfo,
# lspci, ethtool -S (formats: tests/fixtures/real/gdr, ibstat; the rest of ethtool is the real one)

def lsmod(args):
    """The modules a DGX OS host with ConnectX rails runs (real lsmod layout); the no-peermem fault unloads
    nvidia_peermem."""
    peermem = _state("no-peermem") is None
    mods = [("nvidia_uvm", 2093056, "0", ""), ("nvidia_peermem", 16384, "0", "") if peermem else None,
            ("nvidia", 104153088, "2" if peermem else "1", "nvidia_uvm,nvidia_peermem" if peermem else "nvidia_uvm"),
            ("mlx5_ib", 561152, "0", ""), ("ib_uverbs", 212992, "3" if peermem else "2",
                                             ("nvidia_peermem," if peermem else "") + "rdma_ucm,mlx5_ib"),
            ("ib_core", 528384, "8", "rdma_cm,ib_ipoib,iw_cm,ib_umad,rdma_ucm,ib_uverbs,mlx5_ib,ib_cm"),
            ("mlx5_core", 3153920, "1", "mlx5_ib"), ("mlxfw", 36864, "1", "mlx5_core")]
    print("Module                  Size  Used by")
    for m in mods:
        if m:
            name, size, used, by = m
            print(f"{name:<19}{size:>10}  {used} {by}".rstrip())
    return 0


def ibv_devinfo(args):
    """`ibv_devinfo [-d HCA]` for the lab's ConnectX-8 rails (tab layout of the real tool); the port state follows
    the rail netdev's carrier, the link layer is Ethernet (RoCE)."""
    hcas = _hcas()
    want = args[args.index("-d") + 1] if "-d" in args and args.index("-d") + 1 < len(args) else None
    if want and want not in hcas:
        print(f"Device {want} wasn't found")
        return 255
    for i, hca in enumerate(sorted(h for h in hcas if want in (None, h))):
        netdev = hcas[hca]
        up = _sys(netdev, "operstate") == "up" and _sys(netdev, "carrier") == "1"
        mtu = int(_sys(netdev, "mtu") or 1500)
        active = 4096 if mtu >= 4200 else 1024
        guid = f"a088:c203:00{i:02x}:5a20"
        nic = next((n for n in shape()["nics"] if n["hca"] == hca), {})
        print(f"hca_id:\t{hca}\n\ttransport:\t\t\tInfiniBand (0)\n\tfw_ver:\t\t\t\t{nic.get('fw', '40.45.1200')}\n"
              f"\tnode_guid:\t\t\t{guid}\n\tsys_image_guid:\t\t\t{guid}\n\tvendor_id:\t\t\t0x02c9\n"
              f"\tvendor_part_id:\t\t\t{nic.get('part_id', 4131)}\n\thw_ver:\t\t\t\t0x0\n\tboard_id:\t\t\tMT_0000001070\n"
              f"\tphys_port_cnt:\t\t\t1\n\t\tport:\t1\n"
              f"\t\t\tstate:\t\t\t{'PORT_ACTIVE (4)' if up else 'PORT_DOWN (1)'}\n"
              f"\t\t\tmax_mtu:\t\t4096 (5)\n\t\t\tactive_mtu:\t\t{active} ({5 if active == 4096 else 3})\n"
              f"\t\t\tsm_lid:\t\t\t0\n\t\t\tport_lid:\t\t0\n\t\t\tport_lmc:\t\t0x00\n"
              f"\t\t\tlink_layer:\t\tEthernet\n")
    return 0


PEX = "Broadcom / LSI PEX890xx PCIe Gen 5 Switch (rev b0)"
ACS_OFF = "SrcValid- TransBlk- ReqRedir- CmpltRedir- UpstreamFwd- EgressCtrl- DirectTrans-"
ACS_ON = "SrcValid+ TransBlk- ReqRedir+ CmpltRedir+ UpstreamFwd+ EgressCtrl- DirectTrans-"


def _bdf(dom, bus, dev=0, fn=0):
    return f"{dom:04x}:{bus:02x}:{dev:02x}.{fn}"


def _pci_topology():
    """The host's PCIe tree, consistent with nvidia-smi's bus ids, the rails' `ethtool -i` bus-info and
    `nvidia-smi topo -m`: [{bdf, parent, kind, name, secondary}], kind root/up/down/gpu/nic/nvme. A station: the
    display GPU on a root port of domain 0000, the ConnectX-8 (one function per rail) and an NVMe drive on two
    downstream ports of a switch under another, the GB300 on a root port of domain 0008 (topo: NODE). An hgx8:
    per GPU k a switch under a root port of its socket, its downstream ports to the NIC one bus below the GPU
    (rail k; topo: PIX), the GPU, and an NVMe drive."""
    sh_ = shape()
    out = []

    def add(bdf, parent, kind, name, secondary=None):
        out.append({"bdf": bdf, "parent": parent, "kind": kind, "name": name, "secondary": secondary})
        return bdf

    gpus = sh_["gpus"]
    nics = sh_["nics"]
    nvme = "Non-Volatile memory controller: Samsung Electronics Co Ltd NVMe SSD Controller PM174X"
    cx8 = "Ethernet controller: Mellanox Technologies MT43244 ConnectX-8 family"
    if sh_["shape"] == "station":
        disp = next(g for g in gpus if g["display"])
        gpu = next(g for g in gpus if not g["display"])
        rp0 = add(_bdf(0, 0, 1), None, "root", "PCI bridge: NVIDIA Corporation Device 22b2", 1)
        add(disp["bus"][4:].lower(), rp0, "gpu", f"VGA compatible controller: NVIDIA Corporation {disp['name']}")
        rp1 = add(_bdf(0, 0, 2), None, "root", "PCI bridge: NVIDIA Corporation Device 22b2", 2)
        up = add(_bdf(0, 2), rp1, "up", f"PCI bridge: {PEX}", 3)
        dn = add(_bdf(0, 3, 0), up, "down", f"PCI bridge: {PEX}", 4)
        dv = add(_bdf(0, 3, 1), up, "down", f"PCI bridge: {PEX}", 5)
        for j in range(len(nics)):
            add(_bdf(0, 4, 0, j), dn, "nic", cx8)
        add(_bdf(0, 5), dv, "nvme", nvme)
        rp8 = add(_bdf(8, 0), None, "root", "PCI bridge: NVIDIA Corporation Device 22b2",
                  int(gpu["bus"].split(":")[1], 16))
        add(gpu["bus"][4:].lower(), rp8, "gpu", f"3D controller: NVIDIA Corporation {gpu['name']}")
    else:
        for k, g in enumerate(gpus):
            b = int(g["bus"].split(":")[1], 16)
            root = 0x00 if g["numa"] == 0 else 0x80
            rp = add(_bdf(0, root, k % 4 + 1), None, "root", "PCI bridge: Intel Corporation Device 352a (rev 04)", b - 3)
            up = add(_bdf(0, b - 3), rp, "up", f"PCI bridge: {PEX}", b - 2)
            dn = add(_bdf(0, b - 2, 0), up, "down", f"PCI bridge: {PEX}", b - 1)
            dg = add(_bdf(0, b - 2, 1), up, "down", f"PCI bridge: {PEX}", b)
            dv = add(_bdf(0, b - 2, 2), up, "down", f"PCI bridge: {PEX}", b + 1)
            if k < len(nics):
                add(_bdf(0, b - 1), dn, "nic", cx8)
            add(g["bus"][4:].lower(), dg, "gpu", f"3D controller: NVIDIA Corporation {g['name']}")
            add(_bdf(0, b + 1), dv, "nvme", nvme)
    return sorted(out, key=lambda d: d["bdf"])


def nic_bus(netdev):
    """The PCI address of a rail's NIC function (its `ethtool -i` bus-info), from the topology."""
    nics = [d["bdf"] for d in _pci_topology() if d["kind"] == "nic"]
    rails = [n for _, n in sorted(_hcas().items())]  # mlx5_0, mlx5_1, ...: the NICs in bus order
    return nics[rails.index(netdev)] if netdev in rails and rails.index(netdev) < len(nics) else ""


def _acs_redirected():
    """The downstream ports the acs-redirect fault turns ReqRedir/CmpltRedir on: `path` (default) those of the
    serving rail NIC's switch above the NIC and a GPU (an hgx8's; a station's GB300 is on a root port of its own);
    `off-path` the NVMe drive's port on that switch."""
    which = _state("acs-redirect")
    if which is None:
        return set()
    topo = _pci_topology()
    by = {d["bdf"]: d for d in topo}
    nic = by.get(nic_bus(shape()["serve_rail"]))
    if nic is None:
        return set()
    switch = by[nic["parent"]]["parent"]
    ports = [d for d in topo if d["kind"] == "down" and d["parent"] == switch]
    below = {d["parent"]: d["kind"] for d in topo if d["kind"] in ("gpu", "nic", "nvme")}
    want = ("nvme",) if which == "off-path" else ("gpu", "nic")
    return {p["bdf"] for p in ports if below.get(p["bdf"]) in want}


def _slot(d, by, paths, domains):
    if not paths:
        return d["bdf"] if domains else d["bdf"][5:]
    chain = []
    cur = d
    while cur is not None:
        chain.append(cur["bdf"])
        cur = by.get(cur["parent"])
    chain.reverse()
    head = chain[0] if domains else chain[0][5:]
    return "/".join([head] + [c[5:] for c in chain[1:]])


def _pci_block(d, slot, redirected):
    kind = d["kind"]
    lines = [f"{slot} {d['name']}" + (" (prog-if 00 [Normal decode])" if kind in ("root", "up", "down") else "")]
    lines.append("\tControl: I/O+ Mem+ BusMaster+ SpecCycle- MemWINV- VGASnoop- ParErr- Stepping- SERR+ FastB2B- "
                 "DisINTx+")
    if d["secondary"] is not None:
        sec = d["secondary"]
        lines.append(f"\tBus: primary={d['bdf'][5:7]}, secondary={sec:02x}, subordinate={sec:02x}, sec-latency=0")
    port = {"root": "Root Port (Slot+)", "up": "Upstream Port", "down": "Downstream Port (Slot+)"}.get(kind, "Endpoint")
    lines.append(f"\tCapabilities: [68] Express (v2) {port}, MSI 00")
    if kind in ("root", "down"):
        lines += ["\tCapabilities: [f24 v1] Access Control Services",
                  "\t\tACSCap:\tSrcValid+ TransBlk+ ReqRedir+ CmpltRedir+ UpstreamFwd+ EgressCtrl+ DirectTrans+",
                  f"\t\tACSCtl:\t{ACS_ON if d['bdf'] in redirected else ACS_OFF}"]
    driver = {"root": "pcieport", "up": "pcieport", "down": "pcieport", "gpu": "nvidia", "nic": "mlx5_core",
              "nvme": "nvme"}[kind]
    lines.append(f"\tKernel driver in use: {driver}")
    return "\n".join(lines) + "\n"


def lspci(args):
    """`lspci [-PP] [-vvv]` over the host's PCIe tree (_pci_topology), in bus order, the domain shown as lspci does
    (only where a device has one other than 0000), `-P`/`-PP` naming each device by its path through the bridges
    (pciutils' show_slot_path). Switch downstream and root ports have ACS off, as on a DGX; the acs-redirect fault
    turns ReqRedir/CmpltRedir on, on the GPU-NIC path or on an unrelated port (a BIOS default can)."""
    topo = _pci_topology()
    by = {d["bdf"]: d for d in topo}
    paths = any(a in ("-P", "-PP") for a in args)
    domains = "-D" in args or any(not d["bdf"].startswith("0000:") for d in topo)
    redirected = _acs_redirected()
    verbose = any(a.startswith("-v") for a in args)
    for d in topo:
        slot = _slot(d, by, paths, domains)
        print(_pci_block(d, slot, redirected) if verbose else f"{slot} {d['name']}")
    return 0


def _real_ethtool():
    for path in ("/usr/sbin/ethtool", "/sbin/ethtool", "/usr/bin/ethtool"):
        if os.path.exists(path) and os.path.realpath(path) != os.path.realpath(__file__):
            return path
    return None


def ethtool(args):
    """The real ethtool, except `ethtool -S RAIL`: a ConnectX port's `_phy` counters (names and layout of mlx5's
    `ethtool -S`); the rail-errors fault makes symbol and CRC errors climb, as a bad optic does. Under the
    no-ethtool-stats fault `-S` is the real one too: a veth's statistics, none of them a rail error counter."""
    rails = set(_hcas().values())
    if len(args) == 2 and args[0] in ("-S", "--statistics") and args[1] in rails and not _state("no-ethtool-stats"):
        since = _state("rail-errors")
        bad = int((time.time() - float(since)) * 20000) + 1000 if since else 0
        rx = int(_sys(args[1], "statistics/rx_packets") or 0)
        tx = int(_sys(args[1], "statistics/tx_packets") or 0)
        print("NIC statistics:")
        for name, v in (("rx_packets", rx), ("tx_packets", tx), ("rx_out_of_buffer", 0), ("rx_packets_phy", rx),
                        ("tx_packets_phy", tx), ("rx_crc_errors_phy", bad), ("rx_in_range_len_errors_phy", 0),
                        ("rx_symbol_err_phy", bad), ("tx_errors_phy", 0), ("rx_discards_phy", 0),
                        ("tx_discards_phy", 0), ("link_down_events_phy", 1 if since else 0),
                        ("rx_pcs_symbol_err_phy", bad), ("rx_corrected_bits_phy", 0)):
            print(f"     {name}: {v}")
        return 0
    real = _real_ethtool()
    if real is None:
        print("ethtool: not installed on the lab machine", file=sys.stderr)
        return 127
    if len(args) == 2 and args[0] in ("-i", "--driver") and args[1] in rails:
        # a veth has no bus: the rail's bus-info is its NIC function's address in the lab's PCIe tree (lspci)
        r = subprocess.run([real] + args, capture_output=True, text=True)
        sys.stderr.write(r.stderr)
        bus = nic_bus(args[1])
        sys.stdout.write("".join(f"bus-info: {bus}\n" if line.startswith("bus-info:") else line + "\n"
                                 for line in r.stdout.splitlines()))
        return r.returncode
    os.execv(real, [real] + args)


# ---------------------------------------------------------------- docker

CLIENT = """Client: Docker Engine - Community
 Version:           28.2.2
 API version:       1.50
 Go version:        go1.24.3
 Git commit:        e6534b4
 Built:             Fri May 30 12:07:14 2025
 OS/Arch:           linux/arm64
 Context:           default"""

SERVER = """Server: Docker Engine - Community
 Engine:
  Version:          28.2.2
  API version:      1.50 (minimum version 1.24)
  Go version:       go1.24.3
  Git commit:       45873be
  Built:            Fri May 30 12:07:14 2025
  OS/Arch:          linux/arm64
  Experimental:     false
 containerd:
  Version:          1.7.27
  GitCommit:        05044ec0a9a75232cad458027ca83437aae3f4da
 runc:
  Version:          1.2.5
  GitCommit:        v1.2.5-0-g59923ef
 docker-init:
  Version:          0.19.0
  GitCommit:        de40ad0"""

DAEMON_DOWN = "Cannot connect to the Docker daemon at unix:///var/run/docker.sock. Is the docker daemon running?"
DENIED = ('permission denied while trying to connect to the Docker daemon socket at unix:///var/run/docker.sock: '
          'Get "http://%2Fvar%2Frun%2Fdocker.sock/v1.50/{path}": dial unix /var/run/docker.sock: connect: permission denied')


def _daemon_error(path):
    down = _state("docker-down")
    if down == "permission":
        return DENIED.format(path=path)
    if down:
        return DAEMON_DOWN
    return None


def _images():
    with open(os.path.join(HOST_DIR, "docker", "images.json")) as f:
        return json.load(f)  # {"name:tag": "sha256:digest"}


def _image_config(name):
    """An image's own Config (Entrypoint, Cmd, WorkingDir, Env), as lab.up describes it; the vLLM image's
    by default."""
    try:
        conf = _lab().get("images", {}).get(name)
    except (OSError, ValueError):
        conf = None
    return conf or {"Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
                    "Entrypoint": ["vllm", "serve"], "WorkingDir": "/vllm-workspace"}


def _image_doc(name, digest):
    repo = name.rsplit(":", 1)[0]
    return {
        "Id": "sha256:" + hashlib.sha256(("config" + digest).encode()).hexdigest(),
        "RepoTags": [name],
        "RepoDigests": [f"{repo}@{digest}"],
        "Parent": "",
        "Comment": "buildkit.dockerfile.v0",
        "Created": "2026-10-02T18:41:07.512935022Z",
        "DockerVersion": "",
        "Author": "",
        "Config": _image_config(name),
        "Architecture": "arm64",
        "Os": "linux",
        "Size": 21474836480,
        "RootFS": {"Type": "layers", "Layers": ["sha256:" + hashlib.sha256((digest + str(i)).encode()).hexdigest()
                                                for i in range(3)]},
        "Metadata": {"LastTagTime": "0001-01-01T00:00:00Z"},
    }


def _find_image(ref):
    images = _images()
    for name, d in images.items():  # by image id, as `docker image inspect sha256:...` does
        doc = _image_doc(name, d)
        if ref.startswith("sha256:") and doc["Id"] == ref:
            return doc
    if "@" in ref:
        repo, digest = ref.split("@", 1)
        repo = repo.rsplit(":", 1)[0] if ":" in repo.rsplit("/", 1)[-1] else repo
        for name, d in images.items():
            if d == digest and name.rsplit(":", 1)[0] == repo:
                return _image_doc(name, d)
        return None
    name = ref if ":" in ref.rsplit("/", 1)[-1] else ref + ":latest"
    return _image_doc(name, images[name]) if name in images else None


def _go_value(v):
    if isinstance(v, bool):  # Go's text/template prints booleans lowercase
        return "true" if v else "false"
    if isinstance(v, list):
        return "[" + " ".join(str(x) for x in v) + "]"
    return str(v)


def _render(fmt, doc):
    out, i = "", 0
    while i < len(fmt):
        j = fmt.find("{{", i)
        if j < 0:
            out += fmt[i:]
            break
        out += fmt[i:j]
        k = fmt.index("}}", j)
        expr = fmt[j + 2:k].strip()
        as_json = expr.startswith("json ")
        field = expr[5:].strip() if as_json else expr
        v = doc
        for part in [p for p in field.lstrip(".").split(".") if p]:  # `.` alone is the whole document
            v = v.get(part, "<no value>") if isinstance(v, dict) else "<no value>"
        out += json.dumps(v, separators=(",", ":")) if as_json else _go_value(v)  # Go: compact
        i = k + 2
    return out


def docker(args):
    if not args or args[0] in ("-h", "--help"):
        print("Usage:  docker [OPTIONS] COMMAND")
        return 0
    if args[0] == "version":
        arch = f"linux/{shape()['arch']}"  # the host's own architecture
        print(CLIENT.replace("linux/arm64", arch))
        err = _daemon_error("version")
        if err:
            print(err, file=sys.stderr)
            return 1
        print()
        print(SERVER.replace("linux/arm64", arch))
        return 0
    if args[:2] == ["image", "inspect"]:
        rest = args[2:]
        fmt = None
        refs = []
        it = iter(range(len(rest)))
        for i in it:
            a = rest[i]
            if a in ("-f", "--format"):
                fmt = rest[i + 1]
                next(it, None)
            elif a.startswith("--format="):
                fmt = a.split("=", 1)[1]
            else:
                refs.append(a)
        err = _daemon_error("images/json")
        if err:
            print("[]")
            print(err, file=sys.stderr)
            return 1
        docs, rc = [], 0
        for ref in refs:
            doc = _find_image(ref)
            if doc is None:
                rc = 1
                print(f"Error response from daemon: No such image: {ref}", file=sys.stderr)
            else:
                docs.append(doc)
        _print_docs(docs, fmt)
        return rc
    if args[0] in CONTAINER_COMMANDS:
        err = _daemon_error("containers/json")
        if err:
            print(err, file=sys.stderr)
            return 1
        return CONTAINER_COMMANDS[args[0]](args[1:])
    if args[0] == "__shim":
        return _shim(args[1])
    print(f"docker: '{args[0]}' is not a docker command.\nSee 'docker --help'", file=sys.stderr)
    return 1


# ---------------------------------------------------------------- docker: containers
# A container is a process tree started detached by a small shim that outlives the SSH
# session, with the container's environment, ulimits and a private /tmp. Its state lives in
# $RAILYARD_LAB_HOST_DIR/docker/containers/NAME/: config.json, state.json, log.

def _cdir(name):
    return os.path.join(HOST_DIR, "docker", "containers", name)


def _config(name):
    """A container's config by its name, or None (also while `docker run` or `docker rm` is half-way)."""
    try:
        with open(os.path.join(_cdir(name), "config.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _load(name):
    cfg = _config(name)
    if cfg is None and len(name) >= 4:  # by id or id prefix
        cfg = next((c for c in map(_config, _all_names()) if c and c["Id"].startswith(name)), None)
    if cfg is None:
        return None
    cfg["State"] = _state_of(cfg["Name"].lstrip("/"))
    return cfg


def _remove(name):
    """Take the name away at once, as dockerd does, then the files: a process of the old container
    that still writes into its folder cannot leave a half container behind under the name."""
    gone = os.path.join(HOST_DIR, "docker", "removed", f"{name}.{os.getpid()}.{time.time_ns()}")
    os.makedirs(os.path.dirname(gone), exist_ok=True)
    try:
        os.rename(_cdir(name), gone)
    except OSError:
        gone = _cdir(name)
    shutil.rmtree(gone, ignore_errors=True)


def _all_names():
    try:
        return sorted(os.listdir(os.path.join(HOST_DIR, "docker", "containers")))
    except OSError:
        return []


def _now():
    t = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1e9):09d}Z"


def _state_of(name):
    try:
        with open(os.path.join(_cdir(name), "state.json")) as f:
            st = json.load(f)
    except (OSError, ValueError):
        st = {"Status": "created", "Running": False, "Pid": 0, "ExitCode": 0,
              "StartedAt": "0001-01-01T00:00:00Z", "FinishedAt": "0001-01-01T00:00:00Z"}
    if st.get("Running") and not _alive(st.get("Pid", 0)) and not _shim_alive(st.get("ShimPid")):
        # the shim died without writing the exit: report it like a killed container (while the shim lives,
        # it is tearing the container down and writes the exit when every process of it is gone)
        st.update(Status="exited", Running=False, Pid=0, ExitCode=137, FinishedAt=_now())
    base = {"Paused": False, "Restarting": False, "OOMKilled": False, "Dead": False, "Error": ""}
    base.update(st)
    return base


def _shim_alive(pid):
    try:
        with open(f"/proc/{int(pid)}/cmdline", "rb") as f:
            return b"\0__shim\0" in f.read() and _alive(pid)
    except (OSError, TypeError, ValueError):
        return False


def _write_state(name, **kw):
    st = _state_of(name)
    st.update(kw)
    tmp = os.path.join(_cdir(name), "state.json.tmp")
    with open(tmp, "w") as f:
        json.dump(st, f)
    os.replace(tmp, os.path.join(_cdir(name), "state.json"))


RUN_SINGLE = {"--name": "name", "--gpus": "gpus", "--network": "network", "--ipc": "ipc", "--shm-size": "shm",
              "--pull": "pull",
              "--entrypoint": "entrypoint", "--cpuset-cpus": "cpuset_cpus", "--cpuset-mems": "cpuset_mems"}
RUN_MULTI = {"--device": "devices", "--cap-add": "caps", "--ulimit": "ulimits", "-v": "volumes", "--volume": "volumes"}


def _parse_run(args):
    opts = {"env": [], "volumes": [], "devices": [], "caps": [], "ulimits": [], "labels": {}, "detach": False,
            "name": None, "gpus": None, "network": "bridge", "ipc": "", "shm": "", "entrypoint": None, "rm": False,
            "cpuset_cpus": "", "cpuset_mems": "", "pull": "missing"}
    with_value = set(RUN_SINGLE) | set(RUN_MULTI) | {"-e", "--env", "--label", "-l", "--env-file", "-w", "--workdir"}
    i = 0
    while i < len(args):
        a = args[i]
        if not a.startswith("-"):
            break
        if "=" in a and a.startswith("--") and a.split("=", 1)[0] in with_value:
            a, v = a.split("=", 1)
        elif a in with_value:
            i += 1
            if i >= len(args):
                raise ValueError(f"flag needs an argument: {a}")
            v = args[i]
        else:
            v = None
        if a in ("-d", "--detach"):
            opts["detach"] = True
        elif a == "--rm":
            opts["rm"] = True
        elif a == "--gpus":
            opts["gpus"] = v
            opts["gpu_request"] = _gpu_request(v)
        elif a in RUN_SINGLE:
            opts[RUN_SINGLE[a]] = v
        elif a in RUN_MULTI:
            opts[RUN_MULTI[a]].append(v)
        elif a in ("-e", "--env"):
            opts["env"].append(v if "=" in v else f"{v}={os.environ.get(v, '')}")
        elif a in ("--label", "-l"):
            k, _, val = v.partition("=")
            opts["labels"][k] = val
        elif v is None:
            raise ValueError(f"unknown flag: {a}")
        i += 1
    if i >= len(args):
        raise ValueError('"docker run" requires at least 1 argument.')
    return opts, args[i], args[i + 1:]


def _gpu_request(value):
    """`--gpus` as the docker CLI reads it (cli/opts/gpus.go): the value is one CSV record, so several
    devices must be quoted inside it: `--gpus '"device=UUID1,UUID2"'` (argv value `"device=UUID1,UUID2"`).
    Unquoted, `device=0,1` is two fields: device 0 and a bare count 1. Returns a DeviceRequest."""
    import csv
    try:
        fields = next(csv.reader([value], strict=True))
    except (csv.Error, StopIteration) as e:
        raise ValueError(f'invalid argument "{value}" for "--gpus" flag: {e}')
    req = {"Driver": "", "Count": 0, "DeviceIDs": None, "Capabilities": None, "Options": {}}
    seen = set()
    for field in fields:
        key, eq, val = field.partition("=")
        if key in seen:
            raise ValueError(f'invalid argument "{value}" for "--gpus" flag: gpu request key \'{key}\' can be '
                             "specified only once")
        seen.add(key)
        if not eq or key == "count":
            seen.add("count")
            n = key if not eq else val
            if n == "all":
                req["Count"] = -1
            elif n.lstrip("-").isdigit():
                req["Count"] = int(n)
            else:
                raise ValueError(f'invalid argument "{value}" for "--gpus" flag: count must be an integer: '
                                 f'strconv.Atoi: parsing "{n}": invalid syntax')
        elif key == "device":
            req["DeviceIDs"] = val.split(",")
        elif key == "driver":
            req["Driver"] = val
        elif key == "capabilities":
            req["Capabilities"] = [val.split(",") + ["gpu"]]
        elif key != "options":
            raise ValueError(f'invalid argument "{value}" for "--gpus" flag: unexpected key \'{key}\' in \'{field}\'')
    if "count" not in seen and req["DeviceIDs"] is None:
        req["Count"] = 1
    req["Capabilities"] = req["Capabilities"] or [["gpu"]]
    return req


def _resolve_gpus(req):
    """The GPUs (UUIDs) a device request gives a container, or the daemon's error."""
    if req["Count"] != 0 and req["DeviceIDs"]:
        # moby daemon/nvidia_linux.go: errConflictCountDeviceIDs
        return None, "cannot set both Count and DeviceIDs on device request."
    gpus = _gpus()
    if req["DeviceIDs"] is None:
        n = len(gpus) if req["Count"] < 0 else req["Count"]
        return [g["uuid"] for g in gpus[:n]], None
    out = []
    for want in req["DeviceIDs"]:
        g = next((g for g in gpus if want == g["uuid"] or (want.isdigit() and int(want) == g["index"])), None)
        if g is None:
            return None, ("failed to create task for container: failed to create shim task: OCI runtime create "
                          "failed: runc create failed: unable to start container process: error during container "
                          "init: error running prestart hook #0: exit status 1, stdout: , stderr: Auto-detected "
                          f"mode as 'legacy'\nnvidia-container-cli: device error: {want}: unknown device: unknown.")
        out.append(g["uuid"])
    return out, None


def _cpu_list(spec):
    """`0-55,112-167` -> {0, ..., 55, 112, ..., 167}; ValueError when it is not a list."""
    out = set()
    for part in spec.split(","):
        a, _, b = part.partition("-")
        lo, hi = int(a), int(b or a)
        if lo > hi or lo < 0:
            raise ValueError(spec)
        out |= set(range(lo, hi + 1))
    return out


def _check_cpuset(opts):
    """The daemon's checks of --cpuset-cpus/--cpuset-mems against the host's CPUs and NUMA nodes."""
    cpu = shape()["lscpu"]
    have_cpus = set().union(*(_cpu_list(c) for c in cpu["numa"]))
    have_nodes = set(range(len(cpu["numa"])))
    for key, have, what, what_s in (("cpuset_cpus", have_cpus, "CPUs", "cpus"),
                                    ("cpuset_mems", have_nodes, "memory nodes", "mems")):
        spec = opts[key]
        if not spec:
            continue
        try:
            want = _cpu_list(spec)
        except ValueError:
            return f"Invalid value {spec} for cpuset {what_s}"
        if not want <= have:
            avail = f"0-{max(have)}" if have == set(range(max(have) + 1)) else ",".join(map(str, sorted(have)))
            return f"Requested {what} are not available - requested {spec}, available: {avail}"
    return None


def _run(args):
    try:
        opts, image, cmd = _parse_run(args)
    except ValueError as e:
        print(f"docker: {e}\nSee 'docker run --help'.", file=sys.stderr)
        return 125
    bad = _check_cpuset(opts)
    if bad:
        print(f"docker: Error response from daemon: {bad}.\nSee 'docker run --help'.", file=sys.stderr)
        return 125
    img = _find_image(image)
    if img is None and opts["pull"] == "never":
        print(f"docker: Error response from daemon: No such image: {image}.\nSee 'docker run --help'.", file=sys.stderr)
        return 125
    if img is None:
        print(f"Unable to find image '{image}' locally", file=sys.stderr)
        print(f"docker: Error response from daemon: pull access denied for {image.split('@')[0].split(':')[0]}, "
              "repository does not exist or may require 'docker login'.\nSee 'docker run --help'.", file=sys.stderr)
        return 125
    name = opts["name"] or "lab_" + hashlib.sha256(str(time.time()).encode()).hexdigest()[:8]
    existing = _load(name) if os.path.isdir(_cdir(name)) else None
    if existing:
        print(f'docker: Error response from daemon: Conflict. The container name "/{name}" is already in use by '
              f'container "{existing["Id"]}". You have to remove (or rename) that container to be able to reuse that '
              "name.\nSee 'docker run --help'.", file=sys.stderr)
        return 125
    given = []
    if opts["gpus"]:
        given, err = _resolve_gpus(opts["gpu_request"])
        if err:
            print(f"docker: Error response from daemon: {err}", file=sys.stderr)
            return 125
    cid = hashlib.sha256(f"{name}{time.time()}".encode()).hexdigest()
    entry = [opts["entrypoint"]] if opts["entrypoint"] else img["Config"]["Entrypoint"]
    env = ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"] + opts["env"]
    cfg = {"Id": cid, "Created": _now(), "Path": entry[0], "Args": entry[1:] + cmd, "Name": "/" + name,
           "Image": img["Id"], "RestartCount": 0,
           "Config": {"Image": image, "Env": env, "Cmd": cmd, "Entrypoint": entry, "Labels": opts["labels"],
                      "Hostname": socket.gethostname()},
           "HostConfig": {"NetworkMode": opts["network"], "IpcMode": opts["ipc"], "ShmSize": opts["shm"],
                          "CapAdd": opts["caps"], "Binds": opts["volumes"],
                          "Devices": [{"PathOnHost": d, "PathInContainer": d, "CgroupPermissions": "rwm"}
                                      for d in opts["devices"]],
                          "Ulimits": [_ulimit(u) for u in opts["ulimits"]],
                          "DeviceRequests": [opts["gpu_request"]] if opts["gpus"] else None,
                          "CpusetCpus": opts["cpuset_cpus"], "CpusetMems": opts["cpuset_mems"],
                          # an attached `--rm` run is removed by its client, once it has printed the output
                          "AutoRemove": opts["rm"] and opts["detach"]}}
    os.makedirs(os.path.join(_cdir(name), "rootfs", "tmp"), exist_ok=True)
    with open(os.path.join(_cdir(name), "config.json.new"), "w") as f:
        json.dump(cfg, f, indent=2)
    os.replace(os.path.join(_cdir(name), "config.json.new"), os.path.join(_cdir(name), "config.json"))
    with open(os.path.join(_cdir(name), "gpus.json"), "w") as f:  # what the container's CUDA sees, in order
        json.dump(given, f)
    missing = next((p for p in (d.split(":", 1)[0] for d in opts["devices"]) if not _device_exists(p)), None)
    if missing:  # the container is made, its start fails: it stays Created, under its name (unless --rm)
        if opts["rm"]:
            _remove(name)
        print(f'docker: Error response from daemon: error gathering device information while adding custom device '
              f'"{missing}": no such file or directory.', file=sys.stderr)
        if not opts["detach"]:
            print("ERRO[0000] error waiting for container: context canceled", file=sys.stderr)
        return 125
    _start(name)
    if opts["detach"]:
        print(cid)
        return 0
    code = _wait_exit(name)
    if opts["rm"]:
        _remove(name)
    return code


def _device_exists(path):
    """A --device path on this host: /dev/infiniband where the host has RDMA devices and ib_uverbs is loaded
    (the lab makes their files in the container's view only: a lab host cannot have them), any other path as
    the host has it."""
    if _is_rdma_dir(path) or path.startswith("/dev/infiniband/"):
        return bool(_hcas()) and not _state("no-uverbs")
    return os.path.exists(path)


def _is_rdma_dir(path):
    return path.rstrip("/") == "/dev/infiniband"


def _ulimit(u):
    name, _, val = u.partition("=")
    soft, _, hard = val.partition(":")
    hard = hard or soft
    return {"Name": name, "Soft": int(soft), "Hard": int(hard)}


def _start(name):
    """Double-fork a shim in a new session: it runs the container's command, keeps its output as docker's
    json-file driver does (`log`, one JSON object per line) and records its exit."""
    open(os.path.join(_cdir(name), "log"), "ab").close()
    before = _state_of(name).get("StartedAt")
    pid = os.fork()
    if pid == 0:
        os.setsid()
        if os.fork():
            os._exit(0)
        devnull = os.open(os.devnull, os.O_RDWR)
        errors = os.open(os.path.join(_cdir(name), "shim.err"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(devnull, 0)
        os.dup2(devnull, 1)
        os.dup2(errors, 2)
        os.execv(sys.executable, [sys.executable, "-SI", os.path.realpath(__file__), "__shim", name])
    os.waitpid(pid, 0)
    # until the shim has started the process (or it already ran and exited): docker returns once it runs. On a
    # loaded machine the shim's start takes seconds; returning before it, an attached run read an empty log
    deadline = time.monotonic() + 120
    while _state_of(name).get("StartedAt") == before and time.monotonic() < deadline:
        time.sleep(0.01)


def _container_env(cfg):
    env = dict(e.split("=", 1) for e in cfg["Config"]["Env"])
    lab = _lab()
    env["PATH"] = os.path.join(HERE, "image", "bin") + ":" + env.get("PATH", "")
    env["PYTHONPATH"] = os.path.join(HERE, "image", "site")
    env["HOSTNAME"] = socket.gethostname()
    env["HOME"] = "/root"
    # what the stand-in needs to know about its container (a real one would see it directly)
    import resource
    for u in cfg["HostConfig"]["Ulimits"]:
        if u["Name"] == "memlock":
            want = resource.RLIM_INFINITY if u["Soft"] < 0 else u["Soft"]
            hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)[1]
            if hard != resource.RLIM_INFINITY and (want == resource.RLIM_INFINITY or want > hard):
                # this machine may not grant it: show the processes the limit the container was given
                env["LD_PRELOAD"] = os.path.join(HERE, "memlock.so")
                env["RAILYARD_LAB_MEMLOCK"] = "unlimited" if u["Soft"] < 0 else str(u["Soft"])
    env["RAILYARD_LAB_CONTAINER"] = _cdir(cfg["Name"].lstrip("/"))
    env["RAILYARD_LAB_HOST_DIR"] = HOST_DIR
    env["RAILYARD_LAB_DIR"] = lab["lab_dir"]
    return env


def _limits(cfg):
    import resource
    names = {"memlock": resource.RLIMIT_MEMLOCK, "stack": resource.RLIMIT_STACK, "nofile": resource.RLIMIT_NOFILE}
    out = []
    for u in cfg["HostConfig"]["Ulimits"]:
        if u["Name"] in names:
            conv = lambda v: resource.RLIM_INFINITY if v < 0 else v
            out.append((names[u["Name"]], (conv(u["Soft"]), conv(u["Hard"]))))
    if not any(n == resource.RLIMIT_MEMLOCK for n, _ in out):
        out.append((resource.RLIMIT_MEMLOCK, (8 << 20, 8 << 20)))  # docker's default: 8 MiB
    return out


def _private_tmp(name, argv):
    """Run argv in a private mount namespace with the container's own /tmp and its bind volumes
    under /tmp and /run mounted for real (a tmpfs over /run, as a container has its own), and those
    elsewhere onto the mount points lab.up made (/model); a missing host path is made, as docker
    makes it. Binds to other paths, which cannot be made on a lab host, are resolved by the stand-in."""
    cfg = _load(name)
    tmp = os.path.join(_cdir(name), "rootfs", "tmp")
    steps = ['mount --bind "$0" /tmp']
    run_done = False
    for b in cfg["HostConfig"]["Binds"]:  # the /dev setup below needs /run first
        parts = b.split(":")
        src, dst = parts[0], parts[1]
        ro = len(parts) > 2 and "ro" in parts[2].split(",")
        if not (dst.startswith("/run/") or dst.startswith("/tmp/")):
            if os.path.isdir(dst) and os.path.dirname(dst.rstrip("/")) == "/":
                steps.append(f"mkdir -p {shlex.quote(src)}" if not os.path.exists(src) else "true")
                steps.append(f"mount --bind {shlex.quote(src)} {shlex.quote(dst)}")
                if ro:
                    steps.append(f"mount -o remount,ro,bind {shlex.quote(dst)}")
            continue
        if dst.startswith("/run/") and not run_done:
            steps.append("mount -t tmpfs railyard-run /run")
            run_done = True
        make = f"mkdir -p {shlex.quote(os.path.dirname(dst))} && " + (
            f"touch {shlex.quote(dst)}" if os.path.isfile(src) else f"mkdir -p {shlex.quote(dst)}")
        steps.append(make)
        steps.append(f"mount --bind {shlex.quote(src)} {shlex.quote(dst)}")
        if ro:
            steps.append(f"mount -o remount,ro,bind {shlex.quote(dst)}")
    # the files this host's copy of the image has that the lab's shared image does not (a fault's
    # /etc/nccl.conf, another libnccl.so.2): each directory that holds one is overlaid with them
    steps += _layer_mounts(cfg)
    # its own /dev: the usual nodes, and the devices it was given (/dev/infiniband cannot exist on a
    # lab host, so its device files are made here, in the container's view only)
    if not run_done:
        steps.append("mount -t tmpfs railyard-run /run")
    steps += ["mkdir -p /run/.hostdev", "mount --rbind /dev /run/.hostdev", "mount -t tmpfs -o mode=755 railyard-dev /dev"]
    for node in ("null", "zero", "full", "random", "urandom", "tty"):
        steps.append(f"touch /dev/{node} && mount --bind /run/.hostdev/{node} /dev/{node}")
    steps += ["mkdir -p /dev/pts /dev/shm", "mount --rbind /run/.hostdev/pts /dev/pts", "ln -s /proc/self/fd /dev/fd"]
    if cfg["HostConfig"]["IpcMode"] == "host":   # the host's /dev/shm (docker ignores --shm-size then)
        steps.append("mount --rbind /run/.hostdev/shm /dev/shm")
    else:                                        # its own, of --shm-size (docker's default 64 MB)
        steps.append(f"mount -t tmpfs -o size={shlex.quote(_shm_bytes(cfg['HostConfig']['ShmSize']))} shm /dev/shm")
    if cfg["HostConfig"]["NetworkMode"] != "host":
        steps.append("ip link set lo up")
    for d in cfg["HostConfig"]["Devices"]:
        dev = d["PathInContainer"]
        if _is_rdma_dir(dev):
            steps.append("mkdir -p /dev/infiniband && touch /dev/infiniband/uverbs0 /dev/infiniband/uverbs1 "
                         "/dev/infiniband/rdma_cm")
        elif dev.startswith("/dev/"):
            steps.append(f"[ -e /run/.hostdev/{shlex.quote(dev[5:])} ] && touch {shlex.quote(dev)} && "
                         f"mount --bind /run/.hostdev/{shlex.quote(dev[5:])} {shlex.quote(dev)} || true")
    steps.append("umount -l /run/.hostdev && rmdir /run/.hostdev")
    script = " && ".join(steps) + ' && exec "$@"'
    return ["unshare", "-m", *_namespaces(cfg), "--propagation", "private", "sh", "-c", script, tmp] + argv


def image_layer(name):
    """Where this host keeps the files its copy of image NAME adds (lab faults write them)."""
    return os.path.join(HOST_DIR, "docker", "layers", re.sub(r"[^A-Za-z0-9_.-]", "_", name))


def _layer_mounts(cfg):
    img = _find_image(cfg["Config"]["Image"])
    if img is None or not img.get("RepoTags"):
        return []
    layer = image_layer(img["RepoTags"][0])
    dirs = sorted({os.path.relpath(d, layer) for d, _, files in os.walk(layer) if files})
    return [f"mount -t overlay overlay -o lowerdir={shlex.quote(os.path.join(layer, d))}:/{shlex.quote(d)} "
            f"/{shlex.quote(d)}" for d in dirs if os.path.isdir("/" + d)]


def _namespaces(cfg):
    """The namespaces a container has of its own besides its mounts: IPC unless --ipc host, network unless
    --network host (loopback only: the lab has no docker bridge, so nothing reaches its ports and it reaches
    no other host)."""
    hc = cfg["HostConfig"]
    return (["-i"] if hc["IpcMode"] != "host" else []) + (["-n"] if hc["NetworkMode"] != "host" else [])


def _shm_bytes(size):
    """docker's --shm-size (a number with an optional b, k, m or g; default 64m) in bytes."""
    m = re.fullmatch(r"(\d+)([bkmg]?)", (size or "64m").lower())
    if not m:
        return str(64 << 20)
    return str(int(m.group(1)) << {"": 0, "b": 0, "k": 10, "m": 20, "g": 30}[m.group(2)])


def _apply_limits(limits):
    """Set the container's ulimits where this machine allows it (raising a hard limit needs
    CAP_SYS_RESOURCE, which a sandboxed lab may lack: then the hard limit is kept)."""
    import resource
    for res, (soft, hard) in limits:
        try:
            resource.setrlimit(res, (soft, hard))
        except (ValueError, OSError):
            cur_hard = resource.getrlimit(res)[1]
            try:
                resource.setrlimit(res, (min(soft, cur_hard) if soft != resource.RLIM_INFINITY else cur_hard, cur_hard))
            except (ValueError, OSError):
                pass


def _argv(cfg):
    argv = list(cfg["Config"]["Entrypoint"] or []) + list(cfg["Config"]["Cmd"] or [])
    if argv[:1] == ["bash"] and len(argv) > 1 and argv[1] == "-lc":
        argv[1] = "-c"  # a lab host's /etc/profile would reset the image's PATH
    return argv


# docker's json-file driver: each line the container writes becomes {"log": "<line>\n", "stream":
# "stdout"|"stderr", "time": "<RFC3339Nano UTC>"}, stamped when the daemon reads it from the container's
# pipes; a line longer than its 16 KiB buffer is kept in pieces (a newline only on the last).
LOG_PIECE = 16 * 1024


def _rfc3339nano(ns, fixed=False):
    """UTC time from nanoseconds. fixed: nine fraction digits, as `docker logs -t` prints it; otherwise Go's
    RFC3339Nano, as the driver stores it (trailing zeros dropped)."""
    sec, frac = divmod(ns, 1_000_000_000)
    digits = f"{frac:09d}" if fixed else f"{frac:09d}".rstrip("0")
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(sec)) + (f".{digits}" if digits else "") + "Z"


def _log_pump(pipe, stream, fd, lock):
    """Copy one of the container's pipes into its json-file log, a record per line, as it is read."""
    for raw in iter(lambda: pipe.readline(LOG_PIECE), b""):
        rec = {"log": raw.decode("utf-8", errors="replace"), "stream": stream, "time": _rfc3339nano(time.time_ns())}
        data = (json.dumps(rec, ensure_ascii=False) + "\n").encode()
        with lock:
            os.write(fd, data)  # one write per record on an O_APPEND file: readers never see half a record
    pipe.close()


def _log_records(data):
    """The complete records of a json-file log (bytes), as (time, text), and the bytes they take. A line
    that is no record (a log written before the stand-in kept records) is its own text with no time."""
    out, used = [], 0
    for line in data.split(b"\n")[:-1]:  # what follows the last newline is a record still being written
        used += len(line) + 1
        try:
            rec = json.loads(line)
            out.append((str(rec.get("time", "")), str(rec["log"])))
        except (ValueError, KeyError, TypeError, AttributeError):
            out.append(("", line.decode(errors="replace") + "\n"))
    return out, used


def _log_text(records, timestamps=False):
    """What `docker logs` prints: each record's text; with -t its time first (nine fraction digits) and a space."""
    if not timestamps:
        return "".join(text for _, text in records)
    return "".join((_fixed_time(t) + " " if t else "") + text for t, text in records)


def _fixed_time(stamp):
    """The driver's time (`2026-12-02T03:03:13.65797Z`) with nine fraction digits, as `docker logs -t` shows it."""
    head, _, frac = stamp.rstrip("Z").partition(".")
    return f"{head}.{(frac + '000000000')[:9]}Z"


def _subreaper():
    """Make this process its descendants' reaper (prctl PR_SET_CHILD_SUBREAPER): an orphan of the container
    (a server's engine core once the server has died) stays under the shim, as it stays in the container's
    PID namespace under docker."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass


def _descendants(root):
    """Every live process under `root`, by one walk of /proc (this kernel has no /proc/PID/task/TID/children)."""
    parent = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    parent[int(d)] = int(f.read().rsplit(") ", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out += kids
        todo += kids
    return out


def _reap_all():
    """Reap every child that has exited (orphans the shim inherited); never blocks."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _teardown():
    """What the kernel does when a container's first process exits (its PID namespace is torn down):
    SIGKILL to every other process of the container, here every descendant of the shim, until none is left."""
    import signal as _signal
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        left = _descendants(os.getpid())
        for pid in left:
            try:
                os.kill(pid, _signal.SIGKILL)
            except ProcessLookupError:
                pass
        _reap_all()
        if not left:
            return
        time.sleep(0.02)


def _shim(name):
    import threading
    cfg = _load(name)
    fd = os.open(os.path.join(_cdir(name), "log"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
    limits = _limits(cfg)

    def child_setup():
        _apply_limits(limits)

    _subreaper()
    proc = subprocess.Popen(_private_tmp(name, _argv(cfg)), env=_container_env(cfg), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                            cwd=os.path.join(_cdir(name), "rootfs"), preexec_fn=child_setup)
    _write_state(name, Status="running", Running=True, Pid=proc.pid, ExitCode=0, StartedAt=_now(),
                 FinishedAt="0001-01-01T00:00:00Z", ShimPid=os.getpid())
    lock = threading.Lock()
    pumps = [threading.Thread(target=_log_pump, args=(pipe, stream, fd, lock), daemon=True)
             for pipe, stream in ((proc.stdout, "stdout"), (proc.stderr, "stderr"))]
    for t in pumps:
        t.start()
    import signal as _signal

    def forward(sig, frame):
        try:
            proc.send_signal(sig)
        except ProcessLookupError:
            pass

    _signal.signal(_signal.SIGTERM, forward)
    while True:  # the container's first process, and the orphans it leaves to the shim while it runs
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            status = 255 << 8
            break
        if pid == proc.pid:
            break
    rc = proc.returncode = os.waitstatus_to_exitcode(status)
    _teardown()  # the rest of the container goes with its first process, before its exit is recorded
    drained = time.monotonic() + 2
    for t in pumps:  # what the processes wrote before they died is in the log before the exit is recorded
        t.join(timeout=max(0.0, drained - time.monotonic()))
    code = rc if rc >= 0 else 128 - rc
    if _state_of(name).get("ShimPid") == os.getpid():  # never over a later start's state
        _write_state(name, Status="exited", Running=False, Pid=0, ExitCode=code, FinishedAt=_now())
    if cfg["HostConfig"].get("AutoRemove"):
        _remove(name)
    for t in pumps:  # a process given the pipes by other means (none a container can have) ends it
        t.join(timeout=5)
    os.close(fd)
    return 0


def _wait_exit(name):
    while _state_of(name).get("Running"):
        time.sleep(0.1)
    with open(os.path.join(_cdir(name), "log"), "rb") as f:
        sys.stdout.write(_log_text(_log_records(f.read())[0]))
    return _state_of(name).get("ExitCode", 0)


def _no_such(kind, name):
    print(f"Error response from daemon: No such container: {name}", file=sys.stderr)
    return 1


def _inspect_containers(args):
    fmt, names = _fmt_args(args)
    docs, rc = [], 0
    for n in names:
        c = _load(n)
        if c is None:
            img = _find_image(n)
            if img is not None:
                docs.append(img)
                continue
            print(f"Error: No such object: {n}", file=sys.stderr)
            rc = 1
            continue
        docs.append(c)
    _print_docs(docs, fmt)
    return rc


def _print_docs(docs, fmt):
    """`docker inspect` output: a JSON array indented by 4, or one --format line per object."""
    if fmt is not None:
        for d in docs:
            print(_render(fmt, d))
    else:
        print(json.dumps(docs, indent=4))


def _fmt_args(args):
    fmt, rest = None, []
    i = 0
    while i < len(args):
        if args[i] in ("-f", "--format"):
            fmt = args[i + 1]
            i += 2
            continue
        if args[i].startswith("--format="):
            fmt = args[i].split("=", 1)[1]
        elif args[i] in ("-a", "--all", "--no-trunc", "-q"):
            rest.append(args[i])
        else:
            rest.append(args[i])
        i += 1
    return fmt, [r for r in rest if not r.startswith("-")]


def _ago(stamp):
    try:
        t = time.mktime(time.strptime(stamp[:19], "%Y-%m-%dT%H:%M:%S")) - time.timezone
    except ValueError:
        return "?"
    d = max(0, time.time() - t)
    for unit, sec in (("days", 86400), ("hours", 3600), ("minutes", 60)):
        if d >= 2 * sec:
            return f"{int(d // sec)} {unit}"
    if d >= 60:
        return "About a minute"
    return f"{int(d)} seconds" if d >= 2 else "Less than a second"


def _ps(args):
    args = [x for a in args for x in ([f"-{c}" for c in a[1:]] if re.fullmatch(r"-[aq]{2,}", a) else [a])]  # -aq
    show_all = any(a in ("-a", "--all") for a in args)
    quiet = any(a in ("-q", "--quiet") for a in args)
    filters = [args[i + 1] for i, a in enumerate(args) if a in ("--filter", "-f") and i + 1 < len(args)]
    fmt, _ = _fmt_args([a for i, a in enumerate(args) if a not in ("--filter",) and (i == 0 or args[i - 1] != "--filter")])
    rows = []
    for n in _all_names():
        c = _load(n)
        if c is None or (not show_all and not c["State"]["Running"]):
            continue
        if any(f.startswith("name=") and f[5:] not in n for f in filters):
            continue
        st = c["State"]
        status = f"Up {_ago(st['StartedAt'])}" if st["Running"] else \
            f"Exited ({st['ExitCode']}) {_ago(st['FinishedAt'])} ago" if st["Status"] == "exited" else "Created"
        rows.append({"ID": c["Id"][:12], "Image": c["Config"]["Image"], "Names": n, "Status": status,
                     "State": st["Status"], "Command": '"' + " ".join(_argv(c))[:20] + '…"',
                     "CreatedAt": c["Created"], "Ports": ""})
    if quiet and not fmt:   # the ids only, no header (docker ps -q)
        for r in rows:
            print(r["ID"])
        return 0
    if fmt:
        for r in rows:
            print(_render(fmt, r))
        return 0
    print(f"{'CONTAINER ID':<15}{'IMAGE':<35}{'COMMAND':<25}{'CREATED':<20}{'STATUS':<25}{'PORTS':<10}NAMES")
    for r in rows:
        print(f"{r['ID']:<15}{r['Image'][:32]:<35}{r['Command']:<25}{'':<20}{r['Status']:<25}{'':<10}{r['Names']}")
    return 0


def _logs(args):
    """`docker logs [-t] [-n N|--tail N] [-f] NAME`: the records of the container's json-file log, plain or
    with each line's time (-t/--timestamps); the stand-in prints both streams on stdout."""
    tail = None
    follow = False
    stamps = False
    name = None
    i = 0
    while i < len(args):
        a = args[i]
        if a in ("-n", "--tail"):
            tail = args[i + 1]
            i += 1
        elif a.startswith("--tail=") or a.startswith("-n="):
            tail = a.split("=", 1)[1]
        elif a.startswith("-n") and a[2:].isdigit():
            tail = a[2:]
        elif a in ("--since", "--until"):
            i += 1
        elif a in ("-f", "--follow"):
            follow = True
        elif a in ("-t", "--timestamps"):
            stamps = True
        elif a in ("-ft", "-tf"):
            follow = stamps = True
        elif not a.startswith("-"):
            name = a
        i += 1
    c = _load(name) if name else None
    if c is None:
        return _no_such("container", name)
    path = os.path.join(_cdir(c["Name"].lstrip("/")), "log")
    with open(path, "rb") as f:
        records, done = _log_records(f.read())
    if tail not in (None, "all"):
        records = records[-int(tail):] if int(tail) > 0 else []
    sys.stdout.write(_log_text(records, stamps))
    sys.stdout.flush()
    if follow:
        with open(path, "rb") as f:
            f.seek(done)
            pending = b""
            while True:
                running = _state_of(c["Name"].lstrip("/")).get("Running")
                chunk = f.read()  # read after the state: what an exited container wrote is all there
                if chunk:
                    pending += chunk
                    records, used = _log_records(pending)
                    pending = pending[used:]
                    if records:
                        sys.stdout.write(_log_text(records, stamps))
                        sys.stdout.flush()
                elif not running:
                    break
                else:
                    time.sleep(0.2)
    return 0


def _exec(args):
    i = 0
    while i < len(args) and args[i].startswith("-"):
        i += 2 if args[i] in ("-e", "--env", "-u", "--user", "-w", "--workdir") else 1
    if i >= len(args):
        print('"docker exec" requires at least 2 arguments.', file=sys.stderr)
        return 1
    c = _load(args[i])
    if c is None:
        return _no_such("container", args[i])
    if not c["State"]["Running"]:
        print(f"Error response from daemon: container {c['Id']} is not running", file=sys.stderr)
        return 1
    limits = _limits(c)

    def child_setup():
        _apply_limits(limits)

    argv = args[i + 1:]
    env = _container_env(c)
    if not shutil.which(argv[0], path=env.get("PATH")):
        print(f"OCI runtime exec failed: exec failed: unable to start container process: exec: \"{argv[0]}\": "
              "executable file not found in $PATH: unknown", file=sys.stderr)
        return 126
    # into the running container's own namespaces (its mounts: /tmp, /dev/shm, /model; its IPC and network),
    # in its working directory
    joined = ["nsenter", "-t", str(int(c["State"]["Pid"])), "-m", *_namespaces(c), "--wd", "--"] + argv
    return subprocess.run(joined, env=env, preexec_fn=child_setup).returncode


def _stop(args):
    timeout = 10
    names = []
    i = 0
    while i < len(args):
        if args[i] in ("-t", "--timeout", "--time"):
            timeout = int(args[i + 1])
            i += 2
            continue
        if args[i].startswith("--timeout=") or args[i].startswith("--time="):
            timeout = int(args[i].split("=", 1)[1])
        else:
            names.append(args[i])
        i += 1
    rc = 0
    for n in names:
        c = _load(n)
        if c is None:
            rc = _no_such("container", n)
            continue
        st = c["State"]
        if st["Running"]:
            import signal as _signal
            try:
                os.kill(st["Pid"], _signal.SIGTERM)
            except ProcessLookupError:
                pass
            deadline = time.time() + timeout
            while time.time() < deadline and _state_of(n).get("Running"):
                time.sleep(0.05)
            if _state_of(n).get("Running"):
                _sigkill(st)
                for _ in range(100):
                    if not _state_of(n).get("Running"):
                        break
                    time.sleep(0.05)
        print(n)
    return rc


def _sigkill(st):
    """SIGKILL to a running container's first process: its shim kills the rest and records the exit (137), as
    the kernel and docker do. A shim that is gone already (killed with it) cannot: then its process group and
    what lives under the first process are killed here."""
    import signal as _signal
    pid, shim = st["Pid"], st.get("ShimPid")
    if _shim_alive(shim):
        try:
            os.kill(pid, _signal.SIGKILL)
        except ProcessLookupError:
            pass
        return
    left = _descendants(pid) if _alive(pid) else []
    try:
        os.killpg(os.getpgid(pid), _signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for p in left:
        try:
            os.kill(p, _signal.SIGKILL)
        except ProcessLookupError:
            pass


def _kill(args):
    """`docker kill [-s SIGNAL] NAME...`: the signal (SIGKILL by default) to the container's processes."""
    import signal as _signal
    sig = _signal.SIGKILL
    names = []
    i = 0
    while i < len(args):
        a = args[i]
        if a in ("-s", "--signal") and i + 1 < len(args):
            v = args[i + 1]
            i += 2
        elif a.startswith("--signal="):
            v = a.split("=", 1)[1]
            i += 1
        else:
            names.append(a)
            i += 1
            continue
        try:
            sig = _signal.Signals(int(v)) if v.isdigit() else _signal.Signals[v if v.startswith("SIG") else "SIG" + v]
        except (KeyError, ValueError):
            print(f"invalid signal: {v}", file=sys.stderr)
            return 1
    rc = 0
    for n in names:
        c = _load(n)
        if c is None:
            rc = _no_such("container", n)
            continue
        st = c["State"]
        if not st["Running"]:
            print(f"Error response from daemon: cannot kill container: {n}: container {c['Id']} is not running",
                  file=sys.stderr)
            rc = 1
            continue
        try:
            if sig == _signal.SIGKILL:  # the whole container goes (exit 137)
                _sigkill(st)
            else:
                os.kill(st["Pid"], sig)
        except (ProcessLookupError, PermissionError):
            pass
        if sig == _signal.SIGKILL:
            for _ in range(100):
                if not _state_of(n).get("Running"):
                    break
                time.sleep(0.05)
        print(n)
    return rc


def _start_cmd(args):
    rc = 0
    for n in [a for a in args if not a.startswith("-")]:
        c = _load(n)
        if c is None:
            rc = _no_such("container", n)
            continue
        if not c["State"]["Running"]:
            _start(c["Name"].lstrip("/"))
        print(n)
    return rc


def _rm(args):
    force = any(a in ("-f", "--force") for a in args)
    rc = 0
    for n in [a for a in args if not a.startswith("-")]:
        c = _load(n)
        if c is None:
            rc = _no_such("container", n)
            continue
        if c["State"]["Running"]:
            if not force:
                print(f'Error response from daemon: cannot remove container "/{n}": container is running: stop the '
                      "container before removing or force remove", file=sys.stderr)
                rc = 1
                continue
            _stop(["--timeout", "0", n])
        _remove(c["Name"].lstrip("/"))
        print(n)
    return rc


def _container(args):
    sub = {"inspect": _inspect_containers, "ls": _ps, "logs": _logs, "stop": _stop, "start": _start_cmd,
           "kill": _kill, "rm": _rm, "exec": _exec, "run": _run}
    if args and args[0] in sub:
        return sub[args[0]](args[1:])
    print("Usage:  docker container COMMAND", file=sys.stderr)
    return 1


CONTAINER_COMMANDS = {"run": _run, "ps": _ps, "inspect": _inspect_containers, "logs": _logs, "exec": _exec,
                      "stop": _stop, "start": _start_cmd, "kill": _kill, "rm": _rm, "container": _container}


TOOLS = {"ibdev2netdev": ibdev2netdev, "show_gids": show_gids, "nvidia-smi": nvidia_smi, "lscpu": lscpu,
         "timedatectl": timedatectl, "docker": docker, "chronyc": chronyc, "dmesg": dmesg, "lsmod": lsmod,
         "ibv_devinfo": ibv_devinfo, "lspci": lspci, "ethtool": ethtool}


def main():
    name = os.path.basename(sys.argv[0])
    if sys.argv[1:2] == ["__shim"]:  # a container's shim, started by `docker run`/`docker start`
        name = "docker"
    tool = TOOLS.get(name)
    if tool is None:
        print(f"{name}: not a lab tool", file=sys.stderr)
        return 127
    try:
        return tool(sys.argv[1:])
    except BrokenPipeError:
        return 141


if __name__ == "__main__":
    sys.exit(main())
