"""bf16, the precision users train in: both trainer faces bitwise against a bf16 engine in
consistent mode, at engine batch 1, 2 and 8, for dense, MoE, MLA (the aligned model only: the
Megatron face has no MLA), sliding windows with prefix caching, and LoRA on the decoder linears and
on MoE experts. The aligned model keeps fp32 master weights and runs the bf16 copies the engine
serves (verl's FSDP way); the Megatron face holds bf16 parameters (megatron's way); the aligned
model with bf16 parameters is checked too. Negative controls: transformers' bf16 forward, and the
Megatron face normalising the rounded residual sum (what megatron's own layer does).

One engine per family, shared by the module's tests (the family is a module-scoped parameter).
"""

from __future__ import annotations

import pytest
import torch

from support.aligned_checks import bitwise_report, lora_generate, windowed_conversations
from support.vllm_session import Engines, MAX_MODEL_LEN, hf_token_logprobs, prompts_for, rollout

from zero_mismatch_plugin.aligned import pack

BF16 = "bfloat16"
BATCHES = (1, 2, 8)
# family -> whether the Megatron face runs it (it has no multi-head latent attention)
FAMILIES = {"llama": True, "qwen3_moe": True, "deepseek_v3_moe": False}
WINDOWED = "mistral_window"
LORA_ENGINE = dict(enable_lora=True, max_lora_rank=16, max_loras=2, max_model_len=MAX_MODEL_LEN, seed=0, dtype=BF16)


@pytest.fixture(scope="module", autouse=True)
def _consistent(consistent_mode):
    yield


@pytest.fixture(scope="module")
def bf16_engines(engines):
    return Engines(engines.pool, engines.checkpoints, scope=__name__, dtype=BF16)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    return request.param


def batched_rollouts(llm, checkpoint):
    """One rollout per engine batch size: the first b prompts, one sample each, a seed per prompt."""
    prompts = prompts_for(checkpoint)
    return {b: rollout(llm, prompts[:b], seed=400, n=1) for b in BATCHES}


@pytest.fixture(scope="module")
def rollouts(bf16_engines, family):
    return batched_rollouts(bf16_engines.get(family), bf16_engines.checkpoints[family])


def aligned_model(checkpoint, **engine_kwargs):
    from zero_mismatch_plugin.faces.aligned_model import AlignedCausalLM

    return AlignedCausalLM.from_pretrained(checkpoint, **{"max_model_len": MAX_MODEL_LEN, "seed": 0, "dtype": BF16,
                                                          **engine_kwargs})


def megatron_face(checkpoint, **engine_kwargs):
    from zero_mismatch_plugin.integrations.megatron.standalone import MegatronScorer

    return MegatronScorer.from_model_dir(checkpoint, **{"max_model_len": MAX_MODEL_LEN, "seed": 0, "dtype": BF16,
                                                        **engine_kwargs})


def megatron_logprobs(scorer, prompts, responses):
    return torch.cat(scorer.token_logprobs(prompts, responses))


def assert_bitwise(what, logprobs, mu):
    assert logprobs.dtype == torch.float32 and logprobs.shape == mu.shape
    assert torch.equal(logprobs, mu), bitwise_report(what, logprobs, mu)


def test_engine_serves_bf16(bf16_engines, family):
    config = bf16_engines.get(family).llm_engine.vllm_config.model_config
    assert config.dtype == torch.bfloat16 and config.head_dtype == torch.float32


def test_aligned_model_bitwise_at_batch_1_2_8_with_fp32_master_and_bf16_weights(bf16_engines, rollouts, family):
    checkpoint = bf16_engines.checkpoints[family]
    master = aligned_model(checkpoint)
    assert {p.dtype for p in master.parameters()} == {torch.float32}  # fp32 master weights, bf16 forward
    bf16_weights = aligned_model(checkpoint).to(torch.bfloat16)
    for b, (prompts, responses, mu) in rollouts.items():
        batch = pack(prompts, responses)
        with torch.no_grad():
            assert_bitwise(f"{family} aligned model, fp32 master, batch {b}", master.token_logprobs(batch), mu)
            assert_bitwise(f"{family} aligned model, bf16 weights, batch {b}", bf16_weights.token_logprobs(batch), mu)


def test_megatron_face_bitwise_at_batch_1_2_8(bf16_engines, rollouts, family):
    if not FAMILIES[family]:
        with pytest.raises(Exception, match="multi-latent attention"):
            megatron_face(bf16_engines.checkpoints[family])
        return
    scorer = megatron_face(bf16_engines.checkpoints[family])
    assert {p.dtype for p in scorer.model.parameters()} == {torch.bfloat16}
    for b, (prompts, responses, mu) in rollouts.items():
        assert_bitwise(f"{family} Megatron face, batch {b}", megatron_logprobs(scorer, prompts, responses), mu)


