#!/usr/bin/python3 -SI
"""Stand-in for `vllm serve` inside a lab container: real sockets, real ordering, vLLM's formats.

- rank >= 1 (`--headless`) connects to MASTER_ADDR:--master-port over the lab network and
  waits for the head; rank 0 listens there and is ready only once every worker joined;
- then each rank writes an NCCL-format log to $NCCL_DEBUG_FILE whose transport follows the
  container: GDRDMA over the rail only when NCCL_IB_HCA is the HCA holding VLLM_HOST_IP,
  NCCL_IB_GID_INDEX is that address's RoCE v2 index, /dev/infiniband was passed, IPC_LOCK
  was added and memlock is unlimited; otherwise the lines real NCCL prints instead;
- the head prints vLLM's startup lines and serves /health, /v1/models, /v1/chat/completions
  (also streaming) and /metrics, with the API key from $VLLM_API_KEY;
- it fails as vLLM does when the GPU is busy or the model directory is not a model.
Standard library only.
"""

import json
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid as uuidlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

CONTAINER = os.environ.get("RAILYARD_LAB_CONTAINER", "")
HOST_DIR = os.environ.get("RAILYARD_LAB_HOST_DIR", "")
VERSION = "0.30.0"
NCCL_VERSION = "2.30.7+cuda13.0"
START = time.time()
STATS = {"running": 0, "waiting": 0, "prompt": 0, "generation": 0, "requests": 0, "kv": 0.0,
         "prefix_q": 0, "prefix_h": 0, "spec_drafts": 0, "spec_accepted": 0}


def log(msg, level="INFO", where="api_server.py:1"):
    stamp = time.strftime("%m-%d %H:%M:%S")
    print(f"(APIServer pid={os.getpid()}) {level} {stamp} [{where}] {msg}", flush=True)


def fail(msg, exc="ValueError"):
    print("Traceback (most recent call last):", flush=True)
    print('  File "/usr/local/bin/vllm", line 10, in <module>', flush=True)
    print(f"{exc}: {msg}", flush=True)
    sys.exit(1)


def parse(argv):
    args = {"model": None, "port": 8000, "host": None, "nnodes": 1, "node-rank": 0, "master-addr": "127.0.0.1",
            "master-port": 29501, "headless": False, "served-model-name": None, "max-model-len": 98304,
            "gpu-memory-utilization": 0.9, "tensor-parallel-size": 1, "distributed-timeout-seconds": 1800}
    if argv[:1] == ["serve"]:
        argv = argv[1:]
    i = 0
    while i < len(argv):
        a = argv[i]
        if a.startswith("--"):
            key = a[2:]
            if "=" in key:
                key, val = key.split("=", 1)
            elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                val = argv[i + 1]
                i += 1
            else:
                val = True
            args[key] = val
        elif args["model"] is None:
            args["model"] = a
        i += 1
    for k in ("port", "nnodes", "node-rank", "master-port", "max-model-len", "tensor-parallel-size",
              "distributed-timeout-seconds"):
        args[k] = int(args[k])
    args["gpu-memory-utilization"] = float(args["gpu-memory-utilization"])
    return args


def host_path(path):
    """A path inside the container -> where it is on the host (binds from config.json, /tmp private)."""
    with open(os.path.join(CONTAINER, "config.json")) as f:
        binds = json.load(f)["HostConfig"]["Binds"]
    for b in binds:
        parts = b.split(":")
        src, dst = parts[0], parts[1]
        if path == dst or path.startswith(dst.rstrip("/") + "/"):
            return src + path[len(dst.rstrip("/")):]
    return path  # the container's own files (/tmp is private to it)


def container_config():
    with open(os.path.join(CONTAINER, "config.json")) as f:
        return json.load(f)


# ---------------------------------------------------------------- GPU

