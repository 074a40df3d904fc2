"""The two ways a runtime patch of vLLM is declared: always (when the plugin is active) or only in
consistent mode on CPU, both gated on the vLLM pin of :mod:`zero_mismatch_plugin.tables.upstream_versions`.
Every ``vllm_*`` module declares its patches with these."""

from __future__ import annotations

from functools import partial

from zero_mismatch_plugin.tables import upstream_versions
from zero_mismatch_plugin.integrations.patches import patch_at

SUPPORTED_VLLM_VERSIONS = upstream_versions.VLLM
CONSISTENT_ON_CPU = "ZMRL_NUMERICS=consistent on CPU"

# A runtime patch of a vLLM function (see runtime_patches.patch_at for the target's form).
vllm_patch = partial(patch_at, package="vllm", versions=SUPPORTED_VLLM_VERSIONS)
# One applied only in consistent mode on CPU.
consistent_cpu_vllm_patch = partial(vllm_patch, when=CONSISTENT_ON_CPU)
