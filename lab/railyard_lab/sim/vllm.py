#!/usr/bin/python3 -SI
"""Stand-in for `vllm serve`, in a lab container or on a lab host itself: real sockets, real
processes and ordering, vLLM's formats.

- it sees the GPUs it was given: a container's (`docker run --gpus`), narrowed by
  CUDA_VISIBLE_DEVICES; on a host, CUDA_VISIBLE_DEVICES or every GPU;
- it honours the parallel layout (`-tp`, `-pp`, `-dp`, `--enable-expert-parallel`, ...): it refuses
  a layout larger than its GPUs as vLLM does, starts one engine core process per DP rank and one
  worker process per GPU, each holding that GPU's memory (nvidia-smi shows them by vLLM's
  process names), prints each engine's KV cache size computed from its GPU's memory, the memory
  utilization and the weights, and labels every /metrics series with its engine;
- rank >= 1 (`--headless`) connects to MASTER_ADDR:--master-port over the lab network and
  waits for the head; rank 0 listens there and is ready only once every worker joined;
- then each rank writes an NCCL-format log to $NCCL_DEBUG_FILE whose transport follows the
  container: GDRDMA over the rail only when NCCL_IB_HCA is the HCA holding VLLM_HOST_IP,
  NCCL_IB_GID_INDEX is that address's RoCE v2 index, /dev/infiniband was passed, IPC_LOCK
  was added and memlock is unlimited; otherwise the lines real NCCL prints instead;
- the head prints vLLM's startup lines and serves /health, /v1/models, /v1/chat/completions
  (also streaming) and /metrics, with the API key from $VLLM_API_KEY;
- it fails as vLLM does when a GPU is busy or the model directory is not a model, and stops
  cleanly (its GPUs released) on SIGTERM or SIGINT;
- as `nccl_probe.py` (the image's python3 hands it over) it follows the probe's contract: over the
  rail between hosts, or with `--local-ranks N` as N ranks of one host on the container's GPUs,
  printing NCCL's intra-node lines (P2P/CUMEM/read and NVLS on an hgx8 host; SHM/direct when
  NCCL_P2P_DISABLE=1; NET/Socket when shared memory is off too) and modeled NVLink bus bandwidths.
Standard library only.
"""

import json
import mmap
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
SIM_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))  # LAB/sim
STAT_KEYS = ("running", "waiting", "prompt", "generation", "requests", "kv", "prefix_q", "prefix_h", "spec_drafts",
             "spec_accepted", "ext_q", "ext_h", "prefilling")
STATS = [dict.fromkeys(STAT_KEYS, 0)]  # one per engine (DP rank)
STATS[0]["kv"] = 0.0
CHILDREN = []  # engine core and worker processes this process started
# engine-stall (lab/railyard_lab/faults.py): one byte per child above, in its order, set by the child when it
# stops joining its engine's collectives (its main thread parked in lab_fault_engine_stall, the process in
# state S); the same signals as the real engine's sitecustomize (sim/engine_site.py)
STALL_SIGNAL = signal.SIGUSR2
RELEASE_SIGNAL = signal.SIGCONT
STALLED = mmap.mmap(-1, 4096)   # anonymous and shared: the children write it after the fork
SLOT_OF = {}                    # child pid -> its byte
ENGINES = []                    # this node's engines (their core's and workers' pids), by DP rank order
REMOTE_STALLED = threading.Event()  # a rank of this node's TP group on another node stalled (multinode)


def log(msg, level="INFO", where="api_server.py:1", who="APIServer", pid=None):
    stamp = time.strftime("%m-%d %H:%M:%S")
    print(f"({who} pid={pid or os.getpid()}) {level} {stamp} [{where}] {msg}", flush=True)


def fail(msg, exc="ValueError", prefix=""):
    for line in ("Traceback (most recent call last):", '  File "/usr/local/bin/vllm", line 10, in <module>',
                 f"{exc}: {msg}"):
        print(prefix + line, flush=True)
    stop_children()
    sys.exit(1)


def fail_in(who, pid, msg, exc="ValueError", where="core.py:866"):
    """An engine core process failing, as vLLM prints it (every line with that process's prefix)."""
    stamp = time.strftime("%m-%d %H:%M:%S")
    p = f"({who} pid={pid}) "
    for line in ("EngineCore failed to start.", "Traceback (most recent call last):",
                 '  File "/usr/local/lib/python3.12/dist-packages/vllm/v1/engine/core.py", line 857, in '
                 "run_engine_core", f"{exc}: {msg}"):
        print(f"{p}ERROR {stamp} [{where}] {line}", flush=True)
    print(f"{p}Process {who}:", flush=True)
    print(f"{p}Traceback (most recent call last):", flush=True)
    print(f"{p}{exc}: {msg}", flush=True)
    stop_children()
    print("RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): "
          f"{{'{who}': 1}}", flush=True)
    sys.exit(1)


# vllm serve's short options and their long names (vllm/engine/arg_utils.py)
ALIASES = {"tp": "tensor-parallel-size", "pp": "pipeline-parallel-size", "dp": "data-parallel-size",
           "ep": "enable-expert-parallel", "dpl": "data-parallel-size-local", "q": "quantization"}
# flags that take no value: never eat the next word
SWITCHES = {"headless", "enable-expert-parallel", "async-scheduling", "no-async-scheduling", "trust-remote-code",
            "enable-prefix-caching", "no-enable-prefix-caching", "enable-prompt-tokens-details",
            "enable-auto-tool-choice", "disable-custom-all-reduce", "enforce-eager", "enable-eplb", "enable-dbo",
            "disable-log-requests", "disable-log-stats", "enable-log-requests", "enable-chunked-prefill",
            "no-enable-chunked-prefill", "enable-elastic-ep", "enable-sleep-mode"}
INTS = ("port", "nnodes", "node-rank", "master-port", "max-model-len", "tensor-parallel-size",
        "data-parallel-size-local", "data-parallel-start-rank", "data-parallel-rpc-port",
        "pipeline-parallel-size", "data-parallel-size", "api-server-count", "max-num-batched-tokens", "block-size",
        "max-num-seqs", "distributed-timeout-seconds")
DEFAULTS = {"model": None, "port": 8000, "host": None, "nnodes": 1, "node-rank": 0, "master-addr": "127.0.0.1",
            "master-port": 29501, "headless": False, "served-model-name": None, "max-model-len": 98304,
            "gpu-memory-utilization": 0.9, "tensor-parallel-size": 1, "pipeline-parallel-size": 1,
            "data-parallel-size": 1, "data-parallel-size-local": None, "data-parallel-start-rank": 0,
            "data-parallel-address": None, "data-parallel-rpc-port": 29550,
            "enable-expert-parallel": False, "all2all-backend": None,
            "api-server-count": 1, "async-scheduling": False, "kv-cache-dtype": "auto",
            "max-num-batched-tokens": 8192, "block-size": 16, "max-num-seqs": 256,
            "distributed-timeout-seconds": 1800}


def parse(argv):
    """`vllm serve MODEL --flag value --flag=value -tp 8 --switch`, underscores or dashes."""
    args = dict(DEFAULTS)
    given = []
    if argv[:1] == ["serve"]:
        argv = argv[1:]
    i = 0
    while i < len(argv):
        a = argv[i]
        if a.startswith("-") and len(a) > 1 and not a[1:2].isdigit():
            key = a.lstrip("-")
            val = None
            if "=" in key:
                key, val = key.split("=", 1)
            key = ALIASES.get(key, key).replace("_", "-")
            if val is None:
                nxt = argv[i + 1] if i + 1 < len(argv) else None
                if key not in SWITCHES and nxt is not None and (not nxt.startswith("-") or nxt[1:2].isdigit()):
                    val = nxt
                    i += 1
                else:
                    val = True
            args[key] = val
            given.append(key)
        elif args["model"] is None:
            args["model"] = a
        i += 1
    for k in INTS:
        if args[k] is None:  # not given, and vLLM's default is None (--data-parallel-size-local)
            continue
        try:
            args[k] = int(args[k])
        except (TypeError, ValueError):
            short = next((s for s, long_ in ALIASES.items() if long_ == k), None)
            print(f"vllm serve: error: argument --{k}{'/-' + short if short else ''}: invalid int value: "
                  f"'{args[k]}'", file=sys.stderr)
            sys.exit(2)
    args["gpu-memory-utilization"] = float(args["gpu-memory-utilization"])
    args["_given"] = given
    return args


def host_path(path):
    """A path inside the container -> where it is on the host (binds from config.json, /tmp private)."""
    if not CONTAINER:
        return path  # on the host itself
    with open(os.path.join(CONTAINER, "config.json")) as f:
        binds = json.load(f)["HostConfig"]["Binds"]
    for b in binds:
        parts = b.split(":")
        src, dst = parts[0], parts[1]
        if path == dst or path.startswith(dst.rstrip("/") + "/"):
            return src + path[len(dst.rstrip("/")):]
    return path  # the container's own files (/tmp is private to it)


def container_config():
    if not CONTAINER:  # on the host itself: root, the host's own devices
        return {"HostConfig": {"CapAdd": ["IPC_LOCK"], "DeviceRequests": None, "Binds": []}}
    with open(os.path.join(CONTAINER, "config.json")) as f:
        return json.load(f)


# ---------------------------------------------------------------- GPUs

_TOOLS = []


def tools():
    """The lab's simulated tools (nvidia-smi's view of this host's GPUs and who holds them)."""
    if not _TOOLS:
        import importlib.util
        spec = importlib.util.spec_from_file_location("railyard_lab_tools", os.path.join(SIM_DIR, "tools.py"))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        _TOOLS.append(mod)
    return _TOOLS[0]


