"""Pipeline parallelism of the Megatron face: megatron's stages and schedule, the checkpoint per stage.

A stage holds a contiguous run of decoder layers (megatron's split:
``get_transformer_layer_offset`` / ``get_num_layers_to_build``); the first stage also the
embedding, the last the final norm, the output layer and the logprob. What crosses stages is the
hidden state of every token, sent as it is by megatron's point-to-point communication (a copy,
no arithmetic), so each layer computes what it computes in one process and a pipeline needs no
arithmetic of its own to stay bitwise with the engine. The forward and backward run through
megatron's own schedule (``get_forward_backward_func``), as verl's Megatron engine runs them.

In bf16 a hidden state alone is not enough: vLLM's fused add + norm normalises the unrounded sum
of the last layer's output and the residual (:mod:`.residual`), so a stage sends both addends,
packed bit for bit into one fp32 word per element (``pipeline_dtype=torch.float32``, set with the
spec), and the next stage unpacks them, redoes the layer's bf16 add for the residual stream and
hands its first norm the addends (:func:`carry_addends_across_stages`). The message is a copy.

Tied embeddings: megatron keeps a copy of the word embeddings as the last stage's output layer and
all-reduces the two copies' gradients in ``finalize_model_grads``; a checkpoint's
``embed_tokens`` loads both, and the first stage's copy is the one gathered.
"""

from __future__ import annotations

import logging
import re

import torch

from zero_mismatch_plugin.faces.megatron.parallel import layout_group

logger = logging.getLogger(__name__)

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EMBEDDING = "embedding.word_embeddings.weight"
_OUTPUT = "output_layer.weight"
_LAST_STAGE_ONLY = ("decoder.final_layernorm.", "output_layer.")


def model_config(model):
    """The TransformerConfig of a GPTModel, of one wrapped by megatron's DDP, or of a list of model
    chunks (virtual stages: every chunk's is the same)."""
    first = model[0] if isinstance(model, list) else model
    return first.config if hasattr(first, "config") else first.module.config


def pipeline_size(config) -> int:
    return getattr(config, "pipeline_model_parallel_size", 1) or 1


def pipeline_group(config):
    """The pipeline-parallel group of a model of ``config``; ``None`` at pipeline parallelism 1."""
    return layout_group(config, "pipeline_model_parallel_size", "get_pipeline_model_parallel_group")


def virtual_stages(config) -> int:
    """Model chunks per pipeline rank (megatron's interleaved schedule; 1 without it)."""
    return getattr(config, "virtual_pipeline_model_parallel_size", None) or 1


def stage_layers(config, pp_rank: int | None = None, vp_stage: int | None = None) -> range:
    """The decoder layers (0-based, global) stage ``pp_rank`` (default: this rank's) holds; with
    virtual stages, those of its model chunk ``vp_stage``."""
    if pipeline_size(config) == 1:
        return range(config.num_layers)
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    if pp_rank is None:
        from megatron.core import parallel_state

        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    first = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return range(first, first + get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank))


def stage_ends(config, vp_stage: int | None = None) -> dict:
    """``pre_process`` / ``post_process`` of GPTModel on this rank (embedding / head here or not);
    with virtual stages, of its model chunk ``vp_stage`` (the embedding on the first rank's first
    chunk, the head on the last rank's last)."""
    group = pipeline_group(config)
    if group is None:
        return {"pre_process": True, "post_process": True}
    rank = torch.distributed.get_rank(group)
    first_chunk = vp_stage is None or vp_stage == 0
    last_chunk = vp_stage is None or vp_stage == virtual_stages(config) - 1
    return {"pre_process": rank == 0 and first_chunk, "post_process": rank == group.size() - 1 and last_chunk}


def to_stage(tensors: dict, config, tied_head: bool, vp_stage: int | None = None) -> dict:
    """This stage's tensors (layers renumbered from 0, as megatron numbers a stage's layers) from
    full ones under megatron's names; with a tied head the last stage's output layer is the
    checkpoint's embedding. ``vp_stage``: the model chunk's, with virtual stages."""
    if pipeline_size(config) == 1:
        return tensors
    layers, ends = stage_layers(config, vp_stage=vp_stage), stage_ends(config, vp_stage)
    out = {}
    for name, tensor in tensors.items():
        match = _LAYER.match(name)
        if match is not None:
            if int(match.group(1)) in layers:
                out[f"decoder.layers.{int(match.group(1)) - layers.start}.{match.group(2)}"] = tensor
        elif name == _EMBEDDING:
            if ends["pre_process"]:
                out[name] = tensor
            if ends["post_process"] and tied_head:
                out[_OUTPUT] = tensor
        elif name.startswith(_LAST_STAGE_ONLY):
            if ends["post_process"]:
                out[name] = tensor
        else:
            out[name] = tensor
    return out


