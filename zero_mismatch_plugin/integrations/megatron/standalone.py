"""megatron-core models outside a training framework: build, load, score (single process).

:func:`build_gpt_model` builds a GPTModel for a local checkpoint with the aligned spec (or the
stock local spec, for comparisons) and loads the checkpoint the engine serves;
:func:`megatron_token_logprobs` returns the sampled-token logprobs of packed prompt+response
sequences. Works on CPU (gloo, world size 1) and on one GPU.
"""

from __future__ import annotations

import contextlib
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from zero_mismatch_plugin.aligned.packing import PackedBatch, pack, split_sequences
from zero_mismatch_plugin.aligned.runtime import VllmRuntime
from zero_mismatch_plugin.aligned.sampling import SamplingTransform, recorded_logprobs
from zero_mismatch_plugin.faces.megatron import context_parallel, convert, pipeline
from zero_mismatch_plugin.faces.megatron.parallel import cpu_megatron_collectives
from zero_mismatch_plugin.faces.megatron.spec import aligned_gpt_spec, apply_post_construction_swaps


def init_single_process(seed: int = 0) -> None:
    """A 1-rank process group and megatron model parallel state (TP=PP=CP=1); idempotent."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        # A file store, not MASTER_ADDR/MASTER_PORT: an exported port would be inherited by
        # child processes, which would then try to listen on the port this one holds.
        store = Path(tempfile.mkdtemp(prefix="zmrl-pg-")) / "store"
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend=backend, init_method=store.as_uri(), rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    torch.manual_seed(seed)


class _NoDropoutRngTracker:
    """Stands in for megatron's CUDA RNG tracker on CPU, where models run without dropout."""

    def fork(self, name="model-parallel-rng"):
        return contextlib.nullcontext()

    def add(self, name, seed):
        pass

    def get_states(self):
        return {}

    def set_states(self, states):
        pass

    def reset(self):
        pass


@contextlib.contextmanager
def cpu_stock_megatron():
    """Let megatron's stock CPU-unfriendly paths run on a CPU-only machine, then restore.

    megatron-core 0.16 moves RoPE frequencies to ``torch.cuda.current_device()`` at the first
    forward and forks a CUDA RNG state around attention dropout. Only the stock local spec needs
    this (the aligned spec never reaches either); a no-op when CUDA is available.
    """
    if torch.cuda.is_available():
        yield
        return
    from megatron.core.tensor_parallel import random as mrandom

    saved = (mrandom._CUDA_RNG_STATE_TRACKER, mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED)
    mrandom._CUDA_RNG_STATE_TRACKER = _NoDropoutRngTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    try:
        with cpu_megatron_collectives():
            yield
    finally:
        mrandom._CUDA_RNG_STATE_TRACKER, mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = saved


def build_gpt_model(runtime: VllmRuntime, aligned: bool = True, load: bool = True, vp_stage: int | None = None,
                    **config_overrides):
    """A GPTModel of ``runtime``'s checkpoint: the aligned spec (default) or the stock local spec;
    with virtual pipeline stages, this rank's model chunk ``vp_stage``.

    On a megatron-core with the spec-hook patch the aligned model is built from its spec alone;
    on stock megatron-core the post-construction swaps complete it.
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    hf = runtime.hf_config
    init_single_process()
    config = convert.transformer_config_from_hf(hf, params_dtype=runtime.dtype, **config_overrides)
    if config.num_moe_experts:
        from zero_mismatch_plugin.integrations.megatron.cpu_patches import moe_on_cpu

        moe_on_cpu()  # megatron's all-to-all token dispatcher and stock router on a CPU
    if pipeline.pipeline_size(config) > 1:
        from zero_mismatch_plugin.integrations.megatron.cpu_patches import pipeline_on_cpu

        pipeline_on_cpu()  # megatron's schedule and tied embeddings over stages on a CPU
    if aligned:
        spec, _ = aligned_gpt_spec(config, runtime, vp_stage)
    else:
        spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, qk_layernorm=config.qk_layernorm,
                                        normalization="RMSNorm")
    chunk = {} if vp_stage is None else {"vp_stage": vp_stage}
    model = GPTModel(config=config, transformer_layer_spec=spec, **convert.gpt_model_kwargs(hf),
                     **pipeline.stage_ends(config, vp_stage), **chunk)
    if aligned:  # the swaps the spec does not reach (none when built from the hooked spec), stage boundaries
        apply_post_construction_swaps(model, runtime)
    if load:
        convert.load_hf_checkpoint(model, runtime.model_dir, hf)
    return model.to(runtime.device)


def packed_seq_params(seq_lens: list[int], device=None):
    """megatron ``PackedSeqParams`` (THD) for sequences packed back to back."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(seq_lens, dtype=torch.int32), 0)
    cu = cu.to(device) if device is not None else cu
    longest = max(seq_lens)
    return PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest
    )


