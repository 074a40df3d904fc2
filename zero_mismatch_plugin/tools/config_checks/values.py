"""Typed reads of a composed verl config, with one policy for absent, null and mistyped values.

Every key a check reads is in :data:`KEYS` with its type and range: absent takes verl's
``ppo_trainer`` default (or is required), null is an error unless verl gives it a meaning, a wrong
type or range is an error naming the key. See docs/recipes.md, "How the checks read values".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

INT = "an integer"
NUMBER = "a finite number"
BOOL = "true or false"
STRING = "a string"
MAPPING = "a mapping"
STRING_MAP = "a mapping of strings to strings"

_REQUIRED = object()
_ABSENT = object()


class ConfigValueError(ValueError):
    """A value a check needs is absent, null, mistyped or out of range; ``key`` names it."""

    def __init__(self, key: str, reason: str):
        super().__init__(f"{key}: {reason}")
        self.key = key
        self.reason = reason


@dataclass(frozen=True)
class Key:
    path: str
    kind: str
    default: Any = _REQUIRED
    nullable: bool = False
    minimum: float | None = None
    maximum: float | None = None
    above: float | None = None  # exclusive lower bound
    choices: tuple[str, ...] = ()
    help: str = ""

    @property
    def required(self) -> bool:
        return self.default is _REQUIRED


A = "actor_rollout_ref.actor"
M = "actor_rollout_ref.actor.megatron"
R = "actor_rollout_ref.rollout"
ENV_VARS_KEY = "ray_kwargs.ray_init.runtime_env.env_vars"
TRAINER_MODES = ("sync", "colocate_async", "separate_async")


def _positive(path: str, default: Any = _REQUIRED, **kw: Any) -> Key:
    return Key(path, INT, default, minimum=1, **kw)


KEYS: dict[str, Key] = {key.path: key for key in (
    # The algorithm.
    Key("algorithm.adv_estimator", STRING, "gae"),
    Key(f"{A}.policy_loss", MAPPING),
    Key(f"{A}.policy_loss.loss_mode", STRING, "vanilla"),
    Key("algorithm.rollout_correction.bypass_mode", BOOL, False),
    Key("algorithm.rollout_correction.rollout_is", STRING, None, nullable=True, help="null: no IS weights"),
    Key("algorithm.rollout_correction.rollout_rs", STRING, None, nullable=True, help="null: no rejection"),
    Key(f"{A}.loss_agg_mode", STRING, "token-mean"),
    _positive(f"{A}.ppo_epochs", 1),
    Key("trainer.use_v1", BOOL, False),
    Key("trainer.v1.trainer_mode", STRING, "sync", choices=TRAINER_MODES),
    _positive("trainer.v1.separate_async.parameter_sync_step", 1),
    Key("trainer.v1.sampler.max_off_policy_threshold", INT, None, nullable=True, minimum=1,
        help="null: no staleness bound"),
    # Sampling.
    _positive(f"{R}.n", 1),
    Key(f"{R}.temperature", NUMBER, 1.0, above=0.0),
    Key(f"{R}.top_p", NUMBER, 1.0, above=0.0, maximum=1.0),
    Key(f"{R}.top_k", INT, -1, minimum=-1),
    Key(f"{R}.calculate_log_probs", BOOL, False),
    Key(f"{R}.enable_prefix_caching", BOOL, True),
    # Batches.
    _positive("data.train_batch_size"),
    _positive(f"{A}.ppo_mini_batch_size"),
    _positive("data.max_prompt_length"),
    _positive("data.max_response_length"),
    Key(f"{A}.use_dynamic_bsz", BOOL, False),
    _positive(f"{A}.ppo_max_token_len_per_gpu", 16384),
    # Training layout.
    _positive("trainer.nnodes", 1),
    _positive("trainer.n_gpus_per_node", 8),
    Key(f"{A}.strategy", STRING, "fsdp"),
    _positive(f"{A}.ulysses_sequence_parallel_size", 1),
    _positive(f"{M}.tensor_model_parallel_size", 1),
    _positive(f"{M}.pipeline_model_parallel_size", 1),
    _positive(f"{M}.context_parallel_size", 1),
    _positive(f"{M}.expert_model_parallel_size", 1),
    _positive(f"{M}.expert_tensor_parallel_size", None, nullable=True, help="null: the tensor parallel size"),
    Key(f"{M}.sequence_parallel", BOOL, True),
    Key(f"{M}.dynamic_context_parallel", BOOL, False),
    Key(f"{M}.use_mbridge", BOOL, True),
    Key(f"{M}.vanilla_mbridge", BOOL, False),
    Key(f"{M}.use_remove_padding", BOOL, True),
    # Absent: what the builder chooses, which for every MoE model both bridges build is grouped GEMM.
    Key(f"{M}.override_transformer_config.moe_grouped_gemm", BOOL, True),
    Key("actor_rollout_ref.hybrid_engine", BOOL, True),
    # Rollout layout.
    Key(f"{R}.nnodes", INT, 0, minimum=0),
    _positive(f"{R}.n_gpus_per_node", 8),
    _positive(f"{R}.tensor_model_parallel_size", 1),
    _positive(f"{R}.data_parallel_size", 1),
    _positive(f"{R}.pipeline_model_parallel_size", 1),
    _positive(f"{R}.expert_parallel_size", 1),
    Key(f"{R}.checkpoint_engine.backend", STRING, "naive"),
    # The model.
    Key("actor_rollout_ref.model.path", STRING),
    Key("actor_rollout_ref.model.hf_config_path", STRING, None, nullable=True, help="null: model.path"),
    Key("actor_rollout_ref.model.use_fused_kernels", BOOL, False),
    Key("actor_rollout_ref.model.lora.rank", INT, 0, minimum=0),
    Key("actor_rollout_ref.model.lora_rank", INT, 0, minimum=0),
    Key("zmrl.architecture", STRING, None, nullable=True,
        help="null: read from the model's config.json when model.path is a local directory"),
    Key("zmrl.platform", STRING, None, nullable=True, choices=("cpu",),
        help="null: verl picks its device; cpu: `zmrl recipes run` launches on verl's CPU platform"),
    Key("zmrl.smoke_inputs", STRING, None, nullable=True,
        help="null: a CPU recipe run builds its tiny model and data set in ./zmrl-cpu-smoke-inputs"),
    # Environment of every Ray worker.
    Key(ENV_VARS_KEY, STRING_MAP, None, nullable=True, help="null: no variables"),
)}


def _lookup(cfg: DictConfig, path: str) -> Any:
    """The raw value at ``path``, or ``_ABSENT``. A scalar where a section is due is an error."""
    parts = path.split(".")
    for depth in range(1, len(parts)):
        section = ".".join(parts[:depth])
        node = _select(cfg, section)
        if node is _ABSENT or node is None:
            return _ABSENT
        if not isinstance(node, DictConfig):
            raise ConfigValueError(section, f"must be {MAPPING} (it holds {node!r}), so {path} cannot be read")
    return _select(cfg, path)


def _select(cfg: DictConfig, path: str) -> Any:
    try:
        return OmegaConf.select(cfg, path, default=_ABSENT, throw_on_missing=True)
    except MissingMandatoryValue:
        raise ConfigValueError(path, "is mandatory ('???') but has no value: set it") from None
    except OmegaConfBaseException as error:
        reason = str(error).splitlines()[0]
        raise ConfigValueError(path, f"cannot be resolved ({reason}): fix the interpolation") from None


def _type_matches(kind: str, value: Any) -> bool:
    if kind == INT:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == NUMBER:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if kind == BOOL:
        return isinstance(value, bool)
    if kind == STRING:
        return isinstance(value, str)
    return isinstance(value, DictConfig)  # MAPPING, STRING_MAP


def _range_error(key: Key, value: Any) -> str | None:
    if key.choices and value not in key.choices:
        return f"must be one of {', '.join(key.choices)} (got {value!r})"
    if key.minimum is not None and value < key.minimum:
        return f"must be at least {key.minimum} (got {value!r})"
    if key.above is not None and value <= key.above:
        return f"must be greater than {key.above} (got {value!r})"
    if key.maximum is not None and value > key.maximum:
        return f"must be at most {key.maximum} (got {value!r})"
    return None


def _string_map_error(key: Key, value: DictConfig) -> ConfigValueError | None:
    for name, item in value.items():
        if not isinstance(item, str):
            return ConfigValueError(f"{key.path}.{name}", f"must be {STRING} (Ray accepts only strings here; "
                                                          f"got {item!r}): quote it, e.g. '{item}'")
    return None


def switch_errors(env: dict[str, str]) -> list[ConfigValueError]:
    """The plugin's switches in Ray's environment that hold a value the runtime refuses (read by the
    same parser, :mod:`zero_mismatch_plugin.tables.switches`), and the ``ZMRL_`` names that are no switch
    (nothing would read them: a misspelt switch stays at its default)."""
    from zero_mismatch_plugin.tables import switches

    errors = []
    for name in env:
        if name in switches.SWITCHES:
            try:
                switches.check(name, env)
            except switches.SwitchError as error:
                errors.append(ConfigValueError(f"{ENV_VARS_KEY}.{name}", error.reason))
    for name, close in switches.undeclared(env):
        hint = (f"did you mean {close}?" if close else
                f"the plugin's switches are {', '.join(switches.SWITCHES)}")
        errors.append(ConfigValueError(f"{ENV_VARS_KEY}.{name}", f"is not a switch of the plugin, so nothing reads "
                                                                 f"it: {hint}"))
    return errors


def checked(key: Key, value: Any) -> Any:
    """``value`` read at ``key``, or :class:`ConfigValueError` saying what to change."""
    result = _checked(key, value)
    if key.path == ENV_VARS_KEY and result:
        errors = switch_errors(result)
        if errors:
            raise errors[0]
    return result


def _checked(key: Key, value: Any) -> Any:
    if value is _ABSENT:
        if key.required:
            raise ConfigValueError(key.path, f"is required: set it to {key.kind}")
        return key.default
    if value is None:
        if key.nullable:
            return None
        raise ConfigValueError(key.path, f"must be {key.kind}, got null")
    if not _type_matches(key.kind, value):
        raise ConfigValueError(key.path, f"must be {key.kind}, got {type(value).__name__} {value!r}")
    if key.kind == STRING_MAP:
        error = _string_map_error(key, value)
        if error:
            raise error
        return {str(name): item for name, item in value.items()}
    problem = _range_error(key, value)
    if problem:
        raise ConfigValueError(key.path, problem)
    return value


def on_cpu_platform(cfg: DictConfig) -> bool:
    """The recipe runs on verl's CPU platform (``zmrl.platform: cpu``)."""
    zmrl = cfg.get("zmrl") if isinstance(cfg, DictConfig) else None
    return zmrl is not None and zmrl.get("platform") == "cpu"


def read(cfg: DictConfig, path: str) -> Any:
    """The value at ``path`` (one of :data:`KEYS`), typed and range-checked, or :class:`ConfigValueError`."""
    key = KEYS[path]
    return checked(key, _lookup(cfg, path))


def value_errors(cfg: DictConfig) -> list[ConfigValueError]:
    """Every listed key that is present but null where not allowed, mistyped or out of range, and
    every plugin switch in Ray's environment that holds a value the runtime refuses (:func:`switch_errors`).

    Absent keys are not reported here: they take their default, and a required one is reported
    by the check that needs it.
    """
    errors = []
    for path in KEYS:
        try:
            raw = _lookup(cfg, path)
            if raw is not _ABSENT:
                value = _checked(KEYS[path], raw)
                found = switch_errors(value) if path == ENV_VARS_KEY and value else []
            else:
                found = []
        except ConfigValueError as error:
            found = [error]
        errors += [error for error in found if all(error.key != seen.key for seen in errors)]
    return errors
