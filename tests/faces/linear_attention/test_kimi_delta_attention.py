"""Kimi Delta Attention (Kimi Linear) in consistent mode on CPU, where vLLM has no KDA path of its
own: the engine serves it through the plugin's one arithmetic and agrees with itself (a token
decoded has the bits of the same token re-prefilled, across the engine's 64-token chunked
scheduling of long prompts), and the aligned model computes those bits at engine batch 1, 2 and
8, in fp32 and in bf16 (a KDA layer with a dense MLP, then one with Kimi's MoE). Negative
controls: the chunked form of the rule (vLLM's prefill algorithm) in the trainer, the routed
scale where DeepSeek-V3 puts it, and in bf16 the fused add + norm other families end with. Backward:
the op against float64 autograd of the chunked form; every KDA parameter gets a gradient.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from support.aligned_checks import bitwise_report
from support.linear_attention import BATCHES, assert_bitwise, batch_rollouts, reprefilled
from support.vllm_session import MAX_MODEL_LEN, Engines, prompts_for

from zero_mismatch_plugin.aligned import pack

FAMILY = "kimi_linear"
# A long prompt is prefilled in pieces of this many tokens: the later pieces start from the conv
# and recurrent states the earlier ones left.
ENGINE = dict(max_num_batched_tokens=64)


@pytest.fixture(scope="module", autouse=True)
def _consistent(consistent_mode):
    yield


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def dtype(request):
    return request.param


@pytest.fixture(scope="module")
def checkpoint(engines):
    return engines.checkpoints[FAMILY]


@pytest.fixture(scope="module")
def engine(engines, dtype):
    return Engines(engines.pool, engines.checkpoints, scope=__name__, dtype=dtype, **ENGINE).get(FAMILY)


@pytest.fixture(scope="module")
def rollouts(engine, checkpoint):
    return batch_rollouts(engine, checkpoint, seed=600)


def aligned_model(checkpoint, dtype):
    from zero_mismatch_plugin.faces.aligned_model import AlignedCausalLM

    return AlignedCausalLM.from_pretrained(checkpoint, dtype=dtype, max_model_len=MAX_MODEL_LEN, seed=0, **ENGINE)


def test_engine_serves_kimi_linear_through_the_kda_patch(engine, dtype):
    from zero_mismatch_plugin.integrations.vllm import plugin

    assert engine.llm_engine.vllm_config.model_config.dtype == getattr(torch, dtype)
    assert {"cpu-kda-one-arithmetic", "cpu-kimi-no-cutlass-gemm-all-reduce"} <= set(plugin.applied())


def test_engine_decode_equals_reprefill_across_chunks(engine, rollouts):
    """Every sampled token's μ (decoded one at a time after a prefill in 64-token pieces) against
    the same sequences re-prefilled whole, eight at once."""
    prompts, responses, mu = rollouts[8]
    assert max(map(len, prompts)) > 128
    assert_bitwise("engine decode vs re-prefill", reprefilled(engine, prompts, responses), mu)


def test_aligned_model_bitwise_at_batch_1_2_8(checkpoint, rollouts, dtype):
    trainer = aligned_model(checkpoint, dtype)
    assert {p.dtype for p in trainer.parameters()} == {torch.float32}  # fp32 master weights
    for b, (prompts, responses, mu) in rollouts.items():
        with torch.no_grad():
            assert_bitwise(f"Kimi Linear aligned model ({dtype}), batch {b}",
                           trainer.token_logprobs(pack(prompts, responses)), mu)


def chunked_kda_recurrence(q, k, v, raw_g, raw_beta, A_log, dt_bias, lower_bound, states, seq_lens):
    """The trainer's recurrence replaced by the chunked form (the prefill kernel's algorithm), fp32,
    sequence by sequence from zero states."""
    from zero_mismatch_plugin.aligned.kimi_delta_attention import kda_chunked

    outputs, start = [], 0
    for n in seq_lens:
        rows = slice(start, start + n)
        out, _ = kda_chunked(*(x[rows].float() for x in (q, k, v, raw_g, raw_beta)), A_log.float(), dt_bias.float(),
                             lower_bound)
        outputs.append(out)
        start += n
    return torch.cat(outputs).to(v.dtype), states


def test_negative_controls_chunked_rule_routed_scale_and_fused_final_norm(checkpoint, rollouts, dtype, monkeypatch):
    """The trainer with the chunked form of the same rule is close to μ, never equal; so is the
    trainer whose MoE scales the routed output, as DeepSeek-V3's layer asks vLLM to (Kimi's scales
    the router's weights); in bf16 so is the trainer that ends with one fused add + norm, as the
    other families' models do (Kimi Linear adds the last residual in bf16 and norms after): the
    one arithmetic and the model's own op order are what match."""
    import dataclasses

    from zero_mismatch_plugin.aligned import kimi_delta_attention
    from zero_mismatch_plugin.tables import architectures
    from zero_mismatch_plugin.tables.kimi_linear import kimi_moe

    prompts, responses, mu = rollouts[8]
    trainer = aligned_model(checkpoint, dtype)
    with monkeypatch.context() as patched:
        patched.setattr(kimi_delta_attention, "kda_recurrence", chunked_kda_recurrence)
        with torch.no_grad():
            chunked = trainer.token_logprobs(pack(prompts, responses))
    assert not torch.equal(chunked, mu) and (chunked - mu).abs().median() < 0.1
    print(f"trainer with the chunked KDA ({dtype}): {bitwise_report('', chunked, mu)}")
    entry = architectures._ENTRIES["KimiLinearForCausalLM"]
    scaled_output = dataclasses.replace(entry, moe=lambda c: dataclasses.replace(kimi_moe(c), routed_scale_on_weights=False))
    with monkeypatch.context() as patched:
        patched.setitem(architectures._ENTRIES, "KimiLinearForCausalLM", scaled_output)
        with torch.no_grad():
            output_scaled = aligned_model(checkpoint, dtype).token_logprobs(pack(prompts, responses))
    assert not torch.equal(output_scaled, mu) and (output_scaled - mu).abs().median() < 0.1
    print(f"trainer scaling the routed output ({dtype}): {bitwise_report('', output_scaled, mu)}")
    if dtype == "bfloat16":
        trainer.blocks = dataclasses.replace(trainer.blocks, final_add_then_norm=False)
        with torch.no_grad():
            fused = trainer.token_logprobs(pack(prompts, responses))
        assert not torch.equal(fused, mu) and (fused - mu).abs().median() < 0.1
        print(f"trainer with a fused final add + norm (bf16): {bitwise_report('', fused, mu)}")


