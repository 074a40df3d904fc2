"""LoRA settings the aligned path refuses (adapter configs) and the LoRA part of a verl config's
alignment check. No engine, no model."""

from __future__ import annotations

from omegaconf import OmegaConf

from zero_mismatch_plugin.aligned.lora import unsupported_lora_settings
from zero_mismatch_plugin.config_checks.alignment import _lora_gaps, lora_targets

DENSE = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def test_plain_lora_on_every_dense_linear_is_accepted():
    assert unsupported_lora_settings(dict(peft_type="LORA", r=8, lora_alpha=16, target_modules=DENSE)) == []
    assert unsupported_lora_settings(dict(r=32, lora_alpha=16, use_rslora=True, target_modules="q_proj")) == []


def test_each_unsupported_setting_is_named_with_its_fix():
    cases = {
        "use_dora": dict(use_dora=True),
        "bias=": dict(bias="lora_only"),
        "modules_to_save": dict(modules_to_save=["lm_head"]),
        "rank_pattern": dict(rank_pattern={"q_proj": 4}),
        "fan_in_fan_out": dict(fan_in_fan_out=True),
        "layers_to_transform": dict(layers_to_transform=[0]),
        "peft_type": dict(peft_type="IA3"),
        "embed_tokens": dict(target_modules=["q_proj", "embed_tokens"]),
        "experts": dict(target_modules=["experts"]),
        "give the target modules as a list": dict(target_modules=".*proj"),
        "rank must be a positive integer": dict(r=0),
    }
    for needle, change in cases.items():
        problems = unsupported_lora_settings({**dict(r=8, lora_alpha=16, target_modules=DENSE), **change})
        assert len(problems) == 1 and needle in problems[0], (needle, problems)


def _cfg(rank, targets=None):
    lora = {"rank": rank, **({"target_modules": targets} if targets is not None else {})}
    return OmegaConf.create({"actor_rollout_ref": {"model": {"lora": lora, "lora_rank": 0}}})


def test_verl_lora_gap_names_the_face_and_the_uncovered_targets():
    assert _lora_gaps(_cfg(0, DENSE)) == []
    (dense,) = _lora_gaps(_cfg(32, ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]))
    assert "LoRA adapters (rank 32) in verl's Megatron engine" in dense and "outside" not in dense
    kimi = ["linear_q_down_proj", "linear_kv_up_proj", "linear_proj", "linear_fc1", "router"]
    assert lora_targets(_cfg(32, kimi)) == kimi
    (gap,) = _lora_gaps(_cfg(32, kimi))
    assert gap.endswith(": linear_q_down_proj, linear_kv_up_proj, router"), gap
