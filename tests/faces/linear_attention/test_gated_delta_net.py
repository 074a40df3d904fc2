"""Linear attention (gated delta-net, Qwen3-Next) in consistent mode: the engine agrees with itself
(a token decoded has the bits of the same token re-prefilled, across vLLM's 64-token prefill
chunks and its chunked scheduling of long prompts) and the aligned model computes those bits at
engine batch 1, 2 and 8. Negative controls: vLLM's chunked prefill kernel in the trainer, and
transformers' bf16 forward. Backward: against float64, per op and through the model.

vLLM's CPU gated delta-net runs bf16 only (head dim 128); one bf16 engine serves the module.
"""

from __future__ import annotations

import pytest
import torch

from support.aligned_checks import bitwise_report
from support.linear_attention import BATCHES, assert_bitwise, batch_rollouts, reprefilled
from support.vllm_session import MAX_MODEL_LEN, Engines, hf_token_logprobs, prompts_for

from zero_mismatch_plugin.aligned import pack

BF16 = "bfloat16"
FAMILY = "qwen3_next"
# A long prompt is prefilled in pieces of this many tokens (vLLM's chunked prefill): the later
# pieces start from the recurrent and conv states the earlier ones left.
ENGINE = dict(dtype=BF16, max_num_batched_tokens=64)


@pytest.fixture(scope="module", autouse=True)
def _consistent(consistent_mode):
    yield


@pytest.fixture(scope="module")
def engine(engines):
    return Engines(engines.pool, engines.checkpoints, scope=__name__, **ENGINE).get(FAMILY)


@pytest.fixture(scope="module")
def checkpoint(engines):
    return engines.checkpoints[FAMILY]


@pytest.fixture(scope="module")
def rollouts(engine, checkpoint):
    return batch_rollouts(engine, checkpoint, seed=400)


def aligned_model(checkpoint):
    from zero_mismatch_plugin.faces.aligned_model import AlignedCausalLM

    return AlignedCausalLM.from_pretrained(checkpoint, max_model_len=MAX_MODEL_LEN, seed=0, **ENGINE)


def test_engine_runs_the_one_arithmetic_patch_in_bf16(engine):
    from zero_mismatch_plugin.integrations.vllm import plugin

    assert engine.llm_engine.vllm_config.model_config.dtype == torch.bfloat16
    assert {"cpu-gdn-one-arithmetic", "cpu-qwen3-next-attention-gate-sigmoid"} <= set(plugin.applied())


def test_engine_decode_equals_reprefill_across_chunks(engine, rollouts):
    """Every sampled token's μ (decoded one at a time after a prefill in 64-token pieces) against
    the same sequences re-prefilled whole, eight at once."""
    prompts, responses, mu = rollouts[8]
    assert max(map(len, prompts)) > 128
    assert_bitwise("engine decode vs re-prefill", reprefilled(engine, prompts, responses), mu)


def test_aligned_model_bitwise_at_batch_1_2_8(checkpoint, rollouts):
    trainer = aligned_model(checkpoint)
    assert {p.dtype for p in trainer.parameters()} == {torch.float32}  # fp32 master weights, bf16 forward
    for b, (prompts, responses, mu) in rollouts.items():
        with torch.no_grad():
            assert_bitwise(f"Qwen3-Next aligned model, batch {b}", trainer.token_logprobs(pack(prompts, responses)), mu)


def chunked_prefill_rule(q, k, v, a, b, A_log, dt_bias, state_pool, slots, seq_lens, out=None):
    """vLLM's stock prefill for the same packed sequences: gating, then its chunked kernel."""
    from vllm import _custom_ops as vllm_ops

    g, beta = vllm_ops.fused_gdn_gating_cpu(A_log=A_log.to(a.dtype), a=a.contiguous(), b=b.contiguous(),
                                            dt_bias=dt_bias)
    starts = torch.tensor([0, *torch.tensor(seq_lens).cumsum(0).tolist()], dtype=torch.int32)
    result, _ = vllm_ops.chunk_gated_delta_rule_cpu(
        query=q[None], key=k[None], value=v[None], g=g, beta=beta, initial_state=state_pool,
        output_final_state=True, cu_seqlens=starts, head_first=False, use_qk_l2norm_in_kernel=True,
        initial_state_indices=torch.as_tensor(slots, dtype=torch.int32))
    return result[0]


