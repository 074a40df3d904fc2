"""Whether the trainer side of a run is aligned: consistent numerics promise diff 0, which only
the aligned trainer forward keeps, for the models and layouts it covers.

verl's Megatron engine (``ZMRL_MEGATRON_ALIGNED``) and its FSDP engine (``ZMRL_FSDP_ALIGNED``, for
an FSDP actor that sets it) each cover their part of ``architectures.SUPPORTED_ARCHITECTURES``;
what a config lacks is listed as gaps. See docs/recipes.md, "Which trainer paths are aligned".
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from omegaconf import DictConfig

from zero_mismatch_plugin.tables import architectures
from zero_mismatch_plugin.integrations.verl.megatron_engine import ENABLE_ENV
from zero_mismatch_plugin.integrations.verl.fsdp_engine import ENABLE_ENV as FSDP_ENABLE_ENV

from zero_mismatch_plugin.tools.config_checks.cluster import MEGATRON, ROLLOUT, uses_megatron
from zero_mismatch_plugin.tools.config_checks.lora import lora_gaps as _lora_gaps
from zero_mismatch_plugin.tools.config_checks.numerics import env_switch, is_consistent
from zero_mismatch_plugin.tools.config_checks.problems import Problem
from zero_mismatch_plugin.tools.config_checks.trained_model import (
    ARCHITECTURE_KEY, Architecture, model_architecture, uses_fsdp_switch)
from zero_mismatch_plugin.tools.config_checks.values import ENV_VARS_KEY, read

ALIGNED_SWITCH_KEY = f"{ENV_VARS_KEY}.{ENABLE_ENV}"
# Appended by `--allow-unaligned-trainer`: `++` sets the variable whether or not the config has it.
UNALIGNED_OVERRIDE = f"++{ALIGNED_SWITCH_KEY}='0'"
# verl's FSDP engine has its own switch (zero_mismatch_plugin.integrations.verl.fsdp_engine); a config
# that sets it with an FSDP actor is judged by it.
FSDP_SWITCH_KEY = f"{ENV_VARS_KEY}.{FSDP_ENABLE_ENV}"
FSDP_UNALIGNED_OVERRIDE = f"++{FSDP_SWITCH_KEY}='0'"
OVERRIDE_HINT = (f"To train anyway with the trainer unaligned, pass --allow-unaligned-trainer (it adds "
                 f"{UNALIGNED_OVERRIDE}); diff 0 then cannot hold")

STANDARD = "standard kernels"
ALIGNED = "aligned"
NOT_ALIGNED = "NOT aligned"
TURNED_OFF = "NOT aligned (turned off)"
NOT_ENABLED = "NOT aligned (not enabled)"
MODEL_UNKNOWN = "aligned if the model is one of the supported dense decoders (its architecture is not known yet)"


@dataclass(frozen=True)
class TrainerAlignment:
    status: str
    gaps: tuple[str, ...] = ()

    def describe(self) -> str:
        return self.status + (f": missing {'; '.join(self.gaps)}" if self.gaps else "")


def _fsdp_feature_gaps(features: dict) -> list[str]:
    """The model features the FSDP actor's layer forward does not run (fsdp_aligned.AlignedFSDPForward)."""
    gaps = []
    if features.get("multi_latent_attention"):
        gaps.append("multi-head latent attention in verl's FSDP actor")
    if features.get("window_size") is not None:
        gaps.append("sliding-window attention in verl's FSDP actor")
    return gaps


