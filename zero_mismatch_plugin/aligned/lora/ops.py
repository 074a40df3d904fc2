"""vLLM's LoRA-wrapped linear as a trainer op: vLLM's punica wrapper on the trainer's A and B.

The forward calls the punica wrapper vLLM's LoRA layers call (``PunicaWrapperCPU`` on CPU) on A
and B zero-padded to the engine's ``max_lora_rank``, B scaled in the LoRA dtype, so its output
bits are the engine's; the backward, for A and B only (the base is frozen), is fp32 torch. What
vLLM computes: ``docs/lora.md``.
"""

from __future__ import annotations

import torch
from torch.autograd import Function

from zero_mismatch_plugin.aligned.derived import DerivedWeight
from zero_mismatch_plugin.aligned.lora.adapter import LoRAAdapter
from zero_mismatch_plugin.aligned.lora.fused_experts import check_engine_serves_fused_experts
from zero_mismatch_plugin.aligned.lora.names import MERGED_TARGETS
from zero_mismatch_plugin.aligned.lora.peft import LoRAConfig
from zero_mismatch_plugin.aligned.ops import observable


class TokenMapping:
    """vLLM's punica wrapper with every token of the batch mapped to adapter slot 0 (prefill
    metadata, as the engine sets it for a prompt). ``sampled_rows``: every row is also a sampled
    row (the logits' ``sampler_indices``, one per row, as the engine maps each request's row)."""

    def __init__(self, runtime, sampled_rows: bool = False):
        self.runtime = runtime
        self.sampled_rows = sampled_rows
        self.capacity = 0
        self.wrapper = None
        self.tokens = None

    def get(self, num_tokens: int):
        from vllm.lora.layers.utils import LoRAMapping
        from vllm.lora.punica_wrapper import get_punica_wrapper

        if num_tokens > self.capacity:
            self.capacity = max(num_tokens, 2 * self.capacity, 256)
            with self.runtime.context():
                self.wrapper = get_punica_wrapper(self.capacity, 1, self.runtime.device)
            self.tokens = None
        if self.tokens != num_tokens:
            mapping = LoRAMapping((1,) * num_tokens, (1,) * (num_tokens if self.sampled_rows else 1), is_prefill=True)
            self.wrapper.update_metadata(mapping, [1], 2, self.runtime.hf_config.vocab_size)
            self.tokens = num_tokens
        return self.wrapper


# The two steps of vLLM's LoRA linear, in order: ``buf = x A^T`` (fp32), then ``y += buf B'^T``.
LORA_STEPS = ("lora_shrink", "lora_expand")


class LoRAStep:
    """One step of vLLM's LoRA linear (``lora_shrink`` or ``lora_expand``) as an op of its own:
    the unit an observer of the op layer (``zmrl bisect``) sees and names."""

    def __init__(self, kind: str):
        self.kind = kind

    @observable
    def __call__(self, run, out):
        """``run()`` performs vLLM's step in place on ``out`` (a tensor, or shrink's tuple of buffers)."""
        run()
        return out


def _copy_into(dst, src) -> None:
    if src is dst:
        return
    for d, s in zip(dst, src) if isinstance(dst, (tuple, list)) else ((dst, src),):
        if s is not d:
            d.copy_(s)


class SteppedPunica:
    """vLLM's punica wrapper whose ``add_lora_linear`` (vLLM's own code, run on this object)
    hands its two steps to ``step(kind, run, out)``.

    ``add_lora_linear`` allocates the fp32 buffers and calls ``self.add_shrink`` then
    ``self.add_expand``; here each runs as ``step("lora_shrink" | "lora_expand", run, out)``,
    where ``run()`` is vLLM's step on ``out`` in place and ``step`` returns ``out`` or a replacement,
    copied into vLLM's buffer so the rest of the computation uses it. Every other attribute is
    the wrapper's (the token mapping the engine or the trainer set).
    """

    def __init__(self, wrapper, step):
        self._wrapper = wrapper
        self._step = step

    def __getattr__(self, name):
        return getattr(self._wrapper, name)

    def add_lora_linear(self, *args, **kwargs):
        return type(self._wrapper).add_lora_linear(self, *args, **kwargs)

    def add_shrink(self, y, *args, **kwargs):
        _copy_into(y, self._step("lora_shrink", lambda: self._wrapper.add_shrink(y, *args, **kwargs), y))

    def add_expand(self, y, *args, **kwargs):
        _copy_into(y, self._step("lora_expand", lambda: self._wrapper.add_expand(y, *args, **kwargs), y))


