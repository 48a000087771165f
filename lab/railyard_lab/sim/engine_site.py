"""The lab's real engines' `sitecustomize` (image/engine-site, on their PYTHONPATH: sim/engine.py): NIXL's
progress thread waits for UCX's events instead of polling without pause.

NIXL's UCX progress thread (nixlUcxSharedThread::run in the nixl 1.5.1 wheel) polls its workers' event
fds with a timeout of the agent's `pthrDelay`, which NIXL's C++ agent config takes and its Python API
pins at 0 (nixl_cu13/_api.py, `agent_config.pthrDelay = 0`): a poll that returns at once, so every agent
keeps one core busy while idle (one agent alone, UCX over TCP: 3.0 s of CPU in 3 s). On a GPU host that
is one core of many; here each engine of a pd pair took one of the machine's two cores, for as long as
the pair lived, from every other process of the lab. With a delay of 1 ms the thread sleeps until a UCX
event or the next millisecond (NIXL keeps the periodic wakeup as its workaround for fds that poll does not
wake), so the transfer path is NIXL's and UCX's own, unchanged.
"""

import importlib.abc
import importlib.machinery
import sys

PTHR_DELAY_US = 1000
APIS = ("nixl_cu12._api", "nixl_cu13._api")


class _Bindings:
    """NIXL's compiled bindings, except that an agent is made with the lab's progress-thread delay."""

    def __init__(self, real):
        self._real = real

    def __getattr__(self, name):
        return getattr(self._real, name)

    def nixlAgent(self, name, config):  # noqa: N802 (the binding's own name)
        config.pthrDelay = PTHR_DELAY_US
        return self._real.nixlAgent(name, config)


class _Loader(importlib.abc.Loader):
    def __init__(self, real):
        self.real = real

    def create_module(self, spec):
        return self.real.create_module(spec)

    def exec_module(self, module):
        self.real.exec_module(module)
        module.nixlBind = _Bindings(module.nixlBind)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in APIS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


sys.meta_path.insert(0, _Finder())


# ---------------------------------------------------------------- engine-stall (lab/railyard_lab/faults.py)
# A rank that stops joining its group's collectives while its process keeps running (state S, never T):
# `lab.fault HOST engine-stall` sends STALL_SIGNAL to one `VLLM::Worker*` process (an `VLLM::EngineCore*`
# where the engine has no workers); its main thread parks in lab_fault_engine_stall, so its peers wait in
# the real collective and the engine core in the real shm_broadcast / RPC wait. RELEASE_SIGNAL (the heal)
# lets it go on. vLLM 0.32 (the lab's engine venv) installs no handler for either: it uses SIGTERM, SIGINT
# (and SIGTSTP in `vllm chat`); SIGUSR1/SIGUSR2 appear only in torch.distributed.elastic, which vLLM does
# not run. Every engine process imports this file at start (a worker started by fork inherits the handler).

import signal as _signal
import time as _time

STALL_SIGNAL = _signal.SIGUSR2
RELEASE_SIGNAL = _signal.SIGCONT
_stall = {"on": False}


def _title():
    try:
        with open("/proc/self/cmdline", "rb") as f:
            return f.read().split(b"\0")[0].decode(errors="replace").strip()
    except OSError:
        return ""


def lab_fault_engine_stall(signum, frame):
    """lab.fault engine-stall: this engine rank's main thread sleeps here, in the middle of whatever it was
    doing (waiting for the next broadcast, a step), until the fault is healed; the process stays runnable."""
    if _stall["on"] or not _title().startswith(("VLLM::Worker", "VLLM::EngineCore")):
        return
    _stall["on"] = True
    while _stall["on"]:
        _time.sleep(0.5)


def _lab_fault_engine_stall_release(signum, frame):
    _stall["on"] = False


try:
    _signal.signal(STALL_SIGNAL, lab_fault_engine_stall)
    _signal.signal(RELEASE_SIGNAL, _lab_fault_engine_stall_release)
except ValueError:  # not the main thread of the main interpreter: no handler (never an engine's process)
    pass
