"""`zmrl validate-config`: composes as verl does and reports every problem with its key."""

import json
from pathlib import Path

import pytest

from zero_mismatch_plugin.tools import recipes
from zero_mismatch_plugin.tools.cli import main as zmrl
from zero_mismatch_plugin.tools.config_checks import check_config
from zero_mismatch_plugin.tools.config_checks.validate_config import compose_verl_config, validate_config

from support import REPO  # noqa: E402

RECIPES = REPO / "recipes"
PLUGIN_TARGET = "zero_mismatch_plugin.integrations.verl.config.ZeroMismatchPolicyLossConfig"
# The base recipes leave the model open; a dense architecture lets them validate without a checkpoint.
DENSE = "zmrl.architecture=Qwen2ForCausalLM"


def _problems(name: str, *overrides: str) -> dict[str, str]:
    cfg = compose_verl_config(RECIPES, name, overrides)
    return {p.key: p.message for p in validate_config(cfg) if p.fatal}


def _all_problems(name: str, *overrides: str) -> dict[str, str]:
    cfg = compose_verl_config(RECIPES, name, (DENSE, *overrides))
    return {p.key: p.message for p in check_config(cfg) if p.fatal}


@pytest.mark.parametrize("name", ["reinforce_zero", "flash_reinforce"])
def test_recipe_composes_against_installed_verl_and_passes(name, capsys):
    assert _problems(name) == {}
    assert zmrl(["validate-config", "--config-path", str(RECIPES), "--config-name", name, DENSE]) == 0
    assert "config OK" in capsys.readouterr().out


@pytest.mark.parametrize("name,loss_mode", [("reinforce_zero", "reinforce_zero"), ("flash_reinforce", "flash_reinforce")])
def test_composed_actor_config_carries_the_plugin_config_subclass(name, loss_mode):
    from verl.utils.config import omega_conf_to_dataclass

    from zero_mismatch_plugin.integrations.verl.config import ZeroMismatchPolicyLossConfig

    cfg = compose_verl_config(RECIPES, name, ["++actor_rollout_ref.actor.policy_loss.trust_region_delta=0.05"])
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)  # what every verl worker does
    assert isinstance(actor.policy_loss, ZeroMismatchPolicyLossConfig)
    assert actor.policy_loss.loss_mode == loss_mode
    assert actor.policy_loss.trust_region_delta == 0.05


COMMON_BREAKAGES = [
    ("algorithm.rollout_correction.bypass_mode=false", "algorithm.rollout_correction.bypass_mode", "must be true"),
    ("actor_rollout_ref.rollout.calculate_log_probs=false", "actor_rollout_ref.rollout.calculate_log_probs", "mu"),
    ("actor_rollout_ref.actor.loss_agg_mode=token-mean", "actor_rollout_ref.actor.loss_agg_mode", "seq-mean-token-mean"),
    ("actor_rollout_ref.rollout.top_p=0.9", "actor_rollout_ref.rollout.top_p", "common support"),
    ("actor_rollout_ref.rollout.top_k=20", "actor_rollout_ref.rollout.top_k", "common support"),
    ("algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_is", "must be null"),
    ("algorithm.rollout_correction.rollout_rs=seq_mean_k3", "algorithm.rollout_correction.rollout_rs", "must be null"),
    ("trainer.use_v1=false", "trainer.use_v1", "legacy trainer"),
    # ++ adds any key; the policy-loss check then names it (a single + is refused while composing, below).
    ("++actor_rollout_ref.actor.policy_loss.trust_region_detla=0.1",
     "actor_rollout_ref.actor.policy_loss.trust_region_detla", "unknown key"),
    ("++actor_rollout_ref.actor.policy_loss.trust_region_delta=-1", "actor_rollout_ref.actor.policy_loss",
     "trust_region_delta must be a positive number"),
]


@pytest.mark.parametrize("name", ["reinforce_zero", "flash_reinforce"])
def test_bypass_off_is_accepted_when_verl_passes_mu_to_the_loss(name, monkeypatch):
    from verl.workers.utils import losses

    from zero_mismatch_plugin.integrations.verl import ROLLOUT_LOG_PROBS_MARKER

    monkeypatch.setattr(losses, ROLLOUT_LOG_PROBS_MARKER, True, raising=False)
    problems = _problems(name, "algorithm.rollout_correction.bypass_mode=false")
    assert "algorithm.rollout_correction.bypass_mode" not in problems, problems