def engine_lora_config(runtime, r: int):
    """The engine's LoRA settings (``enable_lora``, ``max_lora_rank``), checked to serve rank ``r``."""
    lora = runtime.vllm_config.lora_config
    if lora is None:
        raise ValueError("the trainer's engine arguments need enable_lora=True (as the engine's)")
    if r > lora.max_lora_rank:
        raise ValueError(f"adapter rank {r} > max_lora_rank {lora.max_lora_rank}: raise max_lora_rank")
    return lora


class AlignedLoRALinear:
    """vLLM's LoRA-wrapped linear over a frozen
    :class:`~zero_mismatch_plugin.aligned.ops.AlignedLinear` and trainable A, B.

    ``pairs[i]`` is the adapter (``lora_A`` [r, in], ``lora_B`` [out_i, r]) of vLLM's i-th output
    slice or None (no adapter on that part: vLLM's slice stays zero). ``out_sizes``: vLLM's slices
    (q, k, v; gate, up), by default the base's stacked parts. A base whose rows are permuted
    against vLLM's (megatron's grouped qkv, ``engine_rows``) gets the update in vLLM's row order,
    as the engine adds it, and hands the sum back in its own order (a permutation, exact).
    """

    def __init__(self, runtime, base, pairs, lora_config: LoRAConfig, mapping: TokenMapping, out_sizes=None):
        self.out_sizes = list(out_sizes if out_sizes is not None else base.out_sizes)
        if len(pairs) != len(self.out_sizes) or sum(self.out_sizes) != sum(base.out_sizes):
            raise ValueError("one adapter pair (or None) per output slice of the base linear")
        lora = engine_lora_config(runtime, lora_config.r)
        self.runtime = runtime
        self.base = base
        self.pairs = list(pairs)
        self.scaling = lora_config.scaling
        self.max_rank = lora.max_lora_rank
        self.lora_dtype = lora.lora_dtype
        self.mapping = mapping
        self.params = [t for p in self.pairs if p is not None for t in (p.lora_A, p.lora_B)]
        self.derived = DerivedWeight(self.params, self._build, copies=True)  # vLLM's stacked buffers
        self.steps = {kind: LoRAStep(kind) for kind in LORA_STEPS}

    def _build(self, sources):
        """(lora_a_stacked, lora_b_stacked): vLLM's per-slice [1, 1, max_rank, in] and
        [1, 1, out, max_rank] buffers, B cast to the LoRA dtype then scaled (vLLM's order)."""
        it = iter(sources)
        in_features = self.base.weights[0].shape[1]
        device = self.base.weights[0].device
        a_stacked, b_stacked = [], []
        for pair, out_size in zip(self.pairs, self.out_sizes):
            a = torch.zeros(1, 1, self.max_rank, in_features, dtype=self.lora_dtype, device=device)
            b = torch.zeros(1, 1, out_size, self.max_rank, dtype=self.lora_dtype, device=device)
            if pair is not None:
                lora_a, lora_b = next(it), next(it)
                r = lora_a.shape[0]
                a[0, 0, :r] = lora_a.to(self.lora_dtype)
                scaled = lora_b.to(self.lora_dtype, copy=True)  # never scale the parameter itself
                if self.scaling != 1:
                    scaled *= self.scaling
                b[0, 0, :, :r] = scaled
            a_stacked.append(a)
            b_stacked.append(b)
        return tuple(a_stacked), tuple(b_stacked)

    def kernel(self, x):
        # The base linear as its own (observable) op: what vLLM's LoRA layer adds the update to.
        out = self.base(x)
        if self.base.engine_rows is not None:
            out = out.index_select(-1, self.base.engine_rows.to(out.device))
        a_stacked, b_stacked = self.derived.get()
        x2 = x.reshape(-1, x.shape[-1])
        wrapper = SteppedPunica(self.mapping.get(x2.shape[0]), self._step)
        y = out.view(-1, out.shape[-1])
        wrapper.add_lora_linear(y, x2, a_stacked, b_stacked, 1.0, tuple(self.out_sizes))
        if self.base.engine_rows is not None:
            out = out.index_select(-1, self.base.trainer_cols.to(out.device))
        return out

    def _step(self, kind: str, run, out):
        return self.steps[kind](run, out)

    def __call__(self, x):
        return _LoRALinearFn.apply(x, self, *self.params)