def test_negative_controls_standard_bf16_forward_and_megatrons_own_residual_norm(
        bf16_engines, rollouts, family, monkeypatch):
    """transformers in bf16 (verl's standard forward) is close to μ and not μ; for the Megatron face,
    normalising the rounded residual sum (megatron's layer) instead of vLLM's fused add + norm is
    not μ either: the fused norm is what makes the face bitwise in bf16."""
    from transformers import AutoModelForCausalLM

    from zero_mismatch_plugin.faces.megatron import modules

    prompts, responses, mu = rollouts[8]
    checkpoint = bf16_engines.checkpoints[family]
    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.bfloat16).eval()
    with torch.no_grad():
        standard = hf_token_logprobs(model, prompts, responses).float()
    gap = (standard - mu).abs().max().item()
    assert not torch.equal(standard, mu) and gap < 1.0, gap
    print(f"{family}: transformers bf16 {(standard == mu).float().mean().item():.1%} bitwise equal, max |diff| {gap:.3g}")
    if not FAMILIES[family]:
        return
    scorer = megatron_face(checkpoint)
    monkeypatch.setattr(modules, "residual_addends", lambda total: None)
    for norm in (m for m in scorer.model.modules() if isinstance(m, modules.AlignedRMSNormModule)):
        norm.after_residual_add = False
    rounded_sum = megatron_logprobs(scorer, prompts, responses)
    assert not torch.equal(rounded_sum, mu)
    print(f"{family}: Megatron face normalising the rounded sum: {bitwise_report('', rounded_sum, mu)}")


def test_sliding_window_with_prefix_caching_both_faces_at_batch_1_2_8(bf16_engines):
    """Rollouts at engine batch 1, 2 and 8 (every prompt + response crosses the 12-token window), then
    three turns of conversations re-sent whole, later turns hitting the prefix cache past the window."""
    checkpoint = bf16_engines.checkpoints[WINDOWED]
    trainer, scorer = aligned_model(checkpoint), megatron_face(checkpoint)
    by_batch = batched_rollouts(bf16_engines.get(WINDOWED), checkpoint)
    llm, turns, prompts, responses, mu = windowed_conversations(bf16_engines, bf16_engines.checkpoints, WINDOWED, seed=700)
    assert sum(c >= 128 for c in turns[-1][3]) >= 1  # a hit reaches past the window
    for what, (prompts, responses, mu) in [*((f"batch {b}", r) for b, r in by_batch.items()),
                                           ("three turns, prefix cache", (prompts, responses, mu))]:
        with torch.no_grad():
            assert_bitwise(f"windowed aligned model, {what}", trainer.token_logprobs(pack(prompts, responses)), mu)
        assert_bitwise(f"windowed Megatron face, {what}", megatron_logprobs(scorer, prompts, responses), mu)


@pytest.mark.parametrize("base", ["llama", "qwen3_moe"])
def test_lora_on_linears_and_experts_both_faces_at_batch_1_2_8(engines, base, tmp_path):
    """An adapter on every linear the engine adapts (attention, MLP; every routed expert of the MoE
    model): the engine serving it in bf16, both faces with it, each sequence alone and batched."""
    from vllm.lora.request import LoRARequest

    from zero_mismatch_plugin.aligned.lora.adapter import build_adapter
    from zero_mismatch_plugin.faces.megatron.lora import attach_lora

    from safetensors import safe_open

    checkpoint = engines.checkpoints[base]
    adapter = build_adapter(tmp_path / "adapter", checkpoint, r=8, lora_alpha=16)
    with safe_open(adapter / "adapter_model.safetensors", "pt") as names:
        adapted = {name.split(".lora_")[0].rsplit(".", 1)[-1] for name in names.keys()}
        assert base != "qwen3_moe" or any(".experts." in name for name in names.keys())
    assert {"q_proj", "o_proj", "gate_proj", "down_proj"} <= adapted, adapted
    llm = Engines(engines.pool, engines.checkpoints, scope=f"{__name__}.lora", **LORA_ENGINE).get(base)
    request = LoRARequest(f"bf16-{base}", 1, str(adapter))
    prompts = prompts_for(checkpoint)
    trainer = aligned_model(checkpoint, lora_dir=adapter, **{k: v for k, v in LORA_ENGINE.items() if k != "dtype"})
    scorer = megatron_face(checkpoint, **{k: v for k, v in LORA_ENGINE.items() if k != "dtype"})
    attach_lora(scorer.model, scorer.runtime, adapter)
    for b in BATCHES:
        rows = lora_generate(llm, prompts[:b], [request] * b, seed=500)
        row_prompts, row_responses = [r[0] for r in rows], [r[1] for r in rows]
        mu = torch.cat([r[2] for r in rows])
        with torch.no_grad():
            assert_bitwise(f"{base} LoRA aligned model, batch {b}", trainer.token_logprobs(pack(row_prompts, row_responses)), mu)
        assert_bitwise(f"{base} LoRA Megatron face, batch {b}", megatron_logprobs(scorer, row_prompts, row_responses), mu)
    engines.pool.drop(checkpoint, scope=f"{__name__}.lora", **LORA_ENGINE)