def _architecture_gaps(architecture: Architecture, fsdp: bool) -> list[str]:
    """What keeps the model off the aligned forward of the engine the config trains with (verl's
    FSDP engine when ``fsdp``, else its Megatron engine)."""
    from zero_mismatch_plugin.faces.megatron.spec import unsupported_features

    if architecture.name is None:
        return []
    # Read at call time. MLA and linear-attention checkpoints run aligned only in the package's own aligned model.
    if fsdp:
        gaps = _fsdp_feature_gaps(architecture.features)
        engine = "verl's FSDP engine"
    else:
        gaps = unsupported_features(SimpleNamespace(**architecture.features))
        engine = "verl's Megatron engine"
    not_in_engine = architectures.MLA_ARCHITECTURES + architectures.HYBRID_ARCHITECTURES
    supported = tuple(a for a in architectures.SUPPORTED_ARCHITECTURES if a not in not_in_engine)
    if architecture.name not in supported:
        where = ""
        if architecture.name in not_in_engine:
            where = f"the aligned model face covers it, {engine} does not yet: "
        gaps.insert(0, f"a path for {architecture.name} (from {architecture.source}: {where}the aligned forward "
                       f"in {engine} covers {', '.join(supported)})")
    elif architecture.source.endswith("config.json"):
        gaps += _face_feature_gaps(Path(architecture.source).parent, "aligned" if fsdp else "megatron")
    return gaps


def _face_feature_gaps(model_dir: Path, face: str) -> list[str]:
    """The settings of a supported architecture that the trainer ``face`` does not build: the same
    pre-check ``zmrl check`` runs, on the checkpoint's own config (one transformers cannot read is
    left to the engine's and the checker's own refusals)."""
    from zero_mismatch_plugin.aligned.checkpoint import read_config

    from zero_mismatch_plugin.faces import precheck

    try:
        precheck(read_config(model_dir), face)
    except NotImplementedError as unsupported:
        return [str(unsupported)]
    except (OSError, ValueError, TypeError, KeyError):
        pass
    return []


def switch_key(cfg: DictConfig) -> str:
    return FSDP_SWITCH_KEY if uses_fsdp_switch(cfg) else ALIGNED_SWITCH_KEY


def _fsdp_engine_gaps(cfg: DictConfig) -> list[str]:
    """The FSDP engine settings the aligned forward runs under (fsdp_engine.check_engine_supported)."""
    gaps = []
    for key, wanted in (("actor_rollout_ref.actor.strategy", "fsdp2"),
                        ("actor_rollout_ref.actor.ulysses_sequence_parallel_size", 1),
                        ("actor_rollout_ref.model.use_fused_kernels", False)):
        if read(cfg, key) != wanted:
            gaps.append(f"{key}={str(wanted).lower() if isinstance(wanted, bool) else wanted}")
    return gaps


def _engine_gaps(cfg: DictConfig) -> list[str]:
    """The Megatron engine settings the aligned forward is built into (docs/megatron.md), or the
    FSDP engine's when the config uses that engine's switch."""
    from zero_mismatch_plugin.faces.megatron.spec import unsupported_features

    if uses_fsdp_switch(cfg):
        return _fsdp_engine_gaps(cfg)
    if not uses_megatron(cfg):
        return [f"verl's Megatron engine (actor strategy is {read(cfg, 'actor_rollout_ref.actor.strategy')!r}; "
                "the aligned forward patches that engine): add the zm_engine: megatron group or model_engine=megatron"]
    tp = read(cfg, f"{MEGATRON}.tensor_model_parallel_size")
    layout = SimpleNamespace(tensor_model_parallel_size=tp,
                             pipeline_model_parallel_size=read(cfg, f"{MEGATRON}.pipeline_model_parallel_size"),
                             context_parallel_size=read(cfg, f"{MEGATRON}.context_parallel_size"),
                             sequence_parallel=tp > 1 and read(cfg, f"{MEGATRON}.sequence_parallel"))
    gaps = [f"{feature} in the trainer" for feature in unsupported_features(layout)]
    ep = read(cfg, f"{MEGATRON}.expert_model_parallel_size")
    etp = read(cfg, f"{MEGATRON}.expert_tensor_parallel_size")
    if (tp or 1) > 1 and (ep or 1) > 1 and etp != 1:
        shown = "null (the tensor parallel size)" if etp is None else etp
        gaps.append(f"expert_tensor_parallel_size {shown} with tensor_model_parallel_size {tp} and "
                    f"expert_model_parallel_size {ep}: set "
                    "expert_tensor_parallel_size=1 (each expert whole on its rank, computed as the engine's "
                    "tensor-parallel ranks split it)")
    from zero_mismatch_plugin.integrations.verl.megatron_engine import VERL_UNRUN_LAYOUTS

    for name in VERL_UNRUN_LAYOUTS:  # the layouts the engine patch refuses, named once there
        size = read(cfg, f"{MEGATRON}.{name}")
        if size not in (None, 1):
            gaps.append(f"{name} {size} in verl's Megatron engine (the Megatron face runs it bitwise on its own "
                        "ranks; inside verl's engine it is not run yet)")
    if etp not in (None, 1, tp or 1):
        gaps.append(f"expert_tensor_parallel_size {etp} in the trainer (the aligned MoE layer splits each expert as "
                    f"the engine does, over the {tp or 1} tensor-parallel ranks, or keeps it whole: 1)")
    # Both builders (Megatron-Bridge, and the mbridge backend vanilla_mbridge=true) take the aligned spec.
    for key, wanted in ((f"{MEGATRON}.use_mbridge", True),
                        (f"{MEGATRON}.use_remove_padding", True), ("actor_rollout_ref.model.use_fused_kernels", False)):
        if read(cfg, key) is not wanted:
            gaps.append(f"{key}={str(wanted).lower()}")
    return gaps


