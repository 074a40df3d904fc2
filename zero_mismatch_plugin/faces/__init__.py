"""The trainer faces over the op layer: the aligned model, Megatron, and verl's FSDP actor."""

from __future__ import annotations

from zero_mismatch_plugin.tables.architectures import TRAINER_FACES, Blocks, describe


def precheck(config, face: str = "aligned") -> Blocks:
    """:func:`~zero_mismatch_plugin.tables.architectures.describe` for the trainer ``face`` (one of
    :data:`~zero_mismatch_plugin.tables.architectures.TRAINER_FACES`), before any engine, model or
    trainer is built: raises ``NotImplementedError`` naming every setting that face does not cover
    and what to change (for "megatron" also the Megatron face's own refusals: multi-head latent
    attention, and those of :func:`.megatron.convert.megatron_blocks`, imported, with torch, for
    that face only). ``config`` is the checkpoint's transformers config (its ``AutoConfig``); for a
    checkpoint directory, worded for the command line, see ``checker.checkpoint_inputs.precheck_model``."""
    if face not in TRAINER_FACES:
        raise ValueError(f"unknown trainer face {face!r}; expected one of {', '.join(TRAINER_FACES)}")
    blocks = describe(config)
    if face != "megatron":
        return blocks
    what = blocks.aligned_model_only()
    if what is not None:
        raise NotImplementedError(
            f"{blocks.architecture}: not supported by the Megatron face: {what} (the aligned trainer model covers it)"
        )
    from zero_mismatch_plugin.faces.megatron.convert import megatron_blocks

    try:
        megatron_blocks(config)
    except ValueError as error:
        raise NotImplementedError(f"{blocks.architecture}: not supported by the Megatron face: {error}") from None
    return blocks
