"""megatron-core's dense layer modules (norms, linears, MLP, attention, output layer, per-token
logprob) with vLLM's numerics: each keeps the constructor and parameter names of the module it
replaces in a layer spec and forwards through the op layer. Under tensor parallelism each module
holds the engine rank's part and crosses ranks with megatron-core's collectives
(:mod:`.parallel`); how and why: docs/megatron.md.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from zero_mismatch_plugin.aligned import ops
from zero_mismatch_plugin.aligned.derived import OpCache, shared_ops
from zero_mismatch_plugin.aligned.runtime import VllmRuntime
from zero_mismatch_plugin.aligned.sampling import vllm_label_logprobs
from zero_mismatch_plugin.faces.megatron import context_parallel, parallel
from zero_mismatch_plugin.faces.megatron.convert import vllm_window
from zero_mismatch_plugin.faces.megatron.residual import residual_addends
from zero_mismatch_plugin.tables.architectures import describe


def flat_tokens(x: torch.Tensor) -> torch.Tensor:
    """[..., features] -> [tokens, features], the layout vLLM's kernels are called with."""
    return x.reshape(-1, x.shape[-1])


# ----- Norms -------------------------------------------------------------------------------


class AlignedRMSNormModule(nn.Module):
    """Replaces ``WrappedTorchNorm`` (RMSNorm) for the input / pre-MLP / q / k / final norms."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, *, runtime: VllmRuntime,
                 after_residual_add: bool = False, **_):
        """``after_residual_add``: the norm always follows a residual add (pre-MLP, final), so its
        input must come with its addends (:mod:`.residual`) wherever rounding the sum matters."""
        super().__init__()
        if getattr(config, "normalization", "RMSNorm") != "RMSNorm":
            raise NotImplementedError(
                f"aligned megatron spec: normalization={config.normalization!r}; only RMSNorm"
            )
        if getattr(config, "layernorm_zero_centered_gamma", False):
            raise NotImplementedError("aligned megatron spec: zero-centered RMSNorm gamma")
        self.config = config
        self.runtime = runtime
        self.eps = eps
        self.after_residual_add = after_residual_add
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        # Under sequence parallelism each rank normalizes its own tokens: megatron sums this
        # weight's gradient over the tensor-parallel ranks (finalize_model_grads).
        group = parallel.tensor_parallel_group(config)
        setattr(self.weight, "sequence_parallel", parallel.uses_sequence_parallel(config, group))
        self._aligned_ops = OpCache()

    def _kernel(self) -> ops.AlignedRMSNorm:
        # Rebuilt if the Parameter object was replaced (e.g. by a model conversion).
        return self._aligned_ops.get(
            "norm", [self.weight], lambda: ops.AlignedRMSNorm(self.runtime, self.weight, self.eps))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        addends = residual_addends(x)
        if addends is not None:  # after a residual add: vLLM's fused kernel on the two addends
            out, _ = self._kernel()(*(flat_tokens(t) for t in addends))
            return out.reshape(shape)
        if self.after_residual_add and self.runtime.dtype != torch.float32:
            raise RuntimeError(
                "aligned megatron norm after a residual add got a sum without its addends: in "
                f"{self.runtime.dtype} vLLM normalises the unrounded sum, so this norm would not be the "
                "engine's. The layer's self_attn_bda / mlp_bda must be the aligned spec's residual add")
        return self._kernel()(flat_tokens(x)).reshape(shape)


# ----- Linears -----------------------------------------------------------------------------


def megatron_parameter(data: torch.Tensor) -> nn.Parameter:
    """A parameter with the attributes megatron's DDP / optimizer read on a TP=1 parameter."""
    param = nn.Parameter(data)
    setattr(param, "allreduce", True)
    setattr(param, "sequence_parallel", False)
    return param


def _linear_weight(config, output_size: int, input_size: int, init_method) -> nn.Parameter:
    weight = megatron_parameter(torch.empty(output_size, input_size, dtype=config.params_dtype))
    if init_method is not None and getattr(config, "perform_initialization", True):
        with torch.no_grad():
            init_method(weight)
    return weight


