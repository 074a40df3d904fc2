"""``zmrl check`` and ``zmrl bisect`` as a user runs them, for the tests of their layouts: the
table and the JSON report.

A module that already holds an engine and torchrun ranks can lend them to the command
(:func:`lent_engine_and_ranks`): the command line, its checks and its backend run as they are,
only the engine start and the ranks' start are skipped.
"""

from __future__ import annotations

import contextlib
import json

import pytest

from support.vllm_session import MAX_MODEL_LEN


def run_check(model, flags: list[str], tmp_path, capsys, num_prompts: int = 4, command: str = "check"
              ) -> tuple[int, str, dict]:
    """``zmrl check --model MODEL --trainer megatron FLAGS`` (or ``command`` bisect): (exit code,
    printed table, JSON report)."""
    from zero_mismatch_plugin.tools import cli

    out = tmp_path / f"{command}.json"
    code = cli.main([command, "--model", str(model), "--trainer", "megatron", *flags, "--max-model-len",
                     str(MAX_MODEL_LEN), "--num-prompts", str(num_prompts), "--quiet", "--json", str(out)])
    printed = capsys.readouterr()
    assert out.exists(), f"zmrl {command} exited {code} without a report:\n{printed.out[-2000:]}\n{printed.err[-4000:]}"
    return code, printed.out, json.loads(out.read_text())


class _LentRanks:
    """Stands in for ``RankGroup(layout)`` in the check's backend: the lent group, for any layout of
    its size; the backend's ``close`` leaves it running for the module's other tests."""

    def __init__(self, group):
        self.group, self.layouts = group, []

    def __call__(self, layout, *args, **kwargs):
        assert layout.world_size == self.group.layout.world_size, (layout, self.group.layout)
        self.layouts.append(layout.name)
        return self

    def call(self, *args, **kwargs):
        return self.group.call(*args, **kwargs)

    def close(self) -> None:
        pass


@contextlib.contextmanager
def lent_engine_and_ranks(settings, llm, group=None):
    """While open, ``zmrl check`` runs on ``llm`` (started from the checker's ``settings``; a check
    asking other engine arguments fails) and, if given, on the running RankGroup ``group`` (a
    layout of another number of ranks fails). Yields the names of the layouts the ranks were asked for."""
    from zero_mismatch_plugin.integrations.megatron import rank_group
    from zero_mismatch_plugin.tools.checker import engine as checker_engine

    @contextlib.contextmanager
    def module_engine(asked):
        assert asked.llm_args == settings.llm_args and asked.lora_dir == settings.lora_dir, (asked, settings)
        yield llm

    ranks = _LentRanks(group)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(checker_engine, "open_engine", module_engine)
        if group is not None:
            patch.setattr(rank_group, "RankGroup", ranks)
        yield ranks.layouts
