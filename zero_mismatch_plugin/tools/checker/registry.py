"""The trainer backends the checker can compare with the engine, by name.

Registered as ``"module:callable"`` strings, imported only when chosen (see
:func:`.backends.load_backend`). Light on purpose: the command line reads the names without
importing torch.
"""

TRAINER_BACKENDS: dict[str, str] = {
    "aligned": "zero_mismatch_plugin.tools.checker.backends:AlignedBackend",
    "hf": "zero_mismatch_plugin.tools.checker.backends:HFBackend",
    "megatron": "zero_mismatch_plugin.tools.checker.megatron_backend:megatron_backend",
}

# Trainers the command line accepts. One of them missing from TRAINER_BACKENDS (an installation
# that took it out) is reported as not available instead of being rejected as an unknown name.
KNOWN_TRAINERS = tuple(TRAINER_BACKENDS)
