"""The rollout engine in a process of its own, and the learner's handle on it.

One child process holds the whole engine in-process (one OpenMP thread) with the rollout loop, so
generation and the learner's update run side by side on separate cores; samples come back through
a queue, weights go out through a shared-memory :class:`~.rollout.WeightMailbox`. Why, and the
message protocol: docs/demo.md.
"""

from __future__ import annotations

import itertools
import multiprocessing
import queue
import signal
import traceback

from zero_mismatch_plugin.aligned.numerics import temporary_environment
from zero_mismatch_plugin.integrations.vllm.cpu_engine_process import engine_process_context
from zero_mismatch_plugin.tools.demo.rollout import Chunk, Inbox, RolloutPlan, WeightMailbox, produce_chunks
from zero_mismatch_plugin.tools.demo.task import Task

# The engine runs in the child's own thread, with one OpenMP thread: on a small machine the other
# core belongs to the learner, and idle OpenMP threads spin-wait.
CHILD_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1"}
START_TIMEOUT_S = 600.0
# How long a stop on SIGINT / SIGTERM waits for the engine to finish its chunk and exit before it is
# terminated (an orderly close waits up to CLOSE_TIMEOUT_S).
INTERRUPTED_CLOSE_TIMEOUT_S = 10.0
CLOSE_TIMEOUT_S = 60.0
# Engine arguments the learner mirrors. 32-token KV blocks (the smallest vLLM's CPU attention
# takes) let the short multi-turn conversations of ``--turns`` hit the prefix cache, which
# consistent mode keeps on for this dense model.
ENGINE_ARGS = dict(block_size=32)
POLL_S = 1.0


def _receive_while_parent_lives(requests):
    """``requests.get()``, but exit when the learner's process has gone (nobody would stop us)."""
    parent = multiprocessing.parent_process()
    while True:
        try:
            return requests.get(timeout=POLL_S)
        except queue.Empty:
            if parent is not None and not parent.is_alive():
                raise SystemExit(0)


def _serve_run(llm, message, requests, replies, lock) -> list[tuple]:
    """One run's chunks; returns requests that arrived for after it."""
    _, run_id, task, plan, mailbox = message
    inbox = Inbox(requests, lambda: _receive_while_parent_lives(requests))
    try:
        produce_chunks(llm, task, plan, mailbox.attach(lock), inbox,
                       lambda chunk: replies.put(("chunk", run_id, chunk)))
    except Exception:  # noqa: BLE001 - reported to the learner, which raises it
        replies.put(("error", run_id, traceback.format_exc()))
    replies.put(("done", run_id))
    return inbox.pending


def _engine_main(model_dir: str, max_model_len: int, seed: int, requests, replies, lock,
                 engine_args: dict | None = None) -> None:
    """The child: start the engine, then serve runs until asked to close."""
    # Ctrl-C reaches the whole process group; the learner handles it and stops this process in
    # order (an interrupted child would turn the learner's clean stop into an error).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from zero_mismatch_plugin.aligned import set_mode
    from zero_mismatch_plugin.aligned.runtime import engine_args_for
    from vllm import LLM

    set_mode("consistent")
    llm = LLM(**engine_args_for(model_dir, max_model_len=max_model_len, seed=seed, **ENGINE_ARGS, **(engine_args or {})))
    replies.put(("ready",))
    pending: list[tuple] = []
    while True:
        message = pending.pop(0) if pending else _receive_while_parent_lives(requests)
        if message[0] == "close":
            return
        if message[0] == "run":
            pending.extend(_serve_run(llm, message, requests, replies, lock))
        # "published" / "stop" left over from a finished run need nothing


