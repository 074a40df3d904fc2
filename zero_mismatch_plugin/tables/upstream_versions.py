"""The upstream releases this package's run-time patches and the aligned trainer's vLLM check are
written and tested against: the one table their version gates read. A new release is one edit
here; every patch of that upstream then refuses to apply until it is checked against it. (The
fork patches carry their own pins in ``fork_patches/diffs/manifest.yaml``.)"""

VLLM = ("0.31.0",)
VERL = ("0.9.1",)
TRANSFORMERS = ("5.10.4",)
MEGATRON_CORE = ("0.16.1",)
# verl's mbridge backend (vanilla_mbridge=True): how verl 0.9.1 builds Megatron models on a CPU.
MBRIDGE = ("0.15.1",)