def packed_inputs(model, batch: PackedBatch, tokens_multiple_of: int = 1, min_tokens: int = 0) -> dict:
    """GPTModel's keyword arguments for a packed (THD) batch.

    ``tokens_multiple_of``: sequence parallelism splits the tokens evenly over the ranks;
    ``min_tokens``: megatron's all-gather token dispatcher needs as many tokens on every rank.
    The batch is padded with one sequence of its own after the real ones (no real row attends to it).
    """
    device = next(model.parameters()).device
    ids, positions, seq_lens = batch.input_ids, batch.positions, list(batch.seq_lens)
    pad = max(min_tokens - len(ids), 0)
    pad += -(len(ids) + pad) % tokens_multiple_of
    if pad:
        ids = torch.cat([ids, torch.zeros(pad, dtype=ids.dtype)])
        positions = torch.cat([positions, torch.arange(pad, dtype=positions.dtype)])
        seq_lens.append(pad)
    return dict(input_ids=ids.to(device).unsqueeze(0), position_ids=positions.to(device).unsqueeze(0),
                attention_mask=None, packed_seq_params=packed_seq_params(seq_lens, device))


def packed_logits(model, batch: PackedBatch, tokens_multiple_of: int = 1, min_tokens: int = 0) -> torch.Tensor:
    """Logits [T, V] of a packed (THD) batch through an aligned GPTModel (:func:`packed_inputs`;
    under context parallelism :func:`context_parallel_logits`)."""
    config = pipeline.model_config(model)
    group = context_parallel.context_parallel_group(config)
    if group is not None:
        return context_parallel_logits(model, batch, group, tokens_multiple_of)
    inputs = packed_inputs(model, batch, tokens_multiple_of, min_tokens)
    # A spec-hooked model keeps megatron's rope type, whose frequencies GPTModel still computes.
    with cpu_stock_megatron():
        logits = model(**inputs)
    return logits[0][: len(batch.input_ids)]


def context_parallel_logits(model, batch: PackedBatch, group, tokens_multiple_of: int = 1) -> torch.Tensor:
    """Logits [T, V] of a packed batch at context parallelism: this rank's chunks through the model
    (:func:`context_parallel_inputs`), every rank's rows of the logits gathered back (each rank
    back-propagates through its own rows) and the padding dropped (:func:`whole_rows`)."""
    inputs, split, real = context_parallel_inputs(model, batch, group, tokens_multiple_of)
    with cpu_stock_megatron():
        local = model(**inputs)[0]
    return whole_rows(local, split, real, group)