class EngineProcess:
    """A vLLM engine (consistent numerics) for ``model_dir``'s architecture, in a child process.

    Serves one :meth:`rollout` at a time; each run loads its own initial weights as version 0,
    so one engine serves runs of different seeds and checkpoints of the same shape.
    ``engine_args``: more engine arguments (LoRA serving, :func:`start_engine`).
    """

    def __init__(self, model_dir, max_model_len: int, seed: int = 0, engine_args: dict | None = None):
        context = engine_process_context()  # spawned, or from the engine fork server (ZMRL_CPU_ENGINE_FORK)
        self._requests = context.Queue()
        self._replies = context.Queue()
        self._lock = context.Lock()
        self._run_ids = itertools.count()
        self._process = context.Process(
            target=_engine_main, name="zmrl-engine", daemon=True,
            args=(str(model_dir), max_model_len, seed, self._requests, self._replies, self._lock, engine_args),
        )
        with temporary_environment(CHILD_ENV):
            self._process.start()
        try:
            self._expect("ready", timeout=START_TIMEOUT_S)
        except BaseException:  # an interrupt or a failed start: no engine process is left behind
            self.close(timeout=INTERRUPTED_CLOSE_TIMEOUT_S)
            raise

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def send(self, message: tuple) -> None:
        self._requests.put(message)

    def receive(self, timeout: float | None = None) -> tuple:
        """The next reply; raises if the engine's process has died or ``timeout`` seconds pass."""
        waited = 0.0
        while True:
            try:
                return self._replies.get(timeout=POLL_S)
            except queue.Empty:
                if not self._process.is_alive():
                    raise RuntimeError(f"the engine process exited (code {self._process.exitcode})") from None
                waited += POLL_S
                if timeout is not None and waited >= timeout:
                    raise TimeoutError(f"no reply from the engine process in {timeout:.0f} s") from None

    def _expect(self, kind: str, timeout: float | None = None) -> tuple:
        reply = self.receive(timeout)
        if reply[0] != kind:
            raise RuntimeError(f"engine process: expected {kind!r}, got {reply[0]!r}")
        return reply

    def rollout(self, task: Task, plan: RolloutPlan, initial_weights) -> "Rollout":
        """Start generating ``plan``'s chunks; ``initial_weights`` (named tensors) are version 0."""
        mailbox = WeightMailbox(initial_weights, slots=plan.lag + 1 if plan.fixed_lag else 1).attach(self._lock)
        mailbox.put(0, initial_weights)
        return Rollout(self, next(self._run_ids), task, plan, mailbox)

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Ask the engine's process to exit (it finishes the chunk it is generating), wait up to
        ``timeout`` seconds, then terminate it; it is gone when this returns."""
        if self._process.is_alive():
            self.send(("close",))
            self._process.join(timeout=timeout)
        if self._process.is_alive():
            self._process.terminate()
            self._process.join(timeout=timeout)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()

    def __enter__(self) -> "EngineProcess":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        interrupted = exc_type is not None and issubclass(exc_type, KeyboardInterrupt)
        self.close(timeout=INTERRUPTED_CLOSE_TIMEOUT_S if interrupted else CLOSE_TIMEOUT_S)


class Rollout:
    """The learner's side of one run: take chunks, publish weights, stop."""

    def __init__(self, engine: EngineProcess, run_id: int, task: Task, plan: RolloutPlan,
                 mailbox: WeightMailbox):
        self.engine = engine
        self.run_id = run_id
        self.mailbox = mailbox
        self._finished = False
        engine.send(("run", run_id, task, plan, mailbox))

    def publish(self, version: int, named_weights) -> None:
        """The learner's newest weights; older ones not yet loaded are simply superseded."""
        self.mailbox.put(version, named_weights)
        self.engine.send(("published", version))

    def next_chunk(self) -> Chunk:
        reply = self._reply_of_this_run()
        if reply[0] == "error":
            self._finished = True
            raise RuntimeError(f"the rollout failed in the engine process:\n{reply[2]}")
        if reply[0] == "done":
            self._finished = True
            raise RuntimeError("the rollout ended before the learner took all its chunks")
        return reply[2]

    def _reply_of_this_run(self) -> tuple:
        while True:
            reply = self.engine.receive()
            if reply[0] in ("chunk", "error", "done") and reply[1] == self.run_id:
                return reply

    def stop(self) -> None:
        """End the run and wait until the engine is idle (unread chunks are dropped)."""
        if self._finished:
            return
        self.engine.send(("stop",))
        while self._reply_of_this_run()[0] != "done":
            pass
        self._finished = True

    def __enter__(self) -> "Rollout":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is not None and issubclass(exc_type, KeyboardInterrupt):
            # Interrupted: say stop, but do not wait for the chunk in flight; the engine is closed next.
            self.engine.send(("stop",))
            self._finished = True
            return
        self.stop()


def start_engine(model_dir, max_model_len: int, seed: int = 0, lora_rank: int | None = None,
                 dtype: str = "float32") -> EngineProcess:
    """A rollout engine for the demo's model in consistent numerics, serving ``dtype``.

    Consistent mode is also selected in this process: the aligned learner reads it. With
    ``lora_rank`` the engine serves LoRA adapters of that rank (``enable_lora``; the learner
    mirrors the same arguments).
    """
    from zero_mismatch_plugin.aligned import set_mode

    set_mode("consistent")
    engine_args = {"dtype": dtype}
    if lora_rank is not None:
        from zero_mismatch_plugin.aligned.lora.peft import lora_engine_args_for_rank

        engine_args.update(lora_engine_args_for_rank(lora_rank))
    return EngineProcess(model_dir, max_model_len, seed, engine_args)
