"""Trainer backends the checker compares with the engine, and the registry that names them.

A backend loads a checkpoint directory and answers, for a packed batch, the target tokens'
logprobs, the all-vocabulary logprobs at the target rows, and every op's output under the names
of :mod:`.oplist` (:class:`TrainerBackend`). Backends are ``"module:callable"`` strings in
:data:`.registry.TRAINER_BACKENDS`, imported when chosen and called with the run's
:class:`~.engine.EngineSettings`. See docs/alignment-playbook.md.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Protocol, runtime_checkable

import torch

from zero_mismatch_plugin.tables import upstream_versions
from zero_mismatch_plugin.tools.checker import oplist
from zero_mismatch_plugin.tools.checker.engine import EngineSettings
from zero_mismatch_plugin.tools.checker.recording import OpRecorder, Perturb
from zero_mismatch_plugin.tools.checker.registry import KNOWN_TRAINERS, TRAINER_BACKENDS


def _not_available(name: str) -> str:
    return (
        f"the {name.capitalize()} trainer backend is not available in this installation: no checker "
        f"backend is registered for it. Use --trainer with one of: {', '.join(TRAINER_BACKENDS)}."
    )


class BackendUnavailable(RuntimeError):
    """The requested trainer backend is not registered or cannot be imported here."""


@runtime_checkable
class TrainerBackend(Protocol):
    """What the checker needs from a trainer (see the module docstring)."""

    name: str

    def token_logprobs(self, batch) -> torch.Tensor: ...

    def full_logprobs(self, batch) -> torch.Tensor: ...

    def intermediates(self, batch, perturb: Perturb | None = None) -> dict: ...


def load_backend(name: str, settings: EngineSettings) -> TrainerBackend:
    """Build the backend registered as ``name`` from the run's ``settings``."""
    target = TRAINER_BACKENDS.get(name)
    if target is None:
        if name in KNOWN_TRAINERS:
            raise BackendUnavailable(_not_available(name))
        raise BackendUnavailable(
            f"unknown trainer backend {name!r}; available: {', '.join(TRAINER_BACKENDS)}"
        )
    module_name, _, attr = target.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as error:
        raise BackendUnavailable(
            f"trainer backend {name!r} ({target}) cannot be loaded here: {error}"
        ) from error
    backend = factory(settings)
    if not isinstance(backend, TrainerBackend):
        raise BackendUnavailable(f"{target} does not implement the TrainerBackend interface")
    return backend


# ----- aligned: the plugin's trainer forward built from vLLM's kernels ---------------------


class AlignedBackend:
    """``AlignedCausalLM``: vLLM's kernels in vLLM's order, the plugin's trainer forward."""

    name = "aligned"

    def __init__(self, settings: EngineSettings):
        from zero_mismatch_plugin.faces.aligned_model import AlignedCausalLM

        self.model = AlignedCausalLM.from_pretrained(
            settings.model_dir, lora_dir=settings.lora_dir, **settings.trainer_args
        )
        self.vocab_size = self.model.vocab_size

    @torch.no_grad()
    def token_logprobs(self, batch) -> torch.Tensor:
        return self.model.token_logprobs(batch).float()

    @torch.no_grad()
    def full_logprobs(self, batch) -> torch.Tensor:
        from zero_mismatch_plugin.aligned import SamplingTransform

        logits = self.model.logits(batch)
        return SamplingTransform().logprobs(logits).float()

    @torch.no_grad()
    def intermediates(self, batch, perturb: Perturb | None = None) -> dict:
        """The model's own forward with every op of the op layer recorded."""
        m = self.model
        # The linears carrying the adapter: their LoRA steps are ops of their own in the op list.
        lora = oplist.lora_linears(m.lora.lora_config.targets, m.blocks) if m.lora_enabled else frozenset()
        order = oplist.op_names(m.config.num_hidden_layers, m.blocks.qk_norm, m.blocks, lora=lora)
        with OpRecorder(perturb) as recorder:
            with recorder.op_layer(order):
                hidden = m.hidden_states(batch)
            rows = batch.target_rows.to(hidden.device)
            if m.blocks.final_add_then_norm:  # the engine norms only the rows it scores (compute_logits)
                recorder.ops[oplist.FINAL_NORM] = recorder.ops[oplist.FINAL_NORM].index_select(0, rows)
            # The head with the adapter's lm_head update where it has one.
            head = m.lora_vocab_ops.get("lm_head", m.logits_head) if m.lora_enabled else m.logits_head
            recorder.keep_head(head(hidden.index_select(0, rows)))
        return recorder.ops


