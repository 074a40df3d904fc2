"""``zmrl demo``: asynchronous RL with zero mismatch, end to end on a CPU.

A tiny Llama and tokenizer are built locally; a vLLM engine samples responses to a verifiable
task (answer with digits) with the newest weights it has, while the learner updates with
REINFORCE Zero or FlashREINFORCE called through verl's registry, using either the aligned
forward (vLLM's kernels: bitwise-equal logprobs) or plain transformers. Every sample carries the
weight version that produced it; the learner trains on samples at most K versions old and
publishes new weights after every update.

- ``task``: prompts and reward; ``learners``: the two forwards; ``engine``: the engine's own
  process and the learner's handle on it; ``rollout``: the rollout loop that process runs;
  ``runner``: the learner loop and per-update metrics; ``outputs``: metric log, summary.json,
  report and plots; ``command``: the CLI entry.
"""

from zero_mismatch_plugin.tools.demo.engine import EngineProcess, start_engine
from zero_mismatch_plugin.tools.demo.runner import DemoConfig, DemoResult, DemoRun, UpdateRecord, run_demo

__all__ = ["DemoConfig", "DemoResult", "DemoRun", "EngineProcess", "UpdateRecord", "run_demo", "start_engine"]