def gpu_check(args, cfg):
    """vLLM refuses to start when another process holds the GPU's memory."""
    total_gib = 284208 / 1024
    used = 0.0
    try:
        with open(os.path.join(HOST_DIR, "state", "gpu-busy")) as f:
            busy = json.load(f)
        if os.path.exists(f"/proc/{busy['pid']}"):
            used += busy.get("mib", 0) / 1024
    except (OSError, ValueError):
        pass
    util = args["gpu-memory-utilization"]
    free = total_gib - used
    if free < util * total_gib:
        fail(f"Free memory on device cuda:0 ({free:.2f}/{total_gib:.2f} GiB) on startup is less than desired GPU "
             f"memory utilization ({util}, {util * total_gib:.2f} GiB). Decrease GPU memory utilization or reduce "
             "GPU memory used by other processes.")


def hold_gpu(rank):
    reqs = container_config()["HostConfig"].get("DeviceRequests") or []
    uuid = reqs[0]["DeviceIDs"][0] if reqs else ""
    with open(os.path.join(CONTAINER, "gpu.json"), "w") as f:
        json.dump({"pid": os.getpid(), "name": f"VLLM::Worker_TP{rank}", "mib": 236902, "uuid": uuid}, f)
    try:
        with open("/proc/self/comm", "w") as f:
            f.write(f"VLLM::Worker_TP{rank}"[:15])
    except OSError:
        pass


# ---------------------------------------------------------------- NCCL log

def _rail_of(ip):
    out = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        parts = line.split()
        if len(parts) > 3 and parts[3].split("/")[0] == ip:
            return parts[1].split("@")[0]
    return None


def _v2_index(hca, ip):
    out = subprocess.run(["show_gids", hca], capture_output=True, text=True, env=dict(os.environ, PATH=os.path.join(
        HOST_DIR, "bin") + ":" + os.environ.get("PATH", ""))).stdout
    for line in out.splitlines():
        p = line.split()
        if len(p) >= 7 and p[0] == hca and p[4] == ip and p[5] == "v2":
            return p[2]
    return None


