"""Mixture-of-Experts checkpoints (Qwen3-MoE, Qwen2-MoE with a gated shared expert and a dense
layer, Mixtral, GLM-4.5-style grouped sigmoid routing with a dense first layer and partial rotary):
engine μ vs the aligned trainer, bitwise, for engine batches of 1..8 sequences and for the top-20
distribution; transformers' MoE forward as the negative control; the custom backward per
parameter kind against float64 autograd; an optimizer step and a weight sync; refusals.

Tests are grouped by family (a module-scoped parametrized fixture), so each engine starts once;
the weight-sync test runs last in each group because it changes both sides' weights.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

from support import aligned_checks as checks
from support.vllm_session import hf_token_logprobs, prompts_for, rollout

from zero_mismatch_plugin.aligned import pack
from zero_mismatch_plugin.tools.tiny_models import MOE_FAMILIES


# Every family is compared token by token with the engine, at every engine batch size. Torch's CPU
# sigmoid rounds the tail of a call (the last numel % 32 elements on AVX-512) with another formula
# than the rest, so GLM-4.5's sigmoid router scores and Qwen2-MoE's shared-expert gate ([M, 1])
# had bits that depended on the engine step's token count; in consistent mode both sides compute
# those sigmoids with aligned.row_invariant.row_invariant_sigmoid (the engine through vllm_cpu_sigmoid).
ENGINE_INVARIANT = ("qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe")


@pytest.fixture(scope="module", params=ENGINE_INVARIANT)
def family(request):
    return request.param


def _top20_rollout(llm, prompts, seed):
    """Like ``rollout`` with one sample per prompt, also keeping the engine's top-20 per step."""
    from vllm import SamplingParams

    params = [
        SamplingParams(n=1, temperature=1.0, max_tokens=16, ignore_eos=True, logprobs=20, seed=seed + i)
        for i in range(len(prompts))
    ]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    responses, steps = [], []
    for out in outs:
        completion = out.outputs[0]
        responses.append(list(completion.token_ids))
        steps.extend(completion.logprobs)
    return responses, steps


def test_moe_trainer_logprobs_bitwise_equal_engine(engines, trainers, family):
    """Sampled-token μ of 16 sequences (8 prompts x 2 samples, mixed lengths) bitwise equal."""
    _, _, mu = checks.check_bitwise_equal(engines, trainers, family)
    print(f"{family}: {mu.numel()} tokens bitwise equal")


def test_moe_equal_for_every_engine_batch_size_and_top20(engines, trainers, family):
    """The engine's batch composition does not move the trainer off its bits: batches of 1, 2, 5
    and 8 sequences; and the top-20 logprobs of every step equal the trainer's full distribution
    at those tokens."""
    from zero_mismatch_plugin.aligned.sampling import vllm_logprobs

    llm = engines.get(family)
    trainer = trainers(family)
    prompts = prompts_for(trainer.runtime.model_dir)
    for size in (1, 2, 5, 8):
        responses, steps = _top20_rollout(llm, prompts[:size], seed=400)
        batch = pack(prompts[:size], responses)
        with torch.no_grad():
            full = vllm_logprobs(trainer.logits(batch))
        # Each step holds the top-20 and the sampled token (21 entries when it is not in the top-20).
        rows = torch.cat([torch.full((len(step),), i) for i, step in enumerate(steps)])
        ids = torch.cat([torch.tensor(list(step)) for step in steps])
        engine = torch.tensor([lp.logprob for step in steps for lp in step.values()], dtype=torch.float32)
        assert min(len(step) for step in steps) >= 20 and full.shape[0] == len(steps)
        ours = full[rows, ids]
        message = f"{family}, batch of {size}: {(ours == engine).float().mean().item():.1%} of top-20 equal"
        print(message)
        assert torch.equal(ours, engine), message