def context_parallel_inputs(model, batch: PackedBatch, group, tokens_multiple_of: int = 1, total: int = 0) -> tuple:
    """``(GPTModel's keyword arguments, split, real)`` of this context-parallel rank: each sequence
    padded at its end to megatron's chunk multiple, this rank's chunks of the ids and positions,
    ``PackedSeqParams`` of the whole padded sequences (:func:`context_parallel_rows`; ``total``:
    rows of the padded whole at least, made up by a padding sequence)."""
    size, rank = group.size(), torch.distributed.get_rank(group)
    device = next(model.parameters()).device
    split, real = context_parallel_rows(batch, size, tokens_multiple_of, total)
    ids = []
    for sequence, n, padded in zip(batch.input_ids.split(list(batch.seq_lens)), batch.seq_lens, split.seq_lens):
        ids.append(torch.cat([sequence, sequence.new_zeros(padded - n)]))
    ids.extend(batch.input_ids.new_zeros(n) for n in split.seq_lens[len(batch.seq_lens):])  # the padding sequence
    rows = split.rows(rank)
    inputs = dict(input_ids=torch.cat(ids)[rows].to(device).unsqueeze(0),
                  position_ids=split.positions(rank).to(device).unsqueeze(0), attention_mask=None,
                  packed_seq_params=packed_seq_params(list(split.seq_lens), device))
    return inputs, split, real


def whole_rows(local: torch.Tensor, split, real: torch.Tensor, group) -> torch.Tensor:
    """Every context-parallel rank's rows of ``local`` [rows, ...] gathered into the batch's rows."""
    whole = context_parallel.GatherRows.apply(local, split, group)
    return whole.index_select(0, real.to(local.device))


def context_parallel_rows(batch: PackedBatch, size: int, tokens_multiple_of: int = 1, total: int = 0) -> tuple:
    """``(split, real)``: the context-parallel split of ``batch``'s sequences, each padded at its
    end, and where the batch's own rows lie in the padded whole. ``tokens_multiple_of``: sequence
    parallelism splits each rank's rows over the tensor-parallel ranks, so each sequence is padded
    to a multiple of ``2 * size * tokens_multiple_of`` (as verl pads for megatron). ``total``: the
    padded whole's rows at least, made up by one padding sequence after the real ones (no real row
    attends to it; a multiple of that too)."""
    lens = [context_parallel.padded_length(n, size * tokens_multiple_of) for n in batch.seq_lens]
    if total > sum(lens):
        lens.append(total - sum(lens))
    starts = [sum(lens[:i]) for i in range(len(lens))]
    real = torch.cat([torch.arange(start, start + n) for start, n in zip(starts, batch.seq_lens)])
    return context_parallel.Split(tuple(lens), size), real


def pipelined_outputs(model, batch: PackedBatch, tokens_multiple_of: int = 1, min_tokens: int = 0,
                      coefficients: torch.Tensor | None = None) -> dict | None:
    """A packed batch through megatron's pipeline schedule (:func:`packed_inputs`): on the last
    stage ``{"logprobs": vLLM's recorded logprob of each response token, "target_logits": the rows
    that score them}``, on the others ``None``. With ``coefficients`` the schedule also runs the
    backward of ``sum(coefficients * logprobs)`` (gradients on every stage). Under context
    parallelism too, each stage's ranks hold their chunks (:func:`context_parallel_inputs`) and the
    last stage gathers the logits' rows. ``model``: with virtual pipeline stages, this rank's list
    of model chunks; the batch's sequences then go in one micro-batch per stage (megatron's
    interleaved schedule needs as many), each padded to the longest (under context parallelism by
    a padding sequence), and each micro-batch's objective is multiplied back by their number and
    divided by the context-parallel size (megatron divides by the one, multiplies by the other)."""
    chunks = model if isinstance(model, list) else [model]
    first = chunks[0]
    config = pipeline.model_config(first)
    group = context_parallel.context_parallel_group(config)
    parts = [batch] if len(chunks) == 1 else split_sequences(batch, pipeline.pipeline_size(config))
    weights = [None] * len(parts) if coefficients is None else coefficients.split([len(p.target_ids) for p in parts])
    # Items (part, inputs, context-parallel split and real rows, weight); the schedule exchanges one
    # shape, so every micro-batch is padded to the longest.
    cp_size = 1 if group is None else group.size()
    if group is not None:
        tokens = max(sum(context_parallel_rows(p, cp_size, tokens_multiple_of)[0].seq_lens) for p in parts)
        items = [(part, *context_parallel_inputs(first, part, group, tokens_multiple_of, tokens), w)
                 for part, w in zip(parts, weights)]
    else:
        longest = max([min_tokens, *(p.num_tokens for p in parts)])
        items = [(part, packed_inputs(first, part, tokens_multiple_of, longest), None, None, w)
                 for part, w in zip(parts, weights)]
        tokens = items[0][1]["input_ids"].shape[1]

    def loss(item, output):
        part, _, split, real, weight = item
        logits = output[0][: part.num_tokens] if group is None else whole_rows(output[0], split, real, group)
        values = token_logprobs_from_logits(logits, part)
        # megatron divides a two-value loss by the micro-batches and multiplies it by the
        # context-parallel size (as if each rank's were its share of a mean); here each rank's
        # objective is the whole batch's (its rows gathered), so both are undone.
        objective = values.sum() * 0 if weight is None else (values * weight).sum() * (len(items) / cp_size)
        targets = logits.index_select(0, part.target_rows.to(logits.device))
        return objective, {"logprobs": values.detach(), "target_logits": targets.detach()}

    with cpu_stock_megatron():
        data = pipeline.run_schedule(model, tokens, items, lambda stage, item: stage(**item[1]), loss,
                                     forward_only=coefficients is None)
    if not data:
        return None
    return {key: torch.cat([d[key] for d in data]) for key in ("logprobs", "target_logits")}