def visible_gpus():
    """The GPUs this process's CUDA sees, in order: the container's (or the host's), narrowed by
    CUDA_VISIBLE_DEVICES (indices or UUIDs; CUDA stops at the first entry that names no GPU)."""
    gpus = tools()._gpus()
    if CONTAINER:
        try:
            with open(os.path.join(CONTAINER, "gpus.json")) as f:
                given = json.load(f)
        except (OSError, ValueError):
            given = []
        gpus = [g for u in given for g in gpus if g["uuid"] == u]
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    if cvd is None:
        return gpus
    out = []
    for tok in [t.strip() for t in cvd.split(",") if t.strip()]:
        g = gpus[int(tok)] if tok.isdigit() and int(tok) < len(gpus) else \
            next((g for g in gpus if tok.startswith("GPU-") and g["uuid"].startswith(tok)), None)
        if g is None or g in out:
            break
        out.append(g)
    return out


def worker_name(dp, dp_rank, pp, pp_rank, tp, tp_rank, ep):
    """vLLM's worker process title (vllm/v1/executor/multiproc_executor.py,
    setup_proc_title_and_log_prefix): Worker[_DPd][_PPp][_TPt][_EPe]."""
    name = "Worker"
    if dp > 1:
        name += f"_DP{dp_rank}"
    if pp > 1:
        name += f"_PP{pp_rank}"
    if tp > 1:
        name += f"_TP{tp_rank}"
    if ep:
        name += f"_EP{dp_rank * tp + tp_rank}"
    return name


def check_world(args, gpus):
    """vLLM refuses a layout larger than the GPUs it sees. Messages: vllm/config/parallel.py
    (ParallelConfig.__post_init__, raised inside pydantic's validation, hence the ValidationError) and
    vllm/v1/engine/utils.py (get_device_indices, one DP rank's slice of the devices)."""
    tp, pp, dp = args["tensor-parallel-size"], args["pipeline-parallel-size"], args["data-parallel-size"]
    if args["data-parallel-size-local"] is not None:
        dp = args["data-parallel-size-local"]
    world = tp * pp
    if args["nnodes"] == 1 and world * dp > 1 and len(gpus) < world:
        pre = f"(APIServer pid={os.getpid()}) "
        inp = (f"ArgsKwargs((), {{'pipeline_parallel_size': {pp}, 'tensor_parallel_size': {tp}, "
               f"'data_parallel_size': {dp}, 'nnodes': 1, 'node_rank': 0}})")
        for line in ("Traceback (most recent call last):", '  File "/usr/local/bin/vllm", line 10, in <module>',
                     "    sys.exit(main())",
                     "pydantic_core._pydantic_core.ValidationError: 1 validation error for ParallelConfig",
                     f"  Value error, World size ({world}) is larger than the number of available GPUs "
                     f"({len(gpus)}) in this node. If this is intentional and you are using:",
                     "- ray, set '--distributed-executor-backend ray'.",
                     f"- multiprocessing, set '--nnodes' appropriately. [type=value_error, input_value={inp}, "
                     "input_type=ArgsKwargs]",
                     "    For further information visit https://errors.pydantic.dev/2.12/v/value_error"):
            print(pre + line, flush=True)
        sys.exit(1)
    if args["nnodes"] == 1 and dp > 1 and len(gpus) < world * dp:
        # vLLM raises this when CUDA_VISIBLE_DEVICES lists too few devices for the DP ranks; without it (a
        # container) the rank's engine core fails in CUDA itself a little later: the lab says it this one way
        rank = len(gpus) // world  # the first DP rank whose devices are not there
        base = os.environ.get("CUDA_VISIBLE_DEVICES")
        fail(f"Error setting CUDA_VISIBLE_DEVICES: local range: [{rank * world}, {(rank + 1) * world}) "
             f'base value: "{base}"', "Exception", f"(APIServer pid={os.getpid()}) ")


def free_check(args, engines):
    """vLLM refuses to start when another process holds a GPU's memory (vllm/v1/worker/gpu_worker.py,
    init_device); `cuda:N` is the device as that worker's process numbers it."""
    util = args["gpu-memory-utilization"]
    for e in engines:
        for local, g in enumerate(e["gpus"]):
            total_gib = g["total"] / 1024
            free = total_gib - g["used"] / 1024
            if free < util * total_gib:
                msg = (f"Free memory on device cuda:{local} ({free:.2f}/{total_gib:.2f} GiB) on startup is less "
                       f"than desired GPU memory utilization ({util}, {util * total_gib:.2f} GiB). Decrease GPU "
                       "memory utilization or reduce GPU memory used by other processes.")
                if e["dp_size"] > 1:
                    fail_in(e["name"], e["pid"] or os.getpid(), msg)
                fail(msg)


def _pdeathsig():
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def spawn(name, gpu=None, mib=0):
    """A child process titled VLLM::<name> (vLLM's set_process_title), holding `mib` MiB on `gpu` while
    it lives; it ends with its parent or on SIGTERM, releasing the GPU."""
    parent = os.getpid()
    slot = len(CHILDREN)
    STALLED[slot] = 0
    r, w = os.pipe()
    pid = os.fork()
    if pid:
        os.close(w)
        os.read(r, 1)  # until it holds its GPU
        os.close(r)
        CHILDREN.append(pid)
        SLOT_OF[pid] = slot
        return pid
    os.close(r)
    _pdeathsig()
    me = os.getpid()
    for fd in os.listdir("/proc/self/fd"):  # the parent's sockets are not the worker's
        if int(fd) > 2 and int(fd) != w:
            try:
                os.close(int(fd))
            except OSError:
                pass

    def bye(*_):
        if gpu:
            tools().release(me)
        os._exit(0)

    signal.signal(signal.SIGTERM, bye)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # ^C goes to the whole group: the parent stops us
    stall = {"on": False}

    def lab_fault_engine_stall(*_):
        """lab.fault engine-stall: this rank stops joining its engine's collectives; its main thread sleeps
        here until the fault is healed, the process runnable (state S), as in the real engine's processes."""
        if stall["on"]:
            return
        stall["on"] = True
        STALLED[slot] = 1
        while stall["on"]:
            time.sleep(0.5)
        STALLED[slot] = 0

    def release(*_):
        stall["on"] = False

    signal.signal(STALL_SIGNAL, lab_fault_engine_stall)
    signal.signal(RELEASE_SIGNAL, release)
    try:
        with open("/proc/self/comm", "w") as f:
            f.write(f"VLLM::{name}"[:15])
    except OSError:
        pass
    if gpu:
        tools().hold(me, f"VLLM::{name}", mib, gpu["uuid"])
    os.write(w, b"x")
    os.close(w)
    while os.getppid() == parent:
        time.sleep(0.5)
    bye()


def engine_stopped():
    """Whether an engine core or worker this process started is stopped (SIGSTOP, state T): vLLM's API
    server still answers /health and /metrics then, and a request waits in its queue."""
    for pid in CHILDREN:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rpartition(") ")[2][:1] in ("T", "t"):
                    return True
        except OSError:
            pass
    return False


def rank_stalled(dp):
    """Whether DP rank dp's engine waits on a stalled rank (engine-stall): its core or one of its workers on
    this node, or, for a TP group across nodes, a worker on another node (REMOTE_STALLED)."""
    if REMOTE_STALLED.is_set():
        return True
    for e in ENGINES:
        if e["dp_rank"] == dp:
            pids = [e["pid"]] + [p for _, p in e["workers"]]
            return any(STALLED[SLOT_OF[p]] for p in pids if p in SLOT_OF)
    return False


# vLLM's reader-side wait line (vllm/distributed/device_communicators/shm_broadcast.py, LONG_WAIT_TIME_LOG_MSG,
# logged at INFO from acquire_read, line 871 in 0.32): the engine core waiting on its workers' answer to a step,
# every VLLM_RINGBUFFER_WARNING_INTERVAL seconds (60) of that wait. Seen on the real engine in the lab with
# engine-stall (B's Worker_TP1 parked, one request sent): `(EngineCore pid=N) INFO ... [shm_broadcast.py:871]`
# 60 s after the request.
LONG_WAIT = ("No available shared memory broadcast block found in {} seconds. This typically happens when some "
             "processes are hanging or doing some time-consuming work (e.g. compilation, weight/kv cache "
             "quantization).")
STEP_WAIT = {}      # DP rank -> [when its engine's stuck step began, warnings logged]
FROZEN = {}         # DP rank -> its engine's last published stats, while the engine is stuck
STALL_LOCK = threading.Lock()


def _stuck_core(dp):
    """The engine core of DP rank dp that waits on its workers (a core that is itself parked logs nothing)."""
    for e in ENGINES:
        if e["dp_rank"] == dp and e["workers"] and e["pid"] and not STALLED[SLOT_OF.get(e["pid"], 4095)]:
            return e
    return None


def wait_unstalled(dp):
    """A step of DP rank dp's engine: it waits, without end, for a stalled rank of its group; the request stays
    where it was and no token is counted meanwhile (vLLM: the peers sit in the collective, the core in its wait)."""
    if not rank_stalled(dp):
        return
    try:
        interval = int(os.environ.get("VLLM_RINGBUFFER_WARNING_INTERVAL", "60"))
    except ValueError:
        interval = 60
    with STALL_LOCK:
        wait = STEP_WAIT.setdefault(dp, [time.monotonic(), 1])
    while rank_stalled(dp):
        time.sleep(0.2)
        with STALL_LOCK:
            if time.monotonic() - wait[0] >= interval * wait[1] and STEP_WAIT.get(dp) is wait:
                wait[1] += 1
                e = _stuck_core(dp)
                if e:
                    log(LONG_WAIT.format(interval), where="shm_broadcast.py:871", who=e["name"], pid=e["pid"])
    with STALL_LOCK:
        if STEP_WAIT.get(dp) is wait:
            del STEP_WAIT[dp]