def test_negative_controls_stock_chunked_prefill_and_transformers(checkpoint, rollouts, monkeypatch):
    """The trainer with vLLM's own prefill kernel (chunked, what the engine runs without the
    plugin) is not μ, nor is transformers' bf16 forward: the one arithmetic is what matches."""
    from transformers import AutoModelForCausalLM

    from zero_mismatch_plugin.aligned import linear_attention

    prompts, responses, mu = rollouts[8]
    trainer = aligned_model(checkpoint)
    monkeypatch.setattr(linear_attention, "recurrent_gated_delta_rule", chunked_prefill_rule)
    with torch.no_grad():
        chunked = trainer.token_logprobs(pack(prompts, responses))
    # Close in the median (a routing flip downstream can move a token's logprob by a nat), never equal.
    assert not torch.equal(chunked, mu) and (chunked - mu).abs().median() < 0.1
    print(f"trainer with vLLM's chunked prefill kernel: {bitwise_report('', chunked, mu)}")
    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.bfloat16).eval()
    with torch.no_grad():
        standard = hf_token_logprobs(model, prompts, responses).float()
    assert not torch.equal(standard, mu) and (standard - mu).abs().median() < 0.1
    print(f"transformers bf16: {bitwise_report('', standard, mu)}")


def test_lora_on_every_module_at_batch_1_2_8_and_gradients_reach_only_the_adapter(engines, checkpoint, tmp_path):
    """An adapter on every module the engine adapts: the gated delta-net's in_proj_qkvz, in_proj_ba
    and out_proj, the gated attention's q/k/v/o, every routed expert and the shared experts. The
    engine serves it in bf16 (a LoRA engine wraps conv1d too, whose plain weight the one arithmetic
    reads from under the wrapper); the aligned model with it is bitwise at batch 1, 2 and 8, and its
    gradient reaches the adapter's A and B only, every gated delta-net pair included; ``zmrl bisect``
    with the adapter finds every op and LoRA step equal."""
    from safetensors import safe_open
    from vllm.lora.request import LoRARequest

    from support.aligned_checks import lora_generate
    from zero_mismatch_plugin.aligned.lora.adapter import build_adapter
    from zero_mismatch_plugin.faces.aligned_model import AlignedCausalLM

    adapter = build_adapter(tmp_path / "adapter", checkpoint, r=8, lora_alpha=16)
    with safe_open(adapter / "adapter_model.safetensors", "pt") as tensors:
        modules = {name.split(".lora_")[0].split(".layers.")[1] for name in tensors.keys()}
    assert {"0.linear_attn.in_proj_qkvz", "0.linear_attn.in_proj_ba", "0.linear_attn.out_proj",
            "2.self_attn.q_proj", "2.self_attn.o_proj", "0.mlp.experts.7.down_proj", "2.mlp.shared_expert.up_proj"} <= modules
    assert not any(m.startswith("2.linear_attn") or m.startswith("0.self_attn") for m in modules)
    lora_engine = dict(enable_lora=True, max_lora_rank=16, max_loras=2, max_model_len=MAX_MODEL_LEN, seed=0)
    llm = Engines(engines.pool, engines.checkpoints, scope=f"{__name__}.lora", dtype=BF16, **lora_engine).get(FAMILY)
    request = LoRARequest("qwen3-next", 1, str(adapter))
    trainer = AlignedCausalLM.from_pretrained(checkpoint, lora_dir=adapter, dtype=BF16, **lora_engine)
    prompts = prompts_for(checkpoint)
    for b in BATCHES:
        rows = lora_generate(llm, prompts[:b], [request] * b, seed=500)
        with torch.no_grad():
            logprobs = trainer.token_logprobs(pack([r[0] for r in rows], [r[1] for r in rows]))
        assert_bitwise(f"Qwen3-Next with LoRA on every module, batch {b}", logprobs, torch.cat([r[2] for r in rows]).float())
    trainer.token_logprobs(pack([r[0] for r in rows], [r[1] for r in rows])).sum().backward()
    assert all(p.grad is None for p in trainer.parameters() if p.requires_grad is False)
    trained = dict(trainer.lora.named_parameters())
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in trained.values())
    for name in ("layers.0.in_proj_qkvz.lora_A", "layers.1.in_proj_ba.lora_B", "layers.3.out_proj.lora_B"):
        assert trained[name].grad.abs().sum() > 0, name
    assert {n for n, p in trainer.named_parameters() if p.requires_grad} == {f"lora.{n}" for n in trained}
    # zmrl bisect with the same adapter: vLLM's LoRA layers outside the engine, every op and LoRA step equal.
    from support.linear_attention import assert_bisect_with_adapter_equal

    assert_bisect_with_adapter_equal(checkpoint, MAX_MODEL_LEN, BF16, adapter,
                                     ("in_proj_qkvz", "in_proj_ba", "out_proj", "shared_expert.gate_up_proj"))


