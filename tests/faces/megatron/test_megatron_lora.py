"""The Megatron face with LoRA: a frozen aligned GPTModel plus a rank-8 adapter on every linear
against a LoRA-enabled vLLM engine serving the same adapter (CPU, gloo, world size 1).

Its own engine (enable_lora), started after the session's shared engine is shut down; the sync
test goes last because it changes the adapter on both sides.
"""

from __future__ import annotations

import pytest
import torch

from support.vllm_session import MAX_MODEL_LEN, prompts_for, rollout

from zero_mismatch_plugin.aligned import pack
from zero_mismatch_plugin.aligned.lora.peft import lora_engine_args
from zero_mismatch_plugin.aligned.lora.adapter import build_adapter
from zero_mismatch_plugin.faces.megatron import convert

# Relative L2 error allowed between the Megatron face's and the aligned face's fp32 adapter
# gradients (the aligned face is checked against float64 in test_aligned_lora.py).
GRAD_REL_TOL = 1e-4


@pytest.fixture(scope="module")
def consistent_mode():
    from zero_mismatch_plugin.aligned.numerics import consistent_numerics

    with consistent_numerics():
        yield


@pytest.fixture(scope="module")
def adapter(checkpoints, tmp_path_factory, consistent_mode):
    return build_adapter(tmp_path_factory.mktemp("megatron_lora") / "r8", checkpoints["llama"], r=8, lora_alpha=16, seed=21)


@pytest.fixture(scope="module")
def lora_llm(checkpoints, adapter, engines):
    from vllm import LLM

    from zero_mismatch_plugin.aligned.runtime import engine_args_for, shutdown_engine

    engines.pool.make_room()  # room for the engine started here
    llm = LLM(**engine_args_for(checkpoints["llama"], max_model_len=MAX_MODEL_LEN, seed=0, **lora_engine_args(adapter)))
    yield llm
    shutdown_engine(llm)


@pytest.fixture(scope="module")
def runtime(checkpoints, adapter):
    from zero_mismatch_plugin.aligned.runtime import VllmRuntime
    from zero_mismatch_plugin.integrations.megatron.standalone import init_single_process

    init_single_process()
    return VllmRuntime(checkpoints["llama"], max_model_len=MAX_MODEL_LEN, seed=0, **lora_engine_args(adapter))


@pytest.fixture(scope="module")
def model(runtime, adapter):
    from zero_mismatch_plugin.faces.megatron.lora import attach_lora
    from zero_mismatch_plugin.integrations.megatron.standalone import build_gpt_model

    gpt = build_gpt_model(runtime, aligned=True)
    gpt.lora_config = attach_lora(gpt, runtime, adapter)
    return gpt


def generate(llm, prompts, request, seed=0):
    """(prompts, responses, μ) of one batch, two samples per prompt, every request with ``request``."""
    return rollout(llm, prompts, seed=seed, n=2, max_tokens=16, lora_request=request)


def megatron_logprobs(model, prompts, responses):
    from zero_mismatch_plugin.integrations.megatron.standalone import packed_logits, token_logprobs_from_logits

    batch = pack(prompts, responses)
    return token_logprobs_from_logits(packed_logits(model, batch), batch)


def _assert_bitwise(logprobs, mu, what):
    assert torch.equal(logprobs, mu), (
        f"{what}: {(logprobs == mu).float().mean().item():.1%} of {mu.numel()} tokens bitwise equal, "
        f"max |diff| {(logprobs - mu).abs().max().item():.3g}"
    )


def _request(name, adapter_id, path):
    from vllm.lora.request import LoRARequest

    return LoRARequest(name, adapter_id, str(path))


