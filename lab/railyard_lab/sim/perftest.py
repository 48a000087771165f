#!/usr/bin/python3 -SI
"""Stand-ins for perftest (`ib_write_bw`, `ib_write_lat`, `ib_send_lat`) and infiniband-diags' `ibstat` on a lab
host, installed as symlinks to this one file (the name picks the tool). Standard library only.

Every line printed is a line real perftest prints, copied from the captures in tests/fixtures/real/perftest/
(origins in tests/fixtures/real/ORIGINS.md): the server banner, the header (spark-vllm-docker NETWORKING.md,
perftest #234), the table (the same, #273 for -D), the CUDA preamble (#241), the failures (#228 no server,
#346 GPU memory without peer memory, #276 write latency in GPU memory, #336, ofiwg/libfabric #5149 a server
that cannot create its QP). What is real here: the two ends meet over a real TCP connection on the rail
(server on -p, default 18515, on every address; the client connects to the address given), so a missing
server, a rail that is down and a firewalled port fail for real; -D runs for D real seconds.

The figures follow the host's rail: the HCA's rate (shape.json `nics[].rate_gbps`) times the efficiency a
healthy link shows in the captures (`eff`, `eff_1qp`), times the rail's real throttle (a `tc` tbf qdisc on
the rail netdev, the `rail-slow` fault: its rate over the veth's 10000 Mbit/s), times the GPU-memory factor
with --use_cuda. Each end sends its own factor in the exchange; the pair reads the slower end.
"""

import json
import os
import random
import socket
import subprocess
import sys
import time

HOST_DIR = os.environ.get("RAILYARD_LAB_HOST_DIR", "")
STATE = os.path.join(HOST_DIR, "state")
DEFAULT_PORT = 18515
VETH_MBIT = 10000          # what `ethtool` reports of a lab rail (a veth): the base of a tbf throttle
GPU_FACTOR = 0.93          # GPU memory a bit below host memory on a healthy GPUDirect path (#241's host figure
                           # on a good path is the ceiling; the NVIDIA two-Station playbook reads GPU a few % lower)
# ACS redirect on the PCIe switch ports between the GPU and the NIC sends every peer-to-peer TLP up to the root
# complex and back down: GPUDirect still works but at a fraction of host memory. #241 (GPU and NIC `SYS` apart)
# reads 11000 MB/s in GPU memory against 23000 in host memory: about 0.48.
ACS_FACTOR = 0.48
CONNECT_TIMEOUT_S = 5      # the real client waits the kernel's SYN retries (about two minutes) on a dropped SYN;
                           # the lab cuts it to seconds (the verb bounds every client with its own timeout anyway)
RULE = "-" * 87
BANNER = "\n************************************\n* Waiting for client to connect... *\n************************************"
INLINE_CUDA = "Perftest doesn't supports CUDA tests with inline messages: inline size set to 0"
PEAK_WARNING = " WARNING: BW peak won't be measured in this run."

TESTS = {"ib_write_bw": ("RDMA_Write BW Test", "bw"), "ib_write_lat": ("RDMA_Write Latency Test", "lat"),
         "ib_send_lat": ("Send Latency Test", "lat")}
# what the stand-in takes, in the shape of perftest's usage (a caller checks `--help` for --use_cuda_dmabuf, as
# with a real build); the list is the lab's, not a copy of a real build's help
HELP = """Usage:
  {tool}            start a server and wait for connection
  {tool} <host>     connect to server at <host>

Options:
  -d, --ib-dev=<dev>  Use IB device <dev> (default first device found)
  -x, --gid-index=<index>  Test uses GID with GID index (Default : IB - no gid . ETH - 0)
  -F, --CPU-freq  Do not show a warning even if cpufreq_ondemand module is loaded, and cpu-freq is not on max.
  -p, --port=<port>  Listen on/connect to port <port> (default 18515)
  -s, --size=<size>  Size of message to exchange (default {size})
  -n, --iters=<iters>  Number of exchanges (at least 5, default {iters})
  -D, --duration  Run test for a customized period of seconds.
  -q, --qp=<num of qp's>  Num of qp's(default 1)
  -R, --rdma_cm  Connect QPs with rdma_cm and run test on those QPs
  --report_gbits  Report Max/Average BW of test in Gbit/sec (instead of MiB/sec)
  --use_cuda=<cuda device id>  Use CUDA specific device for GPUDirect RDMA testing
  --use_cuda_dmabuf  Use CUDA DMA-BUF for GPUDirect RDMA testing
  -h, --help  Show this help screen.
"""


