"""Every environment switch of the plugin, and the one way each is read.

The config checks and the processes that act on a switch both read it through :func:`flag` or
:func:`choice`: exactly the spellings in :data:`SWITCHES`, unset or empty for the default, anything
else a :class:`SwitchError`. Imports nothing heavy: every process of a run imports it. See
docs/recipes.md, "How the switches are read".
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Mapping

NUMERICS = "ZMRL_NUMERICS"
MEGATRON_ALIGNED = "ZMRL_MEGATRON_ALIGNED"
FSDP_ALIGNED = "ZMRL_FSDP_ALIGNED"
ALLOW_PREFIX_CACHING = "ZMRL_ALLOW_PREFIX_CACHING"
ALLOW_UNSUPPORTED_VLLM = "ZMRL_ALLOW_UNSUPPORTED_VLLM"
VERL_PLATFORM = "ZMRL_VERL_PLATFORM"
CPU_ENGINE_ONE_PROCESS = "ZMRL_CPU_ENGINE_ONE_PROCESS"
CPU_ENGINE_FORK = "ZMRL_CPU_ENGINE_FORK"
PREFIX = "ZMRL_"

ON, OFF = "1", "0"


class SwitchError(ValueError):
    """An environment switch set to a value it does not take."""

    def __init__(self, name: str, value: str, expected: str):
        super().__init__(f"{name}={value!r}: expected {expected}")
        self.name = name
        self.value = value
        self.expected = expected

    @property
    def reason(self) -> str:
        """The message without the variable's name, for a report that names it as its key."""
        return f"is {self.value!r}, but must be {self.expected}"


@dataclass(frozen=True)
class Switch:
    name: str
    values: tuple[tuple[str, str], ...]  # (spelling, what it does)
    unset: str  # what leaving it unset (or empty) does
    boolean: bool = False

    def expected(self) -> str:
        spelled = [f"{value!r} ({meaning})" for value, meaning in self.values]
        listed = spelled[0] if len(spelled) == 1 else f"{', '.join(spelled[:-1])} or {spelled[-1]}"
        return f"{listed}; unset or empty: {self.unset}"


def _flag(name: str, on: str, off: str, unset: str) -> Switch:
    return Switch(name, ((ON, on), (OFF, off)), unset, boolean=True)


SWITCHES: dict[str, Switch] = {switch.name: switch for switch in (
    Switch(NUMERICS, (("consistent", "engine and trainer on batch-invariant paths, diff 0"),
                      ("fast", "the engine's fast kernels; trainer and engine bits may differ")),
           "the plugin leaves vLLM untouched"),
    _flag(MEGATRON_ALIGNED, "aligned trainer forward in verl's Megatron engine", "off", "off"),
    _flag(FSDP_ALIGNED, "aligned trainer forward in verl's FSDP engine", "off", "off"),
    _flag(ALLOW_PREFIX_CACHING, "consistent mode keeps prefix caching on, unverified where not proven",
          "consistent mode turns prefix caching off everywhere",
          "consistent mode keeps prefix caching on only where a hit is proven bitwise equal to a miss"),
    _flag(ALLOW_UNSUPPORTED_VLLM, "try a vLLM version the aligned trainer was not tested with", "refuse it",
          "refuse it"),
    Switch(VERL_PLATFORM, (("cpu", "verl's CPU platform, from this plugin"),), "verl detects the accelerator"),
    _flag(CPU_ENGINE_ONE_PROCESS, "a CPU engine of world size 1 runs its model in the EngineCore process "
          "(one thread; starts sooner)", "vLLM's worker process", "vLLM's worker process"),
    _flag(CPU_ENGINE_FORK, f"with {CPU_ENGINE_ONE_PROCESS}=1, that EngineCore is forked from a fork server "
          "that imported vLLM once, and the one-CPU ranks of a multi-rank engine from it (starts sooner)",
          "spawned", "spawned"),
)}


def _declared(name: str) -> Switch:
    try:
        return SWITCHES[name]
    except KeyError:
        raise KeyError(f"{name} is not a switch declared in zero_mismatch_plugin.tables.switches.SWITCHES") from None


def _raw(name: str, environ: Mapping[str, str] | None) -> str | None:
    value = (os.environ if environ is None else environ).get(name)
    return None if value is None or value == "" else value


def _parsed(switch: Switch, environ: Mapping[str, str] | None) -> str | None:
    value = _raw(switch.name, environ)
    if value is None:
        return None
    if not isinstance(value, str) or value not in dict(switch.values):
        raise SwitchError(switch.name, value, switch.expected())
    return value


