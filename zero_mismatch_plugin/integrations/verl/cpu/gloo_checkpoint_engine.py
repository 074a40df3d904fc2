"""A gloo checkpoint engine: verl's trainer-to-rollout weight sync between processes on a CPU.

Selected with ``checkpoint_engine.backend=gloo`` and ``custom_backend_module`` naming this module
(importing it registers the engine). Each bucket goes from trainer rank 0 to the rollout workers
over a gloo group built per update: header length, pickled header, payload. See docs/recipes.md,
"verl's own trainer on a CPU".
"""

from __future__ import annotations

import pickle
from datetime import timedelta

import torch
from verl.checkpoint_engine.base import (
    CheckpointEngine,
    CheckpointEngineRegistry,
    merge_weight_chunks,
    split_weight_chunks,
)
from verl.workers.rollout.utils import ensure_async_iterator

from zero_mismatch_plugin.integrations.verl.cpu.listen_ports import free_listen_port

BACKEND = "gloo"
SENDER = 0
OUT_OF_GROUP = -1
TIMEOUT = timedelta(minutes=30)


def _node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address().strip("[]")


@CheckpointEngineRegistry.register(BACKEND)
class GlooCheckpointEngine(CheckpointEngine):
    def __init__(self, bucket_size: int, is_master: bool = False, **unused_engine_kwargs) -> None:
        self.bucket_size = bucket_size
        self.is_master = is_master
        self.rank: int | None = None
        self._store = None
        self._group = None

    # ----- set-up, once per weight update ----------------------------------------------------

    def prepare(self) -> dict:
        # A fresh rendezvous each update: verl builds the group anew before every sync.
        return {"host": _node_ip(), "port": free_listen_port()} if self.is_master else {}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]):
        master = metadata[0]
        if not master:
            raise RuntimeError("gloo checkpoint engine: trainer rank 0 must be created with is_master=True")
        world_size = 1 + rollout_world_size
        actor = {"rank": [SENDER] + [OUT_OF_GROUP] * (actor_wg_world_size - 1),
                 "world_size": [world_size] * actor_wg_world_size,
                 "master": [master] * actor_wg_world_size}
        rollout = {"rank": list(range(1, world_size)),
                   "world_size": [world_size] * rollout_world_size,
                   "master": [master] * rollout_world_size}
        return actor, rollout

    def init_process_group(self, rank: int, world_size: int, master: dict):
        self.rank = rank
        if rank == OUT_OF_GROUP:
            return
        from torch.distributed import ProcessGroupGloo, TCPStore

        self._store = TCPStore(master["host"], master["port"], world_size, is_master=rank == SENDER,
                               timeout=TIMEOUT)
        self._group = ProcessGroupGloo(self._store, rank, world_size, TIMEOUT)

    def finalize(self):
        self._group = None
        self._store = None
        self.rank = None

    # ----- transfer --------------------------------------------------------------------------

    def _broadcast(self, tensor: torch.Tensor) -> None:
        self._group.broadcast(tensor, SENDER).wait()

    def _send_bucket(self, chunks: list[torch.Tensor], metas: list, is_last: bool) -> None:
        payload = torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.uint8)
        header = pickle.dumps({"metas": metas, "length": payload.numel(), "is_last": is_last})
        self._broadcast(torch.tensor([len(header)], dtype=torch.int64))
        self._broadcast(torch.frombuffer(bytearray(header), dtype=torch.uint8))
        if payload.numel():
            self._broadcast(payload)

    def _receive_bucket(self) -> tuple[dict, torch.Tensor]:
        size = torch.zeros(1, dtype=torch.int64)
        self._broadcast(size)
        header_bytes = torch.empty(int(size.item()), dtype=torch.uint8)
        self._broadcast(header_bytes)
        header = pickle.loads(header_bytes.numpy().tobytes())
        payload = torch.empty(header["length"], dtype=torch.uint8)
        if header["length"]:
            self._broadcast(payload)
        return header, payload

    @torch.no_grad()
    async def send_weights(self, weights, global_steps: int | None = None):
        if self.rank == OUT_OF_GROUP:
            async for _ in ensure_async_iterator(weights):
                pass
            return
        if self.rank != SENDER:
            raise RuntimeError("gloo checkpoint engine: only trainer rank 0 sends weights")
        chunks, metas, filled = [], [], 0
        async for meta, chunk in split_weight_chunks(weights, self.bucket_size):
            if filled + meta.chunk_size > self.bucket_size:
                self._send_bucket(chunks, metas, is_last=False)
                chunks, metas, filled = [], [], 0
            meta.offset = filled
            chunks.append(chunk.detach().to("cpu").clone())
            metas.append(meta)
            filled += meta.chunk_size
        self._send_bucket(chunks, metas, is_last=True)

    async def _receive_chunks(self):
        if self.rank is None or self.rank <= SENDER:
            raise RuntimeError("gloo checkpoint engine: only rollout ranks receive weights")
        while True:
            header, payload = self._receive_bucket()
            for meta in header["metas"]:
                # A copy starts at offset 0, so it can be viewed as any dtype (a slice of the
                # payload may sit at an offset that is not a multiple of the dtype's size).
                yield meta, payload[meta.offset: meta.offset + meta.chunk_size].clone()
            if header["is_last"]:
                return

    @torch.no_grad()
    async def receive_weights(self, global_steps: int | None = None):
        async for name, weight in merge_weight_chunks(self._receive_chunks(), self.bucket_size):
            yield name, weight
