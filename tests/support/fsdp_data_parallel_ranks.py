"""Run by torchrun on two one-thread ranks (tests/faces/fsdp/test_fsdp_data_parallel.py): the
checkpoint wrapped by verl's ``apply_fsdp2`` over a two-rank mesh, the aligned FSDP forward on
each rank's share of the sequences, one backward of ``sum(c * logprob)`` (FSDP2's reduce-scatter),
one SGD step and the logprobs again. Rank 0 saves every rank's logprobs, the full gradients, the
full weights, the logprobs after the step and those of verl's own (transformers) forward then
to argv[2]; the request (checkpoint, prompts, responses, c) is argv[1]."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

# What main imports, preloaded once by the launcher's fork server (support/torchrun.py).
PRELOAD = ("transformers", "verl.utils.fsdp_utils", "zero_mismatch_plugin.aligned.runtime",
           "zero_mismatch_plugin.faces.fsdp")


def main(request_path: str, out_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from transformers import AutoModelForCausalLM
    from verl.utils.fsdp_utils import apply_fsdp2

    from zero_mismatch_plugin.aligned.numerics import consistent_numerics
    from zero_mismatch_plugin.aligned.packing import pack
    from zero_mismatch_plugin.aligned.runtime import VllmRuntime
    from zero_mismatch_plugin.faces import fsdp as fsdp_face
    from zero_mismatch_plugin.faces.fsdp import AlignedFSDPForward, PackedMicroBatch
    from zero_mismatch_plugin.integrations.megatron.distributed import data_parallel_share, share_tokens

    request = torch.load(request_path)
    with consistent_numerics():
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
        model = AutoModelForCausalLM.from_pretrained(request["checkpoint"], dtype=torch.float32)
        policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
        apply_fsdp2(model, {"mesh": mesh, "mp_policy": policy, "reshard_after_forward": True}, {})
        aligned = AlignedFSDPForward(VllmRuntime(request["checkpoint"], dtype="float32", **request["engine_kwargs"]),
                                     model.config)
        share = data_parallel_share(len(request["prompts"]), world, rank)
        batch = pack([request["prompts"][i] for i in share], [request["responses"][i] for i in share])
        packed = PackedMicroBatch(batch.input_ids, batch.positions, batch.seq_lens, cu_seqlens=None, labels=None,
                                  temperature=None)
        coefficients = request["coefficients"][share_tokens(request["responses"], share)]

        def logprobs():
            logits = aligned.logits(model, packed).index_select(0, batch.target_rows)
            return logits.log_softmax(-1).gather(-1, batch.target_ids[:, None])[:, 0]

        values = logprobs()
        (values * coefficients).sum().backward()
        grads = {name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad) * world
                 for name, p in model.named_parameters()}  # FSDP2 averages over the ranks
        with torch.no_grad():
            for p in model.parameters():
                p.add_(p.grad, alpha=-request["lr"])
        aligned.mark_stale()
        weights = {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()
                   for name, p in model.named_parameters()}
        with torch.no_grad():
            after = logprobs()
        # The negative control: verl's own (transformers) forward of the same stepped FSDP2 model.
        fsdp_face.uninstall(model)
        with torch.no_grad():
            own = [model(input_ids=torch.tensor([request["prompts"][i] + request["responses"][i]])).logits[0]
                   [len(request["prompts"][i]) - 1:-1].log_softmax(-1)
                   .gather(-1, torch.tensor(request["responses"][i])[:, None])[:, 0] for i in share]
    gathered = [None] * world
    dist.all_gather_object(gathered, (batch.split_per_sequence(values.detach()), batch.split_per_sequence(after), own))
    if rank == 0:
        torch.save({"logprobs": [s for part, _, _ in gathered for s in part],
                    "logprobs_after": [s for _, part, _ in gathered for s in part],
                    "own_forward_after": [s for _, _, part in gathered for s in part], "grads": grads,
                    "weights": weights}, out_path)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
