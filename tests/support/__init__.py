"""Helpers the tests share: engines and rollouts, verl batches, bitwise checks, planted faults, the bad-input table."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
