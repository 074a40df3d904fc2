"""The residual add of megatron's layer, and the norm after it reading both addends, as vLLM's
fused residual-add + RMSNorm does.

vLLM's decoder layer hands the next norm the layer's output and the residual stream separately
(``fused_add_rms_norm``): the kernel adds them in fp32, stores the sum rounded to the model dtype
as the new residual, and normalises the unrounded fp32 sum. Megatron adds first
(``self_attn_bda`` / ``mlp_bda``) and normalises the stored sum. In fp32 the two agree; in bf16
the norm of the rounded sum is other numbers. So the aligned spec's bias-dropout-add
(:func:`aligned_residual_add`) records the addends of each sum it returns, and the norm given
that sum (:func:`residual_addends`) calls vLLM's fused kernel on them: the residual stream is the
engine's rounded sum, the norm's output the engine's. How: docs/megatron.md ("bf16").
"""

from __future__ import annotations

import weakref

# id(sum) -> (a weak reference to the sum, the layer output, the residual). An entry goes when its
# sum is freed, so a later tensor at the same address is never taken for it.
_addends: dict[int, tuple] = {}


def record_addends(total, x, residual) -> None:
    """Remember that ``total`` is ``x + residual`` (for :func:`residual_addends`)."""
    key = id(total)

    def forget(_ref, key=key):
        _addends.pop(key, None)

    _addends[key] = (weakref.ref(total, forget), x, residual)


def residual_addends(total):
    """``(layer output, residual)`` whose sum ``total`` is, if :func:`aligned_residual_add` made it; else None."""
    entry = _addends.get(id(total))
    if entry is None or entry[0]() is not total:
        return None
    return entry[1], entry[2]


def aligned_residual_add(training: bool, fused: bool):
    """The aligned spec's ``self_attn_bda`` / ``mlp_bda`` (megatron's ``get_bias_dropout_add``
    signature): ``x + residual`` in the model dtype, the rounded sum vLLM keeps as its residual,
    with its addends recorded for the norm that reads it. vLLM's layers have no output bias and
    no dropout: either is refused rather than left out."""

    def residual_add(x_with_bias, residual, prob):
        x, bias = x_with_bias
        if bias is not None:
            raise NotImplementedError("aligned megatron spec: an output bias before the residual add "
                                      "(vLLM's decoder layers have none): set add_bias_linear=False")
        if training and prob:
            raise NotImplementedError(f"aligned megatron spec: hidden dropout {prob} (vLLM has none): "
                                      "set hidden_dropout=0")
        total = x + residual
        record_addends(total, x, residual)
        return total

    return residual_add