@pytest.mark.parametrize("name", ["reinforce_zero", "flash_reinforce"])
@pytest.mark.parametrize("override,key,text", COMMON_BREAKAGES)
def test_each_broken_setting_is_named(name, override, key, text):
    problems = _problems(name, override)
    assert key in problems, problems
    assert text in problems[key]


FLASH_BREAKAGES = [
    ("actor_rollout_ref.rollout.n=4", "actor_rollout_ref.rollout.n", "one rollout per prompt"),
    ("actor_rollout_ref.actor.ppo_epochs=2", "actor_rollout_ref.actor.ppo_epochs", "one update per batch"),
    ("actor_rollout_ref.actor.ppo_mini_batch_size=64", "actor_rollout_ref.actor.ppo_mini_batch_size", "256 prompts"),
]


@pytest.mark.parametrize("override,key,text", FLASH_BREAKAGES)
def test_flash_reinforce_specific_requirements(override, key, text):
    problems = _problems("flash_reinforce", override)
    assert key in problems and text in problems[key], problems


def test_separate_async_is_accepted_when_one_step_covers_the_estimator_batch():
    ok = _problems("flash_reinforce", "trainer.v1.trainer_mode=separate_async",
                   "trainer.v1.separate_async.parameter_sync_step=4", "actor_rollout_ref.actor.ppo_mini_batch_size=64")
    assert ok == {}


def test_plugin_key_without_plugin_target_is_named():
    problems = _problems("reinforce_zero", "actor_rollout_ref.actor.policy_loss._target_=verl.workers.config.PolicyLossConfig",
                         "++actor_rollout_ref.actor.policy_loss.trust_region_delta=0.1")
    key = "actor_rollout_ref.actor.policy_loss.trust_region_delta"
    assert key in problems and PLUGIN_TARGET in problems[key]


def test_all_problems_are_reported_at_once_and_exit_nonzero(capsys):
    code = zmrl(["validate-config", "--config-path", str(RECIPES), "--config-name", "flash_reinforce", DENSE,
                 "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.rollout.top_p=0.5",
                 "algorithm.rollout_correction.bypass_mode=false"])
    err = capsys.readouterr().err
    assert code == 1
    assert "3 error(s)" in err
    for key in ("actor_rollout_ref.rollout.n", "actor_rollout_ref.rollout.top_p", "bypass_mode"):
        assert key in err


def test_bad_config_path_is_a_clear_error(capsys, tmp_path):
    assert zmrl(["validate-config", "--config-path", str(tmp_path / "nope"), "--config-name", "x"]) == 2
    assert "no such directory" in capsys.readouterr().err


def test_configs_without_the_plugin_are_left_alone():
    cfg = compose_verl_config(RECIPES, "reinforce_zero", ["algorithm.adv_estimator=grpo",
                                                          "actor_rollout_ref.actor.policy_loss.loss_mode=vanilla",
                                                          "algorithm.rollout_correction.bypass_mode=false"])
    assert validate_config(cfg) == []


def test_separate_async_chunking_that_splits_the_centered_batch_is_named():
    problems = _problems("flash_reinforce", "trainer.v1.trainer_mode=separate_async",
                         "trainer.v1.separate_async.parameter_sync_step=4")
    key = "actor_rollout_ref.actor.ppo_mini_batch_size"
    assert key in problems and "64 prompts in trainer mode separate_async" in problems[key]


def test_unregistered_names_are_rejected_even_outside_the_plugin():
    problems = _problems("reinforce_zero", "algorithm.adv_estimator=reinforce_zer0",
                         "actor_rollout_ref.actor.policy_loss.loss_mode=vanila")
    assert "is not a registered advantage estimator" in problems["algorithm.adv_estimator"]
    assert "is not a registered policy loss" in problems["actor_rollout_ref.actor.policy_loss.loss_mode"]


