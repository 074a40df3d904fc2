"""A rank killed in the middle of a call: the call must fail within 60 s, naming the rank."""

from __future__ import annotations

import os
import signal
import threading
import time

FAILURE_BOUND_S = 60


def assert_a_killed_rank_fails_the_call(group, spec, batch, rank: int = 1) -> None:
    """Stop ``rank`` of the running ``group``, send a ``token_logprobs`` call (the other ranks wait
    for it in a collective), then kill the rank: the call raises ``RankFailure`` within
    :data:`FAILURE_BOUND_S` of the kill, naming the call, the rank and the signal. The group is
    broken afterwards, so this is its last call."""
    from zero_mismatch_plugin.integrations.megatron.rank_group import RankFailure

    outcome = {}

    def call():
        try:
            outcome["value"] = group.call("token_logprobs", spec, batch)
        except RankFailure as failure:
            outcome["failure"], outcome["at"] = failure, time.monotonic()

    victim = group.rank_pids[rank]
    os.kill(victim, signal.SIGSTOP)
    caller = threading.Thread(target=call)
    caller.start()
    time.sleep(1.0)
    killed_at = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    caller.join(FAILURE_BOUND_S + 30)
    assert not caller.is_alive() and "value" not in outcome
    said = str(outcome["failure"])
    assert outcome["at"] - killed_at <= FAILURE_BOUND_S, outcome["at"] - killed_at
    assert "token_logprobs: " in said and f"rank {rank} (killed by SIGKILL) failed first" in said, said
