"""Runtime patch of verl's FSDP engine: the actor's logprobs from vLLM's kernels.

Enabled by ``ZMRL_FSDP_ALIGNED=1`` (:func:`maybe_apply`, from the plugin's verl entry point) or
by :func:`apply`; :func:`remove` puts verl's methods back. The actor's ``forward_step`` runs the
aligned forward of :mod:`zero_mismatch_plugin.faces.fsdp`; what changes and why: docs/fsdp.md.
"""

from __future__ import annotations

import logging
from functools import partial, wraps

from zero_mismatch_plugin.faces.fsdp import (
    AlignedFSDPForward,
    PackedMicroBatch,
    UnsupportedFSDPFeature,
    aligned_log_probs,
    causal_lm,
    peft_lora_config,
    uninstall_all,
)
from zero_mismatch_plugin.integrations.patches import apply as apply_patch
from zero_mismatch_plugin.integrations.patches import is_applied, is_pending, patch_at
from zero_mismatch_plugin.integrations.patches import remove as remove_patch
from zero_mismatch_plugin.tables import upstream_versions
from zero_mismatch_plugin.tables.switches import FSDP_ALIGNED, enabled

logger = logging.getLogger("zero_mismatch_plugin")

ENABLE_ENV = FSDP_ALIGNED
SUPPORTED_VERL_VERSIONS = upstream_versions.VERL
ENGINE_MODULE = "verl.workers.engine.fsdp.transformer_impl"

_STATE_ATTR = "_zmrl_fsdp_aligned"
_GENERATION_ATTR = "_zmrl_weights_generation"


def enabled_by_env() -> bool:
    """``"1"`` on, ``"0"`` or unset off; any other value raises (:mod:`zero_mismatch_plugin.tables.switches`)."""
    return enabled(ENABLE_ENV)


# ----- verl's micro-batch in the packed layout -----------------------------------------------


def packed_micro_batch(micro_batch) -> PackedMicroBatch:
    """verl's no-padding micro-batch (jagged ``input_ids`` / ``position_ids``) as one packed batch."""
    import torch
    from verl.utils import tensordict_utils as tu
    from verl.utils.dataset.dataset_utils import DatasetPadMode

    pad_mode = tu.get_non_tensor_data(data=micro_batch, key="pad_mode", default=DatasetPadMode.NO_PADDING)
    if pad_mode != DatasetPadMode.NO_PADDING:
        raise UnsupportedFSDPFeature(f"the aligned FSDP forward reads verl's no-padding batches; got pad_mode {pad_mode}")
    input_ids = micro_batch["input_ids"]
    position_ids = micro_batch["position_ids"]
    if position_ids.dim() == 3:
        raise UnsupportedFSDPFeature("multi-dimensional (mrope) position_ids: vision-language models are not covered")
    ids = input_ids.values()
    cu_seqlens = input_ids.offsets().to(torch.long)
    seq_lens = [int(n) for n in cu_seqlens.diff().tolist()]
    temperature = micro_batch["temperature"]
    if not isinstance(temperature, torch.Tensor):
        temperature = torch.full((len(seq_lens),), float(temperature))
    temperature = temperature.to(device=ids.device, dtype=torch.float32).reshape(-1)
    if temperature.numel() != len(seq_lens):
        raise ValueError(f"one temperature per sequence expected, got {temperature.numel()} for {len(seq_lens)}")
    # verl's guard for padding rows (temperature 0 would divide by zero).
    temperature = temperature.clamp(min=1e-8)
    return PackedMicroBatch(
        input_ids=ids,
        positions=position_ids.values().to(torch.long),
        seq_lens=seq_lens,
        cu_seqlens=cu_seqlens,
        labels=torch.roll(ids, shifts=-1, dims=0),
        temperature=temperature.repeat_interleave(torch.tensor(seq_lens, device=ids.device)),
    )


# ----- the engine side ----------------------------------------------------------------------


def _unwrapped(module):
    return getattr(module, "_fsdp_wrapped_module", module)


