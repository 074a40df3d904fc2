"""Train stock megatron-core on a CPU-only torch, two one-thread ranks over gloo
(tests/fork_patches/test_cpu_training_patches.py::test_megatron_cpu_training_runs_without_the_runtime_patches).

``python megatron_cpu_training.py patched DIR OUT``: the megatron-core under DIR (a copy with the
fork patches applied) first on the path, none of the plugin imported. ``... runtime - OUT``: the
installed megatron-core with the plugin's runtime CPU patches. ``... stock - OUT``: neither.

Each rank: experts over both ranks (megatron's all-to-all dispatcher and router, bf16 parameters,
dropout under megatron's RNG tracker, packed sequences in its local attention), one training step
(DDP, the mixed-precision optimizer, gradient clipping) and a distributed checkpoint; then two
pipeline stages with a tied embedding and one step. It writes what it saw to OUT/rank{r}.json (the
bits of its weights as a digest) or its traceback to OUT/rank{r}.error.
"""

from __future__ import annotations

import os
import sys

import torch

from forked_ranks import bits_digest, start_ranks

VOCAB = 64


def model_and_optimizer(config, spec, pre_process: bool, post_process: bool, tied: bool):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=32,
                     pre_process=pre_process, post_process=post_process,
                     share_embeddings_and_output_weights=tied, position_embedding_type="rope")
    model = DistributedDataParallel(config, DistributedDataParallelConfig(use_distributed_optimizer=False), model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-3, bf16=True, params_dtype=torch.bfloat16, clip_grad=1.0), [model])
    return model, optimizer


def train_step(model, optimizer, seq_lens: list[int]) -> dict:
    """One step on packed (THD) sequences of ``seq_lens`` tokens; the loss, the step's report and the
    weights after it."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.pipeline_parallel import get_forward_backward_func

    tokens = sum(seq_lens)
    input_ids = torch.randint(0, VOCAB, (1, tokens), generator=torch.Generator().manual_seed(0))
    positions = torch.cat([torch.arange(n) for n in seq_lens])[None]
    starts = torch.tensor([0, *torch.tensor(seq_lens).cumsum(0).tolist()], dtype=torch.int32)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=starts, cu_seqlens_kv=starts,
                             max_seqlen_q=max(seq_lens), max_seqlen_kv=max(seq_lens))

    def forward_step(data_iterator, model):
        per_token = model(input_ids, positions, None, labels=input_ids, packed_seq_params=packed)
        return per_token, lambda out: (out.float().mean(), {"loss": out.float().mean().detach()})

    model.zero_grad_buffer()
    optimizer.zero_grad()
    losses = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([None]), model=[model],
                                         num_microbatches=1, seq_length=tokens, micro_batch_size=1,
                                         forward_only=False)
    updated, grad_norm, _ = optimizer.step()
    return dict(loss=[float(l["loss"]) for l in losses], updated=bool(updated), grad_norm=float(grad_norm),
                weights=bits_digest(model.named_parameters()))


def trained(mode: str, world: int, out: str) -> dict:
    """This rank's steps (its process group started): what it saw."""
    torch.manual_seed(0)  # initialization draws from the host generator (use_cpu_initialization)
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    if mode == "runtime":
        from zero_mismatch_plugin.integrations.megatron import cpu_patches

        cpu_patches.training_on_cpu()
    common = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                  use_cpu_initialization=True, bf16=True, params_dtype=torch.bfloat16,
                  pipeline_dtype=torch.bfloat16, add_bias_linear=False, attention_dropout=0.1,
                  hidden_dropout=0.1, gradient_accumulation_fusion=False, bias_activation_fusion=False,
                  bias_dropout_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
                  apply_rope_fusion=False)
    seen = {"megatron": __import__("megatron.core").core.__file__}

    parallel_state.initialize_model_parallel(expert_model_parallel_size=world)
    model_parallel_cuda_manual_seed(1234)
    config = TransformerConfig(**common, num_moe_experts=4, moe_router_topk=2,
                               moe_token_dispatcher_type="alltoall", moe_grouped_gemm=False)
    model, optimizer = model_and_optimizer(config, get_gpt_layer_local_spec(num_experts=4), True, True, False)
    seen["experts"] = train_step(model, optimizer, [5, 7, 4])
    checkpoint = os.path.join(out, "checkpoint")
    os.makedirs(checkpoint, exist_ok=True)
    dist_checkpointing.save(model.module.sharded_state_dict(), checkpoint)
    seen["checkpoint"] = sorted(os.listdir(checkpoint))
    parallel_state.destroy_model_parallel()

    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=world)
    model_parallel_cuda_manual_seed(4321)
    stage = parallel_state.get_pipeline_model_parallel_rank()
    model, optimizer = model_and_optimizer(TransformerConfig(**common), get_gpt_layer_local_spec(),
                                           stage == 0, stage == world - 1, True)
    seen["pipeline"] = train_step(model, optimizer, [6, 10])
    return seen


def main(mode: str, patched: str, out: str, world: int = 2) -> None:
    if mode == "patched":
        sys.path.insert(0, patched)
    start_ranks(trained, world, mode, out)


if __name__ == "__main__":
    main(*sys.argv[1:4])