def gather_stages(tensors: dict, config, tied_head: bool) -> dict:
    """Every stage's tensors under full megatron names (layers renumbered globally), on every rank
    of the pipeline group (a collective). With a tied head the last stage's copy of the embedding
    is left out: after ``finalize_model_grads`` the first stage's holds the sum of both uses.
    With virtual stages ``tensors`` is a list, one dict per model chunk."""
    group = pipeline_group(config)
    if group is None:
        return tensors
    mine = {}
    for vp_stage, chunk in _chunks(tensors):
        first = stage_layers(config, vp_stage=vp_stage).start
        for name, tensor in chunk.items():
            match = _LAYER.match(name)
            if match is not None:
                name = f"decoder.layers.{int(match.group(1)) + first}.{match.group(2)}"
            elif name == _OUTPUT and tied_head and not stage_ends(config, vp_stage)["pre_process"]:
                continue
            mine[name] = tensor.detach().cpu()
    return merged_over_stages(mine, config)


def _chunks(tensors) -> list[tuple[int | None, dict]]:
    """``[(vp_stage, tensors)]``: a list of per-chunk dicts numbered, one dict as chunk None."""
    return list(enumerate(tensors)) if isinstance(tensors, list) else [(None, tensors)]


def merged_over_stages(entries: dict, config) -> dict:
    """Every stage's ``entries`` (keyed by something global, e.g. a layer index) merged, on every
    rank of the pipeline group (a collective)."""
    group = pipeline_group(config)
    if group is None:
        return entries
    stages = [None] * group.size()
    torch.distributed.all_gather_object(stages, entries, group=group)
    return {key: value for stage in stages for key, value in stage.items()}


def from_last_stage(value, config):
    """``value`` as the last stage has it, on every rank of the pipeline group (a collective)."""
    group = pipeline_group(config)
    if group is None:
        return value
    box = [value]
    last = torch.distributed.get_global_rank(group, group.size() - 1)
    torch.distributed.broadcast_object_list(box, src=last, group=group)
    return box[0]


def run_schedule(model, tokens: int, items: list, forward_step, loss, forward_only: bool) -> list:
    """Micro-batches through megatron's pipeline schedule, one per ``items`` entry:
    ``forward_step(stage_model, item)`` runs this stage's part (GPTModel takes the previous stage's
    output through ``set_input_tensor``), ``loss(item, output)`` on the last stage returns
    ``(loss, data)``; the ``data`` of each micro-batch on the last stage (an empty list elsewhere).
    ``model``: this rank's model, or with virtual stages its list of model chunks (megatron's
    interleaved schedule, which needs at least one micro-batch per stage). ``tokens``: the token
    count of every micro-batch on every stage, whole (megatron divides it by the context-parallel
    size, and by the tensor-parallel size under sequence parallelism, for the tensors the stages
    exchange). megatron divides each micro-batch's loss by their number before its backward."""
    from functools import partial

    from megatron.core.pipeline_parallel import get_forward_backward_func

    from zero_mismatch_plugin.faces.megatron.parallel import cpu_megatron_collectives

    chunks = model if isinstance(model, list) else [model]

    def step(data_iterator, stage_model):
        item = next(data_iterator)
        return forward_step(stage_model, item), partial(loss, item)

    if pipeline_size(model_config(chunks)) == 1:
        raise ValueError("run_schedule is the pipeline path: at pipeline parallelism 1 the face runs its forward directly")
    iterators = [iter(items) for _ in chunks]
    with cpu_megatron_collectives():
        return get_forward_backward_func()(
            forward_step_func=step, data_iterator=iterators if len(chunks) > 1 else iterators[0],
            model=chunks, num_microbatches=len(items), seq_length=tokens, micro_batch_size=1,
            forward_only=forward_only,
        )


# ----- The stage boundary in 16-bit dtypes ------------------------------------------------------


class _PackAddends(torch.autograd.Function):
    """Two 16-bit tensors (the layer output and the residual) as one fp32 tensor of their shape:
    element i's 32 bits are the two addends' 16 bits side by side. A copy of bits, no rounding;
    the gradient arrives packed the same way and is unpacked into each addend's."""

    @staticmethod
    def forward(ctx, x, residual):
        ctx.dtype = x.dtype
        return pack_pair(x, residual)

    @staticmethod
    def backward(ctx, grad):
        return unpack_pair(grad, ctx.dtype)


class _UnpackAddends(torch.autograd.Function):
    @staticmethod
    def forward(ctx, packed, dtype):
        return unpack_pair(packed, dtype)

    @staticmethod
    def backward(ctx, grad_x, grad_residual):
        reference = grad_x if grad_x is not None else grad_residual
        grad_x = torch.zeros_like(reference) if grad_x is None else grad_x
        grad_residual = torch.zeros_like(reference) if grad_residual is None else grad_residual
        return pack_pair(grad_x, grad_residual), None