def watch_stalls(stop):
    """The API's view of a stuck engine: vLLM publishes its scheduler's stats (requests running and waiting)
    after each step, so while a step waits on a stalled rank /metrics keeps the last ones (a request sent to an
    idle engine then shows as neither running nor waiting, as on the real engine in the lab)."""
    while not stop.is_set():
        for dp, st in enumerate(STATS):
            if rank_stalled(dp):
                FROZEN.setdefault(dp, dict(st))
            else:
                FROZEN.pop(dp, None)
        stop.wait(0.1)


def watch_own_stall(sock, stop):
    """A headless node of a TP group across nodes: while one of its workers is stalled, the head's engine waits
    on it (one byte over the rendezvous connection: S when one stalls, R when none is any more)."""
    was = False
    while not stop.is_set():
        now = any(STALLED[SLOT_OF[p]] for p in CHILDREN if p in SLOT_OF)
        if now != was:
            try:
                sock.sendall(b"S" if now else b"R")
            except OSError:
                return
            was = now
        stop.wait(0.5)


def stop_children():
    for pid in CHILDREN:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    for pid in CHILDREN:
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass
    CHILDREN.clear()


def weights_gib(model_dir):
    """The checkpoint's weights: the index's total_size (or the shards' bytes), in GiB."""
    try:
        with open(os.path.join(model_dir, "model.safetensors.index.json")) as f:
            return json.load(f)["metadata"]["total_size"] / 2 ** 30
    except (OSError, ValueError, KeyError, TypeError):
        return sum(os.path.getsize(os.path.join(model_dir, n)) for n in os.listdir(model_dir)
                   if n.endswith(".safetensors")) / 2 ** 30


def kv_bytes_per_token(args, model_dir):
    """KV cache bytes per token on one GPU: GLM-5.3's MLA cache (78 layers x 576 values, not split by
    TP) unless config.json says otherwise; one byte per value with an fp8 KV cache, else two."""
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        cfg = {}
    layers = cfg.get("kv_layers") or 78
    width = (cfg.get("kv_lora_rank") or 512) + (cfg.get("qk_rope_head_dim") or 64)
    dtype = 1 if str(args["kv-cache-dtype"]).startswith("fp8") else 2
    return layers * width * dtype


def kv_cache(args, e, weights, per_token):
    """(available GiB, tokens) of one engine: its GPUs' memory x utilization, less the weights, the
    activation peak and non-torch memory, which differ a little from rank to rank as on real GPUs."""
    g = e["gpus"][0]
    total_gib = g["total"] / 1024
    jitter = ((e["dp_rank"] * 7 + len(socket.gethostname())) % 5) * 0.0137
    avail = total_gib * args["gpu-memory-utilization"] - weights - 1.37 - 0.61 - jitter
    block = args["block-size"]
    blocks = int(avail * 2 ** 30 // (per_token * block))
    return avail, blocks * block


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


# Every line below is in the form a real capture shows (tests/fixtures/real/nccl: ORIGINS.md and
# public/ORIGINS.md). NCCL 2.28+ prints `[date time] ` before every WARN and the file:line it comes
# from; Init COMPLETE comes before the channel lines; integer parameters end with a dot.
NCCL_LINES = {  # what each failure adds, with the capture it comes from
    # public/nccl2.30.4-2node-roce_ib-completion-retry-exc-err-12-vendor-err-129-hca_cqe-error...:
    # the 2.30 form of a completion that ran out of retries (the peer never answered: a wrong GID
    # index, NVIDIA/nccl#426; rails that do not reach each other, #2397)
    "cqe": "transport/net_ib/p2p.cc:783 NCCL WARN NET/IB: ncclIbTest: Got CQE with error (devIndex=0, req=0x7f3a1c0b2e40, "
           "comm=0x7f3a1c004d80 ({side}), wr_id=0, qp_num={qp})",
    "retry": "transport/net_ib/p2p.cc:648 NCCL WARN NET/IB: Got completion from peer {peer}<43210> with "
             "status=IBV_WC_RETRY_EXC_ERR(12) opcode={opcode} vendor_err=129 localGid ::ffff:{ip} remoteGids::ffff:{peer} "
             "hca {hca}",
    # public/nccl-tests-memlock-8192k_ibv-reg-mr-iova2-cannot-allocate-memory...: memlock too small
    # for RDMA registration (nccl-tests#206; `ulimit -l` was 8192); the job fails, no socket fallback
    "memlock": "misc/ibvwrap.cc:278 NCCL WARN Call to ibv_reg_mr_iova2 failed with error Cannot allocate memory",
}


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
    setting = os.environ.get("NCCL_IB_HCA", "")
    gid = os.environ.get("NCCL_IB_GID_INDEX", "")
    netdev = _rail_of(ip)
    hcas = tools().shape()["hcas"]  # this host's rails: RDMA device -> netdev
    # NCCL's matching: `=name` exactly, a bare name as a prefix of the device names (the first one here)
    first = setting.lstrip("=").split(",")[0].split(":")[0]
    hca = first if setting.startswith("=") else next((d for d in sorted(hcas) if first and d.startswith(first)), first)
    has_dev = os.path.exists("/dev/infiniband/uverbs0")  # the container's own /dev
    ipc_lock = "IPC_LOCK" in cfg["HostConfig"]["CapAdd"]
    memlock = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0] == resource.RLIM_INFINITY
    want_gid = _v2_index(hca, ip) if hca in hcas else None
    p = f"{hostname}:{pid}:{pid} [0] NCCL INFO "

    def warn(text):
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        return f"[{stamp}] {hostname}:{pid}:{pid + 7} [0] {text}"

    lines = [p + "cudaDriverVersion 13000", p + f"NCCL_SOCKET_IFNAME set by environment to {iface}",
             p + f"Bootstrap: Using {iface}:{ip}<0>", p + f"NCCL version {NCCL_VERSION}",
             p + "NET/Plugin: Could not find: libnccl-net.so"]
    ib = has_dev and hcas.get(hca) is not None and hcas.get(hca) == netdev
    if setting:
        lines.append(p + f"NCCL_IB_HCA set to {setting}")
    if ib:
        lines.append(p + f"NCCL_IB_GID_INDEX set by environment to {gid}.")
        lines.append(p + f"NET/IB : Using [0]{hca}:1/RoCE [RO]; OOB {iface}:{ip}<0>")
        lines += [p + "Initialized NET plugin IB", p + "Using network IB",
                  p + f"NET/IB : GPU Direct RDMA Enabled for HCA 0 '{hca}'"]
    else:  # h200-two-hosts-one-gpu_lo_socket_nccl2.28.9_r1.log: no usable HCA, sockets
        lines += [p + "NET/IB : No device found.", p + f"NET/IB : Using [RO]; OOB {iface}:{ip}<0>",
                  p + "Failed to initialize NET plugin IB", p + f"NET/Socket : Using [0]{iface}:{ip}<0>",
                  p + "Initialized NET plugin Socket", p + "Using network Socket",
                  p + f"NET/Socket : GPU Direct RDMA Disabled for HCA 0 '{iface}'"]
    lines.append(p + f"ncclCommInitRankConfig comm 0x55d0c0de rank {rank} nranks {nranks} cudaDev 0 nvmlDev 0 "
                     "busId 8060000 commId 0x1f2e3d4c5b6a7988 - Init START")
    lines.append(p + f"comm 0x55d0c0de rank {rank} nRanks {nranks} nNodes {nranks} localRanks 1 localRank 0 MNNVL 0")
    lines.append(p + f"ncclCommInitRankConfig comm 0x55d0c0de rank {rank} nranks {nranks} cudaDev 0 nvmlDev 0 "
                     "busId 8060000 commId 0x1f2e3d4c5b6a7988 - Init COMPLETE")
    if ib and not (ipc_lock and memlock):  # registration fails while the channels connect; the job fails
        lines.append(warn(NCCL_LINES["memlock"]))
    else:
        via = "NET/IB/0/GDRDMA" if ib else "NET/Socket/0"
        other = 1 - rank if nranks == 2 else (rank + 1) % nranks
        for ch in range(2):
            lines.append(p + f"Channel {ch:02d}/0 : {other}[0] -> {rank}[0] [receive] via {via}")
            lines.append(p + f"Channel {ch:02d}/0 : {rank}[0] -> {other}[0] [send] via {via}")
        lines.append(p + f"Connected all rings, use ring PXN 0 GDR {1 if ib else 0}")
        if ib and gid != want_gid:  # the peer is addressed at another GID and never answers: retries run out
            for side, opcode, qp in (("send", "IBV_WC_RDMA_WRITE(1)", 21535), ("recv", "IBV_WC_RECV_RDMA_WITH_IMM(129)",
                                                                              21536)):
                lines.append(warn(NCCL_LINES["cqe"].format(side=side, qp=qp)))
                lines.append(warn(NCCL_LINES["retry"].format(peer=peer_ip, opcode=opcode, ip=ip, hca=hca)))
    transport = "IB" if ib else "Socket"
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
        log(f"Node {addr[0]} joined ({line}); {len(peers)}/{n}", where="multiproc_executor.py:131")
    for conn, _, _ in peers:
        conn.sendall(b"GO\n")
    return srv, peers


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
    s.sendall(f"rank {args['node-rank']}\n".encode())
    f = s.makefile()
    go = f.readline().strip()
    if not go.startswith("GO"):
        fail("The head closed the connection during rendezvous", "RuntimeError")
    return s, f



# ---------------------------------------------------------------- prefix caching and LMCache

PREFILL_US_ENV = "RAILYARD_LAB_PREFILL_US_PER_TOKEN"  # the modeled prefill cost of one uncached prompt token
PREFILL_US_DEFAULT = 60.0  # 20,000 cold tokens: 1.2 s
SEEDED_KEYS_ENV = "RAILYARD_LAB_LMCACHE_SEEDED_KEYS"  # 1: LMCache keys also depend on PYTHONHASHSEED (see below)
LOCAL_BLOCKS = set()  # vLLM's own prefix cache: the block hashes this replica has computed
_NONE_HASH = []


