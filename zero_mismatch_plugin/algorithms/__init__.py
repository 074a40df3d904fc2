"""The seeds' formulas as framework-free torch functions, and per-token metrics of the mismatch."""
