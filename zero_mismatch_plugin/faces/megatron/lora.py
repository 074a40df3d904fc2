"""LoRA in the Megatron face: a frozen GPTModel plus a trainable adapter, with vLLM's LoRA arithmetic.

Each targeted linear (routed and shared experts included) carries a :class:`MegatronLoRA`, the word
embedding and output layer a :class:`MegatronVocabLoRA`; their forwards are the op layer's LoRA ops
over the module's own base op, so the backward reaches A and B only (docs/lora.md, "The Megatron face").
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import torch
from torch import nn

from zero_mismatch_plugin.aligned.derived import OpCache
from zero_mismatch_plugin.aligned.lora.peft import write_peft_adapter
from zero_mismatch_plugin.aligned.lora.targets import LoRAPair, routed_expert_layers, target_shapes
from zero_mismatch_plugin.aligned.lora.adapter import LoRAAdapter
from zero_mismatch_plugin.aligned.lora.ops import TokenMapping, AlignedLoRALinear
from zero_mismatch_plugin.aligned.lora.vocab_ops import AlignedLoRAEmbedding, AlignedLoRALogits
from zero_mismatch_plugin.tables.architectures import VOCAB_LORA_TARGETS
from zero_mismatch_plugin.faces.megatron import convert, parallel, pipeline
from zero_mismatch_plugin.faces.megatron.modules import AlignedOutputLayer


class MegatronLoRA(nn.Module):
    """The adapter of one megatron linear: ``{target: (lora_A [r, in], lora_B [out, r])}`` for
    the PEFT targets among the linear's vLLM slices ``slices`` (sizes ``out_sizes``)."""

    def __init__(self, slices, out_sizes, pairs: dict, lora_config, mapping: TokenMapping):
        super().__init__()
        self.slices = tuple(slices)
        self.out_sizes = list(out_sizes)
        for target, pair in pairs.items():  # parameters named <linear>.lora.<target>.lora_A / _B
            self.add_module(target, pair)
        self.targets = tuple(pairs)
        self.lora_config = lora_config
        self.mapping = mapping
        self._aligned_ops = OpCache()

    def op(self, runtime, base_op):
        """vLLM's LoRA linear over ``base_op`` (rebuilt when the base op is)."""

        def build():
            pairs = [getattr(self, t) if t in self.targets else None for t in self.slices]
            return AlignedLoRALinear(runtime, base_op, pairs, self.lora_config, self.mapping, self.out_sizes)

        return self._aligned_ops.get("linear", [base_op], build)

    def refresh(self) -> None:
        """Derive vLLM's stacked A / B again (after writes through ``param.data``: megatron's
        mixed-precision optimizer copies its fp32 masters into bf16 parameters that way)."""
        self._aligned_ops.refresh_derived()


class MegatronVocabLoRA(nn.Module):
    """The adapter of megatron's word embedding (``embed_tokens``: A [r, vocab], B [hidden, r]) or
    output layer (``lm_head``: A [r, hidden], B [vocab, r]), PEFT's layout."""

    def __init__(self, target: str, pair: LoRAPair, lora_config, runtime):
        super().__init__()
        self.add_module(target, pair)  # parameters named <module>.lora.<target>.lora_A / _B
        self.target = target
        self.lora_config = lora_config
        # Every logits row is a sampled row of the adapter (as in the aligned face's lora_vocab_ops).
        self.mapping = TokenMapping(runtime, sampled_rows=target == "lm_head")
        self._aligned_ops = OpCache()

    def op(self, runtime, base, tp_group=None):
        """vLLM's LoRA embedding over the embedding weight ``base``, or its LoRA logits layer over
        the output layer's head ``base`` (this rank's vocabulary shard under ``tp_group``; rebuilt
        when the base is)."""
        pair = getattr(self, self.target)
        if self.target == "embed_tokens":
            build = lambda: AlignedLoRAEmbedding(runtime, base, pair, self.lora_config, self.mapping)  # noqa: E731
        else:
            build = lambda: AlignedLoRALogits(runtime, base, pair, self.lora_config, self.mapping, tp_group)  # noqa: E731
        return self._aligned_ops.get(self.target, [base], build)

    def refresh(self) -> None:
        """As :meth:`MegatronLoRA.refresh`."""
        self._aligned_ops.refresh_derived()


