"""Mixture-of-Experts checkpoints through the aligned megatron-core spec (megatron's MoE layer,
router and experts computed by the op layer's MoE op) against the live vLLM engine and against
the aligned trainer model (tests/faces/aligned_model/test_aligned_moe.py checks that one against the engine).

Qwen3-MoE and Mixtral: sampled tokens and top-20 bitwise equal to the engine, again after an
optimizer step and a weight sync. Qwen2-MoE (gated shared expert, a dense layer) and GLM-4.5
(grouped sigmoid routing, shared experts, a dense first layer, partial rotary): bitwise equal to
the aligned face, forward; for every family the backward equals the aligned face's. The session's
engines and aligned trainers are shared with tests/aligned; each model here first takes the
trainer's current weights (earlier tests may have stepped and synced them).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from support.vllm_session import prompts_for, rollout
from zero_mismatch_plugin.aligned import pack
from zero_mismatch_plugin.aligned.checkpoint import copy_checkpoint
from zero_mismatch_plugin.faces.megatron import convert
from zero_mismatch_plugin.integrations.megatron.standalone import build_gpt_model, packed_logits, token_logprobs_from_logits
from zero_mismatch_plugin.tools.tiny_models import MOE_FAMILIES

ENGINE_FAMILIES = ("qwen3_moe", "mixtral")
# Relative L2 difference allowed between a megatron gradient and the aligned face's, per tensor:
# fp32 summation-order round-off (measured ~1e-7); a wrong layout or a missing term is O(1).
GRAD_REL_BOUND = 1e-5


def _megatron_like(trainer, **config_overrides):
    """An aligned GPTModel of the trainer's checkpoint carrying the trainer's current weights."""
    model = build_gpt_model(trainer.runtime, aligned=True, load=False, **config_overrides)
    state = {k: v.detach() for k, v in trainer.state_dict().items()}
    copy_checkpoint(convert.model_tensors(model), convert.hf_to_megatron(state, trainer.config))
    return model


def _logprobs(model, batch):
    return token_logprobs_from_logits(packed_logits(model, batch), batch)


def _report(name, got, expected):
    equal = (got == expected).float().mean().item()
    return f"{name}: {equal:.1%} of {expected.numel()} bitwise equal, max |diff| {(got - expected).abs().max().item():.3g}"


def _random_batch(seed=5):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(4, 500, (n,), generator=g).tolist() for n in (3, 7, 12, 5)]
    return pack(prompts, [torch.randint(4, 500, (20,), generator=g).tolist() for _ in prompts])


def _megatron_and_engine(engines, trainers, family):
    """(megatron model, engine serving its weights, the family's prompts)."""
    trainer = trainers(family)
    model = _megatron_like(trainer)
    llm = engines.get(family)
    convert.sync_weights_to_engine(llm, model, trainer.config, trainer.runtime.dtype)
    return model, llm, prompts_for(trainer.runtime.model_dir)


@pytest.fixture(scope="module", params=ENGINE_FAMILIES)
def engine_family(request):
    return request.param


def test_moe_megatron_logprobs_bitwise_equal_engine(engines, trainers, engine_family):
    """16 sampled sequences; then the top-20 of every step for engine batches of 1 and 8."""
    from vllm import SamplingParams

    from zero_mismatch_plugin.aligned.sampling import vllm_logprobs

    model, llm, prompts = _megatron_and_engine(engines, trainers, engine_family)
    model.eval()
    seq_prompts, responses, mu = rollout(llm, prompts, seed=7)
    with torch.no_grad():
        logprobs = _logprobs(model, pack(seq_prompts, responses))
    assert logprobs.shape == mu.shape
    assert torch.equal(logprobs, mu), _report(engine_family, logprobs, mu)
    print(_report(f"{engine_family} megatron vs engine", logprobs, mu))

    for size in (1, 8):
        params = [SamplingParams(max_tokens=12, ignore_eos=True, logprobs=20, seed=400 + i) for i in range(size)]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:size]], params, use_tqdm=False)
        steps = [step for out in outs for step in out.outputs[0].logprobs]
        batch = pack(prompts[:size], [list(out.outputs[0].token_ids) for out in outs])
        with torch.no_grad():
            full = vllm_logprobs(packed_logits(model, batch).index_select(0, batch.target_rows))
        rows = torch.cat([torch.full((len(step),), i) for i, step in enumerate(steps)])
        ids = torch.tensor([t for step in steps for t in step])
        engine = torch.tensor([lp.logprob for step in steps for lp in step.values()], dtype=torch.float32)
        assert min(len(step) for step in steps) >= 20
        assert torch.equal(full[rows, ids], engine), _report(f"top-20, batch of {size}", full[rows, ids], engine)


