#!/usr/bin/python3 -SI
"""Stand-ins for tools a lab host cannot have: ibdev2netdev, show_gids, nvidia-smi, timedatectl, docker.

Installed on each lab host's PATH as symlinks to this one file; the name it is called by
picks the tool. Output formats are copied from real captures (tests/fixtures/real/).
Where a kernel state exists the output follows it: link state, addresses and MACs come
from the host's own network namespace (/sys/class/net, `ip`). Faults the kernel cannot
show (a busy GPU, NTP, Docker) are read from the host's lab state directory,
$RAILYARD_LAB_HOST_DIR/state. Standard library only: this runs on the test host.
"""

import hashlib
import json
import os
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.realpath(__file__))
HOST_DIR = os.environ.get("RAILYARD_LAB_HOST_DIR", "")
STATE = os.path.join(HOST_DIR, "state")
# the lab's two rails: RDMA device -> netdev, as on a DGX Station
HCAS = {"mlx5_0": "cx8r0", "mlx5_1": "cx8r1"}


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


def _uuid(seed):
    h = hashlib.sha256(seed.encode()).hexdigest()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


# ---------------------------------------------------------------- ibdev2netdev

def ibdev2netdev(args):
    # real: "mlx5_1 port 1 ==> cx8r1 (Up)", sorted by device name as text
    for hca in sorted(HCAS):
        netdev = HCAS[hca]
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
    for hca in sorted(HCAS):
        netdev = HCAS[hca]
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


def _gpus():
    """(index, name, short name, uuid, bus, total MiB, used MiB, processes)."""
    host = _host()
    nogpu = _state("no-gpu", "")
    display = {"name": "NVIDIA RTX PRO 6000 Blackwell Workstation Edition", "short": "NVIDIA RTX PRO 6000 Blac...",
               "uuid": _uuid(host + "display"), "bus": "00000000:01:00.0", "total": 97887, "base": 12,
               "procs": [(2191, "G", "/usr/lib/xorg/Xorg", 4), (5635, "G", "/usr/bin/gnome-shell", 8)],
               "power": " 38W /  600W", "fan": "30%", "ecc": "Off", "persist": "Off"}
    main = {"name": "NVIDIA GB300", "short": "NVIDIA GB300", "uuid": _uuid(host + "gb300"),
            "bus": "00000008:06:00.0", "total": 284208, "base": 1, "procs": [],
            "power": "237W / 1400W", "fan": "N/A", "ecc": "0", "persist": "On"}
    busy = _state("gpu-busy")
    if busy:
        info = json.loads(busy)
        if _alive(info["pid"]):
            main["procs"].append((info["pid"], "C", info.get("name", "python3"), info.get("mib", 8710)))
    if nogpu == "all":
        return []
    gpus = [display] if nogpu == "gb300" else [display, main]
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


def nvidia_smi(args):
    gpus = _gpus()
    if "--version" in args:
        print(f"NVIDIA-SMI version  : {DRIVER}\nNVML version        : {DRIVER.rsplit('.', 1)[0]}\n"
              f"DRIVER version      : {DRIVER}\nCUDA Version        : 13.0")
        return 0
    if not gpus:
        print("No devices were found")
        return 6
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
                     "driver_version": ("driver_version", lambda g: DRIVER)}
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
    _table(gpus)
    return 0


def _table(gpus):
    bar = "+-----------------------------------------+------------------------+----------------------+"
    print(time.strftime("%a %b %d %H:%M:%S %Y") + "       ")
    print("+-----------------------------------------------------------------------------------------+")
    print(f"| NVIDIA-SMI {DRIVER}             Driver Version: {DRIVER}     CUDA Version: 13.0     |")
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
        "Config": {"Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
                   "Entrypoint": ["vllm", "serve"], "WorkingDir": "/vllm-workspace"},
        "Architecture": "arm64",
        "Os": "linux",
        "Size": 21474836480,
        "RootFS": {"Type": "layers", "Layers": ["sha256:" + hashlib.sha256((digest + str(i)).encode()).hexdigest()
                                                for i in range(3)]},
        "Metadata": {"LastTagTime": "0001-01-01T00:00:00Z"},
    }


def _find_image(ref):
    images = _images()
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
        for part in field.lstrip(".").split("."):
            v = v.get(part, "<no value>") if isinstance(v, dict) else "<no value>"
        out += json.dumps(v) if as_json else _go_value(v)
        i = k + 2
    return out


def docker(args):
    if not args or args[0] in ("-h", "--help"):
        print("Usage:  docker [OPTIONS] COMMAND")
        return 0
    if args[0] == "version":
        print(CLIENT)
        err = _daemon_error("version")
        if err:
            print(err, file=sys.stderr)
            return 1
        print()
        print(SERVER)
        return 0
    if args[:2] == ["image", "inspect"] or args[0] == "inspect":
        rest = args[2:] if args[0] == "image" else args[1:]
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
        if fmt is not None:
            for d in docs:
                print(_render(fmt, d))
        else:
            print(json.dumps(docs, indent=4))
        return rc
    print(f"docker: '{args[0]}' is not a docker command.\nSee 'docker --help'", file=sys.stderr)
    return 1


TOOLS = {"ibdev2netdev": ibdev2netdev, "show_gids": show_gids, "nvidia-smi": nvidia_smi,
         "timedatectl": timedatectl, "docker": docker}


def main():
    name = os.path.basename(sys.argv[0])
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