class AlignedLinearModule(nn.Module):
    """Replaces ``ColumnParallelLinear`` with vLLM's linear (:class:`AlignedRowParallelLinearModule`
    replaces ``RowParallelLinear``).

    The bias, when present, is applied inside vLLM's linear (one fused ``F.linear``-style call,
    as vLLM does) and never returned for a later add, whatever ``skip_bias_add`` says: a separate
    bias add rounds differently. Under tensor parallelism the module holds this rank's output
    rows and returns this rank's outputs (megatron's ``gather_output=False``).
    """

    # The dim of the full weight split over tensor-parallel ranks: 0 column-, 1 row-parallel.
    partition_dim = 0

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config,
        init_method=None,
        bias: bool = True,
        runtime: VllmRuntime,
        tp_group=None,
        **_,
    ):
        super().__init__()
        self.config = config
        self.runtime = runtime
        self.input_size = input_size
        self.output_size = output_size
        self.tp_group = parallel.tensor_parallel_group(config, tp_group)
        self.sequence_parallel = parallel.uses_sequence_parallel(config, self.tp_group)
        tp = parallel.group_size(self.tp_group)
        rows, columns = output_size, input_size
        if self.partition_dim == 0:
            rows = parallel.divide(output_size, tp, "output size")
        else:
            columns = parallel.divide(input_size, tp, "input size")
            if bias and tp > 1:
                # vLLM adds a row-parallel bias on rank 0 before its all-reduce.
                raise NotImplementedError("aligned megatron spec: a row-parallel bias under tensor parallelism")
        self.weight = _linear_weight(config, rows, columns, init_method)
        self.bias = megatron_parameter(torch.zeros(rows, dtype=config.params_dtype)) if bias else None
        if tp > 1:
            parallel.mark_partitioned(self.weight, self.partition_dim)
            if self.bias is not None:
                parallel.mark_partitioned(self.bias, 0)
        # engine_rows[i]: the megatron row computing vLLM's output i (None: same layout).
        self.register_buffer("engine_rows", None, persistent=False)
        self._aligned_ops = OpCache()
        # A LoRA adapter on this linear (``megatron.lora.attach_lora``): forward through vLLM's LoRA linear.
        self.lora = None

    def _kernel(self) -> ops.AlignedLinear:
        # Rebuilt if a Parameter object was replaced (e.g. by a model conversion).
        biases = None if self.bias is None else [self.bias]
        return self._aligned_ops.get(
            "linear", [self.weight, *(biases or [])],
            lambda: ops.AlignedLinear(self.runtime, [self.weight], biases, engine_rows=self.engine_rows))

    def op(self):
        """vLLM's linear, or with an adapter attached vLLM's LoRA linear over it."""
        return self._kernel() if self.lora is None else self.lora.op(self.runtime, self._kernel())

    def forward(self, x: torch.Tensor, *args, **kwargs):
        x = parallel.column_input(x, self.tp_group, self.sequence_parallel)
        out = self.op()(flat_tokens(x))
        return out.reshape(*x.shape[:-1], out.shape[-1]), None

    def refresh(self) -> None:
        self._kernel().derived.refresh()

    # megatron's distributed checkpoint: a stock model's keys, shapes and splits.
    sharded_state_dict = parallel.linear_sharded_state_dict


class AlignedRowParallelLinearModule(AlignedLinearModule):
    """Replaces ``RowParallelLinear``: this rank's input columns through vLLM's linear, the ranks'
    partial outputs summed (reduce-scattered along tokens under sequence parallelism)."""

    partition_dim = 1

    def forward(self, x: torch.Tensor, *args, **kwargs):
        out = self.op()(flat_tokens(x))
        out = out.reshape(*x.shape[:-1], out.shape[-1])
        return parallel.row_output(out, self.tp_group, self.sequence_parallel), None