def test_megatron_lora_bitwise_equal_engine(lora_llm, model, runtime, adapter):
    from zero_mismatch_plugin.integrations.megatron.standalone import build_gpt_model

    prompts, responses, mu = generate(lora_llm, prompts_for(runtime.model_dir), _request("r8", 1, adapter))
    with torch.no_grad():
        _assert_bitwise(megatron_logprobs(model, prompts, responses), mu, "megatron + LoRA")
        # The adapter is really in the forward: the same GPTModel without it gives other numbers.
        assert not torch.equal(megatron_logprobs(build_gpt_model(runtime, aligned=True), prompts, responses), mu)
    # The adapter's matrices went through convert's name mapping and back unchanged.
    from zero_mismatch_plugin.aligned.lora.peft import WEIGHTS_FILE
    from safetensors.torch import load_file
    from zero_mismatch_plugin.faces.megatron.lora import adapter_state

    on_disk = load_file(str(adapter / WEIGHTS_FILE))
    state = adapter_state(model)
    assert set(state) == set(on_disk) and all(torch.equal(state[n], on_disk[n]) for n in on_disk)


def test_adapters_set_aside_compute_the_base_and_come_back_unchanged(lora_llm, model, runtime, adapter):
    """verl's reference policy with LoRA and mbridge's base-only weight mapping: inside the block the
    model has no adapter (names, state, forward: the base model's bits); after it the same
    parameter objects are back and the forward is the engine's with the adapter again."""
    from zero_mismatch_plugin.faces.megatron.lora import adapters_set_aside, lora_parameters
    from zero_mismatch_plugin.integrations.megatron.standalone import build_gpt_model

    prompts, responses, mu = generate(lora_llm, prompts_for(runtime.model_dir), _request("r8", 1, adapter), seed=300)
    adapter_params = dict(lora_parameters(model))
    with torch.no_grad():
        base = megatron_logprobs(build_gpt_model(runtime, aligned=True), prompts, responses)
        assert not torch.equal(base, mu)
        with adapters_set_aside([model]):
            assert not lora_parameters(model) and not [k for k in model.state_dict() if ".lora." in k]
            _assert_bitwise(megatron_logprobs(model, prompts, responses), base, "adapter set aside")
        assert all(p is adapter_params[n] for n, p in lora_parameters(model)) and len(adapter_params) == 28
        _assert_bitwise(megatron_logprobs(model, prompts, responses), mu, "adapter back")


def test_verls_lora_settings_attach_an_adapter_that_starts_as_the_base_model(runtime, lora_llm):
    """verl's Megatron LoRA settings on the face (FaceLoRA): every A drawn by verl's init (xavier
    uniform, the same on every rank: one seed), every B zero, so the first forward is the base
    model's bit for bit; the base is frozen."""
    from zero_mismatch_plugin.faces.megatron.lora import adapter_state, lora_parameters
    from zero_mismatch_plugin.integrations.megatron.standalone import build_gpt_model
    from zero_mismatch_plugin.integrations.verl.megatron_lora import FaceLoRA

    peft = FaceLoRA.from_verl(dict(rank=8, alpha=16, target_modules=["linear_qkv", "linear_proj", "linear_fc1",
                                                                     "linear_fc2"]))
    first, second, base = (build_gpt_model(runtime, aligned=True) for _ in range(3))
    peft.attach(first, runtime)
    peft.attach(second, runtime)
    assert len(lora_parameters(first)) == 28 and all(not p.requires_grad for n, p in first.named_parameters()
                                                      if ".lora." not in n)
    state, again = adapter_state(first), adapter_state(second)
    assert set(state) == set(again) and all(torch.equal(state[n], again[n]) for n in state)
    for name, tensor in state.items():
        if ".lora_B." in name:
            assert not tensor.any(), name
        else:
            bound = (6 / sum(tensor.shape)) ** 0.5  # xavier uniform
            assert tensor.abs().max() <= bound and tensor.abs().max() > bound / 2, name
    prompts, responses, _ = generate(lora_llm, prompts_for(runtime.model_dir), None, seed=301)
    with torch.no_grad():
        _assert_bitwise(megatron_logprobs(first, prompts, responses), megatron_logprobs(base, prompts, responses),
                        "fresh adapter")


