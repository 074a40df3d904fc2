"""Multi-head latent attention (DeepSeek-V2/V3, dense MLPs): the aligned trainer against vLLM's CPU
MLA engine in consistent mode (its three runtime fixes in place, docs/vllm-cpu-mla.md).

Prompt rows go through the engine's MLA prefill backend, response rows through its absorbed
decode kernel over a latent cache the trainer builds (zero_mismatch_plugin/aligned/mla.py).
"""

from __future__ import annotations

from support import aligned_checks as checks
import pytest
import torch
from support.vllm_session import RESPONSE_TOKENS, new_requests_in_one_step, prompts_for, rollout

from zero_mismatch_plugin.aligned import pack
from zero_mismatch_plugin.aligned.mla import BLOCK_SIZE, plan_mla

NAME = "deepseek_v2"


@pytest.fixture(scope="module", autouse=True)
def engine_accepts_functions(engines):
    """Lets ``collective_rpc`` carry a function to the engine's worker (to take one runtime patch
    out there). Engine and client read the switch when they (de)serialize, so the module's engines
    start with it set and are closed when the module ends."""
    engines.pool.make_room()  # room for the engine started here
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        yield
        engines.pool.close()  # the engines started with the switch set end with the module


def _engine_and_trainer_logprobs(engines, trainers, name, prompts, seed):
    llm = engines.get(name)
    trainer = trainers(name)
    with new_requests_in_one_step(llm):  # a prompt's place in the step is what is tested
        prompts, responses, mu = rollout(llm, prompts, seed=seed, n=1)
    with torch.no_grad():
        logprobs = trainer.token_logprobs(pack(prompts, responses))
    return logprobs, mu


def _bitwise(engines, trainers, name, prompts, seed):
    logprobs, mu = _engine_and_trainer_logprobs(engines, trainers, name, prompts, seed)
    equal = (logprobs == mu).float().mean().item()
    assert torch.equal(logprobs, mu), (
        f"{name}: {equal:.1%} of {mu.numel()} tokens bitwise equal, max |diff| {(logprobs - mu).abs().max().item():.3g}"
    )
    return mu.numel()


def test_engine_and_trainer_use_the_cpu_mla_backends(trainers):
    trainer = trainers(NAME)
    attention = trainer.layer_ops[0]["mla"]
    assert trainer.blocks.attention == "mla"
    assert attention.prefill.get_name() in ("CPU_SDPA_MLA", "ZEN_CPU_SDPA_MLA")


@pytest.mark.parametrize("batch_size", [1, 2, 8, 20])
def test_trainer_logprobs_bitwise_equal_engine(engines, trainers, batch_size):
    """One engine batch of ``batch_size`` sequences (24 response tokens each): at 8 the trainer
    scores 192 decode rows at once; at 20 the engine decodes 20 sequences per step, past the 15
    rows aten's CPU bmm keeps a row's bits for (the plugin's bmm runs eight rows per call)."""
    prompts = prompts_for(trainers(NAME).runtime.model_dir, num_prompts=batch_size)
    tokens = _bitwise(engines, trainers, NAME, prompts, seed=batch_size)
    print(f"{NAME}: batch {batch_size}: {tokens} response tokens bitwise equal")


def _set_one_token_prompt_patch(worker, applied):
    from zero_mismatch_plugin.integrations import patches as runtime_patches
    from zero_mismatch_plugin.integrations.vllm import cpu_mla as vllm_cpu_mla

    patch = vllm_cpu_mla.CPU_MLA_ONE_TOKEN_PROMPT_DECODED
    (runtime_patches.apply if applied else runtime_patches.remove)(patch)
    return runtime_patches.is_applied(patch)


def test_one_token_prompt_is_a_decode_step_in_both(engines, trainers):
    """A one-token prompt is a query of length 1: the trainer decodes it (absorbed kernel), and so
    does the consistent-mode engine, alone, before or after a longer prompt in one step (stock
    vLLM prefills it after a longer prompt: docs/vllm-cpu-mla.md)."""
    prompts = prompts_for(trainers(NAME).runtime.model_dir)
    _bitwise(engines, trainers, NAME, [prompts[0][:1]], seed=11)
    _bitwise(engines, trainers, NAME, [prompts[0][:1], prompts[1]], seed=12)
    _bitwise(engines, trainers, NAME, [prompts[1], prompts[0][:1]], seed=13)


