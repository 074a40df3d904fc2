"""megatron-core GPTModel with the aligned spec vs the live vLLM engine (CPU, gloo, world size 1).

All tests share one engine serving the Llama checkpoint; the weight-sync test goes last because
it changes the weights on both sides.
"""

from __future__ import annotations

import pytest
import torch

from support.vllm_session import MAX_MODEL_LEN, float64_hf_model, hf_token_logprobs
from zero_mismatch_plugin.aligned import pack
from zero_mismatch_plugin.faces.megatron import convert
from zero_mismatch_plugin.integrations.megatron.standalone import (
    build_gpt_model,
    cpu_stock_megatron,
    packed_logits,
    per_sequence_logits,
    token_logprobs_from_logits,
)

# Relative L2 error allowed between the aligned fp32 gradient and the float64 autograd gradient
# (transformers, same weights), per parameter tensor. fp32 round-off over this 2-layer model is
# ~1e-6; a wrong analytic backward or a wrong layout mapping is O(1).
GRAD_REL_TOL = 1e-4


def _aligned_logprobs(model, prompts, responses):
    batch = pack(prompts, responses)
    return token_logprobs_from_logits(packed_logits(model, batch), batch)


def _report(name, logprobs, mu):
    equal = (logprobs == mu).float().mean().item()
    return f"{name}: {equal:.1%} of {mu.numel()} tokens bitwise equal, max |diff| {(logprobs - mu).abs().max().item():.3g}"


@pytest.mark.quick
def test_aligned_megatron_logprobs_bitwise_equal_engine(mg_runtime, mg_rollout):
    prompts, responses, mu = mg_rollout(seed=0)
    assert len(responses) == 16 and all(len(r) == 24 for r in responses)
    model = build_gpt_model(mg_runtime, aligned=True).eval()
    with torch.no_grad():
        logprobs = _aligned_logprobs(model, prompts, responses)
    assert logprobs.dtype == torch.float32 and logprobs.shape == mu.shape
    assert torch.equal(logprobs, mu), _report("aligned megatron", logprobs, mu)
    print(_report("aligned megatron (THD packed)", logprobs, mu))


@pytest.mark.quick
def test_stock_local_spec_is_close(mg_runtime, mg_rollout):
    """Control: the same weights through megatron's stock local spec agree with the engine to
    fp32 round-off. How many tokens are bit-equal depends on the host's kernels: printed, not
    asserted (a planted difference is caught in test_checker_backend_reports_engine_bits)."""
    prompts, responses, mu = mg_rollout(seed=0)
    batch = pack(prompts, responses)
    with cpu_stock_megatron(), torch.no_grad():
        model = build_gpt_model(mg_runtime, aligned=False).eval()
        logprobs = token_logprobs_from_logits(per_sequence_logits(model, batch), batch)
    assert logprobs.shape == mu.shape
    diff = (logprobs - mu).abs().max().item()
    assert diff < 1e-4, diff
    print(_report("stock local spec on this host", logprobs, mu))


def test_verl_provider_injection_builds_bitwise_model(mg_runtime, mg_rollout):
    """The spec factory + pre-wrap hook the verl patch installs, driven as Megatron-Bridge's
    ``provide()`` drives them, give a model with the engine's bits."""
    from types import SimpleNamespace

    from megatron.core.models.gpt import GPTModel

    from zero_mismatch_plugin.integrations.verl.megatron_engine import inject_aligned_spec

    hf = mg_runtime.hf_config
    provider = convert.transformer_config_from_hf(hf)
    provider.transformer_layer_spec = "stock spec placeholder"
    hooks = []
    provider.register_pre_wrap_hook = hooks.append
    engine = SimpleNamespace(
        provider=provider,
        engine_config=SimpleNamespace(use_fused_kernels=False, use_remove_padding=True),
        peft_cls=None,
        is_value_model=False,
        _qat_enabled=False,
    )
    inject_aligned_spec(engine, runtime=mg_runtime)
    assert callable(provider.transformer_layer_spec) and len(hooks) == 1

    spec = provider.transformer_layer_spec(provider)
    model = GPTModel(provider, transformer_layer_spec=spec, **convert.gpt_model_kwargs(hf))
    [model] = hooks[0]([model])
    convert.load_hf_checkpoint(model, mg_runtime.model_dir, hf)
    prompts, responses, mu = mg_rollout(seed=30)
    with torch.no_grad():
        logprobs = _aligned_logprobs(model.eval(), prompts, responses)
    assert torch.equal(logprobs, mu), _report("injected spec", logprobs, mu)


