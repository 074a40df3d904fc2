"""Rollout: a vLLM engine that keeps generating with the newest weights it has.

The code the engine's process runs (:mod:`.engine`): before each chunk it loads the newest version
from the :class:`WeightMailbox` and stamps every sample with it; a chunk is generated only once its
update is at most K versions ahead of the published weights (docs/demo.md, "The rollout and the lag bound").
With a fixed lag the chunks of update u are sampled by version u - K exactly, even where newer
versions are published.
"""

from __future__ import annotations

import itertools
import queue
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from zero_mismatch_plugin.aligned.weight_sync import load_named_weights

from zero_mismatch_plugin.tools.demo.task import Task


def _sample_from_wire(prompt, response, mu, version, uid, reward, cached_tokens) -> "Sample":
    return Sample(prompt, response, torch.tensor(mu, dtype=torch.float32), version, uid, reward, cached_tokens)


@dataclass
class Sample:
    prompt: list[int]
    response: list[int]
    mu: torch.Tensor  # fp32 logprob the engine recorded for each sampled token
    version: int  # weight version that sampled it
    uid: str  # prompt group (same prompt, same chunk, same turn)
    reward: float
    # Prompt tokens the engine took from its prefix cache for this sample's request (counted on
    # the request's first sample only).
    cached_tokens: int = 0

    def __reduce__(self):
        # μ crosses the process boundary as plain floats: exact for fp32 values, and far cheaper
        # than torch's tensor pickling (a shared-memory segment per tensor between processes).
        return _sample_from_wire, (
            self.prompt, self.response, self.mu.tolist(), self.version, self.uid, self.reward, self.cached_tokens
        )


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
    turns: int = 1  # >1: each conversation is re-sent with its response and a new question
    # A LoRA run (``aligned.lora.peft.LoRAConfig``): the published weights are the adapter's tensors,
    # served as a new adapter version, never loaded into the base.
    lora: object | None = None
    # True: every chunk of update u is sampled by version max(0, u - lag) exactly, however far the
    # learner has got, so runs whose learners go at different speeds see the same lag. False: the
    # newest version published (at most ``lag`` old; how old depends on the two sides' speeds).
    fixed_lag: bool = False

    def sampling_version(self, update: int) -> int:
        """The version a fixed-lag plan samples update ``update``'s chunks with."""
        return fixed_lag_version(update, self.lag)


def fixed_lag_version(update: int, lag: int) -> int:
    """The version that samples update ``update`` (the learner at version ``update``) at a fixed lag."""
    return max(0, update - lag)


class WeightMailbox:
    """The last ``slots`` published weight versions, in shared memory: version v lives in slot
    v % slots until version v + slots overwrites it.

    The learner copies its parameters in (a memory copy, no pickling); the engine's process copies
    them out under the same lock, so it never reads a half-written version. The lock is created
    with the engine's process (locks cannot travel through queues) and attached on each side.
    One slot serves a run that always takes the newest version; a fixed lag K needs K + 1 (while
    the engine samples update u with version u - K, the learner cannot publish past version u).
    """

    def __init__(self, named_weights: list[tuple[str, torch.Tensor]], slots: int = 1):
        if slots < 1:
            raise ValueError(f"a weight mailbox needs at least one slot, got {slots}")
        self.layout = [(name, tuple(t.shape), t.numel()) for name, t in named_weights]
        # fp32: the demo's engine dtype, and what the learner trains in.
        numel = sum(n for _, _, n in self.layout)
        self.buffer = torch.empty(slots, numel, dtype=torch.float32).share_memory_()
        # The version each slot holds (-1: none yet); the newest published is their maximum.
        self.versions = torch.full((slots,), -1, dtype=torch.int64).share_memory_()
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
        slot = version % len(self.versions)
        with self.lock:
            for (_, view), (_, tensor) in zip(self._views(self.buffer[slot]), named_weights):
                view.copy_(tensor)
            self.versions[slot] = version

    def take_newer(self, loaded: int | None) -> tuple[int, list[tuple[str, torch.Tensor]]] | None:
        """(version, weights) if the newest published version is not ``loaded``, else None."""
        with self.lock:
            slot = int(self.versions.argmax())
            version = int(self.versions[slot])
            if version < 0 or version == loaded:
                return None
            copy = self.buffer[slot].clone()
        return version, self._views(copy)

    def take_version(self, version: int, loaded: int | None) -> tuple[int, list[tuple[str, torch.Tensor]]] | None:
        """(version, weights) of exactly ``version``, or None if it is the one ``loaded``."""
        if version == loaded:
            return None
        slot = version % len(self.versions)
        with self.lock:
            held = int(self.versions[slot])
            if held != version:
                # The plan waits until ``version`` is published, and the learner cannot publish
                # ``version + slots`` before this chunk is delivered: reaching here is a bug.
                raise RuntimeError(f"weight version {version} asked for, but its mailbox slot holds "
                                   f"version {held} (mailbox of {len(self.versions)} slots)")
            copy = self.buffer[slot].clone()
        return version, self._views(copy)