# ----- values of the wrong type, null, out of range: one reader, one policy -------------------------


def test_every_mistyped_value_is_named_at_once_with_its_expected_type(capsys):
    code = zmrl(["validate-config", "--config-path", str(RECIPES), "--config-name", "reinforce_zero", DENSE,
                 "actor_rollout_ref.rollout.n=abc", "data.train_batch_size=abc", "trainer.nnodes=abc",
                 "actor_rollout_ref.rollout.temperature=hot"])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    assert "ERROR: actor_rollout_ref.rollout.n: must be an integer, got str 'abc'" in err
    assert "ERROR: data.train_batch_size: must be an integer, got str 'abc'" in err
    assert "ERROR: trainer.nnodes: must be an integer, got str 'abc'" in err
    assert "ERROR: actor_rollout_ref.rollout.temperature: must be a finite number, got str 'hot'" in err
    assert "4 error(s)" in err


def test_validate_config_and_recipes_run_give_the_same_verdict_on_the_same_value(capsys):
    bad = "actor_rollout_ref.rollout.temperature=hot"
    assert zmrl(["validate-config", "--config-path", str(RECIPES), "--config-name", "reinforce_zero", DENSE, bad]) == 1
    from_validate = capsys.readouterr().err
    assert zmrl(["recipes", "run", "reinforce_zero", DENSE, bad, "--dry-run"]) == 1
    from_run = capsys.readouterr().err
    line = "ERROR: actor_rollout_ref.rollout.temperature: must be a finite number, got str 'hot'"
    assert line in from_validate and line in from_run


def test_both_modules_read_values_through_the_one_reader():
    # The second, lenient reader (None -> default) is gone: a null where a value is due is an error
    # in both entry points, where one used to default it and the other crashed on it.
    assert not hasattr(recipes, "_get")
    import zero_mismatch_plugin.tools.config_checks.validate_config as module

    assert not hasattr(module, "_get")
    cfg = compose_verl_config(RECIPES, "reinforce_zero", [DENSE, "actor_rollout_ref.rollout.temperature=null"])
    expected = "must be a finite number, got null"
    assert {p.message for p in validate_config(cfg) if p.key.endswith("temperature")} == {expected}
    assert {p.message for p in recipes.recipe_problems(cfg) if p.key.endswith("temperature")} == {expected}


def test_a_temperature_other_than_1_is_one_warning_everywhere():
    cfg = compose_verl_config(RECIPES, "reinforce_zero", [DENSE, "actor_rollout_ref.rollout.temperature=0.7"])
    problems = [p for p in check_config(cfg) if p.key == "actor_rollout_ref.rollout.temperature"]
    assert len(problems) == 1 and not problems[0].fatal
    assert "tested end to end at temperature 1.0" in problems[0].message


def test_reinforce_zero_with_one_rollout_per_prompt_is_refused_pointing_to_flash_reinforce():
    problems = _problems("reinforce_zero", "actor_rollout_ref.rollout.n=1")
    message = problems["actor_rollout_ref.rollout.n"]
    assert "must be at least 2 with reinforce_zero" in message and "use flash_reinforce" in message
    assert "actor_rollout_ref.rollout.n" not in _problems("reinforce_zero", "actor_rollout_ref.rollout.n=2")


def test_a_zero_mini_batch_is_a_range_error_not_a_division_by_zero():
    problems = _all_problems("reinforce_zero", "actor_rollout_ref.actor.ppo_mini_batch_size=0")
    assert problems == {"actor_rollout_ref.actor.ppo_mini_batch_size": "must be at least 1 (got 0)"}


def test_a_removed_required_key_is_named():
    problems = _all_problems("reinforce_zero", "~data.train_batch_size")
    assert problems == {"data.train_batch_size": "is required: set it to an integer"}


def test_nullable_keys_take_the_meaning_verl_gives_null():
    assert _all_problems("reinforce_zero", "trainer.v1.sampler.max_off_policy_threshold=null") == {}
    cfg = compose_verl_config(RECIPES, "reinforce_zero", [DENSE, "trainer.v1.sampler.max_off_policy_threshold=null"])
    assert recipes.policy_lag(cfg).max_updates is None  # unbounded, as verl reads it


