"""The Megatron face's ranks, for the layout tests: the one-process reference gradients (of the
weights, or of a LoRA adapter), and the adapter merged into a checkpoint (the negative control)."""

from __future__ import annotations



def merged_checkpoint(model_dir, adapter_dir, out):
    """The checkpoint with the adapter merged into its weights (W + s·B·A, PEFT's merge): the
    forward vLLM's LoRA layers do not run."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from zero_mismatch_plugin.aligned.lora.ops import merged_lora_weight

    shutil.copytree(model_dir, out)
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    scaling = config["lora_alpha"] / config["r"]
    adapter = load_file(adapter_dir / "adapter_model.safetensors")
    weights = load_file(out / "model.safetensors")
    for name, lora_a in adapter.items():
        if name.endswith(".lora_A.weight"):
            module = name.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            lora_b = adapter[name.replace(".lora_A.", ".lora_B.")]
            weights[f"{module}.weight"] = merged_lora_weight(weights[f"{module}.weight"], lora_a, lora_b, scaling)
    save_file(weights, out / "model.safetensors")
    return out


def one_process_gradients(runtime, prompts, responses, step) -> dict:
    """Checkpoint name -> gradient of ``sum(c_t * logprob_t)`` (``c`` of ``step``) for every weight,
    on the Megatron face of ``runtime`` in one process."""
    from zero_mismatch_plugin.aligned.packing import pack
    from zero_mismatch_plugin.faces.megatron import convert
    from zero_mismatch_plugin.integrations.megatron.distributed import step_coefficients
    from zero_mismatch_plugin.integrations.megatron.standalone import (build_gpt_model, packed_logits,
                                                                        token_logprobs_from_logits)

    model = build_gpt_model(runtime).train()
    batch = pack(prompts, responses)
    values = token_logprobs_from_logits(packed_logits(model, batch), batch)
    (values * step_coefficients(step, values.numel())).sum().backward()
    return convert.megatron_to_hf({k: p.grad for k, p in model.named_parameters()}, runtime.hf_config)


def one_process_lora_gradients(model_dir, trainer_args: dict, adapter_dir, prompts, responses, step) -> dict:
    """PEFT name -> gradient of ``sum(c_t * logprob_t)`` (``c`` of ``step``) for the adapter's A and B,
    on the Megatron face in one process."""
    from zero_mismatch_plugin.aligned.packing import pack
    from zero_mismatch_plugin.faces.megatron import convert
    from zero_mismatch_plugin.faces.megatron.lora import attach_lora, lora_parameters
    from zero_mismatch_plugin.integrations.megatron.distributed import step_coefficients
    from zero_mismatch_plugin.integrations.megatron.standalone import (MegatronScorer, packed_logits,
                                                                        token_logprobs_from_logits)

    scorer = MegatronScorer.from_model_dir(model_dir, **trainer_args)
    attach_lora(scorer.model, scorer.runtime, adapter_dir)
    batch = pack(prompts, responses)
    coefficients = step_coefficients(step, sum(len(r) for r in responses))
    (token_logprobs_from_logits(packed_logits(scorer.model, batch), batch) * coefficients).sum().backward()
    return convert.megatron_to_peft_lora({n: p.grad for n, p in lora_parameters(scorer.model)},
                                         scorer.runtime.hf_config)


def assert_gradients_close(grads: dict, reference: dict, rel_tol: float) -> float:
    """Every tensor of ``reference`` in ``grads``, with its shape, within ``rel_tol`` (relative
    norm); returns the worst relative difference."""
    assert sorted(grads) == sorted(reference)
    worst = 0.0
    for name, expected in reference.items():
        assert grads[name].shape == expected.shape, name
        rel = ((grads[name] - expected).norm() / expected.norm()).item()
        worst = max(worst, rel)
        assert rel < rel_tol, f"{name}: relative difference {rel:.3g}"
    return worst


def without_vocabulary(adapter_dir, out):
    """A copy of the adapter in ``adapter_dir`` without its embed_tokens / lm_head pairs (its
    decoder pairs the same): the negative control of the vocabulary's adapters."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from zero_mismatch_plugin.aligned.lora.peft import CONFIG_FILE, WEIGHTS_FILE
    from zero_mismatch_plugin.tables.architectures import VOCAB_LORA_TARGETS

    shutil.copytree(adapter_dir, out)
    config = json.loads((out / CONFIG_FILE).read_text())
    config["target_modules"] = [t for t in config["target_modules"] if t not in VOCAB_LORA_TARGETS]
    (out / CONFIG_FILE).write_text(json.dumps(config))
    tensors = load_file(out / WEIGHTS_FILE)
    kept = {name: t for name, t in tensors.items() if not any(f".{v}." in name for v in VOCAB_LORA_TARGETS)}
    assert len(kept) < len(tensors), "the adapter has no vocabulary pairs"
    save_file(kept, out / WEIGHTS_FILE)
    return out