def test_kda_recurrence_is_the_chunked_rule_in_float64():
    """The recurrence every token goes through against the chunked form (an independent derivation
    of the same rule) in float64, both gate forms, lengths below, at and past the chunk."""
    from zero_mismatch_plugin.aligned.kimi_delta_attention import kda_chunked, kda_recurrence

    gen = torch.Generator().manual_seed(0)
    heads, dim = 3, 16
    for steps in (5, 16, 41):
        for lower_bound in (None, -3.0):
            q, k, v, raw_g = (torch.randn(steps, heads, dim, generator=gen, dtype=torch.float64) for _ in range(4))
            raw_beta = torch.randn(steps, heads, generator=gen, dtype=torch.float64)
            A_log = torch.log(1 + 15 * torch.rand(heads, generator=gen, dtype=torch.float64))
            dt_bias = 0.5 * torch.randn(heads * dim, generator=gen, dtype=torch.float64)
            zero = torch.zeros(1, heads, dim, dim, dtype=torch.float64)
            out, state = kda_recurrence(q, k, v, raw_g, raw_beta, A_log, dt_bias, lower_bound, zero, [steps])
            for chunk in (16, 7):
                chunked, chunked_state = kda_chunked(q, k, v, raw_g, raw_beta, A_log, dt_bias, lower_bound, chunk)
                assert (chunked - out).abs().max() < 1e-12, (steps, lower_bound, chunk)
                assert (chunked_state - state[0]).abs().max() < 1e-12, (steps, lower_bound, chunk)


