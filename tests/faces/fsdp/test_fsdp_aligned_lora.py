"""verl's FSDP actor with a LoRA adapter (lora_rank > 0) through the aligned forward.

The HF checkpoint gets verl's own PEFT adapter (``FSDPEngine._build_lora_module``, rank 8 on every
linear) and verl's FSDP2 wrapping; the aligned forward runs each targeted linear as vLLM's LoRA
linear over the PEFT module's parameters. Checked against a LoRA-enabled vLLM engine serving the
adapter written from the FSDP module (the unmerged sync verl does), against the aligned model face
with the same adapter (gradients), and against verl's own forward (the negative control).
"""

from __future__ import annotations

import types

import pytest
import torch
from test_fsdp_aligned import (_actor_logprobs, _fsdp2_model, _full, _packed, _target_logprob_sum,  # noqa: F401
                               _verl_forward_logprobs, _verl_fsdp_engine, process_group)
from support.vllm_session import MAX_MODEL_LEN, prompts_for

from zero_mismatch_plugin.aligned.lora.names import peft_tensor_name
from zero_mismatch_plugin.aligned.lora.peft import lora_engine_args_for_rank, write_peft_adapter
from zero_mismatch_plugin.aligned.packing import pack
from zero_mismatch_plugin.faces import fsdp as fsdp_aligned
from zero_mismatch_plugin.faces.fsdp import AlignedFSDPForward, UnsupportedFSDPFeature
from zero_mismatch_plugin.integrations.verl import fsdp_engine

LORA_RANK = 8
LORA_ALPHA = 16
ENGINE_LORA = lora_engine_args_for_rank(LORA_RANK)  # verl's rollout: the smallest max_lora_rank holding the rank


def _verl_lora(model, seed=3, **settings):
    """verl's ``_build_lora_module`` on ``model`` (all-linear, rank 8), its A and B then drawn at
    random (PEFT starts B at zero: the adapter would change nothing)."""
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

    model_config = types.SimpleNamespace(lora_adapter_path=None, lora_rank=LORA_RANK, lora_alpha=LORA_ALPHA,
                                         target_modules="all-linear", target_parameters=None, exclude_modules=None)
    model = FSDPEngine._build_lora_module(types.SimpleNamespace(model_config=model_config), model)
    for key, value in settings.items():
        setattr(model.peft_config[fsdp_aligned.PEFT_ADAPTER], key, value)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_" in name:
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))
    return model


def _peft_name(fsdp_name: str) -> str:
    """PEFT's saved name of an FSDP module's LoRA parameter (the adapter name dropped)."""
    return fsdp_name.replace(f".{fsdp_aligned.PEFT_ADAPTER}.", ".")


def _lora_params(model) -> dict:
    return {_peft_name(name): param for name, param in model.named_parameters() if ".lora_" in name}


def _write_adapter(model, adapter_dir):
    """The FSDP module's adapter in PEFT's format, what verl's unmerged sync hands the rollout."""
    lora_config = fsdp_aligned.peft_lora_config(model)
    return write_peft_adapter(adapter_dir, lora_config, {n: _full(p) for n, p in _lora_params(model).items()})


def _rollout(checkpoint, adapter_dir, prompts):
    """(prompt, response, μ) of a LoRA-enabled vLLM engine serving ``adapter_dir``."""
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    from zero_mismatch_plugin.aligned.runtime import engine_args_for, shutdown_engine

    llm = LLM(**engine_args_for(checkpoint, max_model_len=MAX_MODEL_LEN, seed=0, **ENGINE_LORA))
    try:
        params = [SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, logprobs=0, seed=i)
                  for i in range(len(prompts))]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                            lora_request=LoRARequest("actor", 1, str(adapter_dir)), use_tqdm=False)
    finally:
        shutdown_engine(llm)
    rows = []
    for prompt, out in zip(prompts, outs):
        ids = list(out.outputs[0].token_ids)
        rows.append((prompt, ids, torch.tensor([step[t].logprob for t, step in zip(ids, out.outputs[0].logprobs)])))
    return rows


