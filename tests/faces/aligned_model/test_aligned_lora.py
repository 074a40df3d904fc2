"""Dense LoRA: engine (enable_lora, LoRARequest) vs the aligned trainer (frozen base + adapter).

Tiny Llama and Qwen3 with a rank-8 and a rank-32 (rsLoRA) adapter on every linear (and a rank-16
one on q and v only). One
LoRA-enabled engine per model, started by this module after the session's shared engine is shut
down (at most one engine alive). All adapters are served by the same engine (``max_lora_rank``
32: the rank-8 one is zero-padded, as the trainer pads it).
"""

from __future__ import annotations

import time

from support import aligned_checks as checks
import pytest
import torch

from support.aligned_checks import assert_lora_bitwise as assert_bitwise
from support.aligned_checks import lora_engines as engines_with_lora
from support.aligned_checks import lora_score as score
from support.vllm_session import MAX_MODEL_LEN, prompts_for

from zero_mismatch_plugin.aligned import SamplingTransform, pack
from zero_mismatch_plugin.aligned.lora.adapter import build_adapter
from zero_mismatch_plugin.aligned.lora.ops import merged_lora_weight
from zero_mismatch_plugin.aligned.runtime import engine_args_for, shutdown_engine

MODELS = ("llama", "qwen3")
# Both slots hold an adapter in the mixed-batch test: a base request there is right only with the
# plugin's LORA_BASE_ROWS patch in the engine.
LORA_ENGINE = dict(enable_lora=True, max_lora_rank=32, max_loras=2, max_model_len=MAX_MODEL_LEN, seed=0)
ADAPTERS = {
    "r8": dict(r=8, lora_alpha=16, seed=11),
    "r32": dict(r=32, lora_alpha=16, use_rslora=True, seed=12),
    # PEFT's common choice: q and v only (a merged linear with an empty slice, untouched linears).
    "qv16": dict(r=16, lora_alpha=32, targets=("q_proj", "v_proj"), seed=13),
}
ADAPTER_IDS = {"r8": 1, "r32": 2, "qv16": 3}


@pytest.fixture(scope="module", params=MODELS)
def model(request):
    """Module-scoped, so pytest runs every test of one model before the next (one engine start each)."""
    return request.param


@pytest.fixture(scope="module")
def lora_engines(engines):
    return engines_with_lora(engines, dict(max_logprobs=-1, **LORA_ENGINE), __name__)


@pytest.fixture(scope="module")
def adapters(checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_adapters")
    return {
        (model, name): build_adapter(root / f"{model}_{name}", checkpoints[model], **spec)
        for model in MODELS
        for name, spec in ADAPTERS.items()
    }


@pytest.fixture(scope="module")
def lora_trainers(checkpoints, adapters):
    from zero_mismatch_plugin.faces.aligned_model import AlignedCausalLM

    cache = {}

    def get(model, adapter):
        if (model, adapter) not in cache:
            cache[model, adapter] = AlignedCausalLM.from_pretrained(
                checkpoints[model], lora_dir=adapters[model, adapter], **LORA_ENGINE
            )
        return cache[model, adapter]

    return get


def lora_request(adapters, model, adapter):
    from vllm.lora.request import LoRARequest

    return LoRARequest(f"{model}-{adapter}", ADAPTER_IDS[adapter], str(adapters[model, adapter]))


def generate(llm, prompts, requests, seed=0, n=1, logprobs=0, max_tokens=16):
    """One batch; per sequence (prompt, response, μ, {token: logprob} per position, request)."""
    from vllm import SamplingParams

    params = [
        SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs, seed=seed + i)
        for i in range(len(prompts))
    ]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=requests, use_tqdm=False)
    rows = []
    for prompt, out, request in zip(prompts, outs, requests):
        for c in out.outputs:
            ids = list(c.token_ids)
            mu = torch.tensor([step[t].logprob for t, step in zip(ids, c.logprobs)])
            dists = [{t: lp.logprob for t, lp in step.items()} for step in c.logprobs]
            rows.append((prompt, ids, mu, dists, request))
    return rows