def test_chunked_rule_is_the_recurrent_rule_in_float64():
    """The backward's chunked form of the gated delta rule against its recurrent definition, in
    float64, for lengths below, at and past the chunk (and a chunk that does not divide them)."""
    from zero_mismatch_plugin.aligned.linear_attention import gated_delta_rule_chunked, gated_delta_rule_reference

    gen = torch.Generator().manual_seed(0)
    for steps in (5, 64, 130):
        q, k = (torch.randn(steps, 2, 16, generator=gen, dtype=torch.float64) for _ in range(2))
        v = torch.randn(steps, 4, 8, generator=gen, dtype=torch.float64)
        a, b = (torch.randn(steps, 4, generator=gen, dtype=torch.float64) for _ in range(2))
        A_log, dt_bias = 2 * torch.rand(4, generator=gen, dtype=torch.float64), torch.randn(4, generator=gen, dtype=torch.float64)
        out, state = gated_delta_rule_reference(q, k, v, a, b, A_log, dt_bias)
        for chunk in (64, 7):
            chunked_out, chunked_state = gated_delta_rule_chunked(q, k, v, a, b, A_log, dt_bias, chunk=chunk)
            assert (chunked_out - out).abs().max() < 1e-12 and (chunked_state - state).abs().max() < 1e-12, (steps, chunk)


def test_gated_delta_rule_backward_against_float64():
    """The op's backward (vLLM's recurrent kernel forward, the reference recomputed in fp32 and
    differentiated) against float64 autograd of the reference, over two packed sequences."""
    from zero_mismatch_plugin.aligned.linear_attention import GatedDeltaRuleFn, gated_delta_rule_reference

    gen = torch.Generator().manual_seed(0)
    lens, hk, hv, d = [9, 21], 2, 4, 128
    t = sum(lens)
    shapes = [(t, hk, d), (t, hk, d), (t, hv, d), (t, hv), (t, hv)]
    inputs = [torch.randn(*s, generator=gen).bfloat16().requires_grad_(True) for s in shapes]
    A_log = torch.rand(hv, generator=gen).requires_grad_(True)
    dt_bias = torch.randn(hv, generator=gen).bfloat16().requires_grad_(True)
    grad_out = torch.randn(t, hv, d, generator=gen)
    out = GatedDeltaRuleFn.apply(*inputs, A_log, dt_bias, lens, torch.float32)
    out.backward(grad_out.bfloat16())
    leaves = [x.detach().double().requires_grad_(True) for x in (*inputs, A_log, dt_bias)]
    reference, start = [], 0
    for n in lens:
        rows = slice(start, start + n)
        reference.append(gated_delta_rule_reference(*(x[rows] for x in leaves[:5]), *leaves[5:])[0])
        start += n
    reference = torch.cat(reference)
    assert (out.double() - reference).abs().max() < 0.05  # the kernel's bf16 forward is the reference's
    reference.backward(grad_out.bfloat16().double())
    for name, mine, ref in zip(("q", "k", "v", "a", "b", "A_log", "dt_bias"), (*inputs, A_log, dt_bias), leaves):
        error = ((mine.grad.double() - ref.grad).norm() / ref.grad.norm()).item()
        assert error < 1e-2, (name, error)  # bf16 gradient storage; an error in the formula is O(1)