def _hf_moe_model(model_dir, dtype):
    from transformers import AutoModelForCausalLM

    # The eager experts loop: transformers' grouped GEMM has no float64 kernel.
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, experts_implementation="eager")
    return checks._without_padding_idx(model).eval()


def test_moe_transformers_forward_is_close_but_not_bitwise(engines, trainers, family):
    """Negative control: transformers' MoE forward of the same checkpoint is within 1e-4 of μ but
    not bit-equal on every token (the fraction depends on the host's kernels: printed)."""
    llm = engines.get(family)
    trainer = trainers(family)
    prompts, responses, mu = rollout(llm, prompts_for(trainer.runtime.model_dir), seed=50)
    with torch.no_grad():
        hf = hf_token_logprobs(_hf_moe_model(trainer.runtime.model_dir, torch.float32), prompts, responses)
    equal = (hf == mu).float().mean().item()
    diff = (hf - mu).abs().max().item()
    print(f"{family}: transformers fp32 vs engine: {equal:.1%} of {mu.numel()} tokens bit-equal, max |diff| {diff:.3g}")
    assert diff < 1e-4
    assert equal < 1.0


# transformers keeps each layer's experts fused ([E, 2I, H] gate_up, [E, H, I] down) and names the
# block "mlp"; the trainer keeps the checkpoint's per-expert tensors and block names.
_FUSED = re.compile(r"^(model\.layers\.\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")


def _trainer_grads_of(reference_model, trainer) -> dict[str, torch.Tensor]:
    from zero_mismatch_plugin.faces.aligned_model import _MOE_NAMES

    block, _, (g, u, d), _ = _MOE_NAMES[trainer.blocks.moe.names]
    out = {}
    for name, p in reference_model.named_parameters():
        if p.grad is None:
            continue
        fused = _FUSED.match(name)
        if fused:
            layer, kind = fused.groups()
            for e in range(p.shape[0]):
                prefix = f"{layer}.{block}.experts.{e}"
                if kind == "down_proj":
                    out[f"{prefix}.{d}.weight"] = p.grad[e]
                else:
                    gate, up = p.grad[e].chunk(2, dim=0)
                    out[f"{prefix}.{g}.weight"], out[f"{prefix}.{u}.weight"] = gate, up
        else:
            out[name.replace(".mlp.", f".{block}.") if ".mlp.gate." in name else name] = p.grad
    return out


def _kind(name: str) -> str:
    if ".experts." in name:
        return "expert " + name.rsplit(".", 2)[-2]
    for key in ("shared_expert_gate", "shared_expert", "gate.weight", "embed", "norm", "proj"):
        if key in name:
            return key
    return name


def test_moe_backward_matches_float64_per_parameter_kind(engines, trainers, family):
    """Every parameter's gradient (experts, router gate, shared expert and its gate, attention,
    norms, embedding) within GRAD_REL_TOL of float64 autograd through transformers."""
    llm = engines.get(family)
    trainer = trainers(family)
    prompts, responses, _ = rollout(llm, prompts_for(trainer.runtime.model_dir), seed=90, n=1)
    batch = pack(prompts, responses)
    coeffs = torch.randn(batch.target_ids.numel(), generator=torch.Generator().manual_seed(0))

    trainer.zero_grad(set_to_none=True)
    (trainer.token_logprobs(batch) * coeffs).sum().backward()
    aligned = {n: p.grad.detach().clone() for n, p in trainer.named_parameters() if p.requires_grad}
    trainer.zero_grad(set_to_none=True)

    reference = _hf_moe_model(trainer.runtime.model_dir, torch.float64)
    (hf_token_logprobs(reference, prompts, responses) * coeffs.double()).sum().backward()
    ref_grads = _trainer_grads_of(reference, trainer)

    worst: dict[str, float] = {}
    for name, grad in aligned.items():
        ref = ref_grads.get(name)
        if ref is None:
            ref = torch.zeros_like(grad, dtype=torch.float64)  # an expert no token chose
        denom = ref.norm().clamp_min(1e-30)
        rel = ((grad.double() - ref).norm() / denom).item() if ref.norm() > 0 else grad.abs().max().item()
        worst[_kind(name)] = max(worst.get(_kind(name), 0.0), rel)
        assert rel < checks.GRAD_REL_TOL, f"{name}: relative gradient error {rel:.3g}"
    kinds = set(worst)
    assert {"expert gate_proj", "expert up_proj", "expert down_proj"} <= kinds or {
        "expert w1", "expert w3", "expert w2"} <= kinds
    assert "gate.weight" in kinds  # the router
    print(f"{family}: worst relative gradient error per kind vs float64: "
          + ", ".join(f"{k} {v:.2g}" for k, v in sorted(worst.items())))