def _embedding_with_lora(word_embeddings, args, output):
    """Forward hook of megatron's word embedding carrying an adapter: its output becomes that of
    vLLM's LoRA embedding over the same weight (token ids [b, s] -> [b, s, hidden]).

    Under tensor parallelism the rank holds a vocabulary shard: megatron's output (each token's row
    summed over the ranks, one rank's row plus zeros, so the row itself) is the base, as vLLM's
    layer adds the update to its own summed lookup; under sequence parallelism (megatron's
    reduce-scattered ``[s / tp, b, hidden]``) the whole sequence is gathered for it and the rank
    keeps its rows. The base is frozen: only A and B get gradients, whole on every rank.
    """
    ids = args[0]
    lora = word_embeddings.lora
    if lora is None:  # set aside (:func:`adapters_set_aside`): the base embedding's output
        return None
    op = lora.op(lora.mapping.runtime, word_embeddings.weight)
    group = parallel.tensor_parallel_group(None, word_embeddings.tp_group)
    if group is None:
        out = op(ids.reshape(-1))
        return out.view(*ids.shape, out.shape[-1])
    if not getattr(word_embeddings, "reduce_scatter_embeddings", False):
        raise NotImplementedError("an embed_tokens adapter at tensor parallelism runs with sequence parallelism")
    from megatron.core.tensor_parallel import mappings

    with parallel.cpu_megatron_collectives():
        base = mappings.gather_from_sequence_parallel_region(output.detach(), group=group)  # [s, b, h]
    s, b, h = base.shape
    out = op.over_rows(ids.reshape(-1), base.transpose(0, 1).reshape(b * s, h))  # token-major as ids
    out = out.view(b, s, h).transpose(0, 1).contiguous()
    with parallel.cpu_megatron_collectives():
        return mappings.scatter_to_sequence_parallel_region(out, group=group)