def test_backward_in_bf16_against_float64(bf16_engines):
    """The aligned model's gradient (fp32 master weights, bf16 forward, analytic backward from the
    bf16 activations: GEMMs and SwiGLU in bf16 with fp32 accumulation, the other ops in fp32) against float64
    autograd through transformers: bf16 round-off, stated.
    An error in a backward formula is O(1); bf16 measures ~1e-2 here."""
    from transformers import AutoModelForCausalLM

    checkpoint = bf16_engines.checkpoints["llama"]
    prompts, responses, _ = rollout(bf16_engines.get("llama"), prompts_for(checkpoint), seed=400, n=1)
    trainer = aligned_model(checkpoint)
    coefficients = torch.randn(sum(map(len, responses)), generator=torch.Generator().manual_seed(0))
    (trainer.token_logprobs(pack(prompts, responses)) * coefficients).sum().backward()
    reference = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float64)
    reference.get_input_embeddings().padding_idx = None
    (hf_token_logprobs(reference, prompts, responses) * coefficients.double()).sum().backward()
    ref = dict(reference.named_parameters())
    errors = {name: ((p.grad.double() - ref[name].grad).norm() / ref[name].grad.norm()).item()
              for name, p in trainer.named_parameters()}
    worst = max(errors.values())
    print(f"bf16 forward, backward GEMMs in bf16: worst relative gradient error vs float64 {worst:.3g} "
          f"(median {sorted(errors.values())[len(errors) // 2]:.3g})")
    assert worst < 0.1, {n: e for n, e in errors.items() if e >= 0.1}


def test_engine_head_patch_removed_lets_a_row_count_dependent_gemm_through(bf16_engines, monkeypatch):
    """The engine side of the bf16 fix, in this process: the fp32 head of a bf16 model (vLLM's
    LogitsProcessor, which engine and trainer call) under a planted GEMM that rounds calls of fewer
    than four rows another way. With the plugin's patch a row's logits are the same at every row
    count; with the patch removed the planted kernel shows through (vLLM's own F.linear does so on
    some hosts: 1-3 rows on an AVX-512 EPYC)."""
    from vllm.model_executor.layers import logits_processor

    from zero_mismatch_plugin.aligned.ops import AlignedLogits
    from zero_mismatch_plugin.aligned.runtime import VllmRuntime
    from zero_mismatch_plugin.integrations import patches as runtime_patches
    from zero_mismatch_plugin.integrations.vllm.cpu_head import WIDE_HEAD

    runtime = VllmRuntime(bf16_engines.checkpoints["llama"], dtype=BF16, max_model_len=MAX_MODEL_LEN)
    assert runtime.dtype == torch.bfloat16 and runtime.head_dtype == torch.float32
    weight = torch.nn.Parameter(torch.randn(runtime.hf_config.vocab_size, runtime.hf_config.hidden_size))
    head = AlignedLogits(runtime, weight, runtime.hf_config.vocab_size)
    hidden = torch.randn(40, runtime.hf_config.hidden_size).bfloat16()
    def planted_linear(x, w, b=None):  # float64 rounded once (host-independent), one ulp up below four rows
        y = (x.double() @ w.double().t() + (0 if b is None else b.double())).float()
        return torch.nextafter(y, torch.full_like(y, float("inf"))) if x.reshape(-1, x.shape[-1]).shape[0] < 4 else y

    monkeypatch.setattr(logits_processor, "F", type("F", (), {"linear": staticmethod(planted_linear)}))

    def variant_rows():
        with runtime.context():
            full = head.kernel(hidden)
            return [m for m in (1, 2, 3, 5, 8, 17) if not torch.equal(head.kernel(hidden[:m].contiguous()), full[:m])]

    was_applied = runtime_patches.is_applied(WIDE_HEAD)
    runtime_patches.apply(WIDE_HEAD)
    try:
        assert variant_rows() == []
        runtime_patches.remove(WIDE_HEAD)
        assert variant_rows() == [1, 2, 3]
    finally:
        if was_applied:
            runtime_patches.apply(WIDE_HEAD)
