"""Runtime patches megatron-core 0.16.1 needs to run expert and pipeline parallelism (and its stock
MoE router) on a CPU, and to train inside verl's Megatron engine there.

megatron's all-to-all token dispatcher keeps its split sizes on the GPU and moves them to the host
on a side CUDA stream; on a CPU they are already host tensors, which ``maybe_move_tensor_to_cpu``
leaves as tensors, and ``all_to_all_single`` takes no tensor split sizes. Its optimizer, gradient
clipping, DDP buffers, collectives and distributed checkpoint place tensors on ``"cuda"`` by name
(:class:`_HostTorch` sends them to the host). Each patch handles the CPU case and calls the
original otherwise; applied by :func:`moe_on_cpu` / :func:`pipeline_on_cpu` when
``standalone.build_gpt_model`` builds such a model, and with the training patches by
:func:`training_on_cpu` when verl constructs its Megatron engine on the CPU platform; listed by
``zmrl patches list``.
"""

from __future__ import annotations

import contextlib
from functools import partial

import torch

from zero_mismatch_plugin.integrations.patches import ABSENT, FunctionPatch, apply, is_applied, patch_at, remove
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


def host_split_sizes(dispatcher) -> None:
    """What the all-to-all dispatcher's GPU path leaves at its device-to-host point, on a CPU: the
    split sizes as host numpy arrays (``all_to_all_single`` takes no tensor split sizes), the counts
    as the host tensors they already are (no side stream, no event)."""
    for name in ("input_splits", "output_splits", "output_splits_tp"):
        value = getattr(dispatcher, name, None)
        if torch.is_tensor(value):
            setattr(dispatcher, name, value.numpy())


def _host_splits(original):
    def _maybe_dtoh_and_synchronize(self, point, tokens_per_expert=None):
        if torch.cuda.is_available() or self.drop_and_pad:
            return original(self, point, tokens_per_expert)
        if point == self.cuda_dtoh_point:
            host_split_sizes(self)
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


def current_device():
    """Where megatron places the tensors it allocates: ``torch.cuda.current_device()`` with CUDA,
    the host on a CPU-only torch."""
    return torch.cuda.current_device() if torch.cuda.is_available() else "cpu"


def synchronize_device(device=None):
    """``torch.cuda.synchronize()`` with CUDA; on the host, work is done when a call returns."""
    if torch.cuda.is_available():
        torch.cuda.synchronize(device)


def _host_device(device):
    """Where a tensor megatron places on a CUDA device by name goes on a CPU: the host."""
    if device == "cuda" or (isinstance(device, str) and device.startswith("cuda:")):
        return "cpu"
    return device


class _HostCuda:
    """``torch.cuda`` as a megatron module sees it on a CPU: the current device is the host."""

    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    current_device = staticmethod(current_device)
    synchronize = staticmethod(synchronize_device)


class _HostTorch:
    """``torch`` as a megatron module sees it on a CPU: the tensors it places on ``"cuda"`` (or on
    ``torch.cuda.current_device()``) by name go to the host; everything else is torch itself."""

    cuda = _HostCuda()

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs):
        return torch.zeros(*args, device=_host_device(device), **kwargs)

    @staticmethod
    def empty(*args, device=None, **kwargs):
        return torch.empty(*args, device=_host_device(device), **kwargs)

    @staticmethod
    def tensor(*args, device=None, **kwargs):
        return torch.tensor(*args, device=_host_device(device), **kwargs)


def host_torch(original):
    return original if torch.cuda.is_available() else _HostTorch()


def host_torch_patch(module: str, *, name: str, why: str, when: str) -> FunctionPatch:
    """A patch that gives ``module`` :class:`_HostTorch` as its ``torch`` on a CPU."""
    return megatron_patch(f"{module}:torch", host_torch, name=name, why=why, when=when)


ROUTER_HOST_TENSORS = host_torch_patch(
    "megatron.core.transformer.moe.router",
    name="megatron-router-host-tensors",
    why="megatron's stock router moves its weight to torch.cuda.current_device() at its first forward and "
        "allocates its auxiliary-loss counters there",
    when="a megatron-core MoE model with megatron's own router on a CPU",
)


