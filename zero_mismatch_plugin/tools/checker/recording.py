"""The one recorder of ``zmrl bisect``: every op output of one forward, under its canonical name.

Every side records through :class:`OpRecorder`: the trainer faces through the op layer's
observation point (:meth:`OpRecorder.op_layer`, a call named by its kind and order), vLLM's and
transformers' module trees through hooks (:meth:`OpRecorder.on_output`, :meth:`OpRecorder.on_input`).
An optional ``perturb(name, value)`` plants a difference for the bisector's tests.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch

from zero_mismatch_plugin.tools.checker import oplist

Perturb = Callable[[str, torch.Tensor], torch.Tensor]
# (value -> compared layout, compared layout -> value); None: the value is compared as it is.
Layout = tuple[Callable, Callable] | None


def _detached(value):
    if isinstance(value, (tuple, list)):
        return tuple(_detached(v) for v in value)
    return value.detach().clone()


class OpRecorder:
    """Records named op outputs in execution order into :attr:`ops`. Use as a context manager
    (the module hooks it registered are removed on exit)."""

    def __init__(self, perturb: Perturb | None = None):
        self.ops: dict = {}
        self.perturb = perturb
        self.layer: int | None = None
        self._handles: list = []

    def __enter__(self) -> "OpRecorder":
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # ----- the core: one named value ----------------------------------------------------------

    def keep(self, name: str, value, layout: Layout = None):
        """Record ``value`` as ``name``; returns what the forward continues with (the perturbed
        value, if ``perturb`` changed it). A pair (rotary's q, k) is perturbed in its q."""
        to_compared, from_compared = layout or (None, None)
        shown = value if to_compared is None else to_compared(value)
        if self.perturb is not None:
            if isinstance(shown, tuple):
                changed = (self.perturb(name, shown[0]), *shown[1:])
                moved = changed[0] is not shown[0]
            else:
                changed = self.perturb(name, shown)
                moved = changed is not shown
            if moved:
                shown = changed
                value = changed if from_compared is None else from_compared(changed)
        self.ops[name] = _detached(shown)
        return value

    def keep_head(self, logits: torch.Tensor) -> None:
        """The target rows' logits and their full-vocabulary logprobs (vLLM's logprob tail)."""
        from zero_mismatch_plugin.aligned.sampling import vllm_logprobs, vllm_scaled_logits

        logits = self.keep(oplist.LOGITS, logits)
        self.keep(oplist.LOGPROBS, vllm_logprobs(vllm_scaled_logits(logits)))

    # ----- attachment 1: the op layer (both trainer faces) ----------------------------------

    @contextlib.contextmanager
    def op_layer(self, order: list[str]):
        """Record every aligned op called in this block, named in the order of ``order`` (the
        canonical list, :func:`.oplist.op_names`). The lm_head is not recorded here: its rows
        differ between faces; the caller records the target rows with :meth:`keep_head`."""
        from zero_mismatch_plugin.aligned import ops
        from zero_mismatch_plugin.aligned.moe import AlignedMoE, AlignedMoELoRA
        from zero_mismatch_plugin.aligned.lora.ops import LoRAStep

        kinds = {
            ops.AlignedRMSNorm: "norm",
            ops.AlignedLinear: "linear",
            ops.AlignedRotary: "rotary",
            ops.AlignedAttention: "attn",
            ops.AlignedSiluAndMul: "act",
            AlignedMoE: "moe",
            AlignedMoELoRA: "moe",  # the routed experts with their adapter: one op, as vLLM's layer
        }
        pending = [name for name in order if oplist.op_kind(name) is not None]
        cursor = 0

        def next_name(kind: str) -> str:
            nonlocal cursor
            for i in range(cursor, len(pending)):
                if oplist.op_kind(pending[i]) == kind:
                    cursor = i + 1
                    return pending[i]
            raise RuntimeError(
                f"the forward called a {kind} op after {pending[cursor - 1] if cursor else 'the embedding'} "
                "that the canonical op list has no place for: add it to checker/oplist.py"
            )

        def observe(op, run, args):
            # A face's op of its own (e.g. at a layout) says which op of vLLM's it stands for.
            kind = getattr(op, "recorded_as", None) or next((k for cls, k in kinds.items() if isinstance(op, cls)), None)
            if isinstance(op, LoRAStep):
                kind = op.kind  # lora_shrink, lora_expand
            if kind is None:
                return run(*args)
            name = next_name(kind)
            if kind == "norm" and oplist.reads_residual(name):
                return self._residual_norm(name, run, args)
            if kind == "linear" and op.engine_rows is not None:
                # Compared in vLLM's output order; the face computes in its own.
                rows, cols = op.engine_rows, op.trainer_cols
                layout = (lambda t: t.index_select(-1, rows.to(t.device)),
                          lambda t: t.index_select(-1, cols.to(t.device)))
                return self.keep(name, run(*args), layout)
            if kind == "moe":
                out = run(*args)
                layer = op.base if isinstance(op, AlignedMoELoRA) else op
                self.keep(oplist.topk_ids_of(name), layer.last_topk_ids)
                return self.keep(name, out)
            return self.keep(name, run(*args))

        with ops.observed(observe):
            yield self

    def _residual_norm(self, name: str, run, args):
        """A norm of the residual stream: what it reads is recorded too, as ``<name>.input``
        (layer 0's input norm reads the embedding). Fused, it returns (normalised, sum)."""
        if len(args) == 1:
            return self.keep(name, run(self.keep(oplist.norm_input(name), args[0])))
        normed, summed = run(*args)
        summed = self.keep(oplist.norm_input(name), summed)
        return self.keep(name, normed), summed

    # ----- attachment 2: module hooks (vLLM's model, transformers) ----------------------------

    def track_layers(self, layers) -> None:
        """Name per-layer outputs after the decoder layer running (a pre-hook on each)."""
        for index, layer in enumerate(layers):
            self._handles.append(layer.register_forward_pre_hook(self._enter(index)))

    def _enter(self, index: int):
        def pre_hook(module, args):
            self.layer = index

        return pre_hook

    def name(self, kind: str) -> str:
        """``kind`` in the decoder layer running, or ``kind`` itself for a model-level op."""
        model_level = kind.split(".", 1)[0] in oplist.MODEL_OPS  # final_norm.input too
        return kind if model_level else f"layers.{self.layer}.{kind}"

    def on_output(self, module, kind: str, layout: Layout = None, split: Callable | None = None) -> None:
        """Record ``module``'s output as ``kind``. ``split(output) -> (value, rebuild)`` picks
        the value from a structured output (``rebuild(value)`` puts a perturbed one back)."""

        def hook(mod, args, output):
            value, rebuild = split(output) if split is not None else (output, None)
            kept = self.keep(self.name(kind), value, layout)
            if kept is value:
                return None
            return kept if rebuild is None else rebuild(kept)

        self._handles.append(module.register_forward_hook(hook))

    def capture(self, kind: str) -> Callable:
        """A callback recording the value it is given as ``kind`` (how vLLM's MoE router reports
        the experts it chose)."""
        return lambda value: self.keep(self.name(kind), value)

    def on_exit(self, undo: Callable[[], None]) -> None:
        """Call ``undo`` when the recorder closes (with the module hooks)."""
        self._handles.append(_Undo(undo))

    def on_input(self, module, kind: str, layout: Layout = None) -> None:
        """Record the first input of ``module`` as ``kind``."""

        def pre_hook(mod, args):
            kept = self.keep(self.name(kind), args[0], layout)
            return None if kept is args[0] else (kept, *args[1:])

        self._handles.append(module.register_forward_pre_hook(pre_hook))

    def on_lora_linear(self, module, kind: str) -> None:
        """A vLLM LoRA layer (``BaseLinearLayerWithLoRA``): its base output as ``kind``, then its
        two punica steps as ``kind.lora_shrink`` and ``kind.lora_expand``. The layer is handed a
        :class:`~zero_mismatch_plugin.aligned.lora.ops.SteppedPunica` over its wrapper through its own
        ``set_mapping``; the wrapper is put back on exit."""
        from zero_mismatch_plugin.aligned.lora.ops import SteppedPunica

        recorder = self

        class RecordingPunica(SteppedPunica):
            def add_lora_linear(self, y, *args, **kwargs):
                kept = recorder.keep(recorder.name(kind), y)
                if kept is not y:
                    y.copy_(kept)
                return super().add_lora_linear(y, *args, **kwargs)

        def step(step_kind, run, out):
            run()
            return self.keep(f"{self.name(kind)}.{step_kind}", out)

        original = module.punica_wrapper
        module.set_mapping(RecordingPunica(original, step))
        self._handles.append(_Undo(lambda: module.set_mapping(original)))

    def on_fused_norm(self, module, kind: str) -> None:
        """vLLM's RMSNorm: with a residual it returns (normalised, sum), recorded as ``kind`` and
        ``kind.input``; without one (layer 0), its output alone."""

        def hook(mod, args, output):
            name = self.name(kind)
            if not isinstance(output, tuple):
                kept = self.keep(name, output)
                return None if kept is output else kept
            normed, summed = output
            summed_kept = self.keep(oplist.norm_input(name), summed)
            normed_kept = self.keep(name, normed)
            if normed_kept is normed and summed_kept is summed:
                return None
            return normed_kept, summed_kept

        self._handles.append(module.register_forward_hook(hook))


class _Undo:
    def __init__(self, undo):
        self.remove = undo


def first_of_pair(output):
    """A vLLM linear returns (output, bias): the output is compared."""
    return output[0], lambda value: (value, *output[1:])