def nccl_log(rank, nranks, peer_ip):
    path = os.environ.get("NCCL_DEBUG_FILE")  # unset: NCCL writes its log to stdout
    if os.environ.get("NCCL_DEBUG", "").upper() != "INFO":
        return None
    hostname = socket.gethostname()
    pid = os.getpid()
    path = path.replace("%h", hostname).replace("%p", str(pid)) if path else None
    cfg = container_config()
    ip = os.environ.get("VLLM_HOST_IP", "")
    iface = os.environ.get("NCCL_SOCKET_IFNAME", "")
    hca = os.environ.get("NCCL_IB_HCA", "")
    gid = os.environ.get("NCCL_IB_GID_INDEX", "")
    netdev = _rail_of(ip)
    hcas = {"mlx5_0": "cx8r0", "mlx5_1": "cx8r1"}
    has_dev = os.path.exists("/dev/infiniband/uverbs0")  # the container's own /dev
    ipc_lock = "IPC_LOCK" in cfg["HostConfig"]["CapAdd"]
    memlock = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0] == resource.RLIM_INFINITY
    want_gid = _v2_index(hca, ip) if hca in hcas else None
    p = f"{hostname}:{pid}:{pid} [0] NCCL INFO "
    w = f"{hostname}:{pid}:{pid} [0] NCCL WARN "
    lines = [p + "cudaDriverVersion 13000", p + f"NCCL_SOCKET_IFNAME set by environment to {iface}",
             p + f"Bootstrap: Using {iface}:{ip}<0>", p + f"NCCL version {NCCL_VERSION}",
             p + "NET/Plugin: Could not find: libnccl-net.so"]
    transport = "Socket"
    if not has_dev or hcas.get(hca) is None or hcas.get(hca) != netdev:
        if hca:
            lines.append(p + f"NCCL_IB_HCA set to {hca}")
        lines.append(p + "NET/IB : No device found.")
    elif not (ipc_lock and memlock):
        lines.append(p + f"NCCL_IB_HCA set to {hca}")
        lines.append(w + "Call to ibv_reg_mr failed with error Cannot allocate memory")
        lines.append(w + "NET/IB : Unable to register memory: check memlock ulimit (ulimit -l) and IPC_LOCK")
        lines.append(p + "NET/IB : No device found.")
    else:
        transport = "IB"
        lines.append(p + f"NCCL_IB_HCA set to {hca}")
        lines.append(p + f"NCCL_IB_GID_INDEX set by environment to {gid}")
        lines.append(p + f"NET/IB : Using [0]{hca}:1/RoCE [RO]; OOB {iface}:{ip}<0>")
    if transport == "Socket":
        lines += [p + "Failed to initialize NET plugin IB", p + f"NET/Socket : Using [0]{iface}:{ip}<0>",
                  p + "Initialized NET plugin Socket", p + "Using network Socket",
                  p + f"NET/Socket : GPU Direct RDMA Disabled for HCA 0 '{iface}'"]
    else:
        lines += [p + "Initialized NET plugin IB", p + "Using network IB",
                  p + f"GPU Direct RDMA Enabled for HCA 0 '{hca}'"]
    lines.append(p + f"ncclCommInitRankConfig comm 0x55d0c0de rank {rank} nranks {nranks} cudaDev 0 nvmlDev 0 "
                     "busId 8060000 commId 0x1f2e3d4c5b6a7988 - Init START")
    lines.append(p + f"comm 0x55d0c0de rank {rank} nRanks {nranks} nNodes {nranks} localRanks 1 localRank 0 MNNVL 0")
    via = "NET/Socket/0" if transport == "Socket" else "NET/IB/0/GDRDMA"
    if transport == "IB" and gid != want_gid:
        via = "NET/IB/0"
    other = 1 - rank if nranks == 2 else (rank + 1) % nranks
    for ch in range(2):
        lines.append(p + f"Channel {ch:02d}/0 : {other}[0] -> {rank}[0] [receive] via {via}")
        lines.append(p + f"Channel {ch:02d}/0 : {rank}[0] -> {other}[0] [send] via {via}")
    mtu_mismatch = transport == "IB" and any(m != _my_mtu() for m in PEER_MTU)
    if mtu_mismatch and gid == want_gid:
        # RoCE frames larger than the smaller MTU are dropped: the QP runs out of retries
        lines.append(w + f"NET/IB : Got completion from peer {peer_ip}<43210> with status=12 opcode=1 len=0 "
                         f"vendor err 129 (Send) localGid ::ffff:{ip} remoteGid ::ffff:{peer_ip}")
        lines.append(p + "transport/net_ib.cc:2035 -> 6")
    if transport == "IB" and gid != want_gid:
        lines.append(w + f"NET/IB : Got completion from peer {peer_ip}<43210> with status=12 opcode=0 len=0 "
                         f"vendor err 129 (Recv) localGid ::ffff:{ip} remoteGid ::ffff:{peer_ip}")
        lines.append(p + "transport/net.cc:1313 -> 6")
    lines.append(p + f"Connected all rings, use ring PXN 0 GDR {1 if via.endswith('GDRDMA') else 0}")
    lines.append(p + f"ncclCommInitRankConfig comm 0x55d0c0de rank {rank} nranks {nranks} cudaDev 0 nvmlDev 0 "
                     "busId 8060000 commId 0x1f2e3d4c5b6a7988 - Init COMPLETE")
    if not path:
        print("\n".join(lines), flush=True)
        return transport
    target = host_path(path)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with open(target, "w") as f:
        f.write("\n".join(lines) + "\n")
    return transport


# ---------------------------------------------------------------- rendezvous

