"""The gloo checkpoint engine moves every weight bit for bit from trainer rank 0 to the rollout
ranks, across bucket boundaries and for tensors larger than one bucket."""

from __future__ import annotations

import asyncio
import multiprocessing

import torch

BUCKET_BYTES = 64  # small, so the weights below need several buckets and one is split in chunks


def _weights() -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [("embed.weight", torch.randn(4, 3, generator=generator)),          # 48 bytes
            ("layer.weight", torch.randn(5, 7, generator=generator)),          # 140 bytes > a bucket
            ("layer.bias", torch.randn(2, generator=generator, dtype=torch.float64)),
            ("norm.weight", torch.randn(3, generator=generator).to(torch.bfloat16))]


def _engine(is_master: bool):
    from zero_mismatch_plugin.integrations.verl.cpu.gloo_checkpoint_engine import GlooCheckpointEngine

    return GlooCheckpointEngine(bucket_size=BUCKET_BYTES, is_master=is_master)


def _receiver(rank: int, world_size: int, master: dict, results) -> None:
    engine = _engine(is_master=False)
    engine.init_process_group(rank=rank, world_size=world_size, master=master)

    async def collect():
        return [(name, _bits(tensor)) async for name, tensor in engine.receive_weights()]

    # Plain bytes, not tensors: a tensor put on the queue is fetched later from this process's
    # file-descriptor server, which is gone once this process exits.
    results.put((rank, asyncio.run(collect())))
    engine.finalize()


def _bits(tensor: torch.Tensor) -> tuple[str, tuple[int, ...], bytes]:
    return str(tensor.dtype), tuple(tensor.shape), tensor.contiguous().view(torch.uint8).numpy().tobytes()


def test_weights_arrive_bit_for_bit_at_every_rollout_rank():
    from zero_mismatch_plugin.integrations.verl.cpu.gloo_checkpoint_engine import GlooCheckpointEngine

    sender = _engine(is_master=True)
    master = sender.prepare()
    actor_kwargs, rollout_kwargs = GlooCheckpointEngine.build_topology(2, 2, [master, {}, {}, {}])
    assert actor_kwargs["rank"] == [0, -1] and rollout_kwargs["rank"] == [1, 2]

    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    receivers = [context.Process(target=_receiver, args=(rank, 3, master, results)) for rank in (1, 2)]
    for process in receivers:
        process.start()
    sender.init_process_group(rank=0, world_size=3, master=master)
    asyncio.run(sender.send_weights(iter(_weights())))
    received = dict(results.get(timeout=120) for _ in receivers)
    for process in receivers:
        process.join(timeout=60)
    sender.finalize()

    expected = [(name, _bits(tensor)) for name, tensor in _weights()]
    for rank in (1, 2):
        assert received[rank] == expected  # names, dtypes, shapes and every byte


def test_trainer_ranks_outside_the_group_only_walk_the_generator():
    engine = _engine(is_master=False)
    engine.init_process_group(rank=-1, world_size=3, master={})
    walked = []

    def weights():
        for item in _weights():
            walked.append(item[0])
            yield item

    asyncio.run(engine.send_weights(weights()))
    assert len(walked) == 4