def test_a_sequence_alone_and_in_a_packed_batch_gets_the_same_bits():
    """The product's invariance on this host, whatever its rounding: a sequence's KDA outputs and
    final state are the same bits alone, and packed among seven others of other lengths (so a
    different number of sequences is live at each step)."""
    from zero_mismatch_plugin.aligned.kimi_delta_attention import kda_recurrence

    gen = torch.Generator().manual_seed(1)
    heads, dim, lens = 4, 64, [3, 17, 40, 1, 9, 33, 25, 12]
    t = sum(lens)
    q, k, v, raw_g = (torch.randn(t, heads, dim, generator=gen) for _ in range(4))
    raw_beta = torch.randn(t, heads, generator=gen)
    A_log, dt_bias = torch.log(1 + 15 * torch.rand(heads, generator=gen)), 0.5 * torch.randn(heads * dim, generator=gen)
    states = torch.randn(len(lens), heads, dim, dim, generator=gen) * 0.1
    packed, final = kda_recurrence(q, k, v, raw_g, raw_beta, A_log, dt_bias, None, states, lens)
    start = 0
    for i, n in enumerate(lens):
        rows = slice(start, start + n)
        alone, alone_final = kda_recurrence(q[rows], k[rows], v[rows], raw_g[rows], raw_beta[rows], A_log, dt_bias,
                                            None, states[i:i + 1], [n])
        assert torch.equal(alone, packed[rows]) and torch.equal(alone_final[0], final[i]), i
        start += n


def test_kda_op_backward_against_float64_and_every_model_parameter_gets_a_gradient(checkpoint):
    """The trainer's KDA mixer (fixed-order conv, the recurrence, the gated norm; its backward:
    autograd through the conv and the norm, the chunked rule recomputed in float64 for the
    recurrence) against float64 autograd of an independent form (torch's conv1d, the chunked rule,
    the norm) over two packed sequences: output and every gradient within fp32 round-off (an error
    in the rule is O(1); a recomputation in fp32 cost the gate's gradients precision, up to 7e-6).
    Through the whole fp32 model, every KDA parameter of every layer gets a finite, non-zero
    gradient."""
    from zero_mismatch_plugin.aligned.kimi_delta_attention import kda_chunked

    trainer = aligned_model(checkpoint, "float32")
    op = trainer.layer_ops[0]["kda"]
    blocks = op.blocks
    size, heads, dim = blocks.projection_size, blocks.num_heads, blocks.head_dim
    gen = torch.Generator().manual_seed(0)
    lens = [23, 41]
    t = sum(lens)
    inputs = [torch.randn(t, n, generator=gen).requires_grad_(True) for n in (3 * size, size, size, heads)]
    out = op(*inputs, lens)
    grad_out = torch.randn(out.shape, generator=gen)
    out.backward(grad_out)
    params = [*op.conv_weights, op.A_log, op.dt_bias, op.norm_weight]

    leaves = [x.detach().double().requires_grad_(True) for x in (*inputs, *params)]
    mixed, g1, g2, raw_beta = leaves[:4]
    conv_weight = torch.cat([w.reshape(w.shape[0], -1) for w in leaves[4:7]])
    A_log, dt_bias, norm_weight = leaves[7:]
    outputs, start = [], 0
    for n in lens:
        rows = slice(start, start + n)
        x = torch.nn.functional.pad(mixed[rows].T[None], (conv_weight.shape[1] - 1, 0))
        conv = torch.nn.functional.conv1d(x, conv_weight[:, None, :], groups=conv_weight.shape[0])[0].T
        conv = conv * torch.sigmoid(conv)
        q, k, v = (c.reshape(n, heads, dim) for c in conv.split(size, dim=-1))
        core, _ = kda_chunked(q, k, v, g1[rows].reshape(n, heads, dim), raw_beta[rows], A_log, dt_bias,
                              blocks.gate_lower_bound)
        normed = core / torch.sqrt((core * core).mean(-1, keepdim=True) + blocks.norm_eps) * norm_weight
        outputs.append((normed * torch.sigmoid(g2[rows].reshape(n, heads, dim))).reshape(n, size))
        start += n
    reference = torch.cat(outputs)
    reference.backward(grad_out.double())
    errors = {"output": ((out.double() - reference).norm() / reference.norm()).item()}
    names = ("mixed_qkv", "g1", "g2", "raw_beta", "q_conv", "k_conv", "v_conv", "A_log", "dt_bias", "o_norm")
    for name, mine, ref in zip(names, (*inputs, *params), leaves):
        errors[name] = ((mine.grad.double() - ref.grad).norm() / ref.grad.norm()).item()
    print("relative error against float64:", {k: f"{v:.1e}" for k, v in errors.items()})
    assert max(errors.values()) < 1e-6, errors

    trainer.zero_grad()
    prompts = prompts_for(checkpoint)[:2]
    trainer.token_logprobs(pack(prompts, [p[:5] for p in prompts])).sum().backward()
    kda_params = {n: p for n, p in trainer.named_parameters() if ".self_attn." in n}
    assert len(kda_params) == 15 * trainer.config.num_hidden_layers
    for name, p in kda_params.items():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