def test_moe_equal_again_after_optimizer_step_and_weight_sync(engines, trainers, family):
    """One AdamW step changes expert, router and shared weights; vLLM's own loader takes them into
    the engine; the next rollout is again bitwise equal (the trainer re-derived its layouts)."""
    trainer = trainers(family)
    before = {n: p.detach().clone() for n, p in trainer.named_parameters()}
    checks.check_update_and_sync(engines, trainers, family)
    changed = [n for n, p in trainer.named_parameters() if not torch.equal(p.detach(), before[n])]
    assert any(".experts." in n for n in changed) and any("gate.weight" in n for n in changed)


# ----- refusals (no engine) -----------------------------------------------------------------


def _config(architecture, **fields):
    return SimpleNamespace(architectures=[architecture], hidden_size=256, num_attention_heads=4,
                           num_hidden_layers=2, **fields)


@pytest.mark.parametrize(
    "config, message",
    [
        (_config("Qwen3MoeForCausalLM", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                 quantization_config={"quant_method": "fp8"}), "quantized experts"),
        (_config("Glm4MoeForCausalLM", n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                 n_group=3, topk_group=1, n_shared_experts=1), "not divisible by n_group"),
        (_config("Qwen3MoeForCausalLM", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                 shared_expert_intermediate_size=64), "shared_expert_intermediate_size"),
        (_config("Qwen3MoeForCausalLM", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                 hidden_act="gelu"), "hidden_act"),
        (_config("DeepseekV3ForCausalLM"), "not supported"),
    ],
)
def test_unsupported_moe_configs_are_refused_before_any_engine(config, message):
    from zero_mismatch_plugin.tables.architectures import describe

    with pytest.raises(NotImplementedError, match=message):
        describe(config)


@pytest.mark.parametrize(
    "engine_kwargs, message",
    [
        (dict(enable_expert_parallel=True), "enable_expert_parallel"),
        # vLLM's own config check refuses load balancing on CPU; the plugin's names it elsewhere.
        (dict(enable_eplb=True), "enable_eplb|load balancing"),
    ],
)
def test_expert_parallel_engine_settings_are_refused(checkpoints, engine_kwargs, message):
    """The aligned forward runs vLLM's one-process MoE layer: expert parallelism is refused when
    the trainer is built, with the setting named."""
    from zero_mismatch_plugin.faces.aligned_model import AlignedCausalLM

    with pytest.raises((NotImplementedError, ValueError), match=message):
        AlignedCausalLM.from_pretrained(checkpoints["qwen3_moe"], max_model_len=256, seed=0, **engine_kwargs)


def test_moe_blocks_of_each_family(checkpoints):
    from transformers import AutoConfig

    from zero_mismatch_plugin.tables.architectures import describe

    blocks = {f: describe(AutoConfig.from_pretrained(str(checkpoints[f]))) for f in MOE_FAMILIES}
    assert [blocks[f].mlp_kind(i) for f in MOE_FAMILIES for i in (0, 1)] == [
        "moe", "moe", "moe", "dense", "moe", "moe", "dense", "moe"]
    glm = blocks["glm4_moe"].moe
    assert (glm.scoring_func, glm.grouped_topk, glm.n_group, glm.topk_group) == ("sigmoid", True, 4, 2)
    assert glm.e_score_correction_bias and glm.routed_scaling_factor == 1.5
    assert blocks["glm4_moe"].partial_rotary_factor == 0.5
    assert blocks["qwen2_moe"].moe.shared_expert_gate and not blocks["qwen2_moe"].moe.norm_topk_prob
    assert blocks["mixtral"].moe.names == "mixtral"