def head_rendezvous(args, stop):
    n = args["nnodes"] - 1
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    bind = os.environ.get("VLLM_HOST_IP") or "0.0.0.0"
    srv.bind((bind, args["master-port"]))
    srv.listen(16)
    log(f"Waiting for {n} remote node(s) to join at tcp://{bind}:{args['master-port']}", where="multiproc_executor.py:112")
    peers = []
    srv.settimeout(1)
    deadline = time.time() + args["distributed-timeout-seconds"]
    while len(peers) < n and not stop.is_set():
        if time.time() > deadline:
            fail(f"Timed out after {args['distributed-timeout-seconds']} seconds waiting for clients. "
                 f"{len(peers)}/{n} clients joined.", "RuntimeError")
        try:
            conn, addr = srv.accept()
        except socket.timeout:
            continue
        line = conn.makefile().readline().strip()
        peers.append((conn, addr[0], line))
        try:
            PEER_MTU.append(int(line.split("mtu ")[1].split()[0]))
        except (IndexError, ValueError):
            pass
        log(f"Node {addr[0]} joined ({line}); {len(peers)}/{n}", where="multiproc_executor.py:131")
    for conn, _, _ in peers:
        conn.sendall(f"GO mtu {_my_mtu()}\n".encode())
    return srv, peers


PEER_MTU = []


def _my_mtu():
    iface = _rail_of(os.environ.get("VLLM_HOST_IP", ""))
    try:
        with open(f"/sys/class/net/{iface}/mtu") as f:
            return int(f.read())
    except (OSError, ValueError, TypeError):
        return 0


def worker_rendezvous(args, stop):
    addr = (args["master-addr"], args["master-port"])
    print(f"INFO {time.strftime('%m-%d %H:%M:%S')} [multiproc_executor.py:205] Headless node rank "
          f"{args['node-rank']}: waiting for the head at tcp://{addr[0]}:{addr[1]}", flush=True)
    deadline = time.time() + args["distributed-timeout-seconds"]
    while not stop.is_set():
        try:
            s = socket.create_connection(addr, timeout=2)
            s.settimeout(None)  # joined: now wait as long as the head lives
            break
        except OSError:
            if time.time() > deadline:
                fail(f"Timed out waiting for the master at {addr[0]}:{addr[1]}", "RuntimeError")
            time.sleep(0.5)
    else:
        sys.exit(0)
    s.sendall(f"rank {args['node-rank']} mtu {_my_mtu()}\n".encode())
    f = s.makefile()
    go = f.readline().strip()
    if not go.startswith("GO"):
        fail("The head closed the connection during rendezvous", "RuntimeError")
    try:
        PEER_MTU.append(int(go.split("mtu ")[1]))
    except (IndexError, ValueError):
        pass
    return s, f


# ---------------------------------------------------------------- HTTP