def _bytes_saved_for_backward(run) -> int:
    """The bytes autograd keeps for the backward of what ``run()`` records (each tensor counted
    at every save)."""
    saved = []

    def pack(tensor):
        saved.append(tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        run()
    return sum(saved)


def test_the_kda_backward_keeps_the_inputs_not_a_state_per_position(checkpoint):
    """The trainer's recurrence keeps only its inputs for the backward (which recomputes the
    chunked form), not the [sequences, H, V, K] state of every position that autograd through
    :func:`kda_recurrence` kept; the gradients are those of the recurrence up to fp32 round-off."""
    from zero_mismatch_plugin.aligned.kimi_delta_attention import KdaRecurrenceFn, kda_recurrence

    blocks = aligned_model(checkpoint, "float32").layer_ops[0]["kda"].blocks
    heads, dim = blocks.num_heads, blocks.head_dim
    gen = torch.Generator().manual_seed(1)
    lens = [57, 71]
    t = sum(lens)
    inputs = [torch.randn(t, heads, dim, generator=gen) for _ in range(4)] + [torch.randn(t, heads, generator=gen)]
    params = [torch.randn(heads, generator=gen), torch.randn(heads * dim, generator=gen)]
    leaves = [x.requires_grad_(True) for x in (*inputs, *params)]
    input_bytes = sum(x.numel() * x.element_size() for x in leaves)

    def through_the_function():
        through_the_function.out = KdaRecurrenceFn.apply(*leaves, blocks.gate_lower_bound, lens)

    def through_the_recurrence():  # the trainer's form before: autograd through every step
        zero = torch.zeros(len(lens), heads, dim, dim)
        through_the_recurrence.out, _ = kda_recurrence(*leaves, blocks.gate_lower_bound, zero, lens)

    kept = _bytes_saved_for_backward(through_the_function)
    stepwise = _bytes_saved_for_backward(through_the_recurrence)
    print(f"saved for backward: {kept} bytes (inputs {input_bytes}); autograd through the steps: {stepwise}")
    assert kept == input_bytes
    assert stepwise > 10 * input_bytes  # the control: what the bound rules out

    out, reference = through_the_function.out, through_the_recurrence.out
    assert torch.equal(out, reference)  # the forward is the recurrence's, bit for bit
    grad_out = torch.randn(out.shape, generator=gen)
    mine = torch.autograd.grad(out, leaves, grad_out)
    theirs = torch.autograd.grad(reference, leaves, grad_out)
    for name, a, b in zip(("q", "k", "v", "raw_g", "raw_beta", "A_log", "dt_bias"), mine, theirs):
        assert ((a - b).norm() / b.norm()).item() < 1e-5, name

def test_zmrl_check_passes_every_check_on_kimi_linear_in_bf16(checkpoint, tmp_path, capsys):
    """``zmrl check --dtype bfloat16`` as a user runs it on the tiny Kimi Linear checkpoint (its own
    engine): every check passes, the experts' choice among them (vLLM's modules outside the engine);
    the prefix-cache check is skipped with the reason (vLLM's CPU engine serves no prefix-cache hit
    for linear-attention layers, so consistent mode keeps it off)."""
    import json

    from zero_mismatch_plugin.tools import cli

    out = tmp_path / "check.json"
    code = cli.main(["check", "--model", str(checkpoint), "--dtype", "bfloat16", "--max-model-len", str(MAX_MODEL_LEN),
                     "--num-prompts", "4", "--max-tokens", "8", "--quiet", "--json", str(out)])
    table = capsys.readouterr().out
    report = json.loads(out.read_text())
    assert code == 0, table
    assert "prefix_cache       skip    not run: KimiLinearForCausalLM has linear-attention layers" in table, table
    assert "prefix_cache" not in report
    for name in ("sampled_token", "full_distribution", "expert_selection", "batch_composition", "prefill_vs_decode"):
        assert report[name]["pass"] is True, (name, table)


def test_lora_on_every_module_at_batch_1_2_8_and_gradients_reach_only_the_adapter(engines, checkpoint, tmp_path):
    """An adapter on every KDA projection (q/k/v, beta and the decay's f_a in vLLM's merged
    in_proj_qkvgfab; f_b, g_a, g_b, o), the dense MLP, every routed expert and the shared experts,
    served by the bf16 engine (vLLM gives KimiLinearForCausalLM no LoRA support: the plugin's
    patch does, with the experts' checkpoint names) and run by the aligned model: bitwise at batch
    1, 2 and 8, next to requests without the adapter; the gradient reaches the adapter's A and B
    only, every pair of them; ``zmrl bisect`` with the adapter finds every op and LoRA step equal."""
    from safetensors import safe_open
    from vllm.lora.request import LoRARequest

    from support.aligned_checks import lora_generate
    from zero_mismatch_plugin.aligned.lora.adapter import build_adapter
    from zero_mismatch_plugin.faces.aligned_model import AlignedCausalLM

    adapter = build_adapter(tmp_path / "adapter", checkpoint, r=8, lora_alpha=16)
    with safe_open(adapter / "adapter_model.safetensors", "pt") as tensors:
        modules = {name.split(".lora_")[0].split(".layers.")[1] for name in tensors.keys()}
    assert {f"0.self_attn.{t}" for t in ("q_proj", "b_proj", "f_a_proj", "f_b_proj", "g_a_proj", "g_b_proj", "o_proj")
            } | {"0.mlp.down_proj", "1.block_sparse_moe.experts.7.w2", "1.block_sparse_moe.shared_experts.up_proj"} <= modules
    lora_engine = dict(enable_lora=True, max_lora_rank=8, max_loras=2, max_model_len=MAX_MODEL_LEN, seed=0)
    llm = Engines(engines.pool, engines.checkpoints, scope=f"{__name__}.lora", dtype="bfloat16", **lora_engine).get(FAMILY)
    request = LoRARequest("kimi-linear", 1, str(adapter))
    trainer = AlignedCausalLM.from_pretrained(checkpoint, lora_dir=adapter, dtype="bfloat16", **lora_engine)
    prompts = prompts_for(checkpoint)
    for b in BATCHES:
        requests = [request if i % 2 == 0 else None for i in range(b)]  # base requests beside adapted ones
        rows = lora_generate(llm, prompts[:b], requests, seed=700)
        for adapted in (True, False):
            chosen = [r for r in rows if (r[3] is not None) == adapted]
            if not chosen:
                continue
            with torch.no_grad(), (trainer.adapter_disabled() if not adapted else contextlib.nullcontext()):
                logprobs = trainer.token_logprobs(pack([r[0] for r in chosen], [r[1] for r in chosen]))
            assert_bitwise(f"Kimi Linear, LoRA on every module (adapter {adapted}), batch {b}", logprobs,
                           torch.cat([r[2] for r in chosen]).float())
    chosen = [r for r in rows if r[3] is not None]
    trainer.token_logprobs(pack([r[0] for r in chosen], [r[1] for r in chosen])).sum().backward()
    trained = dict(trainer.lora.named_parameters())
    assert len(trained) == 2 * (12 + 9 + 8 * 3 + 3)  # layer 0: KDA + MLP; layer 1: KDA, 8 experts, shared
    for name, p in trained.items():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
    assert {n for n, p in trainer.named_parameters() if p.requires_grad} == {f"lora.{n}" for n in trained}
    # zmrl bisect with the same adapter: vLLM's LoRA layers outside the engine, every op and LoRA step equal.
    from support.linear_attention import assert_bisect_with_adapter_equal

    assert_bisect_with_adapter_equal(checkpoint, MAX_MODEL_LEN, "bfloat16", adapter,
                                     ("in_proj", "g_a_proj", "g_b_proj", "f_b_proj", "o_proj", "gate_up_proj"))


def test_zmrl_bisect_finds_every_op_equal_and_names_a_planted_difference(checkpoint):
    """``zmrl bisect`` on Kimi Linear (fp32): vLLM's modules outside the engine against the aligned
    model, every op equal — each KDA projection, the mixer, the MoE, and the final norm on the
    scored rows (Kimi norms after its last residual sum, in compute_logits) — and a one-ulp
    difference planted in the mixer, a decay projection or the last residual sum is named exactly."""
    from support.linear_attention import assert_bisect_equal_then_names_planted

    names = assert_bisect_equal_then_names_planted(
        checkpoint, MAX_MODEL_LEN, "float32", ("layers.0.f_b_proj", "layers.1.mixer", "final_norm.input"))
    assert {"layers.0.in_proj", "layers.0.g_a_proj", "layers.1.mixer", "layers.1.experts", "final_norm.input"} <= set(names)


def test_engine_step_without_metadata_is_skipped_and_speculative_decoding_is_refused_by_name():
    """The engine side's entry (the runtime patch and the fork patch call it): a profile or warm-up
    step (no metadata for the layer) leaves the output alone; a step with draft tokens is refused,
    saying what to change, before anything is written."""
    from types import SimpleNamespace

    from zero_mismatch_plugin.aligned.kimi_delta_attention import cpu_kda_forward

    layer = SimpleNamespace(prefix="model.layers.0.self_attn")
    out = torch.full((1, 3, 2, 4), 7.0)
    cpu_kda_forward(layer, None, None, None, None, None, out)
    cpu_kda_forward(layer, {"model.layers.1.self_attn": object()}, None, None, None, None, out)
    assert torch.equal(out, torch.full((1, 3, 2, 4), 7.0))
    drafting = SimpleNamespace(spec_sequence_masks=torch.ones(1, dtype=torch.bool))
    with pytest.raises(NotImplementedError, match="speculative decoding are not covered.*serve without speculative"):
        cpu_kda_forward(layer, {layer.prefix: drafting}, None, None, None, None, out)
    assert torch.equal(out, torch.full((1, 3, 2, 4), 7.0))
