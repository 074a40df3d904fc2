"""The shipped recipes: each composes against the installed verl, passes validation, and says
what the seeds report (hardware, lag, steps, context), and `zmrl recipes` lists, shows, refuses
and launches them."""

from __future__ import annotations

import fnmatch
import re
import shlex
import subprocess
import sys
import tomllib
import types
from functools import lru_cache
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from zero_mismatch_plugin.tools import recipes as recipes_module
from zero_mismatch_plugin.tools.cli import main as zmrl
from zero_mismatch_plugin.tools.recipes import (
    RECIPES_DIR,
    check_recipe,
    cluster_gpus,
    launch_command,
    lora_rank,
    policy_lag,
    recipe_info,
    recipe_names,
    recipe_problems,
    rollout_layout,
    run_recipe,
    runtime_env_vars,
    trainer_layout,
)
from zero_mismatch_plugin.tools.config_checks.alignment import ALIGNED as ALIGNMENT_ALIGNED
from zero_mismatch_plugin.tools.config_checks.alignment import MODEL_UNKNOWN
from zero_mismatch_plugin.tools.config_checks.alignment import NOT_ALIGNED as ALIGNMENT_NOT_ALIGNED
from zero_mismatch_plugin.tools.config_checks.alignment import STANDARD as ALIGNMENT_STANDARD
from zero_mismatch_plugin.tools.config_checks.alignment import UNALIGNED_OVERRIDE, trainer_alignment
from zero_mismatch_plugin.tools.config_checks.validate_config import compose_verl_config, validate_config

from support import REPO  # noqa: E402
TOP_LEVEL_RECIPES = REPO / "recipes"
BASE_RECIPES = ("reinforce_zero", "flash_reinforce")
# Runs verl itself on a CPU (tests/integrations/verl/cpu runs it).
CPU_RECIPES = ("cpu_smoke", "cpu_smoke_megatron")
ENV = "ray_kwargs.ray_init.runtime_env.env_vars"

# What the seeds and the task ask for, independent of how the recipes express it.
# nodes x gpus: the whole cluster the run occupies. Settings the seeds leave open are the
# recipes' choices and are checked for consistency, not against this table.
SPEC = {
    "deepseek_v4_1_flash_swe_bench_pro_sync": dict(
        model="DeepSeek-V4.1-Flash", nodes=16, gpus=4, engine="megatron", numerics="consistent",
        expect={"actor_rollout_ref.rollout.max_model_len": 131072, "actor_rollout_ref.rollout.enable_prefix_caching": True,
                f"{ENV}.ZMRL_ALLOW_PREFIX_CACHING": "1", "actor_rollout_ref.rollout.quantization": None}),
    "deepseek_v4_1_flash_dapo_math_sync": dict(
        model="DeepSeek-V4.1-Flash", nodes=16, gpus=4, engine="megatron", numerics="consistent", algorithm="dapo",
        expect={"data.max_response_length": 8192, "actor_rollout_ref.rollout.quantization": None},
        trajectories_per_node=128),
    "kimi_k3_1_lora_r32_dapo_gb300_sync": dict(
        model="Kimi-K3.1", nodes=4, gpus=4, engine="megatron", numerics="consistent", algorithm="dapo", lora=32,
        expect={"trainer.total_training_steps": 100, "actor_rollout_ref.rollout.val_kwargs.n": 8,
                "actor_rollout_ref.rollout.val_kwargs.do_sample": True},
        val_sets=("aime-2024", "aime-2025", "aime-2026")),
    "mi355x_deepseek_v4_flash_grpo_sync": dict(
        model="DeepSeek-V4-Flash", nodes=4, gpus=8, engine="megatron", numerics="consistent_rocm", algorithm="grpo",
        expect={"trainer.total_training_steps": 36, "trainer.resume_mode": "auto"}, checkpointed=True),
    "mi355x_kimi_k3_1_lora_r32_dapo_sync": dict(
        model="Kimi-K3.1", nodes=2, gpus=8, engine="megatron", numerics="consistent_rocm", algorithm="dapo", lora=32,
        expect={"trainer.total_training_steps": 100, "actor_rollout_ref.rollout.quantization": None}),
    "reinforce_zero_r1_distill_1_5b_math_lag2": dict(
        model="DeepSeek-R1-Distill-Qwen-1.5B", nodes=2, gpus=8, engine="megatron", numerics="consistent", algorithm="reinforce_zero",
        expect={"trainer.total_training_steps": 20000}),
    "reinforce_zero_r1_distill_1_5b_math_lag8": dict(
        model="DeepSeek-R1-Distill-Qwen-1.5B", nodes=2, gpus=8, engine="megatron", numerics="consistent", algorithm="reinforce_zero",
        expect={"trainer.total_training_steps": 20000}),
    "reinforce_zero_qwen3_4b_python_tool_lag64": dict(
        model="Qwen3-4B", nodes=2, gpus=8, engine="megatron", numerics="consistent", algorithm="reinforce_zero", tools=True, context=16384,
        expect={"trainer.total_training_steps": 5000}),
    "reinforce_zero_qwen3_30b_a3b_python_tool_lag8": dict(
        model="Qwen3-30B-A3B", nodes=4, gpus=8, engine="fsdp", numerics="consistent", algorithm="reinforce_zero",
        tools=True, expect={"trainer.total_training_steps": 3000}),
    "ablation_sync_aligned_kernels_r1_distill_1_5b_sync": dict(
        model="DeepSeek-R1-Distill-Qwen-1.5B", nodes=2, gpus=8, engine="megatron", numerics="consistent", algorithm="reinforce_zero",
        expect={"trainer.total_training_steps": 6000}),
    "ablation_is_standard_kernels_r1_distill_1_5b_lag8": dict(
        model="DeepSeek-R1-Distill-Qwen-1.5B", nodes=2, gpus=8, engine="megatron", numerics="standard", algorithm="verl_is",
        gate=None, expect={"trainer.total_training_steps": 6000}),
    "ablation_is_sequence_gate_standard_kernels_r1_distill_1_5b_lag8": dict(
        model="DeepSeek-R1-Distill-Qwen-1.5B", nodes=2, gpus=8, engine="megatron", numerics="standard", algorithm="verl_is",
        gate="seq_mean_k3", expect={"trainer.total_training_steps": 6000}),
    "ablation_is_token_gate_standard_kernels_r1_distill_1_5b_lag8": dict(
        model="DeepSeek-R1-Distill-Qwen-1.5B", nodes=2, gpus=8, engine="megatron", numerics="standard", algorithm="verl_is",
        gate="token_k3", expect={"trainer.total_training_steps": 6000}),
    "flash_reinforce_qwen2_5_math_1_5b_reasoning_lag4": dict(
        model="Qwen2.5-Math-1.5B", nodes=2, gpus=8, engine="megatron", numerics="consistent", algorithm="flash_reinforce",
        rollouts_total=256_000),
    "flash_reinforce_qwen2_5_7b_python_tool_lag4": dict(
        model="Qwen2.5-7B-Instruct", nodes=4, gpus=8, engine="megatron", numerics="consistent", algorithm="flash_reinforce", tools=True,
        expect={"trainer.total_training_steps": 600}),
    "flash_reinforce_qwen3_30b_a3b_python_tool_lag8": dict(
        model="Qwen3-30B-A3B", nodes=4, gpus=8, engine="fsdp", numerics="consistent", algorithm="flash_reinforce",
        tools=True),
    "flash_reinforce_qwen2_5_7b_alfworld_lag4": dict(
        model="Qwen2.5-7B-Instruct", nodes=2, gpus=8, engine="megatron", numerics="consistent", algorithm="flash_reinforce",
        expect={"trainer.total_training_steps": 200}, rollouts_total=12_800),
}
NAMED = sorted(SPEC)
ALL = sorted(SPEC) + list(BASE_RECIPES)
# The trainer side of each recipe today (config_checks.alignment): the dense consistent recipes
# (verl's Megatron engine) and the Qwen3-30B-A3B MoE ones (verl's FSDP engine) are aligned, the MLA /
# KDA / LoRA flagships are not, the standard-kernel ablations are not meant to be.
NOT_ALIGNED = ("deepseek_v4_1_flash_swe_bench_pro_sync", "deepseek_v4_1_flash_dapo_math_sync",
               "kimi_k3_1_lora_r32_dapo_gb300_sync", "mi355x_deepseek_v4_flash_grpo_sync",
               "mi355x_kimi_k3_1_lora_r32_dapo_sync")
