"""The op layer's tests run in consistent mode (the fixture is tests/conftest.py's)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module", autouse=True)
def _every_module_in_consistent_mode(consistent_mode):
    yield
