"""Bad config input to `zmrl validate-config` and `zmrl recipes run`: every value the checks read
given the wrong type, null, out of range or removed; unknown recipes; overrides that do not parse;
models and switches the aligned trainer forward does not cover.

Every case runs the command line in-process (``run_cli``). ``zmrl recipes run`` launches verl
only after validation passes; here its launcher is replaced by one that fails the case, so a
case that validated by mistake cannot start a trainer.
"""

from __future__ import annotations

from support import REPO

import atexit
import json
import re
import shutil
import tempfile
from pathlib import Path
from unittest import mock

import pytest

from support.bad_input import error, result, run_cli

from zero_mismatch_plugin.tools.config_checks.values import BOOL, INT, KEYS, MAPPING, NUMBER, STRING, STRING_MAP

RECIPES = str(REPO / "recipes")
# reinforce_zero with a declared dense architecture validates cleanly: each case changes one thing.
DENSE = "zmrl.architecture=Qwen2ForCausalLM"
ENV = "ray_kwargs.ray_init.runtime_env.env_vars"
VALUES_DOC = "zero_mismatch_plugin/tools/config_checks/values.py (KEYS) and docs/recipes.md, 'How the checks read values'"
ALIGNMENT_DOC = "docs/recipes.md, 'Which trainer paths are aligned'"
# A value of another type for each kind (Hydra parses 5 as an int, 'abc' as a string).
WRONG = {INT: "abc", NUMBER: "hot", BOOL: "maybe", STRING: "5", MAPPING: "abc", STRING_MAP: "abc"}


def _no_launch(command):
    raise AssertionError(f"validation passed and verl was launched: {command}")


def validate(*overrides: str, name: str = "reinforce_zero", flags: tuple[str, ...] = ()):
    return run_cli(["validate-config", "--config-path", RECIPES, "--config-name", name, *flags, DENSE, *overrides])


def recipes_run(name: str, *args: str):
    """`zmrl recipes run` without --dry-run, the launcher replaced: only validation can happen."""
    with mock.patch("zero_mismatch_plugin.tools.recipes._launch", _no_launch):
        return run_cli(["recipes", "run", name, *args])


_scratch: list[str] = []


def model_dir(config: dict | str) -> str:
    """A local checkpoint directory holding only ``config.json`` (a dict, or raw text)."""
    if not _scratch:
        _scratch.append(tempfile.mkdtemp(prefix="zmrl-bad-config-"))
        atexit.register(shutil.rmtree, _scratch[0], True)
    directory = Path(tempfile.mkdtemp(dir=_scratch[0]))
    text = config if isinstance(config, str) else json.dumps(config)
    (directory / "config.json").write_text(text, encoding="utf-8")
    return str(directory)


def says(key: str, text: str) -> str:
    return re.escape(f"{key}: ") + text


def validated_ok(res) -> None:
    assert res.code == 0, res.err
    assert "config OK" in res.out or "warning" in res.err + res.out, res.out


def ok_with(text: str):
    def check(res) -> None:
        assert res.code == 0, res.err
        assert text in res.err + res.out, res.err + res.out
    return check


# ----- every key the checks read, given a value of another type --------------------------------------

