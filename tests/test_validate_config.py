"""`zmrl validate-config`: composes as verl does and reports every problem with its key."""

from pathlib import Path

import pytest

from zero_mismatch_plugin.cli import main as zmrl
from zero_mismatch_plugin.validate_config import compose_verl_config, validate_config

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
PLUGIN_TARGET = "zero_mismatch_plugin.verl_adapter.config.ZeroMismatchPolicyLossConfig"


def _problems(name: str, *overrides: str) -> dict[str, str]:
    cfg = compose_verl_config(RECIPES, name, overrides)
    return {p.key: p.message for p in validate_config(cfg) if p.fatal}


@pytest.mark.parametrize("name", ["reinforce_zero", "flash_reinforce"])
def test_recipe_composes_against_installed_verl_and_passes(name, capsys):
    assert _problems(name) == {}
    assert zmrl(["validate-config", "--config-path", str(RECIPES), "--config-name", name]) == 0
    assert "config OK" in capsys.readouterr().out


@pytest.mark.parametrize("name,loss_mode", [("reinforce_zero", "reinforce_zero"), ("flash_reinforce", "flash_reinforce")])
def test_composed_actor_config_carries_the_plugin_config_subclass(name, loss_mode):
    from verl.utils.config import omega_conf_to_dataclass

    from zero_mismatch_plugin.verl_adapter.config import ZeroMismatchPolicyLossConfig

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
    ("+actor_rollout_ref.actor.policy_loss.trust_region_detla=0.1",
     "actor_rollout_ref.actor.policy_loss.trust_region_detla", "unknown key"),
    ("++actor_rollout_ref.actor.policy_loss.trust_region_delta=-1", "actor_rollout_ref.actor.policy_loss",
     "trust_region_delta must be a positive number"),
]


@pytest.mark.parametrize("name", ["reinforce_zero", "flash_reinforce"])
def test_bypass_off_is_accepted_when_verl_passes_mu_to_the_loss(name, monkeypatch):
    from verl.workers.utils import losses

    from zero_mismatch_plugin.verl_adapter import ROLLOUT_LOG_PROBS_MARKER

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
    code = zmrl(["validate-config", "--config-path", str(RECIPES), "--config-name", "flash_reinforce",
                 "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.rollout.top_p=0.5",
                 "algorithm.rollout_correction.bypass_mode=false"])
    out = capsys.readouterr().out
    assert code == 1
    assert "3 error(s)" in out
    for key in ("actor_rollout_ref.rollout.n", "actor_rollout_ref.rollout.top_p", "bypass_mode"):
        assert key in out


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
