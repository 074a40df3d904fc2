"""verl's main_ppo on its Megatron engine on the CPU (recipe ``cpu_smoke_megatron``: the mbridge
backend, the aligned spec; the dense runs in bf16, the MoE run in the recipe's fp32). A tiny
Qwen3-MoE on two workers at tensor parallelism 2 with sequence parallelism and expert parallelism 2
together: synchronous steps bitwise and saved. The dense Llama: the stock Megatron forward (the
plugin's patch off) as the negative control, two synchronous steps saved; FlashREINFORCE resumed
from that checkpoint with the patch on, in the asynchronous colocate mode (lag >= 1); LoRA at
pipeline parallelism 2, saved. Each run is one real verl process, started once (``megatron_runs``,
``megatron_moe_tp2_ep2_run``, ``megatron_lora_pp2_run``); every test reads them."""

from __future__ import annotations

import pytest
from support.main_ppo_runs import (BITWISE, DIFF, STALENESS_MIN, STALENESS_WORST_MAX,  # noqa: F401
                                   assert_ran, assert_saved_at, inputs, run_verl)

from zero_mismatch_plugin.integrations.verl.cpu.launch import MEGATRON_RECIPE_NAME

pytestmark = pytest.mark.slow

SAVED_STEP = 2
# The dense runs in bf16, the users' precision: verl's Megatron engine with bf16 parameters (fp32
# master weights in megatron's mixed-precision optimizer) and a bf16 rollout.
BF16 = ["actor_rollout_ref.actor.megatron.dtype=bfloat16", "actor_rollout_ref.rollout.dtype=bfloat16"]
BF16_LOG_LINE = "params_dtype=torch.bfloat16"  # in the transformer config verl prints
ALIGNED_LOG_LINE = "zero-mismatch: verl 0.9.1 Megatron engine (engine methods patched)"
LORA_LOG_LINE = "zero-mismatch: verl's Megatron LoRA runs the Megatron face's adapter"


def assert_updates_where_advantages_are_nonzero(run):
    """The engine's backward and optimizer ran: every step with a nonzero advantage has a nonzero
    gradient (a step whose group scores all tie has none, and leaves the weights as they were)."""
    for zero_fraction, norm in zip(run.metric("actor/zero_mismatch/zero_advantage_fraction"),
                                   run.metric("actor/grad_norm"), strict=True):
        assert zero_fraction == 1.0 or norm > 0, (zero_fraction, norm)


def megatron_smoke(run_dir, inputs, overrides):
    return run_verl(run_dir, inputs, overrides, recipe=MEGATRON_RECIPE_NAME)


@pytest.fixture(scope="module")
def megatron_runs(tmp_path_factory, inputs):
    """(the stock Megatron forward, two synchronous steps saved at step 2; FlashREINFORCE with the
    aligned forward resumed from that checkpoint in colocate_async; their directory)."""
    root = tmp_path_factory.mktemp("main_ppo_megatron")
    checkpoints = root / "checkpoints"
    # The recipe with the plugin's Megatron patch off: verl's own forward of the same model.
    stock = megatron_smoke(root / "stock", inputs, ["--allow-unaligned-trainer", *BF16,
                                                    f"trainer.default_local_dir={checkpoints}",
                                                    f"trainer.save_freq={SAVED_STEP}"])
    resumed = megatron_smoke(root / "colocate_resumed", inputs, [
        *BF16, "zm_algorithm=flash_reinforce", "actor_rollout_ref.rollout.n=1", "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "trainer.v1.trainer_mode=colocate_async",
        f"trainer.total_training_steps={SAVED_STEP + 3}", f"trainer.default_local_dir={checkpoints}"])
    return stock, resumed, root