def test_verls_adapter_path_is_attached_and_an_adapter_of_another_scale_is_refused(runtime, adapter):
    """verl's ``lora.adapter_path``: the adapter on disk is the one attached; one whose rank or alpha
    differs from verl's settings (which tell the rollout its scale) is refused, naming the keys."""
    from safetensors.torch import load_file

    from zero_mismatch_plugin.aligned.lora.peft import WEIGHTS_FILE
    from zero_mismatch_plugin.faces.megatron.lora import adapter_state
    from zero_mismatch_plugin.integrations.megatron.standalone import build_gpt_model
    from zero_mismatch_plugin.integrations.verl.megatron_lora import FaceLoRA

    settings = dict(rank=8, alpha=16, target_modules=["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"],
                    adapter_path=str(adapter))
    gpt = build_gpt_model(runtime, aligned=True)
    FaceLoRA.from_verl(settings).attach(gpt, runtime)
    on_disk, state = load_file(str(adapter / WEIGHTS_FILE)), adapter_state(gpt)
    assert set(state) == set(on_disk) and all(torch.equal(state[n], on_disk[n]) for n in on_disk)
    with pytest.raises(ValueError, match="rank 8, lora_alpha 16.*alpha 32: set actor_rollout_ref.model.lora.rank"):
        FaceLoRA.from_verl({**settings, "alpha": 32}).attach(build_gpt_model(runtime, aligned=True), runtime)


def test_a_checkpoint_of_the_face_adapter_holds_every_matrix_under_the_names_the_model_loads(runtime):
    """What verl saves and resumes for the face's adapter (the adapter's entries of megatron's
    sharded state dict, ``adapter_entries``): every A and B, under the names ``load_state_dict``
    takes, each over the parameter's own data; the base's entries stay out."""
    from zero_mismatch_plugin.faces.megatron.lora import lora_parameters
    from zero_mismatch_plugin.integrations.megatron.standalone import build_gpt_model
    from zero_mismatch_plugin.integrations.verl.megatron_lora import FaceLoRA, adapter_entries

    gpt = build_gpt_model(runtime, aligned=True)
    FaceLoRA.from_verl(dict(rank=8, alpha=16, target_modules=["linear_qkv", "linear_proj", "linear_fc1",
                                                               "linear_fc2"])).attach(gpt, runtime)
    params = dict(lora_parameters(gpt))
    entries = adapter_entries(gpt.sharded_state_dict())
    assert set(entries) == set(params) and len(params) == 28
    assert all(entries[name].data is params[name] for name in params)
    gpt.load_state_dict({name: torch.ones_like(p) for name, p in params.items()}, strict=False)
    assert all(bool((p == 1).all()) for p in params.values())


def test_refresh_reaches_the_adapters_after_writes_through_param_data(runtime, adapter, lora_llm, tmp_path):
    """megatron's mixed-precision optimizer writes its fp32 masters into bf16 parameters through
    ``param.data`` (no version bump): after ``refresh_aligned_weights`` (what the verl patch calls
    after each optimizer step) the forward is that of a model built with the new adapter."""
    from zero_mismatch_plugin.faces.megatron.lora import attach_lora, lora_parameters, save_adapter
    from zero_mismatch_plugin.faces.megatron.spec import refresh_aligned_weights
    from zero_mismatch_plugin.integrations.megatron.standalone import build_gpt_model

    trained = build_gpt_model(runtime, aligned=True)
    config = attach_lora(trained, runtime, adapter)
    prompts, responses, _ = generate(lora_llm, prompts_for(runtime.model_dir), _request("r8", 1, adapter), seed=302)
    with torch.no_grad():
        before = megatron_logprobs(trained, prompts, responses)
        for name, param in lora_parameters(trained):
            if name.endswith("lora_B"):
                param.data.copy_(param.data * 1.5 + 0.01)
        assert torch.equal(megatron_logprobs(trained, prompts, responses), before)  # the stale copies: the fault
        refresh_aligned_weights(trained)
        fresh = build_gpt_model(runtime, aligned=True)
        attach_lora(fresh, runtime, save_adapter(trained, config, tmp_path / "written"))
        after = megatron_logprobs(trained, prompts, responses)
        assert not torch.equal(after, before)
        _assert_bitwise(after, megatron_logprobs(fresh, prompts, responses), "refreshed adapter")