def test_ray_env_values_must_be_strings():
    problems = _all_problems("reinforce_zero", "ray_kwargs.ray_init.runtime_env.env_vars.VLLM_BATCH_INVARIANT=1")
    assert "quote it" in problems["ray_kwargs.ray_init.runtime_env.env_vars.VLLM_BATCH_INVARIANT"]


# ----- the trainer side ---------------------------------------------------------------------------------


def _model(tmp_path: Path, **config) -> str:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return str(tmp_path)


SWITCH = "ray_kwargs.ray_init.runtime_env.env_vars.ZMRL_MEGATRON_ALIGNED"


def test_the_local_config_json_decides_the_architecture(tmp_path):
    dense = _model(tmp_path / "dense", architectures=["LlamaForCausalLM"])
    moe = _model(tmp_path / "moe", architectures=["Qwen3MoeForCausalLM"], num_experts=128)
    assert _all_problems("reinforce_zero", f"actor_rollout_ref.model.path={dense}") == {}
    # config.json wins over a declared dense architecture: verl's Megatron engine runs the MoE
    # checkpoint aligned with per-expert (not grouped-GEMM) experts.
    message = _all_problems("reinforce_zero", f"actor_rollout_ref.model.path={moe}")[SWITCH]
    assert "override_transformer_config.moe_grouped_gemm=false (grouped-GEMM experts" in message
    assert "--allow-unaligned-trainer" in message
    assert _all_problems("reinforce_zero", f"actor_rollout_ref.model.path={moe}",
                         "++actor_rollout_ref.actor.megatron.override_transformer_config.moe_grouped_gemm=false") == {}


def test_a_window_counts_unless_the_config_switches_it_off(tmp_path):
    unwindowed = _model(tmp_path / "mistral", architectures=["MistralForCausalLM"], sliding_window=None)
    windowed = _model(tmp_path / "mistral_window", architectures=["MistralForCausalLM"], sliding_window=4096)
    qwen2_off = _model(tmp_path / "qwen2", architectures=["Qwen2ForCausalLM"], sliding_window=4096,
                       use_sliding_window=False)
    qwen2_on = _model(tmp_path / "qwen2_window", architectures=["Qwen2ForCausalLM"], sliding_window=4096,
                      use_sliding_window=True)
    interleaved = _model(tmp_path / "mistral_layers", architectures=["MistralForCausalLM"], sliding_window=4096,
                         layer_types=["sliding_attention", "full_attention"])
    assert _all_problems("reinforce_zero", f"actor_rollout_ref.model.path={unwindowed}") == {}
    assert _all_problems("reinforce_zero", f"actor_rollout_ref.model.path={qwen2_off}") == {}
    # Mistral's every-layer window is covered by both faces; Qwen2's window and per-layer types are not.
    assert _all_problems("reinforce_zero", f"actor_rollout_ref.model.path={windowed}") == {}
    for refused in (qwen2_on, interleaved):
        message = _all_problems("reinforce_zero", f"actor_rollout_ref.model.path={refused}")[SWITCH]
        assert "sliding-window attention" in message


def test_interleaved_windows_count_where_both_faces_follow_layer_types(tmp_path):
    layers = ["sliding_attention", "full_attention"]
    cwm = _model(tmp_path / "cwm", architectures=["CwmForCausalLM"], sliding_window=8192, layer_types=layers)
    odd = _model(tmp_path / "cwm_odd", architectures=["CwmForCausalLM"], sliding_window=8192,
                 layer_types=["chunked_attention", "full_attention"])
    assert _all_problems("reinforce_zero", f"actor_rollout_ref.model.path={cwm}") == {}
    message = _all_problems("reinforce_zero", f"actor_rollout_ref.model.path={odd}")[SWITCH]
    assert "sliding-window attention" in message


def test_without_a_local_checkpoint_or_a_declared_architecture_the_run_is_refused():
    cfg = compose_verl_config(RECIPES, "reinforce_zero", ["actor_rollout_ref.model.path=org/some-hub-model"])
    problems = {p.key: p.message for p in check_config(cfg) if p.fatal}
    assert "cannot tell whether the aligned trainer forward covers the model" in problems["zmrl.architecture"]
    assert "'org/some-hub-model' has no local config.json" in problems["zmrl.architecture"]


