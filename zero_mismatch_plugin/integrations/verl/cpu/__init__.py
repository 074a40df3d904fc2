"""verl's own trainer on a CPU: a CPU platform for verl's registry and the patches it needs.

Opt in with ``ZMRL_VERL_PLATFORM=cpu``. Importing this package then registers
:class:`~.platform.PlatformCPU` under the name ``cpu`` and selects it (``VERL_PLATFORM=cpu``)
in this process, and applies the CPU runtime patches of :mod:`.patches`. Without the variable
importing it changes nothing and imports nothing heavy. verl imports it in every process when
it is named in ``VERL_USE_EXTERNAL_MODULES`` (or when the plugin's ``verl.plugins`` entry point
imports it).
"""

from __future__ import annotations

from zero_mismatch_plugin.integrations.verl.cpu.registration import ENABLE_ENV, register_if_enabled, register_loudly, unregister

__all__ = ["ENABLE_ENV", "register_if_enabled", "register_loudly", "unregister"]

register_loudly()