MOE_FSDP = ("reinforce_zero_qwen3_30b_a3b_python_tool_lag8", "flash_reinforce_qwen3_30b_a3b_python_tool_lag8")
STANDARD = tuple(n for n in NAMED if SPEC[n]["numerics"] == "standard")
ALIGNED = tuple(n for n in NAMED if n not in NOT_ALIGNED + STANDARD)
SWITCH = f"{ENV}.ZMRL_MEGATRON_ALIGNED"
FSDP_SWITCH = f"{ENV}.ZMRL_FSDP_ALIGNED"
# The base recipes leave the model open: declared here, as a user with a hub id would.
DENSE = "zmrl.architecture=Qwen2ForCausalLM"


@lru_cache(maxsize=None)
def composed(name: str):
    # Through the top-level recipes/ directory, as a source checkout and the existing tests use it.
    return compose_verl_config(TOP_LEVEL_RECIPES, name)


def sel(cfg, key):
    return OmegaConf.select(cfg, key)


# ----- the recipe set ---------------------------------------------------------------------------


def test_every_shipped_recipe_is_specified_here():
    assert set(recipe_names()) == set(SPEC) | set(BASE_RECIPES) | set(CPU_RECIPES)


def test_every_recipe_names_its_setting_and_named_recipes_quote_the_seed():
    for name in recipe_names():
        info = recipe_info(name)
        assert info.summary, name
        if name in SPEC:
            assert info.seed_result, f"{name} has no '# Seed:' line"


# ----- composes and validates --------------------------------------------------------------------


@pytest.mark.parametrize("name", [*ALIGNED, *STANDARD, *BASE_RECIPES])
def test_composes_against_installed_verl_and_zmrl_validate_config_passes(name, capsys):
    overrides = [DENSE] if name in BASE_RECIPES else []
    cfg = compose_verl_config(TOP_LEVEL_RECIPES, name, overrides)
    assert [str(p) for p in validate_config(cfg) if p.fatal] == []
    assert [str(p) for p in recipe_problems(cfg) if p.fatal] == []
    assert zmrl(["validate-config", "--config-path", str(TOP_LEVEL_RECIPES), "--config-name", name, *overrides]) == 0
    assert "config OK" in capsys.readouterr().out


@pytest.mark.parametrize("name", NOT_ALIGNED)
def test_unaligned_flagships_are_refused_for_that_alone_and_run_with_the_override(name, capsys):
    problems = [p for p in recipe_problems(composed(name)) if p.fatal]
    assert [p.key for p in problems] == [SWITCH], problems
    assert "does not cover this run, so diff 0 cannot hold; missing: a path for" in problems[0].message
    assert zmrl(["validate-config", "--config-path", str(TOP_LEVEL_RECIPES), "--config-name", name,
                 "--allow-unaligned-trainer"]) == 0
    assert "TRAINER NOT ALIGNED" in capsys.readouterr().out


@pytest.fixture
def vllm_lora_rank_check(monkeypatch):
    """verl checks a LoRA rank against vLLM's allowed ranks by importing its vLLM rollout package,
    which needs a GPU build of vLLM. Stand in for it with the same list verl falls back to."""
    allowed = (1, 8, 16, 32, 64, 128, 256, 320, 512)
    checked = []

    def get_vllm_max_lora_rank(rank):
        checked.append(rank)
        if rank not in allowed:
            raise ValueError(f"LoRA rank {rank} is not one of vLLM's {allowed}")
        return rank

    package = types.ModuleType("verl.workers.rollout.vllm_rollout")
    utils = types.ModuleType("verl.workers.rollout.vllm_rollout.utils")
    utils.get_vllm_max_lora_rank = get_vllm_max_lora_rank
    package.utils = utils
    monkeypatch.setitem(sys.modules, "verl.workers.rollout.vllm_rollout", package)
    monkeypatch.setitem(sys.modules, "verl.workers.rollout.vllm_rollout.utils", utils)
    return checked


@pytest.mark.parametrize("name", ALL)
def test_verls_own_config_checks_accept_the_recipe(name, vllm_lora_rank_check):
    from verl.utils.config import omega_conf_to_dataclass
    from verl.utils.config import validate_config as verl_validate_config

    cfg = composed(name)
    verl_validate_config(cfg, use_reference_policy=False, use_critic=False)
    rollout = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout)  # RolloutConfig's own asserts (EP = TP x DP, ...)
    assert rollout.name == "vllm"
    omega_conf_to_dataclass(cfg.algorithm)
    if SPEC.get(name, {}).get("lora"):
        assert vllm_lora_rank_check == [32]