def test_the_supported_list_is_the_aligned_forwards_own(monkeypatch):
    from zero_mismatch_plugin.tables import architectures

    assert SWITCH in _all_problems("reinforce_zero", "zmrl.architecture=GemmaForCausalLM")
    monkeypatch.setattr(architectures, "SUPPORTED_ARCHITECTURES",
                        (*architectures.SUPPORTED_ARCHITECTURES, "GemmaForCausalLM"))
    assert _all_problems("reinforce_zero", "zmrl.architecture=GemmaForCausalLM") == {}


def test_the_override_runs_an_uncovered_model_with_a_loud_warning(capsys):
    argv = ["validate-config", "--config-path", str(RECIPES), "--config-name", "reinforce_zero",
            "zmrl.architecture=DeepseekV3ForCausalLM"]
    assert zmrl(argv) == 1
    assert "missing: a path for DeepseekV3ForCausalLM" in capsys.readouterr().err
    assert zmrl([*argv, "--allow-unaligned-trainer"]) == 0
    out = capsys.readouterr().out
    assert f"warning: {SWITCH}: TRAINER NOT ALIGNED" in out and "diff 0 CANNOT hold" in out
    assert "a path for DeepseekV3ForCausalLM" in out  # and it still says what is missing


def test_consistent_numerics_without_the_aligned_switch_is_refused():
    problems = _all_problems("reinforce_zero", f"~{SWITCH}")
    assert "ZMRL_NUMERICS=consistent promises diff 0" in problems[SWITCH]


def test_config_checks_is_the_one_module_both_commands_use():
    cfg = compose_verl_config(RECIPES, "flash_reinforce", [DENSE, "actor_rollout_ref.rollout.n=4"])
    assert recipes.check_recipe(cfg) == check_config(cfg)
    assert set(validate_config(cfg)) | set(recipes.recipe_problems(cfg)) == set(check_config(cfg))


# ----- composing: what Hydra would answer with misleading advice -------------------------------------------


def test_config_path_takes_hydras_forms(tmp_path):
    from zero_mismatch_plugin.tools.config_checks.validate_config import config_directory

    assert config_directory("pkg://zero_mismatch_plugin.tools.recipes") == recipes.RECIPES_DIR
    assert config_directory(f"file://{RECIPES}") == recipes.RECIPES_DIR
    assert config_directory(RECIPES) == recipes.RECIPES_DIR
    with pytest.raises(FileNotFoundError, match="no package 'no_such_pkg' can be imported"):
        config_directory("pkg://no_such_pkg")
    with pytest.raises(FileNotFoundError, match="no such directory"):
        config_directory(f"file://{tmp_path / 'nope'}")


def test_a_misspelt_key_is_matched_segment_by_segment_or_by_its_name_elsewhere():
    from zero_mismatch_plugin.tools.config_checks.validate_config import _close_key

    paths = {"a", "a.policy_loss", "a.policy_loss.loss_mode", "a.ppo_epochs", "b", "b.n", "c", "c.ppo_epochs",
             "env", "env.X"}
    assert _close_key("a.policy_los.loss_mode", paths) == ("'a.policy_loss.loss_mode'", "a")
    assert _close_key("b.ppo_epochs", paths) == ("'a.ppo_epochs' or 'c.ppo_epochs'", "b")
    assert _close_key("b.unrelated", paths) == (None, "b")
    assert _close_key("zzz.n", paths) == ("'b.n'", "")
    assert _close_key("zzz.qqq", paths) == (None, "")


def test_an_override_without_equals_is_named_before_hydra_parses_it():
    from zero_mismatch_plugin.tools.config_checks.validate_config import ConfigComposeError, _without_equals

    _without_equals(["a=1", "~b", "+c=2", "++d.e='x'"])
    with pytest.raises(ConfigComposeError, match=r"override 'trainer.nnodes' has no '='.*\(trainer.nnodes=2\?\)"):
        _without_equals(["trainer.nnodes", "2"])


