"""The rank-side logic of the distributed Megatron face that needs no ranks: layouts, data-parallel
shares, expert renumbering, pipeline stages' checkpoint names, the context-parallel split, and
megatron-core's CPU patches for its all-to-all token dispatcher."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from zero_mismatch_plugin.faces.megatron import context_parallel, parallel, pipeline
from zero_mismatch_plugin.integrations import patches as runtime_patches
from zero_mismatch_plugin.integrations.megatron import cpu_patches
from zero_mismatch_plugin.integrations.megatron.distributed import Layout, data_parallel_share, share_tokens


def test_layouts_name_their_sizes_and_refuse_what_megatron_cannot_build():
    assert Layout(2, True).name == "tp2-sp" and Layout(2).world_size == 2
    ep = Layout(expert_model_parallel_size=2, data_parallel_size=2, moe_token_dispatcher_type="allgather")
    assert ep.name == "tp1-ep2-allgather-dp2" and ep.world_size == 2
    assert ep.config_overrides()["moe_token_dispatcher_type"] == "allgather"
    assert ep.engine_kwargs() == {"tensor_parallel_size": 1}  # the rollout keeps its experts in one process
    with pytest.raises(ValueError, match="does not divide"):
        Layout(expert_model_parallel_size=2)
    with pytest.raises(ValueError, match="moe_token_dispatcher_type='flex'"):
        Layout(expert_model_parallel_size=2, data_parallel_size=2, moe_token_dispatcher_type="flex")


def test_layouts_count_pipeline_and_context_ranks():
    assert Layout(pipeline_model_parallel_size=2).name == "tp1-pp2"
    assert Layout(context_parallel_size=2).name == "tp1-cp2"
    assert Layout(2, pipeline_model_parallel_size=2, context_parallel_size=2).world_size == 8
    overrides = Layout(context_parallel_size=2).config_overrides()
    assert overrides["context_parallel_size"] == 2 and overrides["pipeline_model_parallel_size"] == 1


def test_the_context_parallel_split_is_megatrons_load_balanced_chunks():
    split = context_parallel.Split((8, 4), 2)  # chunks of 2 and 1 rows
    # rank 0: chunks 0 and 3 of each sequence; rank 1: chunks 1 and 2.
    assert split.chunks(0) == [(0, 0, 2), (0, 6, 8), (1, 0, 1), (1, 3, 4)]
    assert split.chunks(1) == [(0, 2, 4), (0, 4, 6), (1, 1, 2), (1, 2, 3)]
    assert split.rows(0).tolist() == [0, 1, 6, 7, 8, 11] and split.rows(1).tolist() == [2, 3, 4, 5, 9, 10]
    assert split.positions(1).tolist() == [2, 3, 4, 5, 1, 2]
    whole = torch.arange(12.0)[:, None] * torch.ones(1, 3)
    assert torch.equal(split.whole([whole[split.rows(r)] for r in range(2)]), whole)
    assert context_parallel.padded_length(13, 2) == 16 and context_parallel.padded_length(16, 2) == 16
    with pytest.raises(ValueError, match="not multiples of 4"):
        context_parallel.Split((6,), 2)


def test_a_context_parallel_micro_batch_is_padded_to_the_longest_by_a_sequence_of_its_own():
    """Virtual stages run one micro-batch per stage through one exchanged shape: a shorter one gets a
    padding sequence after its real ones; the real rows, and where they lie, are unchanged."""
    from zero_mismatch_plugin.aligned.packing import pack
    from zero_mismatch_plugin.integrations.megatron.standalone import context_parallel_rows

    batch = pack([[1, 2, 3], [4, 5]], [[6, 7], [8, 9, 10]])  # 5 tokens each: padded to 8 at CP 2
    split, real = context_parallel_rows(batch, 2)
    assert split.seq_lens == (8, 8) and real.tolist() == [0, 1, 2, 3, 4, 8, 9, 10, 11, 12]
    padded, padded_real = context_parallel_rows(batch, 2, total=24)
    assert padded.seq_lens == (8, 8, 8) and torch.equal(padded_real, real)
    assert context_parallel_rows(batch, 2, total=16)[0].seq_lens == (8, 8)  # already as long
    with pytest.raises(ValueError, match="not multiples of 4"):
        context_parallel_rows(batch, 2, total=18)


def test_a_pipeline_stage_holds_its_layers_renumbered_and_its_ends(monkeypatch):
    config = SimpleNamespace(pipeline_model_parallel_size=2, num_layers=4)
    full = {f"decoder.layers.{i}.mlp.linear_fc2.weight": torch.full((1,), float(i)) for i in range(4)}
    full.update({"embedding.word_embeddings.weight": torch.zeros(1), "decoder.final_layernorm.weight": torch.ones(1)})
    monkeypatch.setattr(pipeline, "stage_layers", lambda config, vp_stage=None: range(2, 4))
    monkeypatch.setattr(pipeline, "stage_ends", lambda config, vp_stage=None: {"pre_process": False, "post_process": True})
    last = pipeline.to_stage(full, config, tied_head=True)
    assert sorted(last) == ["decoder.final_layernorm.weight", "decoder.layers.0.mlp.linear_fc2.weight",
                            "decoder.layers.1.mlp.linear_fc2.weight", "output_layer.weight"]
    assert last["decoder.layers.0.mlp.linear_fc2.weight"].item() == 2.0  # global layer 2
    assert last["output_layer.weight"] is full["embedding.word_embeddings.weight"]  # the tied head's copy
    assert "output_layer.weight" not in pipeline.to_stage(full, config, tied_head=False)


def test_with_virtual_stages_the_embedding_is_on_the_first_chunk_of_the_first_stage_and_the_head_on_the_last(
        monkeypatch):
    config = SimpleNamespace(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2, num_layers=4)
    for rank, expected in ((0, [(True, False), (False, False)]), (1, [(False, False), (False, True)])):
        monkeypatch.setattr(pipeline, "pipeline_group", lambda config: _Group(2, rank))
        monkeypatch.setattr(torch.distributed, "get_rank", lambda group: group.rank)
        ends = [pipeline.stage_ends(config, vp_stage) for vp_stage in (0, 1)]
        assert [(e["pre_process"], e["post_process"]) for e in ends] == expected, rank


def test_a_batch_splits_into_micro_batches_of_whole_sequences_in_order():
    from zero_mismatch_plugin.aligned.packing import pack, split_sequences

    prompts, responses = [[1, 2], [3], [4, 5, 6], [7]], [[8], [9, 10], [11], [12, 13, 14]]
    batch = pack(prompts, responses)
    parts = split_sequences(batch, 3)
    assert [len(p.seq_lens) for p in parts] == [2, 1, 1]
    assert torch.equal(torch.cat([p.input_ids for p in parts]), batch.input_ids)
    assert torch.equal(torch.cat([p.target_ids for p in parts]), batch.target_ids)
    assert [p.response_lens for p in parts] == [[1, 2], [1], [3]]
    with pytest.raises(ValueError, match="4 sequences cannot be split into 5 non-empty groups"):
        split_sequences(batch, 5)


def test_data_parallel_shares_cover_every_sequence_once_in_order():
    for n, ranks in ((4, 2), (5, 2), (7, 3), (3, 3)):
        shares = [data_parallel_share(n, ranks, r) for r in range(ranks)]
        assert [i for share in shares for i in share] == list(range(n))
        assert max(map(len, shares)) - min(map(len, shares)) <= 1
    with pytest.raises(ValueError, match="cannot give each of 4"):
        data_parallel_share(3, 4, 0)
    responses = [[1] * 3, [1] * 2, [1] * 4, [1]]
    assert [share_tokens(responses, data_parallel_share(4, 2, r)) for r in (0, 1)] == [slice(0, 5), slice(5, 10)]


class _Group:
    def __init__(self, size, rank):
        self._size, self.rank = size, rank

    def size(self):
        return self._size


def test_a_rank_takes_its_experts_renumbered_and_experts_are_never_split_over_tensor_ranks(monkeypatch):
    monkeypatch.setattr(parallel, "group_rank", lambda group: group.rank)
    name = "decoder.layers.0.mlp.experts.local_experts.{}.linear_fc1.weight"
    full = {name.format(e): torch.full((2, 2), float(e)) for e in range(4)}
    full["decoder.layers.0.mlp.router.weight"] = torch.zeros(4, 2)
    mine = parallel.local_experts_of(full, 4, _Group(2, 1))
    assert sorted(mine) == sorted([name.format(0), name.format(1), "decoder.layers.0.mlp.router.weight"])
    assert mine[name.format(0)][0, 0] == 2 and mine[name.format(1)][0, 0] == 3
    assert parallel.shard_layout(name.format(0)) is None  # whole on its rank
    assert parallel.shard_layout("decoder.layers.0.mlp.linear_fc1.weight") == "halves"
    assert parallel.local_experts_of(full, 4, None) is full


def test_the_all_to_all_dispatcher_patches_keep_split_sizes_on_the_host_and_come_off_again():
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher as Dispatcher

    from megatron.core.transformer.moe import moe_utils

    applied_earlier = any(runtime_patches.is_applied(p) for p in cpu_patches.MOE_PATCHES)  # an MoE model built here
    cpu_patches.remove_all()
    before = (Dispatcher.__dict__["cuda_dtoh_stream"], Dispatcher._maybe_dtoh_and_synchronize)
    cpu_patches.moe_on_cpu()
    try:
        assert all(runtime_patches.is_applied(p) for p in cpu_patches.MOE_PATCHES)
        assert Dispatcher.cuda_dtoh_stream is not None  # so __init__ makes no torch.cuda.Stream
        this = SimpleNamespace(drop_and_pad=False, cuda_dtoh_point="before_permutation_1",
                               input_splits=torch.tensor([3, 1]), output_splits=torch.tensor([2, 2]),
                               output_splits_tp=None)
        counts = torch.tensor([1, 2])
        assert Dispatcher._maybe_dtoh_and_synchronize(this, "before_permutation_1", counts) is counts
        assert isinstance(this.input_splits, np.ndarray) and this.input_splits.tolist() == [3, 1]
        assert isinstance(this.output_splits, np.ndarray) and this.output_splits_tp is None
        # Another point: nothing moves.
        other = SimpleNamespace(drop_and_pad=False, cuda_dtoh_point="before_ep_alltoall", input_splits=torch.tensor([1]))
        Dispatcher._maybe_dtoh_and_synchronize(other, "before_permutation_1")
        assert torch.is_tensor(other.input_splits)
        assert moe_utils.te_general_gemm is None  # bound, so the stock router takes its torch GEMM
    finally:
        cpu_patches.remove_all()
    assert (Dispatcher.__dict__["cuda_dtoh_stream"], Dispatcher._maybe_dtoh_and_synchronize) == before
    assert not hasattr(moe_utils, "te_general_gemm")  # unbound again, as megatron left it
    if applied_earlier:
        cpu_patches.moe_on_cpu()


def test_the_spec_takes_the_layouts_run_and_refuses_the_combinations_not_run():
    from zero_mismatch_plugin.faces.megatron.spec import unsupported_features

    def refused(**sizes):
        return [p for p in unsupported_features(SimpleNamespace(**sizes)) if "parallel" in p]

    assert refused(pipeline_model_parallel_size=2) == [] and refused(context_parallel_size=2) == []
    # Each of TP, EP and CP with PP, TP x EP and CP x EP with PP, and TP x EP x CP run bitwise
    # (test_megatron_tensor_parallel.py).
    for run in (dict(tensor_model_parallel_size=2), dict(num_moe_experts=8, expert_model_parallel_size=2),
                dict(context_parallel_size=2),
                dict(num_moe_experts=8, tensor_model_parallel_size=2, expert_model_parallel_size=2,
                     expert_tensor_parallel_size=1),
                dict(num_moe_experts=8, context_parallel_size=2, expert_model_parallel_size=2)):
        assert refused(pipeline_model_parallel_size=2, **run) == [], run
    assert refused(num_moe_experts=8, tensor_model_parallel_size=2, expert_model_parallel_size=2,
                   expert_tensor_parallel_size=1, context_parallel_size=2) == []
    # and on eight ranks TP x PP x CP, with EP too.
    assert refused(pipeline_model_parallel_size=2, tensor_model_parallel_size=2, context_parallel_size=2) == []
    assert refused(num_moe_experts=8, pipeline_model_parallel_size=2, tensor_model_parallel_size=2,
                   expert_model_parallel_size=2, expert_tensor_parallel_size=1, context_parallel_size=2) == []
    # Virtual stages (megatron's interleaved schedule) run bitwise (test_megatron_two_rank_layouts.py).
    assert refused(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2) == []


def test_a_bf16_stage_boundary_carries_both_addends_bit_for_bit_and_their_gradients_back():
    """What a bf16 stage sends: the two addends of its last residual sum in one fp32 word each,
    every bit kept (infinities, signed zeros, subnormals, NaN payloads); the next stage's sum and
    both addends are the sender's, and the gradients of both addends come back exactly."""
    from zero_mismatch_plugin.faces.megatron.pipeline import _PackAddends, _UnpackAddends, pack_pair, unpack_pair

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(5, 1, 16, generator=generator).to(torch.bfloat16)
    residual = torch.randn(5, 1, 16, generator=generator).to(torch.bfloat16) * 300
    specials = torch.tensor([float("inf"), -float("inf"), -0.0, 1e-40, float("nan")], dtype=torch.bfloat16)
    x[0, 0, :5] = specials
    residual.view(torch.int16)[1, 0, 0] = 0x7FC1  # a NaN with a payload
    packed = pack_pair(x, residual)
    assert packed.dtype == torch.float32 and packed.shape == x.shape and packed._base is None
    for sent, received in zip((x, residual), unpack_pair(packed, torch.bfloat16)):
        assert torch.equal(sent.view(torch.int16), received.view(torch.int16))  # bits, NaNs included

    x, residual = (t.detach().nan_to_num().requires_grad_() for t in (x, residual))
    sent = _PackAddends.apply(x, residual)
    received = sent.detach().requires_grad_()  # what megatron's receive hands the next stage
    x_next, residual_next = _UnpackAddends.apply(received, torch.bfloat16)
    assert torch.equal(x_next + residual_next, x + residual)
    grad_x, grad_residual = torch.randn(2, 5, 1, 16, generator=generator).to(torch.bfloat16)
    torch.autograd.backward((x_next, residual_next), (grad_x, grad_residual))
    assert received.grad.dtype == torch.float32  # sent back at pipeline_dtype
    sent.backward(received.grad)
    assert torch.equal(x.grad, grad_x) and torch.equal(residual.grad, grad_residual)
    with pytest.raises(ValueError, match="two 16-bit tensors of one dtype and shape"):
        pack_pair(x.float(), residual.float())