def flag(name: str, environ: Mapping[str, str] | None = None) -> bool | None:
    """A boolean switch: ``"1"`` True, ``"0"`` False, unset or empty None (its default); anything
    else :class:`SwitchError`. ``environ``: the mapping to read (default ``os.environ``), e.g. the
    ``env_vars`` of a verl config."""
    switch = _declared(name)
    if not switch.boolean:
        raise KeyError(f"{name} is a choice switch: read it with choice()")
    value = _parsed(switch, environ)
    return None if value is None else value == ON


def enabled(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """A boolean switch that is off unless set to ``"1"`` (see :func:`flag`)."""
    return flag(name, environ) is True


def choice(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """A choice switch: one of its listed values, or None when unset or empty; anything else
    :class:`SwitchError`."""
    switch = _declared(name)
    if switch.boolean:
        raise KeyError(f"{name} is a boolean switch: read it with flag()")
    return _parsed(switch, environ)


def check(name: str, environ: Mapping[str, str] | None = None) -> None:
    """Raise :class:`SwitchError` if the switch holds a value it does not take."""
    _parsed(_declared(name), environ)


def shown(name: str, environ: Mapping[str, str] | None = None) -> str:
    """``NAME='value'`` or ``NAME unset``, for a message (not a read: nothing is parsed)."""
    value = (os.environ if environ is None else environ).get(name)
    return f"{name} unset" if value is None else f"{name}={value!r}"


def undeclared(names) -> list[tuple[str, str | None]]:
    """The ``ZMRL_``-prefixed names in ``names`` that are not switches, each with the closest
    switch name (None when nothing is close): a misspelt switch is otherwise ignored."""
    import difflib

    result = []
    for name in names:
        if isinstance(name, str) and name.startswith(PREFIX) and name not in SWITCHES:
            close = difflib.get_close_matches(name, list(SWITCHES), n=1, cutoff=0.6)
            result.append((name, close[0] if close else None))
    return result


# vLLM's per-rank CPU binding of a CPU engine ("0|1": rank 0 on CPU 0, rank 1 on CPU 1).
CPU_THREADS_BIND = "VLLM_CPU_OMP_THREADS_BIND"


# ----- vLLM's CPU KV-cache size ----------------------------------------------------------------

CPU_KV_CACHE_SPACE = "VLLM_CPU_KVCACHE_SPACE"
_WHOLE_NUMBER = re.compile(r"[0-9]+")


def _available_gib() -> int | None:
    """Whole GiB of memory available now (None when it cannot be told)."""
    try:
        import psutil

        return int(psutil.virtual_memory().available // (1 << 30))
    except Exception:  # noqa: BLE001 - no psutil or no /proc: the upper bound is then not checked
        try:
            return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // (1 << 30))
        except (ValueError, OSError, AttributeError):
            return None


def cpu_kv_cache_space(environ: Mapping[str, str] | None = None, available_gib: int | None = None) -> int | None:
    """``VLLM_CPU_KVCACHE_SPACE`` in GiB (None when unset or empty: vLLM sizes the cache itself), or
    :class:`SwitchError` for a value vLLM's CPU engine would die on at start-up: not a whole number
    (vLLM reads it with ``int()``), zero (a cache of 0 bytes), or more than the memory available
    now (vLLM refuses it in its engine core). ``available_gib``: the bound (default: measured)."""
    value = _raw(CPU_KV_CACHE_SPACE, environ)
    if value is None:
        return None
    bound = _available_gib() if available_gib is None else available_gib
    sane = (f"a whole number of GiB from 1 to {bound} (the memory available now)" if bound and bound >= 1
            else "a whole number of GiB, at least 1")
    if not isinstance(value, str) or not _WHOLE_NUMBER.fullmatch(value) or int(value) < 1:
        raise SwitchError(CPU_KV_CACHE_SPACE, value, f"{sane}; unset: vLLM sizes the KV cache itself")
    if bound is not None and int(value) > bound:
        raise SwitchError(CPU_KV_CACHE_SPACE, value,
                          f"{sane}: vLLM's CPU engine refuses a KV cache larger than the available memory")
    return int(value)


def default_cpu_kv_cache_space(default: str = "1") -> int | None:
    """Set ``VLLM_CPU_KVCACHE_SPACE`` to ``default`` GiB unless the environment has it, then check
    it (:func:`cpu_kv_cache_space`); for a process about to start a CPU engine."""
    os.environ.setdefault(CPU_KV_CACHE_SPACE, default)
    return cpu_kv_cache_space()