# ----- hf: transformers' standard kernels, the usual trainer baseline ----------------------


class HFBackend:
    """A transformers ``AutoModelForCausalLM`` in fp32, one sequence at a time."""

    name = "hf"

    def __init__(self, settings: EngineSettings):
        from transformers import AutoModelForCausalLM

        dtype = getattr(torch, settings.trainer_args.get("dtype", "float32"))
        self.model = AutoModelForCausalLM.from_pretrained(settings.model_dir, dtype=dtype).eval()
        self.vocab_size = self.model.config.vocab_size
        self.qk_norm = hasattr(self.model.model.layers[0].self_attn, "q_norm")

    def _sequences(self, batch):
        start = 0
        for n, r in zip(batch.seq_lens, batch.response_lens):
            ids = batch.input_ids[start : start + n]
            yield ids, n - r, r
            start += n

    @torch.no_grad()
    def full_logprobs(self, batch) -> torch.Tensor:
        out = []
        for ids, prompt_len, response_len in self._sequences(batch):
            logits = self.model(input_ids=ids[None]).logits[0]
            out.append(logits[prompt_len - 1 : prompt_len - 1 + response_len].float().log_softmax(-1))
        return torch.cat(out)

    @torch.no_grad()
    def token_logprobs(self, batch) -> torch.Tensor:
        full = self.full_logprobs(batch)
        return full.gather(-1, batch.target_ids[:, None])[:, 0]

    @torch.no_grad()
    def intermediates(self, batch, perturb: Perturb | None = None) -> dict:
        """Every sequence alone through the model with hooks; per-op outputs joined by token."""
        per_sequence = []
        for ids, prompt_len, response_len in self._sequences(batch):
            with OpRecorder(perturb) as recorder:
                logits = self._trace(recorder, ids)
                rows = logits[prompt_len - 1 : prompt_len - 1 + response_len].float()
                # transformers' usual tail: log_softmax of the logits (this is the baseline).
                recorder.keep(oplist.LOGPROBS, recorder.keep(oplist.LOGITS, rows).log_softmax(-1))
            per_sequence.append(recorder.ops)
        joined = {}
        for name in per_sequence[0]:
            values = [r[name] for r in per_sequence]
            if isinstance(values[0], tuple):
                joined[name] = tuple(torch.cat(parts) for parts in zip(*values))
            else:
                joined[name] = torch.cat(values)
        return joined

    def _trace(self, recorder: OpRecorder, ids) -> torch.Tensor:
        """One sequence through the model, its ops into ``recorder`` as [T, ...] (the batch
        dimension dropped); returns the logits [T, V]."""
        inner = self.model.model
        batch_row = (lambda t: t[0], lambda t: t[None])
        recorder.track_layers(inner.layers)
        recorder.on_output(inner.embed_tokens, oplist.EMBED, batch_row)
        for i, layer in enumerate(inner.layers):
            attn, mlp = layer.self_attn, layer.mlp
            if i > 0:
                recorder.on_input(layer.input_layernorm, "input_norm.input", batch_row)
            recorder.on_output(layer.input_layernorm, "input_norm", batch_row)
            for part in ("q_proj", "k_proj", "v_proj"):
                recorder.on_output(getattr(attn, part), f"qkv_proj.{part}", batch_row)
            if self.qk_norm:
                recorder.on_output(attn.q_norm, "q_norm", batch_row)
                recorder.on_output(attn.k_norm, "k_norm", batch_row)
            recorder.on_input(attn.o_proj, "attn", batch_row)
            recorder.on_output(attn.o_proj, "o_proj", batch_row)
            recorder.on_input(layer.post_attention_layernorm, "post_attention_norm.input", batch_row)
            recorder.on_output(layer.post_attention_layernorm, "post_attention_norm", batch_row)
            if not hasattr(mlp, "gate_proj"):
                _trace_hf_router(recorder, mlp.gate)
                continue
            for part in ("gate_proj", "up_proj"):
                recorder.on_output(getattr(mlp, part), f"gate_up_proj.{part}", batch_row)
            recorder.on_input(mlp.down_proj, "act", batch_row)
            recorder.on_output(mlp.down_proj, "down_proj", batch_row)
        recorder.on_input(inner.norm, oplist.FINAL_NORM + ".input", batch_row)
        recorder.on_output(inner.norm, oplist.FINAL_NORM, batch_row)
        with _recording_hf_rotary(self.model, recorder):
            logits = self.model(input_ids=ids[None]).logits[0]
        # vLLM runs q/k/v and gate/up as one merged linear each: compare the concatenation.
        ops = recorder.ops
        for i in range(len(inner.layers)):
            p = f"layers.{i}."
            ops[p + "qkv_proj"] = torch.cat([ops.pop(p + f"qkv_proj.{n}") for n in ("q_proj", "k_proj", "v_proj")], -1)
            if p + "gate_up_proj.gate_proj" in ops:
                ops[p + "gate_up_proj"] = torch.cat([ops.pop(p + f"gate_up_proj.{n}") for n in ("gate_proj", "up_proj")], -1)
        return logits