def test_a_misspelt_override_names_the_key_and_not_hydras_plus(capsys):
    code = zmrl(["validate-config", "--config-path", str(RECIPES), "--config-name", "reinforce_zero", DENSE,
                 "actor_rollout_ref.actor.policy_los.loss_mode=x"])
    err = capsys.readouterr().err
    assert code == 2 and "+actor_rollout_ref" not in err
    assert "did you mean 'actor_rollout_ref.actor.policy_loss.loss_mode'?" in err


def test_a_new_name_in_env_vars_is_told_to_use_double_plus():
    from zero_mismatch_plugin.tools.config_checks.validate_config import ConfigComposeError

    with pytest.raises(ConfigComposeError, match=r"takes new keys: add it with "
                                                 r"\+\+ray_kwargs.ray_init.runtime_env.env_vars.MY_VAR='1'"):
        compose_verl_config(RECIPES, "reinforce_zero", ["ray_kwargs.ray_init.runtime_env.env_vars.MY_VAR='1'"])
    cfg = compose_verl_config(RECIPES, "reinforce_zero", ["++ray_kwargs.ray_init.runtime_env.env_vars.MY_VAR='1'"])
    assert cfg.ray_kwargs.ray_init.runtime_env.env_vars.MY_VAR == "1"


def test_the_config_checks_read_switches_as_the_runtime_does():
    from zero_mismatch_plugin.tables import switches
    from zero_mismatch_plugin.tools.config_checks.values import switch_errors

    env = {"ZMRL_NUMERICS": "consistent", "ZMRL_FSDP_ALIGNED": "true", "ZMRL_ALLOW_PREFIX_CACHING": "",
           "ZMRL_MEGATRON_ALIGNE": "1", "PATH": "/bin"}
    errors = {error.key.rsplit(".", 1)[-1]: error.reason for error in switch_errors(env)}
    assert set(errors) == {"ZMRL_FSDP_ALIGNED", "ZMRL_MEGATRON_ALIGNE"}
    with pytest.raises(switches.SwitchError) as raised:
        switches.flag("ZMRL_FSDP_ALIGNED", env)
    assert errors["ZMRL_FSDP_ALIGNED"] == raised.value.reason
    assert "did you mean ZMRL_MEGATRON_ALIGNED?" in errors["ZMRL_MEGATRON_ALIGNE"]


def test_a_single_plus_adding_a_misspelt_key_is_refused_while_composing():
    from zero_mismatch_plugin.tools.config_checks.validate_config import ConfigComposeError

    with pytest.raises(ConfigComposeError, match=r"adds 'actor_rollout_ref.actor.policy_loss.trust_region_detla', "
                                                 r".*did you mean 'actor_rollout_ref.actor.policy_loss.trust_region_delta'"):
        compose_verl_config(RECIPES, "flash_reinforce", [DENSE, "+actor_rollout_ref.actor.policy_loss.trust_region_detla=0.1"])


def test_tensor_with_expert_parallelism_needs_whole_experts(tmp_path):
    """At TP x EP the aligned MoE layer keeps each expert whole on its rank (expert tensor parallelism
    1); megatron's default, the tensor parallel size, is refused with the setting to change."""
    moe = _model(tmp_path / "moe", architectures=["Qwen3MoeForCausalLM"], num_experts=128)
    layout = (f"actor_rollout_ref.model.path={moe}",
              "++actor_rollout_ref.actor.megatron.override_transformer_config.moe_grouped_gemm=false",
              "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
              "actor_rollout_ref.actor.megatron.sequence_parallel=true",
              "actor_rollout_ref.actor.megatron.expert_model_parallel_size=2",
              "actor_rollout_ref.rollout.tensor_model_parallel_size=2")
    message = _all_problems("reinforce_zero", *layout)[SWITCH]
    assert "expert_tensor_parallel_size null (the tensor parallel size) with tensor_model_parallel_size 2" in message
    assert "set expert_tensor_parallel_size=1" in message
    assert _all_problems("reinforce_zero", *layout, "actor_rollout_ref.actor.megatron.expert_tensor_parallel_size=1") == {}