def pack_pair(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a`` and ``b`` (one 16-bit dtype, one shape) as an fp32 tensor of that shape holding both
    bit patterns (a copy; :func:`unpack_pair` gives them back exactly)."""
    if a.dtype != b.dtype or a.shape != b.shape or a.element_size() != 2:
        raise ValueError(f"pack_pair takes two 16-bit tensors of one dtype and shape, got "
                         f"{a.dtype} {tuple(a.shape)} and {b.dtype} {tuple(b.shape)}")
    packed = torch.empty(a.shape, dtype=torch.float32, device=a.device)
    packed.view(a.dtype).view(*a.shape, 2).copy_(torch.stack((a, b), dim=-1))
    return packed


def unpack_pair(packed: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The two ``dtype`` tensors :func:`pack_pair` packed into ``packed``."""
    pairs = packed.contiguous().view(dtype).view(*packed.shape, 2)
    return pairs[..., 0].clone(), pairs[..., 1].clone()


def carries_addends(config) -> bool:
    """Whether stages of ``config`` send the residual sum's addends (bf16 at pipeline parallelism > 1)."""
    return pipeline_size(config) > 1 and config.params_dtype == torch.bfloat16


def boundary_problem(config) -> str | None:
    """Why stages of ``config`` cannot carry what the next stage's first norm reads; None if they can."""
    if pipeline_size(config) > 1 and getattr(config, "fp16", False):
        return "pipeline parallelism > 1 in fp16 (not run; bf16 and fp32 are)"
    return None


def send_addends_in_fp32(config) -> None:
    """``config.pipeline_dtype`` fp32 where stages carry addends (:func:`carries_addends`): megatron
    sizes the buffers it sends and receives by it. Called with the spec, before the model is built
    (verl sets ``pipeline_dtype`` to the model dtype)."""
    if carries_addends(config) and config.pipeline_dtype != torch.float32:
        logger.info("aligned megatron spec: pipeline_dtype %s -> torch.float32 (each fp32 word a pair of "
                    "bf16 addends of the residual sum)", config.pipeline_dtype)
        config.pipeline_dtype = torch.float32


def carry_addends_across_stages(model) -> None:
    """In bf16 at pipeline parallelism > 1: a stage that is not the last sends its last residual
    sum's two addends packed (:func:`pack_pair`), and a stage that is not the first unpacks what it
    receives into the sum and its addends, so its first norm is vLLM's fused add + norm on the
    engine's numbers. Hooks on the model chunk's TransformerBlock; installed once; nothing at
    fp32 or at pipeline parallelism 1 (the sum alone is then what the norm reads)."""
    from zero_mismatch_plugin.faces.megatron.residual import record_addends, residual_addends

    decoder = model.decoder
    config = decoder.config
    if getattr(decoder, "_zero_mismatch_boundary", False) or not carries_addends(config):
        return
    if config.pipeline_dtype != torch.float32:
        raise NotImplementedError(
            f"aligned megatron spec: bf16 stages send the two bf16 addends of the residual sum packed in one fp32 "
            f"word, but pipeline_dtype is {config.pipeline_dtype}: build the model from aligned_gpt_spec (which "
            "sets it) or set pipeline_dtype=torch.float32")
    dtype = config.params_dtype

    def unpack_received(block, args, kwargs):
        received = block.input_tensor
        if received is None or received.dtype != torch.float32:
            return None  # a stage given nothing (megatron's schedule sets it) or the first stage
        x, residual = _UnpackAddends.apply(received, dtype)
        total = x + residual  # the rounded sum vLLM keeps as the residual, made as the layer made it
        record_addends(total, x, residual)
        block._zero_mismatch_received = received
        block.input_tensor = total
        return None

    def restore_received(block, args, kwargs, output):
        received = getattr(block, "_zero_mismatch_received", None)
        if received is not None:
            block.input_tensor, block._zero_mismatch_received = received, None
        return None

    def pack_sent(block, args, kwargs, output):
        addends = residual_addends(output)
        if addends is None:
            raise RuntimeError("aligned megatron stage: the stage's output is not a residual sum of the "
                               "aligned spec's residual add, so its addends cannot be sent")
        return _PackAddends.apply(*addends)

    if not decoder.pre_process:
        decoder.register_forward_pre_hook(unpack_received, with_kwargs=True)
        decoder.register_forward_hook(restore_received, with_kwargs=True)
    if not decoder.post_process:
        decoder.register_forward_hook(pack_sent, with_kwargs=True)
    decoder._zero_mismatch_boundary = True