def make_handler(args, served, key):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "uvicorn"
        sys_version = ""

        def log_message(self, fmt, *a):
            print(f'INFO:     {self.client_address[0]}:{self.client_address[1]} - "{self.requestline}" '
                  f"{a[1] if len(a) > 1 else ''}", flush=True)

        def _send(self, code, body, ctype="application/json"):
            data = body if isinstance(body, bytes) else body.encode()
            self.send_response(code)
            self.send_header("content-type", ctype)
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _authorized(self):
            if not key or not self.path.startswith("/v1"):
                return True
            if self.headers.get("Authorization") == f"Bearer {key}":
                return True
            self._send(401, json.dumps({"error": "Unauthorized"}))
            return False

        def do_GET(self):
            if self.path == "/health":
                return self._send(200, b"", "application/json")
            if not self._authorized():
                return
            if self.path == "/v1/models":
                return self._send(200, json.dumps({"object": "list", "data": [{
                    "id": served, "object": "model", "created": int(START), "owned_by": "vllm", "root": args["model"],
                    "parent": None, "max_model_len": args["max-model-len"],
                    "permission": [{"id": f"modelperm-{uuidlib.uuid4().hex}", "object": "model_permission",
                                    "created": int(START), "allow_create_engine": False, "allow_sampling": True,
                                    "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
                                    "allow_fine_tuning": False, "organization": "*", "group": None,
                                    "is_blocking": False}]}]}))
            if self.path == "/metrics":
                return self._send(200, metrics(served), "text/plain; version=0.0.4; charset=utf-8")
            return self._send(404, json.dumps({"detail": "Not Found"}))

        def do_POST(self):
            length = int(self.headers.get("content-length") or 0)
            body = self.rfile.read(length)
            if not self._authorized():
                return
            if self.path != "/v1/chat/completions":
                return self._send(404, json.dumps({"detail": "Not Found"}))
            try:
                req = json.loads(body or b"{}")
            except ValueError:
                return self._send(400, json.dumps({"object": "error", "message": "invalid JSON", "type":
                                                   "BadRequestError", "param": None, "code": 400}))
            if req.get("model") not in (served, None):
                return self._send(404, json.dumps({"object": "error", "message": f"The model `{req.get('model')}` "
                                                   "does not exist.", "type": "NotFoundError", "param": None,
                                                   "code": 404}))
            prompt = " ".join(str(m.get("content", "")) for m in req.get("messages", []))
            words = ["The", " two", " stations", " answer", " over", " the", " rail", "."]
            STATS["requests"] += 1
            STATS["prompt"] += max(1, len(prompt.split()))
            STATS["generation"] += len(words)
            STATS["prefix_q"] += max(1, len(prompt.split()))
            STATS["spec_drafts"] += 4
            STATS["spec_accepted"] += 3
            rid = f"chatcmpl-{uuidlib.uuid4().hex}"
            usage = {"prompt_tokens": max(1, len(prompt.split())), "total_tokens": max(1, len(prompt.split())) + len(words),
                     "completion_tokens": len(words), "prompt_tokens_details": None}
            if req.get("stream"):
                self.send_response(200)
                self.send_header("content-type", "text/event-stream; charset=utf-8")
                self.send_header("transfer-encoding", "chunked")
                self.end_headers()

                def chunk(obj):
                    data = f"data: {obj}\n\n".encode()
                    self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")

                base = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": served}
                chunk(json.dumps(dict(base, choices=[{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                       "logprobs": None, "finish_reason": None}])))
                for wd in words:
                    chunk(json.dumps(dict(base, choices=[{"index": 0, "delta": {"content": wd}, "logprobs": None,
                                                           "finish_reason": None}])))
                chunk(json.dumps(dict(base, choices=[{"index": 0, "delta": {"content": ""}, "logprobs": None,
                                                       "finish_reason": "stop", "stop_reason": None}])))
                chunk("[DONE]")
                self.wfile.write(b"0\r\n\r\n")
                return
            return self._send(200, json.dumps({
                "id": rid, "object": "chat.completion", "created": int(time.time()), "model": served,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(words),
                                                     "reasoning_content": None, "tool_calls": []},
                             "logprobs": None, "finish_reason": "stop", "stop_reason": None}],
                "usage": usage, "prompt_logprobs": None}))
    return Handler