def check_engine_supported(engine) -> None:
    """Refuse the engine settings the aligned forward does not reproduce, naming what to change."""
    problems = []
    lora_sync = getattr(getattr(engine, "model_config", None), "lora", None) or {}
    if getattr(engine, "_is_lora", False) and lora_sync.get("merge", False):
        problems.append("LoRA synced merged (the rollout serves W + s BA, not the adapter the aligned forward "
                        "runs): set actor_rollout_ref.model.lora.merge=false")
    if getattr(engine, "ulysses_sequence_parallel_size", 1) > 1:
        problems.append("Ulysses sequence parallelism: set actor_rollout_ref.actor.ulysses_sequence_parallel_size=1")
    if getattr(engine, "_qat_enabled", False):
        problems.append("quantization-aware training: turn off actor_rollout_ref.actor.fsdp_config.qat.enable")
    if getattr(engine.engine_config, "strategy", "fsdp2") not in ("fsdp2", None):
        problems.append(f"strategy {engine.engine_config.strategy!r}: the aligned forward runs on FSDP2 "
                        "(fully_shard) units; set actor_rollout_ref.actor.strategy=fsdp2")
    if problems:
        raise UnsupportedFSDPFeature(f"{ENABLE_ENV}=1 but verl's FSDP engine runs with " + "; ".join(problems)
                                     + f". Fix these or unset {ENABLE_ENV} (diff 0 then cannot hold).")


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def aligned_state(engine) -> AlignedFSDPForward:
    """The engine's aligned forward, built on first use from the checkpoint the actor loaded, in
    the dtype its forward computes in (the rollout must serve the same checkpoint in that dtype)."""
    state = getattr(engine, _STATE_ATTR, None)
    if state is None:
        from zero_mismatch_plugin.aligned import numerics
        from zero_mismatch_plugin.aligned.runtime import VllmRuntime

        check_engine_supported(engine)
        if numerics.is_consistent():
            # The trainer side of the switch in the actor's worker, kept for the worker's life
            # (vLLM's batch-invariant mode on a GPU; on a CPU the trainer follows ZMRL_NUMERICS).
            numerics.enable_consistent_numerics()
        root = _unwrapped(engine.module)
        dtype = getattr(engine, "_autocast_dtype", None) or next(root.parameters()).dtype
        lora_config = peft_lora_config(root)
        lora_args = {}
        if lora_config is not None:
            from zero_mismatch_plugin.aligned.lora.peft import lora_engine_args_for_rank

            lora_args = lora_engine_args_for_rank(lora_config.r)  # the rollout's max_lora_rank (verl's rule)
        runtime = VllmRuntime(engine.model_config.local_path, dtype=_dtype_name(dtype), **lora_args)
        state = AlignedFSDPForward(runtime, causal_lm(root).config, lora_config)
        setattr(engine, _STATE_ATTR, state)
        logger.warning("zero-mismatch: verl FSDP actor (%s, %s): logprobs from vLLM's kernels (%s)",
                       state.blocks.architecture, _dtype_name(dtype), runtime.platform)
    if getattr(engine, _GENERATION_ATTR, 0) != state.generation:
        state.mark_stale()
        state.generation = getattr(engine, _GENERATION_ATTR, 0)
    return state


def _micro_batch_problems(micro_batch) -> list[str]:
    from verl.utils import tensordict_utils as tu

    problems = []
    for key, what in (("use_fused_kernels", "actor_rollout_ref.model.use_fused_kernels=false"),
                      ("distillation_use_topk", "no top-k distillation"),
                      ("distillation_only", "no distillation-only forward")):
        if tu.get_non_tensor_data(data=micro_batch, key=key, default=False):
            problems.append(what)
    if "multi_modal_inputs" in micro_batch.keys():
        from verl.utils.model import extract_multi_modal_inputs

        # verl carries the key for text-only batches too (one empty entry per sample).
        if extract_multi_modal_inputs(micro_batch["multi_modal_inputs"]):
            problems.append("text-only inputs (no multi_modal_inputs)")
    return problems