def per_sequence_logits(model, batch: PackedBatch) -> torch.Tensor:
    """Logits [T, V], one sequence per forward (sbhd; the stock local spec rejects THD)."""
    device = next(model.parameters()).device
    out = []
    for ids in batch.input_ids.split(batch.seq_lens):
        ids = ids.to(device).unsqueeze(0)
        positions = torch.arange(ids.shape[1], device=device).unsqueeze(0)
        n = ids.shape[1]
        # megatron builds its default causal mask on CUDA; pass it explicitly (True = masked).
        mask = torch.ones(n, n, dtype=torch.bool, device=device).triu(1)[None, None]
        out.append(model(input_ids=ids, position_ids=positions, attention_mask=mask)[0])
    return torch.cat(out)


def token_logprobs_from_logits(logits: torch.Tensor, batch: PackedBatch, transform=None):
    """vLLM's recorded logprob of each response token, from logits [T, V]."""
    rows = logits.index_select(0, batch.target_rows.to(logits.device))
    return recorded_logprobs(rows, batch.target_ids, transform)


@dataclass
class MegatronScorer:
    """An aligned megatron-core model of one checkpoint that scores prompt+response pairs."""

    runtime: VllmRuntime
    model: torch.nn.Module

    @classmethod
    def from_model_dir(cls, model_dir, dtype: str = "float32", **engine_kwargs) -> "MegatronScorer":
        runtime = VllmRuntime(model_dir, dtype=dtype, **engine_kwargs)
        return cls(runtime, build_gpt_model(runtime, aligned=True))

    def token_logprobs(self, prompts, responses, transform: SamplingTransform | None = None):
        """One fp32 tensor per sequence: logprob of each response token (vLLM's bits)."""
        batch = pack(prompts, responses)
        with torch.no_grad():
            values = token_logprobs_from_logits(packed_logits(self.model, batch), batch, transform)
        return batch.split_per_sequence(values.cpu())


def megatron_token_logprobs(model_dir, prompts, responses, dtype: str = "float32", **engine_kwargs):
    """Sampled-token logprobs of packed prompt+response sequences from an aligned GPTModel.

    ``engine_kwargs`` must match the engine's numeric arguments (see ``engine_args_for``).
    Returns one fp32 tensor per sequence.
    """
    scorer = MegatronScorer.from_model_dir(model_dir, dtype=dtype, **engine_kwargs)
    return scorer.token_logprobs(prompts, responses)
