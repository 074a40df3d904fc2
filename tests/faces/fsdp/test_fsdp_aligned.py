"""The aligned forward inside verl's FSDP2 units (zero_mismatch_plugin.faces.fsdp).

In-process, one gloo rank: an HF checkpoint (dense, or Mixture-of-Experts with transformers'
stacked experts) wrapped by verl's own ``apply_fsdp2`` computes the same logits and the same
parameter gradients, bit for bit, as the aligned model (``AlignedCausalLM``, whose logprobs the
aligned tests compare against vLLM's engine), also after an optimizer step; its logprobs are the
engine's μ where verl's own forward's are not (the negative control). The end-to-end check against
vLLM's μ inside verl's trainer is ``tests/integrations/verl/cpu/test_main_ppo_*.py``.
"""

from __future__ import annotations

import types

import pytest
import torch

from zero_mismatch_plugin.aligned.packing import pack
from zero_mismatch_plugin.faces import fsdp as fsdp_aligned
from zero_mismatch_plugin.faces.fsdp import AlignedFSDPForward, PackedMicroBatch
from zero_mismatch_plugin.integrations.verl import fsdp_engine
from zero_mismatch_plugin.tables.switches import FSDP_ALIGNED

PROMPT_LENS = (5, 9, 3)
RESPONSE_LENS = (4, 2, 6)


