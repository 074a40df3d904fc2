"""LoRA settings the aligned path refuses (adapter configs) and the LoRA part of a verl config's
alignment check. No engine, no model."""

from __future__ import annotations

from omegaconf import OmegaConf

from types import SimpleNamespace

from zero_mismatch_plugin.aligned.lora.names import supported_lora_targets
from zero_mismatch_plugin.aligned.lora.peft import unsupported_lora_settings
from zero_mismatch_plugin.aligned.numerics import CONSISTENT, MODE_ENV
from zero_mismatch_plugin.tools.config_checks import check_config
from zero_mismatch_plugin.tools.config_checks.lora import TARGETS_KEY, lora_gaps, lora_problems, lora_targets

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


def _cfg(rank, targets=None, mode=None, **megatron):
    """A verl config with LoRA ``rank``; with ``megatron`` settings, on verl's Megatron engine."""
    lora = {"rank": rank, **({"target_modules": targets} if targets is not None else {})}
    env = {"ray_kwargs": {"ray_init": {"runtime_env": {"env_vars": {MODE_ENV: mode}}}}} if mode else {}
    engine = {"actor": {"strategy": "megatron", "megatron": megatron}} if megatron else {}
    trainer = {"trainer": {"nnodes": 1, "n_gpus_per_node": megatron.get("tensor_model_parallel_size", 1)}}
    return OmegaConf.create({"actor_rollout_ref": {"model": {"lora": lora, "lora_rank": 0}, **engine}, **trainer, **env})


MBRIDGE = dict(vanilla_mbridge=True, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
               context_parallel_size=1, expert_model_parallel_size=1)
VERL_MEGATRON_TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]


def test_verl_megatron_lora_is_aligned_on_the_mbridge_builder_and_each_gap_says_what_to_set():
    assert lora_gaps(_cfg(0, DENSE)) == []
    assert lora_gaps(_cfg(32, VERL_MEGATRON_TARGETS, **MBRIDGE)) == []
    (bridge,) = lora_gaps(_cfg(32, VERL_MEGATRON_TARGETS, **{**MBRIDGE, "vanilla_mbridge": False}))
    assert "Megatron-Bridge's PEFT" in bridge and "actor_rollout_ref.actor.megatron.vanilla_mbridge=true" in bridge
    merged = _cfg(32, VERL_MEGATRON_TARGETS, **MBRIDGE)
    merged.actor_rollout_ref.model.lora.merge = True
    assert "actor_rollout_ref.model.lora.merge=true" in lora_gaps(merged)[0]
    (tp,) = lora_gaps(_cfg(32, VERL_MEGATRON_TARGETS, **{**MBRIDGE, "tensor_model_parallel_size": 2}))
    assert "tensor parallelism 2 runs with sequence parallelism" in tp
    assert lora_gaps(_cfg(32, VERL_MEGATRON_TARGETS, **{**MBRIDGE, "tensor_model_parallel_size": 2,
                                                        "sequence_parallel": True})) == []
    # An MoE model's adapter (experts included) at TP 2 + SP, and at TP 2 + SP x EP 2.
    moe_tp = {**MBRIDGE, "tensor_model_parallel_size": 2, "sequence_parallel": True}
    moe = _cfg(32, VERL_MEGATRON_TARGETS, **moe_tp)
    moe.actor_rollout_ref.model.path = "Qwen/Qwen3-30B-A3B"  # no local config.json: zmrl.architecture says
    moe.zmrl = {"architecture": "Qwen3MoeForCausalLM"}
    assert lora_gaps(moe) == []
    moe.actor_rollout_ref.actor.megatron.expert_model_parallel_size = 2
    assert lora_gaps(moe) == []
    moe.actor_rollout_ref.actor.megatron.sequence_parallel = False
    (no_sp,) = lora_gaps(moe)
    assert "turn sequence parallelism on" in no_sp
    # The MLA projections: the aligned LoRA path adapts them, the face's adapter in verl does not yet.
    mla = ["linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_proj", "linear_fc1"]
    (gap,) = lora_gaps(_cfg(32, mla, **MBRIDGE))
    assert "outside" not in gap and "target_modules=" in gap
    seed = mla + ["linear_kv_up_proj", "router"]
    assert lora_targets(_cfg(32, seed)) == seed
    (gap,) = lora_gaps(_cfg(32, seed, **MBRIDGE))
    assert gap.endswith(": linear_kv_up_proj, router"), gap