def generate_chunk(llm, task: Task, plan: RolloutPlan, index: int, version: int, lora_request=None) -> list[Sample]:
    """The chunk's samples, all with the weights of ``version``.

    Turn 1 samples ``samples_per_prompt`` responses per prompt; every later turn re-sends each
    conversation whole (its prompt, its response, a follow-up question), as an agent does, so the
    engine takes the earlier turns from its prefix cache. The samples of one prompt in one turn
    form one group. ``lora_request``: the adapter version serving every request (LoRA runs).
    """
    from vllm import SamplingParams

    n = plan.samples_per_prompt
    pairs = task.prompts_for_chunk(plan.seed, index, plan.prompts_per_chunk)
    base_seed = (plan.seed * 7_919 + index * plan.prompts_per_chunk * n) % (2**31 - 2**20)
    # (prompt index, conversation so far, samples, seed) per request.
    requests = [(prompt_index, prompt, n, base_seed + i * n) for i, (prompt_index, prompt) in enumerate(pairs)]
    samples = []
    for turn in range(plan.turns):
        # T = 1, no top-k/top-p: the recorded logprob is the distribution sampled from, and the
        # support is the full vocabulary, as exact unclipped IS needs.
        params = [
            SamplingParams(
                n=k, temperature=1.0, top_p=1.0, top_k=0, max_tokens=plan.response_tokens,
                ignore_eos=True, logprobs=0, seed=seed, detokenize=False,
            )
            for _, _, k, seed in requests
        ]
        outputs = llm.generate([{"prompt_token_ids": r[1]} for r in requests], params, use_tqdm=False,
                               lora_request=lora_request)
        follow_ups = []
        group_suffix = f":turn{turn + 1}" if turn else ""
        for (prompt_index, prompt, _, seed), output in zip(requests, outputs):
            for k, completion in enumerate(output.outputs):
                ids = list(completion.token_ids)
                mu = torch.tensor([step[t].logprob for t, step in zip(ids, completion.logprobs)], dtype=torch.float32)
                cached = int(output.num_cached_tokens or 0) if k == 0 else 0
                samples.append(Sample(prompt, ids, mu, version, f"{index}:{prompt_index}{group_suffix}",
                                      task.reward(prompt, ids), cached))
                conversation = prompt + ids + task.follow_up(prompt_index, turn + 1)
                follow_ups.append((prompt_index, conversation, 1, (seed + 1_000_003 * (turn + 1) + k) % (2**31 - 1)))
        requests = follow_ups
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


# Adapter ids are unique for the engine's life: a run's version 0 is not an earlier run's.
_ADAPTER_IDS = itertools.count(1)


def adapter_request(adapter_root, lora_config, version: int, weights):
    """A new adapter version for the engine: the published tensors written in PEFT's format and a
    ``LoRARequest`` of a fresh id, loaded by vLLM's own adapter loading when first requested."""
    from vllm.lora.request import LoRARequest

    from zero_mismatch_plugin.aligned.lora.peft import write_peft_adapter

    adapter_id = next(_ADAPTER_IDS)
    path = write_peft_adapter(Path(adapter_root) / f"adapter-{adapter_id}", lora_config, dict(weights))
    return LoRARequest(f"zmrl-demo-v{version}-{adapter_id}", adapter_id, str(path))


def produce_chunks(llm, task: Task, plan: RolloutPlan, mailbox: WeightMailbox, inbox: Inbox,
                   send: Callable[[Chunk], None]) -> None:
    """The rollout loop: every chunk of the plan, in order, each with the newest weights published
    (for a LoRA run, the newest adapter: the base weights stay as loaded)."""
    with tempfile.TemporaryDirectory(prefix="zmrl-adapters-") as adapter_root:
        loaded: int | None = None  # the engine may hold another run's weights
        lora_request = None
        for index in range(plan.total_chunks):
            update = index // plan.chunks_per_update
            inbox.wait_until_allowed(update, plan.lag)
            if inbox.stopping:
                return
            load_s = 0.0
            if plan.fixed_lag:
                newer = mailbox.take_version(plan.sampling_version(update), loaded)
            else:
                newer = mailbox.take_newer(loaded)
            if newer is not None:
                start = time.perf_counter()
                loaded, weights = newer
                if plan.lora is None:
                    load_named_weights(llm, weights)
                else:
                    lora_request = adapter_request(adapter_root, plan.lora, loaded, weights)
                load_s = time.perf_counter() - start
            start = time.perf_counter()
            samples = generate_chunk(llm, task, plan, index, loaded, lora_request)
            send(Chunk(index, loaded, samples, time.perf_counter() - start, load_s))