SCHEDULE_TOKEN_COUNT = host_torch_patch(
    "megatron.core.pipeline_parallel.schedules",
    name="megatron-schedule-host-token-count",
    why="megatron's forward-backward schedules allocate their token count with device='cuda', which a CPU-only "
        "torch cannot",
    when="a megatron-core model at pipeline parallelism > 1 built by the plugin on a CPU",
)


P2P_HOST_TENSORS = host_torch_patch(
    "megatron.core.pipeline_parallel.p2p_communication",
    name="megatron-p2p-host-tensors",
    why="megatron's stage-to-stage communication allocates the shapes it exchanges and the tensors it receives "
        "on torch.cuda.current_device() and synchronizes CUDA after the exchange",
    when="verl's Megatron engine at pipeline parallelism > 1 on the CPU platform",
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

_TRAINING_WHEN = "verl's Megatron engine on the CPU platform (ZMRL_VERL_PLATFORM=cpu)"

OPTIMIZER_HOST_TENSORS = host_torch_patch(
    "megatron.core.optimizer.optimizer",
    name="megatron-optimizer-host-tensors",
    why="megatron's optimizers allocate their loss scale and overflow flags with device='cuda' "
        "(FP32Optimizer.__init__: torch.tensor([1.0], ..., device='cuda'))",
    when=_TRAINING_WHEN,
)

def _float16_params_on_host(original):
    def __init__(self, optimizer, config, grad_scaler, init_state_fn):
        if torch.cuda.is_available() or not optimizer:
            return original(self, optimizer, config, grad_scaler, init_state_fn)
        from megatron.core import tensor_parallel
        from megatron.core.optimizer.optimizer import MixedPrecisionOptimizer

        # The original's body, its parameter classes told by dtype: it names the CUDA tensor types
        # ('torch.cuda.BFloat16Tensor'), and a host parameter is 'torch.BFloat16Tensor'.
        MixedPrecisionOptimizer.__init__(self, optimizer, config, grad_scaler, init_state_fn)
        self.float16_groups, self.fp32_from_float16_groups, self.fp32_from_fp32_groups = [], [], []
        for group in self.optimizer.param_groups:
            float16, fp32_from_float16, fp32 = [], [], []
            for i, param in enumerate(group["params"]):
                if not param.requires_grad:
                    continue
                if param.dtype in (torch.float16, torch.bfloat16):
                    main_param = param.detach().clone().float()  # the fp32 master copy the optimizer steps
                    tensor_parallel.copy_tensor_model_parallel_attributes(main_param, param)
                    if hasattr(param, "shared"):
                        main_param.shared = param.shared
                    group["params"][i] = param.main_param = main_param
                    if param in self.optimizer.state:
                        self.optimizer.state[main_param] = self.optimizer.state.pop(param)
                    float16.append(param)
                    fp32_from_float16.append(main_param)
                elif param.dtype == torch.float32:
                    fp32.append(param)
                else:
                    raise TypeError(f"megatron's mixed-precision optimizer takes fp16, bf16 or fp32 parameters, "
                                    f"not {param.dtype}")
            self.float16_groups.append(float16)
            self.fp32_from_float16_groups.append(fp32_from_float16)
            self.fp32_from_fp32_groups.append(fp32)
        self.is_stub_optimizer = False

    return __init__


FLOAT16_PARAMS_ON_HOST = megatron_patch(
    "megatron.core.optimizer.optimizer:Float16OptimizerWithFloat16Params.__init__", _float16_params_on_host,
    name="megatron-float16-optimizer-on-host",
    why="Float16OptimizerWithFloat16Params sorts parameters by param.type() in ['torch.cuda.HalfTensor', "
        "'torch.cuda.BFloat16Tensor'] and raises TypeError for a host bf16 parameter ('torch.BFloat16Tensor')",
    when=_TRAINING_WHEN,
)

GRADIENT_CLIP_HOST_TENSORS = host_torch_patch(
    "megatron.core.optimizer.clip_grads",
    name="megatron-clip-grads-host-tensors",
    why="megatron's gradient-norm reduction allocates its norm with device='cuda'",
    when=_TRAINING_WHEN,
)

MAPPINGS_HOST_TENSORS = host_torch_patch(
    "megatron.core.tensor_parallel.mappings",
    name="megatron-mappings-host-tensors",
    why="megatron's tensor- and sequence-parallel gathers and reduce-scatters allocate their outputs on "
        "torch.cuda.current_device() (the vocabulary-parallel embedding's reduce-scatter under sequence parallelism)",
    when=_TRAINING_WHEN,
)

UTILS_HOST_TENSORS = host_torch_patch(
    "megatron.core.utils",
    name="megatron-utils-host-tensors",
    why="megatron's local stand-in for apex's multi_tensor_l2norm (no apex, no Transformer Engine) returns the "
        "gradient norm on device='cuda'",
    when=_TRAINING_WHEN,
)

GRAD_BUFFER_HOST_TENSORS = host_torch_patch(
    "megatron.core.distributed.param_and_grad_buffer",
    name="megatron-grad-buffer-host-tensors",
    why="megatron's DDP allocates its parameter and gradient buffers on torch.cuda.current_device()",
    when=_TRAINING_WHEN,
)

ROTARY_HOST_TENSORS = host_torch_patch(
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    name="megatron-rotary-host-tensors",
    why="megatron's rotary embedding moves its frequencies to torch.cuda.current_device() at the first forward",
    when=_TRAINING_WHEN,
)


CHECKPOINT_HOST_TENSORS = [
    host_torch_patch(
        f"megatron.core.dist_checkpointing.strategies.{module}",
        name=f"megatron-checkpoint-{module.replace('_', '-')}-on-host",
        why=f"megatron's distributed checkpoint ({module}) synchronizes CUDA streams and allocates its flags on "
            "torch.cuda.current_device() while saving",
        when=_TRAINING_WHEN,
    )
    for module in ("filesystem_async", "fully_parallel", "state_dict_saver", "async_utils")
]


def _clip_on_host(original):
    def clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
        if torch.cuda.is_available() or use_decoupled_grad:
            return original(parameters, max_norm, total_norm, use_decoupled_grad)
        from megatron.core.utils import to_local_if_dtensor

        # The original's fp32 check names the CUDA tensor type; the check itself is kept.
        params = [parameters] if torch.is_tensor(parameters) else list(parameters)
        grads = [to_local_if_dtensor(p.grad).detach() for p in params if p.grad is not None]
        if any(grad.dtype != torch.float32 for grad in grads):
            raise TypeError("clip_grad_by_total_norm_fp32 expects fp32 gradients")
        clip_coeff = max_norm / (total_norm + 1.0e-6)
        if clip_coeff < 1.0 and grads:
            torch._foreach_mul_(grads, clip_coeff)

    return clip_grad_by_total_norm_fp32


GRADIENT_CLIP_ON_HOST = megatron_patch(
    "megatron.core.optimizer.clip_grads:clip_grad_by_total_norm_fp32", _clip_on_host,
    name="megatron-clip-grads-on-host",
    why="clip_grad_by_total_norm_fp32 asserts param.grad.type() == 'torch.cuda.FloatTensor' (a host fp32 "
        "gradient is 'torch.FloatTensor')",
    when=_TRAINING_WHEN,
    bound_in=("megatron.core.optimizer.optimizer",),
)

def _host_rng_tracker(original):
    if torch.cuda.is_available():
        return original

    class HostRNGStatesTracker(original):
        """megatron's named RNG states (data-parallel, model-parallel, expert) as states of the host
        generator: on a CPU that generator is the one dropout and initialization draw from."""

        def add(self, name, seed):
            if seed in self.seeds_ or name in self.states_:
                raise Exception(f"rng state {name} (seed {seed}) already exists")
            self._is_initialized = True
            self.seeds_.add(seed)
            current = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(current)

        @contextlib.contextmanager
        def fork(self, name="model-parallel-rng"):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            outer = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer)

    return HostRNGStatesTracker