def test_moe_megatron_equal_engine_after_optimizer_step_and_weight_sync(engines, trainers, engine_family):
    """One AdamW step on the megatron model changes expert, router and attention weights; they
    reach the engine through the layout map and vLLM's loader; the next rollout is bitwise equal."""
    model, llm, prompts = _megatron_and_engine(engines, trainers, engine_family)
    model.train()
    config, dtype = trainers(engine_family).config, trainers(engine_family).runtime.dtype
    before_prompts, before_responses, before_mu = rollout(llm, prompts, seed=200)
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3)
    (-_logprobs(model, pack(before_prompts, before_responses)).mean()).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    changed = [k for k, p in model.named_parameters() if not torch.equal(p.detach(), before[k])]
    assert any(".local_experts." in k for k in changed) and any("router.weight" in k for k in changed)

    convert.sync_weights_to_engine(llm, model, config, dtype)
    after_prompts, after_responses, after_mu = rollout(llm, prompts, seed=200)
    assert after_responses != before_responses or not torch.equal(after_mu, before_mu)
    with torch.no_grad():
        logprobs = _logprobs(model.eval(), pack(after_prompts, after_responses))
    assert torch.equal(logprobs, after_mu), _report("after step + sync", logprobs, after_mu)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_moe_megatron_forward_and_backward_equal_aligned_face(trainers, family):
    """Logprobs bitwise equal to the aligned trainer model's; every gradient (experts, router,
    shared expert and its gate, attention, norms, embedding) too, mapped to checkpoint names."""
    trainer = trainers(family)
    model = _megatron_like(trainer).train()
    batch = _random_batch()
    coeffs = torch.randn(batch.target_ids.numel(), generator=torch.Generator().manual_seed(0))

    trainer.zero_grad(set_to_none=True)
    expected = trainer.token_logprobs(batch)
    (expected * coeffs).sum().backward()
    aligned = {k: p.grad for k, p in trainer.named_parameters() if p.requires_grad}
    got = _logprobs(model, batch)
    (got * coeffs).sum().backward()
    assert torch.equal(got.detach(), expected.detach()), _report(family, got, expected)

    grads = convert.megatron_to_hf({k: p.grad for k, p in model.named_parameters()}, trainer.config)
    trainer.zero_grad(set_to_none=True)
    assert set(grads) == set(aligned)
    rel = {k: ((grads[k] - g).norm() / g.norm().clamp_min(1e-30)).item() for k, g in aligned.items()}
    equal = [k for k, g in aligned.items() if torch.equal(grads[k], g)]
    worst = max(rel, key=rel.get)
    print(f"{family}: {len(equal)} of {len(aligned)} gradients bitwise equal the aligned face's; "
          f"worst relative difference {rel[worst]:.3g} ({worst})")
    # The same ops run in both faces; the residual stream's gradient is summed in a different order
    # (megatron's residual adds vs the aligned face's fused add + RMSNorm backward), a rounding
    # difference of fp32 size that reaches the layers below the last one.
    assert rel[worst] < GRAD_REL_BOUND, f"{worst}: relative difference {rel[worst]:.3g}"
    # Above the first such sum, in a last layer that is an MoE layer, the experts' and router's
    # gradients (the op layer's MoE backward in both faces) are bitwise equal.
    last = trainer.config.num_hidden_layers - 1
    if trainer.blocks.mlp_kind(last) == "moe":
        top = [k for k in aligned if k.startswith(f"model.layers.{last}.") and (".experts." in k or ".gate." in k)]
        assert top and set(top) <= set(equal), sorted(set(top) - set(equal))


def test_zmrl_check_with_megatron_trainer_passes_on_moe_checkpoint(checkpoints, engines, capsys):
    """``zmrl check --trainer megatron`` on the Qwen3-MoE checkpoint: every check passes, the
    per-layer expert-selection agreement with vLLM's router included."""
    from zero_mismatch_plugin.tools import cli

    engines.pool.make_room()  # room for the engine started here
    code = cli.main(["check", "--model", str(checkpoints["qwen3_moe"]), "--trainer", "megatron", "--quiet",
                     "--num-prompts", "4", "--max-tokens", "8", "--batch-sizes", "1,4"])
    out = capsys.readouterr().out
    print(out)
    assert code == 0, out
    assert "trainer megatron" in out
    # The expert choice is read from the megatron model's MoE layers through the op recorder.
    assert any(line.startswith("expert_selection") and "PASS" in line for line in out.splitlines()), out