WRONG_TYPE = [
    error(f"wrong-type-{key.path}", lambda key=key: validate(f"++{key.path}={WRONG[key.kind]}"),
          says(key.path, f"must be {re.escape(key.kind)}"))
    for key in KEYS.values()
] + [
    error("int-key-given-a-fraction", lambda: validate("actor_rollout_ref.rollout.n=1.5"),
          says("actor_rollout_ref.rollout.n", "must be an integer, got float 1.5")),
    error("int-key-given-a-bool", lambda: validate("actor_rollout_ref.rollout.n=true"),
          says("actor_rollout_ref.rollout.n", "must be an integer, got bool True")),
    error("int-key-given-a-list", lambda: validate("data.train_batch_size=[256]"),
          says("data.train_batch_size", "must be an integer, got ListConfig")),
    error("int-key-given-a-whole-float", lambda: validate("trainer.nnodes=2.0"),
          says("trainer.nnodes", "must be an integer, got float 2.0")),
    error("number-key-given-a-bool", lambda: validate("actor_rollout_ref.rollout.temperature=true"),
          says("actor_rollout_ref.rollout.temperature", "must be a finite number, got bool")),
    error("number-key-given-nan", lambda: validate("actor_rollout_ref.rollout.temperature=nan"),
          says("actor_rollout_ref.rollout.temperature", "must be a finite number, got float nan")),
    error("number-key-given-inf", lambda: validate("actor_rollout_ref.rollout.top_p=inf"),
          says("actor_rollout_ref.rollout.top_p", "must be a finite number, got float inf")),
    error("bool-key-given-an-int", lambda: validate("trainer.use_v1=1"),
          says("trainer.use_v1", "must be true or false, got int 1")),
    error("bool-key-given-a-quoted-true", lambda: validate("algorithm.rollout_correction.bypass_mode='true'"),
          says("algorithm.rollout_correction.bypass_mode", "must be true or false, got str 'true'")),
    error("env-var-given-an-int", lambda: validate(f"{ENV}.VLLM_BATCH_INVARIANT=1"),
          says(f"{ENV}.VLLM_BATCH_INVARIANT", r"must be a string \(Ray accepts only strings here; got 1\): quote it")),
    error("env-var-given-a-bool", lambda: validate(f"++{ENV}.ZMRL_ALLOW_PREFIX_CACHING=true"),
          says(f"{ENV}.ZMRL_ALLOW_PREFIX_CACHING", "must be a string")),
    error("section-given-a-scalar", lambda: validate("actor_rollout_ref.rollout=abc"),
          says("actor_rollout_ref.rollout", r"must be a mapping \(it holds 'abc'\)")),
    error("nested-section-given-a-scalar", lambda: validate("trainer.v1=5"),
          says("trainer.v1", r"must be a mapping \(it holds 5\)")),
    error("unresolvable-interpolation", lambda: validate("data.train_batch_size=${data.nope}"),
          says("data.train_batch_size", r"cannot be resolved .*fix the interpolation")),
    error("mandatory-value-left-unset", lambda: validate("actor_rollout_ref.model.path=???"),
          says("actor_rollout_ref.model.path", r"is mandatory \('\?\?\?'\) but has no value")),
    # The same checks guard `zmrl recipes run`, with and without --dry-run.
    error("recipes-run-rollout-n-abc", lambda: recipes_run("reinforce_zero", DENSE, "actor_rollout_ref.rollout.n=abc"),
          says("actor_rollout_ref.rollout.n", "must be an integer, got str 'abc'")),
    error("recipes-run-train-batch-size-abc",
          lambda: recipes_run("reinforce_zero_r1_distill_1_5b_math_lag2", "data.train_batch_size=abc", "--dry-run"),
          says("data.train_batch_size", "must be an integer, got str 'abc'")),
    error("recipes-run-nnodes-abc", lambda: recipes_run("flash_reinforce_qwen2_5_7b_alfworld_lag4", "trainer.nnodes=abc"),
          says("trainer.nnodes", "must be an integer, got str 'abc'")),
    error("recipes-run-temperature-hot",
          lambda: recipes_run("reinforce_zero_qwen3_4b_python_tool_lag64", "actor_rollout_ref.rollout.temperature=hot"),
          says("actor_rollout_ref.rollout.temperature", "must be a finite number, got str 'hot'")),
]

# ----- null -------------------------------------------------------------------------------------------

NULLABLE_OK = {  # null has a meaning verl gives it; the config still validates
    "algorithm.rollout_correction.rollout_is", "algorithm.rollout_correction.rollout_rs",
    "trainer.v1.sampler.max_off_policy_threshold", "actor_rollout_ref.actor.megatron.expert_tensor_parallel_size",
    "actor_rollout_ref.model.hf_config_path",
}
# One key of each kind, and the keys the issue met: null is an error unless verl gives it a meaning.
NULL_IS_AN_ERROR = ("actor_rollout_ref.rollout.n", "data.train_batch_size", "trainer.nnodes",
                    "actor_rollout_ref.rollout.temperature", "actor_rollout_ref.rollout.top_k", "trainer.use_v1",
                    "algorithm.rollout_correction.bypass_mode", "algorithm.adv_estimator", "trainer.v1.trainer_mode",
                    "actor_rollout_ref.actor.policy_loss", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size",
                    "actor_rollout_ref.model.path")
