"""Run by torchrun on four one-thread ranks (tests/faces/megatron/test_megatron_reduction_order.py):
every rank holds a planted partial whose columns are the permutations of (2^25, -2^25, 1, 0) over
the ranks, so a column's fp32 sum is 1 or 0 depending on the order of the additions. Rank 0 writes
what each reduction gave on every rank to the JSON file named by argv[1]."""

from __future__ import annotations

import itertools
import json
import os
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist

# What main imports, preloaded once by the launcher's fork server (support/torchrun.py).
PRELOAD = ("megatron.core.tensor_parallel", "zero_mismatch_plugin.faces.megatron.parallel",
           "zero_mismatch_plugin.integrations.vllm.cpu_all_reduce")


def planted(world: int) -> torch.Tensor:
    """[world, tokens=4, columns=64]: rank r's partial is [r]."""
    big = 2.0 ** 25
    columns = torch.tensor(list(itertools.permutations([big, -big, 1.0, 0.0])), dtype=torch.float32).t()[:world]
    columns = torch.cat([columns, torch.zeros(world, 64 - columns.shape[1])], dim=1)
    return torch.stack([columns.roll(t, dims=1) for t in range(4)], dim=1)


def main(out_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import mappings

    from zero_mismatch_plugin.aligned.reductions import rank_order_sum
    from zero_mismatch_plugin.faces.megatron import parallel
    from zero_mismatch_plugin.integrations import patches as runtime_patches
    from zero_mismatch_plugin.integrations.vllm import cpu_all_reduce

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    group = parallel_state.get_tensor_model_parallel_group()
    table = planted(world)
    expected = rank_order_sum(list(table))
    mine = table[rank].clone()
    got = {}
    with parallel.cpu_megatron_collectives():
        leaf = mine.clone().requires_grad_(True)
        face = parallel.row_output(leaf, group, False)
        face.backward(torch.full_like(face, float(rank + 1)))
        got["face"] = face.detach()
        got["face_grad_is_identity"] = bool(torch.equal(leaf.grad, torch.full_like(mine, float(rank + 1))))
        leaf = mine.clone().requires_grad_(True)
        face_sp = parallel.row_output(leaf, group, True)
        face_sp.backward(torch.full_like(face_sp, float(rank + 1)))
        got["face_sp"] = face_sp.detach()
        got["face_sp_grad"] = leaf.grad
        got["megatron"] = mappings.reduce_from_tensor_model_parallel_region(mine.clone(), group=group)
    # vLLM's CPU all-reduce, stock and as the plugin patches it. Stock is the shared-memory kernel
    # where the host's kernel library has it (vLLM's CpuCommunicator checks the same attribute),
    # else torch.distributed's all-reduce, which vLLM then falls back to.
    from vllm.platforms import current_platform

    current_platform.import_kernels()  # the host's build (_C, _C_AVX512 or _C_AVX2) registers torch.ops._C
    stock = mine.clone()
    if hasattr(torch.ops._C, "init_shm_manager"):
        names = [None] * world
        dist.all_gather_object(names, f"zmrl-order-{os.environ['MASTER_PORT']}")
        handle = torch.ops._C.init_shm_manager(names[0], world, rank, 1)
        dist.barrier()
        torch.ops._C.join_shm_manager(handle, names[0])
        dist.barrier()
        torch.ops._C.shm_allreduce(handle, stock)
        got["vllm_stock_path"] = "shared memory"
    else:
        dist.all_reduce(stock, group=group)
        got["vllm_stock_path"] = "torch.distributed"
    got["vllm_stock"] = stock
    from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator

    runtime_patches.apply(cpu_all_reduce.TENSOR_PARALLEL_ALL_REDUCE)
    try:
        patched = CpuCommunicator.all_reduce(SimpleNamespace(world_size=world, device_group=group), mine.clone())
    finally:
        runtime_patches.remove(cpu_all_reduce.TENSOR_PARALLEL_ALL_REDUCE)
    got["vllm_patched"] = patched
    gathered = [None] * world
    dist.all_gather_object(gathered, {k: (v.tolist() if torch.is_tensor(v) else v) for k, v in got.items()})
    if rank == 0:
        Path = __import__("pathlib").Path
        Path(out_path).write_text(json.dumps({"expected": expected.tolist(), "ranks": gathered}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