# ----- hardware ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMED)
def test_world_size_arithmetic_matches_nodes_times_gpus(name):
    cfg, spec = composed(name), SPEC[name]
    trainer, rollout = trainer_layout(cfg), rollout_layout(cfg)
    assert cluster_gpus(cfg) == spec["nodes"] * spec["gpus"]
    assert sel(cfg, "trainer.n_gpus_per_node") == spec["gpus"]
    # Trainer: TP x PP x CP x DP covers every training GPU, and so does ETP x EP x PP x expert DP.
    assert trainer.dense_product() == trainer.world
    assert trainer.expert_product() == trainer.world
    # Rollout: whole replicas of TP x DP x PP fill the rollout GPUs; vLLM's EP spans a replica.
    assert rollout.replicas >= 1 and rollout.replicas * rollout.replica_size == rollout.world
    assert rollout.ep in (1, rollout.tp * rollout.dp)
    if sel(cfg, "trainer.v1.trainer_mode") == "separate_async":
        assert sel(cfg, "actor_rollout_ref.hybrid_engine") is False
        assert sel(cfg, "actor_rollout_ref.rollout.n_gpus_per_node") == spec["gpus"]
        assert trainer.world + rollout.world == spec["nodes"] * spec["gpus"]
    else:
        assert rollout.world == trainer.world == spec["nodes"] * spec["gpus"]
    assert (sel(cfg, "actor_rollout_ref.actor.strategy") == "megatron") == (spec.get("engine") == "megatron")


@pytest.mark.parametrize("name", ALL)
def test_batch_sizes_divide_as_verl_requires(name):
    cfg = composed(name)
    train, mini = sel(cfg, "data.train_batch_size"), sel(cfg, "actor_rollout_ref.actor.ppo_mini_batch_size")
    n, dp = sel(cfg, "actor_rollout_ref.rollout.n"), trainer_layout(cfg).dp
    assert train % mini == 0
    assert (mini * n) % dp == 0, "an update's responses must split evenly over the data-parallel ranks"
    assert (train * n) % dp == 0
    if sel(cfg, "trainer.v1.trainer_mode") == "separate_async":
        assert train == sel(cfg, "trainer.v1.separate_async.parameter_sync_step") * mini
    if sel(cfg, "algorithm.adv_estimator") == "flash_reinforce":
        assert mini == train and sel(cfg, "actor_rollout_ref.actor.ppo_epochs") == 1
    longest = sel(cfg, "data.max_prompt_length") + sel(cfg, "data.max_response_length")
    assert sel(cfg, "actor_rollout_ref.actor.ppo_max_token_len_per_gpu") * trainer_layout(cfg).cp >= longest


# ----- async mode and lag -------------------------------------------------------------------------


def name_says(name: str) -> tuple[str, int]:
    match = re.search(r"_(sync|lag(\d+))$", name)
    assert match, f"{name} does not end in _sync or _lagN"
    return ("sync", 0) if match.group(1) == "sync" else ("async", int(match.group(2)))


@pytest.mark.parametrize("name", NAMED)
def test_async_mode_and_max_policy_lag_are_what_the_name_says(name):
    cfg = composed(name)
    mode, lag = name_says(name)
    measured = policy_lag(cfg)
    if mode == "sync":
        assert measured.trainer_mode == "sync" and measured.max_versions == 0
        assert sel(cfg, "actor_rollout_ref.hybrid_engine") is True
    else:
        assert measured.trainer_mode in ("separate_async", "colocate_async")
        assert measured.max_updates == lag and measured.max_versions == lag
        assert sel(cfg, "trainer.v1.sampler.max_off_policy_strategy") == "wait"
        # The prefetch window reaches the lag the name promises.
        assert sel(cfg, f"trainer.v1.{measured.trainer_mode}.num_warmup_batches") == lag


def test_policy_lag_counts_verls_staleness_span_inclusively():
    cfg = OmegaConf.create({"data": {"train_batch_size": 64},
                            "actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 32, "ppo_epochs": 1}},
                            "trainer": {"v1": {"trainer_mode": "colocate_async",
                                               "sampler": {"max_off_policy_threshold": 3}}}})
    lag = policy_lag(cfg)
    assert (lag.updates_per_step, lag.max_versions, lag.max_updates) == (2, 2, 5)
    cfg.trainer.v1.sampler.max_off_policy_threshold = None
    assert policy_lag(cfg).max_updates is None
    cfg.trainer.v1.trainer_mode = "sync"
    assert policy_lag(cfg).max_versions == 0


# ----- zero mismatch and LoRA ----------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL)
def test_sampling_is_untruncated_and_records_mu(name):
    cfg = composed(name)
    rollout = cfg.actor_rollout_ref.rollout
    assert rollout.temperature == 1.0 and rollout.top_p == 1.0 and rollout.top_k == -1
    assert rollout.calculate_log_probs is True and rollout.logprobs_mode == "processed_logprobs"


@pytest.mark.parametrize("name", [n for n in ALL if SPEC.get(n, {}).get("numerics", "consistent") != "standard"])
def test_zero_mismatch_recipes_turn_the_consistent_switch_on(name):
    cfg = composed(name)
    env = runtime_env_vars(cfg)
    assert env["ZMRL_NUMERICS"] == "consistent" and env["VLLM_BATCH_INVARIANT"] == "1"
    assert env["ZMRL_MEGATRON_ALIGNED"] == "1", "consistent numerics enable the aligned trainer forward"
    if sel(cfg, "actor_rollout_ref.actor.strategy") != "megatron" and name not in BASE_RECIPES:
        assert env["ZMRL_FSDP_ALIGNED"] == "1", "... in the engine the recipe trains with"
    # Prefix caching only where the seed's run had it, and then the plugin is told to keep it.
    caching = sel(cfg, "actor_rollout_ref.rollout.enable_prefix_caching")
    assert caching == (env.get("ZMRL_ALLOW_PREFIX_CACHING") == "1")
    assert caching == (name == "deepseek_v4_1_flash_swe_bench_pro_sync")
    rocm = SPEC.get(name, {}).get("numerics") == "consistent_rocm"
    assert (env.get("TORCH_BLAS_PREFER_HIPBLASLT") == "0") == rocm
    assert (env.get("ROCBLAS_USE_HIPBLASLT") == "0") == rocm
    assert name.startswith("mi355x_") == rocm