def test_backward_matches_float64_reference(mg_runtime, mg_rollout):
    prompts, responses, _ = mg_rollout(seed=90, n=1)
    model = build_gpt_model(mg_runtime, aligned=True).train()
    coeffs = torch.randn(sum(len(r) for r in responses), generator=torch.Generator().manual_seed(0))
    (_aligned_logprobs(model, prompts, responses) * coeffs).sum().backward()
    named = dict(model.named_parameters())
    assert all(p.grad is not None for p in named.values())
    grads = convert.megatron_to_hf({k: p.grad for k, p in named.items()}, mg_runtime.hf_config)

    state = convert.megatron_to_hf({k: p.detach() for k, p in named.items()}, mg_runtime.hf_config)
    reference = float64_hf_model(mg_runtime.model_dir, state)
    (hf_token_logprobs(reference, prompts, responses) * coeffs.double()).sum().backward()
    worst = 0.0
    for name, ref in reference.named_parameters():
        g = grads[name].double()
        rel = ((g - ref.grad).norm() / ref.grad.norm().clamp_min(1e-30)).item()
        worst = max(worst, rel)
        assert rel < GRAD_REL_TOL, f"{name}: relative gradient error {rel:.3g}"
    print(f"aligned megatron backward: worst relative error vs float64 {worst:.3g}")


def test_checker_backend_reports_engine_bits(mg_checkpoints, mg_rollout):
    """``MegatronBackend`` (for ``zmrl check --trainer megatron``): μ bitwise, canonical op
    names, and a planted difference in one op reaches the logprobs."""
    from zero_mismatch_plugin.tools.checker import oplist
    from zero_mismatch_plugin.tools.checker.engine import engine_settings
    from zero_mismatch_plugin.tools.checker.megatron_backend import MegatronBackend

    backend = MegatronBackend(engine_settings(mg_checkpoints["llama"], max_model_len=256, seed=0))
    prompts, responses, mu = mg_rollout(seed=0)
    batch = pack(prompts, responses)
    assert torch.equal(backend.token_logprobs(batch), mu)
    record = backend.intermediates(batch)
    names = oplist.op_names(backend.runtime.hf_config.num_hidden_layers, qk_norm=False)
    assert set(record) == set(names)  # rotary, attention and activation included
    assert torch.equal(record[oplist.LOGPROBS].gather(-1, batch.target_ids[:, None])[:, 0], mu)
    planted = backend.intermediates(
        batch, lambda name, t: t + 1e-3 if name == "layers.1.qkv_proj" else t
    )
    assert torch.equal(planted["layers.0.qkv_proj"], record["layers.0.qkv_proj"])
    assert not torch.equal(planted[oplist.LOGPROBS], record[oplist.LOGPROBS])
    # An op inside megatron's attention module is recorded and planted the same way.
    inside = backend.intermediates(batch, lambda name, t: t + 1e-3 if name == "layers.1.attn" else t)
    assert torch.equal(inside["layers.1.rotary"][0], record["layers.1.rotary"][0])
    assert not torch.equal(inside["layers.1.o_proj"], record["layers.1.o_proj"])


def test_equal_again_after_optimizer_step_and_weight_sync(mg_runtime, mg_engine, mg_rollout):
    model = build_gpt_model(mg_runtime, aligned=True).train()
    prompts, responses, before_mu = mg_rollout(seed=200)
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3)
    (-_aligned_logprobs(model, prompts, responses).mean()).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)

    convert.sync_weights_to_engine(mg_engine, model, mg_runtime.hf_config, mg_runtime.dtype)
    after_prompts, after_responses, after_mu = mg_rollout(seed=200)
    # Same seeds: only the weights can have changed the rollout.
    assert after_responses != responses or not torch.equal(after_mu, before_mu)
    with torch.no_grad():
        logprobs = _aligned_logprobs(model.eval(), after_prompts, after_responses)
    assert torch.equal(logprobs, after_mu), _report("after step + sync", logprobs, after_mu)


