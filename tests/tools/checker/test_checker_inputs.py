"""The pre-checks other commands can call: ``faces.precheck`` (a config, a trainer face),
``checker.checkpoint_inputs.precheck_model`` (a checkpoint directory) and the adapter reader's
``malformed_lora_settings``. Configs only, no weights and no engine (the command-line cases are
in ``tests/support/bad_input/cases_cli.py`` and ``cases_checkpoints.py``)."""

from __future__ import annotations

import json
import types

import pytest
from transformers import DeepseekV2Config, LlamaConfig

from zero_mismatch_plugin.aligned.lora.peft import malformed_lora_settings
from zero_mismatch_plugin.faces import precheck
from zero_mismatch_plugin.tables.architectures import TRAINER_FACES, describe
from zero_mismatch_plugin.tools.checker.checkpoint_inputs import config_value_problems, precheck_model
from zero_mismatch_plugin.tools.checker.inputs import CheckerInputError


def _llama(**changes):
    return LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, architectures=["LlamaForCausalLM"], **changes)


def _deepseek_v2(first_k_dense_replace, **routing):
    return DeepseekV2Config(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=512, qk_rope_head_dim=64,
                            qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=4, n_shared_experts=1,
                            num_experts_per_tok=2, moe_intermediate_size=128,
                            first_k_dense_replace=first_k_dense_replace, architectures=["DeepseekV2ForCausalLM"],
                            **routing)


@pytest.mark.parametrize("face", TRAINER_FACES)
def test_precheck_of_a_covered_model_is_describe(face):
    assert precheck(_llama(), face=face) == describe(_llama())


def test_precheck_refuses_moe_with_mla_for_every_face_naming_the_change():
    # transformers' DeepseekV2Config leaves the routing groups unset: refused for every face.
    for face in TRAINER_FACES:
        with pytest.raises(NotImplementedError, match=r"n_group=None, topk_group=None: .*state both in config\.json"):
            precheck(_deepseek_v2(first_k_dense_replace=1), face=face)
    stated = _deepseek_v2(first_k_dense_replace=1, topk_method="greedy", scoring_func="softmax", n_group=1, topk_group=1)
    assert precheck(stated, face="aligned").moe.moe_layers == (1,)
    with pytest.raises(NotImplementedError, match="not supported by the Megatron face: multi-head latent attention"):
        precheck(stated, face="megatron")


def test_precheck_adds_the_megatron_faces_own_refusals():
    dense_mla = _deepseek_v2(first_k_dense_replace=2)
    assert precheck(dense_mla, face="aligned").attention == "mla"
    with pytest.raises(NotImplementedError, match="not supported by the Megatron face: multi-head latent attention"):
        precheck(dense_mla, face="megatron")
    with pytest.raises(NotImplementedError, match="o_proj bias"):
        precheck(_llama(attention_bias=True), face="megatron")
    assert precheck(_llama(attention_bias=True), face="aligned").o_bias


def test_a_linear_attention_hybrid_is_the_aligned_faces_only_naming_the_change(tmp_path):
    """Qwen3-Next: the aligned model covers it (zmrl bisect too); the Megatron face and verl's FSDP
    actor refuse it by name."""
    from types import SimpleNamespace

    from transformers import Qwen3NextConfig

    from zero_mismatch_plugin.faces.fsdp import AlignedFSDPForward
    from zero_mismatch_plugin.tools.checker.commands import _refuse_mla_bisect

    config = Qwen3NextConfig(architectures=["Qwen3NextForCausalLM"], num_hidden_layers=4,
                             layer_types=["linear_attention"] * 3 + ["full_attention"])
    blocks = precheck(config, face="aligned")
    assert blocks.linear_attention.layers == (0, 1, 2) and blocks.norm == "gemma_rms" and blocks.attention_output_gate
    with pytest.raises(NotImplementedError, match=r"Megatron face: linear attention \(gated delta-net\)"):
        precheck(config, face="megatron")
    with pytest.raises(NotImplementedError, match=r"does not cover linear attention \(gated delta-net\)"):
        AlignedFSDPForward(SimpleNamespace(), config)
    _refuse_mla_bisect(tmp_path, blocks)  # bisect runs linear-attention layers
    wrong_heads = Qwen3NextConfig(architectures=["Qwen3NextForCausalLM"], num_hidden_layers=4, linear_key_head_dim=64,
                                  layer_types=["linear_attention"] * 3 + ["full_attention"])
    with pytest.raises(NotImplementedError, match="head dim 128 only"):
        precheck(wrong_heads, face="aligned")


