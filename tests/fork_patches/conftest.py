"""Fixtures of the fork-patch modules: the manifest, and megatron-core with its patches applied."""

from __future__ import annotations

import pytest

from zero_mismatch_plugin import fork_patches


@pytest.fixture(scope="module")
def manifest():
    return fork_patches.load_manifest()


@pytest.fixture(scope="module")
def patched_megatron(tmp_path_factory, manifest):
    """A full copy of the installed megatron-core with the megatron-lm patches applied."""
    return fork_patches.copy_patched_package(manifest, "megatron-lm", tmp_path_factory.mktemp("patched-megatron"))