def test_bf16_stages_send_fp32_words_and_a_model_whose_stages_cannot_is_refused():
    from zero_mismatch_plugin.faces.megatron.pipeline import carry_addends_across_stages, send_addends_in_fp32
    from zero_mismatch_plugin.faces.megatron.spec import unsupported_features

    def config(pp, dtype):
        return SimpleNamespace(pipeline_model_parallel_size=pp, params_dtype=dtype, pipeline_dtype=dtype,
                               bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16)

    staged = config(2, torch.bfloat16)
    send_addends_in_fp32(staged)
    assert staged.pipeline_dtype == torch.float32  # verl and megatron default it to the model dtype
    for unchanged in (config(1, torch.bfloat16), config(2, torch.float32)):
        send_addends_in_fp32(unchanged)
        assert unchanged.pipeline_dtype == unchanged.params_dtype
    # A model built without the spec's setting: refused by name, not sent as the rounded sum.
    decoder = SimpleNamespace(config=config(2, torch.bfloat16), pre_process=False, post_process=True)
    with pytest.raises(NotImplementedError, match=r"pipeline_dtype is torch.bfloat16: build the model from "
                                                  r"aligned_gpt_spec \(which sets it\) or set pipeline_dtype=torch.float32"):
        carry_addends_across_stages(SimpleNamespace(decoder=decoder))
    assert unsupported_features(config(2, torch.bfloat16)) == []
    assert unsupported_features(config(2, torch.float16)) == ["pipeline parallelism > 1 in fp16 (not run; bf16 and "
                                                              "fp32 are)"]