def test_lora_sampled_and_full_distribution_bitwise_equal_engine(model, lora_engines, lora_trainers, adapters):
    llm = lora_engines.get(model)
    for adapter in ADAPTERS:
        trainer = lora_trainers(model, adapter)
        prompts = prompts_for(trainer.runtime.model_dir)
        rows = generate(llm, prompts, [lora_request(adapters, model, adapter)] * len(prompts), n=2, logprobs=-1)
        assert len(rows) == 16 and all(len(r[3][0]) >= trainer.vocab_size for r in rows)
        assert_bitwise(score(trainer, rows), rows, f"{model} {adapter} sampled")
        batch = pack([r[0] for r in rows], [r[1] for r in rows])
        with torch.no_grad():
            full = SamplingTransform().logprobs(trainer.logits(batch))
        dists = [d for r in rows for d in r[3]]
        engine = torch.tensor([[d[t] for t in range(trainer.vocab_size)] for d in dists])
        assert torch.equal(full[:, : trainer.vocab_size], engine), (
            f"{model} {adapter} full distribution: {(full[:, :trainer.vocab_size] == engine).float().mean().item():.1%} equal"
        )
        # The adapter is really in the forward: the base model gives other numbers.
        assert not torch.equal(score(trainer, rows, adapter=False), torch.cat([r[2] for r in rows]))


def test_lora_batch_sizes_and_mixed_batches_bitwise_equal_engine(model, lora_engines, lora_trainers, adapters):
    llm = lora_engines.get(model)
    trainer8, trainer32 = lora_trainers(model, "r8"), lora_trainers(model, "r32")
    prompts = prompts_for(trainer8.runtime.model_dir)
    r8 = lora_request(adapters, model, "r8")
    r32 = lora_request(adapters, model, "r32")
    for b in range(1, 9):
        rows = generate(llm, prompts[:b], [r8] * b, seed=100)
        assert_bitwise(score(trainer8, rows), rows, f"{model} r8 batch of {b}")
    # Mixed: rank-8 adapter, base model and rank-32 adapter requests in one batch.
    kinds = [r8, None, r32] * 3
    rows = generate(llm, prompts, kinds[: len(prompts)], seed=200, n=2)
    groups = {
        "r8": ([r for r in rows if r[4] is r8], trainer8, True),
        "base": ([r for r in rows if r[4] is None], trainer8, False),
        "r32": ([r for r in rows if r[4] is r32], trainer32, True),
    }
    for what, (group, trainer, adapter) in groups.items():
        assert group, what
        assert_bitwise(score(trainer, group, adapter), group, f"{model} mixed batch, {what} rows")


def test_merged_lora_forward_is_close_but_not_the_engine_bits(model, lora_engines, lora_trainers, adapters):
    """Negative control: PEFT's merged weight W + s·BA through the same vLLM kernels."""
    from zero_mismatch_plugin.faces.aligned_model import AlignedCausalLM

    llm = lora_engines.get(model)
    trainer = lora_trainers(model, "r32")
    prompts = prompts_for(trainer.runtime.model_dir)
    rows = generate(llm, prompts, [lora_request(adapters, model, "r32")] * len(prompts), seed=300, n=2)
    merged = AlignedCausalLM.from_pretrained(trainer.runtime.model_dir, max_model_len=MAX_MODEL_LEN, seed=0)
    params = dict(merged.named_parameters())
    scaling = trainer.lora.lora_config.scaling
    with torch.no_grad():
        for i, target, pair in trainer.lora.pairs():
            parent = "self_attn" if target.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            w = params[f"model.layers.{i}.{parent}.{target}.weight"]
            w.copy_(merged_lora_weight(w, pair.lora_A, pair.lora_B, scaling))
    merged_lp = score(merged, rows, adapter=False)
    mu = torch.cat([r[2] for r in rows])
    equal = (merged_lp == mu).float().mean().item()
    max_diff = (merged_lp - mu).abs().max().item()
    print(f"{model}: merged (W + s·BA) forward {equal:.1%} of {mu.numel()} tokens bitwise equal, max |diff| {max_diff:.3g}")
    assert max_diff < 1e-3  # the same model ...
    assert not torch.equal(merged_lp, mu)  # ... but not the engine's arithmetic