@pytest.mark.parametrize("name", [n for n in NAMED if SPEC[n]["numerics"] == "standard"])
def test_standard_kernel_ablations_use_verls_rollout_correction(name, vllm_lora_rank_check):
    from verl.utils.config import omega_conf_to_dataclass

    cfg = composed(name)
    assert runtime_env_vars(cfg) == {"ZMRL_NUMERICS": "fast", "VLLM_BATCH_INVARIANT": "0", "ZMRL_MEGATRON_ALIGNED": "0"}
    correction = cfg.algorithm.rollout_correction
    assert correction.bypass_mode is True and correction.loss_type == "reinforce"
    assert correction.rollout_is == "token" and float(correction.rollout_is_threshold) >= 1e9  # unclipped
    assert correction.rollout_rs == SPEC[name]["gate"]
    assert sel(cfg, "algorithm.norm_adv_by_std_in_grpo") is False
    # What verl's bypass loss reads in every worker (it calls .get on this block):
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert actor.policy_loss.loss_mode == "bypass_mode"
    seen_by_loss = actor.policy_loss.rollout_correction
    assert seen_by_loss.get("rollout_rs") == SPEC[name]["gate"]
    assert seen_by_loss.get("rollout_is") == "token" and seen_by_loss.get("loss_type") == "reinforce"


@pytest.mark.parametrize("name", [n for n in NAMED if SPEC[n].get("lora")])
def test_lora_recipes_target_every_module_the_aligned_path_adapts(name):
    """The seed adapts every module; a recipe keeps those the aligned LoRA path adapts (experts share
    megatron's linear_fc1/fc2 names with the dense MLPs) and drops, saying so in its header, those
    vLLM never applies to a response token (kv_b_proj) or cannot serve on CPU (the MoE router)."""
    from zero_mismatch_plugin.tools.config_checks.lora import COVERED, lora_problems

    cfg = composed(name)
    lora = cfg.actor_rollout_ref.model.lora
    assert lora_rank(cfg) == SPEC[name]["lora"]
    targets = set(lora.target_modules)
    assert targets <= set(COVERED), targets - set(COVERED)
    assert lora_problems(cfg) == []
    attention = {"linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj"}
    assert attention <= targets, "every MLA projection vLLM adapts on every token"
    assert {"linear_proj", "linear_fc1", "linear_fc2"} <= targets, "attention output and (expert) MLPs"
    header = (TOP_LEVEL_RECIPES / f"{name}.yaml").read_text().split("hydra:")[0]
    assert "drops linear_kv_up_proj" in header and "router" in header
    assert list(lora.exclude_modules) == []  # target mode and exclude mode are exclusive
    assert lora.merge is False, "a merged adapter would rewrite the frozen base"
    assert sel(cfg, "actor_rollout_ref.rollout.load_format") != "dummy", "the base stays the release weights"
    assert sel(cfg, "actor_rollout_ref.actor.megatron.use_mbridge") is True
    assert sel(cfg, "actor_rollout_ref.actor.megatron.vanilla_mbridge") is False


# ----- what the seeds report ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMED)
def test_seed_settings(name):
    cfg, spec = composed(name), SPEC[name]
    assert sel(cfg, "actor_rollout_ref.model.path").endswith(spec["model"])
    assert sel(cfg, "trainer.experiment_name") == name
    for key, value in spec.get("expect", {}).items():
        assert sel(cfg, key) == value, key
    estimator = sel(cfg, "algorithm.adv_estimator")
    algorithm = spec.get("algorithm")
    if algorithm in ("reinforce_zero", "flash_reinforce"):
        assert estimator == algorithm and sel(cfg, "actor_rollout_ref.actor.policy_loss.loss_mode") == algorithm
    elif algorithm == "dapo":
        assert estimator == "grpo" and sel(cfg, "algorithm.filter_groups.enable") is True
        assert sel(cfg, "actor_rollout_ref.actor.clip_ratio_high") > sel(cfg, "actor_rollout_ref.actor.clip_ratio_low")
    elif algorithm == "grpo":
        assert estimator == "grpo" and sel(cfg, "algorithm.filter_groups.enable") is False
    if algorithm == "flash_reinforce":
        assert sel(cfg, "actor_rollout_ref.rollout.n") == 1
    if spec.get("tools"):
        assert sel(cfg, "actor_rollout_ref.rollout.multi_turn.enable") is True
        assert sel(cfg, "actor_rollout_ref.rollout.agent.default_agent_loop") == "tool_agent"
    if "context" in spec:
        assert sel(cfg, "data.max_prompt_length") + sel(cfg, "data.max_response_length") == spec["context"]
    if "trajectories_per_node" in spec:
        trajectories = sel(cfg, "data.train_batch_size") * sel(cfg, "actor_rollout_ref.rollout.n")
        assert trajectories == spec["trajectories_per_node"] * spec["nodes"]
    if "rollouts_total" in spec:
        rollouts = (sel(cfg, "data.train_batch_size") * sel(cfg, "actor_rollout_ref.rollout.n")
                    * sel(cfg, "trainer.total_training_steps"))
        assert rollouts == spec["rollouts_total"]
    for val_set in spec.get("val_sets", ()):
        assert any(val_set in path for path in sel(cfg, "data.val_files"))
    if spec.get("checkpointed"):
        steps, every = sel(cfg, "trainer.total_training_steps"), sel(cfg, "trainer.save_freq")
        assert 0 < every < steps and steps % every == 0, "checkpoints inside the run, one at the end"
        assert {"model", "optimizer", "extra"} <= set(sel(cfg, "actor_rollout_ref.actor.checkpoint.save_contents"))
        assert sel(cfg, "actor_rollout_ref.actor.checkpoint.load_contents") == sel(
            cfg, "actor_rollout_ref.actor.checkpoint.save_contents")


def test_megatron_long_context_uses_dynamic_context_parallelism():
    cfg = composed("deepseek_v4_1_flash_swe_bench_pro_sync")
    megatron = cfg.actor_rollout_ref.actor.megatron
    assert megatron.context_parallel_size > 1 and megatron.dynamic_context_parallel is True
    assert megatron.max_seqlen_per_dp_cp_rank * megatron.context_parallel_size >= sel(
        cfg, "actor_rollout_ref.rollout.max_model_len")


# ----- broken overrides are refused ------------------------------------------------------------------


