"""vLLM engines shared by every test module of a session (of an xdist worker), keyed by engine configuration.

An engine start costs 20-50 s on a 2-core CPU, most of the suite's time. Two requests get the same
engine when they name the same checkpoint, the same engine arguments, and the same plugin switches
(``ZMRL_*``, ``VLLM_*``) at start-up, the settings vLLM's processes read when they start. A test
that changes an engine's weights gives it back with :meth:`EnginePool.discard`.
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict

# Alive at once per worker: each engine holds its KV cache (VLLM_CPU_KVCACHE_SPACE, 1 GiB in the
# suite) and one process that imported vLLM (ZMRL_CPU_ENGINE_ONE_PROCESS; two without it). Three
# started as many engines (37) as two: the next module's configuration rarely matches either.
DEFAULT_CAPACITY = 2
CAPACITY_ENV = "ZMRL_TEST_ENGINE_POOL_SIZE"
ENVIRONMENT_PREFIXES = ("ZMRL_", "VLLM_")


def _environment() -> tuple:
    return tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith(ENVIRONMENT_PREFIXES)))


def engine_key(engine_args: dict) -> tuple:
    return (tuple(sorted((k, repr(v)) for k, v in engine_args.items())), _environment())


class EnginePool:
    """Lazily started ``vllm.LLM`` engines, the least recently used shut first beyond ``capacity``."""

    def __init__(self, capacity: int | None = None):
        self.capacity = capacity or int(os.environ.get(CAPACITY_ENV) or DEFAULT_CAPACITY)
        self._alive: OrderedDict[tuple, object] = OrderedDict()
        self.started: list[tuple[str, float]] = []  # (model, seconds) per start
        self.reused = 0

    def get(self, checkpoint, scope=None, **overrides):
        """The engine of ``engine_args_for(checkpoint, **overrides)`` under the current environment;
        one of its own for each ``scope`` given (an engine with LoRA caches adapters by their id,
        which another module may give to another adapter)."""
        from zero_mismatch_plugin.aligned.runtime import engine_args_for

        args = engine_args_for(checkpoint, **overrides)
        key = (scope, engine_key(args))
        if key in self._alive:
            self._alive.move_to_end(key)
            self.reused += 1
            return self._alive[key]
        while len(self._alive) >= self.capacity:
            self._shut(next(iter(self._alive)))
        from vllm import LLM

        began = time.monotonic()
        llm = LLM(**args)
        self.started.append((os.path.basename(str(checkpoint)), time.monotonic() - began))
        # Keyed by the environment after the start: the first start in a process writes variables of
        # vLLM's own (VLLM_WORKER_MULTIPROC_METHOD, ...), which every later request then sees.
        self._alive[(scope, engine_key(args))] = llm
        return llm

    def drop(self, checkpoint, scope=None, **overrides) -> None:
        """Shut the engine :meth:`get` would return for these arguments, if one is alive (none is started)."""
        from zero_mismatch_plugin.aligned.runtime import engine_args_for

        key = (scope, engine_key(engine_args_for(checkpoint, **overrides)))
        if key in self._alive:
            self._shut(key)

    def discard(self, llm) -> None:
        """Shut ``llm`` now (its weights or state no longer match its checkpoint)."""
        for key, alive in list(self._alive.items()):
            if alive is llm:
                self._shut(key)

    def make_room(self, engines: int = 1) -> None:
        """Shut the least recently used engines until ``engines`` more fit (for a test that starts
        an engine of its own, outside the pool)."""
        while self._alive and len(self._alive) + engines > self.capacity:
            self._shut(next(iter(self._alive)))

    def close(self) -> None:
        while self._alive:
            self._shut(next(iter(self._alive)))

    def _shut(self, key) -> None:
        from zero_mismatch_plugin.aligned.runtime import shutdown_engine

        shutdown_engine(self._alive.pop(key))