@pytest.mark.parametrize("family", ("qwen2_moe", "glm4_moe"))
def test_zmrl_bisect_with_megatron_trainer_compares_every_moe_op_equal(checkpoints, engines, family, tmp_path, capsys):
    """``zmrl bisect --trainer megatron``: the router logits, the router's choice, the routed
    experts' output, the shared expert's ops (and its gate) and the dense layer's ops of the
    megatron model all equal vLLM's own modules, bitwise."""
    import json

    from zero_mismatch_plugin.tools import cli
    from zero_mismatch_plugin.tables.architectures import describe
    from zero_mismatch_plugin.tools.checker import oplist

    engines.pool.make_room()  # room for the engine started here
    out = tmp_path / "bisect.json"
    code = cli.main(["bisect", "--model", str(checkpoints[family]), "--trainer", "megatron",
                     "--max-model-len", "256", "--json", str(out), "--quiet"])
    table = capsys.readouterr().out
    report = json.loads(out.read_text())
    hf = _hf_config(checkpoints, family)
    blocks = describe(hf)
    assert code == 0 and report["pass"] is True and report["not_compared"] == [], table
    assert [op["op"] for op in report["ops"]] == oplist.op_names(hf.num_hidden_layers, blocks.qk_norm, blocks)
    assert {"router", "topk_ids", "experts", "shared_expert.down_proj"} <= {
        op["op"].split(".", 2)[-1] for op in report["ops"]}


# ----- layout and refusals (no engine) ---------------------------------------------------------


def _hf_config(checkpoints, family):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(checkpoints[family]))


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_moe_layout_map_round_trips_and_describes_the_layers(checkpoints, family):
    """checkpoint -> megatron -> checkpoint is the identity; megatron's config marks the dense
    and MoE layers and the shared expert as the checkpoint has them."""
    from zero_mismatch_plugin.aligned.checkpoint import read_checkpoint
    from zero_mismatch_plugin.tables.architectures import describe

    hf = _hf_config(checkpoints, family)
    state = read_checkpoint(checkpoints[family])
    blocks = describe(hf)
    if blocks.tied_head:
        state.pop("lm_head.weight", None)
    back = convert.megatron_to_hf(convert.hf_to_megatron(state, hf), hf)
    assert set(back) == set(state) and all(torch.equal(back[k], state[k]) for k in state)
    config = convert.transformer_config_from_hf(hf)
    assert config.moe_layer_freq == [int(blocks.mlp_kind(i) == "moe") for i in range(hf.num_hidden_layers)]
    assert bool(config.moe_shared_expert_intermediate_size) == bool(blocks.moe.shared_expert_intermediate_size)
    assert config.moe_router_enable_expert_bias == blocks.moe.e_score_correction_bias


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(expert_tensor_parallel_size=2), "expert tensor parallelism"),
        (dict(moe_grouped_gemm=True), "moe_grouped_gemm"),
        (dict(moe_aux_loss_coeff=1e-3), "auxiliary losses"),
        (dict(moe_aux_loss_coeff=1e-3, moe_router_load_balancing_type="seq_aux_loss"), "auxiliary losses"),
        (dict(moe_expert_capacity_factor=1.0), "token dropping"),
        (dict(moe_router_enable_expert_bias=True, moe_router_bias_update_rate=1e-3), "bias_update_rate"),
    ],
)
def test_megatron_moe_settings_vllm_does_not_run_are_refused(settings, message):
    from zero_mismatch_plugin.faces.megatron.spec import UnsupportedMegatronFeature, require_supported

    with pytest.raises(UnsupportedMegatronFeature, match=message):
        require_supported(SimpleNamespace(num_moe_experts=8, **settings))


def test_an_aux_loss_coefficient_the_router_does_not_apply_is_accepted():
    """mbridge copies the checkpoint's router_aux_loss_coef into moe_aux_loss_coeff; with verl's
    moe_router_load_balancing_type "none" megatron's router adds no loss, so nothing is refused."""
    from zero_mismatch_plugin.faces.megatron.spec import require_supported

    require_supported(SimpleNamespace(num_moe_experts=8, moe_aux_loss_coeff=1e-3, moe_router_load_balancing_type="none"))
    require_supported(SimpleNamespace(num_moe_experts=8, moe_aux_loss_coeff=[0.0, 1e-3],
                                      moe_router_load_balancing_type=["aux_loss", "none"]))


def test_megatron_moe_config_that_differs_from_the_engine_checkpoint_is_refused(checkpoints):
    """A provider built elsewhere (as verl's Megatron-Bridge does) must route as vLLM does."""
    from zero_mismatch_plugin.tables.architectures import describe
    from zero_mismatch_plugin.faces.megatron.moe import moe_config_mismatches

    hf = _hf_config(checkpoints, "glm4_moe")
    config = convert.transformer_config_from_hf(hf)
    assert moe_config_mismatches(config, describe(hf)) == []
    config.moe_router_topk = 3
    config.moe_layer_freq = 1
    problems = moe_config_mismatches(config, describe(hf))
    assert any(p.startswith("moe_router_topk=2") for p in problems)
    assert any(p.startswith("moe_layer_freq=[0, 1]") for p in problems)


def test_megatron_moe_layer_refuses_a_mismatched_config(trainers):
    trainer = trainers("qwen3_moe")
    with pytest.raises(NotImplementedError, match="moe_router_topk=2"):
        build_gpt_model(trainer.runtime, aligned=True, load=False, moe_router_topk=4)
