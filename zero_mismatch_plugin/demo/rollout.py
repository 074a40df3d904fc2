"""Rollout: a vLLM engine that keeps generating with the newest weights it has.

The engine's model runs in vLLM's own processes; this module drives it from a thread of the
learner's process, so generation and the learner's update run at the same time. The learner
publishes its weights after every update; the rollout thread loads the newest published version
before each chunk it generates and stamps every sample with that version.

The lag bound is enforced at the source: chunk ``c`` feeds update ``c // chunks_per_update``, and
it is only generated once the learner has published version ``update - K`` or newer, so every
sample reaches the learner at most K versions old. With K = 0 this is synchronous RL (the engine
waits for the update, then samples with the fresh weights); with K >= 1 the engine runs ahead.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass

import torch

from zero_mismatch_plugin.aligned.weight_sync import encode

from .task import DigitTask


@dataclass
class Sample:
    prompt: list[int]
    response: list[int]
    mu: torch.Tensor  # fp32 logprob the engine recorded for each sampled token
    version: int  # weight version that sampled it
    uid: str  # prompt group (same prompt, same chunk)
    reward: float


@dataclass
class Chunk:
    index: int
    version: int
    samples: list[Sample]
    generate_s: float
    weight_load_s: float


def encode_weights(named_weights) -> list:
    """The wire form of a weight version (raw bytes): a snapshot the learner can keep changing after."""
    return [encode(name, t.to(torch.float32)) for name, t in named_weights]


def load_engine_weights(llm, encoded: list) -> None:
    """Load encoded weights into every worker through vLLM's weight-loading path."""
    loaded = llm.collective_rpc("zmrl_load_weights", args=(encoded,))
    if any(n != len(encoded) for n in loaded):
        raise RuntimeError(f"weight load: workers loaded {loaded} of {len(encoded)} tensors")
    llm.reset_prefix_cache()


def start_engine(model_dir, max_model_len: int, seed: int = 0):
    """A vLLM engine for the demo's model in consistent numerics (set before it starts)."""
    from vllm import LLM

    from zero_mismatch_plugin.aligned import set_mode
    from zero_mismatch_plugin.aligned.runtime import engine_args_for

    set_mode("consistent")
    return LLM(**engine_args_for(model_dir, max_model_len=max_model_len, seed=seed, enable_prefix_caching=False))


@dataclass(frozen=True)
class RolloutPlan:
    seed: int
    prompts_per_chunk: int
    samples_per_prompt: int
    response_tokens: int
    chunks_per_update: int
    lag: int
    total_chunks: int


class RolloutWorker(threading.Thread):
    """Generates chunks in order into ``self.chunks``; an exception is put there instead."""

    def __init__(self, llm, task: DigitTask, plan: RolloutPlan, loaded_version: int = 0):
        super().__init__(name="zmrl-rollout", daemon=True)
        self.llm = llm
        self.task = task
        self.plan = plan
        self.chunks: queue.Queue = queue.Queue()
        self._cond = threading.Condition()
        self._learner_version = loaded_version
        self._published: tuple[int, list | None] = (loaded_version, None)
        self._loaded_version = loaded_version
        self._stopping = False

    def publish(self, version: int, encoded: list) -> None:
        """The learner's newest weights; older unpublished ones are simply superseded."""
        with self._cond:
            self._published = (version, encoded)
            self._learner_version = version
            self._cond.notify_all()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()

    def run(self) -> None:
        try:
            for index in range(self.plan.total_chunks):
                update = index // self.plan.chunks_per_update
                with self._cond:
                    self._cond.wait_for(
                        lambda: self._stopping or update <= self._learner_version + self.plan.lag
                    )
                    if self._stopping:
                        return
                    version, encoded = self._published
                load_s = 0.0
                if version != self._loaded_version:
                    start = time.perf_counter()
                    load_engine_weights(self.llm, encoded)
                    load_s = time.perf_counter() - start
                    self._loaded_version = version
                start = time.perf_counter()
                samples = self._generate(index, version)
                self.chunks.put(Chunk(index, version, samples, time.perf_counter() - start, load_s))
        except BaseException as error:  # noqa: BLE001 - handed to the learner, which re-raises
            self.chunks.put(error)

    def _generate(self, index: int, version: int) -> list[Sample]:
        from vllm import SamplingParams

        plan = self.plan
        n = plan.samples_per_prompt
        pairs = self.task.prompts_for_chunk(plan.seed, index, plan.prompts_per_chunk)
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
        outputs = self.llm.generate([{"prompt_token_ids": p} for _, p in pairs], params, use_tqdm=False)
        samples = []
        for (prompt_index, prompt), output in zip(pairs, outputs):
            for completion in output.outputs:
                ids = list(completion.token_ids)
                mu = torch.tensor([step[t].logprob for t, step in zip(ids, completion.logprobs)], dtype=torch.float32)
                samples.append(Sample(prompt, ids, mu, version, f"{index}:{prompt_index}", self.task.reward(ids)))
        return samples