def _shape():
    try:
        with open(os.path.join(HOST_DIR, "shape.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        print("lab: this host has no shape.json (run `inv lab.up`)", file=sys.stderr)
        sys.exit(70)


def _state(name, default=None):
    try:
        with open(os.path.join(STATE, name)) as f:
            return f.read().strip()
    except OSError:
        return default


def _sys(iface, attr):
    try:
        with open(f"/sys/class/net/{iface}/{attr}") as f:
            return f.read().strip()
    except OSError:
        return None


def _ipv4(iface):
    out = subprocess.run(["ip", "-4", "-o", "addr", "show", "dev", iface], capture_output=True, text=True).stdout
    return next((ln.split()[3].split("/")[0] for ln in out.splitlines() if " inet " in ln), "0.0.0.0")


def _nic(shape, hca):
    return next((n for n in shape["nics"] if n["hca"] == hca), {})


def throttle(netdev):
    """The rail's real throttle: a tbf qdisc's rate (bytes/s in `tc -j`) over the veth's line rate; 1.0 if none."""
    try:
        out = subprocess.run(["tc", "-j", "qdisc", "show", "dev", netdev], capture_output=True, text=True,
                             timeout=5).stdout
        for q in json.loads(out or "[]"):
            if q.get("kind") == "tbf":
                rate = q.get("options", {}).get("rate")
                if isinstance(rate, (int, float)) and rate > 0:
                    return min(1.0, rate * 8 / (VETH_MBIT * 1e6))
    except (OSError, ValueError, subprocess.TimeoutExpired):
        pass
    return 1.0


# ---------------------------------------------------------------- arguments

def parse_args(tool, argv):
    """perftest's flags the lab honours; an unknown one is refused as getopt_long refuses it."""
    o = {"tool": tool, "dev": None, "gid": None, "port": DEFAULT_PORT, "size": None, "iters": None,
         "duration": None, "qps": 1, "cm": False, "gbits": False, "cuda": None, "dmabuf": False, "host": None,
         "help": False}
    with_value = {"-d": "dev", "--ib-dev": "dev", "-x": "gid", "--gid-index": "gid", "-p": "port", "--port": "port",
                  "-s": "size", "--size": "size", "-n": "iters", "--iters": "iters", "-D": "duration",
                  "--duration": "duration", "-q": "qps", "--qp": "qps", "--use_cuda": "cuda"}
    flags = {"-F": None, "--CPU-freq": None, "-R": "cm", "--rdma_cm": "cm", "--report_gbits": "gbits",
             "--use_cuda_dmabuf": "dmabuf", "-h": "help", "--help": "help"}
    i = 0
    while i < len(argv):
        a = argv[i]
        name, eq, val = a.partition("=") if a.startswith("--") else (a, "", "")
        if name in with_value:
            if not eq:
                i += 1
                if i >= len(argv):
                    print(f"{tool}: option requires an argument -- '{name.lstrip('-')}'", file=sys.stderr)
                    return None
                val = argv[i]
            o[with_value[name]] = val
        elif name in flags:
            if flags[name]:
                o[flags[name]] = True
        elif a.startswith("-"):
            print(f"{tool}: unrecognized option '{a}'" if a.startswith("--") else f"{tool}: invalid option -- "
                  f"'{a[1:]}'", file=sys.stderr)
            return None
        else:
            o["host"] = a
        i += 1
    for k in ("port", "size", "iters", "duration", "qps", "gid", "cuda"):
        if o[k] is not None and not str(o[k]).isdigit():
            print(f" Invalid value for {k}: {o[k]}", file=sys.stderr)
            return None
        if o[k] is not None:
            o[k] = int(o[k])
    kind = TESTS[tool][1]
    o["size"] = o["size"] if o["size"] is not None else (65536 if kind == "bw" else 2)
    return o


# ---------------------------------------------------------------- the run

def _cuda_preamble(shape, o):
    gpus = shape["gpus"]
    if o["cuda"] >= len(gpus):
        print(f"No CUDA device with id {o['cuda']}", file=sys.stderr)   # plain: no capture shows this line
        return False
    print("initializing CUDA\nListing all CUDA devices in system:")
    for k, g in enumerate(gpus):
        bus = g["bus"].split(":")
        print(f"CUDA device {k}: PCIe address is {bus[1]}:{bus[2][:2]}")
    g = gpus[o["cuda"]]
    print(f"\nPicking device No. {o['cuda']}\n[pid = {os.getpid()}, dev = {o['cuda']}] device name = [{g['name']}]")
    print("creating CUDA Ctx\nmaking it the current CUDA Ctx")
    print(f"cuMemAlloc() of a {2 * o['size'] * max(1, o['qps'])} bytes GPU buffer")
    addr = 0x7f3fa4000000 + (os.getpid() % 4096) * 0x200000
    print(f"allocated GPU buffer address at {addr:016x} pointer={addr:#x}")
    if _state("no-peermem") and not o["dmabuf"]:
        # without nvidia_peermem the MR over GPU memory cannot be registered (#346; --use_cuda_dmabuf avoids it)
        print("Couldn't allocate MR with error=14\nfailed to create mr\nFailed to create MR\n"
              " Couldn't create IB resources\ndestroying current CUDA Ctx", flush=True)
        return False
    return True


def _gid(ip):
    return "00:00:00:00:00:00:00:00:00:00:255:255:" + ":".join(f"{int(b):02d}" for b in ip.split("."))


def _header(o, local, remote):
    name, kind = TESTS[o["tool"]]
    mtu = int(_sys(local["netdev"], "mtu") or 1500)
    lines = [RULE, f"                    {name}",
             f" Dual-port       : OFF          Device         : {o['dev']}",
             f" Number of qps   : {o['qps']:<13d}Transport type : IB",
             " Connection type : RC           Using SRQ      : OFF",
             f" PCIe relax order: {'ON' if kind == 'bw' else 'OFF'}", " ibv_wr* API     : ON",
             f" TX depth        : {128 if kind == 'bw' else 1}"]
    if kind == "bw":
        lines.append(" CQ Moderation   : 1")
    lines += [f" Mtu             : {4096 if mtu >= 4200 else 1024}[B]", " Link type       : Ethernet",
              f" GID index       : {local['gid']}",
              f" Max inline data : {0 if kind == 'bw' or o['cuda'] is not None else (236 if 'send' in o['tool'] else 220)}[B]",
              f" rdma_cm QPs     : {'ON' if o['cm'] else 'OFF'}",
              f" Data ex. method : {'rdma_cm' if o['cm'] else 'Ethernet'}", RULE]
    rnd = random.Random(f"{local['ip']}{remote['ip']}{o['port']}")
    for who, end in (("local", local), ("remote", remote)):
        for q in range(o["qps"]):
            qpn, psn = 0x100 + rnd.randrange(0x2000), rnd.randrange(1 << 24)
            if o["cm"] or o["tool"] == "ib_send_lat":
                lines.append(f" {who} address: LID 0000 QPN {qpn:#06x} PSN {psn:#08x}")
            else:
                lines.append(f" {who} address: LID 0000 QPN {qpn:#06x} PSN {psn:#08x} RKey {rnd.randrange(1 << 22):#08x}"
                             f" VAddr 0x{0x7f0000000000 + rnd.randrange(1 << 24) * 0x1000:014x}")
            lines.append(f" GID: {_gid(end['ip'])}")
    lines.append(RULE)
    return "\n".join(lines)


def _table(o, factor):
    kind = TESTS[o["tool"]][1]
    if kind == "bw":
        gbps = factor
        unit = "Gb/sec" if o["gbits"] else "MiB/sec"
        scale = 1.0 if o["gbits"] else 1e9 / 8 / 1048576
        if o["duration"]:
            iters, peak = int(gbps * 1e9 / 8 * o["duration"] / o["size"]), 0.0   # -D: the total count, no peak
        else:
            iters, peak = o["iters"] or 5000, gbps * 1.0002
        rate = gbps * 1e9 / 8 / o["size"] / 1e6
        return (f" #bytes     #iterations    BW peak[{unit}]    BW average[{unit}]   MsgRate[Mpps]\n"
                f" {o['size']:<10d} {iters:<16d} {peak * scale:<18.2f} {gbps * scale:<18.2f} {rate:.6f}\n{RULE}")
    base = factor   # latency in usec
    vals = (base * 0.966, base * 1.313, base, base, 0.0, base * 1.068, base * 1.313)
    cols = (15, 13, 20, 17, 16, 24)
    row = f" {o['size']:<8d}{o['iters'] or 1000:<14d}" + "".join(f"{v:<{w}.2f}" for v, w in zip(vals, cols)) + \
        f"{vals[-1]:.2f}"
    return (" #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec]   "
            f"99% percentile[usec]   99.9% percentile[usec]\n{row}\n{RULE}")


def _end(shape, o):
    """This end's facts for the exchange: its rail address, GID index and the factor of its own side."""
    netdev = shape["hcas"][o["dev"]]
    nic = _nic(shape, o["dev"])
    rate = float(nic.get("rate_gbps", 400))
    eff = nic.get("eff_1qp", 0.9) if o["qps"] == 1 else nic.get("eff", 0.95)
    bw = rate * eff * throttle(netdev)
    if o["cuda"] is not None:
        bw *= GPU_FACTOR
        if _state("acs-redirect") == "path" and netdev == shape["serve_rail"]:
            bw *= ACS_FACTOR
    gid = _state("gid-index", "3")
    return {"netdev": netdev, "ip": _ipv4(netdev), "gid": int(gid) if gid.isdigit() else 3, "bw": bw,
            "lat": float(nic.get("lat_us", 1.47))}   # a 2-byte ping-pong does not feel a bandwidth throttle


# the flags both ends must agree on (sparkrun and the field notes: a mismatch is a confusing failure in perftest)
MATCH = (("tool", "test"), ("size", "-s"), ("qps", "-q"), ("duration", "-D"), ("iters", "-n"), ("cm", "-R"))


def _mismatch(mine, theirs):
    for key, flag in MATCH:
        if mine.get(key) != theirs.get(key):
            return (f" lab perftest: {flag} differs between the ends ({mine.get(key)} here, {theirs.get(key)} on the "
                    f"peer): run the same command on both")   # plain: no real capture shows this failure
    return ""


def _send(sock, doc):
    sock.sendall((json.dumps(doc) + "\n").encode())


def _recv(sock):
    data = b""
    while not data.endswith(b"\n"):
        chunk = sock.recv(65536)
        if not chunk:
            return None
        data += chunk
    return json.loads(data)


def _exchange_doc(o, end):
    return {**{k: o[k] for k, _ in MATCH}, "end": end}


def run(tool, argv):
    o = parse_args(tool, argv)
    if o is None:
        return 1
    kind = TESTS[tool][1]
    if o["help"]:
        print(HELP.format(tool=tool, size=65536 if kind == "bw" else 2, iters=5000 if kind == "bw" else 1000))
        return 0
    if o["dmabuf"] and o["cuda"] is None:
        print("CUDA DMA-BUF cannot be used without CUDA\n Parser function exited with Error")   # #336
        return 1
    if kind == "lat" and o["duration"]:
        print(" lab perftest: -D with a latency test is not simulated (use -n)", file=sys.stderr)
        return 1
    if tool == "ib_write_lat" and o["cuda"] is not None:
        print(f"{RULE}\nPerftest supports CUDA latency tests with read/send verbs only")   # #276
        return 1
    shape = _shape()
    hcas = shape["hcas"]
    o["dev"] = o["dev"] or sorted(hcas)[0]
    if o["dev"] not in hcas:
        print(f"IB device {o['dev']} not found\n Unable to find the Infiniband/RoCE device", file=sys.stderr)
        return 1
    if kind == "bw" and o["duration"]:
        print(PEAK_WARNING)
    if o["cuda"] is not None:
        print(INLINE_CUDA)
    return client(o, shape) if o["host"] else server(o, shape)


def server(o, shape):
    if _state("perftest-down"):
        # the server dies at once after its banner (ofiwg/libfabric #5149: the QP cannot be created)
        print(BANNER)
        print("Couldn't get device attributes\nUnable to create QP.\nFailed to create QP.\n Couldn't create IB resources",
              flush=True)
        return 1
    try:
        lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        lsock.bind(("", o["port"]))
        lsock.listen(1)
    except OSError:
        print(f"Couldn't listen to port {o['port']}\nUnable to open file descriptor for socket connection",
              file=sys.stderr)   # plain: the real bind failure line was not captured
        return 1
    print(BANNER, flush=True)
    conn, _ = lsock.accept()
    lsock.close()
    with conn:
        theirs = _recv(conn)
        if o["cuda"] is not None and not _cuda_preamble(shape, o):
            return 1
        end = _end(shape, o)
        _send(conn, _exchange_doc(o, end))
        if theirs is None:
            print(" Failed to exchange data between server and clients", file=sys.stderr)   # perftest's, uncaptured
            return 1
        bad = _mismatch(_exchange_doc(o, end), theirs)
        if bad:
            print(bad, file=sys.stderr)
            return 1
        print(_header(o, end, theirs["end"]), flush=True)
        done = _recv(conn)    # the client's figures, sent after its run
        if done is None:
            print(" Failed to exchange data between server and clients", file=sys.stderr)
            return 1
        print(_table(o, done["figure"]), flush=True)
    return 0


def client(o, shape):
    try:
        sock = socket.create_connection((o["host"], o["port"]), timeout=CONNECT_TIMEOUT_S)
    except (OSError, socket.timeout):
        print(f"Couldn't connect to {o['host']}:{o['port']}\n"
              "Unable to open file descriptor for socket connection Unable to init the socket connection",
              file=sys.stderr)   # #228
        return 1
    sock.settimeout(None)
    with sock:
        if o["cuda"] is not None and not _cuda_preamble(shape, o):
            return 1
        end = _end(shape, o)
        _send(sock, _exchange_doc(o, end))
        theirs = _recv(sock)
        if theirs is None:
            print(" Failed to exchange data between server and clients", file=sys.stderr)
            return 1
        bad = _mismatch(_exchange_doc(o, end), theirs)
        if bad:
            print(bad, file=sys.stderr)
            return 1
        print(_header(o, end, theirs["end"]), flush=True)
        if TESTS[o["tool"]][1] == "bw":
            figure = min(end["bw"], theirs["end"]["bw"])          # the slower end sets the pair's figure
            seconds = o["duration"] or (o["iters"] or 5000) * o["size"] * 8 / (figure * 1e9)
        else:
            figure = max(end["lat"], theirs["end"]["lat"])
            seconds = (o["iters"] or 1000) * figure * 2e-6
        figure *= random.uniform(0.997, 1.003)    # a real run never reads the same figure twice
        time.sleep(min(seconds, 600))
        _send(sock, {"figure": figure})
        print(_table(o, figure), flush=True)
    return 0


# ---------------------------------------------------------------- ibstat

CA_TYPE = {"ConnectX-8": "MT4131", "ConnectX-7": "MT4129"}


def ibstat(argv):
    """`ibstat [HCA [PORT]]` (infiniband-diags): each HCA's port 1, tab layout as the real tool prints it
    (tests/fixtures/real/ibstat/). State follows the rail netdev's carrier; Rate is the NIC's negotiated rate (a
    throttled link still reads it); a down port reads 40, as the GB10 capture's disabled port does."""
    shape = _shape()
    hcas = shape["hcas"]
    want = argv[0] if argv else None
    if want and want not in hcas:
        print(f"lab ibstat: no HCA {want} on this host", file=sys.stderr)   # plain: no capture of this failure
        return 1
    for i, hca in enumerate(sorted(hcas)):
        if want and hca != want:
            continue
        netdev = hcas[hca]
        nic = _nic(shape, hca)
        up = _sys(netdev, "operstate") == "up" and _sys(netdev, "carrier") == "1"
        mac = (_sys(netdev, "address") or "00:00:00:00:00:00").split(":")
        node = f"0x{mac[0]}{mac[1]}{mac[2]}0300{mac[3]}{mac[4]}{mac[5]}"
        port_guid = f"0x{int(mac[0], 16) ^ 2:02x}{mac[1]}{mac[2]}fffe{mac[3]}{mac[4]}{mac[5]}"
        rate = nic.get("rate_gbps", 400) if up else 40
        print(f"CA '{hca}'\n\tCA type: {CA_TYPE.get(nic.get('model', ''), 'MT4129')}\n\tNumber of ports: 1\n"
              f"\tFirmware version: {nic.get('fw', '28.45.4028')}\n\tHardware version: 0\n\tNode GUID: {node}\n"
              f"\tSystem image GUID: {node}\n\tPort 1:\n\t\tState: {'Active' if up else 'Down'}\n"
              f"\t\tPhysical state: {'LinkUp' if up else 'Disabled'}\n\t\tRate: {rate:g}\n\t\tBase lid: 0\n"
              f"\t\tLMC: 0\n\t\tSM lid: 0\n\t\tCapability mask: 0x00010000\n\t\tPort GUID: {port_guid}\n"
              f"\t\tLink layer: Ethernet")
    return 0


def main():
    name = os.path.basename(sys.argv[0])
    try:
        if name in TESTS:
            return run(name, sys.argv[1:])
        if name == "ibstat":
            return ibstat(sys.argv[1:])
    except BrokenPipeError:
        return 141
    print(f"{name}: not a lab tool", file=sys.stderr)
    return 127


if __name__ == "__main__":
    sys.exit(main())