def metrics(served):
    m = f'model_name="{served}"'
    out = [
        "# HELP vllm:num_requests_running Number of requests in model execution batches.",
        "# TYPE vllm:num_requests_running gauge", f"vllm:num_requests_running{{engine=\"0\",{m}}} {STATS['running']}.0",
        "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
        "# TYPE vllm:num_requests_waiting gauge", f"vllm:num_requests_waiting{{engine=\"0\",{m}}} {STATS['waiting']}.0",
        "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.",
        "# TYPE vllm:kv_cache_usage_perc gauge", f"vllm:kv_cache_usage_perc{{engine=\"0\",{m}}} {STATS['kv']}",
        "# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.",
        "# TYPE vllm:prefix_cache_queries_total counter",
        f"vllm:prefix_cache_queries_total{{engine=\"0\",{m}}} {STATS['prefix_q']}.0",
        "# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.",
        "# TYPE vllm:prefix_cache_hits_total counter",
        f"vllm:prefix_cache_hits_total{{engine=\"0\",{m}}} {STATS['prefix_h']}.0",
        "# HELP vllm:prompt_tokens_total Number of prefill tokens processed.",
        "# TYPE vllm:prompt_tokens_total counter", f"vllm:prompt_tokens_total{{engine=\"0\",{m}}} {STATS['prompt']}.0",
        "# HELP vllm:generation_tokens_total Number of generation tokens processed.",
        "# TYPE vllm:generation_tokens_total counter",
        f"vllm:generation_tokens_total{{engine=\"0\",{m}}} {STATS['generation']}.0",
        "# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.",
        "# TYPE vllm:spec_decode_num_draft_tokens_total counter",
        f"vllm:spec_decode_num_draft_tokens_total{{engine=\"0\",{m}}} {STATS['spec_drafts']}.0",
        "# HELP vllm:spec_decode_num_accepted_tokens_total Number of accepted tokens.",
        "# TYPE vllm:spec_decode_num_accepted_tokens_total counter",
        f"vllm:spec_decode_num_accepted_tokens_total{{engine=\"0\",{m}}} {STATS['spec_accepted']}.0",
    ]
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------- main

def main(argv):
    args = parse(argv)
    stop = threading.Event()

    def on_term(sig, frame):
        stop.set()
        log("Shutting down (SIGTERM)", where="launcher.py:80")
        sys.exit(0)

    signal.signal(signal.SIGTERM, on_term)
    rank = args["node-rank"]
    served = args["served-model-name"] or args["model"]
    model_dir = host_path(args["model"] or "")
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        fail(f"Invalid repository ID or local directory specified: '{args['model']}'.\nPlease verify the following "
             "requirements:\n1. Provide a valid Hugging Face repository ID.\n2. Specify a local directory that "
             "contains a recognized configuration file.\n   - For Hugging Face models: ensure the presence of a "
             "'config.json'.")
    cfg = container_config()
    gpu_check(args, cfg)
    if rank == 0:
        log(f"vLLM API server version {VERSION}", where="api_server.py:1894")
        log(f"non-default args: {{'model': '{args['model']}', 'served_model_name': ['{served}'], 'nnodes': "
            f"{args['nnodes']}, 'node_rank': 0, 'tensor_parallel_size': {args['tensor-parallel-size']}}}",
            where="utils.py:328")
        peer_sockets = []
        if args["nnodes"] > 1:
            srv, peers = head_rendezvous(args, stop)
            peer_sockets = [c for c, _, _ in peers]
            peer_ip = peers[0][1]
        else:
            peer_ip = os.environ.get("VLLM_HOST_IP", "127.0.0.1")
    else:
        sock, f = worker_rendezvous(args, stop)
        peer_ip = args["master-addr"]
    hold_gpu(rank)
    transport = nccl_log(rank, args["nnodes"], peer_ip)
    if transport:
        print(f"INFO {time.strftime('%m-%d %H:%M:%S')} [pynccl.py:70] vLLM is using nccl=={NCCL_VERSION.split('+')[0]}",
              flush=True)
    print(f"INFO {time.strftime('%m-%d %H:%M:%S')} [gpu_model_runner.py:2602] Model loading took 217.94 GiB and "
          "2.1 seconds", flush=True)
    if rank != 0:
        # a headless worker serves no API; it lives as long as the head does
        while f.readline():
            pass
        print(f"ERROR {time.strftime('%m-%d %H:%M:%S')} [multiproc_executor.py:240] The head closed the "
              "connection; shutting down", flush=True)
        sys.exit(1)
    log("Available KV cache memory: 8.21 GiB", where="gpu_worker.py:298")
    log("GPU KV cache size: 226,816 tokens", where="kv_cache_utils.py:1087")
    log(f"Maximum concurrency for {args['max-model-len']:,} tokens per request: 2.31x", where="kv_cache_utils.py:1091")
    key = os.environ.get("VLLM_API_KEY") or None
    host = args["host"] or "0.0.0.0"
    httpd = ThreadingHTTPServer((host, args["port"]), make_handler(args, served, key))
    log(f"Starting vLLM API server 0 on http://{host}:{args['port']}", where="api_server.py:1975")
    print(f"INFO:     Started server process [{os.getpid()}]", flush=True)
    print("INFO:     Waiting for application startup.", flush=True)
    print("INFO:     Application startup complete.", flush=True)

    def watch_peers():
        for c in peer_sockets:
            try:
                c.recv(1)  # returns when the worker goes away
            except OSError:
                pass
            if not stop.is_set():
                print(f"ERROR {time.strftime('%m-%d %H:%M:%S')} [multiproc_executor.py:150] A worker process died; "
                      "shutting down the engine", flush=True)
                os._exit(1)

    threading.Thread(target=watch_peers, daemon=True).start()
    httpd.serve_forever()