def none_hash():
    """vLLM's root block hash (v1/core/kv_cache_utils.py, init_none_hash): random 32 bytes when
    PYTHONHASHSEED is unset, otherwise derived from its value."""
    if not _NONE_HASH:
        import hashlib
        seed = os.environ.get("PYTHONHASHSEED")
        if seed is None:
            log("PYTHONHASHSEED is not set. This will lead to non-reproducible block-hashes when using sha256_cbor "
                "as the hash function. Consider setting PYTHONHASHSEED to a fixed value for reproducibility.",
                "WARNING", where="kv_cache_utils.py:92", who="EngineCore")
            _NONE_HASH.append(os.urandom(32))
        else:
            _NONE_HASH.append(hashlib.sha256(seed.encode()).digest())
    return _NONE_HASH[0]


VOCAB = {}  # the checkpoint's tokenizer.json vocabulary (the lab's word-level tokenizer), when it has one


def load_vocab(model_dir):
    """The word-level vocabulary of the checkpoint's tokenizer.json (lab/railyard_lab/tokenizer), which
    AIPerf loads too: one token per whitespace-separated word, so both count the same tokens."""
    try:
        with open(os.path.join(model_dir, "tokenizer.json")) as f:
            model = json.load(f).get("model") or {}
    except (OSError, ValueError):
        return
    if model.get("type") == "WordLevel":
        VOCAB.update(model.get("vocab") or {})


def token_ids(text):
    """The stand-in's tokenizer: one token per word; its id from the checkpoint's vocabulary, else (and
    for words outside it, which that tokenizer maps to UNK) a stable hash of the word."""
    import hashlib
    return [VOCAB.get(w) or int.from_bytes(hashlib.blake2b(w.encode(), digest_size=4).digest(), "big") % 151552
            for w in text.split()] or [0]


def block_hashes(ids, block):
    """Chained hashes of the prompt's full blocks, rooted at none_hash() (vLLM's hash_block_tokens)."""
    import hashlib
    out, parent = [], none_hash()
    for i in range(0, len(ids) - len(ids) % block, block):
        parent = hashlib.sha256(parent + b"".join(t.to_bytes(4, "big") for t in ids[i:i + block])).digest()
        out.append(parent)
    return out


def _listener_pid(port):
    """The process listening on TCP `port` in this network namespace (the LMCache server), or None."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                for line in f.readlines()[1:]:
                    p = line.split()
                    if p[3] == "0A" and int(p[1].rsplit(":", 1)[1], 16) == port:
                        inodes.add(p[9])
        except OSError:
            continue
    want = {f"socket:[{i}]" for i in inodes}
    for pid in (d for d in os.listdir("/proc") if d.isdigit()):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                if os.readlink(f"/proc/{pid}/fd/{fd}") in want:
                    return int(pid)
        except OSError:
            continue
    return None


def _container_log_of(pid):
    """The lab container a process runs in (its RAILYARD_LAB_CONTAINER), as that container's log file."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(e.split(b"=", 1) for e in f.read().split(b"\0") if b"=" in e)
    except OSError:
        return None
    d = env.get(b"RAILYARD_LAB_CONTAINER")
    return os.path.join(d.decode(), "log") if d else None


