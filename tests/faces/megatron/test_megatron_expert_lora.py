"""The Megatron face with LoRA on MoE experts: a frozen aligned GPTModel plus a rank-8 adapter on
attention, every routed expert (gate, up, down) and the shared expert, against a LoRA-enabled
vLLM engine serving the same adapter (CPU, gloo, world size 1).

Qwen3-MoE (softmax routing), Qwen2-MoE (a gated shared expert, a dense last layer), GLM-4.5
(sigmoid routing in expert groups, a shared expert, a dense first layer) and Mixtral (experts'
linears named w1, w3, w2 in the adapter). One LoRA engine per
checkpoint, started after the session's shared engine is shut; the sync test goes last in each
because it changes the adapter on both sides.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from support.vllm_session import MAX_MODEL_LEN, prompts_for, rollout

from zero_mismatch_plugin.aligned import pack
from zero_mismatch_plugin.aligned.lora.peft import WEIGHTS_FILE
from zero_mismatch_plugin.aligned.lora.adapter import build_adapter
from zero_mismatch_plugin.faces.megatron import convert

MODELS = ("qwen3_moe", "qwen2_moe", "glm4_moe", "mixtral")
# max_lora_rank above the adapter's rank: engine and trainer both zero-pad A and B to it.
LORA_ENGINE = dict(enable_lora=True, max_lora_rank=16, max_loras=2, max_model_len=MAX_MODEL_LEN, seed=0)
# Relative L2 difference allowed between the Megatron face's and the aligned face's fp32 adapter
# gradients (the aligned face's expert LoRA backward is checked against float64 in
# tests/faces/aligned_model/test_aligned_expert_lora.py): summation order, measured ~1e-6; a wrong term is O(1).
GRAD_REL_TOL = 1e-4


@pytest.fixture(scope="module", params=MODELS)
def family(request):
    """Module-scoped: every test of one checkpoint runs before the next (one engine start each)."""
    return request.param


@pytest.fixture(scope="module")
def adapter(checkpoints, family, tmp_path_factory):
    return build_adapter(tmp_path_factory.mktemp(f"megatron_expert_lora_{family}"), checkpoints[family], r=8,
                         lora_alpha=16, seed=21)


@pytest.fixture(scope="module")
def lora_llm(engines, checkpoints, family):
    from vllm import LLM

    from zero_mismatch_plugin.aligned.runtime import engine_args_for, shutdown_engine

    engines.pool.make_room()  # room for the engine started here
    llm = LLM(**engine_args_for(checkpoints[family], **LORA_ENGINE))
    yield llm
    shutdown_engine(llm)


@pytest.fixture(scope="module")
def runtime(checkpoints, family):
    from zero_mismatch_plugin.aligned.runtime import VllmRuntime
    from zero_mismatch_plugin.integrations.megatron.standalone import init_single_process

    init_single_process()
    return VllmRuntime(checkpoints[family], **LORA_ENGINE)


@pytest.fixture(scope="module")
def model(runtime, adapter):
    from zero_mismatch_plugin.faces.megatron.lora import attach_lora
    from zero_mismatch_plugin.integrations.megatron.standalone import build_gpt_model

    gpt = build_gpt_model(runtime, aligned=True)
    gpt.lora_config = attach_lora(gpt, runtime, adapter)
    return gpt


def _request(path, lora_id=1):
    from vllm.lora.request import LoRARequest

    return LoRARequest(f"experts-{lora_id}", lora_id, str(path))


def megatron_logprobs(model, prompts, responses):
    from zero_mismatch_plugin.integrations.megatron.standalone import packed_logits, token_logprobs_from_logits

    batch = pack(prompts, responses)
    return token_logprobs_from_logits(packed_logits(model, batch), batch)


def _assert_bitwise(logprobs, mu, what):
    assert logprobs.shape == mu.shape
    assert torch.equal(logprobs, mu), (
        f"{what}: {(logprobs == mu).float().mean().item():.1%} of {mu.numel()} tokens bitwise equal, "
        f"max |diff| {(logprobs - mu).abs().max().item():.3g}"
    )


def _expert_parts(runtime):
    """The name parts of the MoE adapter: the routed experts, and the shared expert if any."""
    from zero_mismatch_plugin.tables.architectures import describe

    shared = describe(runtime.hf_config).moe.shared_expert_intermediate_size
    return [".local_experts."] + ([".shared_experts."] if shared else [])


@contextlib.contextmanager
def _zeroed_b(model, part):
    """The adapter's B matrices whose names contain ``part`` are zero inside, restored after."""
    from zero_mismatch_plugin.faces.megatron.lora import lora_parameters

    b_matrices = [p for n, p in lora_parameters(model) if part in n and n.endswith("lora_B")]
    assert b_matrices, part
    saved = [p.detach().clone() for p in b_matrices]
    with torch.no_grad():
        for p in b_matrices:
            p.zero_()
    try:
        yield
    finally:
        with torch.no_grad():
            for p, value in zip(b_matrices, saved):
                p.copy_(value)


