"""The trainer faces over the op layer: the aligned model, Megatron, and verl's FSDP actor."""
