"""LoRA on embed_tokens and lm_head (with every decoder linear): engine vs the aligned trainer.

vLLM 0.31 wraps both for Llama and Qwen3 (``embedding_modules``): ``VocabParallelEmbeddingWithLoRA``
adds the adapter's embedding rows times B' through ``add_lora_embedding``, ``LogitsProcessorWithLoRA``
adds h·Aᵀ·B' to the head's logits (``add_lora_logits``) before any soft-cap. The trainer runs those
two vLLM layers on its own A and B. The LoRA-enabled engine of the dense LoRA tests serves the
adapters (one engine alive at a time, the session's shared engine shut first).
"""

from __future__ import annotations

from support import aligned_checks as checks
import pytest
import torch
from test_aligned_lora import LORA_ENGINE, _peft_reference, assert_bitwise, generate, lora_engines, score  # noqa: F401 - a fixture
from test_aligned_mla_lora import lora_trainers  # noqa: F401 - a fixture (one trainer per model, of `adapters`)
from support.vllm_session import prompts_for

from zero_mismatch_plugin.aligned import SamplingTransform, pack
from zero_mismatch_plugin.aligned.lora.adapter import build_adapter
from zero_mismatch_plugin.tables.architectures import LORA_TARGETS, VOCAB_LORA_TARGETS

MODELS = ("llama", "qwen3")  # qwen3's tiny checkpoint ties lm_head to embed_tokens; llama's does not
TARGETS = LORA_TARGETS + VOCAB_LORA_TARGETS
ADAPTER_ID = 7


@pytest.fixture(scope="module", params=MODELS)
def model(request):
    """Module-scoped, so pytest runs every test of one model before the next (one engine start each)."""
    return request.param