def test_broken_override_on_flash_reinforce_recipe_is_refused_with_a_clear_message(capsys):
    name = "flash_reinforce_qwen3_30b_a3b_python_tool_lag8"
    launched = []
    code = run_recipe(name, ["actor_rollout_ref.rollout.n=4"], dry_run=True, launcher=launched.append)
    err = capsys.readouterr().err
    assert code == 1 and launched == []
    assert "ERROR: actor_rollout_ref.rollout.n: must be 1: FlashREINFORCE uses one rollout per prompt" in err
    assert "refusing to launch" in err
    # The same through the command line, without --dry-run: still nothing is launched.
    assert zmrl(["recipes", "run", name, "actor_rollout_ref.rollout.n=4"]) == 1


def test_recipes_run_composes_once_unless_it_adds_the_cpu_runs_inputs(tmp_path, monkeypatch):
    """Hydra reads verl's whole config tree per composition: a GPU recipe is composed once and
    validated as composed; a CPU recipe again, with the input paths the run will build."""
    composed = []

    def counting(*args):
        composed.append(args)
        return compose_verl_config(*args)

    monkeypatch.setattr(recipes_module, "compose_verl_config", counting)
    launched = []
    assert run_recipe("flash_reinforce_qwen3_30b_a3b_python_tool_lag8", dry_run=True, launcher=launched.append) == 0
    assert len(composed) == 1
    composed.clear()
    assert run_recipe("cpu_smoke", [f"zmrl.smoke_inputs={tmp_path / 'inputs'}"], dry_run=True,
                      launcher=launched.append) == 0
    assert len(composed) == 2 and composed[0][2] != composed[1][2]  # the second with the inputs' paths
    # A broken override still fails validation from the one composition.
    composed.clear()
    assert run_recipe("flash_reinforce_qwen3_30b_a3b_python_tool_lag8", ["actor_rollout_ref.rollout.n=4"],
                      dry_run=True, launcher=launched.append) == 1
    assert len(composed) == 1 and launched == []


RECIPE_BREAKAGES = [
    ("deepseek_v4_1_flash_dapo_math_sync", ["trainer.nnodes=15"], "actor_rollout_ref.actor.megatron.expert_model_parallel_size",
     "not divisible by expert TP 1 x EP 16"),
    ("deepseek_v4_1_flash_dapo_math_sync", ["actor_rollout_ref.rollout.expert_parallel_size=8"],
     "actor_rollout_ref.rollout.expert_parallel_size", "TP x DP = 4"),
    ("deepseek_v4_1_flash_swe_bench_pro_sync", ["actor_rollout_ref.actor.megatron.dynamic_context_parallel=false"],
     "actor_rollout_ref.actor.megatron.context_parallel_size", "mis-normalizes seq-mean-token-mean"),
    ("ablation_sync_aligned_kernels_r1_distill_1_5b_sync", ["actor_rollout_ref.actor.ppo_mini_batch_size=1"],
     "actor_rollout_ref.actor.ppo_mini_batch_size", "8 responses per update do not split over 16 data-parallel ranks"),
    ("reinforce_zero_r1_distill_1_5b_math_lag2", ["trainer.v1.separate_async.parameter_sync_step=2"],
     "actor_rollout_ref.actor.ppo_mini_batch_size", "parameter_sync_step 2"),
    ("reinforce_zero_r1_distill_1_5b_math_lag2", ["actor_rollout_ref.rollout.nnodes=0"],
     "actor_rollout_ref.rollout.nnodes", "rollout pool"),
    ("reinforce_zero_r1_distill_1_5b_math_lag2", ["actor_rollout_ref.rollout.checkpoint_engine.backend=naive"],
     "actor_rollout_ref.rollout.checkpoint_engine.backend", "collective backend"),
    ("reinforce_zero_qwen3_4b_python_tool_lag64", ["actor_rollout_ref.actor.ppo_max_token_len_per_gpu=8192"],
     "actor_rollout_ref.actor.ppo_max_token_len_per_gpu", "16384 tokens"),
    ("mi355x_kimi_k3_1_lora_r32_dapo_sync", [f"{ENV}.VLLM_BATCH_INVARIANT='0'"], f"{ENV}.VLLM_BATCH_INVARIANT",
     "must be \"1\""),
    ("kimi_k3_1_lora_r32_dapo_gb300_sync", ["actor_rollout_ref.rollout.calculate_log_probs=false"],
     "actor_rollout_ref.rollout.calculate_log_probs", "the rollout engine recorded"),
]


@pytest.mark.parametrize("name,overrides,key,text", RECIPE_BREAKAGES)
def test_each_recipe_level_breakage_is_named(name, overrides, key, text):
    problems = [(p.key, p.message) for p in check_recipe(compose_verl_config(TOP_LEVEL_RECIPES, name, overrides))
                if p.fatal]
    assert any(k == key and text in message for k, message in problems), problems


def test_prefix_caching_without_the_plugin_switch_is_flagged():
    cfg = compose_verl_config(TOP_LEVEL_RECIPES, "deepseek_v4_1_flash_dapo_math_sync",
                              ["actor_rollout_ref.rollout.enable_prefix_caching=true"])
    warnings = {p.key: p.message for p in recipe_problems(cfg) if not p.fatal}
    assert "ZMRL_ALLOW_PREFIX_CACHING" in warnings["actor_rollout_ref.rollout.enable_prefix_caching"]


# ----- zmrl recipes list / show / run ------------------------------------------------------------------


def test_dry_run_prints_the_exact_command_and_launches_nothing(capsys):
    launched = []
    overrides = ["actor_rollout_ref.model.path=/models/r1", "data.train_files=[/d/a.parquet,/d/b.parquet]"]
    code = run_recipe("reinforce_zero_r1_distill_1_5b_math_lag2", overrides, dry_run=True, launcher=launched.append)
    out = capsys.readouterr().out.strip()
    assert code == 0 and launched == []
    assert shlex.split(out) == [sys.executable, "-m", "verl.trainer.main_ppo", f"--config-path={RECIPES_DIR}",
                                "--config-name=reinforce_zero_r1_distill_1_5b_math_lag2", *overrides]
    assert Path(shlex.split(out)[3].split("=", 1)[1]).is_absolute()  # verl resolves relative paths against itself


def test_run_hands_the_command_to_the_launcher_and_returns_its_status():
    launched = []

    def launcher(command):
        launched.append(command)
        return 7

    assert run_recipe("flash_reinforce", [DENSE, "trainer.nnodes=1"], launcher=launcher) == 7
    assert launched == [launch_command("flash_reinforce", [DENSE, "trainer.nnodes=1"])]