# ----- padded expert width, re-derivation, Qwen2-MoE -----------------------------------------


def test_moe_layer_rederived_after_in_place_update_equals_a_fresh_layer(trainers):
    """After an in-place update of expert and router weights, the op's engine layout (loaded,
    padded and packed by vLLM) is re-derived: same bits as a layer built from scratch."""
    from zero_mismatch_plugin.aligned.moe import AlignedMoE

    trainer = trainers("qwen3_moe_padded")
    ops = trainer.layer_ops[0]
    moe_op = ops["experts"]
    x = torch.randn(37, trainer.config.hidden_size, generator=torch.Generator().manual_seed(3))
    saved = [p.detach().clone() for p in moe_op.params]
    with torch.no_grad():
        before = moe_op(x, ops["router"](x))
        for p in moe_op.params[::3]:
            p.mul_(1.25)  # what an optimizer step does: an in-place update
        after = moe_op(x, ops["router"](x))
        fresh = AlignedMoE(trainer.runtime, moe_op.moe, trainer.config.hidden_size,
                           moe_op.gate, moe_op.up, moe_op.down)(x, ops["router"](x))
        for p, value in zip(moe_op.params, saved):
            p.copy_(value)
    assert not torch.equal(before, after)
    assert torch.equal(after, fresh)


def test_padded_expert_width_bitwise_equal_engine_before_and_after_sync(engines, trainers):
    """Expert width 80: vLLM's CPU experts zero-pad it to 96 at load; the trainer gets the same
    padding from the same post-load processing, and the same bits; again after an optimizer step
    and a weight sync (both sides pad and pack the new weights as at the first load)."""
    _, _, mu = checks.check_bitwise_equal(engines, trainers, "qwen3_moe_padded")
    print(f"qwen3_moe_padded: {mu.numel()} tokens bitwise equal")
    checks.check_update_and_sync(engines, trainers, "qwen3_moe_padded")


def test_qwen2_moe_trainer_equals_vllm_modules_teacher_forced(checkpoints, engines):
    """Qwen2-MoE (gated shared expert, unrenormalized top-k, a dense layer): the trainer equals
    vLLM's own model run teacher-forced on the same packed batch, bitwise, and the engine's μ.
    A fresh engine and trainer: the family tests above update the shared ones' weights."""
    from zero_mismatch_plugin.faces.aligned_model import AlignedCausalLM
    from zero_mismatch_plugin.tools.checker.engine import engine_settings
    from zero_mismatch_plugin.tools.checker.engine_modules import EngineModules

    trainer = AlignedCausalLM.from_pretrained(checkpoints["qwen2_moe"], max_model_len=256, seed=0)
    llm = engines.fresh("qwen2_moe")
    prompts, responses, mu = rollout(llm, prompts_for(trainer.runtime.model_dir))
    batch = pack(prompts, responses)
    with torch.no_grad():
        ours = trainer.token_logprobs(batch)
    with EngineModules(engine_settings(trainer.runtime.model_dir, 256, seed=0)) as modules:
        full = modules.forward(batch)
    reference = full.gather(1, batch.target_ids[:, None].to(full.device))[:, 0]
    print(f"qwen2_moe: trainer vs engine μ: {(ours == mu).float().mean().item():.1%} of {mu.numel()} "
          f"bit-equal (max |diff| {(ours - mu).abs().max().item():.3g})")
    assert torch.equal(ours, reference), f"{(ours == reference).float().mean().item():.1%} equal"
    assert torch.equal(ours, mu)


