#!/usr/bin/python3 -SI
"""The lab image's `vllm` when the lab serves with the real engine (`inv lab.up --engine vllm`).

The real `vllm` of the lab's engine venv (vLLM's CPU build) runs with the arguments and the
environment railyard rendered, unchanged, so its own parser, its own log lines, its own API and its
own failures are what railyard sees. Around it, only what a GPU host adds and a CPU cannot have
(the stand-in's GPU layer, lab/railyard_lab/sim/vllm.py):
- the container's GPUs (`docker run --gpus`, CUDA_VISIBLE_DEVICES): a layout larger than them, or a
  GPU whose memory another process holds, fails before the engine starts, as the GPU build fails;
- GPU memory: each engine worker process holds its GPU's memory while it lives (nvidia-smi shows
  it under the worker's own title, `VLLM::Worker_TP1`), released when it exits;
- NCCL's log: once the engine's distributed group forms (the worker's `world_size=N rank=R` line),
  the node writes the log the stand-in writes, its transport following the container: NCCL over
  RDMA cannot run here.
What only the CPU build needs, set where the environment sets nothing: HF_HUB_OFFLINE (the lab has
no network), no usage statistics, VLLM_CPU_OMP_THREADS_BIND=nobind (several ranks share the
machine's cores; the CPU build's automatic binding refuses two ranks on one NUMA node),
OMP_NUM_THREADS=1 (every rank of every lab host shares the machine's two cores: with OpenMP's
default of one thread per core, a TP=2 pair spent 165 ms a token spinning, with one 32 ms) and
VLLM_CPU_KVCACHE_SPACE=1 (unset, each engine would take a share of the machine's memory), and one
inductor cache for the lab's engines (TORCHINDUCTOR_CACHE_DIR, beside the engine venv): with TP > 1
the first request compiles vLLM's masked vocabulary lookup (VocabParallelEmbedding, torch.compile
even under --enforce-eager), 20 s on two cores; in a container's own /tmp every start compiled again.
Beside it, one `modelinfos` for the lab's engines: without its entry for the model's class, a start
inspects the class in a process of its own that imports vLLM again (15-18 s before `Resolved
architecture` on two cores, against 3 s with it), and every freshly made lab host had none.
And NIXL's progress thread waits for UCX's events instead of polling without pause (the engine's
sitecustomize, sim/engine_site.py): NIXL's Python API pins its poll delay at 0, and a pd pair took both
cores for as long as it lived.
Standard library only.
"""

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.realpath(__file__))  # LAB/sim/image/bin
LAB_JSON = os.path.join(os.path.dirname(os.path.dirname(HERE)), "lab.json")
CPU_DEFAULTS = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
                "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
# a worker's line once its process group is up (vllm/distributed/parallel_state.py)
GROUP_RE = re.compile(r"world_size=(\d+) rank=(\d+) local_rank=\d+ distributed_init_method=\S+ backend=")
TITLE_RE = re.compile(r"^VLLM::Worker(?:_DP(\d+))?(?:_PP(\d+))?(?:_TP(\d+))?(?:_EP\d+)?$")