def test_megatron_lora_gradients_only_on_a_and_b(lora_llm, model, runtime, adapter, checkpoints):
    from zero_mismatch_plugin.faces.aligned_model import AlignedCausalLM
    from zero_mismatch_plugin.faces.megatron.lora import lora_parameters

    prompts, responses, _ = generate(lora_llm, prompts_for(runtime.model_dir), _request("r8", 1, adapter), seed=100)
    coeffs = torch.randn(sum(len(r) for r in responses), generator=torch.Generator().manual_seed(0))
    model.zero_grad(set_to_none=True)
    (megatron_logprobs(model, prompts, responses) * coeffs).sum().backward()
    adapter_names = {n for n, _ in lora_parameters(model)}
    assert len(adapter_names) == 2 * 7 * 2  # A and B of 7 targets in 2 layers
    for name, p in model.named_parameters():
        if name in adapter_names:
            assert p.requires_grad and p.grad is not None and p.grad.abs().max() > 0, name
        else:
            assert p.grad is None and not p.requires_grad, name
    grads = convert.megatron_to_peft_lora({n: p.grad for n, p in lora_parameters(model)})
    model.zero_grad(set_to_none=True)

    aligned = AlignedCausalLM.from_pretrained(checkpoints["llama"], max_model_len=MAX_MODEL_LEN, seed=0,
                                              lora_dir=adapter, **lora_engine_args(adapter))
    (aligned.token_logprobs(pack(prompts, responses)) * coeffs).sum().backward()
    worst = 0.0
    for i, target, pair in aligned.lora.pairs():
        for which, p in (("A", pair.lora_A), ("B", pair.lora_B)):
            g = grads[f"base_model.model.model.layers.{i}.{'self_attn' if target in ('q_proj', 'k_proj', 'v_proj', 'o_proj') else 'mlp'}.{target}.lora_{which}.weight"]
            rel = ((g - p.grad).norm() / p.grad.norm()).item()
            worst = max(worst, rel)
            assert rel < GRAD_REL_TOL, f"layer {i} {target} lora_{which}: relative difference {rel:.3g}"
    print(f"megatron vs aligned LoRA gradients: worst relative difference {worst:.3g}")


def test_megatron_lora_equal_again_after_optimizer_step_and_adapter_sync(lora_llm, model, runtime, tmp_path):
    from zero_mismatch_plugin.faces.megatron.lora import lora_parameters, save_adapter

    prompts = prompts_for(runtime.model_dir)
    before = generate(lora_llm, prompts, _request("r8", 1, model_adapter_dir(model, tmp_path, "v0")), seed=200)
    optimizer = torch.optim.AdamW([p for _, p in lora_parameters(model)], lr=2e-2)
    (-megatron_logprobs(model, before[0], before[1]).mean()).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    path = save_adapter(model, model.lora_config, tmp_path / "v1")
    after = generate(lora_llm, prompts, _request("r8-v1", 2, path), seed=200)
    # Same seeds: only the new adapter can have changed the rollout.
    assert after[1] != before[1] or not torch.equal(after[2], before[2])
    with torch.no_grad():
        _assert_bitwise(megatron_logprobs(model, after[0], after[1]), after[2], "megatron + LoRA after sync")


def model_adapter_dir(model, tmp_path, name):
    from zero_mismatch_plugin.faces.megatron.lora import save_adapter

    return save_adapter(model, model.lora_config, tmp_path / name)
