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