def test_the_printed_command_composes_in_verls_own_launcher(tmp_path, capsys):
    # Hydra's --cfg job composes through verl's real entry point and prints the config without
    # starting the trainer; run from another directory, as a user would. The command is the one
    # `--allow-unaligned-trainer` prints for a flagship the aligned forward does not cover.
    name = "flash_reinforce_qwen3_30b_a3b_python_tool_lag8"
    overrides = ["trainer.total_training_steps=5", "zm_engine=megatron"]  # MoE in Megatron: not aligned
    assert run_recipe(name, overrides, dry_run=True, allow_unaligned_trainer=True) == 0
    command = shlex.split(capsys.readouterr().out.strip())
    result = subprocess.run([*command, "--cfg", "job"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    printed = OmegaConf.create(result.stdout[result.stdout.index("data:"):])
    assert printed.algorithm.adv_estimator == "flash_reinforce"
    assert printed.trainer.total_training_steps == 5
    env = printed.ray_kwargs.ray_init.runtime_env.env_vars
    assert env.ZMRL_NUMERICS == "consistent" and env.ZMRL_MEGATRON_ALIGNED == "0"  # a string, as Ray needs


def test_the_unaligned_override_is_loud_and_launches_only_with_the_switch_off(capsys):
    name = "kimi_k3_1_lora_r32_dapo_gb300_sync"
    launched = []
    assert run_recipe(name, launcher=launched.append) == 1 and launched == []
    err = capsys.readouterr().err
    assert "missing: a path for KimiK3ForCausalLM" in err and "LoRA adapters (rank 32)" in err
    assert "refusing to launch" in err
    assert run_recipe(name, launcher=lambda command: launched.append(command) or 0, allow_unaligned_trainer=True) == 0
    assert launched == [launch_command(name, [UNALIGNED_OVERRIDE])]
    assert f"warning: {SWITCH}: TRAINER NOT ALIGNED" in capsys.readouterr().err


@pytest.fixture(scope="module")
def recipes_listed() -> str:
    """What `zmrl recipes list` prints (it composes every recipe: run once for the module)."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert zmrl(["recipes", "list"]) == 0
    return out.getvalue()


def test_list_names_every_recipe_and_whether_its_trainer_is_aligned(recipes_listed):
    out = recipes_listed
    for name in recipe_names():
        assert f"  {name}\n" in out
        trainer = out.split(f"  {name}\n", 1)[1].splitlines()[1].strip()
        expected = ("trainer: NOT aligned: missing a path for" if name in NOT_ALIGNED else
                    "trainer: standard kernels" if name in STANDARD else
                    "trainer: aligned if the model is one of" if name in BASE_RECIPES else "trainer: aligned")
        assert trainer.startswith(expected), (name, trainer)
    assert str(RECIPES_DIR) in out


HEADER_SAYS = {"aligned": ALIGNED, "NOT aligned today": NOT_ALIGNED, "standard kernels": STANDARD,
               "aligned if the model is a dense": BASE_RECIPES}


@pytest.mark.parametrize("name", ALL)
def test_each_recipe_header_says_what_its_trainer_side_is(name):
    said = recipe_info(name).trainer
    matching = [prefix for prefix, names in HEADER_SAYS.items() if name in names]
    assert len(matching) == 1 and said.startswith(matching[0] + (":" if matching[0] == "aligned" else "")), said
    status = trainer_alignment(composed(name)).status
    assert status == {"aligned": ALIGNMENT_ALIGNED, "NOT aligned today": ALIGNMENT_NOT_ALIGNED,
                      "standard kernels": ALIGNMENT_STANDARD, "aligned if the model is a dense": MODEL_UNKNOWN}[matching[0]]


@pytest.mark.parametrize("name", [n for n in ALIGNED if SPEC[n]["engine"] == "megatron"])
def test_aligned_recipes_enable_the_aligned_megatron_forward(name):
    cfg = composed(name)
    assert runtime_env_vars(cfg)["ZMRL_MEGATRON_ALIGNED"] == "1"
    assert sel(cfg, "actor_rollout_ref.actor.strategy") == "megatron"
    megatron = cfg.actor_rollout_ref.actor.megatron
    assert (megatron.tensor_model_parallel_size, megatron.pipeline_model_parallel_size,
            megatron.context_parallel_size) == (1, 1, 1)
    assert sel(cfg, "actor_rollout_ref.rollout.tensor_model_parallel_size") == 1
    assert lora_rank(cfg) == 0


MEGATRON_TP = "actor_rollout_ref.actor.megatron.tensor_model_parallel_size"
ROLLOUT_TP = "actor_rollout_ref.rollout.tensor_model_parallel_size"


def test_equal_tensor_parallelism_is_aligned_in_verls_megatron_engine():
    """The aligned output layer gathers the vocabulary and the patched logits processor takes the
    gathered logits (cpu_smoke_megatron runs it at TP 2 + SP on two workers)."""
    name = next(n for n in ALIGNED if SPEC[n]["engine"] == "megatron")
    cfg = compose_verl_config(TOP_LEVEL_RECIPES, name, [f"{MEGATRON_TP}=2", f"{ROLLOUT_TP}=2"])
    alignment = trainer_alignment(cfg)
    assert alignment.status == ALIGNMENT_ALIGNED, alignment.describe()


@pytest.mark.parametrize("trainer_tp,rollout_tp,says,not_said", [
    (2, 1, f"rollout tensor parallelism 1 with trainer tensor parallelism 2 (each trainer rank reproduces the "
           f"rollout rank of its index: set {ROLLOUT_TP} and {MEGATRON_TP} equal)", None),
    (1, 4, f"rollout tensor parallelism 4 with trainer tensor parallelism 1 (each trainer rank reproduces the "
           f"rollout rank of its index: set {ROLLOUT_TP}=1)", "in verl's Megatron engine"),
])
def test_trainer_and_rollout_tensor_parallelism_must_be_equal(trainer_tp, rollout_tp, says, not_said):
    name = next(n for n in ALIGNED if SPEC[n]["engine"] == "megatron")
    cfg = compose_verl_config(TOP_LEVEL_RECIPES, name, [f"{MEGATRON_TP}={trainer_tp}", f"{ROLLOUT_TP}={rollout_tp}"])
    alignment = trainer_alignment(cfg)
    said = alignment.describe()
    assert alignment.status == ALIGNMENT_NOT_ALIGNED and says in said, said
    assert not_said is None or not_said not in said, said
    assert "tensor parallelism > 1 in the trainer" not in said  # the Megatron face itself runs TP > 1


def test_show_prints_the_composed_config_with_overrides(capsys):
    assert zmrl(["recipes", "show", "mi355x_deepseek_v4_flash_grpo_sync", "trainer.save_freq=6"]) == 0
    shown = OmegaConf.create(capsys.readouterr().out)
    assert shown.trainer.save_freq == 6
    assert shown.actor_rollout_ref.actor.strategy == "megatron"
    assert shown.ray_kwargs.ray_init.runtime_env.env_vars.ROCBLAS_USE_HIPBLASLT == "0"


@pytest.mark.parametrize("argv", [["recipes", "show", "no_such_recipe"], ["recipes", "run", "no_such_recipe", "--dry-run"]])
def test_unknown_recipe_is_a_clear_error(argv, capsys):
    assert zmrl(argv) == 2
    err = capsys.readouterr().err
    assert "no recipe named 'no_such_recipe'" in err and "reinforce_zero" in err


def test_an_override_that_does_not_compose_is_a_clear_error(capsys):
    assert zmrl(["recipes", "run", "reinforce_zero", "actor_rollout_ref.rollout.no_such_key=1", "--dry-run"]) == 2
    assert "cannot compose recipe 'reinforce_zero'" in capsys.readouterr().err


# ----- shipped inside the package ----------------------------------------------------------------------


def test_recipes_live_in_the_package_and_the_top_level_directory_is_the_same():
    assert RECIPES_DIR == Path(recipes_module.__file__).resolve().parent
    assert RECIPES_DIR.parents[1] == Path(recipes_module.__file__).resolve().parents[2]  # zero_mismatch_plugin/
    assert TOP_LEVEL_RECIPES.resolve() == RECIPES_DIR


def test_package_data_ships_every_yaml_file():
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    patterns = pyproject["tool"]["setuptools"]["package-data"]["zero_mismatch_plugin"]
    package_dir = RECIPES_DIR.parents[1]
    shipped = {p for pattern in patterns for p in package_dir.glob(pattern)}
    every = set(RECIPES_DIR.rglob("*.yaml"))
    assert every and every == {p for p in shipped if p.is_relative_to(RECIPES_DIR)}
    assert all(fnmatch.fnmatch(str(p.relative_to(package_dir)), "tools/recipes/*") for p in every)


def test_recipes_compose_from_the_package_without_a_source_path():
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="zero_mismatch_plugin.tools.recipes", version_base=None):
        cfg = compose(config_name="kimi_k3_1_lora_r32_dapo_gb300_sync")
    GlobalHydra.instance().clear()
    assert cfg.actor_rollout_ref.model.lora.rank == 32


def test_verls_launcher_hands_the_aligned_switch_to_every_ray_worker(monkeypatch):
    # verl 0.9.1's run_ppo merges ray_kwargs.ray_init.runtime_env over its own defaults and passes
    # it to ray.init, whose runtime_env every actor (TaskRunner, workers, vLLM servers) inherits.
    from verl.trainer import main_ppo

    initialised = {}

    class TaskRunner:
        @classmethod
        def remote(cls):
            return cls()

        class run:  # noqa: N801 - stands in for a Ray actor method
            @staticmethod
            def remote(config):
                return config

    monkeypatch.setattr(main_ppo.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(main_ppo.ray, "init", lambda **kwargs: initialised.update(kwargs))
    monkeypatch.setattr(main_ppo.ray, "get", lambda ref: ref)
    for name, switch in (("reinforce_zero_r1_distill_1_5b_math_lag2", "1"),
                         ("ablation_is_standard_kernels_r1_distill_1_5b_lag8", "0")):
        main_ppo.run_ppo(composed(name), task_runner_class=TaskRunner)
        env_vars = initialised["runtime_env"]["env_vars"]
        assert env_vars["ZMRL_MEGATRON_ALIGNED"] == switch, name
        assert env_vars["ZMRL_NUMERICS"] == ("consistent" if switch == "1" else "fast")


@pytest.mark.parametrize("name", MOE_FSDP)
def test_moe_recipes_train_aligned_in_verls_fsdp_engine(name, recipes_listed):
    """The Qwen3-30B-A3B recipes train with verl's FSDP2 engine and its aligned forward
    (zm_engine: fsdp_aligned), which runs MoE layers through the op layer's MoE op; `zmrl recipes
    list` says aligned. Would the FSDP engine stop covering MoE, the status would name the gap."""
    cfg = composed(name)
    assert trainer_alignment(cfg).status == ALIGNMENT_ALIGNED, trainer_alignment(cfg).describe()
    assert sel(cfg, "zmrl.architecture") == "Qwen3MoeForCausalLM"
    assert runtime_env_vars(cfg)["ZMRL_FSDP_ALIGNED"] == "1"
    assert sel(cfg, "actor_rollout_ref.actor.strategy") == "fsdp2"
    assert sel(cfg, "actor_rollout_ref.actor.ulysses_sequence_parallel_size") == 1
    assert sel(cfg, "actor_rollout_ref.model.use_fused_kernels") is False
    assert lora_rank(cfg) == 0
    # The forward computes in FSDP's param_dtype: the dtype the rollout serves the checkpoint in.
    assert sel(cfg, "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype") == "bf16"
    assert sel(cfg, "actor_rollout_ref.rollout.dtype") == "bfloat16"
    rollout = rollout_layout(cfg)
    assert (rollout.tp, rollout.dp, rollout.pp, rollout.ep) == (1, 1, 1, 1), "1-GPU replicas, one-process experts"
    listed = recipes_listed.split(f"  {name}\n", 1)[1].splitlines()[1].strip()
    assert listed == "trainer: aligned", listed


def test_moe_in_verls_megatron_engine_at_expert_parallelism_needs_per_expert_gemms():
    """The same recipe on verl's Megatron engine at EP 8: expert parallelism runs there; the
    grouped-GEMM experts both bridges build for an MoE model are the gap named."""
    cfg = compose_verl_config(TOP_LEVEL_RECIPES, "reinforce_zero_qwen3_30b_a3b_python_tool_lag8",
                              ["zm_engine=megatron", "actor_rollout_ref.actor.megatron.expert_model_parallel_size=8"])
    alignment = trainer_alignment(cfg)
    assert alignment.status == ALIGNMENT_NOT_ALIGNED
    said = alignment.describe()
    assert "moe_grouped_gemm=false (grouped-GEMM experts are not vLLM's fused-MoE arithmetic)" in said
    assert "expert_model_parallel_size 8 in verl's Megatron engine" not in said  # runs there (cpu_smoke_megatron, EP 2)


@pytest.mark.parametrize("tp, etp, gap", [(2, 2, False), (2, 1, False), (4, 2, True), (1, 2, True)])
def test_expert_tensor_parallelism_is_a_gap_only_when_it_is_neither_1_nor_the_tensor_parallelism(tp, etp, gap):
    """The face splits each expert as the engine's tensor-parallel ranks do (ETP = TP) or keeps it
    whole and computes the engine ranks' shards (ETP 1, with expert parallelism); other sizes are named."""
    cfg = compose_verl_config(TOP_LEVEL_RECIPES, "reinforce_zero_qwen3_30b_a3b_python_tool_lag8",
                              ["zm_engine=megatron", f"actor_rollout_ref.actor.megatron.tensor_model_parallel_size={tp}",
                               f"actor_rollout_ref.actor.megatron.expert_tensor_parallel_size={etp}"])
    said = trainer_alignment(cfg).describe()
    assert (f"expert_tensor_parallel_size {etp} in the trainer" in said) == gap, said


def test_context_parallelism_is_a_gap_of_verls_engine_not_of_the_face_and_pipeline_parallelism_is_neither():
    """The face runs CP bitwise on its own ranks, so the spec does not refuse it; inside verl's
    Megatron engine it has not run, and the config check says that, not "unsupported". Pipeline
    parallelism has run inside verl's engine (by hand, docs/megatron.md): no gap."""
    def said(name):
        cfg = compose_verl_config(TOP_LEVEL_RECIPES, "reinforce_zero_qwen3_30b_a3b_python_tool_lag8",
                                  ["zm_engine=megatron", f"actor_rollout_ref.actor.megatron.{name}=2"])
        return trainer_alignment(cfg).describe()

    context = said("context_parallel_size")
    assert "context_parallel_size 2 in verl's Megatron engine (the Megatron face runs it bitwise" in context
    assert "context parallelism > 1 in the trainer" not in context
    assert "pipeline" not in said("pipeline_model_parallel_size")


@pytest.mark.parametrize("override,gap", [
    # Multi-head latent attention stays outside verl's FSDP engine (the aligned model face covers it).
    ("zmrl.architecture=DeepseekV3ForCausalLM", "the aligned model face covers it, verl's FSDP engine does not yet"),
    # vLLM's MoE layer across data-parallel ranks is not the one-process layer the op runs.
    ("actor_rollout_ref.rollout.data_parallel_size=2", "rollout data_parallel_size 2"),
    ("actor_rollout_ref.rollout.tensor_model_parallel_size=2", "rollout tensor parallelism 2"),
])
def test_what_the_fsdp_engine_does_not_cover_is_named_for_the_moe_recipe(override, gap):
    cfg = compose_verl_config(TOP_LEVEL_RECIPES, "reinforce_zero_qwen3_30b_a3b_python_tool_lag8", [override])
    alignment = trainer_alignment(cfg)
    assert alignment.status == ALIGNMENT_NOT_ALIGNED and gap in alignment.describe(), alignment.describe()
    problems = [p for p in recipe_problems(cfg) if p.fatal]
    assert [p.key for p in problems] == [FSDP_SWITCH], problems


# ----- the command line: overrides after flags, flags given to the wrong command ------------------------


def _parsed(argv):
    from zero_mismatch_plugin.tools.cli import build_parser

    parser = build_parser()
    args, stray = parser.parse_known_args(argv)
    if stray:
        recipes_module.place_stray_arguments(parser, args, stray)
    return args


def test_overrides_are_taken_wherever_they_stand():
    args = _parsed(["recipes", "run", "reinforce_zero", "a=1", "--dry-run", "b=2", "--allow-unaligned-trainer", "~c"])
    assert args.overrides == ["a=1", "b=2", "~c"] and args.dry_run and args.allow_unaligned_trainer
    args = _parsed(["validate-config", "--config-path", "X", "a=1", "--config-name", "Y", "b=2"])
    assert (args.config_path, args.config_name, args.overrides) == ("X", "Y", ["a=1", "b=2"])


@pytest.mark.parametrize("argv,says", [
    (["recipes", "show", "reinforce_zero", "--dry-run"], "--dry-run is an option of `zmrl recipes run`, not of `zmrl recipes show`"),
    (["recipes", "run", "reinforce_zero", "--dryrun"], "--dryrun: did you mean --dry-run?"),
    (["recipes", "run", "reinforce_zero", "--config-name", "x"], "--config-name is an option of `zmrl validate-config`"),
    (["recipes", "list", "x=1"], "`zmrl recipes list` takes no overrides"),
    (["recipes", "run", "reinforce_zero", "--nope"], "--nope is not an option of `zmrl recipes run` (its options: "),
])
def test_a_misplaced_flag_names_where_it_belongs(argv, says):
    with pytest.raises(recipes_module.StrayArguments) as raised:
        _parsed(argv)
    assert says in str(raised.value)


def test_an_unknown_recipe_names_the_close_ones():
    with pytest.raises(recipes_module.RecipeError, match=r"no recipe named 'reinforce_zro'; did you mean 'reinforce_zero'"):
        recipes_module.recipe_path("reinforce_zro")


# ----- the CPU run: where it writes ---------------------------------------------------------------------


def test_the_cpu_run_inputs_folder_is_the_recipes_or_the_override(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = OmegaConf.create({"zmrl": {"smoke_inputs": "zmrl-cpu-smoke-inputs"}})
    assert recipes_module.smoke_inputs_dir(cfg) == tmp_path / recipes_module.SMOKE_INPUTS_DIR
    assert recipes_module.smoke_inputs_dir(OmegaConf.create({})) == tmp_path / recipes_module.SMOKE_INPUTS_DIR
    cfg = OmegaConf.create({"zmrl": {"smoke_inputs": str(tmp_path / "elsewhere")}})
    assert recipes_module.smoke_inputs_dir(cfg) == tmp_path / "elsewhere"


def test_an_unwritable_cpu_run_is_refused_before_anything_is_built(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    blocked = tmp_path / "a-file"
    blocked.write_text("x")
    problems = recipes_module._cpu_run_problems(blocked / "inputs", [], build=True)
    assert len(problems) == 1 and f"{blocked / 'inputs'}, which cannot be written" in problems[0]
    assert "zmrl.smoke_inputs=DIR" in problems[0]
    assert recipes_module._cpu_run_problems(tmp_path / "inputs", [], build=True) == []
    assert recipes_module._cpu_run_problems(blocked / "inputs", [], build=False) == []
