"""Trainer backends the checker compares with the engine, and the registry that names them.

A backend is the trainer side of ``zmrl check`` / ``zmrl bisect``: it loads a checkpoint
directory and answers three questions about a packed batch (:class:`~zero_mismatch_plugin.aligned.PackedBatch`,
prompt + response per sequence, targets = the response tokens):

* :meth:`TrainerBackend.token_logprobs` — logprob of every target token, [R] float32;
* :meth:`TrainerBackend.full_logprobs` — all-vocabulary logprobs at the target rows, [R, V];
* :meth:`TrainerBackend.intermediates` — every op's output under the canonical names of
  :mod:`.oplist` (ops a backend cannot expose are simply absent and are not compared), with an
  optional ``perturb(name, tensor) -> tensor`` applied to an op's output before the rest of the
  forward uses it (how the bisector's own tests plant a difference).

Backends are registered in :data:`.registry.TRAINER_BACKENDS` as ``"module:callable"`` strings,
imported only when chosen, so a backend whose framework is not installed costs nothing until
asked for. A new one is one line there; the callable is called as
``factory(model_dir, max_model_len=..., seed=...)``.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Callable, Protocol, runtime_checkable

import torch

from . import oplist
from .registry import KNOWN_TRAINERS, TRAINER_BACKENDS

Perturb = Callable[[str, torch.Tensor], torch.Tensor]


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


def available_backends() -> list[str]:
    return list(TRAINER_BACKENDS)


def load_backend(name: str, model_dir, max_model_len: int, seed: int = 0) -> TrainerBackend:
    """Build the backend registered as ``name`` for ``model_dir``."""
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
    backend = factory(Path(model_dir), max_model_len=max_model_len, seed=seed)
    if not isinstance(backend, TrainerBackend):
        raise BackendUnavailable(f"{target} does not implement the TrainerBackend interface")
    return backend


def _perturbed(perturb: Perturb | None, name: str, value: torch.Tensor) -> torch.Tensor:
    return value if perturb is None else perturb(name, value)


# ----- aligned: the plugin's trainer forward built from vLLM's kernels ---------------------


class _Recording:
    """Wraps one aligned op; records (and optionally perturbs) what it returns.

    ``names`` maps the n-th call to the op's name, so a shared op object (the model has one
    rotary, one attention and one activation for all layers) is named per layer by the order of
    its calls. A fused residual-add norm (``fused_norm``) returns (normalised, residual sum) and
    is recorded as ``<name>`` and ``<name>.input``; called without a residual (layer 0), the
    tensor it normalises is the embedding output, recorded as ``embed``.
    """

    def __init__(self, op, record: dict, perturb: Perturb | None, names: Callable[[int], str], fused_norm=False):
        self.op = op
        self.record = record
        self.perturb = perturb
        self.names = names
        self.fused_norm = fused_norm
        self.calls = 0

    def __getattr__(self, item):
        return getattr(self.op, item)

    def _keep(self, name, value):
        value = _perturbed(self.perturb, name, value)
        self.record[name] = value.detach().clone()
        return value

    def __call__(self, *args):
        name = self.names(self.calls)
        self.calls += 1
        if self.fused_norm and len(args) == 1:
            args = (self._keep(oplist.EMBED, args[0]),)
        out = self.op(*args)
        if self.fused_norm and len(args) == 2:
            normed, summed = out
            summed = self._keep(name + ".input", summed)
            return self._keep(name, normed), summed
        if isinstance(out, tuple):  # rotary: (q, k); a perturbation applies to q
            out = (_perturbed(self.perturb, name, out[0]), *out[1:])
            self.record[name] = tuple(t.detach().clone() for t in out)
            return out
        return self._keep(name, out)


class AlignedBackend:
    """``AlignedCausalLM``: vLLM's kernels in vLLM's order, the plugin's trainer forward."""

    name = "aligned"

    def __init__(self, model_dir: Path, max_model_len: int = 256, seed: int = 0):
        from zero_mismatch_plugin.aligned import AlignedCausalLM

        self.model = AlignedCausalLM.from_pretrained(model_dir, max_model_len=max_model_len, seed=seed)
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
        """Runs the model's own ``hidden_states`` with every op wrapped by a recorder."""
        m = self.model
        record: dict = {}
        saved_layer_ops = [dict(ops) for ops in m.layer_ops]
        saved = {attr: getattr(m, attr) for attr in ("rotary", "attention", "act", "final_norm")}
        kinds = {
            "input_norm": "input_norm",
            "post_norm": "post_attention_norm",
            "qkv": "qkv_proj",
            "o": "o_proj",
            "gate_up": "gate_up_proj",
            "down": "down_proj",
            "q_norm": "q_norm",
            "k_norm": "k_norm",
        }
        try:
            for i, ops in enumerate(m.layer_ops):
                for key, op in list(ops.items()):
                    name = f"layers.{i}.{kinds[key]}"
                    fused = key in ("input_norm", "post_norm")
                    ops[key] = _Recording(op, record, perturb, lambda _c, n=name: n, fused)
            for attr, kind in (("rotary", "rotary"), ("attention", "attn"), ("act", "act")):
                op = saved[attr]
                setattr(m, attr, _Recording(op, record, perturb, lambda c, k=kind: f"layers.{c}.{k}"))
            m.final_norm = _Recording(saved["final_norm"], record, perturb, lambda _c: oplist.FINAL_NORM, True)
            hidden = m.hidden_states(batch)
        finally:
            for ops, original in zip(m.layer_ops, saved_layer_ops):
                ops.clear()
                ops.update(original)
            for attr, op in saved.items():
                setattr(m, attr, op)
        from zero_mismatch_plugin.aligned import SamplingTransform

        rows = batch.target_rows.to(hidden.device)
        logits = _perturbed(perturb, oplist.LOGITS, m.logits_head(hidden.index_select(0, rows)))
        record[oplist.LOGITS] = logits.detach().clone()
        logprobs = SamplingTransform().logprobs(logits)
        record[oplist.LOGPROBS] = _perturbed(perturb, oplist.LOGPROBS, logprobs).detach().clone()
        return record