RNG_TRACKER_ON_HOST = megatron_patch(
    "megatron.core.tensor_parallel.random:CudaRNGStatesTracker", _host_rng_tracker,
    name="megatron-rng-tracker-on-host",
    why="model_parallel_cuda_manual_seed (verl's MegatronEngine.__init__) seeds named CUDA generator states: "
        "AssertionError: Torch not compiled with CUDA enabled",
    when=_TRAINING_WHEN,
)

def packed_causal_mask(cu_seqlens: torch.Tensor, tokens: int) -> torch.Tensor:
    """megatron's attention mask (True: masked) for ``tokens`` packed tokens whose sequences start at
    ``cu_seqlens``: each query sees the keys of its own sequence up to itself, shape [1, 1, t, t]."""
    starts = cu_seqlens.to(device="cpu", dtype=torch.long)
    segment = torch.bucketize(torch.arange(tokens), starts[1:], right=True)
    position = torch.arange(tokens)
    visible = (segment[:, None] == segment[None, :]) & (position[None, :] <= position[:, None])
    return (~visible)[None, None]


def packed_as_one_row(query, key, value, packed_seq_params):
    """Packed (THD) query, key and value [t, heads, dim] as one batch row of t tokens, and the mask
    that keeps each sequence to itself: megatron's local attention then computes as for any batch."""
    cu_seqlens = packed_seq_params.cu_seqlens_q_padded
    if cu_seqlens is None:
        cu_seqlens = packed_seq_params.cu_seqlens_q
    mask = packed_causal_mask(cu_seqlens, query.shape[0]).to(query.device)
    return query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1), mask