def qkv_row_order(num_heads: int, num_query_groups: int, head_dim: int) -> torch.Tensor:
    """engine_rows between megatron's fused qkv and vLLM's ``[q; k; v]``: the megatron row of
    each of vLLM's output rows.

    megatron stores, per query group g: the group's ``num_heads / num_query_groups`` query heads,
    then its key head, then its value head. vLLM's ``QKVParallelLinear`` stacks all query heads,
    then all key heads, then all value heads.
    """
    per_group = num_heads // num_query_groups
    group_rows = (per_group + 2) * head_dim
    q_rows, k_rows, v_rows = [], [], []
    for g in range(num_query_groups):
        base = g * group_rows
        q_rows.append(torch.arange(base, base + per_group * head_dim))
        k_rows.append(torch.arange(base + per_group * head_dim, base + (per_group + 1) * head_dim))
        v_rows.append(torch.arange(base + (per_group + 1) * head_dim, base + group_rows))
    return torch.cat(q_rows + k_rows + v_rows)


class AlignedQKVLinearModule(AlignedLinearModule):
    """``linear_qkv``: megatron's grouped layout, computed as vLLM's ``[q; k; v]`` GEMM."""

    def __init__(self, input_size: int, output_size: int, *, config, runtime: VllmRuntime, **kw):
        super().__init__(input_size, output_size, config=config, runtime=runtime, **kw)
        head_dim = config.kv_channels
        groups = config.num_query_groups or config.num_attention_heads
        expected = (config.num_attention_heads + 2 * groups) * head_dim
        if output_size != expected:
            raise NotImplementedError(
                f"aligned megatron spec: linear_qkv of {output_size} rows, expected {expected} "
                "(dense GQA attention; gated or latent attention is not supported)"
            )
        tp = parallel.group_size(self.tp_group)
        self.engine_rows = qkv_row_order(
            parallel.divide(config.num_attention_heads, tp, "num_attention_heads"),
            parallel.divide(groups, tp, "num_query_groups (vLLM would replicate key/value heads)"),
            head_dim,
        )


# ----- Activation / MLP --------------------------------------------------------------------