# ----- hf: transformers' standard kernels, the usual trainer baseline ----------------------


class HFBackend:
    """A transformers ``AutoModelForCausalLM`` in fp32, one sequence at a time."""

    name = "hf"

    def __init__(self, model_dir: Path, max_model_len: int = 256, seed: int = 0):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
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
            record = self._trace(ids, perturb)
            rows = slice(prompt_len - 1, prompt_len - 1 + response_len)
            logits = _perturbed(perturb, oplist.LOGITS, record.pop("_all_logits")[rows].float())
            record[oplist.LOGITS] = logits
            record[oplist.LOGPROBS] = _perturbed(perturb, oplist.LOGPROBS, logits.log_softmax(-1))
            per_sequence.append(record)
        joined = {}
        for name in per_sequence[0]:
            values = [r[name] for r in per_sequence]
            if isinstance(values[0], tuple):
                joined[name] = tuple(torch.cat(parts) for parts in zip(*values))
            else:
                joined[name] = torch.cat(values)
        return joined

    def _trace(self, ids, perturb):
        """One sequence; returns op name -> [T, ...] (batch dimension dropped)."""
        model = self.model
        record: dict = {}
        handles = []
        current = {"layer": None}
        first = lambda t: t[0]  # noqa: E731 - drop the batch dimension

        def output_hook(name_of, take=first):
            def hook(module, args, output):
                name = name_of()
                out = _perturbed(perturb, name, output) if perturb else output
                record[name] = take(out).detach().clone()
                return out

            return hook

        def input_hook(name_of):
            def hook(module, args):
                name = name_of()
                x = _perturbed(perturb, name, args[0]) if perturb else args[0]
                record[name] = x[0].detach().clone()
                return (x, *args[1:])

            return hook

        def layer_name(kind):
            return lambda: f"layers.{current['layer']}.{kind}"

        def enter(index):
            def hook(module, args, kwargs=None):
                current["layer"] = index

            return hook

        inner = model.model
        handles.append(inner.embed_tokens.register_forward_hook(output_hook(lambda: oplist.EMBED)))
        for i, layer in enumerate(inner.layers):
            handles.append(layer.register_forward_pre_hook(enter(i)))
            attn, mlp = layer.self_attn, layer.mlp
            if i > 0:
                handles.append(layer.input_layernorm.register_forward_pre_hook(input_hook(layer_name("input_norm.input"))))
            handles.append(layer.input_layernorm.register_forward_hook(output_hook(layer_name("input_norm"))))
            for part in ("q_proj", "k_proj", "v_proj"):
                handles.append(getattr(attn, part).register_forward_hook(output_hook(layer_name(f"qkv_proj.{part}"))))
            if self.qk_norm:
                handles.append(attn.q_norm.register_forward_hook(output_hook(layer_name("q_norm"))))
                handles.append(attn.k_norm.register_forward_hook(output_hook(layer_name("k_norm"))))
            handles.append(attn.o_proj.register_forward_pre_hook(input_hook(layer_name("attn"))))
            handles.append(attn.o_proj.register_forward_hook(output_hook(layer_name("o_proj"))))
            handles.append(
                layer.post_attention_layernorm.register_forward_pre_hook(input_hook(layer_name("post_attention_norm.input")))
            )
            handles.append(
                layer.post_attention_layernorm.register_forward_hook(output_hook(layer_name("post_attention_norm")))
            )
            for part in ("gate_proj", "up_proj"):
                handles.append(getattr(mlp, part).register_forward_hook(output_hook(layer_name(f"gate_up_proj.{part}"))))
            handles.append(mlp.down_proj.register_forward_pre_hook(input_hook(layer_name("act"))))
            handles.append(mlp.down_proj.register_forward_hook(output_hook(layer_name("down_proj"))))
        handles.append(inner.norm.register_forward_pre_hook(input_hook(lambda: oplist.FINAL_NORM + ".input")))
        handles.append(inner.norm.register_forward_hook(output_hook(lambda: oplist.FINAL_NORM)))
        handles.append(model.lm_head.register_forward_hook(output_hook(lambda: "_all_logits")))

        # Rotary is a function in transformers' modeling code, not a module: wrap it there.
        modeling = sys.modules[type(model).__module__]
        original_rope = getattr(modeling, "apply_rotary_pos_emb", None)

        def recording_rope(q, k, *args, **kwargs):
            q_out, k_out = original_rope(q, k, *args, **kwargs)
            name = layer_name("rotary")()
            if perturb:
                q_out = perturb(name, q_out)
            # [B, heads, T, D] -> [T, heads * D], the engine's layout.
            record[name] = tuple(t[0].transpose(0, 1).reshape(t.shape[2], -1).detach().clone() for t in (q_out, k_out))
            return q_out, k_out

        if original_rope is not None:
            modeling.apply_rotary_pos_emb = recording_rope
        try:
            model(input_ids=ids[None])
        finally:
            if original_rope is not None:
                modeling.apply_rotary_pos_emb = original_rope
            for h in handles:
                h.remove()
        # vLLM runs q/k/v and gate/up as one merged linear each: compare the concatenation.
        for i in range(len(inner.layers)):
            p = f"layers.{i}."
            record[p + "qkv_proj"] = torch.cat(
                [record.pop(p + f"qkv_proj.{part}") for part in ("q_proj", "k_proj", "v_proj")], dim=-1
            )
            record[p + "gate_up_proj"] = torch.cat(
                [record.pop(p + f"gate_up_proj.{part}") for part in ("gate_proj", "up_proj")], dim=-1
            )
        return record
