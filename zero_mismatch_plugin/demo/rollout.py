"""Rollout: a vLLM engine that keeps generating with the newest weights it has.

This is the code the engine's process runs (see :mod:`.engine`): the learner publishes its weights
after every update into a shared-memory :class:`WeightMailbox`; before each chunk the rollout loop
loads the newest published version into the engine and stamps every sample with that version.

The lag bound is enforced at the source: chunk ``c`` feeds update ``c // chunks_per_update``, and
it is only generated once the learner has published version ``update - K`` or newer, so every
sample reaches the learner at most K versions old. With K = 0 this is synchronous RL (the engine
waits for the update, then samples with the fresh weights); with K >= 1 the engine runs ahead.
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass
from typing import Callable

import torch

from zero_mismatch_plugin.aligned.weight_sync import load_named_weights

from .task import Task


def _sample_from_wire(prompt, response, mu, version, uid, reward) -> "Sample":
    return Sample(prompt, response, torch.tensor(mu, dtype=torch.float32), version, uid, reward)


@dataclass
class Sample:
    prompt: list[int]
    response: list[int]
    mu: torch.Tensor  # fp32 logprob the engine recorded for each sampled token
    version: int  # weight version that sampled it
    uid: str  # prompt group (same prompt, same chunk)
    reward: float

    def __reduce__(self):
        # μ crosses the process boundary as plain floats: exact for fp32 values, and far cheaper
        # than torch's tensor pickling (a shared-memory segment per tensor between processes).
        return _sample_from_wire, (self.prompt, self.response, self.mu.tolist(), self.version, self.uid, self.reward)


@dataclass
class Chunk:
    index: int
    version: int
    samples: list[Sample]
    generate_s: float
    weight_load_s: float


@dataclass(frozen=True)
class RolloutPlan:
    seed: int
    prompts_per_chunk: int
    samples_per_prompt: int
    response_tokens: int
    chunks_per_update: int
    lag: int
    total_chunks: int


class WeightMailbox:
    """The newest published weight version, in one shared-memory slot that each publish overwrites.

    The learner copies its parameters in (a memory copy, no pickling); the engine's process copies
    them out under the same lock, so it never reads a half-written version. The lock is created
    with the engine's process (locks cannot travel through queues) and attached on each side.
    """

    def __init__(self, named_weights: list[tuple[str, torch.Tensor]]):
        self.layout = [(name, tuple(t.shape), t.numel()) for name, t in named_weights]
        # fp32: the demo's engine dtype, and what the learner trains in.
        self.buffer = torch.empty(sum(n for _, _, n in self.layout), dtype=torch.float32).share_memory_()
        self.version = torch.full((1,), -1, dtype=torch.int64).share_memory_()
        self.lock = None

    def __getstate__(self):
        return {**self.__dict__, "lock": None}

    def attach(self, lock) -> "WeightMailbox":
        self.lock = lock
        return self

    def _views(self, flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        views, offset = [], 0
        for name, shape, numel in self.layout:
            views.append((name, flat[offset: offset + numel].view(shape)))
            offset += numel
        return views

    def put(self, version: int, named_weights: list[tuple[str, torch.Tensor]]) -> None:
        given = [name for name, _ in named_weights]
        if given != [name for name, _, _ in self.layout]:
            raise ValueError(f"published weights {given} do not match the mailbox's layout")
        with self.lock:
            for (_, slot), (_, tensor) in zip(self._views(self.buffer), named_weights):
                slot.copy_(tensor)
            self.version[0] = version

    def take_newer(self, loaded: int | None) -> tuple[int, list[tuple[str, torch.Tensor]]] | None:
        """(version, weights) if a version other than ``loaded`` is published, else None."""
        with self.lock:
            version = int(self.version[0])
            if version < 0 or version == loaded:
                return None
            copy = self.buffer.clone()
        return version, self._views(copy)


def generate_chunk(llm, task: Task, plan: RolloutPlan, index: int, version: int) -> list[Sample]:
    from vllm import SamplingParams

    n = plan.samples_per_prompt
    pairs = task.prompts_for_chunk(plan.seed, index, plan.prompts_per_chunk)
    base_seed = (plan.seed * 7_919 + index * plan.prompts_per_chunk * n) % (2**31 - 2**20)
    # T = 1, no top-k/top-p: the recorded logprob is the distribution sampled from, and the
    # support is the full vocabulary, as exact unclipped IS needs.
    params = [
        SamplingParams(
            n=n, temperature=1.0, top_p=1.0, top_k=0, max_tokens=plan.response_tokens,
            ignore_eos=True, logprobs=0, seed=base_seed + i * n, detokenize=False,
        )
        for i in range(len(pairs))
    ]
    outputs = llm.generate([{"prompt_token_ids": p} for _, p in pairs], params, use_tqdm=False)
    samples = []
    for (prompt_index, prompt), output in zip(pairs, outputs):
        for completion in output.outputs:
            ids = list(completion.token_ids)
            mu = torch.tensor([step[t].logprob for t, step in zip(ids, completion.logprobs)], dtype=torch.float32)
            samples.append(Sample(prompt, ids, mu, version, f"{index}:{prompt_index}", task.reward(prompt, ids)))
    return samples


class Inbox:
    """What the learner has said during one run: the newest published version, and whether to stop.

    Reads the engine process's request queue; messages of other kinds end the run (the caller
    handles them after it).
    """

    def __init__(self, requests, receive: Callable, learner_version: int = 0):
        self.requests = requests
        self.receive = receive  # blocking get that notices a vanished learner
        self.learner_version = learner_version
        self.stopping = False
        self.pending: list[tuple] = []

    def _handle(self, message: tuple) -> None:
        if message[0] == "published":
            self.learner_version = max(self.learner_version, message[1])
        else:  # "stop", or a request for after this run
            self.stopping = True
            if message[0] != "stop":
                self.pending.append(message)

    def poll(self) -> None:
        while True:
            try:
                self._handle(self.requests.get_nowait())
            except queue.Empty:
                return

    def wait_until_allowed(self, update: int, lag: int) -> None:
        """Block until update ``update`` may be sampled for (learner version >= update - lag)."""
        self.poll()
        while not self.stopping and update > self.learner_version + lag:
            self._handle(self.receive())


def produce_chunks(llm, task: Task, plan: RolloutPlan, mailbox: WeightMailbox, inbox: Inbox,
                   send: Callable[[Chunk], None]) -> None:
    """The rollout loop: every chunk of the plan, in order, each with the newest weights published."""
    loaded: int | None = None  # the engine may hold another run's weights
    for index in range(plan.total_chunks):
        inbox.wait_until_allowed(index // plan.chunks_per_update, plan.lag)
        if inbox.stopping:
            return
        load_s = 0.0
        newer = mailbox.take_newer(loaded)
        if newer is not None:
            start = time.perf_counter()
            loaded, weights = newer
            load_named_weights(llm, weights)
            load_s = time.perf_counter() - start
        start = time.perf_counter()
        samples = generate_chunk(llm, task, plan, index, loaded)
        send(Chunk(index, loaded, samples, time.perf_counter() - start, load_s))
