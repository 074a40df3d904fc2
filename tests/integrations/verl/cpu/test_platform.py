"""The CPU platform: chosen only on opt-in, registered through verl's platform registry,
reversible, and refusing settings it cannot honour with a message that says what to change."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from support import preloaded_python

OPT_IN = {"ZMRL_VERL_PLATFORM": "cpu", "VERL_USE_EXTERNAL_MODULES": "zero_mismatch_plugin.integrations.verl.cpu"}

PROBE = (
    "import verl\n"
    "from verl.utils.device import get_device_name, get_nccl_backend, get_resource_name\n"
    "from verl.plugin.platform import get_platform\n"
    "print(get_device_name(), get_nccl_backend(), get_resource_name(), type(get_platform()).__name__)\n"
)


def _environment(**env: str) -> dict:
    clean = {k: v for k, v in os.environ.items()
             if k not in ("ZMRL_VERL_PLATFORM", "VERL_PLATFORM", "VERL_USE_EXTERNAL_MODULES", "VERL_ENGINE_DEVICE")}
    return {**clean, **env}


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    """``python -c code`` in an interpreter that has not imported verl (support/preloaded_python.py)."""
    return preloaded_python.shared().run(code, env=_environment(**env), timeout=240)


def test_opted_in_process_resolves_verl_platform_to_cpu_with_gloo():
    result = _run(PROBE, **OPT_IN)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["cpu", "gloo", "GPU", "PlatformCPU"]


def test_without_opt_in_verl_keeps_its_own_detection():
    # Negative control: the module is imported, but without ZMRL_VERL_PLATFORM it registers nothing.
    result = _run(PROBE, VERL_USE_EXTERNAL_MODULES="zero_mismatch_plugin.integrations.verl.cpu")
    assert result.returncode == 0, result.stderr
    device, backend, _, platform = result.stdout.split()
    assert (device, platform) != ("cpu", "PlatformCPU") and backend != "gloo"


def test_unknown_platform_name_is_refused_with_what_to_set():
    result = _run("import verl", ZMRL_VERL_PLATFORM="tpu", VERL_USE_EXTERNAL_MODULES="zero_mismatch_plugin.integrations.verl.cpu")
    assert result.returncode != 0
    assert "ZMRL_VERL_PLATFORM='tpu'" in result.stderr and "ZMRL_VERL_PLATFORM=cpu" in result.stderr


def test_conflicting_verl_platform_is_refused():
    result = _run("import verl", VERL_PLATFORM="nvidia", **OPT_IN)
    assert result.returncode != 0
    assert "VERL_PLATFORM='nvidia'" in result.stderr and "unset one of them" in result.stderr


def test_opting_in_after_verl_resolved_another_platform_is_refused():
    code = (
        "import os, verl\n"
        "from verl.plugin.platform import get_platform\n"
        "get_platform()\n"
        "os.environ['ZMRL_VERL_PLATFORM'] = 'cpu'\n"
        "from zero_mismatch_plugin.integrations.verl.cpu import register_if_enabled\n"
        "register_if_enabled()\n"
    )
    result = _run(code)
    assert result.returncode != 0
    assert "already resolved its platform to 'cuda'" in result.stderr


def test_unregister_restores_registry_environment_and_patches(monkeypatch):
    from verl.plugin.platform import PlatformRegistry

    from verl.plugin.platform import platform_manager

    from zero_mismatch_plugin.integrations.verl.cpu import patches, registration

    # Other tests in this process may have let verl resolve its default platform already.
    monkeypatch.setattr(platform_manager, "_current_platform", None)
    monkeypatch.setenv("ZMRL_VERL_PLATFORM", "cpu")
    monkeypatch.delenv("VERL_PLATFORM", raising=False)
    monkeypatch.setenv("VERL_ENGINE_DEVICE", "npu")  # the user's own choice must survive
    assert registration.register_if_enabled()
    assert os.environ["VERL_PLATFORM"] == "cpu" and os.environ["VERL_ENGINE_DEVICE"] == "npu"
    assert PlatformRegistry.get("cpu") is not None
    assert all(patches.is_applied(p) or patches.is_pending(p) for p in patches.PATCHES)
    registration.unregister()
    assert "VERL_PLATFORM" not in os.environ
    assert PlatformRegistry.get("cpu") is None
    assert not any(patches.is_applied(p) or patches.is_pending(p) for p in patches.PATCHES)


def test_platform_answers_without_cuda():
    from zero_mismatch_plugin.integrations.verl.cpu.platform import PlatformCPU

    platform = PlatformCPU()
    assert platform.is_available() and not platform.is_platform_available(use_smi_check=True)
    assert platform.ray_resource_options(0.5) == {"num_gpus": 0.5}
    assert platform.get_device_capability() == (None, None) and platform.cudart() is None
    assert not platform.is_ipc_supported()
    # verl moves modules with .to(get_device_id()): an int would mean an accelerator index.
    assert torch.zeros(1).to(platform.current_device()).device.type == "cpu"
    with platform.nvtx_range("step"):
        pass


def test_device_module_gives_host_memory_and_the_global_rng():
    from zero_mismatch_plugin.integrations.verl.cpu.device_module import CPU_DEVICE_MODULE as device

    free, total = device.mem_get_info()
    assert 0 < free <= total
    state = device.get_rng_state()
    first = torch.rand(3)
    device.set_rng_state(state)
    assert torch.equal(torch.rand(3), first)
    assert device.memory_allocated() == 0 and device.empty_cache() is None
    assert device.current_device() == torch.cpu.current_device()



def test_a_failed_opt_in_is_logged_at_error_level_not_only_raised():
    # verl swallows entry-point exceptions at DEBUG: the log line is what the user sees.
    code = ("import verl\n"
            "try:\n    import zero_mismatch_plugin.integrations.verl.cpu\nexcept ValueError:\n    print('raised')\n")
    result = _run(code, ZMRL_VERL_PLATFORM="tpu")
    assert "raised" in result.stdout
    assert "CPU platform could NOT be set up" in result.stderr


def test_importing_the_package_without_opt_in_loads_nothing_heavy():
    code = ("import sys\nimport zero_mismatch_plugin.integrations.verl.cpu\n"
            "print(sorted(m for m in ('verl', 'torch', 'vllm') if m in sys.modules))\n")
    # A fresh interpreter: the preloaded one has torch already.
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240,
                            env=_environment())
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["[]"]