NULL = [
    error(f"null-{path}", lambda path=path: validate(f"++{path}=null"),
          says(path, f"must be {re.escape(KEYS[path].kind)}, got null"))
    for path in NULL_IS_AN_ERROR
] + [
    result(f"null-means-verls-default-{path}", lambda path=path: validate(f"++{path}=null"), validated_ok, VALUES_DOC)
    for path in sorted(NULLABLE_OK)
] + [
    result("null-env-vars-means-no-variables", lambda: validate(f"{ENV}=null"), validated_ok, VALUES_DOC),
    error("null-architecture-with-a-hub-model", lambda: validate("zmrl.architecture=null"),
          says("zmrl.architecture", "cannot tell whether the aligned trainer forward covers the model")),
]

# ----- out of range -------------------------------------------------------------------------------------

OUT_OF_RANGE = [
    error(f"range-{path}={value}", lambda path=path, value=value: validate(f"++{path}={value}"), says(path, expected))
    for path, value, expected in [
        ("actor_rollout_ref.rollout.n", 0, r"must be at least 1 \(got 0\)"),
        ("actor_rollout_ref.rollout.n", -1, r"must be at least 1 \(got -1\)"),
        ("data.train_batch_size", 0, "must be at least 1"),
        ("actor_rollout_ref.actor.ppo_mini_batch_size", 0, "must be at least 1"),
        ("actor_rollout_ref.actor.ppo_epochs", 0, "must be at least 1"),
        ("trainer.nnodes", 0, "must be at least 1"),
        ("trainer.n_gpus_per_node", 0, "must be at least 1"),
        ("actor_rollout_ref.rollout.n_gpus_per_node", 0, "must be at least 1"),
        ("actor_rollout_ref.rollout.nnodes", -1, "must be at least 0"),
        ("actor_rollout_ref.rollout.tensor_model_parallel_size", 0, "must be at least 1"),
        ("actor_rollout_ref.actor.megatron.tensor_model_parallel_size", 0, "must be at least 1"),
        ("actor_rollout_ref.actor.megatron.context_parallel_size", -2, "must be at least 1"),
        ("actor_rollout_ref.rollout.temperature", 0, r"must be greater than 0.0 \(got 0\)"),
        ("actor_rollout_ref.rollout.temperature", -1.0, "must be greater than 0.0"),
        ("actor_rollout_ref.rollout.top_p", 0, "must be greater than 0.0"),
        ("actor_rollout_ref.rollout.top_p", 1.5, r"must be at most 1.0 \(got 1.5\)"),
        ("actor_rollout_ref.rollout.top_k", -5, "must be at least -1"),
        ("trainer.v1.sampler.max_off_policy_threshold", 0, "must be at least 1"),
        ("trainer.v1.separate_async.parameter_sync_step", 0, "must be at least 1"),
        ("data.max_prompt_length", 0, "must be at least 1"),
        ("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", 0, "must be at least 1"),
        ("actor_rollout_ref.model.lora.rank", -1, "must be at least 0"),
        ("trainer.v1.trainer_mode", "async", "must be one of sync, colocate_async, separate_async"),
    ]
] + [
    error("reinforce-zero-with-one-rollout-per-prompt", lambda: validate("actor_rollout_ref.rollout.n=1"),
          says("actor_rollout_ref.rollout.n", "must be at least 2 with reinforce_zero .*use flash_reinforce")),
    error("recipes-run-reinforce-zero-with-one-rollout",
          lambda: recipes_run("reinforce_zero_r1_distill_1_5b_math_lag8", "actor_rollout_ref.rollout.n=1"),
          says("actor_rollout_ref.rollout.n", "must be at least 2 with reinforce_zero .*use flash_reinforce")),
    error("layout-with-fewer-gpus-than-one-model-replica",
          lambda: validate("actor_rollout_ref.actor.megatron.tensor_model_parallel_size=16"),
          says("actor_rollout_ref.actor.megatron", "8 training GPUs are fewer than TP 16")),
]

# ----- keys removed ---------------------------------------------------------------------------------------

