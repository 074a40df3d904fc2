"""``zmrl check`` as a user runs it, for the tests of its layouts: its table and its JSON report."""

from __future__ import annotations

import json

from support.vllm_session import MAX_MODEL_LEN


def run_check(model, flags: list[str], tmp_path, capsys, num_prompts: int = 4) -> tuple[int, str, dict]:
    """``zmrl check --model MODEL --trainer megatron FLAGS``: (exit code, printed table, JSON report)."""
    from zero_mismatch_plugin.tools import cli

    out = tmp_path / "check.json"
    code = cli.main(["check", "--model", str(model), "--trainer", "megatron", *flags, "--max-model-len",
                     str(MAX_MODEL_LEN), "--num-prompts", str(num_prompts), "--quiet", "--json", str(out)])
    table = capsys.readouterr().out
    return code, table, json.loads(out.read_text())
