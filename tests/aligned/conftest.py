"""The aligned-trainer tests run in consistent mode; the shared engine and checkpoint
fixtures live in tests/conftest.py. Tests are grouped by model so each engine starts once."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module", autouse=True)
def consistent_mode():
    """ZMRL_NUMERICS=consistent while this directory's tests run, restored afterwards.

    Engines and trainers read it when they are created (inside these tests); the rest of the test
    session does not see it.
    """
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ZMRL_NUMERICS", "consistent")
        yield