def test_a_layout_takes_virtual_pipeline_stages_at_pipeline_parallelism_with_any_other_parallelism():
    from zero_mismatch_plugin.integrations.megatron.distributed import Layout

    layout = Layout(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
    assert layout.name == "tp1-pp2-vp2" and layout.world_size == 2
    assert layout.config_overrides()["virtual_pipeline_model_parallel_size"] == 2
    assert "virtual_pipeline_model_parallel_size" not in Layout(pipeline_model_parallel_size=2).config_overrides()
    with_replicas = Layout(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2, data_parallel_size=2)
    assert with_replicas.name == "tp1-pp2-vp2-dp2" and with_replicas.world_size == 4
    with_tensor = Layout(tensor_model_parallel_size=2, sequence_parallel=True, pipeline_model_parallel_size=2,
                         virtual_pipeline_model_parallel_size=2)
    assert with_tensor.name == "tp2-sp-pp2-vp2" and with_tensor.world_size == 4
    with_experts = Layout(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2, data_parallel_size=2,
                          expert_model_parallel_size=2)
    assert with_experts.name == "tp1-ep2-alltoall-pp2-vp2-dp2" and with_experts.world_size == 4
    with_context = Layout(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2, context_parallel_size=2)
    assert with_context.name == "tp1-pp2-vp2-cp2" and with_context.world_size == 4
    for sizes in (dict(), dict(tensor_model_parallel_size=2), dict(context_parallel_size=2)):
        with pytest.raises(ValueError, match=r"virtual_pipeline_model_parallel_size=2: virtual stages split each "
                                             r"pipeline stage's layers; set pipeline_model_parallel_size > 1"):
            Layout(virtual_pipeline_model_parallel_size=2, **sizes)


def test_the_pipeline_patches_give_the_schedule_a_host_token_count_and_come_off_again():
    import megatron.core.pipeline_parallel.schedules as schedules
    from megatron.core.models.common.language_module.language_module import LanguageModule

    applied_earlier = any(runtime_patches.is_applied(p) for p in cpu_patches.PIPELINE_PATCHES)  # a PP model built here
    for patch in cpu_patches.PIPELINE_PATCHES:
        runtime_patches.remove(patch)
    before = (schedules.torch, LanguageModule.setup_embeddings_and_output_layer)
    cuda = torch.Tensor.cuda
    assert before[0] is torch
    cpu_patches.pipeline_on_cpu()
    try:
        count = schedules.torch.zeros([], dtype=torch.int, device="cuda")  # the schedules' own call
        assert count.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
        assert schedules.torch.no_grad is torch.no_grad
        moved = []

        def copy_like_megatron(self):
            moved.append(torch.zeros(2).cuda().device.type)  # what megatron does before its all-reduce

        wrapped = cpu_patches._host_embedding_copy(copy_like_megatron)
        wrapped(object())
        # With CUDA the patch is a no-op and megatron's own move happens.
        assert moved == ["cuda" if torch.cuda.is_available() else "cpu"] and torch.Tensor.cuda is cuda
    finally:
        for patch in cpu_patches.PIPELINE_PATCHES:
            runtime_patches.remove(patch)
    assert (schedules.torch, LanguageModule.setup_embeddings_and_output_layer) == before
    if applied_earlier:
        cpu_patches.pipeline_on_cpu()


def test_a_layout_switch_destroys_the_groups_of_the_layout_it_leaves_and_forgets_its_models():
    """megatron's destroy_model_parallel forgets most of its groups without destroying them; each
    gloo group keeps a socket-polling thread, so a rank group serving many layouts idled at a third
    of a core per rank. After each switch only the new layout's groups are registered (one process:
    the world-1 layout set up again), and the models built at the old one are dropped."""
    from support.preloaded_python import run_script

    result = run_script("""
        import json
        import torch.distributed as dist
        from megatron.core import parallel_state
        from zero_mismatch_plugin.integrations.megatron import distributed
        from zero_mismatch_plugin.integrations.megatron.standalone import init_single_process

        init_single_process()
        registered = [len(dist.distributed_c10d._world.pg_map)]
        dropped = []
        for _ in range(3):
            distributed._BUILT["planted"] = object()
            distributed._drop_layout()
            dropped.append(not distributed._BUILT)
            parallel_state.initialize_model_parallel(1, 1)
            registered.append(len(dist.distributed_c10d._world.pg_map))
        stock = []  # megatron's teardown alone, for contrast
        for _ in range(2):
            parallel_state.destroy_model_parallel()
            parallel_state.initialize_model_parallel(1, 1)
            stock.append(len(dist.distributed_c10d._world.pg_map))
        print(json.dumps({"registered": registered, "dropped": dropped, "stock": stock}))
    """)
    assert result.returncode == 0, result.stderr[-3000:]
    counts = json.loads(result.stdout.strip().splitlines()[-1])
    assert all(counts["dropped"]), counts
    assert len(set(counts["registered"])) == 1, counts
    assert counts["stock"][0] > counts["registered"][-1] and counts["stock"][1] > counts["stock"][0], counts
