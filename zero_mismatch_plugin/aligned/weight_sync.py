"""Trainer -> engine weight sync through vLLM's own weight-loading path.

:class:`WeightSyncExtension` hands the trainer's parameters to each worker's ``reload_weights``
and resets the prefix cache. The engine needs ``worker_extension_cls=runtime.WORKER_EXTENSION``.
See docs/zero-mismatch.md, "Weight sync".
"""

from __future__ import annotations

import torch

from zero_mismatch_plugin.aligned.cpu_weight_reload import repack_shared_cpu_weights, reprocess_moe_as_first_load

_BYTE_VIEWS = {torch.bfloat16: torch.int16, torch.float16: torch.int16}


def encode(name: str, t: torch.Tensor) -> tuple[str, str, list[int], bytes]:
    t = t.detach().cpu().contiguous()
    raw = t.view(_BYTE_VIEWS.get(t.dtype, t.dtype)).numpy().tobytes()
    return name, str(t.dtype).removeprefix("torch."), list(t.shape), raw


def decode(item) -> tuple[str, torch.Tensor]:
    name, dtype_name, shape, raw = item
    dtype = getattr(torch, dtype_name)
    carrier = _BYTE_VIEWS.get(dtype, dtype)
    t = torch.frombuffer(bytearray(raw), dtype=carrier).view(dtype).reshape(shape)
    return name, t


def engine_weights(model) -> list[tuple[str, torch.Tensor]]:
    """(checkpoint name, engine-dtype tensor) pairs for an AlignedCausalLM."""
    return [(name, p.detach().to(model.runtime.dtype)) for name, p in model.named_parameters()]


class WeightSyncExtension:
    """Mixed into vLLM's worker class; methods are reachable with ``llm.collective_rpc``."""

    def zmrl_load_weights(self, encoded: list) -> int:
        weights = [decode(item) for item in encoded]
        device = self.device if hasattr(self, "device") else torch.device("cpu")
        weights = [(n, t.to(device)) for n, t in weights]
        # CPU MoE layers: pad and pre-pack the new expert weights as at the first load.
        reprocess_moe_as_first_load(self.model_runner.get_model())
        self.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
        repack_shared_cpu_weights(self.model_runner.get_model())
        return len(weights)


def load_named_weights(llm, named_weights) -> None:
    """Load (checkpoint name, tensor) pairs into every worker of ``llm`` (a ``vllm.LLM``) through
    vLLM's weight-loading path, then drop cached prefixes computed with the old weights."""
    encoded = [encode(n, t) for n, t in named_weights]
    loaded = llm.collective_rpc("zmrl_load_weights", args=(encoded,))
    if any(n != len(encoded) for n in loaded):
        raise RuntimeError(f"weight sync: workers loaded {loaded} of {len(encoded)} tensors")
    llm.reset_prefix_cache()


def sync_weights(llm, model) -> None:
    """Copy ``model``'s current parameters into the engine behind ``llm`` (a ``vllm.LLM``)."""
    load_named_weights(llm, engine_weights(model))
