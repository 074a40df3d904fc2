"""The Megatron face with LoRA on embed_tokens and lm_head (and every decoder linear): a frozen
aligned GPTModel against a LoRA-enabled vLLM engine serving the same adapter (tiny Llama, CPU,
gloo, world size 1).

The model fixture and the comparison helpers are those of tests/faces/megatron/test_megatron_lora.py, over this
module's adapter; engine and runtime take the engine arguments of the adapter's rank
(``lora_engine_args`` reads a config with the layer targets only). The sync test goes last
because it changes the adapter on both sides.
"""

from __future__ import annotations

import types

import pytest
import torch
from test_megatron_lora import (  # noqa: F401 - fixtures
    GRAD_REL_TOL,
    _assert_bitwise,
    _request,
    consistent_mode,
    megatron_logprobs,
    model,
)
from support.vllm_session import MAX_MODEL_LEN, prompts_for, rollout

from zero_mismatch_plugin.aligned import pack
from zero_mismatch_plugin.aligned.lora.names import peft_tensor_name, PEFT_VOCAB_NAMES
from zero_mismatch_plugin.aligned.lora.peft import lora_engine_args_for_rank
from zero_mismatch_plugin.aligned.lora.adapter import build_adapter
from zero_mismatch_plugin.tables.architectures import LORA_TARGETS, VOCAB_LORA_TARGETS
from zero_mismatch_plugin.faces.megatron import convert

LORA_ENGINE = lora_engine_args_for_rank(8)
VOCAB_PARAMETERS = {convert.megatron_vocab_lora_name(t, which) for t in VOCAB_LORA_TARGETS for which in "AB"}


@pytest.fixture(scope="module")
def adapter(checkpoints, tmp_path_factory, consistent_mode):
    return build_adapter(tmp_path_factory.mktemp("megatron_vocab_lora") / "r8", checkpoints["llama"], r=8,
                         lora_alpha=16, targets=LORA_TARGETS + VOCAB_LORA_TARGETS, seed=31)


@pytest.fixture(scope="module")
def lora_llm(checkpoints, adapter, engines):
    from vllm import LLM

    from zero_mismatch_plugin.aligned.runtime import engine_args_for, shutdown_engine

    engines.pool.make_room()  # room for the engine started here
    llm = LLM(**engine_args_for(checkpoints["llama"], max_model_len=MAX_MODEL_LEN, seed=0, **LORA_ENGINE))
    yield llm
    shutdown_engine(llm)


@pytest.fixture(scope="module")
def runtime(checkpoints, adapter):
    from zero_mismatch_plugin.aligned.runtime import VllmRuntime
    from zero_mismatch_plugin.integrations.megatron.standalone import init_single_process

    init_single_process()
    return VllmRuntime(checkpoints["llama"], max_model_len=MAX_MODEL_LEN, seed=0, **LORA_ENGINE)


def _rollout(llm, prompts, path, seed, name="vocab-r8", adapter_id=1):
    """(prompts, responses, μ): one sample per prompt, every request with the adapter in ``path``."""
    return rollout(llm, prompts, seed=seed, n=1, max_tokens=16, lora_request=_request(name, adapter_id, path))


def test_megatron_vocab_lora_bitwise_equal_engine(lora_llm, model, runtime, adapter):
    from safetensors.torch import load_file

    from zero_mismatch_plugin.aligned.lora.peft import WEIGHTS_FILE
    from zero_mismatch_plugin.faces.megatron.lora import adapter_state, lora_parameters

    assert VOCAB_PARAMETERS <= {n for n, _ in lora_parameters(model)}
    prompts = prompts_for(runtime.model_dir)
    for b in (1, 8):
        rows = _rollout(lora_llm, prompts[:b], adapter, seed=700)
        with torch.no_grad():
            _assert_bitwise(megatron_logprobs(model, rows[0], rows[1]), rows[2], f"megatron + vocab LoRA, batch of {b}")
    # The vocabulary matrices went through convert's name mapping and back unchanged.
    on_disk = load_file(str(adapter / WEIGHTS_FILE))
    state = adapter_state(model)
    assert set(PEFT_VOCAB_NAMES["embed_tokens"] + PEFT_VOCAB_NAMES["lm_head"]) <= set(state)
    assert set(state) == set(on_disk) and all(torch.equal(state[n], on_disk[n]) for n in on_disk)


@pytest.mark.parametrize("target", VOCAB_LORA_TARGETS)
def test_megatron_vocab_lora_is_in_the_forward(lora_llm, model, runtime, adapter, target):
    """Zeroing the target's B moves the logprobs off the engine's (restored afterwards)."""
    rows = _rollout(lora_llm, prompts_for(runtime.model_dir), adapter, seed=701)
    lora_b = dict(model.named_parameters())[convert.megatron_vocab_lora_name(target, "B")]
    saved = lora_b.detach().clone()
    with torch.no_grad():
        lora_b.zero_()
        try:
            assert not torch.equal(megatron_logprobs(model, rows[0], rows[1]), rows[2]), f"{target} adapter unused"
        finally:
            lora_b.copy_(saved)
        _assert_bitwise(megatron_logprobs(model, rows[0], rows[1]), rows[2], f"{target} B restored")