MISSING = [
    error(f"missing-{path}", lambda path=path: validate(f"~{path}"), says(path, "is required: set it to"))
    for path in ("data.train_batch_size", "actor_rollout_ref.actor.ppo_mini_batch_size",
                 "actor_rollout_ref.model.path", "data.max_response_length")
] + [
    result("missing-policy-loss-falls-back-to-verls-loss", lambda: validate("~actor_rollout_ref.actor.policy_loss"),
           ok_with("reinforce_zero advantages with the vanilla loss is neither paper's algorithm"),
           "zero_mismatch_plugin/tools/config_checks/algorithms.py (algorithm_problems) and docs/recipes.md"),
    result("missing-nnodes-takes-verls-default", lambda: validate("~trainer.nnodes"), validated_ok, VALUES_DOC),
    result("missing-temperature-takes-verls-default", lambda: validate("~actor_rollout_ref.rollout.temperature"),
           validated_ok, VALUES_DOC),
]

# ----- recipes, paths and override syntax ----------------------------------------------------------------

COMMAND_LINE = [
    error(f"unknown-recipe-{command}-{name or 'empty'}",
          lambda command=command, name=name: run_cli(["recipes", command, name, "--dry-run"] if command == "run"
                                                     else ["recipes", command, name]),
          r"no recipe named .*available: ")
    for command in ("run", "show")
    for name in ("no_such_recipe", "", "zm_numerics/consistent", "../validate_config", "reinforce_zero.yaml")
] + [
    error("override-without-equals", lambda: validate("actor_rollout_ref.rollout.n"),
          r"cannot compose 'reinforce_zero' .*override 'actor_rollout_ref.rollout.n' has no '=': an override is "
          r"key=value \(or ~key to remove a key\)"),
    error("override-with-unclosed-list", lambda: validate("actor_rollout_ref.rollout.n=[1,"),
          r"cannot compose 'reinforce_zero' .*no viable alternative at input '\[1,'"),
    error("override-of-a-key-that-does-not-exist", lambda: validate("actor_rollout_ref.rollout.no_such_key=1"),
          r"cannot compose 'reinforce_zero' .*no_such_key"),
    error("append-to-an-existing-key", lambda: validate("+data.train_batch_size=5"),
          r"cannot compose 'reinforce_zero' .*train_batch_size"),
    error("override-with-an-empty-key", lambda: validate("=5"), r"cannot compose 'reinforce_zero'"),
    error("recipes-run-override-that-does-not-parse",
          lambda: recipes_run("flash_reinforce", "actor_rollout_ref.rollout.n=[1,"), r"cannot compose recipe 'flash_reinforce'"),
    error("config-path-that-does-not-exist",
          lambda: run_cli(["validate-config", "--config-path", "/no/such/dir", "--config-name", "x"]),
          "no such directory"),
    error("config-path-that-is-a-file",
          lambda: run_cli(["validate-config", "--config-path", __file__, "--config-name", "x"]), "no such directory"),
    error("config-name-that-does-not-exist",
          lambda: run_cli(["validate-config", "--config-path", RECIPES, "--config-name", "no_such_config"]),
          r"cannot compose 'no_such_config'"),
    error("validate-config-without-config-name",
          lambda: run_cli(["validate-config", "--config-path", RECIPES]), "the following arguments are required"),
]

# ----- what Hydra's own answers would mislead: misspelt keys, paths, names, misplaced flags -------------------

NO_PLUS_ADVICE = r"(?s)^(?!.*use \+)"  # Hydra's "To append to your config use +key=value" adds the misspelt key


def dry_run_printed(*expected_overrides: str):
    def check(res) -> None:
        assert res.code == 0, res.err
        command = res.out.strip().splitlines()[-1]
        assert "verl.trainer.main_ppo" in command, res.out
        positions = [command.index(override) for override in expected_overrides]
        assert positions == sorted(positions), command
    return check


def _read_only_folder() -> str | None:
    """A folder this process cannot create anything in: a 0o555 directory, or /sys where the tests
    run as root (which ignores permission bits); None if there is none."""
    import os

    candidate = tempfile.mkdtemp(prefix="zmrl-read-only-")
    os.chmod(candidate, 0o555)
    atexit.register(shutil.rmtree, candidate, True)
    for folder in (candidate, "/sys"):
        probe = Path(folder) / "zmrl-write-probe"
        try:
            probe.mkdir()
        except OSError:
            return folder
        probe.rmdir()
    return None


READ_ONLY = _read_only_folder()
NEEDS_READ_ONLY = (pytest.mark.skipif(READ_ONLY is None, reason="no folder this process cannot write"),)