@functools.cache
def aligned_mlp_class():
    """``AlignedMLP``, defined on first use (megatron-core is imported then)."""
    from megatron.core.transformer.mlp import MLP

    class AlignedMLP(MLP):
        """megatron's dense MLP with vLLM's ``SiluAndMul`` between fc1 ([gate; up]) and fc2."""

        def __init__(self, config, submodules, *args, runtime: VllmRuntime, **kwargs):
            if not (config.gated_linear_unit and config.activation_func is torch.nn.functional.silu):
                raise NotImplementedError("aligned megatron spec: only SwiGLU MLPs (silu, gated)")
            if getattr(config, "use_te_activation_func", False):
                raise NotImplementedError("aligned megatron spec: use_te_activation_func")
            super().__init__(config, submodules, *args, **kwargs)
            self.runtime = runtime
            self.act = ops.AlignedSiluAndMul(runtime)

        def forward(self, hidden_states, per_token_scale=None, **kwargs):
            if per_token_scale is not None:
                raise NotImplementedError("aligned megatron spec: per-token-scaled MLP (MoE)")
            gate_up, _ = self.linear_fc1(hidden_states)
            shape = gate_up.shape
            intermediate = self.act(flat_tokens(gate_up)).reshape(*shape[:-1], shape[-1] // 2)
            return self.linear_fc2(intermediate)

    return AlignedMLP


# ----- Rotary embedding and core attention ------------------------------------------------


def _packed_seq_lens(packed_seq_params) -> list[int]:
    """The sequence lengths of a packed (THD) batch, kept on its ``PackedSeqParams``: every layer
    (rotary and attention) of one forward sees the same object, and reading cu_seqlens on the host
    is a device sync."""
    cu = packed_seq_params.cu_seqlens_q_padded
    if cu is None:
        cu = packed_seq_params.cu_seqlens_q
    cached = getattr(packed_seq_params, "_zmrl_seq_lens", None)
    if cached is None or cached[0] is not cu:
        # Padding, if any, trails each sequence: causal rows before it are unaffected.
        cached = (cu, [int(n) for n in torch.diff(cu.cpu()).tolist() if int(n) > 0])
        packed_seq_params._zmrl_seq_lens = cached
    return list(cached[1])


def _batch_plan(attention: ops.AlignedAttention, packed_seq_params, seq_lens: list[int]):
    """The attention plan of one packed batch, built by its first layer and kept on its
    ``PackedSeqParams`` for the others (unpacked input: built per call)."""
    if packed_seq_params is None:
        return attention.plan(seq_lens)
    plans = packed_seq_params.__dict__.setdefault("_zmrl_plans", {})
    key = (id(attention), tuple(seq_lens))
    if key not in plans:
        plans[key] = (attention, attention.plan(seq_lens))  # holding attention keeps its id unique
    return plans[key][1]


def _token_major(query, key, value, attention_mask, packed_seq_params, cp_group=None):
    """q, k, v as vLLM's ``[T, heads * D]`` (sequence after sequence), their lengths, and the
    megatron layout to return to (``None``: packed ``thd``; ``(s, b)``: ``sbhd``).

    Accepts megatron's ``sbhd`` layout (each batch column one causal sequence, no padding mask)
    and packed ``thd`` input (``packed_seq_params.cu_seqlens_q``), which verl uses.
    """
    if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
        seq_lens = _packed_seq_lens(packed_seq_params)
        tokens = query.shape[0]
        # Under context parallelism cu_seqlens are the whole sequences', the rows this rank's share.
        if sum(seq_lens) != tokens * parallel.group_size(cp_group):
            raise ValueError(f"cu_seqlens cover {sum(seq_lens)} tokens, query has {tokens} "
                             f"(context parallelism {parallel.group_size(cp_group)})")
        flat = [None if t is None else t.reshape(tokens, -1) for t in (query, key, value)]
        return (*flat, seq_lens, None)
    if packed_seq_params is not None:
        raise NotImplementedError(
            f"aligned megatron spec: packed qkv_format={packed_seq_params.qkv_format!r}"
        )
    if cp_group is not None:
        raise NotImplementedError("aligned megatron spec: context parallelism takes packed THD input")
    if attention_mask is not None:
        raise NotImplementedError(
            "aligned megatron spec: explicit attention masks (padded bshd batches); "
            "use packed THD input (verl: use_remove_padding=True) or unpadded sequences"
        )
    s, b = query.shape[0], query.shape[1]
    flat = [None if t is None else t.transpose(0, 1).reshape(b * s, -1) for t in (query, key, value)]
    return (*flat, [s] * b, (s, b))


def _megatron_layout(x2d: torch.Tensor, layout, like: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_token_major` for one tensor, back to the shape of ``like``."""
    if layout is None:
        return x2d.reshape(like.shape)
    s, b = layout
    return x2d.view(b, s, *like.shape[2:]).transpose(0, 1)


def _positions(seq_lens: list[int], device, cp_group=None) -> torch.Tensor:
    """Each row's position in its sequence (this rank's rows under context parallelism)."""
    if cp_group is not None:
        split = context_parallel.Split(tuple(seq_lens), cp_group.size())
        return split.positions(torch.distributed.get_rank(cp_group)).to(device)
    return torch.cat([torch.arange(n, device=device) for n in seq_lens])


def _shared_rotary(runtime: VllmRuntime, head_dim: int) -> ops.AlignedRotary:
    hf = runtime.hf_config
    max_pos = getattr(hf, "max_position_embeddings", 8192)
    rope = getattr(hf, "rope_parameters", None)
    partial = describe(hf).partial_rotary_factor
    if partial != 1.0:  # vLLM's GLM-4.5 turns the leading part of each head only
        rope = {**(rope or {}), "partial_rotary_factor": partial}
    return shared_ops(runtime).get(
        ("rotary", head_dim, max_pos), [], lambda: ops.AlignedRotary(runtime, head_dim, max_pos, rope)
    )


def _layer_window(config, layer_number: int) -> int | None:
    """vLLM's sliding window of megatron layer ``layer_number`` (1-based), read the way megatron's
    own attention reads ``window_size`` / ``window_attn_skip_freq``; ``None``: full attention."""
    from megatron.core.transformer.utils import is_layer_window_attention

    window_size = getattr(config, "window_size", None)
    if not is_layer_window_attention(window_size, getattr(config, "window_attn_skip_freq", None), layer_number):
        return None
    window = vllm_window(window_size)
    if window is None:
        raise NotImplementedError(
            f"aligned megatron spec: window_size={window_size!r}; only causal windows (left, 0)"
        )
    return window


class AlignedRotaryApplication(nn.Module):
    """The ``rotary_application`` spec hook (patched megatron-core): vLLM's rotary embedding.

    Called by megatron's ``Attention.forward`` in place of ``apply_rotary_pos_emb`` on q and k,
    with megatron's layout. megatron's own frequencies (``rotary_pos_emb``) are not used: the
    rotation is vLLM's kernel with vLLM's cos/sin cache, at positions 0.. within each sequence.
    """

    def __init__(self, config, *, runtime: VllmRuntime, **_):
        super().__init__()
        self.cp_group = context_parallel.context_parallel_group(config)
        self.rotary = _shared_rotary(runtime, config.kv_channels)

    def forward(self, query, key, rotary_pos_emb=None, packed_seq_params=None, inference_context=None):
        if inference_context is not None:
            raise NotImplementedError("aligned megatron spec: megatron's inference (KV-cache) path")
        q, k, _, seq_lens, layout = _token_major(query, key, None, None, packed_seq_params, self.cp_group)
        q, k = self.rotary(_positions(seq_lens, query.device, self.cp_group), q, k)
        return _megatron_layout(q, layout, query), _megatron_layout(k, layout, key)


class AlignedCoreAttention(nn.Module):
    """Replaces ``DotProductAttention`` with vLLM's attention backend (and, on stock
    megatron-core, vLLM's rotary embedding first).

    On stock megatron-core, megatron applies the rotary embedding in ``Attention.forward`` just
    before core attention, with its own cos/sin; that application is switched off after
    construction (:func:`..spec.apply_post_construction_swaps`) and the rotation vLLM applies is
    done here, on the same q and k, at the same point in the data flow. With the megatron-lm
    spec-hook patch the spec's ``rotary_application`` rotates instead and this module is built
    with ``rotates_qk=False``.
    """

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type=None,
        attention_type: str = "self",
        attention_dropout=None,
        softmax_scale=None,
        cp_comm_type=None,
        pg_collection=None,
        *,
        runtime: VllmRuntime,
        rotates_qk: bool = True,
        **_,
    ):
        super().__init__()
        if attention_type != "self":
            raise NotImplementedError("aligned megatron spec: cross attention")
        # Context parallelism: this rank's query rows, every rank's keys and values (context_parallel.py).
        self.cp_group = context_parallel.context_parallel_group(config)
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise NotImplementedError("aligned megatron spec: attention dropout (vLLM has none)")
        self.sliding_window = _layer_window(config, layer_number)
        # A provider built elsewhere (Megatron-Bridge in verl) must carry the window vLLM runs.
        engine_window = describe(runtime.hf_config).window_of(layer_number - 1)
        if self.sliding_window != engine_window:
            raise NotImplementedError(
                f"aligned megatron spec: layer {layer_number} has sliding window {self.sliding_window} in "
                f"megatron's config but {engine_window} in the checkpoint vLLM serves; set window_size="
                f"{None if engine_window is None else (engine_window - 1, 0)} (and window_attn_skip_freq per layer)"
            )
        self.config = config
        self.runtime = runtime
        self.layer_number = layer_number
        # This rank's heads: the engine rank of the same index runs the same ones.
        tp = parallel.group_size(parallel.tensor_parallel_group(config, getattr(pg_collection, "tp", None)))
        self.num_heads = config.num_attention_heads // tp
        self.num_kv_heads = (config.num_query_groups or config.num_attention_heads) // tp
        self.head_dim = config.kv_channels
        # vLLM's Llama/Qwen attention uses head_dim ** -0.5.
        self.scale = softmax_scale if softmax_scale is not None else self.head_dim**-0.5
        self.rotates_qk = rotates_qk
        self.rotary = _shared_rotary(runtime, self.head_dim) if rotates_qk else None
        self.attention = shared_ops(runtime).get(
            ("attention", self.num_heads, self.num_kv_heads, self.head_dim, self.scale, self.sliding_window),
            [],
            lambda: ops.AlignedAttention(
                runtime, self.num_heads, self.num_kv_heads, self.head_dim, self.scale, self.sliding_window
            ),
        )
        # Set by apply_post_construction_swaps once megatron's own rotary is switched off.
        self.applies_rotary = False

    def forward(
        self,
        query,
        key,
        value,
        attention_mask=None,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ):
        if self.rotates_qk and not self.applies_rotary:
            raise RuntimeError(
                "AlignedCoreAttention used without apply_post_construction_swaps(model): "
                "megatron would rotate q/k itself and the rotation would be applied twice"
            )
        if attention_bias is not None:
            raise NotImplementedError("aligned megatron spec: attention bias")
        q, k, v, seq_lens, layout = _token_major(query, key, value, attention_mask, packed_seq_params, self.cp_group)
        if self.rotates_qk:
            q, k = self.rotary(_positions(seq_lens, query.device, self.cp_group), q, k)
        if self.cp_group is not None:
            split = context_parallel.Split(tuple(seq_lens), self.cp_group.size())
            out = context_parallel.ContextParallelAttentionOp(self.attention)(q, k, v.contiguous(), split, self.cp_group)
        else:
            plan = _batch_plan(self.attention, packed_seq_params, seq_lens)
            out = self.attention(q, k, v.contiguous(), plan, seq_lens)
        if layout is None:
            return out
        s, b = layout
        return out.view(b, s, -1).transpose(0, 1)


# ----- Output layer ------------------------------------------------------------------------


class _MegatronLogits(ops.AlignedLogits):
    def _build(self, sources):
        # A megatron output weight may carry padded vocabulary rows; vLLM's head has exactly
        # vocab_size rows before its own padding.
        return super()._build([sources[0][: self.vocab_size]])


class AlignedOutputLayer(nn.Module):
    """Replaces GPTModel's ``output_layer``: vLLM's lm_head + ``LogitsProcessor`` (head dtype
    honoured, fp32 in consistent mode), returning logits of vLLM's width (the model vocabulary).

    Under tensor parallelism each rank computes its vocabulary rows' logits (the engine rank's
    lm_head GEMM) and the shards are concatenated, as vLLM gathers them before its logprobs.
    """

    def __init__(self, runtime: VllmRuntime, weight: nn.Parameter | None, vocab_size: int, *, config=None, tp_group=None):
        super().__init__()
        self.runtime = runtime
        self.vocab_size = vocab_size
        self.tp_group = parallel.tensor_parallel_group(config, tp_group)
        self.sequence_parallel = parallel.uses_sequence_parallel(config, self.tp_group)
        self.shard_rows = parallel.vocab_shard_rows(runtime, vocab_size, parallel.group_size(self.tp_group))
        self.weight = weight  # None when tied: GPTModel passes the embedding weight
        self._aligned_ops = OpCache()
        # An lm_head adapter (``megatron.lora.attach_lora``): logits through vLLM's LoRA logits layer.
        self.lora = None

    def _kernel(self, weight: torch.Tensor) -> ops.AlignedLogits:
        if weight.shape[0] != self.shard_rows:
            raise NotImplementedError(
                f"aligned output layer: weight has {weight.shape[0]} rows, the model vocabulary "
                f"{self.vocab_size} ({self.shard_rows} per tensor-parallel rank); padded megatron "
                "vocabularies are not supported (make_vocab_size_divisible_by / should_pad_vocab off)"
            )
        if self.shard_rows == self.vocab_size:
            build = lambda: _MegatronLogits(self.runtime, weight, self.vocab_size)  # noqa: E731
        else:
            # The engine rank's shard: exactly these rows, no padding of its own.
            build = lambda: ops.AlignedLogits(  # noqa: E731
                self.runtime, weight, self.shard_rows, padded_vocab=self.shard_rows, full_vocab=self.vocab_size)
        # Rebuilt for another weight (tied: the embedding weight GPTModel passes).
        return self._aligned_ops.get("head", [weight], build)

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        weight = self.weight if weight is None else weight
        if weight is None:
            raise ValueError("aligned output layer: no weight (tied model without weight=)")
        hidden_states = parallel.column_input(hidden_states, self.tp_group, self.sequence_parallel)
        s, b, h = hidden_states.shape
        # vLLM computes logits for tokens in sequence order; megatron's rows are [s, b].
        tokens = hidden_states.transpose(0, 1).reshape(b * s, h)
        head = self._kernel(weight)
        if self.lora is None:
            logits = parallel.gather_vocab(head(tokens), self.tp_group)
        else:  # vLLM's LoRA logits layer gathers the shards itself, then adds the update
            logits = self.lora.op(self.runtime, head, self.tp_group)(tokens)
        return logits.view(b, s, -1).transpose(0, 1), None

    # megatron's distributed checkpoint, as its column-parallel output layer's (no weight when tied).
    partition_dim = 0
    sharded_state_dict = parallel.linear_sharded_state_dict

    def refresh(self) -> None:
        self._aligned_ops.refresh_derived()


class AlignedOutputLayerModule(AlignedOutputLayer):
    """The ``output_layer`` spec hook (patched megatron-core): built by GPTModel with the
    arguments of ``ColumnParallelLinear`` (TP=1), holding its own ``[vocab, hidden]`` weight
    unless GPTModel ties it to the embedding (``skip_weight_param_allocation``)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config,
        init_method=None,
        bias: bool = False,
        skip_weight_param_allocation: bool = False,
        runtime: VllmRuntime,
        tp_group=None,
        **_,
    ):
        if bias:
            raise NotImplementedError("aligned output layer: a bias on the output layer")
        group = parallel.tensor_parallel_group(config, tp_group)
        weight = None
        if not skip_weight_param_allocation:
            tp = parallel.group_size(group)
            weight = _linear_weight(config, parallel.vocab_shard_rows(runtime, output_size, tp), input_size, init_method)
            if tp > 1:
                parallel.mark_partitioned(weight, 0)
        super().__init__(runtime, weight, output_size, config=config, tp_group=group)


# ----- Per-token logprob -------------------------------------------------------------------


class AlignedTokenLogprob(nn.Module):
    """The ``token_logprob`` spec hook (patched megatron-core): vLLM's sampler logprob of each
    label, ``[b, s]``, from megatron's ``[s, b, V]`` logits. GPTModel returns its negation as
    the per-token loss, so ``-model(..., labels=labels)`` is vLLM's logprob bit for bit.

    ``temperature`` is the sampling temperature of the rollout (T = 1 by default).
    """

    def __init__(self, config=None, *, temperature: float = 1.0, **_):
        super().__init__()
        if not temperature > 0:
            raise ValueError(f"aligned token logprob: temperature must be > 0, got {temperature}")
        self.temperature = float(temperature)

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        rows = logits.transpose(0, 1)  # [b, s, V], the labels' layout
        return vllm_label_logprobs(rows, labels, self.temperature if self.temperature != 1.0 else None)
