"""Inputs of the CPU smoke run: verl's RL parquet layout, a chat template verl's agent loop can
apply, and the digit reward."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.mark.parametrize("text, expected", [("", 0.0), ("  ", 0.0), ("12 34", 1.0), ("a1", 0.5), ("seven", 0.0)])
def test_digit_reward_is_the_share_of_digit_characters(text, expected):
    from zero_mismatch_plugin.integrations.verl.cpu.digit_reward import compute_score

    assert compute_score("zmrl_digits", text, "") == expected


def test_dataset_rows_have_verls_rl_layout(tmp_path):
    import pandas as pd

    from zero_mismatch_plugin.tools.smoke_assets import DATA_SOURCE, build_smoke_dataset

    frame = pd.read_parquet(build_smoke_dataset(tmp_path, count=5))
    assert len(frame) == 5 and set(frame["data_source"]) == {DATA_SOURCE}
    first = frame.iloc[0]
    assert [m["role"] for m in first["prompt"]] == ["user"]
    assert first["prompt"][0]["content"].startswith("question: ")
    assert first["reward_model"]["style"] == "rule"
    assert list(frame["extra_info"].map(lambda e: e["index"])) == list(range(5))


def test_model_tokenizer_formats_a_chat_with_the_generation_prompt(tmp_path):
    from transformers import AutoTokenizer

    from zero_mismatch_plugin.tools.smoke_assets import build_smoke_model

    tokenizer = AutoTokenizer.from_pretrained(str(build_smoke_model(tmp_path / "model")))
    text = tokenizer.apply_chat_template([{"role": "user", "content": "question: two"}],
                                         add_generation_prompt=True, tokenize=False)
    assert text == "question: two answer:"


def test_a_missing_trainer_package_is_named_before_anything_starts(tmp_path, monkeypatch):
    import importlib.util

    from zero_mismatch_plugin.integrations.verl.cpu import launch

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "transfer_queue" else real_find_spec(name, *a))
    with pytest.raises(launch.MissingTrainerPackages, match="pip install TransferQueue"):
        launch.run_smoke(tmp_path, {}, [])
    assert not (tmp_path / "log.txt").exists()


def _assert_gone(pid: int) -> None:
    """``pid`` killed (gone, or a zombie awaiting its reaper) within 5 s."""
    import time

    for _ in range(50):
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return
        if state in ("Z", "X"):
            return
        time.sleep(0.1)
    raise AssertionError(f"the run's process {pid} is still running")


def test_a_finished_run_leaves_no_process_of_its_group_behind(tmp_path):
    """As a TP-2 rollout's vLLM workers outlived main_ppo: a grandchild still running when the run
    exits is killed with the run's group, and the run's exit code is kept."""
    import os

    from zero_mismatch_plugin.integrations.verl.cpu import launch

    pid_file = tmp_path / "grandchild.pid"
    command = ["sh", "-c", f"sleep 300 & echo $! > {pid_file}; exit 4"]
    assert launch.run_in_own_group(command, tmp_path, dict(os.environ), tmp_path / "log.txt", timeout_s=30) == 4
    _assert_gone(int(pid_file.read_text()))


def test_a_run_past_its_time_is_killed_with_every_process_it_started(tmp_path):
    """As verl's Ray cluster stays in the group of the process that started it: a run that hangs
    leaves nothing running behind it (a grandchild here), and the error names its output and
    carries its last lines (a CI machine's temporary directory is gone when the failure is read)."""
    import os
    import time

    from zero_mismatch_plugin.integrations.verl.cpu import launch

    pid_file = tmp_path / "grandchild.pid"
    command = ["sh", "-c", f"sleep 300 & echo $! > {pid_file}; echo started; wait", "recipes run cpu_smoke"]
    started = time.monotonic()
    with pytest.raises(launch.RunTimedOut, match=r"did not finish in 2 s; its processes were killed; its output: "
                                                 r".*log\.txt, which ended:\nstarted$"):
        launch.run_in_own_group(command, tmp_path, dict(os.environ), tmp_path / "log.txt", timeout_s=2)
    assert time.monotonic() - started < 30
    assert (tmp_path / "log.txt").read_text().strip() == "started"
    _assert_gone(int(pid_file.read_text()))
    assert launch.run_in_own_group(["sh", "-c", "exit 3"], tmp_path, dict(os.environ), tmp_path / "log.txt", 10) == 3


def test_smoke_command_launches_verls_trainer_with_the_recipe():
    from zero_mismatch_plugin.integrations.verl.cpu.launch import cpu_environment, smoke_command

    command = smoke_command(["trainer.total_training_steps=2"])
    assert command[1:] == ["-m", "zero_mismatch_plugin.tools.cli", "recipes", "run", "cpu_smoke",
                           "trainer.total_training_steps=2"]
    env = cpu_environment({"VERL_PLATFORM": "nvidia", "PATH": "/bin"})
    assert env["ZMRL_VERL_PLATFORM"] == "cpu" and "VERL_PLATFORM" not in env and env["PATH"] == "/bin"


def test_recipes_run_builds_missing_inputs_and_launches_on_the_cpu_platform(tmp_path, monkeypatch):
    from zero_mismatch_plugin.tools import recipes

    monkeypatch.chdir(tmp_path)
    launched = []
    status = recipes.run_recipe("cpu_smoke", ["trainer.total_training_steps=3"], launcher=lambda command: launched.append(command) or 0,
                                err=lambda text: None)
    assert status == 0 and len(launched) == 1
    command = launched[0]
    # verl resolves its platform before reading the config: the environment comes with the command.
    assert command[:3] == ["env", "-u", "VERL_PLATFORM"] and "ZMRL_VERL_PLATFORM=cpu" in command
    assert command[command.index("-m") + 1] == "verl.trainer.main_ppo" and "--config-name=cpu_smoke" in command
    inputs = tmp_path / recipes.SMOKE_INPUTS_DIR
    assert f"actor_rollout_ref.model.path={inputs / 'model'}" in command
    assert f"data.train_files={inputs / 'data' / 'train.parquet'}" in command
    assert (inputs / "model" / "config.json").exists()
    assert command[-1] == "trainer.total_training_steps=3"


def test_recipes_run_keeps_the_users_model_and_data(tmp_path, monkeypatch):
    from zero_mismatch_plugin.tools import recipes

    monkeypatch.chdir(tmp_path)
    launched = []
    given = ["actor_rollout_ref.model.path=/models/mine", "data.train_files=/data/mine.parquet"]
    assert recipes.run_recipe("cpu_smoke", given, launcher=lambda command: launched.append(command) or 0, err=lambda text: None) == 0
    assert [arg for arg in launched[0] if arg.startswith(("actor_rollout_ref.model.path", "data.train_files"))] == given
    assert not (tmp_path / recipes.SMOKE_INPUTS_DIR).exists()


def test_other_recipes_launch_without_the_cpu_environment():
    from zero_mismatch_plugin.tools import recipes

    command = recipes.launch_command("reinforce_zero", ["x=1"])
    assert command[0] != "env" and not any(arg.startswith("ZMRL_VERL_PLATFORM") for arg in command)


def test_a_dry_run_prints_the_command_and_builds_nothing(tmp_path, monkeypatch, capsys):
    from zero_mismatch_plugin.tools import recipes

    monkeypatch.chdir(tmp_path)
    assert recipes.run_recipe("cpu_smoke", ["trainer.total_training_steps=3"], dry_run=True, err=lambda text: None) == 0
    printed = capsys.readouterr().out
    inputs = tmp_path / recipes.SMOKE_INPUTS_DIR
    # The command names the paths a real run builds the inputs at, but nothing is built.
    assert f"actor_rollout_ref.model.path={inputs / 'model'}" in printed
    assert f"data.train_files={inputs / 'data' / 'train.parquet'}" in printed
    assert not inputs.exists()


ENV = "ray_kwargs.ray_init.runtime_env.env_vars"


def _checked(overrides, recipe="cpu_smoke"):
    from zero_mismatch_plugin.tools.config_checks.alignment import trainer_alignment
    from zero_mismatch_plugin.tools.recipes import check_recipe, compose_recipe

    cfg = compose_recipe(recipe, overrides)
    return trainer_alignment(cfg), check_recipe(cfg)


def test_cpu_smoke_megatron_is_aligned_and_validates_its_fp32_engine_config():
    """verl's own McoreEngineConfig refuses dtype float32; the CPU platform's recipe is validated with
    the platform's config patch, as its workers build it, and an MoE checkpoint is covered."""
    from zero_mismatch_plugin.tools.config_checks.alignment import ALIGNED, TURNED_OFF

    alignment, problems = _checked([], "cpu_smoke_megatron")
    assert alignment.status == ALIGNED and not [p for p in problems if p.fatal], problems
    alignment, _ = _checked([f"{ENV}.ZMRL_MEGATRON_ALIGNED='0'"], "cpu_smoke_megatron")
    assert alignment.status == TURNED_OFF
    alignment, _ = _checked(["zmrl.architecture=Qwen3MoeForCausalLM"], "cpu_smoke_megatron")
    assert alignment.status == ALIGNED, alignment.describe()
    alignment, _ = _checked(["zmrl.architecture=Qwen3MoeForCausalLM",
                             "actor_rollout_ref.actor.megatron.override_transformer_config.moe_grouped_gemm=true"],
                            "cpu_smoke_megatron")
    assert "moe_grouped_gemm=false" in alignment.describe()


def test_cpu_smoke_trainer_is_aligned_through_the_fsdp_switch():
    from zero_mismatch_plugin.tools.config_checks.alignment import ALIGNED

    alignment, problems = _checked([])
    assert alignment.status == ALIGNED and not [p for p in problems if p.fatal]


def test_cpu_smoke_refuses_vllms_batch_invariant_mode_and_unaligned_fsdp_layouts():
    from zero_mismatch_plugin.tools.config_checks.alignment import NOT_ALIGNED, TURNED_OFF

    _, problems = _checked([f"{ENV}.VLLM_BATCH_INVARIANT='1'"])
    assert any(p.fatal and "Triton" in str(p) for p in problems), problems
    alignment, problems = _checked(["actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"])
    assert alignment.status == NOT_ALIGNED and "ulysses_sequence_parallel_size=1" in alignment.describe()
    alignment, problems = _checked([f"{ENV}.ZMRL_FSDP_ALIGNED='0'"])
    assert alignment.status == TURNED_OFF
    assert any(not p.fatal and "ZMRL_FSDP_ALIGNED" in str(p) for p in problems), problems