def in_folder(folder: str | None, run):
    def call():
        import os

        before = os.getcwd()
        os.chdir(folder)
        try:
            return run()
        finally:
            os.chdir(before)
    return call


def writable_folder(name: str) -> str:
    if not _scratch:
        model_dir({})
    path = Path(_scratch[0]) / name
    path.mkdir(exist_ok=True)
    return str(path)


def a_file_path() -> str:
    if not _scratch:
        model_dir({})
    path = Path(_scratch[0]) / "a-file"
    path.write_text("x\n")
    return str(path)


MISLEADING = [
    # A misspelt key: Hydra advises +key=value, which then validates ("config OK") with the typo unread.
    error("override-of-a-misspelt-section",
          lambda: validate("actor_rollout_ref.actor.policy_los.loss_mode=x"),
          NO_PLUS_ADVICE + r".*did you mean 'actor_rollout_ref\.actor\.policy_loss\.loss_mode'\?"),
    error("override-of-a-misspelt-leaf", lambda: validate("trainer.nodes=2"),
          NO_PLUS_ADVICE + r".*no key 'trainer\.nodes'; did you mean 'trainer\.nnodes'\?"),
    error("two-misspelt-overrides-both-named",
          lambda: validate("actor_rollout_ref.rolout.n=2", "data.train_batch_sise=8"),
          NO_PLUS_ADVICE + r".*did you mean 'actor_rollout_ref\.rollout\.n'\?.*did you mean 'data\.train_batch_size'\?"),
    error("override-of-a-key-in-the-wrong-section", lambda: validate("actor_rollout_ref.rollout.ppo_epochs=2"),
          NO_PLUS_ADVICE + r".*did you mean 'actor_rollout_ref\.actor\.ppo_epochs'"),
    error("removal-of-a-misspelt-key", lambda: validate("~actor_rollout_ref.rollout.temprature"),
          r"cannot remove 'actor_rollout_ref\.rollout\.temprature'.*did you mean 'actor_rollout_ref\.rollout\.temperature'"),
    error("hydras-plus-advice-followed", lambda: validate("+actor_rollout_ref.actor.policy_los.loss_mode=x"),
          r"adds 'actor_rollout_ref\.actor\.policy_los\.loss_mode', which verl's config does not define, so nothing "
          r"reads it; did you mean 'actor_rollout_ref\.actor\.policy_loss\.loss_mode'\?"),
    error("recipes-run-misspelt-key", lambda: recipes_run("reinforce_zero", DENSE, "trainer.nnode=2", "--dry-run"),
          NO_PLUS_ADVICE + r".*cannot compose recipe 'reinforce_zero'.*did you mean 'trainer\.nnodes'\?"),
    # The form `zmrl recipes list` prints the recipes in (Hydra's own): accepted wherever a config path is.
    result("config-path-pkg-as-recipes-list-prints-it",
           lambda: run_cli(["validate-config", "--config-path", "pkg://zero_mismatch_plugin.tools.recipes",
                            "--config-name", "reinforce_zero", DENSE]), validated_ok, "docs/recipes.md"),
    result("config-path-file-url", lambda: run_cli(["validate-config", "--config-path", f"file://{RECIPES}",
                                                    "--config-name", "reinforce_zero", DENSE]),
           validated_ok, "docs/recipes.md"),
    error("config-path-pkg-of-no-package",
          lambda: run_cli(["validate-config", "--config-path", "pkg://no_such_package.recipes", "--config-name", "x"]),
          r"--config-path pkg://no_such_package.recipes: no package 'no_such_package.recipes' can be imported"),
    error("config-name-misspelt", lambda: run_cli(["validate-config", "--config-path", RECIPES,
                                                   "--config-name", "reinforce_zro"]),
          r"no config 'reinforce_zro' in .*recipes \(no reinforce_zro.yaml there\): did you mean 'reinforce_zero'"),
    error("recipe-name-misspelt", lambda: run_cli(["recipes", "show", "flash_reinforse"]),
          r"no recipe named 'flash_reinforse'; did you mean 'flash_reinforce'"),
    error("override-with-a-space-instead-of-equals", lambda: validate("trainer.nnodes", "2"),
          r"override 'trainer.nnodes' has no '='.*\(trainer.nnodes=2\?\)"),
    # Flags after the recipe name and its overrides: overrides are taken wherever they stand.
    result("recipes-run-override-after-dry-run",
           lambda: recipes_run("reinforce_zero", "--dry-run", DENSE, "trainer.nnodes=1"),
           dry_run_printed(DENSE, "trainer.nnodes=1"), "docs/recipes.md"),
    result("recipes-run-overrides-around-dry-run",
           lambda: recipes_run("reinforce_zero", DENSE, "--dry-run", "trainer.nnodes=1"),
           dry_run_printed(DENSE, "trainer.nnodes=1"), "docs/recipes.md"),
    error("validate-config-override-after-config-name-is-read",
          lambda: run_cli(["validate-config", "--config-path", RECIPES, DENSE, "--config-name", "reinforce_zero",
                           "actor_rollout_ref.rollout.n=1"]),
          says("actor_rollout_ref.rollout.n", "must be at least 2 with reinforce_zero")),
    error("recipes-show-given-dry-run", lambda: run_cli(["recipes", "show", "reinforce_zero", "--dry-run"]),
          r"--dry-run is an option of `zmrl recipes run`, not of `zmrl recipes show`"),
    error("recipes-run-flag-misspelt", lambda: recipes_run("reinforce_zero", DENSE, "--dryrun"),
          r"--dryrun: did you mean --dry-run\?"),
    error("recipes-run-given-a-config-path", lambda: recipes_run("reinforce_zero", DENSE, "--config-path", RECIPES),
          r"--config-path is an option of `zmrl validate-config`, not of `zmrl recipes run`"),
    # The CPU run writes its inputs and verl's Hydra run directory: refused before anything is built.
    error("cpu-smoke-in-a-read-only-folder", in_folder(READ_ONLY, lambda: recipes_run("cpu_smoke")),
          r"the CPU run builds its tiny model and data set in .*zmrl-cpu-smoke-inputs, which cannot be written .*"
          r"move it with zmrl\.smoke_inputs=DIR", marks=NEEDS_READ_ONLY),
    error("cpu-smoke-own-inputs-in-a-read-only-folder",
          in_folder(READ_ONLY, lambda: recipes_run("cpu_smoke", "actor_rollout_ref.model.path=/models/mine",
                                                   "data.train_files=/data/mine.parquet")),
          r"Hydra run directory .* in the working directory .*, which cannot be written .*hydra\.run\.dir=DIR",
          marks=NEEDS_READ_ONLY),
    error("cpu-smoke-inputs-under-a-file",
          lambda: recipes_run("cpu_smoke", f"zmrl.smoke_inputs={a_file_path()}/inputs",
                              f"hydra.run.dir={writable_folder('hydra-run')}"),
          r"builds its tiny model and data set in .*a-file/inputs, which cannot be written"),
]