class LMCacheConnector:
    """vLLM's LMCacheMPConnector as far as the lab needs it: the real LMCache client library (in the
    lab engine venv, lmcache_client.py) registers this replica's KV caches, one instance per worker, and
    looks up, retrieves and stores each request's prompt through the real server."""

    def __init__(self):
        self.proc = None
        self.lock = threading.Lock()
        self.ipc = []  # the hold records made for the server (tools.hold_ipc), removed on a clean stop
        self.chunk = 256

    def start(self, cfg, args, engines, served, avail):
        extra = cfg.get("kv_connector_extra_config") or {}
        host = str(extra.get("lmcache.mp.host", "tcp://localhost"))
        port = int(extra.get("lmcache.mp.port", 5555))
        timeout = float(extra.get("lmcache.mp.mq_timeout", 300))
        beat = float(extra.get("lmcache.mp.heartbeat_interval", 10))
        url = f"{host}:{port}"
        e = engines[0]
        workers = e["workers"]
        tp, pp = args["tensor-parallel-size"], args["pipeline-parallel-size"]
        log(f"Resolved LMCache MP geometry: group_tokens_per_block={args['block-size']}, "
            f"scheduler_block_size={args['block-size']}, cache_model_name={served}",
            where="lmcache_mp_connector.py:667", who="EngineCore", pid=e["pid"])
        for name, pid in workers:
            print(f"({name} pid={pid}) [{time.strftime('%Y-%m-%d %H:%M:%S')}] LMCache INFO: Registering kv caches! "
                  "(lmcache_mp_connector.py:867:lmcache.integration.vllm.lmcache_mp_connector)", flush=True)
        with open(os.path.join(SIM_DIR, "lab.json")) as f:
            python = json.load(f)["lmcache_python"]
        salt = block_hashes([0], 1)[0].hex()[:32] if os.environ.get(SEEDED_KEYS_ENV) == "1" else ""
        env = {"PATH": "/usr/bin:/bin", "LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1",
               "LMCACHE_DISABLE_BANNER": "1", "HOME": "/tmp"}
        err = open("/tmp/lmcache-connector.log", "ab")  # the container's own /tmp
        self.proc = subprocess.Popen(
            [python, "-I", os.path.join(SIM_DIR, "image", "lib", "lmcache_client.py"), "--url", url,
             "--ranks", str(len(workers)), "--world-size", str(tp * pp), "--model", served, "--mq-timeout",
             str(timeout), "--heartbeat", str(beat), "--block-size", str(args["block-size"]), "--salt", salt],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True, env=env, preexec_fn=_pdeathsig)
        first = self.proc.stdout.readline()
        try:
            hello = json.loads(first)
        except ValueError:
            hello = {"error": f"LMCache server did not respond to register_kv_caches within {timeout}s. "
                              "Is the server running?"}
        if "error" in hello:
            self.proc.kill()
            self.proc = None
            fail_in(e["name"], e["pid"] or os.getpid(), hello["error"], "ConnectionError")
        self.chunk = hello["chunk"]
        for (name, pid), iid in zip(workers, hello["registered"]):
            print(f"({name} pid={pid}) [{time.strftime('%Y-%m-%d %H:%M:%S')}] LMCache INFO: LMCache MP worker "
                  f"adapter created with instance_id={iid} (vllm_multi_process_adapter.py:1415:"
                  "lmcache.integration.vllm.vllm_multi_process_adapter)", flush=True)
        # On real GPUs the server maps each worker's KV cache through CUDA IPC: when the worker dies
        # without unregistering, the server keeps that memory until it lets go of the instance.
        server = _listener_pid(port) if host.split("://")[-1] in ("127.0.0.1", "localhost", "0.0.0.0") or \
            host.split("://")[-1] == os.environ.get("VLLM_HOST_IP") else None
        if server:
            logf = _container_log_of(server)
            mib = int(avail[0] * 1024)
            for (name, pid), g, iid in zip(workers, e["gpus"], hello["registered"]):
                self.ipc.append(tools().hold_ipc(server, mib, g["uuid"], pid, iid, logf))

    def _call(self, **req):
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise ConnectionError("the LMCache connector process went away")
        return json.loads(line)

    def request(self, rid, ids, computed, st):
        """Before the prefill: the tokens LMCache has beyond the `computed` ones, loaded. Returns
        (tokens now computed, tokens LMCache had)."""
        if self.proc is None:
            return computed, 0
        st["ext_q"] += len(ids)
        hit = self._call(op="lookup", id=rid, tokens=ids)
        if "error" in hit:
            log(f"LMCache lookup failed: {hit['error']}", "WARNING", where="lmcache_mp_connector.py:1300",
                who="EngineCore")
            return computed, 0
        got = min(hit["hit"], len(ids) - 1)  # a full hit still computes the last token
        if got <= computed:
            return computed, hit["hit"]
        r = self._call(op="retrieve", id=rid, tokens=ids, n=hit["hit"])
        if not r.get("ok"):
            return computed, 0
        st["ext_h"] += got - computed
        return got, hit["hit"]

    def after(self, rid, ids, had):
        """After the prefill: store what LMCache did not have (`had` tokens it had), end the session."""
        if self.proc is None:
            return
        self._call(op="store", id=rid, tokens=ids, start=had)
        self._call(op="end", id=rid)

    def close(self):
        if self.proc is None:
            return
        try:
            self.proc.stdin.write(json.dumps({"op": "close"}) + "\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
        for path in self.ipc:
            try:
                os.unlink(path)
            except OSError:
                pass
        self.proc = None


LMCACHE = LMCacheConnector()


def kv_transfer(args, engines, served, avail):
    """--kv-transfer-config: LMCacheMPConnector registers with the LMCache server (after the KV cache
    is sized, as in vLLM); any other connector is accepted and does nothing here."""
    raw = args.get("kv-transfer-config")
    if not raw or raw is True:
        return
    try:
        cfg = json.loads(raw)
    except ValueError as e:
        print(f"vllm serve: error: argument --kv-transfer-config: Value {raw} cannot be converted to "
              f"<class 'vllm.config.kv_transfer.KVTransferConfig'>: {e}", file=sys.stderr, flush=True)
        stop_children()
        sys.exit(2)
    roles = ("kv_producer", "kv_consumer", "kv_both")
    if cfg.get("kv_role") is not None and cfg["kv_role"] not in roles:  # vllm/config/kv_transfer.py
        fail(f"Unsupported kv_role: {cfg['kv_role']}. Supported roles are {list(roles)}")
    if cfg.get("kv_connector") == "LMCacheMPConnector" and args["node-rank"] == 0:
        LMCACHE.start(cfg, args, engines, served, avail)
    elif cfg.get("kv_connector") == "NixlConnector" and args["node-rank"] == 0:
        nixl_start().start(cfg, args, engines, served, host_path(args["model"] or ""))


NIXL = []  # the NixlConnector (image/lib/nixl_sim.py) when --kv-transfer-config names it


def nixl_start():
    import importlib.util
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(__file__))), "lib", "nixl_sim.py")
    spec = importlib.util.spec_from_file_location("railyard_lab_nixl", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    NIXL[:] = [mod.Nixl(sys.modules[__name__]), mod]
    return NIXL[0]


def prefill(ids, block, st, rid):
    """The request's prefill, modeled: vLLM's own prefix cache first, then LMCache for what follows;
    every token neither has costs RAILYARD_LAB_PREFILL_US_PER_TOKEN, a retrieve its real time."""
    try:
        us = float(os.environ.get(PREFILL_US_ENV, PREFILL_US_DEFAULT))
    except ValueError:
        us = PREFILL_US_DEFAULT
    hashes = block_hashes(ids, block)
    local = 0
    for h in hashes:
        if h not in LOCAL_BLOCKS:
            break
        local += block
    local = min(local, len(ids) - 1)
    st["prefix_q"] += len(ids)
    st["prefix_h"] += local
    with LMCACHE.lock:
        computed, had = LMCACHE.request(rid, ids, local, st)
        chunked_prefill(max(0, len(ids) - computed), us, st)
        LOCAL_BLOCKS.update(hashes)
        LMCACHE.after(rid, ids, had)
    if LMCACHE.proc is not None:
        q, h = st["ext_q"], st["ext_h"]
        log(f"Engine 000: Prefix cache hit rate: {100 * st['prefix_h'] / max(1, st['prefix_q']):.1f}%, "
            f"External prefix cache hit rate: {100 * h / max(1, q):.1f}%", where="loggers.py:259")
    return computed


def chunked_prefill(tokens, us, st):
    """Compute `tokens` prompt tokens as vLLM's chunked prefill does: at most max_num_batched_tokens
    per engine step, each step also paying one decode step of the running batch; while it runs, the
    decode steps of the other requests carry its chunk (interference, see decode_step)."""
    budget = max(1, SCHED["batched_tokens"])
    st["prefilling"] += tokens
    try:
        while tokens > 0:
            chunk = min(tokens, budget)
            time.sleep(_tpot_s(st) + chunk * us / 1e6)
            tokens -= chunk
            st["prefilling"] -= chunk
    finally:
        st["prefilling"] -= max(0, tokens)


def decode_step(st):
    """One output token's time for one request: the decode step of the running batch, plus the prompt
    chunk the engine schedules into the same step while another request is in prefill (up to
    max_num_batched_tokens: a large budget speeds prefill and slows decode, a small one the reverse)."""
    interfering = min(SCHED["batched_tokens"], max(0, st["prefilling"]))
    return _tpot_s(st) + interfering * _prefill_us() / 1e6


SCHED = {"max_num_seqs": 256, "batched_tokens": 8192}  # set from the flags in main()
SLOTS = []  # one semaphore of max_num_seqs per engine: requests beyond it wait (vllm:num_requests_waiting)
ANSWER = ["The", " two", " stations", " answer", " over", " the", " rail", "."]  # its last word: the weights'


WEIGHTS = {"digest": b""}  # sha256 of the loaded model.safetensors: what the KV blocks a prefill sends are made of


def word_of(digest):
    pool = sorted((w for w in VOCAB if w.isalpha() and w != "UNK"), key=VOCAB.get) or ["rail"]
    return " " + pool[int.from_bytes(digest[:4], "big") % len(pool)]


def answer_by_weights(model_dir):
    """A model answers by its weights: the answer's last word is drawn from the vocabulary by a digest of
    the checkpoint's model.safetensors (the lab model's, 4.5 MB), so the same weights always answer the
    same and another seed's (lab.fault wrong-weights) answers otherwise, as the real engine does."""
    import hashlib
    try:
        with open(os.path.join(model_dir, "model.safetensors"), "rb") as f:
            WEIGHTS["digest"] = hashlib.sha256(f.read()).digest()
    except OSError:
        return
    ANSWER[-2] = word_of(WEIGHTS["digest"])


def kv_answer(words, kv_from):
    """A decode answers from the KV blocks it was given: blocks a prefill computed with other weights
    (their bytes carry that prefill's digest, kv_from) change its answer's last word, as another model's
    KV changes a real model's answer; blocks of the same weights change nothing."""
    import hashlib
    last = len(ANSWER) - 2
    if not kv_from or not WEIGHTS["digest"] or kv_from == WEIGHTS["digest"].hex() or len(words) <= last \
            or words[:last + 1] != ANSWER[:last + 1]:
        return words
    return words[:last] + [word_of(hashlib.sha256(bytes.fromhex(kv_from) + WEIGHTS["digest"]).digest())] + \
        words[last + 1:]


def output_words(req, cap, prompt_ids):
    """What the model answers: the short fixed answer (finish_reason stop), or with ignore_eos (as
    benchmarks send) exactly max_tokens words of the vocabulary (finish_reason length)."""
    if req.get("ignore_eos") and isinstance(cap, int) and cap > 0:
        pool = sorted(VOCAB, key=VOCAB.get)[1:257] or [w.strip() for w in ANSWER]
        return [" " + pool[(len(prompt_ids) + i * 7) % len(pool)] for i in range(cap)], "length"
    return (ANSWER[:cap] if isinstance(cap, int) and cap > 0 else list(ANSWER)), "stop"


# ---------------------------------------------------------------- HTTP

def make_handler(args, served, key):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "uvicorn"
        sys_version = ""

        def setup(self):
            super().setup()  # uvicorn's sockets send at once (TCP_NODELAY): no token waits for a delayed ACK
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

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
            prompt = " ".join(c if isinstance(c, str) else " ".join(str(p.get("text", "")) for p in c
                                                                   if isinstance(p, dict))
                              for c in (m.get("content", "") for m in req.get("messages", [])))
            # vLLM honours the router's X-data-parallel-rank; otherwise the DP coordinator spreads requests
            want = self.headers.get("X-data-parallel-rank", "")
            dp = int(want) if want.isdigit() and int(want) < len(STATS) else \
                sum(e["requests"] for e in STATS) % len(STATS)
            st = STATS[dp]
            st["requests"] += 1
            xrid = self.headers.get("X-Request-Id")  # serving_chat: chatcmpl-<X-Request-Id>, else a random id
            rid = f"chatcmpl-{xrid or uuidlib.uuid4().hex}"
            ids = token_ids(prompt)
            cap = req.get("max_completion_tokens") or req.get("max_tokens")
            words, finish = output_words(req, cap, ids)
            ktp = req.get("kv_transfer_params") if isinstance(req.get("kv_transfer_params"), dict) else None
            if args.get("enable-log-requests"):  # vLLM 0.32 at INFO: the id and the params, never the prompt
                # (tests/fixtures/real/vllm-cpu/pd-request-log.txt)
                extra = {"kv_transfer_params": ktp} if ktp else None
                log(f"Received request {rid}: params: SamplingParams(n=1, presence_penalty=0.0, "
                    "frequency_penalty=0.0, repetition_penalty=1.0, "
                    f"temperature={float(req.get('temperature', 1.0))}, watermarking=None, top_p=1.0, top_k=0, "
                    f"min_p=0.0, seed={req.get('seed')}, stop=[], stop_token_ids=[], bad_words=[], "
                    "thinking_token_budget=None, include_stop_str_in_output=False, "
                    f"ignore_eos={bool(req.get('ignore_eos'))}, max_tokens={cap if isinstance(cap, int) else None}, "
                    "min_tokens=0, logprobs=None, prompt_logprobs=None, skip_special_tokens=True, "
                    "spaces_between_special_tokens=True, structured_outputs=None, "
                    f"extra_args={extra}), lora_request: None.", where="request_logger.py:65")
                log(f"Added request {rid}-{uuidlib.uuid4().hex[:8]}.", where="async_llm.py:578")
            while engine_stopped():  # the API queued it; a stopped engine core reads nothing, reports nothing
                time.sleep(0.2)
            out_params = None
            slots = SLOTS[dp] if dp < len(SLOTS) else None
            if slots is not None and not slots.acquire(blocking=False):
                st["waiting"] += 1  # the batch is full (max_num_seqs): it waits for a slot, as vLLM queues it
                slots.acquire()
                st["waiting"] -= 1
            st["running"] += 1
            streamed = False
            try:
                wait_unstalled(dp)
                try:
                    out_params, finish, sample = (DP_LINK.call if dp in DP_LINK.remote else engine_step)(
                        args, dp, rid, ids, ktp, st, finish)
                except EngineDead:
                    return self._engine_dead()
                if not req.get("ignore_eos"):
                    words = kv_answer(words, (sample or {}).get("kv_weights"))
                usage = {"prompt_tokens": len(ids), "total_tokens": len(ids) + len(words),
                         "completion_tokens": len(words), "prompt_tokens_details": None}
                if req.get("stream"):  # each token sent when its decode step is done, as vLLM streams
                    streamed = True
                    self._stream(rid, served, words, finish, usage, st, req, dp)
                else:
                    for _ in words:
                        time.sleep(decode_step(st))
                        wait_unstalled(dp)
            except (BrokenPipeError, ConnectionResetError):
                return None
            finally:
                st["running"] -= 1
                if slots is not None:
                    slots.release()
                st["prompt"] += len(ids)
                st["generation"] += len(words)
                st["spec_drafts"] += 4
                st["spec_accepted"] += 3
            if streamed:
                return None
            return self._send(200, json.dumps({
                "id": rid, "object": "chat.completion", "created": int(time.time()), "model": served,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(words),
                                                     "reasoning_content": None, "tool_calls": []},
                             "logprobs": None, "finish_reason": finish, "stop_reason": None}],
                "usage": usage, "prompt_logprobs": None, "kv_transfer_params": out_params}))

        def _stream(self, rid, served, words, finish, usage, st, req, dp=0):
            self.send_response(200)
            self.send_header("content-type", "text/event-stream; charset=utf-8")
            self.send_header("transfer-encoding", "chunked")
            self.end_headers()

            def chunk(obj):
                data = f"data: {obj}\n\n".encode()
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()

            base = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": served}
            chunk(json.dumps(dict(base, choices=[{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                   "logprobs": None, "finish_reason": None}])))
            for i, wd in enumerate(words):
                if i:
                    time.sleep(decode_step(st))
                    wait_unstalled(dp)
                chunk(json.dumps(dict(base, choices=[{"index": 0, "delta": {"content": wd}, "logprobs": None,
                                                       "finish_reason": None}])))
            chunk(json.dumps(dict(base, choices=[{"index": 0, "delta": {"content": ""}, "logprobs": None,
                                                   "finish_reason": finish, "stop_reason": None}])))
            if (req.get("stream_options") or {}).get("include_usage"):  # vLLM: a last chunk with no choices
                chunk(json.dumps(dict(base, choices=[], usage=usage)))
            chunk("[DONE]")
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()

        def _engine_dead(self):
            """The engine died under the request (vLLM: EngineDeadError): a 500, then the server exits."""
            msg = "EngineCore encountered an issue. See stack trace (above) for the root cause."
            log("AsyncLLM output_handler failed.", "ERROR", where="async_llm.py:708")
            print(f"(APIServer pid={os.getpid()}) vllm.v1.engine.exceptions.EngineDeadError: {msg}", flush=True)
            self._send(500, json.dumps({"object": "error", "message": msg, "type": "InternalServerError",
                                        "param": None, "code": 500}))
            self.wfile.flush()

            def bye():
                time.sleep(0.3)
                print("INFO:     Shutting down", flush=True)
                stop_children()
                os._exit(1)

            threading.Thread(target=bye, daemon=True).start()
    return Handler