def test_expert_adapter_names_map_to_peft_and_back(model, runtime, adapter):
    """Every routed expert's and the shared expert's A and B are Megatron-face parameters next to
    the expert's own weights, and come back under PEFT's names unchanged (what save_adapter writes)."""
    from safetensors.torch import load_file

    from zero_mismatch_plugin.tables.architectures import describe
    from zero_mismatch_plugin.faces.megatron.lora import adapter_state, lora_parameters

    blocks = describe(runtime.hf_config)
    moe_layers = [i for i in range(runtime.hf_config.num_hidden_layers) if blocks.mlp_kind(i) == "moe"]
    names = [n for n, _ in lora_parameters(model)]
    routed = [n for n in names if ".mlp.experts.local_experts." in n]
    shared = [n for n in names if ".mlp.shared_experts." in n]
    assert len(routed) == len(moe_layers) * blocks.moe.num_experts * 3 * 2
    assert len(shared) == (len(moe_layers) * 3 * 2 if blocks.moe.shared_expert_intermediate_size else 0)
    last = f"decoder.layers.{moe_layers[-1]}.mlp.experts.local_experts.{blocks.moe.num_experts - 1}.linear_fc2"
    assert f"{last}.lora.down_proj.lora_B" in names and f"{last}.weight" in dict(model.named_parameters())

    on_disk = load_file(str(adapter / WEIGHTS_FILE))
    state = adapter_state(model)
    assert set(state) == set(on_disk) and all(torch.equal(state[n], on_disk[n]) for n in on_disk)
    assert convert.peft_to_megatron_lora(on_disk).keys() == set(names)
    if shared:
        with pytest.raises(ValueError, match="hf_config"):
            convert.megatron_to_peft_lora({shared[0]: torch.zeros(1)})
    with pytest.raises(ValueError, match="not a Megatron-face LoRA parameter"):
        # down_proj sits on linear_fc2, never on linear_fc1
        convert.parse_megatron_lora_name(routed[0].replace("gate_proj", "down_proj"))


def test_megatron_expert_lora_bitwise_equal_engine_at_batch_1_and_8(lora_llm, model, runtime, adapter):
    prompts = prompts_for(runtime.model_dir)
    for size in (1, 8):
        seq_prompts, responses, mu = rollout(lora_llm, prompts[:size], seed=100, n=1, max_tokens=12,
                                             lora_request=_request(adapter))
        with torch.no_grad():
            _assert_bitwise(megatron_logprobs(model, seq_prompts, responses), mu, f"engine batch of {size}")
    # Each expert part of the adapter is in the forward: without it (its B zeroed) the logprobs
    # differ from μ; restored, they are μ again.
    for part in _expert_parts(runtime):
        with _zeroed_b(model, part), torch.no_grad():
            assert not torch.equal(megatron_logprobs(model, seq_prompts, responses), mu), part
    with torch.no_grad():
        _assert_bitwise(megatron_logprobs(model, seq_prompts, responses), mu, "adapter restored")