@pytest.fixture(scope="module")
def process_group(tmp_path_factory):
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    store = dist.FileStore(str(tmp_path_factory.mktemp("gloo") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _fsdp2_model(checkpoint, gradient_checkpointing=False, prepare=None, param_dtype=torch.float32):
    """The checkpoint as verl's FSDP engine wraps it: every decoder layer (and embed/lm_head) a
    fully_shard unit, then the root; fp32 parameters and reductions (``param_dtype``: what FSDP2
    gathers them in for the forward, verl's ``mixed_precision.param_dtype``); with verl's
    ``enable_gradient_checkpointing``, transformers' non-reentrant checkpointing as verl enables it;
    ``prepare(model)``: what verl does to the HF module before wrapping it (its PEFT adapter)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from transformers import AutoModelForCausalLM
    from verl.utils.fsdp_utils import apply_fsdp2

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("fsdp",))
    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()  # transformers' layers recompute only in training mode, as verl's engine trains
    if prepare is not None:
        model = prepare(model)
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    apply_fsdp2(model, {"mesh": mesh, "mp_policy": policy, "reshard_after_forward": True}, {})
    return model


def _batch():
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 200, (n,), generator=generator).tolist() for n in PROMPT_LENS]
    responses = [torch.randint(0, 200, (n,), generator=generator).tolist() for n in RESPONSE_LENS]
    return pack(prompts, responses)


def _packed(batch) -> PackedMicroBatch:
    return PackedMicroBatch(batch.input_ids, batch.positions, batch.seq_lens, cu_seqlens=None, labels=None,
                            temperature=None)


def _target_logprob_sum(logits, batch):
    return logits.log_softmax(-1).gather(-1, batch.target_ids[:, None]).sum()


def _full(tensor):
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _verl_fsdp_engine(model, checkpoint, lora=False, autocast_dtype=None):
    """The attributes of verl's FSDP engine that the patched ``forward_step`` reads to build the
    aligned forward (``autocast_dtype``: the mixed-precision dtype verl's engine records)."""
    return types.SimpleNamespace(
        module=model, _is_lora=lora, ulysses_sequence_parallel_size=1, _qat_enabled=False,
        _autocast_dtype=autocast_dtype,
        engine_config=types.SimpleNamespace(strategy="fsdp2"),
        model_config=types.SimpleNamespace(local_path=str(checkpoint), lora={"merge": False} if lora else {}))


def _actor_logprobs(aligned, model, batch):
    """The actor's logprobs of the response tokens as the patched ``forward_step`` computes them."""
    temperature = torch.ones(batch.input_ids.numel())
    packed = PackedMicroBatch(batch.input_ids, batch.positions, batch.seq_lens, cu_seqlens=None,
                              labels=torch.roll(batch.input_ids, -1), temperature=temperature)
    log_probs, _ = fsdp_aligned.aligned_log_probs(aligned.logits(model, packed), packed)
    return log_probs.index_select(0, batch.target_rows)


def _verl_forward_logprobs(model, rows):
    """verl's own (HF + PEFT) forward, one sequence at a time: the logprobs without the patch."""
    out = []
    for prompt, response, _ in rows:
        ids = torch.tensor([prompt + response])
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
        out.append(logits.log_softmax(-1).gather(-1, torch.tensor(response)[:, None])[:, 0])
    return torch.cat(out)


def _reference_grads(reference) -> dict:
    """The aligned model's gradients under the names of transformers' module tree: per-expert
    gate/up/down (checkpoint names) stacked as transformers' ``experts.gate_up_proj`` ([gate; up]
    per expert) and ``experts.down_proj``, Mixtral's ``block_sparse_moe`` as ``mlp``."""
    import re

    from zero_mismatch_plugin.tables.architectures import MOE_CHECKPOINT_NAMES

    grads, experts = {}, {}
    for name, param in reference.named_parameters():
        if param.grad is None:  # the selection bias of sigmoid routing steers, it is not trained
            continue
        name = name.replace(".block_sparse_moe.", ".mlp.")
        match = re.fullmatch(r"(.*\.mlp\.experts)\.(\d+)\.(\w+)\.weight", name)
        if match:
            experts.setdefault(match[1], {}).setdefault(match[3], {})[int(match[2])] = param.grad
        else:
            grads[name] = param.grad
    gate, up, down = MOE_CHECKPOINT_NAMES[reference.blocks.moe.names][2] if experts else (None, None, None)
    for prefix, by_kind in experts.items():
        count = len(by_kind[down])
        grads[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([by_kind[gate][e], by_kind[up][e]]) for e in range(count)])
        grads[f"{prefix}.down_proj"] = torch.stack([by_kind[down][e] for e in range(count)])
    return grads


def _assert_same_gradients(model, reference):
    expected = _reference_grads(reference)
    fsdp_params = dict(model.named_parameters())
    assert set(expected) <= set(fsdp_params), set(expected) - set(fsdp_params)
    for name, reference_grad in expected.items():
        assert fsdp_params[name].grad is not None, f"{name} got no gradient"
        gradient = _full(fsdp_params[name].grad)
        assert torch.equal(gradient, reference_grad), (name, (gradient - reference_grad).abs().max())


# Dense decoders, and the Mixture-of-Experts families (transformers' stacked experts; Qwen2-MoE's
# gated shared expert; GLM-4.5's sigmoid routing in groups, shared experts, a dense first layer and
# partial rotary). With gradient checkpointing (verl's default) the backward calls each layer again.
@pytest.mark.parametrize("family,gradient_checkpointing", [
    pytest.param("llama", False, marks=pytest.mark.quick),
    *[(family, False) for family in ("qwen3", "qwen3_moe", "qwen3_moe_padded", "qwen2_moe", "mixtral", "glm4_moe")],
    ("llama", True), ("qwen3_moe", True)])
def test_fsdp2_units_give_the_aligned_models_logits_and_gradients(process_group, checkpoints, family,
                                                                  gradient_checkpointing):
    from zero_mismatch_plugin.faces.aligned_model import AlignedCausalLM
    from zero_mismatch_plugin.aligned.runtime import VllmRuntime

    model = _fsdp2_model(checkpoints[family], gradient_checkpointing)
    aligned = AlignedFSDPForward(VllmRuntime(checkpoints[family], dtype="float32"), model.config)
    reference = AlignedCausalLM.from_pretrained(checkpoints[family])
    batch = _batch()
    optimizers = (torch.optim.SGD(model.parameters(), lr=0.5), torch.optim.SGD(reference.parameters(), lr=0.5))

    for step in range(2):
        # verl's order: the no-grad old-logprob pass first (it builds the ops), then the training forward.
        with torch.no_grad():
            before = aligned.logits(model, _packed(batch)).index_select(0, batch.target_rows)
        logits = aligned.logits(model, _packed(batch)).index_select(0, batch.target_rows)
        expected = reference.logits(batch)
        assert torch.equal(before, expected), (step, (before - expected).abs().max().item())
        assert torch.equal(logits, expected), (step, (logits - expected).abs().max().item())

        _target_logprob_sum(logits, batch).backward()
        _target_logprob_sum(expected, batch).backward()
        _assert_same_gradients(model, reference)

        # One optimizer step on both sides, then the engine's signal (mark_stale) that the shards changed.
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        aligned.mark_stale()

    fsdp_aligned.uninstall(model)
    assert all("forward" not in vars(module) for module in model.modules()), "the HF forwards are back"


def test_engine_layout_weights_are_derived_once_per_weights_generation_not_at_every_gather(process_group,
                                                                                         checkpoints, monkeypatch):
    """FSDP2 gathers each unit into new storage before every forward, values unchanged: the merged,
    oneDNN-packed weights (and the MoE layer's loaded experts) are derived at the first forward and
    again only after ``mark_stale`` (the engine's optimizer step / checkpoint load), not at every
    gather; a norm weight, a view of its parameter, follows the storage."""
    from zero_mismatch_plugin.aligned import derived
    from zero_mismatch_plugin.aligned.runtime import VllmRuntime

    model = _fsdp2_model(checkpoints["qwen3_moe"])
    aligned = AlignedFSDPForward(VllmRuntime(checkpoints["qwen3_moe"], dtype="float32"), model.config)
    builds = []
    original = derived.DerivedWeight._derive
    monkeypatch.setattr(derived.DerivedWeight, "_derive",
                        lambda self: builds.append(self.copies) or original(self))
    batch = _packed(_batch())

    def derived_in_one_forward() -> list:
        builds.clear()
        with torch.no_grad():
            logits = aligned.logits(model, batch)
        return list(builds), logits

    first, logits = derived_in_one_forward()
    again, same = derived_in_one_forward()
    assert first.count(True) >= 2 * model.config.num_hidden_layers + 1  # qkv, o, the MLP or experts; the head
    assert True not in again, "a copy was derived again while the weights did not change"
    assert torch.equal(same, logits)
    aligned.mark_stale()
    after, _ = derived_in_one_forward()
    assert after.count(True) == first.count(True)


def test_derived_weights_that_may_view_their_sources_are_not_switched_to_the_owners_refresh():
    from zero_mismatch_plugin.aligned.derived import DerivedWeight

    source = torch.ones(4)
    view = DerivedWeight([source], lambda s: s[0])
    with pytest.raises(TypeError, match=r"may view its sources' storage: it must follow that storage"):
        view.refreshed_by_owner()
    copy = DerivedWeight([source], lambda s: s[0].clone(), copies=True)
    copy.refreshed_by_owner()
    first = copy.get()
    source.data = torch.ones(4)  # new storage, same values: not derived again
    assert copy.get() is first
    source.data = torch.full((4,), 2.0)
    assert copy.get() is first  # the owner has not refreshed
    assert torch.equal(copy.refresh(), source)


def test_actor_logprobs_are_the_engines_and_verls_own_forward_is_not(process_group, checkpoints, engines):
    """The patched forward_step's logprobs of a rollout are the engine's μ bit for bit; verl's own
    HF forward of the same FSDP2 model is close to μ and not equal (the negative control of the
    aligned actor inside verl's trainer)."""
    from support.vllm_session import prompts_for, rollout

    checkpoint = checkpoints["llama"]
    model = _fsdp2_model(checkpoint)
    aligned = fsdp_engine.aligned_state(_verl_fsdp_engine(model, checkpoint))
    prompts, responses, mu = rollout(engines.get("llama"), prompts_for(checkpoint))
    batch = pack(prompts, responses)
    with torch.no_grad():
        actor = _actor_logprobs(aligned, model, batch)
        fsdp_aligned.uninstall(model)
        verls_own = _verl_forward_logprobs(model, list(zip(prompts, responses, mu)))
    assert torch.equal(actor, mu), (actor - mu).abs().max().item()
    assert not torch.equal(verls_own, mu)
    torch.testing.assert_close(verls_own, mu, rtol=0, atol=1e-4)  # ... though the same weights in fp32


def test_in_bf16_mixed_precision_actor_logprobs_are_the_bf16_engines_and_verls_own_forward_is_not(
        process_group, engines, checkpoints):
    """verl's FSDP engine in bf16 mixed precision (fp32 master weights gathered in bf16, autocast in
    bf16): the aligned forward computes in the dtype the engine records, from the bf16 weights the
    rollout serves, and its logprobs are a bf16 engine's μ bit for bit; verl's own forward under
    bf16 autocast is not. (The same inside verl's trainer: test_main_ppo_moe.py.)"""
    from support.vllm_session import Engines, prompts_for, rollout

    checkpoint = checkpoints["llama"]
    bf16 = Engines(engines.pool, checkpoints, scope="fsdp_bf16", dtype="bfloat16")
    # Alone in the pool: with this module's fp32 engine alive, the bf16 engine's first generate
    # hung here (its core waiting for input; not isolated).
    engines.pool.make_room(engines.pool.capacity)
    prompts, responses, mu = rollout(bf16.get("llama"), prompts_for(checkpoint))
    bf16.discard("llama")
    model = _fsdp2_model(checkpoint, param_dtype=torch.bfloat16)
    aligned = fsdp_engine.aligned_state(_verl_fsdp_engine(model, checkpoint, autocast_dtype=torch.bfloat16))
    assert aligned.runtime.dtype == torch.bfloat16
    batch = pack(prompts, responses)
    with torch.no_grad():
        actor = _actor_logprobs(aligned, model, batch)
        fsdp_aligned.uninstall(model)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            verls_own = _verl_forward_logprobs(model, list(zip(prompts, responses, mu))).float()
    assert torch.equal(actor, mu), f"{int((actor != mu).sum())} of {mu.numel()} differ, max {(actor - mu).abs().max()}"
    assert not torch.equal(verls_own, mu)
    torch.testing.assert_close(verls_own, mu, rtol=0, atol=0.2)  # the same weights, bf16 rounding


def test_unsupported_architecture_is_refused(tmp_path):
    config = types.SimpleNamespace(architectures=["GPT2LMHeadModel"])
    with pytest.raises(NotImplementedError, match="GPT2LMHeadModel"):
        AlignedFSDPForward(runtime=None, hf_config=config)


@pytest.mark.parametrize("name", ["mistral_window", "deepseek_v3_moe"])
def test_windowed_and_latent_attention_checkpoints_are_refused_naming_the_switch(checkpoints, name):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(checkpoints[name]))
    with pytest.raises(NotImplementedError, match=f"{FSDP_ALIGNED}=0"):
        AlignedFSDPForward(runtime=None, hf_config=config)