class EngineDead(Exception):
    """The engine of a DP rank died under a request (vLLM's EngineDeadError follows)."""


def engine_step(args, dp, rid, ids, ktp, st, finish):
    """What the engine of DP rank `dp` does with a request before it decodes: the KV blocks from the
    prefill instance (NIXL) and the prompt tokens they do not cover, or its own prefill; a prefill
    instance's request ends there with the kv_transfer_params for the decode side.
    Returns (kv_transfer_params, finish_reason, the NIXL transfer's sample or None)."""
    params, sample = None, None
    wait_unstalled(dp)  # a headless DP node's rank too: its answer to the head waits
    if NIXL and ktp and ktp.get("do_remote_prefill") and ktp.get("remote_block_ids"):
        try:
            got, sample = NIXL[0].pull(dp, rid, ktp)
        except NIXL[1].HandshakeDead:
            raise EngineDead(dp) from None
        # the tokens no full block carried are computed here
        time.sleep(max(0, len(ids) - got) * _prefill_us() / 1e6)
    else:
        prefill(ids, args["block-size"], st, rid)
    if NIXL and ktp and ktp.get("do_remote_decode"):
        params, finish = NIXL[0].finished_prefill(dp, rid, len(ids)), "length"
    return params, finish, sample


class DpLink:
    """Multi-node data parallel (--data-parallel-size-local below --data-parallel-size): the head's API
    server reaches the engines of the ranks its headless nodes run, as vLLM's front-end does over ZMQ at
    --data-parallel-address:--data-parallel-rpc-port. Here one TCP connection per headless node, one
    JSON line per request and per answer; an engine that dies takes its node's connection down, and
    the head with it (vLLM: "Engine core proc ... died unexpectedly, shutting down client.")."""

    def __init__(self):
        self.srv = None
        self.remote = {}  # DP rank -> the node's connection (head side)
        self.calls = {}   # call id -> [Event, answer]
        self.lock = threading.Lock()
        self.n = 0

    # ------------------------------------------------------------ the head
    def listen(self, args):
        self.srv = socket.socket()
        self.srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.srv.bind((args["data-parallel-address"] or "127.0.0.1", args["data-parallel-rpc-port"]))
        self.srv.listen(16)
        self.srv.settimeout(1)

    def wait_ready(self, count, stop):
        """Until the headless nodes' engines, `count` ranks in all, have started and said so."""
        debug = os.environ.get("VLLM_LOGGING_LEVEL", "INFO").upper() == "DEBUG"
        said = 0.0
        while len(self.remote) < count and not stop.is_set():
            if debug and time.time() - said >= 10:
                said = time.time()
                log(f"Waiting for 0 local, {count - len(self.remote)} remote core engine proc(s) to start.", "DEBUG",
                    where="utils.py:975")
            try:
                conn, _ = self.srv.accept()
            except socket.timeout:
                continue
            f = conn.makefile("rwb")
            hello = json.loads(f.readline() or b"{}")
            node = {"f": f, "wlock": threading.Lock(), "ranks": hello.get("ranks", [])}
            for r in node["ranks"]:
                self.remote[r] = node
            threading.Thread(target=self._answers, args=(node, stop), daemon=True).start()

    def _answers(self, node, stop):
        for line in node["f"]:
            a = json.loads(line)
            with self.lock:
                call = self.calls.pop(a["id"], None)
            if call:
                call[1] = a
                call[0].set()
        if not stop.is_set():
            log(f"Engine core proc EngineCore_DP{node['ranks'][0] if node['ranks'] else '?'} died unexpectedly, "
                "shutting down client.", "ERROR", where="core_client.py:564")
            stop_children()
            os._exit(1)

    def call(self, args, dp, rid, ids, ktp, st, finish):
        """engine_step on the node that runs rank dp; its NIXL transfer counts in this head's /metrics."""
        node = self.remote[dp]
        call = [threading.Event(), None]
        with self.lock:
            self.n += 1
            cid = self.n
            self.calls[cid] = call
        with node["wlock"]:
            node["f"].write((json.dumps({"id": cid, "dp": dp, "rid": rid, "ids": ids, "ktp": ktp, "finish": finish})
                             + "\n").encode())
            node["f"].flush()
        call[0].wait()
        a = call[1]
        if a.get("dead"):
            raise EngineDead(dp)
        if a.get("sample") and NIXL:
            NIXL[0].record(dp, a["sample"])
        return a.get("params"), a.get("finish", finish), a.get("sample")

    # ------------------------------------------------------------ a headless node
    def join(self, args, dpl, stop):
        addr = (args["data-parallel-address"] or "127.0.0.1", args["data-parallel-rpc-port"])
        print(f"INFO {time.strftime('%m-%d %H:%M:%S')} [serve.py:201] Launching {dpl} data parallel engine(s) in "
              f"headless mode, with head node address tcp://{addr[0]}:{addr[1]}.", flush=True)
        deadline = time.time() + 300
        while not stop.is_set():
            try:
                self.sock = socket.create_connection(addr, timeout=2)
                self.sock.settimeout(None)
                return
            except OSError:
                if time.time() > deadline:
                    fail("Did not receive response from front-end process within 5 minutes", "RuntimeError")
                time.sleep(0.5)
        sys.exit(0)

    def serve(self, args, engines):
        f = self.sock.makefile("rwb")
        wlock = threading.Lock()
        f.write((json.dumps({"ranks": [e["dp_rank"] for e in engines]}) + "\n").encode())
        f.flush()

        def one(req):
            dp = req["dp"]
            try:
                params, finish, sample = engine_step(args, dp, req["rid"], req["ids"], req["ktp"], STATS[dp],
                                                     req["finish"])
                a = {"id": req["id"], "params": params, "finish": finish, "sample": sample}
            except EngineDead:
                a = {"id": req["id"], "dead": True}
            with wlock:
                f.write((json.dumps(a) + "\n").encode())
                f.flush()
            if a.get("dead"):
                stop_children()
                os._exit(1)

        for line in f:
            threading.Thread(target=one, args=(json.loads(line),), daemon=True).start()
        print(f"ERROR {time.strftime('%m-%d %H:%M:%S')} [core.py:1084] The front-end process at the head went away; "
              "shutting down", flush=True)
        stop_children()
        sys.exit(1)


DP_LINK = DpLink()


TPOT_ENV = "RAILYARD_LAB_DECODE_MS_PER_TOKEN"  # the modeled time of one output token with one request running


def _prefill_us():
    try:
        return float(os.environ.get(PREFILL_US_ENV, PREFILL_US_DEFAULT))
    except ValueError:
        return PREFILL_US_DEFAULT


def _tpot_s(st):
    """One output token's time: a base cost that grows with the engine's decode batch (requests running)."""
    try:
        base = float(os.environ.get(TPOT_ENV, "2.0"))
    except ValueError:
        base = 2.0
    return base / 1e3 * (1 + 0.05 * max(0, st["running"] - 1))


METRICS = (  # (name, type, help, STATS key), in vLLM's order
    ("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.", "running"),
    ("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", "waiting"),
    ("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", "kv"),
    ("vllm:prefix_cache_queries_total", "counter", "Prefix cache queries, in terms of number of queried tokens.",
     "prefix_q"),
    ("vllm:prefix_cache_hits_total", "counter", "Prefix cache hits, in terms of number of cached tokens.", "prefix_h"),
    ("vllm:external_prefix_cache_queries_total", "counter", "External prefix cache queries from KV connector "
     "cross-instance cache sharing, in terms of number of queried tokens.", "ext_q"),
    ("vllm:external_prefix_cache_hits_total", "counter", "External prefix cache hits from KV connector "
     "cross-instance cache sharing, in terms of number of cached tokens.", "ext_h"),
    ("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.", "prompt"),
    ("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.", "generation"),
    ("vllm:spec_decode_num_draft_tokens_total", "counter", "Number of draft tokens.", "spec_drafts"),
    ("vllm:spec_decode_num_accepted_tokens_total", "counter", "Number of accepted tokens.", "spec_accepted"),
)


