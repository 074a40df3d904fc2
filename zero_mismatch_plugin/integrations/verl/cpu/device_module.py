"""The ``torch.<device>`` namespace verl calls through ``get_torch_device()``, for the CPU.

verl treats the device module as ``torch.cuda``: it empties caches, reads memory figures, moves
RNG states and makes streams and events. ``torch.cpu`` has streams and events but none of the
memory or RNG functions, so this namespace fills them in with what they mean on a CPU: there is
no device cache to empty, the memory figures are the host's, and the RNG is torch's global one.
"""

from __future__ import annotations

import types

import torch


def _host_memory() -> tuple[int, int]:
    import psutil

    memory = psutil.virtual_memory()
    return int(memory.available), int(memory.total)


def _nothing(*args, **kwargs) -> None:
    """Cache, IPC and allocator calls: a CPU has no device memory pool to manage."""
    return None


def _zero_bytes(*args, **kwargs) -> int:
    """Device-memory counters: nothing lives in device memory on a CPU."""
    return 0


def _mem_get_info(device=None) -> tuple[int, int]:
    """(free, total) bytes, as ``torch.cuda.mem_get_info``: the host's memory."""
    return _host_memory()


def _get_rng_state(device=None) -> torch.Tensor:
    return torch.get_rng_state()


def _set_rng_state(state: torch.Tensor, device=None) -> None:
    torch.set_rng_state(state)


def _get_device_name(device=None) -> str:
    return "cpu"


def _manual_seed(seed: int) -> None:
    torch.manual_seed(seed)


def build_cpu_device_module() -> types.ModuleType:
    """A module object with ``torch.cpu``'s functions plus the ones verl expects of a device."""
    module = types.ModuleType("zero_mismatch_plugin.integrations.verl.cpu.device", __doc__)
    for name in dir(torch.cpu):
        if not name.startswith("_"):
            setattr(module, name, getattr(torch.cpu, name))
    for name in ("empty_cache", "ipc_collect", "reset_peak_memory_stats", "set_per_process_memory_fraction"):
        setattr(module, name, _nothing)
    for name in ("memory_allocated", "memory_reserved", "max_memory_allocated", "max_memory_reserved"):
        setattr(module, name, _zero_bytes)
    module.mem_get_info = _mem_get_info
    module.get_rng_state = _get_rng_state
    module.set_rng_state = _set_rng_state
    module.get_device_name = _get_device_name
    module.manual_seed = _manual_seed
    module.manual_seed_all = _manual_seed
    return module


CPU_DEVICE_MODULE = build_cpu_device_module()