def test_megatron_engine_resumes_and_flash_reinforce_is_bitwise_on_current_batches(megatron_runs):
    """A new process with the plugin's patch on resumes the checkpoint verl's stock Megatron engine
    saved (the aligned layers take the loaded weights and re-derive the engine's from them) and
    trains FlashREINFORCE with the rollout one version behind: batches of the current version are
    bitwise, stale ones are not."""
    _, resumed, root = megatron_runs
    assert_ran(resumed, [3, 4, 5])
    assert ALIGNED_LOG_LINE in resumed.log and BF16_LOG_LINE in resumed.log
    assert f"Resuming from {root / 'checkpoints'}/global_step_{SAVED_STEP}" in resumed.log
    assert resumed.metric("actor/flash_reinforce/admitted_fraction")
    staleness, stale_min, fractions = (resumed.metric(STALENESS_WORST_MAX), resumed.metric(STALENESS_MIN),
                                       resumed.metric(BITWISE))
    print(f"resumed colocate_async: staleness_worst/max {staleness}, staleness/min {stale_min}, bitwise {fractions}")
    # Step 3 samples with the resumed weights.
    assert staleness[0] == 0 and fractions[0] == 1.0, (staleness, fractions)
    assert max(staleness) >= 1
    for worst, least, fraction in zip(staleness, stale_min, fractions):
        if worst == 0:
            assert fraction == 1.0
        if least >= 1:
            assert fraction < 1.0


def test_verls_stock_megatron_forward_is_not_mu_and_saves(megatron_runs):
    """Negative control: the recipe with ZMRL_MEGATRON_ALIGNED=0 (megatron's local modules, verl's
    logprob arithmetic) trains on the current weights' samples and still does not reproduce mu, at
    either step; its checkpoint is the one the aligned run resumes."""
    stock, _, root = megatron_runs
    assert_ran(stock, [1, 2])
    assert ALIGNED_LOG_LINE not in stock.log and BF16_LOG_LINE in stock.log
    assert all(fraction < 1.0 for fraction in stock.metric(BITWISE)), stock.metric(BITWISE)
    assert all(diff > 0.0 for diff in stock.metric(DIFF)), stock.metric(DIFF)
    assert_saved_at(root / "checkpoints", SAVED_STEP)


# verl's Megatron LoRA settings (its defaults: linear_qkv, linear_proj, linear_fc1, linear_fc2; xavier A,
# zero B; the adapter synced unmerged), rank 8, in bf16, on two pipeline stages (one rank each), each
# colocated with a one-process vLLM replica; four samples of four prompts a step, one update a step.
MEGATRON_LORA_PP2 = ["actor_rollout_ref.model.lora.rank=8", "actor_rollout_ref.model.lora.alpha=16", *BF16,
                     "trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
                     "data.train_batch_size=4", "actor_rollout_ref.rollout.n=4",
                     "actor_rollout_ref.actor.ppo_mini_batch_size=4"]



@pytest.fixture(scope="module")
def megatron_lora_pp2_run(tmp_path_factory, inputs):
    """(two synchronous LoRA steps at pipeline parallelism 2 saved at step 2, its directory)."""
    root = tmp_path_factory.mktemp("main_ppo_megatron_lora_pp2")
    run = megatron_smoke(root / "saved", inputs, [*MEGATRON_LORA_PP2, f"trainer.default_local_dir={root / 'checkpoints'}",
                                                  f"trainer.save_freq={SAVED_STEP}"])
    return run, root


def test_megatron_engine_lora_at_pipeline_parallel_2_is_bitwise_after_adapter_syncs_and_saves(megatron_lora_pp2_run):
    """verl's Megatron engine with LoRA on the mbridge builder, in bf16, at pipeline parallelism 2:
    the face's adapter on each stage's layers (verl 0.9.1 would assert Megatron-Bridge), verl's base
    sync and then adapter-only syncs into the vLLM rollout as TensorLoRARequests. The base is frozen,
    so a nonzero gradient norm at step 1 means the adapter is in the trainer's forward and step 2
    samples with a changed B: every step's logprobs are mu, bit for bit, before and after the adapter
    moved. verl saves the adapter (its filter is Megatron-Bridge's): the model checkpoint holds every
    layer's A and B of every target, from both stages, and nothing of the frozen base."""
    from torch.distributed.checkpoint import FileSystemReader

    from zero_mismatch_plugin.faces.megatron.convert import MEGATRON_LORA_SLICES

    run, root = megatron_lora_pp2_run
    assert_ran(run, [1, 2])
    assert ALIGNED_LOG_LINE in run.log and LORA_LOG_LINE in run.log and BF16_LOG_LINE in run.log
    assert "pipeline_model_parallel_size=2" in run.log
    assert run.metric("actor/grad_norm")[0] > 0, run.metric("actor/grad_norm")
    assert run.metric(BITWISE) == [1.0, 1.0], run.metric(BITWISE)
    assert run.metric(DIFF) == [0.0, 0.0]
    assert_saved_at(root / "checkpoints", SAVED_STEP)
    saved = root / "checkpoints" / f"global_step_{SAVED_STEP}" / "actor"
    entries = FileSystemReader(saved / "model" / "dist_ckpt").read_metadata().state_dict_metadata
    # verl's four LoRA targets, one A/B pair per slice of each linear (the face's names)
    expected = {f"decoder.layers.{module}.lora.{piece}.lora_{matrix}"
                for module, pieces in MEGATRON_LORA_SLICES.items() for piece in pieces for matrix in "AB"}
    assert set(entries) == expected, sorted(entries)
    layers = {entries[name].size[0] for name in entries}  # megatron stacks the layers of both stages
    assert layers == {2}, layers
    assert any((saved / "optimizer" / "dist_ckpt").iterdir())