# ---------------------------------------------------------------- the NCCL probe's stand-in

def probe_main(argv):
    """scripts/nccl_probe.py in a lab container: the same rendezvous and output lines, with the
    bytes really sent over the lab's rail (TCP between the two network namespaces), timed."""
    sizes = "1M"
    for i, a in enumerate(argv):
        if a == "--sizes" and i + 1 < len(argv):
            sizes = argv[i + 1]
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    todo = []
    for s in sizes.split(","):
        s = s.strip().upper().rstrip("B").rstrip("I")
        todo.append(int(float(s[:-1]) * units[s[-1]]) if s and s[-1] in units else int(s))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    addr = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))

    def emit(**kw):
        print(json.dumps(dict(railyard_probe=1, rank=rank, **kw)), flush=True)

    if rank == 0:
        srv = socket.socket()
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind((os.environ.get("VLLM_HOST_IP") or "0.0.0.0", addr[1]))
        srv.listen(8)
        srv.settimeout(120)
        peers = []
        while len(peers) < world - 1:
            try:
                c, a = srv.accept()
            except socket.timeout:
                emit(error="RuntimeError: timed out waiting for the other ranks")
                sys.exit(1)
            peers.append((c, a[0]))
        nccl_log(0, world, peers[0][0].getpeername()[0] if peers else addr[0])
        chunk = b"\0" * (1 << 20)
        for size in todo:
            t0 = time.perf_counter()
            for c, _ in peers:
                c.sendall(f"{size}\n".encode())
                left = size
                while left:
                    n = min(left, len(chunk))
                    c.sendall(chunk[:n])
                    left -= n
            for c, _ in peers:
                c.recv(3)
            t = time.perf_counter() - t0
            for c, _ in peers:
                c.sendall(f"{t!r}\n".encode())
            emit(bytes=size, time_s=t, algbw_gbs=size / t / 1e9, busbw_gbs=size / t / 1e9 * 2 * (world - 1) / world)
        return
    deadline = time.time() + 120
    while True:
        try:
            s = socket.create_connection(addr, timeout=2)
            s.settimeout(None)
            break
        except OSError:
            if time.time() > deadline:
                emit(error=f"RuntimeError: could not reach the rendezvous at {addr[0]}:{addr[1]}")
                sys.exit(1)
            time.sleep(0.3)
    f = s.makefile("rb")
    nccl_log(rank, world, addr[0])
    for _ in todo:
        size = int(f.readline())
        left = size
        while left:
            got = f.read(min(left, 1 << 20))
            if not got:
                emit(error="RuntimeError: the head closed the connection")
                sys.exit(1)
            left -= len(got)
        s.sendall(b"ok\n")
        t = float(f.readline())
        emit(bytes=size, time_s=t, algbw_gbs=size / t / 1e9, busbw_gbs=size / t / 1e9 * 2 * (world - 1) / world)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--railyard-probe"]:
        probe_main(sys.argv[2:])
    else:
        main(sys.argv[1:])
