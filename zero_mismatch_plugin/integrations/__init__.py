"""Integrations by upstream (vLLM, verl, Megatron), with the one runtime-patch mechanism."""