# With gradient checkpointing (verl's default) the backward calls each layer again.
@pytest.mark.parametrize("family,gradient_checkpointing", [("llama", False), ("qwen3", True)])
def test_lora_actor_logprobs_equal_the_lora_engine_and_gradients_reach_the_adapter(
        process_group, checkpoints, engines, family, gradient_checkpointing, tmp_path):
    from zero_mismatch_plugin.faces.aligned_model import AlignedCausalLM

    checkpoint = checkpoints[family]
    model = _fsdp2_model(checkpoint, gradient_checkpointing, prepare=_verl_lora)
    aligned = fsdp_engine.aligned_state(_verl_fsdp_engine(model, checkpoint, lora=True))
    assert aligned.lora_config.scaling == LORA_ALPHA / LORA_RANK
    assert aligned.runtime.vllm_config.lora_config.max_lora_rank == ENGINE_LORA["max_lora_rank"]
    adapter_dir = _write_adapter(model, tmp_path / "adapter")

    engines.pool.make_room()  # room for the engine started here
    rows = _rollout(checkpoint, adapter_dir, prompts_for(checkpoint))
    mu = torch.cat([r[2] for r in rows])
    batch = pack([r[0] for r in rows], [r[1] for r in rows])

    with torch.no_grad():
        old_log_probs = _actor_logprobs(aligned, model, batch)
    assert torch.equal(old_log_probs, mu), (old_log_probs - mu).abs().max().item()
    log_probs = _actor_logprobs(aligned, model, batch)
    assert torch.equal(log_probs, mu), (log_probs - mu).abs().max().item()

    # Negative control: verl's own forward of the same PEFT model is not vLLM's.
    fsdp_aligned.uninstall(model)  # the aligned forward is installed again below
    with torch.no_grad():
        unpatched = _verl_forward_logprobs(model, rows)
    assert not torch.equal(unpatched, mu)
    torch.testing.assert_close(unpatched, mu, rtol=0, atol=1e-3)  # ... though the same model

    # Gradients: on the adapter only, equal to the aligned model face's with the same adapter, bit for bit.
    _target_logprob_sum(aligned.logits(model, _packed(batch)).index_select(0, batch.target_rows), batch).backward()
    reference = AlignedCausalLM.from_pretrained(checkpoint, lora_dir=adapter_dir, **ENGINE_LORA)
    _target_logprob_sum(reference.logits(batch), batch).backward()
    with_grad = {name for name, param in model.named_parameters() if param.grad is not None}
    lora = _lora_params(model)
    assert with_grad == {name for name, param in model.named_parameters() if ".lora_" in name}
    expected = {peft_tensor_name(i, target, which): getattr(pair, f"lora_{which}").grad
                for i, target, pair in reference.lora.pairs() for which in "AB"}
    assert set(expected) == set(lora)
    for name, reference_grad in expected.items():
        gradient = _full(lora[name].grad)
        assert gradient.abs().max() > 0, name
        assert torch.equal(gradient, reference_grad), (name, (gradient - reference_grad).abs().max())

    # After an optimizer step (FSDP2 refills the adapter in place; the engine marks the ops stale)
    # both faces still compute the same logits.
    for optimizer in (torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5),
                      torch.optim.SGD(reference.lora.parameters(), lr=0.5)):
        optimizer.step()
        optimizer.zero_grad()
    aligned.mark_stale()
    with torch.no_grad():
        stepped = aligned.logits(model, _packed(batch)).index_select(0, batch.target_rows)
        assert torch.equal(stepped, reference.logits(batch))
        assert not torch.equal(_actor_logprobs(aligned, model, batch), mu), "the step changed the adapter"


@pytest.mark.parametrize("settings,fix", [
    (dict(lora_dropout=0.05), "lora_dropout=0"),
    (dict(use_dora=True), "use_dora=false"),
    (dict(modules_to_save=["lm_head"]), "modules_to_save=null"),
])
def test_lora_settings_vllm_does_not_serve_are_refused(checkpoints, settings, fix):
    from transformers import AutoModelForCausalLM

    model = _verl_lora(AutoModelForCausalLM.from_pretrained(str(checkpoints["llama"])), **settings)
    with pytest.raises(UnsupportedFSDPFeature, match=fix) as error:
        fsdp_aligned.peft_lora_config(model)
    assert fsdp_engine.ENABLE_ENV in str(error.value)


def test_lora_on_moe_layers_is_refused_naming_the_switch(checkpoints):
    from transformers import AutoConfig

    from zero_mismatch_plugin.aligned.lora.peft import LoRAConfig

    config = AutoConfig.from_pretrained(str(checkpoints["qwen3_moe"]))
    lora_config = LoRAConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, targets=("q_proj",))
    with pytest.raises(NotImplementedError, match=f"Mixture-of-Experts.*{fsdp_engine.ENABLE_ENV}=0"):
        AlignedFSDPForward(runtime=None, hf_config=config, lora_config=lora_config)


def _fsdp_lora_config(checkpoint, **model):
    """A verl config of an FSDP actor with the aligned switch and a rank-8 adapter (verl's defaults:
    all-linear, unmerged sync)."""
    from omegaconf import OmegaConf

    return OmegaConf.create({
        "actor_rollout_ref": {"actor": {"strategy": "fsdp2"},
                              "model": {"path": str(checkpoint), "lora_rank": LORA_RANK, "target_modules": "all-linear",
                                        "lora": {"rank": 0, "merge": False}, **model}},
        "ray_kwargs": {"ray_init": {"runtime_env": {"env_vars": {fsdp_engine.ENABLE_ENV: "1"}}}},
    })


def test_config_check_accepts_fsdp_lora_on_dense_decoders_and_names_what_it_does_not_cover(checkpoints):
    from omegaconf import OmegaConf

    from zero_mismatch_plugin.tools.config_checks.lora import lora_gaps

    assert lora_gaps(_fsdp_lora_config(checkpoints["llama"])) == []
    (merged,) = lora_gaps(_fsdp_lora_config(checkpoints["llama"], lora={"rank": 0, "merge": True}))
    assert "lora.merge=false" in merged
    (moe,) = lora_gaps(_fsdp_lora_config(checkpoints["qwen3_moe"]))
    assert "Mixture-of-Experts" in moe
    (router,) = lora_gaps(_fsdp_lora_config(checkpoints["llama"], target_modules=["q_proj", "router"]))
    assert router.endswith(": router"), router
    # Without the FSDP switch, in verl's Megatron engine on Megatron-Bridge, LoRA stays a gap (the face's
    # adapter runs on the mbridge builder).
    megatron = _fsdp_lora_config(checkpoints["llama"])
    OmegaConf.update(megatron, "actor_rollout_ref.actor.strategy", "megatron")
    (gap,) = lora_gaps(megatron)
    assert "Megatron-Bridge's PEFT" in gap and "vanilla_mbridge=true" in gap, gap