# ----- the trainer side: what the aligned forward covers --------------------------------------------------

MOE_CONFIG = {"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 128}
ALIGNMENT = [
    error("declared-moe-architecture", lambda: validate("zmrl.architecture=Qwen3MoeForCausalLM"),
          says(f"{ENV}.ZMRL_MEGATRON_ALIGNED", r"the aligned trainer forward does not cover this run.*"
                                               r"missing: \+\+actor_rollout_ref.actor.megatron.override_transformer_config"
                                               r".moe_grouped_gemm=false \(grouped-GEMM experts")),
    error("local-moe-checkpoint", lambda: validate(f"actor_rollout_ref.model.path={model_dir(MOE_CONFIG)}"),
          r"missing: \+\+actor_rollout_ref.actor.megatron.override_transformer_config.moe_grouped_gemm=false"),
    error("local-qwen2-with-sliding-window",
          lambda: validate("actor_rollout_ref.model.path=" + model_dir(
              {"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True, "sliding_window": 4096})),
          r"missing: sliding-window attention"),
    # A supported architecture with a setting the trainer face does not build: describe()'s refusal,
    # as zmrl check gives it (before, validate-config read "OK" and the run failed in the trainer).
    error("local-llama-with-mlp-bias",
          lambda: validate("actor_rollout_ref.model.path=" + model_dir(
              {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "mlp_bias": True})),
          r"missing: .*LlamaForCausalLM: not supported by the aligned trainer forward: mlp_bias: set it to false"),
    error("local-llama-with-a-sliding-window",
          lambda: validate("actor_rollout_ref.model.path=" + model_dir(
              {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "sliding_window": 64})),
          r"missing: .*LlamaForCausalLM: not supported by the aligned trainer forward: .*window"),
    error("local-config-json-that-is-not-json",
          lambda: validate(f"actor_rollout_ref.model.path={model_dir('{not json')}"),
          says("actor_rollout_ref.model.path", r".*config.json is not a readable model config")),
    error("local-config-json-that-is-a-list", lambda: validate(f"actor_rollout_ref.model.path={model_dir('[1, 2]')}"),
          says("actor_rollout_ref.model.path", r".*config.json is not a readable model config")),
    error("local-config-json-without-architectures",
          lambda: validate(f"actor_rollout_ref.model.path={model_dir({'model_type': 'llama'})}"),
          says("actor_rollout_ref.model.path", r".*names no architecture")),
    error("hf-config-path-to-a-moe-checkpoint",
          lambda: validate(f"actor_rollout_ref.model.hf_config_path={model_dir(MOE_CONFIG)}"),
          r"missing: \+\+actor_rollout_ref.actor.megatron.override_transformer_config.moe_grouped_gemm=false"),
    error("aligned-switch-not-a-0-or-1", lambda: validate(f"{ENV}.ZMRL_MEGATRON_ALIGNED=yes"),
          says(f"{ENV}.ZMRL_MEGATRON_ALIGNED", r"is 'yes', but must be '1' \(aligned trainer forward .*\) or '0'")),
    error("consistent-numerics-without-the-aligned-switch", lambda: validate(f"~{ENV}.ZMRL_MEGATRON_ALIGNED"),
          says(f"{ENV}.ZMRL_MEGATRON_ALIGNED", "ZMRL_NUMERICS=consistent promises diff 0")),
    error("numerics-switch-misspelt", lambda: validate(f"{ENV}.ZMRL_NUMERICS=consistant"),
          says(f"{ENV}.ZMRL_NUMERICS", r"is 'consistant', but must be 'consistent' \(.*\) or 'fast'")),
    error("aligned-forward-on-fsdp", lambda: validate("actor_rollout_ref.actor.strategy=fsdp"),
          r"missing: verl's Megatron engine \(actor strategy is 'fsdp'"),
    error("aligned-forward-with-tensor-parallelism",
          lambda: validate("actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"),
          r"missing: rollout tensor parallelism 1 with trainer "
          r"tensor parallelism 2 .*set actor_rollout_ref.rollout.tensor_model_parallel_size and "
          r"actor_rollout_ref.actor.megatron.tensor_model_parallel_size equal"),
    error("aligned-forward-with-lora", lambda: validate("actor_rollout_ref.model.lora.rank=8"),
          r"missing: LoRA adapters \(rank 8\)"),
    error("aligned-forward-with-fused-kernels", lambda: validate("actor_rollout_ref.model.use_fused_kernels=true"),
          r"actor_rollout_ref.model.use_fused_kernels=false"),
    error("aligned-forward-with-rollout-tp2", lambda: validate("actor_rollout_ref.rollout.tensor_model_parallel_size=2"),
          r"rollout tensor parallelism 2"),
    # The MoE recipe on verl's Megatron engine (its own recipe trains aligned on the FSDP engine).
    error("flagship-moe-recipe-run-on-megatron",
          lambda: recipes_run("reinforce_zero_qwen3_30b_a3b_python_tool_lag8", "zm_engine=megatron"),
          r"moe_grouped_gemm=false \(grouped-GEMM experts.*--allow-unaligned-trainer"),
    result("flagship-moe-recipe-validated-with-the-override",
           lambda: recipes_run("deepseek_v4_1_flash_dapo_math_sync", "--dry-run", "--allow-unaligned-trainer"),
           ok_with("TRAINER NOT ALIGNED"), ALIGNMENT_DOC),
    result("unaligned-override-on-validate-config",
           lambda: validate("zmrl.architecture=Qwen3MoeForCausalLM", flags=("--allow-unaligned-trainer",)),
           ok_with("diff 0 CANNOT hold"), ALIGNMENT_DOC),
]

CASES = WRONG_TYPE + NULL + OUT_OF_RANGE + MISSING + COMMAND_LINE + MISLEADING + ALIGNMENT
