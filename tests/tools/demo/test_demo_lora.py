"""``zmrl demo --lora R``: a frozen base and a LoRA learner; every update's adapter is served by
the engine as a new adapter version (vLLM's LoRA loading), and same-version samples are bitwise.

One LoRA-enabled engine (in its own process) for the file, started after the session's shared
engine is shut down.
"""

from __future__ import annotations

import pytest
import torch

from test_demo import _assert_only_gap_is_lag, _run_recording
from support.vllm_session import demo_llama_engine
from zero_mismatch_plugin.aligned.checkpoint import read_checkpoint
from zero_mismatch_plugin.tools.demo import DemoConfig, run_demo

MAX_MODEL_LEN = 128
RANK = 8


@pytest.fixture(scope="module")
def lora_demo_engine(tmp_path_factory, engines):
    engines.pool.make_room()  # room for the engine started here
    yield from demo_llama_engine(tmp_path_factory, "demo_lora_model", MAX_MODEL_LEN, lora_rank=RANK)


def test_lora_lag0_bitwise_adapter_served_base_frozen(lora_demo_engine):
    _, model_dir = lora_demo_engine
    run, result, weights, samples = _run_recording(lora_demo_engine, lag=0, updates=5, lora_rank=RANK,
                                                   learning_rate=1e-3)
    learner = run.learner
    initial = weights[0]
    assert initial and all(".lora_A." in n or ".lora_B." in n for n in initial)  # only the adapter is published
    base = dict(learner.module.named_parameters())
    checkpoint = read_checkpoint(model_dir)
    for r in result.records:
        assert r.sample_versions == [r.learner_version] * len(r.sample_versions)
        assert all(r.ratios_all_one) and all(r.own_version_bitwise), f"update {r.step}"
        assert r.metrics["actor/zero_mismatch/bitwise_equal_fraction"] == 1.0
        assert r.metrics["actor/rollout_corr/k3_kl"] == 0.0
    # The adapter moved, the base did not (it has no gradient and is not in the optimizer).
    final = learner.snapshot()
    assert any(not torch.equal(final[n], initial[n]) for n in initial)
    base = {n: p for n, p in base.items() if not n.startswith("lora.")}
    in_checkpoint = [n for n in base if n in checkpoint]
    assert len(in_checkpoint) == len(base), sorted(set(base) - set(in_checkpoint))
    assert all(torch.equal(base[n], checkpoint[n].to(base[n].dtype)) for n in in_checkpoint)
    assert all(not p.requires_grad for p in base.values())
    # The engine served the last pushed adapter: the last samples' μ are the learner's logprobs
    # under that version's adapter, not under the initial one.
    last = samples[-1]
    assert {s.version for s in last} == {4}
    prompts, responses = [s.prompt for s in last], [s.response for s in last]
    mu = torch.cat([s.mu for s in last])
    with torch.no_grad():
        with learner.weights_of(weights[4]):
            served = torch.cat(learner.response_logprobs(prompts, responses))
        with learner.weights_of(initial):
            first = torch.cat(learner.response_logprobs(prompts, responses))
    assert torch.equal(served, mu)
    assert not torch.equal(first, mu)


def test_lora_lag1_only_gap_is_weight_lag(lora_demo_engine):
    engine, model_dir = lora_demo_engine
    result = run_demo(DemoConfig(max_model_len=MAX_MODEL_LEN, lag=1, updates=6, lora_rank=RANK,
                                 learning_rate=1e-3), engine, model_dir)
    _assert_only_gap_is_lag(result, lag=1)


def test_lora_demo_refuses_other_kernels_and_bad_ranks():
    with pytest.raises(ValueError, match="aligned kernels"):
        DemoConfig(kernels="standard", lora_rank=8)
    with pytest.raises(ValueError, match="positive rank"):
        DemoConfig(lora_rank=0)
