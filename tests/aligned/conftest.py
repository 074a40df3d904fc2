"""The aligned-trainer tests run in consistent mode; the shared engine and checkpoint
fixtures live in tests/conftest.py. Tests are grouped by model so each engine starts once."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module", autouse=True)
def consistent_mode():
    """Consistent numerics while this directory's tests run, undone afterwards.

    Engines read ZMRL_NUMERICS when they are created (inside these tests), a GPU trainer needs
    vLLM's batch-invariant mode in this process; the rest of the test session sees neither.
    """
    from zero_mismatch_plugin.aligned.numerics import consistent_numerics

    with consistent_numerics():
        yield
