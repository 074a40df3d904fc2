"""The vLLM releases the plugin's runtime patches of vLLM's code were written and tested against,
and the two ways such a patch is declared: always (when the plugin is active) or only in
consistent mode on CPU. Every ``vllm_*`` module declares its patches with these, so a new vLLM
release is one edit here and each patch then refuses to apply until it is checked against it."""

from __future__ import annotations

from functools import partial

from zero_mismatch_plugin import upstream_versions
from zero_mismatch_plugin.runtime_patches import patch_at

SUPPORTED_VLLM_VERSIONS = upstream_versions.VLLM
CONSISTENT_ON_CPU = "ZMRL_NUMERICS=consistent on CPU"

# A runtime patch of a vLLM function (see runtime_patches.patch_at for the target's form).
vllm_patch = partial(patch_at, package="vllm", versions=SUPPORTED_VLLM_VERSIONS)
# One applied only in consistent mode on CPU.
consistent_cpu_vllm_patch = partial(vllm_patch, when=CONSISTENT_ON_CPU)