def test_linear_attention_layer_backward_against_float64_and_every_parameter_gets_a_gradient(checkpoint, rollouts):
    """One gated delta-net layer of the aligned model (bf16 forward: vLLM's linears, the fixed-order
    conv, the recurrent kernel, the gated norm; fp32 backward) against float64 autograd through
    transformers' ``Qwen3NextGatedDeltaNet`` holding the same weights, over two packed sequences
    (40 and 90 tokens): output and every gradient within bf16 round-off (~1e-2 measured; an error
    in a backward formula is O(1)). Through the whole model, every linear-attention parameter
    gets a finite, non-zero gradient (the model-level float64 comparison is dominated by MoE
    routing flips between bf16 and float64, so it is not the check of this layer)."""
    import functools

    from transformers import AutoConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    from zero_mismatch_plugin.faces.hybrid_layers import gated_delta_net_mixer

    trainer = aligned_model(checkpoint)
    prefix = "model.layers.0.linear_attn."
    reference = Qwen3NextGatedDeltaNet(AutoConfig.from_pretrained(str(checkpoint)), 0).double()
    reference.load_state_dict({n[len(prefix):]: p.detach().double() for n, p in trainer.named_parameters()
                               if n.startswith(prefix)}, strict=True)
    gen = torch.Generator().manual_seed(0)
    lens = [40, 90]
    hidden = torch.randn(sum(lens), trainer.config.hidden_size, generator=gen).bfloat16().requires_grad_(True)
    out = gated_delta_net_mixer(trainer.layer_ops[0], functools.partial(trainer._linear, 0), hidden, lens)
    grad_out = torch.randn(out.shape, generator=gen)
    out.float().backward(grad_out)
    hidden64 = hidden.detach().double().requires_grad_(True)
    ref_out = torch.cat([reference(part[None])[0] for part in hidden64.split(lens)])
    ref_out.backward(grad_out.double())
    ref = dict(reference.named_parameters())
    errors = {"output": ((out.double() - ref_out).norm() / ref_out.norm()).item(),
              "hidden": ((hidden.grad.double() - hidden64.grad).norm() / hidden64.grad.norm()).item()}
    for name, p in trainer.named_parameters():
        if name.startswith(prefix):
            key = name[len(prefix):]
            errors[key] = ((p.grad.double() - ref[key].grad).norm() / ref[key].grad.norm()).item()
    assert len(errors) == 2 + 7, errors
    print("gated delta-net layer vs float64, relative errors: " + ", ".join(f"{k} {v:.2g}" for k, v in errors.items()))
    assert max(errors.values()) < 0.05, errors

    trainer.zero_grad()
    prompts, responses, _ = rollouts[8]
    trainer.token_logprobs(pack(prompts, responses)).sum().backward()
    linear = {name: p for name, p in trainer.named_parameters() if ".linear_attn." in name}
    assert len(linear) == 3 * 7  # three gated delta-net layers, seven parameters each
    for name, p in linear.items():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


def test_zmrl_bisect_finds_every_op_equal_and_names_a_planted_difference(checkpoint):
    """``zmrl bisect`` on Qwen3-Next (bf16): vLLM's modules outside the engine, their gated
    delta-net layers reading fresh state slots, against the aligned model: every op equal, the
    linear-attention layers' projections and mixers and the gated full-attention layer among
    them; a one-ulp difference planted in a mixer or a linear-attention projection is named exactly."""
    from support.linear_attention import assert_bisect_equal_then_names_planted

    names = assert_bisect_equal_then_names_planted(
        checkpoint, MAX_MODEL_LEN, BF16, ("layers.0.in_proj_ba", "layers.3.mixer"))
    assert {"layers.0.in_proj_qkvz", "layers.1.mixer", "layers.2.attn", "layers.3.out_proj"} <= set(names)
