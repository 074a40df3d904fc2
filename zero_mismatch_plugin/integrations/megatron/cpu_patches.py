"""Runtime patches megatron-core 0.16.1 needs to run expert and pipeline parallelism (and its stock
MoE router) on a CPU.

megatron's all-to-all token dispatcher keeps its split sizes on the GPU and moves them to the host
on a side CUDA stream; on a CPU they are already host tensors, which ``maybe_move_tensor_to_cpu``
leaves as tensors, and ``all_to_all_single`` takes no tensor split sizes. Each patch handles the
CPU case and calls the original otherwise; applied by :func:`moe_on_cpu` when
``standalone.build_gpt_model`` builds an MoE model, listed by ``zmrl patches list``.
"""

from __future__ import annotations

from functools import partial

import torch

from zero_mismatch_plugin.integrations.patches import ABSENT, apply, is_applied, patch_at, remove
from zero_mismatch_plugin.tables import upstream_versions

megatron_patch = partial(patch_at, package="megatron.core", versions=upstream_versions.MEGATRON_CORE,
                         when="a megatron-core MoE model built by the plugin on a CPU")

_DISPATCHER = "megatron.core.transformer.moe.token_dispatcher"


class _HostStream:
    """Stands in for the dispatcher's class-wide CUDA side stream on a CPU: never used there."""


def _no_cuda_stream(original):
    return original if torch.cuda.is_available() else _HostStream()


ALLTOALL_SIDE_STREAM = megatron_patch(
    f"{_DISPATCHER}:MoEAlltoAllTokenDispatcher.cuda_dtoh_stream", _no_cuda_stream,
    name="megatron-alltoall-no-cuda-stream",
    why="MoEAlltoAllTokenDispatcher creates a torch.cuda.Stream when it is first built, which a CPU-only torch cannot",
)


def _host_splits(original):
    def _maybe_dtoh_and_synchronize(self, point, tokens_per_expert=None):
        if torch.cuda.is_available() or self.drop_and_pad:
            return original(self, point, tokens_per_expert)
        if point == self.cuda_dtoh_point:
            # What the GPU path leaves at this point: split sizes as host numpy arrays, counts as
            # host tensors (no stream, no event: everything already is on the host).
            for name in ("input_splits", "output_splits", "output_splits_tp"):
                value = getattr(self, name, None)
                if torch.is_tensor(value):
                    setattr(self, name, value.numpy())
        return tokens_per_expert

    return _maybe_dtoh_and_synchronize


ALLTOALL_HOST_SPLITS = megatron_patch(
    f"{_DISPATCHER}:MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize", _host_splits,
    name="megatron-alltoall-host-splits",
    why="on a CPU the all-to-all split sizes stay tensors (maybe_move_tensor_to_cpu converts CUDA tensors only) and "
        "all_to_all_single() refuses them; the GPU path's side-stream copy and event do not exist there",
)

def _no_transformer_engine_gemm(original):
    return None if original is ABSENT else original


ROUTER_GEMM_NAME = megatron_patch(
    "megatron.core.transformer.moe.moe_utils:te_general_gemm", _no_transformer_engine_gemm,
    name="megatron-router-gemm-unbound",
    why="without Transformer Engine moe_utils leaves te_general_gemm unbound and megatron's stock router raises "
        "NameError testing it for None; bound to None, the router takes its torch GEMM",
)


class _HostTorch:
    """``torch`` as megatron's schedules see it on a CPU: the one tensor they place on ``"cuda"`` by
    name (the token count they add up) goes to the host; everything else is torch itself."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs):
        return torch.zeros(*args, device="cpu" if device == "cuda" else device, **kwargs)


def _schedules_torch(original):
    return original if torch.cuda.is_available() else _HostTorch()


SCHEDULE_TOKEN_COUNT = megatron_patch(
    "megatron.core.pipeline_parallel.schedules:torch", _schedules_torch,
    name="megatron-schedule-host-token-count",
    why="megatron's forward-backward schedules allocate their token count with device='cuda', which a CPU-only "
        "torch cannot",
    when="a megatron-core model at pipeline parallelism > 1 built by the plugin on a CPU",
)


def _host_embedding_copy(original):
    def setup_embeddings_and_output_layer(self):
        if torch.cuda.is_available():
            return original(self)
        # The first and last stages' copies of a tied embedding meet in an all-reduce after
        # ``weight.data.cuda()``; on a CPU the data stays where it is.
        cuda = torch.Tensor.cuda
        torch.Tensor.cuda = lambda tensor, *args, **kwargs: tensor
        try:
            return original(self)
        finally:
            torch.Tensor.cuda = cuda

    return setup_embeddings_and_output_layer


TIED_EMBEDDING_COPY = megatron_patch(
    "megatron.core.models.common.language_module.language_module:LanguageModule.setup_embeddings_and_output_layer",
    _host_embedding_copy,
    name="megatron-tied-embedding-on-host",
    why="with tied embeddings over pipeline stages megatron moves the last stage's copy to the GPU before "
        "all-reducing it with the first stage's",
    when="a megatron-core model at pipeline parallelism > 1 built by the plugin on a CPU",
)

MOE_PATCHES = [ALLTOALL_SIDE_STREAM, ALLTOALL_HOST_SPLITS, ROUTER_GEMM_NAME]
PIPELINE_PATCHES = [SCHEDULE_TOKEN_COUNT, TIED_EMBEDDING_COPY]
PATCHES = MOE_PATCHES + PIPELINE_PATCHES


def moe_on_cpu() -> None:
    """Apply the patches (once; they stay until :func:`remove_all`). A no-op with CUDA."""
    if torch.cuda.is_available():
        return
    import megatron.core.transformer.moe.moe_utils  # noqa: F401 - the patches' modules
    import megatron.core.transformer.moe.token_dispatcher  # noqa: F401

    for patch in MOE_PATCHES:
        apply(patch)


def remove_all() -> None:
    for patch in PATCHES:
        if is_applied(patch):
            remove(patch)


def pipeline_on_cpu() -> None:
    """Apply the pipeline patches (once; they stay until :func:`remove_all`). A no-op with CUDA."""
    if torch.cuda.is_available():
        return
    import megatron.core.models.common.language_module.language_module  # noqa: F401 - the patches' modules
    import megatron.core.pipeline_parallel.schedules  # noqa: F401

    for patch in PIPELINE_PATCHES:
        apply(patch)
