"""verl's own trainer on a CPU: a CPU platform for verl's registry and the patches it needs.

Opt in with ``ZMRL_VERL_PLATFORM=cpu``: importing this package then registers and selects
:class:`~.platform.PlatformCPU` and applies :mod:`.patches`; without it, importing changes nothing
and imports nothing heavy. See docs/recipes.md, "verl's own trainer on a CPU".
"""

from __future__ import annotations

from zero_mismatch_plugin.integrations.verl.cpu.registration import ENABLE_ENV, register_if_enabled, register_loudly, unregister

__all__ = ["ENABLE_ENV", "register_if_enabled", "register_loudly", "unregister"]

register_loudly()
