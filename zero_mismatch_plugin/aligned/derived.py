"""Copies of trainer parameters in the layout and dtype vLLM's kernels need, kept up to date.

The trainer owns its (fp32) parameters; vLLM's kernels want merged qkv / gate_up matrices, a
padded lm_head, the model dtype and, on CPU, a pre-packed oneDNN handle. Those are derived here
and re-derived whenever a source parameter changes: an in-place update (what optimizers do)
bumps the tensor's version counter, and replacing ``.data`` changes its storage, both of which
are checked before every use. Writes through ``param.data`` are invisible to the version counter;
call :meth:`refresh` (or ``AlignedCausalLM.refresh_derived_weights``) after those.
"""

from __future__ import annotations

import torch


def _stamp(tensors) -> tuple:
    return tuple((t.data_ptr(), t._version, tuple(t.shape)) for t in tensors if t is not None)


class DerivedWeight:
    """A tensor computed from source parameters by ``build``; rebuilt when a source changes."""

    def __init__(self, sources, build):
        self.sources = list(sources)
        self.build = build
        self._stamp = None
        self._value = None

    def get(self):
        stamp = _stamp(self.sources)
        if stamp != self._stamp:
            with torch.no_grad():
                self._value = self.build([s.detach() if s is not None else None for s in self.sources])
            self._stamp = stamp
        return self._value

    def refresh(self):
        self._stamp = None
        return self.get()


def cast_like_engine(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in the engine dtype; no copy when it already is."""
    return t if t.dtype == dtype else t.to(dtype)