class _LoRALinearFn(Function):
    @staticmethod
    def forward(ctx, x, op: AlignedLoRALinear, *params):
        ctx.save_for_backward(x, *params)
        ctx.op = op
        return op.kernel(x)

    @staticmethod
    def backward(ctx, g):
        x, *params = ctx.saved_tensors
        op = ctx.op
        _, base_weight = op.base.derived.get()
        g2 = g.reshape(-1, g.shape[-1]).float()
        x2 = x.reshape(-1, x.shape[-1]).float()
        gx = g2 @ base_weight.float()  # both in the trainer's row order
        if op.base.engine_rows is not None:
            g2 = g2.index_select(-1, op.base.engine_rows.to(g2.device))  # the slices are vLLM's
        grads = []
        it = iter(params)
        offset = 0
        for pair, size in zip(op.pairs, op.out_sizes):
            gs = g2[:, offset : offset + size]
            offset += size
            if pair is None:
                continue
            a, b = next(it).float(), next(it).float()
            buf = x2 @ a.t()  # [T, r]
            gbuf = (gs @ b) * op.scaling  # [T, r]
            gx = gx + gbuf @ a
            grads.append((gbuf.t() @ x2).to(pair.lora_A.dtype))
            grads.append(((gs.t() @ buf) * op.scaling).to(pair.lora_B.dtype))
        return (gx.reshape(x.shape).to(x.dtype), None, *grads)


def lora_linears(runtime, adapter: LoRAAdapter, base_ops: list[dict], merged=MERGED_TARGETS,
                 mapping: TokenMapping | None = None) -> list[dict]:
    """The LoRA op of every merged linear an adapter targets, per layer: ``{"qkv": op, ...}``, and
    of the routed experts and shared expert of an MoE layer (``"experts"``, ``"shared_gate_up"``,
    ``"shared_down"``); ``merged``: the model's linears (key of its op) and the checkpoint modules
    stacked in each; ``mapping``: the token mapping to share with other calls (a new one by default)."""
    mapping = mapping or TokenMapping(runtime)
    if adapter.lora_config.target_parameters:
        check_engine_serves_fused_experts(runtime)
    out = []
    for i, ops in enumerate(base_ops):
        layer = {}
        for key, parts in merged.items():
            pairs = [adapter.pair(i, part) for part in parts]
            if all(p is None for p in pairs):
                continue
            if key not in ops:
                raise NotImplementedError(f"layer {i} has no {key} linear for the adapter's {list(parts)}")
            layer[key] = AlignedLoRALinear(runtime, ops[key], pairs, adapter.lora_config, mapping)
        shared = adapter.shared_expert_pairs(i)
        if shared is not None:
            layer["shared_gate_up"] = AlignedLoRALinear(
                runtime, ops["shared_gate_up"], [shared["gate_proj"], shared["up_proj"]], adapter.lora_config, mapping
            )
            layer["shared_down"] = AlignedLoRALinear(
                runtime, ops["shared_down"], [shared["down_proj"]], adapter.lora_config, mapping
            )
        experts = adapter.expert_pairs(i)
        if experts is not None:
            from zero_mismatch_plugin.aligned.moe import AlignedMoELoRA

            layer["experts"] = AlignedMoELoRA(runtime, ops["experts"], experts, adapter.lora_config, mapping)
        out.append(layer)
    return out


def merged_lora_weight(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float):
    """PEFT's merged weight W + s·BA (what ``merge_and_unload`` computes): the forward vLLM does
    not run. Used as the negative control."""
    return weight + scaling * (lora_b @ lora_a)