def _is_moe(architecture: Architecture) -> bool:
    return bool(architecture.features.get("num_moe_experts")) or architecture.name in architectures.MOE_ARCHITECTURES


def _rollout_gaps(cfg: DictConfig, architecture: Architecture) -> list[str]:
    """The aligned forward reproduces a vLLM replica at the trainer's tensor parallelism (each
    trainer rank computes what the rollout rank of its index computes; verl's FSDP engine runs the
    face at TP 1) and no pipeline parallelism; for a Mixture-of-Experts model that includes vLLM's
    one-process MoE layer (no data or expert parallelism spreading its experts or tokens over
    processes)."""
    gaps = []
    rollout_tp = read(cfg, f"{ROLLOUT}.tensor_model_parallel_size")
    trainer_tp = 1 if uses_fsdp_switch(cfg) or not uses_megatron(cfg) else read(cfg, f"{MEGATRON}.tensor_model_parallel_size") or 1
    if rollout_tp != trainer_tp:
        change = (f"set {ROLLOUT}.tensor_model_parallel_size={trainer_tp}" if trainer_tp == 1 else
                  f"set {ROLLOUT}.tensor_model_parallel_size and {MEGATRON}.tensor_model_parallel_size equal")
        gaps.append(f"rollout tensor parallelism {rollout_tp} with trainer tensor parallelism {trainer_tp} (each "
                    f"trainer rank reproduces the rollout rank of its index: {change})")
    size = read(cfg, f"{ROLLOUT}.pipeline_model_parallel_size")
    if size != 1:
        gaps.append(f"rollout pipeline parallelism {size} (the aligned forward reproduces one pipeline stage)")
    if _is_moe(architecture):
        for key in ("data_parallel_size", "expert_parallel_size"):
            size = read(cfg, f"{ROLLOUT}.{key}")
            if size not in (None, 1):
                gaps.append(f"rollout {key} {size} (vLLM's MoE layer then spans processes; the aligned MoE op is "
                            "its one-process layer)")
    return gaps


def _megatron_moe_gaps(cfg: DictConfig, architecture: Architecture) -> list[str]:
    """The aligned MoE layer runs each expert through vLLM's fused-MoE arithmetic; megatron's
    grouped-GEMM experts (what both bridges choose for an MoE model) are refused by the spec."""
    key = f"{MEGATRON}.override_transformer_config.moe_grouped_gemm"
    if uses_fsdp_switch(cfg) or not uses_megatron(cfg) or not _is_moe(architecture) or read(cfg, key) is False:
        return []
    return [f"++{key}=false (grouped-GEMM experts are not vLLM's fused-MoE arithmetic)"]