def test_megatron_expert_lora_gradients_equal_aligned_face_and_base_gets_none(lora_llm, model, runtime, adapter,
                                                                              checkpoints, family):
    from zero_mismatch_plugin.faces.aligned_model import AlignedCausalLM
    from zero_mismatch_plugin.faces.megatron.lora import lora_parameters

    prompts, responses, _ = rollout(lora_llm, prompts_for(runtime.model_dir), seed=100, n=1, max_tokens=12,
                                    lora_request=_request(adapter))
    coeffs = torch.randn(sum(len(r) for r in responses), generator=torch.Generator().manual_seed(0))
    model.zero_grad(set_to_none=True)
    (megatron_logprobs(model, prompts, responses) * coeffs).sum().backward()
    adapter_names = {n for n, _ in lora_parameters(model)}
    for name, p in model.named_parameters():
        if name not in adapter_names:
            assert p.grad is None and not p.requires_grad, name
    for part in _expert_parts(runtime):
        assert any(p.grad is not None and p.grad.any() for n, p in lora_parameters(model) if part in n), part
    grads = convert.megatron_to_peft_lora({n: p.grad for n, p in lora_parameters(model)}, runtime.hf_config)
    model.zero_grad(set_to_none=True)

    aligned = AlignedCausalLM.from_pretrained(checkpoints[family], lora_dir=adapter, **LORA_ENGINE)
    (aligned.token_logprobs(pack(prompts, responses)) * coeffs).sum().backward()
    expected = {name: p.grad for name, p in aligned.lora.named_matrices()}
    assert set(grads) == set(expected)
    rel = {}
    for name, g in expected.items():
        # An expert no token chose gets no gradient, in both faces.
        assert (grads[name] is None) == (g is None), name
        if g is not None:
            rel[name] = ((grads[name] - g).norm() / g.norm().clamp_min(1e-30)).item()
    worst = max(rel, key=rel.get)
    print(f"{family}: megatron vs aligned expert-LoRA gradients, {len(rel)} tensors, worst relative "
          f"difference {rel[worst]:.3g} ({worst})")
    assert rel[worst] < GRAD_REL_TOL, f"{worst}: relative difference {rel[worst]:.3g}"


def test_megatron_expert_lora_bitwise_again_after_optimizer_step_and_adapter_sync(lora_llm, model, runtime, tmp_path):
    from zero_mismatch_plugin.faces.megatron.lora import lora_parameters, save_adapter

    prompts = prompts_for(runtime.model_dir)
    v0 = save_adapter(model, model.lora_config, tmp_path / "v0")
    before = rollout(lora_llm, prompts, seed=300, n=1, max_tokens=12, lora_request=_request(v0, 11))
    optimizer = torch.optim.AdamW([p for _, p in lora_parameters(model)], lr=2e-2)
    (-megatron_logprobs(model, before[0], before[1]).mean()).backward()
    before_step = {n: p.detach().clone() for n, p in lora_parameters(model)}
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    moved = [n for n, p in lora_parameters(model) if not torch.equal(p.detach(), before_step[n])]
    assert all(any(part in n for n in moved) for part in _expert_parts(runtime)), "the step moved no expert adapter"
    v1 = save_adapter(model, model.lora_config, tmp_path / "v1")
    after = rollout(lora_llm, prompts, seed=300, n=1, max_tokens=12, lora_request=_request(v1, 12))
    # Same seeds: only the new adapter can have changed the rollout.
    assert after[1] != before[1] or not torch.equal(after[2], before[2])
    with torch.no_grad():
        _assert_bitwise(megatron_logprobs(model, after[0], after[1]), after[2], "after an optimizer step and a sync")
