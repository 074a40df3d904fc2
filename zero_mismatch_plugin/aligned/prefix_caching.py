"""Whether consistent mode keeps vLLM's prefix cache on for a checkpoint.

On where a hit is proven bitwise equal to a miss and to the trainer (dense decoders on CPU), off
elsewhere, saying why; ``ZMRL_ALLOW_PREFIX_CACHING`` overrides. See docs/zero-mismatch.md,
"Prefix caching in consistent mode".
"""

from __future__ import annotations

ALLOW_ENV = "ZMRL_ALLOW_PREFIX_CACHING"
# Platforms whose consistent-mode attention has been measured hit == miss == trainer.
PROVEN_PLATFORMS = ("cpu",)


def unproven_reason(hf_config, platform: str) -> str | None:
    """``None`` when a prefix-cache hit is proven to give the bits of a miss (and of the trainer)
    for this checkpoint on this platform; otherwise why not, as a sentence."""
    from zero_mismatch_plugin.tables.architectures import describe

    if platform not in PROVEN_PLATFORMS:
        return f"prefix-cache hits are not proven bitwise equal to misses on {platform} (only on {', '.join(PROVEN_PLATFORMS)})"
    try:
        blocks = describe(hf_config)
    except NotImplementedError as why:
        return f"prefix-cache hits are proven only for the aligned dense decoders; {why}"
    if blocks.linear_attention is not None:
        # vLLM keeps a linear-attention state per block only in its own mamba caching modes; a hit
        # resuming from such a state is not proven to give a miss's bits here.
        return (f"prefix-cache hits are proven only for the aligned dense decoders; {blocks.architecture} has "
                "linear-attention layers, whose cached states are not proven equal to a recomputation")
    if blocks.moe is not None:
        return (f"prefix-cache hits are proven only for the aligned dense decoders; {blocks.architecture} is a "
                "Mixture-of-Experts model")
    if blocks.mla is not None:
        return (f"prefix-cache hits are proven only for the aligned dense decoders; {blocks.architecture} has "
                "multi-head latent attention (vLLM's CPU platform turns prefix caching off for it too)")
    return None


def keep_prefix_caching(hf_config, platform: str, environ, lora: bool = False) -> tuple[bool, str]:
    """(keep the engine's prefix caching?, why) in consistent mode. ``environ`` holds
    ``ZMRL_ALLOW_PREFIX_CACHING`` when the user set it; ``lora``: the engine serves LoRA adapters."""
    from zero_mismatch_plugin.tables.switches import flag

    allow = flag(ALLOW_ENV, environ)  # "1" / "0" / unset; any other value raises, naming the ones it takes
    if allow is False:
        return False, f"{ALLOW_ENV}=0"
    if allow is True:
        return True, f"{ALLOW_ENV}=1 (kept on whether or not proven)"
    if lora:
        return False, f"prefix-cache hits are not proven with LoRA adapters; set {ALLOW_ENV}=1 to keep it on unverified"
    if hf_config is None:
        return False, "the model config could not be read, so prefix caching is not proven for it"
    reason = unproven_reason(hf_config, platform)
    if reason is None:
        return True, "proven bitwise for this architecture"
    return False, f"{reason}; set {ALLOW_ENV}=1 to keep it on unverified"


def engine_hf_config(args):
    """The transformers config of an ``EngineArgs``' model, or ``None`` when it cannot be read."""
    try:
        from zero_mismatch_plugin.aligned.checkpoint import read_config

        return read_config(
            args.model,
            trust_remote_code=bool(getattr(args, "trust_remote_code", False)),
            revision=getattr(args, "revision", None),
        )
    except Exception:  # noqa: BLE001 - unreadable here means unproven, not an engine failure
        return None