def _peft_reference(trainer, adapter_dir, dtype):
    """transformers + PEFT (unmerged LoRA) carrying the trainer's base weights and adapter."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(trainer.runtime.model_dir), dtype=dtype)
    base.get_input_embeddings().padding_idx = None  # vLLM's embedding has no padding row
    model = PeftModel.from_pretrained(base, str(adapter_dir), is_trainable=True).to(dtype)
    return model.eval()


def _peft_parameters(adapter_dir):
    """``reference(trainer)`` for the gradient check: transformers + PEFT in float64 and its A / B
    under the trainer's adapter parameter names."""

    def reference(trainer):
        model = _peft_reference(trainer, adapter_dir, torch.float64)
        params = {}
        for name, p in model.named_parameters():
            if "lora_" in name:
                # base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight
                parts = name.split(".")
                params[f"layers.{parts[4]}.{parts[6]}.{parts[7]}"] = p
        return model, params

    return reference


def test_lora_backward_matches_float64_and_base_gets_no_gradient(model, lora_engines, lora_trainers, adapters):
    llm = lora_engines.get(model)
    trainer = lora_trainers(model, "r32")
    prompts = prompts_for(trainer.runtime.model_dir)
    rows = generate(llm, prompts, [lora_request(adapters, model, "r32")] * len(prompts), seed=400)
    worst = checks.check_lora_backward_matches_float64(trainer, rows, _peft_parameters(adapters[model, "r32"]))
    print(f"{model}: worst relative LoRA gradient error vs float64 {worst:.3g}")


