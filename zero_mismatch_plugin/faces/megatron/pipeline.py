"""Pipeline parallelism of the Megatron face: megatron's stages and schedule, the checkpoint per stage.

A stage holds a contiguous run of decoder layers (megatron's split:
``get_transformer_layer_offset`` / ``get_num_layers_to_build``); the first stage also the
embedding, the last the final norm, the output layer and the logprob. What crosses stages is the
hidden state of every token, sent as it is by megatron's point-to-point communication (a copy,
no arithmetic), so each layer computes what it computes in one process and a pipeline needs no
arithmetic of its own to stay bitwise with the engine. The forward and backward run through
megatron's own schedule (``get_forward_backward_func``), as verl's Megatron engine runs them.

Tied embeddings: megatron keeps a copy of the word embeddings as the last stage's output layer and
all-reduces the two copies' gradients in ``finalize_model_grads``; a checkpoint's
``embed_tokens`` loads both, and the first stage's copy is the one gathered.
"""

from __future__ import annotations

import re

import torch

from zero_mismatch_plugin.faces.megatron.parallel import layout_group

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
