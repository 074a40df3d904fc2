"""megatron-core with vLLM's numerics: aligned layer spec, swaps, weight mapping, verl patch.

Importing this package imports neither megatron-core nor vLLM; the submodules do.
"""