def test_lora_equal_again_after_optimizer_step_and_adapter_sync(model, lora_engines, lora_trainers, adapters, tmp_path):
    """A new adapter version reaches the engine through vLLM's adapter loading: a new
    LoRARequest (new id, new directory), then an in-place reload (same id, load_inplace)."""
    from vllm.lora.request import LoRARequest

    llm = lora_engines.get(model)
    trainer = lora_trainers(model, "r8")
    prompts = prompts_for(trainer.runtime.model_dir)
    request = lora_request(adapters, model, "r8")
    optimizer = torch.optim.AdamW(trainer.lora.parameters(), lr=2e-2)
    for version, inplace in ((1, False), (2, True)):
        before = generate(llm, prompts, [request] * len(prompts), seed=500)
        batch = pack([r[0] for r in before], [r[1] for r in before])
        (-trainer.token_logprobs(batch).mean()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        start = time.perf_counter()
        path = trainer.save_adapter(tmp_path / f"v{version}")
        if inplace:
            request = LoRARequest(request.lora_name, request.lora_int_id, str(path), load_inplace=True)
        else:
            request = LoRARequest(f"{model}-r8-v{version}", 100 + version, str(path))
        after = generate(llm, prompts, [request] * len(prompts), seed=500)
        elapsed = time.perf_counter() - start
        print(f"{model}: adapter sync ({'in place' if inplace else 'new request'}) + rollout {elapsed:.2f} s")
        # Same seeds: only the adapter can have changed the rollout.
        assert [r[1] for r in after] != [r[1] for r in before] or not torch.equal(
            torch.cat([r[2] for r in after]), torch.cat([r[2] for r in before])
        )
        assert_bitwise(score(trainer, after), after, f"{model} after update {version}")


# ----- zmrl check --lora ------------------------------------------------------------------


@pytest.mark.parametrize("trainer", ["aligned", "megatron"])
def test_zmrl_check_lora_passes_every_check(trainer, checkpoints, adapters, lora_engines, tmp_path, capsys):
    """Both trainer faces with the adapter (the Megatron face through ``megatron.lora``)."""
    import json

    from zero_mismatch_plugin.tools import cli

    lora_engines.pool.make_room()  # room for the engine started here
    out = tmp_path / "check.json"
    code = cli.main([
        "check", "--model", str(checkpoints["llama"]), "--lora", str(adapters["llama", "r32"]), "--trainer", trainer,
        "--max-model-len", str(MAX_MODEL_LEN), "--num-prompts", "4", "--max-tokens", "12",
        "--batch-sizes", "1,4", "--full-vocab", "--json", str(out), "--quiet",
    ])
    table = capsys.readouterr().out
    print(table)
    report = json.loads(out.read_text())
    assert code == 0, table
    assert "+ LoRA" in table
    assert all(entry["pass"] is True for entry in report.values()), report
    assert set(report) == {"sampled_token", "full_distribution", "batch_composition", "prefix_cache"}
    assert "prompt_logprobs with a LoRA request fails" in table  # prefill_vs_decode: skipped, said why
    assert report["sampled_token"]["bitwise_equal_fraction"] == 1.0
    assert report["full_distribution"]["entries"] == 4 * 12 * 512


def test_zmrl_check_lora_refuses_unsupported_adapters_before_starting(checkpoints, adapters, tmp_path, capsys):
    import json
    import shutil

    from zero_mismatch_plugin.tools import cli

    dora = tmp_path / "dora"
    shutil.copytree(adapters["llama", "r8"], dora)
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True, "target_modules": ["q_proj", "kv_b_proj"]}))
    base = ["check", "--model", str(checkpoints["llama"]), "--max-model-len", str(MAX_MODEL_LEN), "--quiet"]
    assert cli.main([*base, "--lora", str(dora)]) == 2
    err = capsys.readouterr().err
    assert "use_dora" in err and "kv_b_proj" in err
    assert cli.main([*base, "--lora", str(adapters["llama", "r8"]), "--trainer", "hf"]) == 2
    assert "--trainer aligned" in capsys.readouterr().err


def test_engine_patch_gives_tokens_without_adapter_no_lora():
    """vLLM's torch shrink op indexes slot -1 (the last slot) for a token without adapter; the
    plugin's patch makes that token's shrink 0. Checked on the op itself, patched and not."""
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    from zero_mismatch_plugin.integrations import patches as runtime_patches
    from zero_mismatch_plugin.integrations.vllm.plugin import LORA_BASE_ROWS

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 16, generator=gen)
    slots = torch.randn(2, 1, 8, 16, generator=gen)  # both slots hold an adapter
    indices = torch.tensor([0, -1, 1, -1, 0, 1])
    x[1] = x[2]  # token 1 (no adapter) has the input of token 2 (slot 1)

    def shrink():
        """The engine's path (sgmv: per-request indices, exploded per token) for 6 one-token requests."""
        out = torch.zeros(6, 8)
        lora_ops.sgmv_shrink(x, slots, out, None, torch.ones(6, dtype=torch.long), indices, 6, 1, 6, 1.0)
        return out

    was_applied = runtime_patches.is_applied(LORA_BASE_ROWS)
    runtime_patches.remove(LORA_BASE_ROWS)
    try:
        unpatched = shrink()
        assert torch.equal(unpatched[1], unpatched[2])  # slot -1 is slot 1's adapter
        runtime_patches.apply(LORA_BASE_ROWS)
        assert punica_cpu.bgmv_shrink is lora_ops.bgmv_shrink  # the decode path sees it too
        patched = shrink()
        assert torch.equal(patched[[1, 3]], torch.zeros(2, 8))
        assert torch.equal(patched[[0, 2, 4, 5]], unpatched[[0, 2, 4, 5]])
    finally:
        if not was_applied:
            runtime_patches.remove(LORA_BASE_ROWS)