def test_stock_order_prefills_a_one_token_prompt_after_a_longer_one(engines, trainers):
    """Negative control: the same engine with vLLM's own decode/prefill order (the plugin's
    reorder patch taken out in its worker) prefills the one-token prompt after the longer one,
    and the trainer, which decodes it, no longer matches it bit for bit."""
    prompts = prompts_for(trainers(NAME).runtime.model_dir)
    llm = engines.get(NAME)
    assert llm.collective_rpc(_set_one_token_prompt_patch, args=(False,)) == [False]
    try:
        logprobs, mu = _engine_and_trainer_logprobs(engines, trainers, NAME, [prompts[1], prompts[0][:1]], seed=13)
    finally:
        assert llm.collective_rpc(_set_one_token_prompt_patch, args=(True,)) == [True]
    one_token = slice(-RESPONSE_TOKENS, None)  # the one-token prompt's response
    equal = (logprobs[one_token] == mu[one_token]).float().mean().item()
    print(f"{NAME}, vLLM's own order: one-token prompt after a longer one, {equal:.1%} of {RESPONSE_TOKENS} "
          f"response logprobs bitwise equal to the trainer, max |diff| "
          f"{(logprobs[one_token] - mu[one_token]).abs().max().item():.3g}")
    assert not torch.equal(logprobs[one_token], mu[one_token])


def test_query_lora_and_yarn_rope_bitwise_equal_engine(engines, trainers):
    """DeepSeek-V3 shape: q_a_proj / q_a_layernorm / q_b_proj (vLLM fuses q_a with kv_a) and
    vLLM's deepseek_yarn rotary, whose mscale^2 enters the softmax scale."""
    trainer = trainers("deepseek_v3_yarn")
    assert trainer.blocks.mla.q_lora_rank == 96 and trainer.blocks.mla.rope_type == "deepseek_yarn"
    _bitwise(engines, trainers, "deepseek_v3_yarn", prompts_for(trainer.runtime.model_dir), seed=21)


@pytest.mark.parametrize("batch_size", [1, 2, 8])
def test_moe_variant_bitwise_equal_engine(engines, trainers, batch_size):
    """DeepSeek-V3 MLA with an MoE second layer through the aligned MoE op (grouped sigmoid routing,
    selection bias, shared expert), one, two and eight sequences in one engine batch (the router's
    sigmoid is row-count-invariant on both sides: vllm_cpu_sigmoid)."""
    trainer = trainers("deepseek_v3_moe")
    assert trainer.blocks.moe.moe_layers == (1,) and trainer.blocks.moe.e_score_correction_bias
    prompts = prompts_for(trainer.runtime.model_dir)[:batch_size]
    _bitwise(engines, trainers, "deepseek_v3_moe", prompts, seed=31 + batch_size)


@pytest.mark.parametrize("batch_size", [1, 8])
@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
def test_deepseek_v2_moe_routings_bitwise_equal_engine(engines, trainers, method, batch_size):
    """DeepSeek-V2 MLA with its MoE: softmax routing over all experts or the best of two groups, a
    routed scale, a shared expert, through vLLM's own router on both sides."""
    name = f"deepseek_v2_moe_{method}"
    trainer = trainers(name)
    moe = trainer.blocks.moe
    assert (moe.scoring_func, moe.e_score_correction_bias, moe.moe_layers) == ("softmax", False, (1,))
    assert (moe.n_group, moe.routed_scaling_factor) == ((1, 2.5) if method == "greedy" else (2, 1.5))
    _bitwise(engines, trainers, name, prompts_for(trainer.runtime.model_dir)[:batch_size], seed=41 + batch_size)


def test_custom_backward_matches_float64_autograd(engines, trainers):
    worst = checks.check_backward_matches_float64(trainers(NAME), engines, NAME)
    print(f"{NAME}: worst relative gradient error vs float64 {worst:.3g}")


def test_transformers_forward_is_close_but_not_the_engine(engines, trainers):
    fraction, worst = checks.check_hf_forward_is_close_and_comparison_discriminates(engines, trainers, NAME)
    print(f"{NAME}: transformers fp32 bitwise equal to the engine on {fraction:.1%} of tokens, "
          f"max |diff| {worst:.3g}")
    assert fraction < 1.0


def test_decode_kernel_reads_no_slot_past_the_sequence():
    """Why every decode row of a sequence may share its blocks: what lies after ``seq_len`` (the
    sequence's later rows in the trainer, stale data in the engine) does not reach the output."""
    from vllm import _custom_ops as ops

    generator = torch.Generator().manual_seed(0)
    query = torch.randn(2, 4, 576, generator=generator)
    cache = torch.randn(3, BLOCK_SIZE, 576, generator=generator)
    block_table = torch.tensor([[0, 1], [2, 0]], dtype=torch.int32)
    seq_lens = torch.tensor([20, 5], dtype=torch.int32)

    def decode(blocks):
        out = torch.zeros(2, 4, 512)
        ops.mla_decode_kvcache_cpu(out, query, blocks, 0.1, block_table, seq_lens)
        return out

    poisoned = cache.clone()
    poisoned[1, 20 - BLOCK_SIZE :] = float("nan")
    poisoned[2, 5:] = 1e4
    assert torch.equal(decode(cache), decode(poisoned))


