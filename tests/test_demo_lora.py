"""``zmrl demo --lora R``: a frozen base and a LoRA learner; every update's adapter is served by
the engine as a new adapter version (vLLM's LoRA loading), and same-version samples are bitwise.

One LoRA-enabled engine (in its own process) for the file, started after the session's shared
engine is shut down.
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from test_demo import _assert_only_gap_is_lag  # noqa: E402

from zero_mismatch_plugin.demo import DemoConfig, DemoRun, run_demo  # noqa: E402

MAX_MODEL_LEN = 128
RANK = 8


@pytest.fixture(scope="module")
def lora_demo_engine(tmp_path_factory, engines):
    from zero_mismatch_plugin.demo.engine import start_engine
    from zero_mismatch_plugin.tiny_models import build_tiny_model

    engines.close()  # at most one engine alive
    model_dir = build_tiny_model(tmp_path_factory.mktemp("demo_lora_model"), family="llama", seed=0)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ZMRL_NUMERICS", "consistent")
        mp.setenv("VLLM_CPU_ATTN_SPLIT_KV", "0")
        with start_engine(model_dir, MAX_MODEL_LEN, lora_rank=RANK) as engine:
            yield engine, model_dir


def test_lora_lag0_bitwise_adapter_served_base_frozen(lora_demo_engine):
    engine, model_dir = lora_demo_engine
    run = DemoRun(DemoConfig(max_model_len=MAX_MODEL_LEN, lag=0, updates=5, lora_rank=RANK,
                             learning_rate=1e-3), engine, model_dir)
    learner = run.learner
    base = {n: p.detach().clone() for n, p in learner.module.named_parameters() if not n.startswith("lora.")}
    initial = learner.snapshot()
    assert initial and all(".lora_A." in n or ".lora_B." in n for n in initial)  # only the adapter is published
    samples = []
    update = run._update

    def recording_update(step, chunks, waited):
        samples.append([s for c in chunks for s in c.samples])
        return update(step, chunks, waited)

    run._update = recording_update
    weights = {0: initial}

    def after_update(record):  # the learner now holds (and has published) the next version
        weights[record.learner_version + 1] = learner.snapshot()

    result = run.run(after_update)
    for r in result.records:
        assert r.sample_versions == [r.learner_version] * len(r.sample_versions)
        assert all(r.ratios_all_one) and all(r.own_version_bitwise), f"update {r.step}"
        assert r.metrics["actor/zero_mismatch/bitwise_equal_fraction"] == 1.0
        assert r.metrics["actor/rollout_corr/k3_kl"] == 0.0
    # The adapter moved, the base did not (it has no gradient and is not in the optimizer).
    final = learner.snapshot()
    assert any(not torch.equal(final[n], initial[n]) for n in initial)
    assert all(torch.equal(p, base[n]) for n, p in learner.module.named_parameters() if n in base)
    assert all(not p.requires_grad for n, p in learner.module.named_parameters() if n in base)
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