def attach_lora(model, runtime, adapter_dir: str | os.PathLike):
    """Freeze ``model`` (a GPTModel with the aligned spec) and attach the PEFT adapter in
    ``adapter_dir`` to its linears (routed experts and shared experts included), word embedding and
    output layer; returns the adapter's :class:`~zero_mismatch_plugin.aligned.lora.peft.LoRAConfig`.

    ``runtime`` must be built with the engine's LoRA arguments (``lora_engine_args``).
    """
    hf = runtime.hf_config
    config = getattr(model, "config", None)
    tp = getattr(config, "tensor_model_parallel_size", 1) or 1
    adapter = LoRAAdapter.from_dir(adapter_dir, hf, convert.megatron_blocks(hf).head_dim, vocab=True)
    lora_config = adapter.lora_config
    if lora_config.target_parameters:
        raise NotImplementedError(
            f"{adapter_dir}: a 3-D expert adapter (target_parameters) runs in the aligned model face only; the "
            "Megatron face reads per-expert adapters (target_modules gate_proj, up_proj, down_proj)"
        )
    vocab_pairs = {t: adapter.vocab_pair(t) for t in VOCAB_LORA_TARGETS if adapter.vocab_pair(t) is not None}
    if "lm_head" in vocab_pairs and getattr(model, "share_embeddings_and_output_weights", False):
        raise NotImplementedError(
            f"{adapter_dir}: an lm_head adapter on a model whose output layer is tied to the embedding "
            "(tie_word_embeddings) is not covered in the Megatron face; drop lm_head from target_modules "
            "or use the aligned model face"
        )
    vocab_names = {convert.megatron_vocab_lora_name(t, which) for t in VOCAB_LORA_TARGETS for which in "AB"}
    tensors = {n: t for n, t in convert.peft_to_megatron_lora(adapter.peft_state()).items() if n not in vocab_names}
    # A pipeline stage's own layers, numbered from 0 as megatron numbers them; an expert-parallel
    # rank's own experts, numbered from 0 as its local experts are.
    experts_group = parallel.expert_parallel_group(config)
    num_experts = getattr(config, "num_moe_experts", None) or 0
    tensors = parallel.local_experts_of(
        pipeline.to_stage(tensors, config, tied_head=False, vp_stage=getattr(model, "vp_stage", None)),
        num_experts, experts_group)
    problem = layout_problem(tp, bool(getattr(config, "sequence_parallel", False)))
    if problem:
        raise NotImplementedError(f"{adapter_dir}: {problem}")
    out_features = _out_features(hf)
    mapping = TokenMapping(runtime)
    for p in model.parameters():
        p.requires_grad_(False)
    linears = {}  # megatron linear -> (expert, {target: pair})
    for name, tensor in tensors.items():
        layer, target, which, expert = convert.parse_megatron_lora_name(name)
        if which == "A":
            pair = LoRAPair(lora_config.r, tensor.shape[1], out_features[expert][target])
            pair.lora_A.data.copy_(tensor)
            pair.lora_B.data.copy_(tensors[convert.megatron_lora_name(layer, target, "B", expert)])
            linears.setdefault(convert.lora_linear_name(layer, target, expert), (expert, {}))[1][target] = pair
    modules = dict(model.named_modules())
    missing = sorted(name for name in linears if name not in modules)
    if missing:
        raise ValueError(f"{adapter_dir}: the model has no megatron linear {missing[:4]} for the adapter")
    for name, (expert, pairs) in linears.items():
        module = modules[name]
        slices = convert.lora_slices(next(iter(pairs)))
        sizes = [out_features[expert][t] for t in slices]
        # The linear's own group: a routed expert's linears are megatron's, split over the expert
        # tensor-parallel ranks (the tensor-parallel ones, or one rank at TP x EP: whole experts).
        split = parallel.group_size(module.tp_group) if tp > 1 else 1
        if split > 1:
            # The face's linears say how they are split; megatron's carry it on the weight.
            partition_dim = getattr(module, "partition_dim", None)
            if partition_dim is None:
                partition_dim = module.weight.partition_dim
            if partition_dim == 0:  # a column-parallel linear's slices: this rank's rows of each
                sizes = [size // split for size in sizes]
            pairs = {t: tensor_parallel_pair(p, partition_dim, module.tp_group) for t, p in pairs.items()}
        module.lora = MegatronLoRA(slices, sizes, {t: p.to(module.weight.device) for t, p in pairs.items()},
                                   lora_config, mapping)
        if isinstance(expert, int) and experts_group is not None:
            for param in module.lora.parameters():
                param.allreduce = False  # megatron's mark of an expert-parallel parameter (DDP, grad norms)
    _attach_vocab_lora(model, runtime, vocab_pairs, lora_config)
    return lora_config


def layout_problem(tensor_parallel: int, sequence_parallel: bool) -> str | None:
    """Why the Megatron face cannot run an adapter at a layout, or None.

    At tensor parallelism it runs with sequence parallelism: megatron's ``finalize_model_grads``
    then sums the gradients of the adapter matrices every rank holds whole (column-parallel A,
    row-parallel B) over the ranks, a routed expert's as a dense linear's (its linears split over
    the expert tensor-parallel ranks, which are the tensor-parallel ones, as vLLM's MoE LoRA layer
    splits them). At tensor x expert parallelism (expert tensor parallelism 1) each expert and its
    adapter are whole on their rank, which computes every engine rank's slices of them
    (:class:`~zero_mismatch_plugin.aligned.expert_parallel.EngineShard`). The vocabulary's adapters
    are whole on every rank and adapt whole rows, as vLLM's do (``aligned/lora/vocab_ops.py``).
    Data and context parallelism change nothing for an adapter (per-token arithmetic, DDP's sums);
    pipeline stages hold their layers' adapters, expert-parallel ranks their experts' (computed as
    the engine's CPU LoRA experts compute each row).
    """
    if tensor_parallel > 1 and not sequence_parallel:
        return (f"LoRA at tensor parallelism {tensor_parallel} runs with sequence parallelism: megatron sums the "
                "gradients of the adapter matrices every rank holds whole over the ranks only then; turn "
                "sequence parallelism on")
    return None


def tensor_parallel_pair(pair: LoRAPair, partition_dim: int, group) -> LoRAPair:
    """This rank's part of ``pair`` as vLLM's LoRA layers split it at tensor parallelism.

    A column-parallel linear (``partition_dim`` 0) keeps A whole and this rank's output rows of B;
    a row-parallel one (1) this rank's input columns of A and B whole, so the rank's update is
    ``(x_rank A_rank^T) B^T``, added to its partial output before the ranks' sum, as vLLM adds it.
    The whole matrix's gradient is a partial sum on each rank: marked for megatron's sum over
    the tensor-parallel ranks (``sequence_parallel``, see :func:`layout_problem`).
    """
    size, rank = parallel.group_size(group), parallel.group_rank(group)
    a, b = pair.lora_A.data, pair.lora_B.data
    if partition_dim == 0:
        rows = parallel.divide(b.shape[0], size, "LoRA B rows")
        a_part, b_part = a, b[rank * rows:(rank + 1) * rows]
    else:
        columns = parallel.divide(a.shape[1], size, "LoRA A columns")
        a_part, b_part = a[:, rank * columns:(rank + 1) * columns], b
    part = LoRAPair(a.shape[0], a_part.shape[1], b_part.shape[0])
    part.lora_A.data.copy_(a_part)
    part.lora_B.data.copy_(b_part)
    split, whole = (part.lora_B, part.lora_A) if partition_dim == 0 else (part.lora_A, part.lora_B)
    parallel.mark_partitioned(split, partition_dim)
    setattr(whole, "sequence_parallel", True)
    return part


def _attach_vocab_lora(model, runtime, pairs: dict, lora_config) -> None:
    """Put the ``embed_tokens`` / ``lm_head`` adapters ``pairs`` on megatron's word embedding and
    output layer (which must be the aligned one); a pipeline stage takes those of the modules it has
    (the first the embedding, the last the output layer)."""
    modules = dict(model.named_modules())
    for target, pair in pairs.items():
        name = convert.MEGATRON_VOCAB_LORA_MODULES[target]
        if name not in modules and pipeline.pipeline_size(getattr(model, "config", None)) > 1:
            continue  # on another stage
        module = modules[name]
        if target == "lm_head" and not isinstance(module, AlignedOutputLayer):
            raise ValueError(f"an lm_head adapter needs the aligned output layer, the model has {type(module).__name__}")
        if target == "embed_tokens" and getattr(module, "lora", None) is None:  # one hook, however often attached
            module.register_forward_hook(_embedding_with_lora)
        module.lora = MegatronVocabLoRA(target, pair.to(module.weight.device), lora_config, runtime)


def _out_features(hf_config) -> dict:
    """{expert: {target: output features}} of the linears an adapter can target: ``None`` a
    layer's own, each routed expert's index, ``convert.SHARED_EXPERT`` the shared expert's."""
    blocks = convert.megatron_blocks(hf_config)
    _, routed, _, shared = routed_expert_layers(hf_config)
    out = {None: target_shapes(hf_config, blocks.head_dim), convert.SHARED_EXPERT: shared}
    out.update(dict.fromkeys(range(blocks.moe.num_experts if blocks.moe else 0), routed))
    return {expert: {target: out_f for target, (out_f, _) in shapes.items()} for expert, shapes in out.items()}


def lora_parameters(model):
    """(Megatron-face name, parameter) of every adapter matrix of ``model``."""
    return [(n, p) for n, p in model.named_parameters() if ".lora." in n]


def full_adapter_tensors(model, tensors) -> dict:
    """PEFT names -> whole tensors, from this rank's parts ``tensors`` (Megatron-face names) of the
    model's adapter matrices or their gradients: a matrix split over the tensor-parallel ranks
    (:func:`tensor_parallel_pair`) is gathered along its split (a collective: every rank calls it).
    With virtual pipeline stages ``model`` is the rank's list of model chunks and ``tensors`` one
    dict per chunk."""
    from zero_mismatch_plugin.aligned.reductions import all_gather_parts

    chunks = model if isinstance(model, list) else [model]
    parts = tensors if isinstance(model, list) else [tensors]
    hf_config = next((m.mapping.runtime.hf_config for chunk in chunks for m in chunk.modules()
                      if isinstance(m, MegatronLoRA)), None)
    config = pipeline.model_config(chunks)
    wholes = []
    for chunk, part in zip(chunks, parts):
        params = dict(lora_parameters(chunk))
        whole = {}
        for name, tensor in part.items():
            param = params[name]
            tensor = tensor.detach()
            if getattr(param, "tensor_model_parallel", False):
                from megatron.core import parallel_state

                pieces = all_gather_parts(tensor.contiguous(), parallel_state.get_tensor_model_parallel_group())
                tensor = torch.cat(pieces, dim=param.partition_dim)
            whole[name] = tensor
        # Every expert-parallel rank's experts, numbered globally (as they are in one process).
        wholes.append(parallel.gather_experts(whole, getattr(config, "num_moe_experts", None) or 0,
                                              parallel.expert_parallel_group(config)))
    # Every pipeline stage's (and model chunk's) matrices, their layers numbered globally.
    whole = pipeline.gather_stages(wholes if isinstance(model, list) else wholes[0], config, tied_head=False)
    return convert.megatron_to_peft_lora(whole, hf_config)


def adapter_state(model) -> dict:
    """The model's adapter under PEFT's names (detached, whole), what the engine loads; ``model``:
    one model, or with virtual pipeline stages the rank's list of model chunks."""
    if isinstance(model, list):
        return full_adapter_tensors(model, [dict(lora_parameters(chunk)) for chunk in model])
    return full_adapter_tensors(model, dict(lora_parameters(model)))


def save_adapter(model, lora_config, adapter_dir: str | os.PathLike):
    """Write the model's adapter in PEFT's format, for a ``LoRARequest`` to load."""
    return write_peft_adapter(adapter_dir, lora_config, adapter_state(model))


@contextmanager
def adapters_set_aside(model):
    """Inside the block the model (or list of model chunks, wrapped or not) computes and names
    only its base: every adapter module is unregistered (its parameters leave ``named_parameters``
    and ``state_dict``, each linear forwards its base op) and put back, the same objects, after.
    For a reference policy without the adapter, and for a weight mapper that knows only the base's
    names."""
    chunks = model if isinstance(model, (list, tuple)) else [model]
    holders = [m for chunk in chunks for m in chunk.modules()
               if isinstance(m._modules.get("lora"), (MegatronLoRA, MegatronVocabLoRA))]
    adapters = [m._modules["lora"] for m in holders]
    for module in holders:
        module._modules["lora"] = None  # read as ``module.lora is None``: no adapter
    try:
        yield
    finally:
        for module, adapter in zip(holders, adapters):
            module._modules["lora"] = adapter