def _trace_hf_router(recorder: OpRecorder, router) -> None:
    """transformers' MoE router of one layer ([tokens, hidden] in): its logits, and the experts it
    chose where it returns them ((logits, weights, ids): Qwen2-/Qwen3-MoE, Mixtral). Its experts
    run fused over all of them at once: their output is not recorded (reported as not compared)."""

    def hook(module, args, output):
        logits = output[0] if isinstance(output, tuple) else output
        kept = recorder.keep(recorder.name("router"), logits)
        if isinstance(output, tuple) and len(output) == 3:
            recorder.keep(recorder.name(oplist.TOPK_IDS), output[2])
        if kept is logits:
            return None
        return (kept, *output[1:]) if isinstance(output, tuple) else kept

    recorder.on_exit(router.register_forward_hook(hook).remove)


# transformers versions whose modeling code applies rotary as ``apply_rotary_pos_emb(q, k, ...)``
# returning (q, k) in [batch, heads, tokens, head_dim].
HF_ROTARY_VERSIONS = upstream_versions.TRANSFORMERS


@contextlib.contextmanager
def _recording_hf_rotary(model, recorder: OpRecorder):
    """transformers applies the rotary embedding in a function of the model's modeling module, not
    in a module: a runtime patch of that function records its (q, k) for the block. On another
    transformers version rotary is left unrecorded (reported as not compared)."""
    from zero_mismatch_plugin.integrations import patches as runtime_patches

    def build(original):
        def apply_rotary_pos_emb(q, k, *args, **kwargs):
            q_out, k_out = original(q, k, *args, **kwargs)
            # [1, heads, T, D] <-> [T, heads * D], vLLM's layout.
            layout = (
                lambda pair: tuple(t[0].transpose(0, 1).reshape(t.shape[2], -1) for t in pair),
                lambda pair: tuple(t.reshape(t.shape[0], -1, q_out.shape[-1]).transpose(0, 1)[None] for t in pair),
            )
            return recorder.keep(recorder.name("rotary"), (q_out, k_out), layout)

        return apply_rotary_pos_emb

    patch = runtime_patches.FunctionPatch(
        name="bisect-record-hf-rotary",
        package="transformers",
        versions=HF_ROTARY_VERSIONS,
        module=type(model).__module__,
        owner=None,
        attribute="apply_rotary_pos_emb",
        build=build,
        why="zmrl bisect records transformers' rotary output, which no module returns",
    )
    try:
        runtime_patches.apply(patch)
    except (runtime_patches.UnsupportedVersion, AttributeError):
        yield
        return
    try:
        yield
    finally:
        runtime_patches.remove(patch)