def metrics(served):
    """Prometheus text: every series once per engine (DP rank), labelled engine="<n>", as vLLM does."""
    m = f'model_name="{served}"'
    out = []
    for name, kind, help_, key in METRICS:
        out += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]
        for n, st in enumerate(STATS):
            v = FROZEN.get(n, st)[key] if key in ("running", "waiting", "kv") else st[key]
            out.append(f'{name}{{engine="{n}",{m}}} {v if isinstance(v, float) else f"{v}.0"}')
    return "\n".join(out) + "\n" + (NIXL[0].metrics(served) if NIXL else "")


# ---------------------------------------------------------------- main

def main(argv):
    if argv[:1] in (["--version"], ["-v"]):
        print(VERSION)
        return
    args = parse(argv)
    stop = threading.Event()

    def on_term(sig, frame):
        if stop.is_set():
            return
        stop.set()
        log(f"Shutting down ({signal.Signals(sig).name})", where="launcher.py:80")
        LMCACHE.close()  # unregisters its KV caches: LMCache lets go of their memory
        stop_children()  # the engine cores and workers end; their GPUs are free again
        sys.stdout.flush()
        os._exit(0)

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    rank = args["node-rank"]
    served = args["served-model-name"] or args["model"]
    model_dir = host_path(args["model"] or "")
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        fail(f"Invalid repository ID or local directory specified: '{args['model']}'.\nPlease verify the following "
             "requirements:\n1. Provide a valid Hugging Face repository ID.\n2. Specify a local directory that "
             "contains a recognized configuration file.\n   - For Hugging Face models: ensure the presence of a "
             "'config.json'.")
    try:   # transformers' configuration_utils reads it first, as the real engine's start does
        with open(os.path.join(model_dir, "config.json")) as f:
            json.load(f)
    except ValueError:
        fail(f"It looks like the config file at '{os.path.join(args['model'], 'config.json')}' is not a valid JSON "
             "file.", exc="OSError")
    tp, pp, dp, nnodes = (args["tensor-parallel-size"], args["pipeline-parallel-size"], args["data-parallel-size"],
                          args["nnodes"])
    ep = bool(args["enable-expert-parallel"])
    gpus = visible_gpus()
    dpl = dp if args["data-parallel-size-local"] is None else args["data-parallel-size-local"]
    start = args["data-parallel-start-rank"]
    dp_headless = bool(args["headless"]) and nnodes == 1  # multi-node data parallel: this node's ranks, no API
    if rank == 0 and not dp_headless:
        log(f"vLLM API server version {VERSION}", where="api_server.py:1894")
        extra = "".join(f", '{k.replace('-', '_')}': {args[k]!r}" for k in (
            "pipeline-parallel-size", "data-parallel-size", "enable-expert-parallel", "all2all-backend",
            "api-server-count", "async-scheduling", "kv-cache-dtype", "max-num-batched-tokens")
            if k in args["_given"])
        log(f"non-default args: {{'model': '{args['model']}', 'served_model_name': ['{served}'], 'nnodes': "
            f"{nnodes}, 'node_rank': 0, 'tensor_parallel_size': {tp}{extra}}}", where="utils.py:328")
    if not gpus:  # vllm/config/device.py
        fail("Failed to infer device type, please set the environment variable `VLLM_LOGGING_LEVEL=DEBUG` to turn "
             "on verbose logging to help debug the issue.", "RuntimeError", f"(APIServer pid={os.getpid()}) ")
    if rank == 0:
        check_world(args, gpus)
        # vllm/config/scheduler.py and vllm/config/vllm.py
        log(f"Chunked prefill is enabled with max_num_batched_tokens={args['max-num-batched-tokens']}.",
            where="scheduler.py:231")
        if args["async-scheduling"]:
            log("Asynchronous scheduling is enabled.", where="vllm.py:753")
    local = max(1, tp * pp // nnodes)  # workers of one engine on this node
    if local > len(gpus):
        fail("CUDA error: invalid device ordinal", "torch.AcceleratorError")
    uniproc = tp * pp * dp * nnodes == 1  # one GPU, no workers: the engine core runs the model itself
    engines = [{"dp_rank": d, "dp_size": dp, "name": f"EngineCore_DP{d}" if dp > 1 else "EngineCore",
                "gpus": gpus[(d - start) * local:(d - start + 1) * local], "pid": None, "workers": []}
               for d in (range(start, start + dpl) if rank == 0 else range(1))]
    if rank == 0 and not uniproc:
        for e in engines:
            e["pid"] = spawn(e["name"])
    free_check(args, engines)
    if dp_headless:
        DP_LINK.join(args, dpl, stop)
    elif dpl < dp:
        DP_LINK.listen(args)
    peer_sockets = []
    if rank == 0:
        if nnodes > 1:
            srv, peers = head_rendezvous(args, stop)
            peer_sockets = [c for c, _, _ in peers]
            peer_ip = peers[0][1]
        else:
            peer_ip = os.environ.get("VLLM_HOST_IP", "127.0.0.1")
    else:
        sock, f = worker_rendezvous(args, stop)
        peer_ip = args["master-addr"]
    weights = weights_gib(model_dir) / (tp * pp * (dp if ep else 1))
    util = args["gpu-memory-utilization"]
    for e in engines:
        for k, g in enumerate(e["gpus"]):
            n = rank * local + k  # this worker's rank within its engine
            name = "EngineCore" if uniproc else worker_name(dp, e["dp_rank"], pp, n // tp, tp, n % tp, ep)
            pid = spawn(name, g, int(g["total"] * util))
            if uniproc:
                e["pid"] = pid
            e["workers"].append((name, pid))
    ENGINES[:] = engines
    transport = nccl_log(rank, nnodes, peer_ip)
    if transport:
        print(f"INFO {time.strftime('%m-%d %H:%M:%S')} [pynccl.py:70] vLLM is using nccl=={NCCL_VERSION.split('+')[0]}",
              flush=True)
    for e in engines:
        for name, pid in e["workers"]:
            log(f"Model loading took {weights:.2f} GiB and 2.1 seconds", where="gpu_model_runner.py:2602",
                who=name, pid=pid)
    if rank != 0:
        # a headless worker serves no API; it lives as long as the head does
        threading.Thread(target=watch_own_stall, args=(sock, stop), daemon=True).start()
        while f.readline():
            pass
        print(f"ERROR {time.strftime('%m-%d %H:%M:%S')} [multiproc_executor.py:240] The head closed the "
              "connection; shutting down", flush=True)
        stop_children()
        sys.exit(1)
    per_token = kv_bytes_per_token(args, model_dir)
    for e in engines:
        avail, tokens = kv_cache(args, e, weights, per_token)
        for name, pid in e["workers"]:
            log(f"Available KV cache memory: {avail:.2f} GiB", where="gpu_worker.py:298", who=name, pid=pid)
        if tokens <= 0:  # vllm/v1/core/kv_cache_utils.py
            fail_in(e["name"], e["pid"], "No available memory for the cache blocks. Try increasing "
                    "`gpu_memory_utilization` when initializing the engine.", where="core.py:866")
        log(f"GPU KV cache size: {tokens:,} tokens", where="kv_cache_utils.py:1087", who=e["name"], pid=e["pid"])
        log(f"Maximum concurrency for {args['max-model-len']:,} tokens per request: "
            f"{tokens / args['max-model-len']:.2f}x", where="kv_cache_utils.py:1091", who=e["name"], pid=e["pid"])
    STATS[:] = [dict(dict.fromkeys(STAT_KEYS, 0), kv=0.0) for _ in range(max(dp, start + len(engines)))]
    SCHED.update(max_num_seqs=max(1, args["max-num-seqs"]), batched_tokens=max(1, args["max-num-batched-tokens"]))
    SLOTS[:] = [threading.BoundedSemaphore(SCHED["max_num_seqs"]) for _ in engines]
    load_vocab(model_dir)
    answer_by_weights(model_dir)
    kv_transfer(args, engines, served, [kv_cache(args, e, weights, per_token)[0] for e in engines])
    if dp_headless:
        DP_LINK.serve(args, engines)  # until the head goes away
    if DP_LINK.srv:
        DP_LINK.wait_ready(dp - dpl, stop)
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
                while True:  # a worker there stalled (engine-stall): the group's steps wait on it until R
                    b = c.recv(1)
                    if b == b"S":
                        REMOTE_STALLED.set()
                    elif b == b"R":
                        REMOTE_STALLED.clear()
                    else:
                        break
            except OSError:               # otherwise it returns when the worker goes away
                pass
            if not stop.is_set():
                print(f"ERROR {time.strftime('%m-%d %H:%M:%S')} [multiproc_executor.py:150] A worker process died; "
                      "shutting down the engine", flush=True)
                stop_children()
                os._exit(1)

    threading.Thread(target=watch_peers, daemon=True).start()
    threading.Thread(target=watch_stalls, args=(stop,), daemon=True).start()
    httpd.serve_forever()


# ---------------------------------------------------------------- the NCCL probe's stand-in

def probe_main(argv):
    """scripts/nccl_probe.py in a lab container: the same rendezvous and output lines, with the
    bytes really sent over the lab's rail (TCP between the two network namespaces), timed.
    `--local-ranks N`: N ranks of one host (local_probe)."""
    sizes, local, timeout = "1M", 0, 300
    for i, a in enumerate(argv):
        if a == "--sizes" and i + 1 < len(argv):
            sizes = argv[i + 1]
        elif a == "--local-ranks" and i + 1 < len(argv):
            local = int(argv[i + 1])
        elif a == "--timeout" and i + 1 < len(argv):
            timeout = int(argv[i + 1])
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    todo = []
    for s in sizes.split(","):
        s = s.strip().upper().rstrip("B").rstrip("I")
        todo.append(int(float(s[:-1]) * units[s[-1]]) if s and s[-1] in units else int(s))
    if local:
        sys.exit(local_probe(local, todo, timeout))
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


# ---------------------------------------------------------------- the probe's N local ranks

# The bus bandwidth (GB/s) an 8-GPU all-reduce reaches at large sizes, and the latency (s) that rules
# small ones. P2P on H200 (NVLink 4, NVSwitch): nccl-tests on 8 x H100 SXM measured 365-370 GB/s with
# the ring and up to 480 GB/s with NVLink SHARP (NVIDIA/nccl#1455); H200 has the same NVLink. B200's
# NVLink 5 carries twice as much per GPU (1.8 TB/s against 900 GB/s). SHM stages every byte through
# host memory over PCIe (a few to ~15 GB/s); NET/Socket between ranks of one host is a TCP loopback
# (the H200 capture in tests/fixtures/real/h200-validation: 1.86 GB/s). Modeled, not measured: the
# lab has no NVLink.
LOCAL_BUSBW = {("P2P", "H200"): (365.0, 18e-6), ("NVLS", "H200"): (470.0, 22e-6),
               ("P2P", "B200"): (730.0, 16e-6), ("NVLS", "B200"): (900.0, 20e-6),
               ("SHM", None): (14.0, 45e-6), ("NET/Socket", None): (2.0, 120e-6)}


def _local_transport(n):
    """(transport, nvls) as NCCL would pick them for n ranks of this host, from its environment."""
    env = os.environ
    if env.get("NCCL_P2P_DISABLE") == "1" or env.get("NCCL_P2P_LEVEL", "").upper() == "LOC":
        return ("NET/Socket" if env.get("NCCL_SHM_DISABLE") == "1" else "SHM"), False
    nvls = bool(tools().shape().get("nvlink")) and n > 2 and env.get("NCCL_NVLS_ENABLE", "2") != "0"
    return "P2P", nvls


def _local_nccl_log(rank, n, gpus, transport, nvls):
    """What NCCL 2.30 prints (NCCL_DEBUG=INFO, INIT,ENV,P2P,SHM,NET) for one of n ranks of this host;
    formats from NCCL's sources (init.cc, transport/p2p.cc, shm.cc, net.cc, nvls.cc, graph/paths.cc)."""
    if os.environ.get("NCCL_DEBUG", "").upper() != "INFO":
        return []
    pid = os.getpid()
    host = socket.gethostname()
    p = f"{host}:{pid}:{pid} [{rank}] NCCL INFO "
    g = gpus[rank]
    dev = g.get("index", rank)
    bus = g["bus"].split(":", 1)[1].replace(":", "").replace(".", "").lstrip("0").lower() or "0"
    comm = f"0x{0x55d0c0de0000 + rank * 0x10000:x}"
    env = os.environ
    lines = [p + "cudaDriverVersion 13000", p + f"NCCL version {NCCL_VERSION}",
             p + "NET/Plugin: Could not find: libnccl-net.so", p + "NET/IB : No device found.",
             p + "Failed to initialize NET plugin IB", p + "Using network Socket",
             p + f"[Rank {rank}] ncclCommInitRankConfig comm {comm} rank {rank} nranks {n} cudaDev {rank} nvmlDev {dev} "
                 f"busId {bus} commId 0x1f2e3d4c5b6a7988 - Init START"]
    if env.get("NCCL_P2P_DISABLE") == "1":
        lines.append(p + "NCCL_P2P_DISABLE set by environment to 1")
    elif env.get("NCCL_P2P_LEVEL"):
        lines.append(p + f"NCCL_P2P_LEVEL set by environment to {env['NCCL_P2P_LEVEL'].upper()}")
    if env.get("NCCL_SHM_DISABLE") == "1":
        lines.append(p + "NCCL_SHM_DISABLE set by environment to 1.")
    lines.append(p + f"NVLS multicast support is {'' if nvls else 'not '}available on dev {rank}")
    lines.append(p + f"comm {comm} rank {rank} nRanks {n} nNodes 1 localRanks {n} localRank {rank} MNNVL 0")
    nvls_ch = 16 if nvls else 0
    lines.append(p + f"24 coll channels, 24 collnet channels, {nvls_ch} nvls channels, 32 p2p channels, "
                     "32 p2p channels per peer")
    peers = [(rank + 1) % n, (rank - 1) % n]
    for ch in range(4):
        for q in peers:
            qd = gpus[q].get("index", q)
            if transport == "P2P":
                lines.append(p + f"Channel {ch:02d}/0 : {rank}[{dev}] -> {q}[{qd}] via P2P/CUMEM/read")
            elif transport == "SHM":
                lines.append(p + f"Channel {ch:02d} : {rank}[{dev}] -> {q}[{qd}] via SHM/direct")
            else:
                lines.append(p + f"Channel {ch:02d}/0 : {rank}[{dev}] -> {q}[{qd}] [send] via NET/Socket/0")
                lines.append(p + f"Channel {ch:02d}/0 : {q}[{qd}] -> {rank}[{dev}] [receive] via NET/Socket/0")
    lines.append(p + "Connected all rings, use ring PXN 0 GDR 1")
    if nvls:
        lines.append(p + f"NVLS comm {comm} headRank {rank} nHeads {n} nvlsRanks {n} buffSize 1048576 "
                         f"nvlsPerRankSize 33554432 nvlsTotalSize {33554432 * n}")
    lines.append(p + f"ncclCommInitRankConfig comm {comm} rank {rank} nranks {n} cudaDev {rank} nvmlDev {dev} "
                     f"busId {bus} commId 0x1f2e3d4c5b6a7988 - Init COMPLETE")
    return lines


def _local_rank(rank, n, gpus, todo, timeout):
    """One rank: its GPU, the rendezvous at MASTER_ADDR:MASTER_PORT (rank 0 holds it, as torch's TCPStore
    does), NCCL's lines, then per size the modeled time, in step with the other ranks."""
    def emit(**kw):
        print(json.dumps(dict(railyard_probe=1, rank=rank, **kw)), flush=True)

    if rank >= len(gpus):  # what torch.cuda.set_device says (seen on a real H200, one GPU, rank 1)
        emit(error="AcceleratorError: CUDA error: invalid device ordinal\nGPU device may be out of range, do you have "
                   "enough GPUs?\n")
        return 1
    addr = (os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29511")))
    if rank == 0:
        srv = socket.socket()
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind(addr)
        srv.listen(n)
        srv.settimeout(timeout)
        peers = []
        try:
            while len(peers) < n - 1:
                peers.append(srv.accept()[0].makefile("rwb", buffering=0))
        except socket.timeout:
            emit(error=f"DistStoreError: Timed out after {timeout} seconds waiting for clients. {len(peers) + 1}/{n} "
                       "clients joined.")
            return 1
    else:
        deadline = time.time() + timeout
        while True:
            try:
                conn = socket.create_connection(addr, timeout=2)
                conn.settimeout(None)
                break
            except OSError:
                if time.time() > deadline:
                    emit(error=f"DistNetworkError: failed to connect to {addr[0]}:{addr[1]}")
                    return 1
                time.sleep(0.1)
        f = conn.makefile("rwb", buffering=0)
    transport, nvls = _local_transport(n)
    lines = _local_nccl_log(rank, n, gpus, transport, nvls)
    if lines:
        print("\n".join(lines), flush=True)
    model = next((m for m in ("H200", "B200") if m in gpus[0]["name"]), "H200")
    key = (("NVLS" if nvls else "P2P"), model) if transport == "P2P" else (transport, None)
    busbw, latency = LOCAL_BUSBW[key]
    for size in todo:
        if rank == 0:  # every size starts together and ends with the slowest rank
            for c in peers:
                c.write(b"go\n")
        elif f.readline() != b"go\n":
            emit(error="DistBackendError: rank 0 went away")
            return 1
        t = latency + size * 2 * (n - 1) / n / (busbw * 1e9)
        t *= 1 + 0.003 * ((rank * 7 + size.bit_length()) % 5)
        time.sleep(t)
        if rank == 0:
            for c in peers:
                c.readline()
        else:
            f.write(b"done\n")
        algbw = size / t / 1e9
        emit(bytes=size, time_s=t, algbw_gbs=algbw, busbw_gbs=algbw * 2 * (n - 1) / n)
    return 0


def local_probe(n, todo, timeout):
    """`nccl_probe.py --local-ranks N` in a lab container: N processes, rank i on the container's GPU i
    (CUDA_VISIBLE_DEVICES order); when one fails the others are stopped, as the real probe does."""
    gpus = visible_gpus()
    pids = []
    for rank in range(n):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = _local_rank(rank, n, gpus, todo, timeout)
            finally:
                sys.stdout.flush()
                os._exit(code)
        pids.append(pid)
    codes = {}
    stopped = False
    while len(codes) < n:
        for pid in pids:
            if pid not in codes:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[pid] = os.waitstatus_to_exitcode(status)
        if not stopped and any(c != 0 for c in codes.values()):
            time.sleep(0.5)
            for pid in pids:
                if pid not in codes:
                    try:
                        os.kill(pid, signal.SIGTERM)
                    except ProcessLookupError:
                        pass
            stopped = True
        time.sleep(0.02)
    return 1 if any(codes.values()) else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--railyard-probe"]:
        probe_main(sys.argv[2:])
    else:
        main(sys.argv[1:])