def alignment_gaps(cfg: DictConfig, architecture: Architecture) -> list[str]:
    """What the aligned trainer forward lacks to reproduce this config's rollout bit for bit."""
    gaps = (_architecture_gaps(architecture, uses_fsdp_switch(cfg)) + _engine_gaps(cfg) + _lora_gaps(cfg)
            + _megatron_moe_gaps(cfg, architecture))
    return gaps + _rollout_gaps(cfg, architecture)


def aligned_switch(cfg: DictConfig) -> bool | None:
    """The engine's aligned switch: True ("1"), False ("0") or None (unset)."""
    return env_switch(cfg, FSDP_ENABLE_ENV if uses_fsdp_switch(cfg) else ENABLE_ENV)


def trainer_alignment(cfg: DictConfig) -> TrainerAlignment:
    """Whether the trainer's logprobs are vLLM's bits for this config, and if not, what is missing."""
    if not is_consistent(cfg):
        return TrainerAlignment(STANDARD)
    switch = aligned_switch(cfg)
    architecture = model_architecture(cfg)
    gaps = tuple(alignment_gaps(cfg, architecture))
    if switch is False:
        return TrainerAlignment(TURNED_OFF, gaps)
    if switch is not True:
        return TrainerAlignment(NOT_ENABLED, gaps)
    if gaps:
        return TrainerAlignment(NOT_ALIGNED, gaps)
    if architecture.name is None:
        return TrainerAlignment(MODEL_UNKNOWN)
    return TrainerAlignment(ALIGNED)


def _unaligned_warning(gaps: tuple[str, ...], key: str) -> Problem:
    why = f" The aligned forward would also lack: {'; '.join(gaps)}." if gaps else ""
    return Problem(key,
                   "TRAINER NOT ALIGNED: \"0\" runs the trainer on its own kernels while ZMRL_NUMERICS=consistent; "
                   "its logprobs are not vLLM's bits, so diff 0 CANNOT hold (rollout_probs_diff will not read 0, "
                   f"bitwise_equal_fraction will not read 1).{why}", fatal=False)


def _override_hint(cfg: DictConfig) -> str:
    if uses_fsdp_switch(cfg):
        return f"To train anyway with the trainer unaligned, pass {FSDP_UNALIGNED_OVERRIDE}; diff 0 then cannot hold"
    return OVERRIDE_HINT


def alignment_problems(cfg: DictConfig) -> list[Problem]:
    switch = aligned_switch(cfg)  # a value other than "1" / "0" was reported by the value checks already
    alignment = trainer_alignment(cfg)
    if alignment.status == NOT_ENABLED:
        return [Problem(switch_key(cfg), "ZMRL_NUMERICS=consistent promises diff 0, which needs the aligned "
                                            "trainer forward: set it to \"1\" (the zm_numerics: consistent group "
                                            f"does). {_override_hint(cfg)}")]
    if alignment.status == NOT_ALIGNED:
        return [Problem(switch_key(cfg), "the aligned trainer forward does not cover this run, so diff 0 cannot "
                                            f"hold; missing: {'; '.join(alignment.gaps)}. {_override_hint(cfg)}")]
    if alignment.status == MODEL_UNKNOWN:
        return [Problem(ARCHITECTURE_KEY, f"cannot tell whether the aligned trainer forward covers the model: "
                                          f"{model_architecture(cfg).source}. Point model.path at a local "
                                          f"checkpoint, or set ++{ARCHITECTURE_KEY}=<its config.json architectures[0]>")]
    if alignment.status == TURNED_OFF:
        return [_unaligned_warning(alignment.gaps, switch_key(cfg))]
    if alignment.status == STANDARD and switch is True:
        return [Problem(switch_key(cfg), "the aligned trainer forward is on without ZMRL_NUMERICS=consistent: "
                                            "the engine side is not batch-invariant, so parity is not expected",
                        fatal=False)]
    return []
