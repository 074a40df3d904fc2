"""Trainer backend for ``zmrl check --trainer megatron``: an aligned megatron-core GPTModel.

Answers the checker's three questions (see ``zero_mismatch_plugin.checker.backends``) for a
packed batch, run as megatron's packed THD input. Intermediates are recorded with forward hooks
on the megatron modules under the checker's canonical op names; ``qkv_proj`` is reported in
vLLM's ``[q; k; v]`` column order. The rotary, attention and activation outputs happen inside
single modules here and are not reported (the checker skips absent ops).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..aligned.sampling import SamplingTransform
from ..megatron.standalone import MegatronScorer, packed_logits, token_logprobs_from_logits
from . import oplist


def _rows(t: torch.Tensor) -> torch.Tensor:
    # THD activations are [T, 1, features]: one row per token.
    return t.reshape(t.shape[0] * t.shape[1], -1) if t.dim() == 3 else t


class MegatronBackend:
    name = "megatron"

    def __init__(self, model_dir: Path, max_model_len: int = 256, seed: int = 0):
        self.scorer = MegatronScorer.from_model_dir(model_dir, max_model_len=max_model_len, seed=seed)
        self.model = self.scorer.model.eval()
        self.runtime = self.scorer.runtime
        self.vocab_size = self.runtime.hf_config.vocab_size

    @torch.no_grad()
    def token_logprobs(self, batch) -> torch.Tensor:
        return token_logprobs_from_logits(packed_logits(self.model, batch), batch).float()

    @torch.no_grad()
    def full_logprobs(self, batch) -> torch.Tensor:
        logits = packed_logits(self.model, batch)
        rows = logits.index_select(0, batch.target_rows.to(logits.device))
        return SamplingTransform().logprobs(rows).float()

    @torch.no_grad()
    def intermediates(self, batch, perturb=None) -> dict:
        gpt = self.model
        record: dict = {}
        handles = []

        def output_hook(name, engine_cols=None):
            def hook(module, inputs, output):
                value = output[0] if isinstance(output, tuple) else output
                rows = _rows(value)
                reported = rows if engine_cols is None else rows.index_select(-1, engine_cols)
                if perturb is not None:
                    changed = perturb(name, reported.clone())
                    if engine_cols is not None:
                        back = torch.empty_like(changed)
                        back[:, engine_cols] = changed
                        changed = back
                    value = changed.reshape(value.shape)
                    reported = changed if engine_cols is None else changed.index_select(-1, engine_cols)
                record[name] = reported.detach().clone()
                if perturb is None:
                    return None
                return (value,) + tuple(output[1:]) if isinstance(output, tuple) else value

            return hook

        def input_hook(name):
            def hook(module, inputs):
                record[name] = _rows(inputs[0]).detach().clone()

            return hook

        def watch(module, name, engine_cols=None, residual_input=None):
            if residual_input is not None:
                handles.append(module.register_forward_pre_hook(input_hook(residual_input)))
            handles.append(module.register_forward_hook(output_hook(name, engine_cols)))

        try:
            watch(gpt.embedding, oplist.EMBED)
            for i, layer in enumerate(gpt.decoder.layers):
                p = f"layers.{i}."
                attn, mlp = layer.self_attention, layer.mlp
                watch(layer.input_layernorm, p + "input_norm",
                      residual_input=None if i == 0 else p + "input_norm.input")
                watch(attn.linear_qkv, p + "qkv_proj", engine_cols=attn.linear_qkv.engine_rows)
                watch(attn.linear_proj, p + "o_proj")
                watch(layer.pre_mlp_layernorm, p + "post_attention_norm",
                      residual_input=p + "post_attention_norm.input")
                watch(mlp.linear_fc1, p + "gate_up_proj")
                watch(mlp.linear_fc2, p + "down_proj")
            watch(gpt.decoder.final_layernorm, oplist.FINAL_NORM, residual_input=oplist.FINAL_NORM + ".input")
            logits = packed_logits(gpt, batch)
        finally:
            for h in handles:
                h.remove()
        rows = logits.index_select(0, batch.target_rows.to(logits.device))
        if perturb is not None:
            rows = perturb(oplist.LOGITS, rows)
        record[oplist.LOGITS] = rows.detach().clone()
        logprobs = SamplingTransform().logprobs(rows)
        if perturb is not None:
            logprobs = perturb(oplist.LOGPROBS, logprobs)
        record[oplist.LOGPROBS] = logprobs.detach().clone()
        return record
