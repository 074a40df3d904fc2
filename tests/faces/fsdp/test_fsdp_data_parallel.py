"""The FSDP face at data parallelism 2: verl's ``apply_fsdp2`` over a two-rank gloo mesh (two
one-thread torchrun ranks, tests/support/fsdp_data_parallel_ranks.py), each rank its share of the
sequences. FSDP2 gathers every unit's shards before its forward, so each rank computes what one
process computes: the logprobs are the one-process engine's μ bit for bit; the gradients are
reduce-scattered by FSDP2's own collective (two ranks: one order) and agree with the one-process
aligned model (but for the pad token's embedding row, which transformers' ``padding_idx`` leaves
untrained); after one SGD step the ranks' logprobs are the engine's again once it has the
stepped weights. Cost: one torchrun of two ranks (~30 s) and the session's Llama engine.
"""

from __future__ import annotations

import pytest
import torch

from support.torchrun import run_ranks
from support.vllm_session import MAX_MODEL_LEN, prompts_for, rollout

LR = 1e-3
ENGINE_KWARGS = dict(max_model_len=MAX_MODEL_LEN, seed=0)
GRAD_REL_TOL = 1e-6  # fp32 rounding behind the cross-rank gradient sum (worst measured 2.4e-7)


@pytest.fixture(scope="module")
def fsdp_run(checkpoints, engines, tmp_path_factory):
    prompts, responses, mu = rollout(engines.fresh("llama"), prompts_for(checkpoints["llama"], corpus_seed=17), seed=9)
    coefficients = torch.randn(mu.numel(), generator=torch.Generator().manual_seed(3))
    work = tmp_path_factory.mktemp("fsdp_dp2")
    torch.save(dict(checkpoint=str(checkpoints["llama"]), engine_kwargs=ENGINE_KWARGS, prompts=prompts,
                    responses=responses, coefficients=coefficients, lr=LR), work / "request.pt")
    run_ranks("fsdp_data_parallel_ranks.py", 2, work / "request.pt", work / "out.pt")
    return dict(prompts=prompts, responses=responses, mu=mu, coefficients=coefficients, **torch.load(work / "out.pt"))


def test_fsdp_face_at_dp2_is_bitwise_equal_to_the_one_process_engine(fsdp_run):
    values, mu = torch.cat(fsdp_run["logprobs"]), fsdp_run["mu"]
    assert values.shape == mu.shape
    assert torch.equal(values, mu), f"{int((values != mu).sum())} of {mu.numel()} tokens differ"


def test_fsdp_gradients_at_dp2_agree_with_the_one_process_aligned_model(checkpoints, fsdp_run):
    from zero_mismatch_plugin.aligned.packing import pack
    from zero_mismatch_plugin.faces.aligned_model import AlignedCausalLM

    reference = AlignedCausalLM.from_pretrained(checkpoints["llama"], **ENGINE_KWARGS)
    batch = pack(fsdp_run["prompts"], fsdp_run["responses"])
    logits = reference.logits(batch)
    values = logits.log_softmax(-1).gather(-1, batch.target_ids[:, None])[:, 0]
    (values * fsdp_run["coefficients"]).sum().backward()
    expected = {name: p.grad for name, p in reference.named_parameters()}
    grads = fsdp_run["grads"]
    assert set(expected) <= set(grads), set(expected) - set(grads)
    # transformers' embedding has padding_idx = pad_token_id: that row gets no gradient there (the
    # engine may sample the pad token); the aligned model's vLLM embedding trains it.
    pad = reference.config.pad_token_id
    embed = "model.embed_tokens.weight"
    assert pad is not None and not grads[embed][pad].any()
    expected[embed] = expected[embed].clone()
    expected[embed][pad] = 0
    worst = max(float((grads[n] - g).norm() / g.norm().clamp_min(1e-30)) for n, g in expected.items())
    print(f"fsdp dp2: worst relative gradient difference vs the one-process aligned model {worst:.3g}")
    assert worst <= GRAD_REL_TOL


def test_after_a_step_at_dp2_the_engine_with_the_stepped_weights_is_bitwise_again(engines, fsdp_run):
    from types import SimpleNamespace

    from zero_mismatch_plugin.aligned.weight_sync import load_named_weights
    from zero_mismatch_plugin.tools.checker.engine import rescore

    after = torch.cat(fsdp_run["logprobs_after"])
    assert not torch.equal(after, fsdp_run["mu"])
    stepped = list(fsdp_run["weights"].items())  # the ranks' shards after the step, gathered whole
    llm = engines.get("llama")
    engines.updated["llama"] = llm  # restarted on the checkpoint's weights after this module
    load_named_weights(llm, stepped)
    completions = [SimpleNamespace(prompt=p, tokens=r) for p, r in zip(fsdp_run["prompts"], fsdp_run["responses"])]
    engine_after = torch.tensor([v for row in rescore(llm, completions) for v in row])
    assert torch.equal(engine_after, after), f"{int((engine_after != after).sum())} of {after.numel()} tokens differ"
    # Negative control: verl's own forward of the same stepped model on the ranks is not the engine's.
    own = torch.cat(fsdp_run["own_forward_after"])
    assert not torch.equal(own, engine_after) and (own - engine_after).abs().max() < 1e-3