# Two Megatron ranks at tensor parallelism 2 with sequence parallelism and, on the same two ranks,
# expert parallelism 2 (each expert whole on its rank: expert tensor parallelism 1), colocated with a
# vLLM replica at tensor parallelism 2 (its two CPU workers bound one per core).
TENSOR_BY_EXPERT_PARALLEL_2 = [
    "trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
    "actor_rollout_ref.actor.megatron.sequence_parallel=true",
    "actor_rollout_ref.actor.megatron.expert_model_parallel_size=2",
    "actor_rollout_ref.actor.megatron.expert_tensor_parallel_size=1",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
    "++ray_kwargs.ray_init.runtime_env.env_vars.VLLM_CPU_OMP_THREADS_BIND='0|1'",
]


@pytest.fixture(scope="module")
def two_key_value_head_moe(tmp_path_factory):
    """A tiny Qwen3-MoE with two key/value heads (one per tensor-parallel rank)."""
    from zero_mismatch_plugin.tools.smoke_assets import build_smoke_model

    return str(build_smoke_model(tmp_path_factory.mktemp("moe_kv2") / "qwen3_moe", family="qwen3_moe",
                                 moe_intermediate_size=64, num_key_value_heads=2))


@pytest.fixture(scope="module")
def megatron_moe_tp2_ep2_run(tmp_path_factory, inputs, two_key_value_head_moe):
    """(the synchronous run saving at step 2, its directory)."""
    root = tmp_path_factory.mktemp("main_ppo_megatron_moe_tp2_ep2")
    run = megatron_smoke(root / "sync", {**inputs, "actor_rollout_ref.model.path": two_key_value_head_moe},
                         [*TENSOR_BY_EXPERT_PARALLEL_2, f"trainer.default_local_dir={root / 'checkpoints'}",
                          f"trainer.save_freq={SAVED_STEP}"])
    return run, root


def test_megatron_engine_moe_at_tensor_by_expert_parallel_2_is_bitwise_and_saved(megatron_moe_tp2_ep2_run):
    """verl's Megatron engine on two workers at TP 2 + SP and EP 2 with a tiny Qwen3-MoE: each rank
    computes the engine rank of its index for attention heads and the vocabulary (shards gathered
    before the logprobs), and for its experts, kept whole, every engine shard's output (megatron's
    all-to-all dispatcher brings every token's top-k outputs back, summed in vLLM's slot order). Each
    rank loads its own experts from the checkpoint (mbridge would split them over the tensor-parallel
    ranks), and mbridge's export gathers heads and experts (global indices) for the TP-2 rollout's
    reload: every sampled token's logprob is mu, bit for bit, before and after an update; the engine
    saves the aligned model's checkpoint."""
    run, root = megatron_moe_tp2_ep2_run
    assert_ran(run, [1, 2])
    assert ALIGNED_LOG_LINE in run.log
    assert run.metric(BITWISE) == [1.0, 1.0], run.metric(BITWISE)
    assert run.metric(DIFF) == [0.0, 0.0]
    assert_updates_where_advantages_are_nonzero(run)
    assert_saved_at(root / "checkpoints", SAVED_STEP)