def _packed_local_attention(original):
    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if torch.cuda.is_available() or packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            return original(self, query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                            attention_bias=attention_bias, packed_seq_params=packed_seq_params)
        query, key, value, mask = packed_as_one_row(query, key, value, packed_seq_params)
        return original(self, query, key, value, mask, attn_mask_type=attn_mask_type,
                        attention_bias=attention_bias, packed_seq_params=None)

    return forward


PACKED_LOCAL_ATTENTION = megatron_patch(
    "megatron.core.transformer.dot_product_attention:DotProductAttention.forward", _packed_local_attention,
    name="megatron-packed-local-attention",
    why="megatron's local DotProductAttention (the only one without Transformer Engine) refuses packed (THD) "
        "sequences, which verl's Megatron engine sends with use_remove_padding=True: 'Packed sequence is not "
        "supported by DotProductAttention'",
    when=_TRAINING_WHEN,
)

TRAINING_PATCHES = [OPTIMIZER_HOST_TENSORS, GRADIENT_CLIP_HOST_TENSORS, MAPPINGS_HOST_TENSORS, UTILS_HOST_TENSORS,
                    GRAD_BUFFER_HOST_TENSORS, ROTARY_HOST_TENSORS, GRADIENT_CLIP_ON_HOST, FLOAT16_PARAMS_ON_HOST,
                    RNG_TRACKER_ON_HOST,
                    PACKED_LOCAL_ATTENTION, *CHECKPOINT_HOST_TENSORS]

MOE_PATCHES = [ALLTOALL_SIDE_STREAM, ALLTOALL_HOST_SPLITS, ROUTER_GEMM_NAME, ROUTER_HOST_TENSORS]
PIPELINE_PATCHES = [SCHEDULE_TOKEN_COUNT, P2P_HOST_TENSORS, TIED_EMBEDDING_COPY]
PATCHES = MOE_PATCHES + PIPELINE_PATCHES + TRAINING_PATCHES


def moe_on_cpu() -> None:
    """Apply the patches (once; they stay until :func:`remove_all`). A no-op with CUDA."""
    if torch.cuda.is_available():
        return
    import megatron.core.transformer.moe.moe_utils  # noqa: F401 - the patches' modules
    import megatron.core.transformer.moe.router  # noqa: F401
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
    import megatron.core.pipeline_parallel.p2p_communication  # noqa: F401
    import megatron.core.pipeline_parallel.schedules  # noqa: F401

    for patch in PIPELINE_PATCHES:
        apply(patch)


def training_on_cpu() -> None:
    """Apply the patches megatron's optimizer, gradient clipping and DDP buffers need on a CPU, and
    the MoE and pipeline ones (once; they stay until :func:`remove_all`). A no-op with CUDA."""
    if torch.cuda.is_available():
        return
    moe_on_cpu()
    pipeline_on_cpu()
    for patch in TRAINING_PATCHES:
        apply(patch)
