"""``zmrl demo``: asynchronous RL with zero mismatch, end to end on a CPU.

A vLLM engine samples a verifiable task with the newest weights it has while the learner updates
with REINFORCE Zero or FlashREINFORCE through verl's registry, on the aligned forward or plain
transformers, on samples at most K weight versions old. How it works: docs/demo.md.
"""

from zero_mismatch_plugin.tools.demo.engine import EngineProcess, start_engine
from zero_mismatch_plugin.tools.demo.runner import DemoConfig, DemoResult, DemoRun, UpdateRecord, run_demo

__all__ = ["DemoConfig", "DemoResult", "DemoRun", "EngineProcess", "UpdateRecord", "run_demo", "start_engine"]
