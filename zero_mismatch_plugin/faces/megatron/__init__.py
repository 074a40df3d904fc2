"""megatron-core with vLLM's numerics: replacement modules, aligned layer spec, swaps, weight mapping, LoRA.

Importing this package imports neither megatron-core nor vLLM; the submodules do.
"""
