"""An engine that dies while ``LLM.generate`` waits for it: an error naming how it died, not a hang.

vllm 0.31's ``SyncMPClient`` (the client behind ``vllm.LLM``) waits for the engine's outputs on a
queue that an output thread fills. When the EngineCore process dies without a word (killed by the
kernel or a signal, or a crash in native code), the client's monitor marks the engine dead and
shuts the client down; the shutdown stops the output thread cleanly, nothing more reaches the
queue, and the caller waits for ever (seen in a test run: the engine process gone, the test
blocked in ``get_output`` with no error). The patched ``get_output`` waits for the queue while
watching the dead mark and raises vLLM's ``EngineDeadError`` with the engine process's exit code.
"""

from __future__ import annotations

from zero_mismatch_plugin.integrations.vllm.patch_kinds import vllm_patch

# How often a waiting caller looks at the client's dead mark (seconds).
ENGINE_DEATH_POLL_S = 1.0


def engine_exit_codes(client) -> list:
    """The exit codes of the client's engine processes (None while one runs; -9: killed)."""
    manager = getattr(client.resources, "engine_manager", None)
    return [process.exitcode for process in getattr(manager, "processes", ()) or ()]


def _raise_when_the_engine_dies(original):
    def get_output(self):
        outputs = self.outputs_queue
        with outputs.not_empty:  # queue.Queue's own condition, released while waiting
            while not outputs.queue:
                if self.resources.engine_dead:
                    from vllm.v1.engine.exceptions import EngineDeadError

                    raise EngineDeadError(
                        f"The engine process exited (exit codes {engine_exit_codes(self)}; -9 is a kill, e.g. by the "
                        "kernel when memory ran out) while this client waited for its outputs, without an error "
                        "of its own; its log above ends where it died.")
                outputs.not_empty.wait(ENGINE_DEATH_POLL_S)
        return original(self)

    return get_output


ENGINE_DEATH = vllm_patch(
    "vllm.v1.engine.core_client:SyncMPClient.get_output", _raise_when_the_engine_dies,
    name="sync-client-engine-death",
    why="an EngineCore that dies silently left LLM.generate waiting for ever: the client's monitor "
        "marks it dead but stops the output thread without telling the waiting caller",
    when="the plugin's numerics are set (ZMRL_NUMERICS)",
)