def _mla_config(q_lora_rank):
    return SimpleNamespace(kv_lora_rank=512, q_lora_rank=q_lora_rank)


def test_mla_targets_are_the_projections_vllm_adapts_on_every_token():
    v2 = ["q_proj", "kv_a_proj_with_mqa", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert list(supported_lora_targets(_mla_config(None))) == v2
    v3 = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert list(supported_lora_targets(_mla_config(96))) == v3
    assert list(supported_lora_targets(SimpleNamespace(q_lora_rank=None))) == DENSE  # no latent: dense
    config = dict(r=8, lora_alpha=16)
    assert unsupported_lora_settings({**config, "target_modules": v3}, supported_lora_targets(_mla_config(96))) == []
    # Each refused target alone, with vLLM's reason; a name of the other query form is not covered.
    cases = {"kv_b_proj": "never applies an adapter on kv_b_proj", "gate": "router", "embed_tokens": "embedding_modules",
             "lm_head": "embedding_modules", "q_b_proj": "covers"}
    for target, needle in cases.items():
        problems = unsupported_lora_settings({**config, "target_modules": v2 + [target]}, supported_lora_targets(_mla_config(None)))
        assert len(problems) == 1 and target in problems[0] and needle in problems[0], (target, problems)


def test_consistent_config_with_a_target_vllm_ignores_is_an_error():
    seed = ["linear_q_down_proj", "linear_kv_up_proj", "linear_proj", "router"]
    problems = lora_problems(_cfg(32, seed, mode=CONSISTENT))
    assert [p.key for p in problems] == [TARGETS_KEY] * 2 and all(p.fatal for p in problems)
    assert "linear_kv_up_proj: vLLM never applies an adapter on kv_b_proj" in problems[0].message
    assert problems[1].message.startswith("router: the aligned path adapts no MoE router")
    assert lora_problems(_cfg(32, seed)) == []  # standard numerics: no parity claimed
    assert lora_problems(_cfg(32, seed[:1] + seed[2:3], mode=CONSISTENT)) == []
    # It is one of the checks validate-config runs.
    assert any(p.key == TARGETS_KEY for p in check_config(_cfg(32, seed, mode=CONSISTENT)))


def test_embedding_and_lm_head_targets_are_aligned_only_where_vllm_adapts_them(tmp_path):
    import json

    llama = SimpleNamespace(architectures=["LlamaForCausalLM"], q_lora_rank=None)
    vocab = ["embed_tokens", "lm_head"]
    # The aligned model face (vocab=True) adapts them for Llama; readers of the linears only do not.
    assert list(supported_lora_targets(llama, vocab=True)) == DENSE + vocab
    assert list(supported_lora_targets(llama)) == DENSE
    config = dict(r=8, lora_alpha=16, target_modules=DENSE + vocab)
    assert unsupported_lora_settings(config, supported_lora_targets(llama, vocab=True)) == []
    assert len(unsupported_lora_settings(config, supported_lora_targets(llama))) == 2
    # DeepSeek (MLA): vLLM wraps neither, refused even by the aligned model face.
    mla = SimpleNamespace(architectures=["DeepseekV2ForCausalLM"], kv_lora_rank=512, q_lora_rank=None)
    assert "embed_tokens" not in supported_lora_targets(mla, vocab=True)
    # validate-config: an error under consistent numerics unless the model is one vLLM adapts them for.
    for arch, errors in (("LlamaForCausalLM", []), ("DeepseekV3ForCausalLM", vocab)):
        model = tmp_path / arch
        model.mkdir()
        (model / "config.json").write_text(json.dumps({"architectures": [arch]}))
        cfg = _cfg(32, ["linear_qkv"] + vocab, mode=CONSISTENT)
        cfg.actor_rollout_ref.model.path = str(model)
        assert [p.message.split(":")[0] for p in lora_problems(cfg)] == errors, arch
        assert ("outside" in lora_gaps(cfg)[0]) == bool(errors), arch
    assert [p.message.split(":")[0] for p in lora_problems(_cfg(32, vocab, mode=CONSISTENT))] == vocab  # model unknown