def aligned_forward_step(engine, micro_batch, loss_function, forward_only):
    """``FSDPEngineWithLMHead.forward_step`` with the logprobs (and entropy / sum pi^2 when verl
    asks for them) from the aligned forward; returns what verl's returns."""
    import torch

    from verl.utils import tensordict_utils as tu
    from verl.utils.device import get_device_id, get_device_name

    micro_batch = micro_batch.to(get_device_id())
    problems = _micro_batch_problems(micro_batch)
    if problems:
        raise UnsupportedFSDPFeature(f"{ENABLE_ENV}=1: the aligned FSDP forward needs " + "; ".join(problems))
    state = aligned_state(engine)
    batch = packed_micro_batch(micro_batch)
    logits = state.logits(engine.module, batch)
    log_probs, scaled = aligned_log_probs(logits, batch)
    nested = partial(torch.nested.nested_tensor_from_jagged, offsets=batch.cu_seqlens)
    model_output = {"log_probs": nested(log_probs)}
    if tu.get_non_tensor_data(data=micro_batch, key="calculate_entropy", default=False):
        model_output["entropy"] = nested(engine.compute_entropy_from_logits(scaled))
    if tu.get_non_tensor_data(data=micro_batch, key="calculate_sum_pi_squared", default=False):
        from verl.utils import torch_functional as verl_F

        model_output["sum_pi_squared"] = nested(verl_F.calculate_sum_pi_squared_from_logits(scaled))
    if loss_function is not None:
        loss, metrics = loss_function(model_output=model_output, data=micro_batch,
                                      dp_group=engine.get_data_parallel_group())
    else:
        assert forward_only, "forward_only must be True when loss_function is None"
        loss = torch.tensor(1.0, device=get_device_name())
        metrics = {}
    output = {"model_output": _detach_tree(model_output), "loss": loss.detach().item(), "metrics": metrics}
    return loss, output


def _detach_tree(model_output: dict) -> dict:
    return {key: value.detach() for key, value in model_output.items()}


# ----- the patches --------------------------------------------------------------------------


def _is_actor_engine(engine) -> bool:
    import importlib

    return not isinstance(engine, importlib.import_module(ENGINE_MODULE).FSDPEngineWithValueHead)


def _aligned_forward_step(original):
    @wraps(original)
    def forward_step(self, micro_batch, loss_function, forward_only):
        if not _is_actor_engine(self):
            return original(self, micro_batch, loss_function, forward_only)
        return aligned_forward_step(self, micro_batch, loss_function, forward_only)

    return forward_step


def _new_weights_after(original):
    @wraps(original)
    def method(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        setattr(self, _GENERATION_ATTR, getattr(self, _GENERATION_ATTR, 0) + 1)
        return result

    return method


fsdp_patch = partial(patch_at, package="verl", versions=SUPPORTED_VERL_VERSIONS, when=f"{ENABLE_ENV}=1")

FORWARD_STEP = fsdp_patch(
    f"{ENGINE_MODULE}:FSDPEngineWithLMHead.forward_step", _aligned_forward_step, name="fsdp-aligned-forward-step",
    why="the actor's logprobs from vLLM's kernels and logprob arithmetic instead of the HF forward")
# FSDP2 refills the gathered parameters in place: the engine-layout copies are re-derived after
# every call that changes the shards.
OPTIMIZER_STEP, LOAD_CHECKPOINT = (
    fsdp_patch(f"{ENGINE_MODULE}:FSDPEngine.{method}", _new_weights_after,
               name=f"fsdp-aligned-{method.replace('_', '-')}",
               why=f"re-derive the aligned forward's engine-layout weights after {cause} changed the shards")
    for method, cause in (("optimizer_step", "the optimizer"), ("load_checkpoint", "a checkpoint")))

PATCHES = (FORWARD_STEP, OPTIMIZER_STEP, LOAD_CHECKPOINT)


def apply() -> None:
    """Install the patches (now, or when verl's FSDP engine module is imported). Idempotent."""
    for patch in PATCHES:
        apply_patch(patch)


def remove() -> None:
    """Put verl's methods back, and the HF forwards of every module the aligned forward ran on."""
    for patch in reversed(PATCHES):
        remove_patch(patch)
    uninstall_all()


def is_active() -> bool:
    return all(is_applied(patch) or is_pending(patch) for patch in PATCHES)


def maybe_apply() -> bool:
    """Apply when ``ZMRL_FSDP_ALIGNED`` is set; for the plugin's verl entry point."""
    if not enabled_by_env():
        return False
    apply()
    return True