def test_megatron_vocab_lora_gradients_equal_aligned_face(lora_llm, model, runtime, adapter, checkpoints):
    from zero_mismatch_plugin.faces.aligned_model import AlignedCausalLM
    from zero_mismatch_plugin.faces.megatron.lora import lora_parameters

    prompts, responses, _ = _rollout(lora_llm, prompts_for(runtime.model_dir), adapter, seed=702)
    coeffs = torch.randn(sum(len(r) for r in responses), generator=torch.Generator().manual_seed(0))
    model.zero_grad(set_to_none=True)
    (megatron_logprobs(model, prompts, responses) * coeffs).sum().backward()
    grads = convert.megatron_to_peft_lora({n: p.grad for n, p in lora_parameters(model)})
    model.zero_grad(set_to_none=True)

    aligned = AlignedCausalLM.from_pretrained(checkpoints["llama"], max_model_len=MAX_MODEL_LEN, seed=0,
                                              lora_dir=adapter, **LORA_ENGINE)
    (aligned.token_logprobs(pack(prompts, responses)) * coeffs).sum().backward()
    expected = {}
    for target in VOCAB_LORA_TARGETS:
        pair = aligned.lora.vocab_pair(target)
        expected.update(zip(PEFT_VOCAB_NAMES[target], (pair.lora_A.grad, pair.lora_B.grad)))
    for i, target, pair in aligned.lora.pairs():
        expected.update({peft_tensor_name(i, target, "A"): pair.lora_A.grad, peft_tensor_name(i, target, "B"): pair.lora_B.grad})
    assert set(grads) == set(expected)
    worst = 0.0
    for name, want in expected.items():
        assert want.abs().max() > 0, name
        rel = ((grads[name] - want).norm() / want.norm()).item()
        worst = max(worst, rel)
        assert rel < GRAD_REL_TOL, f"{name}: relative difference {rel:.3g}"
    print(f"megatron vs aligned vocab LoRA gradients: worst relative difference {worst:.3g}")


def test_megatron_checker_backend_serves_vocab_adapter(lora_llm, runtime, adapter, checkpoints):
    """``zmrl check --trainer megatron --lora``'s trainer side: the engine arguments of the adapter
    served (vocabulary targets included) and its logprobs the engine's."""
    from zero_mismatch_plugin.tools.checker.backends import load_backend
    from zero_mismatch_plugin.tools.checker.engine import engine_settings

    backend = load_backend("megatron", engine_settings(checkpoints["llama"], MAX_MODEL_LEN, lora_dir=adapter))
    assert VOCAB_PARAMETERS <= {n for n, _ in backend.model.named_parameters()}
    prompts, responses, mu = _rollout(lora_llm, prompts_for(runtime.model_dir), adapter, seed=704)
    _assert_bitwise(backend.token_logprobs(pack(prompts, responses)), mu, "checker's megatron backend + vocab LoRA")


def test_megatron_vocab_lora_equal_again_after_optimizer_step_and_adapter_sync(lora_llm, model, runtime, tmp_path):
    from zero_mismatch_plugin.faces.megatron.lora import lora_parameters, save_adapter

    prompts = prompts_for(runtime.model_dir)
    before = _rollout(lora_llm, prompts, save_adapter(model, model.lora_config, tmp_path / "v0"), seed=703)
    vocab = {n: p for n, p in lora_parameters(model) if n in VOCAB_PARAMETERS}
    old = {n: p.detach().clone() for n, p in vocab.items()}
    optimizer = torch.optim.AdamW([p for _, p in lora_parameters(model)], lr=2e-2)
    (-megatron_logprobs(model, before[0], before[1]).mean()).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    assert all(not torch.equal(old[n], p) for n, p in vocab.items()), "the step left a vocabulary matrix unchanged"
    path = save_adapter(model, model.lora_config, tmp_path / "v1")
    after = _rollout(lora_llm, prompts, path, seed=703, name="vocab-r8-v1", adapter_id=2)
    # Same seeds: only the new adapter can have changed the rollout.
    assert after[1] != before[1] or not torch.equal(after[2], before[2])
    with torch.no_grad():
        _assert_bitwise(megatron_logprobs(model, after[0], after[1]), after[2], "megatron + vocab LoRA after sync")


def test_megatron_face_refuses_lm_head_adapter_on_tied_head(checkpoints, tmp_path):
    from transformers import AutoConfig

    from zero_mismatch_plugin.faces.megatron.lora import attach_lora

    hf = AutoConfig.from_pretrained(str(checkpoints["qwen3"]))
    assert hf.tie_word_embeddings
    adapter = build_adapter(tmp_path / "qwen3", checkpoints["qwen3"], r=4, targets=("q_proj", "lm_head"), seed=1)
    tied = types.SimpleNamespace(share_embeddings_and_output_weights=True)
    with pytest.raises(NotImplementedError, match="tied to the embedding.*drop lm_head"):
        attach_lora(tied, types.SimpleNamespace(hf_config=hf), adapter)
