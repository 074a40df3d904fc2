"""Megatron-core on a CPU: the helpers that build and run a model in one process."""