def test_plan_splits_prefill_and_decode_rows_like_the_engine():
    plan = plan_mla([20, 3, 2], [18, 1, 2])
    # Prompts longer than one token are prefill rows; everything else decodes with seq_len = position + 1.
    assert plan.prefill_rows.tolist() == list(range(18)) + [23, 24]
    assert plan.prefill_query_start.tolist() == [0, 18, 20]
    assert plan.decode_rows.tolist() == [18, 19, 20, 21, 22]
    assert plan.decode_seq_lens.tolist() == [19, 20, 1, 2, 3]
    assert plan.block_table.tolist() == [[0, 1], [0, 1], [2, 0], [2, 0], [2, 0]]
    assert plan.num_blocks == 4 and plan.cache_rows.tolist()[18:] == [18, 19, 32, 33, 34, 48, 49]
    with pytest.raises(ValueError, match="prompt length 0 outside 1..3"):
        plan_mla([3], [0])


def _deepseek_config(**extra):
    from transformers import DeepseekV2Config

    shape = dict(vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=4, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64,
                 qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=4, first_k_dense_replace=2)
    config = DeepseekV2Config(architectures=["DeepseekV2ForCausalLM"], **{**shape, **extra})
    config.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    return config


def test_architecture_describes_mla_and_refuses_what_cpu_mla_does_not_run():
    from zero_mismatch_plugin.tables.architectures import describe

    blocks = describe(_deepseek_config())
    assert (blocks.attention, blocks.head_dim, blocks.moe) == ("mla", 96, None)
    assert (blocks.mla.kv_lora_rank, blocks.mla.v_head_dim, blocks.mla.rope_type) == (512, 32, "default")
    with pytest.raises(NotImplementedError, match="kv_lora_rank=256, qk_rope_head_dim=64: vLLM's CPU MLA decode"):
        describe(_deepseek_config(kv_lora_rank=256))
    # DeepSeek-V2's MoE as its transformers config defaults leave it (no groups, no scoring function).
    with pytest.raises(NotImplementedError, match=r"n_group=None, topk_group=None: vLLM routes DeepSeek experts in "
                                                  r"groups always.*1 and 1 for greedy"):
        describe(_deepseek_config(first_k_dense_replace=1))
    blocks = describe(_deepseek_config(first_k_dense_replace=1, topk_method="group_limited_greedy", scoring_func="softmax",
                                       n_group=2, topk_group=1, routed_scaling_factor=16.0))
    assert (blocks.mlp_kind(0), blocks.mlp_kind(1)) == ("dense", "moe")
    assert (blocks.moe.n_group, blocks.moe.topk_group, blocks.moe.routed_scaling_factor) == (2, 1, 16.0)
    with pytest.raises(NotImplementedError, match=r"n_routed_experts=4, n_group=3, topk_group=1: the experts must"):
        describe(_deepseek_config(first_k_dense_replace=1, topk_method="greedy", scoring_func="softmax", n_group=3,
                                  topk_group=1))


def test_deepseek_moe_routings_are_described_and_others_refused():
    from transformers import DeepseekV3Config

    from zero_mismatch_plugin.tables.architectures import describe

    def config(**routing):
        c = DeepseekV3Config(architectures=["DeepseekV3ForCausalLM"], vocab_size=32, hidden_size=64,
                             intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, kv_lora_rank=512,
                             qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=4,
                             n_group=2, topk_group=1, first_k_dense_replace=1, moe_intermediate_size=32, **routing)
        c.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
        return c

    blocks = describe(config(topk_method="noaux_tc", scoring_func="sigmoid"))
    assert (blocks.mlp_kind(0), blocks.mlp_kind(1), blocks.moe.scoring_func) == ("dense", "moe", "sigmoid")
    assert describe(config(topk_method="greedy", scoring_func="softmax")).moe.scoring_func == "softmax"
    with pytest.raises(NotImplementedError, match="topk_method='noaux_tc', scoring_func='softmax': covered are "
                                                  "topk_method 'noaux_tc' with scoring_func 'sigmoid'"):
        describe(config(topk_method="noaux_tc", scoring_func="softmax"))