def test_precheck_refuses_an_unknown_face():
    with pytest.raises(ValueError, match="unknown trainer face 'deepspeed'"):
        precheck(_llama(), face="deepspeed")


def test_precheck_model_names_the_directory_the_trainer_and_the_other_face(tmp_path):
    _deepseek_v2(first_k_dense_replace=2).save_pretrained(tmp_path)
    assert precheck_model(tmp_path, "aligned").attention == "mla"
    with pytest.raises(CheckerInputError, match=r"\(--trainer megatron\): .*\. --trainer aligned runs this model"):
        precheck_model(tmp_path, "megatron")


def test_config_value_problems_name_each_field():
    config = json.loads(_llama().to_json_string())
    assert config_value_problems(config) == []
    bad = {**config, "vocab_size": "512", "rms_norm_eps": float("nan"), "mlp_bias": "no", "dtype": "fp33"}
    problems = " | ".join(config_value_problems(bad))
    for part in ('"rms_norm_eps" is NaN', '"vocab_size" must be a positive integer', '"mlp_bias" must be true or false',
                 "\"dtype\": 'fp33' is not a torch dtype name"):
        assert part in problems, problems


def test_malformed_adapter_configs_are_named_and_plain_ones_pass():
    assert malformed_lora_settings({"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}) == []
    assert malformed_lora_settings({"r": 8, "lora_alpha": 16.0, "target_modules": "q_proj", "use_rslora": True}) == []
    assert malformed_lora_settings(["q_proj"]) == [
        "not a JSON object (it holds a list): PEFT writes one object of settings"
    ]
    problems = malformed_lora_settings({"r": 8, "lora_alpha": "16", "target_modules": [1, 2]})
    assert len(problems) == 2 and "lora_alpha='16'" in problems[0] and "target_modules=[1, 2]" in problems[1]
    assert malformed_lora_settings({"r": 8, "lora_alpha": float("inf")}) == ["lora_alpha=inf: give a finite number"]
    assert malformed_lora_settings({"r": 8}) == ["lora_alpha is missing: give the adapter's alpha (a number)"]


def test_validate_checkpoint_runs_every_check_on_a_directory(tmp_path):
    """The one call for another command: a good tiny checkpoint passes, a NaN weight is named."""
    from safetensors.torch import load_file, save_file

    from zero_mismatch_plugin.tools.checker.checkpoint_inputs import validate_checkpoint
    from zero_mismatch_plugin.tools.tiny_models import build_tiny_model

    model = build_tiny_model(tmp_path / "llama", family="llama", num_hidden_layers=1)
    assert validate_checkpoint(model)["architectures"] == ["LlamaForCausalLM"]
    state = load_file(str(model / "model.safetensors"))
    state["model.norm.weight"][3] = float("nan")
    save_file(state, str(model / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckerInputError, match=r"model\.safetensors: non-finite values .* model\.norm\.weight \(1 of 256\)"):
        validate_checkpoint(model)



def test_bisect_on_ranks_refuses_tensor_parallel_groups_vllm_would_not_build(monkeypatch):
    """vLLM builds its tensor-parallel groups from consecutive ranks; a rank whose megatron group is
    other ranks (a non-default rank order) would be compared with another engine rank's shards:
    refused, naming both groups. (Planted: the two groups as one rank would see them.)"""
    import torch
    from megatron.core import parallel_state as megatron_groups
    from vllm.distributed import parallel_state as vllm_groups

    from zero_mismatch_plugin.tools.checker import rank_records

    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 2)
    monkeypatch.setattr(megatron_groups, "get_tensor_model_parallel_group", lambda: "megatron-tp")
    monkeypatch.setattr(vllm_groups, "get_tp_group", lambda: types.SimpleNamespace(ranks=[2, 3]))
    monkeypatch.setattr(torch.distributed, "get_process_group_ranks", lambda group: [0, 2])
    with pytest.raises(RuntimeError, match=r"rank 2: megatron's tensor-parallel ranks \[0, 2\] are not vLLM's \[2, 3\]"):
        rank_records._same_tensor_parallel_ranks()
    monkeypatch.setattr(torch.distributed, "get_process_group_ranks", lambda group: [2, 3])
    rank_records._same_tensor_parallel_ranks()  # the same ranks: nothing to say