# ----- the row-count-invariant sigmoid (GLM-4.5 router scores, Qwen2-MoE shared-expert gate) -----


SIGMOID_ROWS = (*range(1, 70), 100, 129, 257, 1000, 2100)


def _row_variance(sigmoid, width, reference_rows=3000):
    """The row counts M at which sigmoid(x[:M]) differs from the first M rows of sigmoid(x)."""
    x = torch.randn(reference_rows, width, generator=torch.Generator().manual_seed(width))
    reference = sigmoid(x)
    return [m for m in SIGMOID_ROWS if not torch.equal(sigmoid(x[:m].contiguous()), reference[:m])]


@pytest.mark.parametrize("width", [1, 8, 20, 64, 160])
def test_row_invariant_sigmoid_gives_each_row_the_same_bits_at_every_row_count(width):
    """aligned.row_invariant.row_invariant_sigmoid: a row's bits do not depend on how many rows the call
    holds (asserted at every M); torch.sigmoid's own variance on this host is printed."""
    from zero_mismatch_plugin.aligned.row_invariant import row_invariant_sigmoid

    stock = _row_variance(torch.sigmoid, width)
    print(f"width {width}: torch.sigmoid differs from the 3000-row call at {len(stock)} of "
          f"{len(SIGMOID_ROWS)} row counts {stock[:8]}")
    assert _row_variance(row_invariant_sigmoid, width) == []
    x = torch.randn(37, width, dtype=torch.float64, requires_grad=True)
    assert (row_invariant_sigmoid(x.float()) - torch.sigmoid(x).float()).abs().max() < 1e-6
    (grad,) = torch.autograd.grad(row_invariant_sigmoid(x).sum(), x)
    assert torch.allclose(grad, torch.sigmoid(x) * (1 - torch.sigmoid(x)))


def test_engine_router_sigmoid_patch_is_row_count_invariant_and_removable():
    """The consistent-mode patch of vLLM's CPU grouped top-k (GLM-4.5 / DeepSeek-V3 routing):
    the weights and experts of a token do not depend on the token count; removing the patch puts
    vLLM's function back."""
    from vllm.model_executor.layers.fused_moe.router import cpu_router

    from zero_mismatch_plugin.integrations import patches as runtime_patches
    from zero_mismatch_plugin.integrations.vllm.cpu_sigmoid import ROUTER_SIGMOID

    def route(logits):
        return cpu_router._grouped_topk(logits, topk=2, renormalize=True, num_expert_group=4, topk_group=2,
                                        scoring_func="sigmoid", routed_scaling_factor=1.5,
                                        e_score_correction_bias=bias)

    def variant_rows(logits):
        weights, ids = route(logits)
        return [m for m in SIGMOID_ROWS if m <= logits.shape[0] and not all(
            torch.equal(a, b[:m]) for a, b in zip(route(logits[:m].contiguous()), (weights, ids)))]

    gen = torch.Generator().manual_seed(0)
    logits, bias = torch.randn(2100, 8, generator=gen), 0.1 * torch.randn(8, generator=gen)
    # An engine started earlier in this process applied it already: taken out here, put back after.
    was_applied = runtime_patches.is_applied(ROUTER_SIGMOID)
    runtime_patches.remove(ROUTER_SIGMOID)
    try:
        stock_function = cpu_router._grouped_topk
        stock = variant_rows(logits)
        runtime_patches.apply(ROUTER_SIGMOID)
        assert cpu_router._grouped_topk is not stock_function
        patched = variant_rows(logits)
        runtime_patches.remove(ROUTER_SIGMOID)
        assert cpu_router._grouped_topk is stock_function
    finally:
        if was_applied:
            runtime_patches.apply(ROUTER_SIGMOID)
    print(f"stock router: top-k weights depend on the token count at {len(stock)} of {len(SIGMOID_ROWS)} counts")
    assert patched == []
