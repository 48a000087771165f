"""The serving engines and the components beside them, one module each (vllm; lmcache, litellm).

An engine is the program that serves the model in a layout's containers. What the generic code (the
executor, the launch timeline, health, `plan --against-engine`) reads from one is this contract, an
`Engine` subclass that registers itself by name (`class Vllm(Engine, name="vllm")`):

    serves(command)          True when a container's command runs this engine
    milestones_of(command)   the bring-up MILESTONES its log can show for that command
    milestone_of(line)       which milestone a log line marks, or None
    milestone_grep           what `grep -F` keeps of a log before milestone_of reads it
    kv_line / kv_lines(log)  the line each engine core prints once its KV cache is sized, parsed by DP rank
    progress                 the /metrics counters that move while it makes tokens (hung or busy)
    metric_engines(text)     the engine labels its /metrics carries
    summarize_metrics(m)     the figures health shows from its /metrics
    prefetch(vars)           what a first start fetches that sync-model stages for offline hosts (a Prefetch), or None

`of(svc)` is the engine a service runs (None for a proxy, a cache server, a router); generic code
asks it and never imports an engine's module.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Sequence

from ..plan.spec import Service
from ..transport import Result, Sh

# the bring-up milestones of one engine container, in order, and their column labels (`inv launch`)
MILESTONES = ("weights_loaded", "kv_cache_allocated", "engine_initialised", "api_ready")
MILESTONE_LABELS = {"weights_loaded": "weights loaded", "kv_cache_allocated": "KV cache",
                    "engine_initialised": "engine initialised", "api_ready": "API ready"}

_REGISTRY: dict[str, type["Engine"]] = {}


@dataclass(frozen=True)
class KvLine:
    """One engine core's KV cache line."""

    dp: int          # its DP rank (0 without a DP suffix)
    tokens: int
    device: str      # GPU (CUDA), CPU (the CPU build), ...
    line: str


STAGED_MARK = "railyard-staged.json"   # the record a staged folder holds of what it holds (a launch looks for it)


@dataclass(frozen=True)
class Staged:
    """What a staging run said: one line of what it staged (or found staged, or had nothing to stage), its figures,
    or why it failed."""

    line: str
    detail: dict
    error: str | None = None


@dataclass(frozen=True)
class Prefetch:
    """A folder an engine reads at its first start, staged on sync-model's source by `command` (`stdin` fed to it),
    read back by `parse`, then copied to every host like the checkpoint; each engine container mounts it (a Mount of
    kind "staged") and a launch refuses a host whose folder holds no STAGED_MARK."""

    path: str
    what: str
    command: Sh
    stdin: bytes
    parse: Callable[[Result], Staged]


class Engine:
    """A serving engine. Subclass with `name=` to register it."""
    name: ClassVar[str]
    kv_line: ClassVar[str]
    milestone_grep: ClassVar[tuple[str, ...]]
    progress: ClassVar[tuple[str, ...]]

    def __init_subclass__(cls, name: str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if name:
            if name in _REGISTRY:
                raise TypeError(f"engine {name!r} registered twice ({_REGISTRY[name].__module__}, {cls.__module__})")
            cls.name = name
            _REGISTRY[name] = cls

    def serves(self, command: Sequence[str]) -> bool:
        raise NotImplementedError

    def milestones_of(self, command: Sequence[str]) -> tuple[str, ...]:
        return MILESTONES

    def milestone_of(self, line: str) -> str | None:
        raise NotImplementedError

    def kv_lines(self, log: str) -> dict[int, KvLine]:
        raise NotImplementedError

    def kv_cache(self, log: str) -> dict[int, int]:
        """DP rank -> KV tokens; an engine core that prints its line twice counts once."""
        return {dp: e.tokens for dp, e in self.kv_lines(log).items()}

    def metric_engines(self, text: str) -> set[str]:
        raise NotImplementedError

    def summarize_metrics(self, m: dict) -> dict:
        raise NotImplementedError

    def prefetch(self, v: dict) -> Prefetch | None:
        return None


def _registry() -> dict[str, type[Engine]]:
    """Every engine, by name: importing an engine's module registers it."""
    importlib.import_module(".vllm", __name__)
    return _REGISTRY


def names() -> tuple[str, ...]:
    return tuple(_registry())


def by_name(name: str) -> Engine:
    return _registry()[name]()


def prefetches(v: dict) -> list[Prefetch]:
    """What the engines railyard knows would fetch at a first start on a host with these variables, to stage."""
    return [p for p in (cls().prefetch(v) for cls in _registry().values()) if p is not None]


def of(svc: Service) -> Engine | None:
    """The engine the service's container runs, or None (a proxy, a cache server, a router)."""
    words = [str(w) for w in svc.spec.command]
    return next((engine for engine in (cls() for cls in _registry().values()) if engine.serves(words)), None)


__all__ = ["Engine", "KvLine", "MILESTONES", "MILESTONE_LABELS", "Prefetch", "STAGED_MARK", "Staged", "by_name",
           "names", "of", "prefetches"]