@pytest.fixture(scope="module")
def adapters(checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("vocab_lora_adapters")
    return {m: build_adapter(root / m, checkpoints[m], r=8, lora_alpha=16, targets=TARGETS, seed=31) for m in MODELS}


def _request(adapters, model):
    from vllm.lora.request import LoRARequest

    return LoRARequest(f"{model}-vocab-r8", ADAPTER_ID, str(adapters[model]))


def _full_distribution(trainer, rows):
    batch = pack([r[0] for r in rows], [r[1] for r in rows])
    with torch.no_grad():
        full = SamplingTransform().logprobs(trainer.logits(batch))[:, : trainer.vocab_size]
    dists = [d for r in rows for d in r[3]]
    engine = torch.tensor([[d[t] for t in range(trainer.vocab_size)] for d in dists])
    return full, engine


def test_embedding_and_lm_head_lora_bitwise_equal_engine(model, lora_engines, lora_trainers, adapters):
    llm = lora_engines.get(model)
    trainer = lora_trainers(model)
    assert set(trainer.lora_vocab_ops) == {"embed_tokens", "lm_head"}
    prompts = prompts_for(trainer.runtime.model_dir)
    request = _request(adapters, model)
    for b in (1, 8):
        rows = generate(llm, prompts[:b], [request] * b, seed=700, logprobs=-1)
        assert_bitwise(score(trainer, rows), rows, f"{model} embed_tokens + lm_head + linears, batch of {b}")
        full, engine = _full_distribution(trainer, rows)
        assert torch.equal(full, engine), f"{model} batch {b} full distribution: {(full == engine).float().mean().item():.1%} equal"
    # Both vocabulary adapters are in the forward: without either, other numbers.
    mu = torch.cat([r[2] for r in rows])
    vocab_ops = trainer.lora_vocab_ops
    try:
        for target in VOCAB_LORA_TARGETS:
            trainer.lora_vocab_ops = {t: op for t, op in vocab_ops.items() if t != target}
            without = score(trainer, rows)
            print(f"{model}: without the {target} adapter max |Δ logprob| {(without - mu).abs().max().item():.3g}")
            assert not torch.equal(without, mu), target
    finally:
        trainer.lora_vocab_ops = vocab_ops


def test_embedding_and_lm_head_lora_in_a_mixed_batch(model, lora_engines, lora_trainers, adapters, tmp_path):
    """Adapter, base and another adapter's requests in one batch (both slots loaded): each row
    gets its own model."""
    from vllm.lora.request import LoRARequest

    llm = lora_engines.get(model)
    trainer = lora_trainers(model)
    prompts = prompts_for(trainer.runtime.model_dir)
    request = _request(adapters, model)
    other_dir = build_adapter(tmp_path / "other", trainer.runtime.model_dir, r=8, lora_alpha=16, targets=TARGETS, seed=32)
    other = LoRARequest(f"{model}-vocab-other", ADAPTER_ID + 1, str(other_dir))
    kinds = [request, None, other] * 3
    rows = generate(llm, prompts[:8], kinds[:8], seed=800, n=2)
    lora_rows = [r for r in rows if r[4] is request]
    base_rows = [r for r in rows if r[4] is None]
    assert_bitwise(score(trainer, lora_rows), lora_rows, f"{model} mixed batch, adapter rows")
    assert_bitwise(score(trainer, base_rows, adapter=False), base_rows, f"{model} mixed batch, base rows")


def _peft_vocab_parameters(adapter_dir):
    """``reference(trainer)`` for the gradient check: transformers + PEFT in float64, its A / B under
    the trainer's adapter parameter names (layers.{i}.{target}.lora_A, embed_tokens.lora_A, ...)."""

    def reference(trainer):
        model = _peft_reference(trainer, adapter_dir, torch.float64)
        params = {}
        for name, p in model.named_parameters():
            if "lora_" not in name:
                continue
            parts = name.split(".")
            # base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight
            # base_model.model.model.embed_tokens.lora_embedding_A.default
            # base_model.model.lm_head.lora_A.default.weight
            if "layers" in parts:
                params[f"layers.{parts[4]}.{parts[6]}.{parts[7]}"] = p
            else:
                which = next(x for x in parts if x.startswith("lora_"))
                target = "embed_tokens" if "embed_tokens" in parts else "lm_head"
                params[f"{target}.{which.replace('embedding_', '')}"] = p
        return model, params

    return reference


def test_embedding_and_lm_head_lora_backward_matches_float64(model, lora_engines, lora_trainers, adapters):
    llm = lora_engines.get(model)
    trainer = lora_trainers(model)
    prompts = prompts_for(trainer.runtime.model_dir)
    rows = generate(llm, prompts, [_request(adapters, model)] * len(prompts), seed=900)
    worst = checks.check_lora_backward_matches_float64(trainer, rows, _peft_vocab_parameters(adapters[model]))
    assert {"embed_tokens.lora_A", "embed_tokens.lora_B", "lm_head.lora_A", "lm_head.lora_B"} <= {
        n for n, _ in trainer.lora.named_parameters()
    }
    print(f"{model}: worst relative LoRA gradient error vs float64 (embed_tokens, lm_head, linears) {worst:.3g}")


def test_engine_patch_gives_embedding_rows_without_adapter_no_update():
    """vLLM's embedding LoRA looks up slot 0's A rows for a token without adapter (offset 0) and
    expands with B of slot -1 (the last slot); the plugin's patch leaves such rows unchanged.
    Checked on the op itself, patched and not."""
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    from zero_mismatch_plugin.integrations import patches as runtime_patches
    from zero_mismatch_plugin.integrations.vllm.plugin import LORA_BASE_EMBEDDING_ROWS

    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(6, 8, generator=gen)  # the looked-up A rows (rank 8)
    slots = torch.randn(2, 1, 16, 8, generator=gen)  # B of both slots
    base = torch.randn(6, 16, generator=gen)
    indices = torch.tensor([0, -1, 1, -1, 0, 1])

    def expand():
        """The engine's prefill path: six one-token requests, per-request indices exploded per token."""
        out = base.clone()
        lora_ops.sgmv_expand(rows, slots, out, None, torch.ones(6, dtype=torch.long), indices, 6, 1, 6, True)
        return out

    was_applied = runtime_patches.is_applied(LORA_BASE_EMBEDDING_ROWS)
    runtime_patches.remove(LORA_BASE_EMBEDDING_ROWS)
    try:
        unpatched = expand()
        assert not torch.equal(unpatched[[1, 3]], base[[1, 3]])  # the last slot's B was applied
        runtime_patches.apply(LORA_BASE_EMBEDDING_ROWS)
        assert punica_cpu.bgmv_expand is lora_ops.bgmv_expand  # the decode path sees it too
        patched = expand()
        assert torch.equal(patched[[1, 3]], base[[1, 3]])
        assert torch.equal(patched[[0, 2, 4, 5]], unpatched[[0, 2, 4, 5]])
    finally:
        if not was_applied:
            runtime_patches.remove(LORA_BASE_EMBEDDING_ROWS)
