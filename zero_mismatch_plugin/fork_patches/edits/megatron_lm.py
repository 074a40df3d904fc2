"""The edits of the Megatron-LM fork patch."""

from __future__ import annotations

from zero_mismatch_plugin.fork_patches.edits.edit import Edit

ATTENTION = "megatron/core/transformer/attention.py"
GPT_MODEL = "megatron/core/models/gpt/gpt_model.py"

MEGATRON_SPEC_HOOKS = [
    Edit(
        ATTENTION,
        old="""\
    q_layernorm: Union[ModuleSpec, type] = None
    k_layernorm: Union[ModuleSpec, type] = None
""",
        new="""\
    q_layernorm: Union[ModuleSpec, type] = None
    k_layernorm: Union[ModuleSpec, type] = None
    # Replaces apply_rotary_pos_emb on q and k when set: built with (config=...), called as
    # rotary_application(query, key, rotary_pos_emb=, packed_seq_params=, inference_context=)
    # and returns (query, key) in the same layout. Lets a spec choose the rotary kernel.
    rotary_application: Union[ModuleSpec, type] = None
""",
    ),
    Edit(
        ATTENTION,
        old="""\
        self.checkpoint_core_attention = (
""",
        new="""\
        rotary_application = getattr(submodules, "rotary_application", None)
        self.rotary_application = (
            build_module(rotary_application, config=self.config)
            if rotary_application is not None
            else None
        )

        self.checkpoint_core_attention = (
""",
    ),
    Edit(
        ATTENTION,
        old="""\
        if rotary_pos_emb is not None and (
            not self.config.flash_decode or inference_context is None
        ):
""",
        new="""\
        if self.rotary_application is not None:
            if not split_qkv:
                raise ValueError(
                    "a spec'd rotary_application needs separate q and k; "
                    "set fused_single_qkv_rope=False"
                )
            query, key = self.rotary_application(
                query,
                key,
                rotary_pos_emb=rotary_pos_emb,
                packed_seq_params=packed_seq_params,
                inference_context=inference_context,
            )
        elif rotary_pos_emb is not None and (
            not self.config.flash_decode or inference_context is None
        ):
""",
    ),
    Edit(
        GPT_MODEL,
        old="from collections import OrderedDict\nfrom typing import Dict, Literal, Optional\n",
        new="from collections import OrderedDict\nfrom dataclasses import dataclass\nfrom typing import Dict, Literal, Optional, Union\n",
    ),
    Edit(
        GPT_MODEL,
        old="""\
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlock
""",
        new="""\
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_block import (
    TransformerBlock,
    TransformerBlockSubmodules,
)
""",
    ),
    Edit(
        GPT_MODEL,
        old="""\
class GPTModel(LanguageModule):
""",
        new="""\
@dataclass
class GPTModelSubmodules(TransformerBlockSubmodules):
    \"\"\"A decoder block spec that also names what GPTModel builds after the block.

    Pass it as ``transformer_layer_spec``: the block is built from ``layer_specs`` and
    ``layer_norm`` as usual, and a provider that forwards the spec forwards these too.

    Args:
        output_layer: built with the arguments of ``ColumnParallelLinear`` and called like it
            (``output_layer(hidden_states, weight=, runtime_gather_output=) -> (logits, bias)``).
            None: ``ColumnParallelLinear``.
        token_logprob: built with ``(config=...)``; ``token_logprob(logits [s, b, V], labels
            [b, s]) -> [b, s]`` log-probabilities of the labels. When set, ``forward(labels=)``
            returns their negation as the per-token loss instead of the cross entropy.
    \"\"\"

    output_layer: Optional[Union[ModuleSpec, type]] = None
    token_logprob: Optional[Union[ModuleSpec, type]] = None


class GPTModel(LanguageModule):
""",
    ),
    Edit(
        GPT_MODEL,
        old="""\
            self.output_layer = tensor_parallel.ColumnParallelLinear(
""",
        new="""\
            output_layer_spec = getattr(transformer_layer_spec, "output_layer", None)
            self.output_layer = build_module(
                output_layer_spec or tensor_parallel.ColumnParallelLinear,
""",
    ),
    Edit(
        GPT_MODEL,
        old="""\
        if self.pre_process or self.post_process or self.mtp_process:
""",
        new="""\
        token_logprob_spec = getattr(transformer_layer_spec, "token_logprob", None)
        self.token_logprob = (
            build_module(token_logprob_spec, config=config)
            if self.post_process and token_logprob_spec is not None
            else None
        )

        if self.pre_process or self.post_process or self.mtp_process:
""",
    ),
    Edit(
        GPT_MODEL,
        old="""\
        loss = self.compute_language_model_loss(labels, logits)
""",
        new="""\
        if self.token_logprob is not None:
            # Negation is exact: -loss is the spec'd logprob bit for bit.
            return -self.token_logprob(logits, labels)

        loss = self.compute_language_model_loss(labels, logits)
""",
    ),
]

# Patch name (as in manifest.yaml) -> its edits.
EDITS: dict[str, list[Edit]] = {
    "megatron-lm-spec-hooks": MEGATRON_SPEC_HOOKS,
}