def test_qwen3_shape_matches_aligned_causal_lm(mg_checkpoints):
    """Qwen3 (q/k norms, tied head) through the aligned spec equals the aligned trainer model,
    which tests/aligned checks bitwise against the engine."""
    from zero_mismatch_plugin.faces.aligned_model import AlignedCausalLM

    reference = AlignedCausalLM.from_pretrained(mg_checkpoints["qwen3"], max_model_len=256, seed=0)
    model = build_gpt_model(reference.runtime, aligned=True).eval()
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(4, 500, (n,), generator=g).tolist() for n in (3, 7, 12, 5)]
    responses = [torch.randint(4, 500, (20,), generator=g).tolist() for _ in prompts]
    batch = pack(prompts, responses)
    with torch.no_grad():
        expected = reference.token_logprobs(batch)
        got = token_logprobs_from_logits(packed_logits(model, batch), batch)
    assert torch.equal(got, expected), _report("qwen3 megatron vs aligned trainer", got, expected)


def test_mistral_megatron_logprobs_bitwise_equal_engine(checkpoints, engines):
    """Mistral (one entry in zero_mismatch_plugin.tables.architectures) through the aligned spec, against
    the session's Mistral engine. The engine is first given the megatron model's weights (the
    checkpoint's, through the layout mapping and vLLM's loader): earlier tests may have synced
    other weights into it."""
    from support.vllm_session import prompts_for, rollout

    from zero_mismatch_plugin.aligned.runtime import VllmRuntime
    from zero_mismatch_plugin.integrations.megatron.standalone import init_single_process

    init_single_process()
    runtime = VllmRuntime(checkpoints["mistral"], max_model_len=256, seed=0)
    assert runtime.hf_config.architectures == ["MistralForCausalLM"]
    model = build_gpt_model(runtime, aligned=True).eval()
    llm = engines.get("mistral")
    convert.sync_weights_to_engine(llm, model, runtime.hf_config, runtime.dtype)
    prompts, responses, mu = rollout(llm, prompts_for(checkpoints["mistral"]), seed=7)
    with torch.no_grad():
        logprobs = _aligned_logprobs(model, prompts, responses)
    assert logprobs.shape == mu.shape
    assert torch.equal(logprobs, mu), _report("mistral megatron", logprobs, mu)


def _checkpoint_layout(model) -> dict:
    """Each sharded tensor of megatron's distributed checkpoint under the key the checkpoint stores
    it by (a layer's ``sharded_state_dict_keys_map`` renames the state dict's key): (global shape,
    how it is split)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    layout = {}
    for key, value in model.sharded_state_dict().items():
        if isinstance(value, ShardedTensor):
            layout[value.key] = (tuple(value.global_shape), tuple(value.axis_fragmentations))
        elif "_extra_state" not in key:  # a factory (fc1's gate/up halves) keeps its tensor's key
            layout[value.key] = type(value).__name__
    return layout


@pytest.mark.quick
@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_aligned_model_checkpoints_as_the_stock_model_does(mg_runtime, mg_checkpoints, family):
    """verl's Megatron engine saves and resumes through megatron's distributed checkpoint: the aligned
    model's checkpoint has the stock model's keys (megatron's local spec stores the norms under
    Transformer Engine's fused names), shapes and splits, so either model resumes the other's
    checkpoint (a stock run resumed with the plugin on, and back)."""
    from zero_mismatch_plugin.aligned.runtime import VllmRuntime

    runtime = mg_runtime if family == "llama" else VllmRuntime(mg_checkpoints[family], max_model_len=MAX_MODEL_LEN, seed=0)
    with cpu_stock_megatron():
        aligned = _checkpoint_layout(build_gpt_model(runtime, aligned=True, load=False))
        stock = _checkpoint_layout(build_gpt_model(runtime, aligned=False, load=False))
    assert aligned == stock
    assert any(key.endswith("linear_proj.weight") for key in aligned)
    assert any(key.endswith("linear_qkv.layer_norm_weight") for key in aligned)