def standin():
    """The stand-in's module, for its GPU layer (its main() does not run on import)."""
    spec = importlib.util.spec_from_file_location("railyard_lab_vllm", os.path.join(os.path.dirname(HERE), "lib",
                                                                                    "vllm_standin.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def real_vllm():
    with open(LAB_JSON) as f:
        return json.load(f)["engine_vllm"]


def engine_env():
    env = dict(os.environ)
    # the image's site dir (its nvidia.nccl) is not the engine venv's; the lab's sitecustomize is (engine_site.py)
    env["PYTHONPATH"] = os.path.join(os.path.dirname(HERE), "engine-site")
    for k, v in CPU_DEFAULTS.items():
        env.setdefault(k, v)
    venv = os.path.dirname(os.path.dirname(real_vllm()))
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(venv, "inductor-cache"))
    share_modelinfos(env, os.path.join(venv, "modelinfos"))
    return env


def share_modelinfos(env, shared):
    """The engine's cache of what it learnt of a model class (`modelinfos`, keyed by the class's source) is
    one folder for all the lab's engines: the cache folder the engine will use (a mount the container was
    given included) gets `modelinfos` as a link to it, unless it has that folder already."""
    root = os.path.expanduser(env.get("VLLM_CACHE_ROOT") or "") or os.path.join(
        env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "vllm")
    try:
        os.makedirs(shared, exist_ok=True)
        os.makedirs(root, exist_ok=True)
        os.symlink(shared, os.path.join(root, "modelinfos"))
    except OSError:  # there already, or a folder the engine may not write: it inspects the class itself
        pass


def descendants(pid):
    """Every live process under pid, by walking /proc once."""
    parent = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    parent[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out += kids
        todo += kids
    return out


def title(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().split(b"\0")[0].decode(errors="replace").strip()
    except OSError:
        return ""


class GpuLayer:
    """Holds each worker's GPU memory while it lives and writes the node's NCCL log once."""

    def __init__(self, sim, args, engines):
        self.sim, self.args, self.engines = sim, args, engines
        self.held = {}  # worker pid -> the title it was held under
        self.nccl_written = False
        self.lock = threading.Lock()

    def gpu_of(self, name):
        m = TITLE_RE.match(name)
        if not m or not self.engines:
            return None
        dp = int(m.group(1) or 0) - self.args["data-parallel-start-rank"]
        e = self.engines[dp] if 0 <= dp < len(self.engines) else self.engines[0]
        tp = self.args["tensor-parallel-size"]
        local = int(m.group(2) or 0) * tp + int(m.group(3) or 0)  # this worker's rank in its engine
        local -= self.args["node-rank"] * len(e["gpus"])          # ... of this node's share of it
        return e["gpus"][local] if 0 <= local < len(e["gpus"]) else None

    def final(self, name):
        """A worker first runs as `VLLM::Worker`, then takes its rank's title (`VLLM::Worker_TP1`):
        its GPU is known once the title names every parallel dimension of the layout."""
        a = self.args
        return all(part in name for part, size in (("_DP", a["data-parallel-size"]), ("_PP", a["pipeline-parallel-size"]),
                                                   ("_TP", a["tensor-parallel-size"])) if size > 1)

    def watch(self, root, stop):
        util = float(self.args["gpu-memory-utilization"])
        tools = self.sim.tools()
        while not stop.is_set():
            for pid in descendants(root):
                name = title(pid)
                if name.startswith("VLLM::Worker") and pid not in self.held and self.final(name):
                    g = self.gpu_of(name)
                    if g:
                        tools.hold(pid, name, int(g["total"] * util), g["uuid"])
                        self.held[pid] = name
            stop.wait(0.5)

    def line(self, text):
        m = GROUP_RE.search(text)
        if not m or self.nccl_written:
            return
        with self.lock:
            if self.nccl_written:
                return
            self.nccl_written = True
        nnodes = self.args["nnodes"]
        peer = self.args["master-addr"] if self.args["node-rank"] else os.environ.get("VLLM_HOST_IP", "")
        self.sim.nccl_log(self.args["node-rank"], nnodes, peer)


def main(argv):
    exe = real_vllm()
    if argv[:1] != ["serve"]:  # --version, --help, bench ...: the engine itself
        os.execve(exe, [exe] + argv, engine_env())
    sim = standin()
    quiet, sys.stderr = sys.stderr, open(os.devnull, "w")
    try:
        args = sim.parse(argv)
    except (SystemExit, ValueError):  # what the GPU layer cannot read, the engine's own parser reports
        os.execve(exe, [exe] + argv, engine_env())
    finally:
        sys.stderr = quiet
    gpus = sim.visible_gpus()
    pid = os.getpid()
    if not gpus:  # what the GPU build says where the container was given no GPU (vllm/config/device.py)
        sim.fail("Failed to infer device type, please set the environment variable `VLLM_LOGGING_LEVEL=DEBUG` to "
                 "turn on verbose logging to help debug the issue.", "RuntimeError", f"(APIServer pid={pid}) ")
    tp, pp, dp, nnodes = (args["tensor-parallel-size"], args["pipeline-parallel-size"], args["data-parallel-size"],
                          args["nnodes"])
    dpl = dp if args["data-parallel-size-local"] is None else args["data-parallel-size-local"]
    start = args["data-parallel-start-rank"]
    if args["node-rank"] == 0:
        sim.check_world(args, gpus)
    local = max(1, tp * pp // nnodes)
    engines = [{"dp_rank": d, "dp_size": dp, "name": f"EngineCore_DP{d}" if dp > 1 else "EngineCore", "pid": None,
                "gpus": gpus[(d - start) * local:(d - start + 1) * local]} for d in range(start, start + dpl)]
    sim.free_check(args, engines)
    layer = GpuLayer(sim, args, engines)
    proc = subprocess.Popen([exe] + argv, env=engine_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL)

    def forward(sig, frame):
        try:
            proc.send_signal(sig)
        except ProcessLookupError:
            pass

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    stop = threading.Event()
    threading.Thread(target=layer.watch, args=(proc.pid, stop), daemon=True).start()
    out = sys.stdout.buffer

    def pump():
        for raw in iter(proc.stdout.readline, b""):
            out.write(raw)
            out.flush()
            layer.line(raw.decode(errors="replace"))

    # the real `vllm serve` is the image's main process: when it exits, so does this one (and docker ends the
    # container with every process left in it), whether or not its engine core and workers still hold its stdout
    pumping = threading.Thread(target=pump, daemon=True)
    pumping.start()
    rc = proc.wait()
    pumping.join(timeout=1.0)
    stop.set()
    time.sleep(0.1)
    sys.exit(rc if rc >= 0 else 128 - rc)


if __name__ == "__main__":
    main(sys.argv[1:])
