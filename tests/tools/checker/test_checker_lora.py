"""``zmrl bisect --lora``: vLLM's LoRA layers (served adapter) against the trainer's base + adapter.

The engine side is vLLM's model wrapped by vLLM's LoRA manager, the adapter activated for every
token; the trainer side is the aligned model with the same adapter. Both record each LoRA-wrapped
linear as three ops: its base output, ``lora_shrink`` (x A^T) and ``lora_expand`` (base + update).
No engine is started.
"""

from __future__ import annotations

import json

import pytest
import torch

from support.vllm_session import restored_environ
from zero_mismatch_plugin.tools import cli
from zero_mismatch_plugin.aligned.lora.adapter import build_adapter
from zero_mismatch_plugin.tools.checker import oplist
from zero_mismatch_plugin.tools.checker.backends import load_backend
from zero_mismatch_plugin.tools.checker.engine import engine_settings

MAX_MODEL_LEN = 256
ALL_LINEARS = frozenset({"qkv_proj", "o_proj", "gate_up_proj", "down_proj"})


@pytest.fixture(scope="module")
def numerics_environ():
    with restored_environ(ZMRL_NUMERICS="consistent"):
        yield


@pytest.fixture(scope="module")
def llama_adapter(checkpoints, tmp_path_factory):
    return build_adapter(tmp_path_factory.mktemp("bisect_lora") / "r8", checkpoints["llama"], r=8, lora_alpha=16, seed=11)


def test_bisect_lora_finds_every_op_equal_lora_steps_included(checkpoints, llama_adapter, numerics_environ, tmp_path, capsys):
    out = tmp_path / "bisect.json"
    code = cli.main([
        "bisect", "--model", str(checkpoints["llama"]), "--lora", str(llama_adapter),
        "--max-model-len", str(MAX_MODEL_LEN), "--json", str(out), "--quiet",
    ])
    table = capsys.readouterr().out
    print(table)
    report = json.loads(out.read_text())
    assert code == 0 and report["pass"] is True, table
    assert "+ LoRA" in table and "no difference" in table
    assert report["not_compared"] == []
    names = [op["op"] for op in report["ops"]]
    # 26 ops of the 2-layer model + shrink and expand of its 4 linears per layer.
    assert names == oplist.op_names(2, qk_norm=False, lora=ALL_LINEARS) and len(names) == 26 + 2 * 4 * 2
    assert {"layers.0.qkv_proj.lora_shrink", "layers.1.down_proj.lora_expand"} <= set(names)
    assert all(op["bitwise_equal"] for op in report["ops"])


def test_megatron_bisect_lora_finds_every_op_equal(checkpoints, llama_adapter, numerics_environ, tmp_path, capsys):
    """The Megatron face with the adapter (megatron.lora): its LoRA linears run the same steps,
    the update added in vLLM's row order before megatron's grouped-qkv permutation."""
    out = tmp_path / "bisect.json"
    code = cli.main([
        "bisect", "--model", str(checkpoints["llama"]), "--lora", str(llama_adapter), "--trainer", "megatron",
        "--max-model-len", str(MAX_MODEL_LEN), "--json", str(out), "--quiet",
    ])
    table = capsys.readouterr().out
    report = json.loads(out.read_text())
    assert code == 0 and report["pass"] is True, table
    assert report["not_compared"] == []
    assert [op["op"] for op in report["ops"]] == oplist.op_names(2, qk_norm=False, lora=ALL_LINEARS)
    assert all(op["bitwise_equal"] for op in report["ops"])


@pytest.fixture(scope="module")
def lora_modules(checkpoints, llama_adapter, numerics_environ):
    from zero_mismatch_plugin.tools.checker.engine_modules import EngineModules

    with EngineModules(engine_settings(checkpoints["llama"], MAX_MODEL_LEN, seed=0, lora_dir=llama_adapter)) as modules:
        yield modules


@pytest.fixture(scope="module")
def lora_batch(checkpoints, lora_modules):
    from zero_mismatch_plugin.tools.checker.bisect import bisect_input
    from zero_mismatch_plugin.tools.checker.engine import load_prompts

    prompts = load_prompts(checkpoints["llama"], None, 3, lora_modules.runtime.hf_config.vocab_size)
    return bisect_input(prompts, 8, lora_modules.runtime.hf_config.vocab_size)


@pytest.mark.parametrize(
    "target, which, first",
    [("up_proj", "B", "layers.1.gate_up_proj.lora_expand"), ("k_proj", "A", "layers.0.qkv_proj.lora_shrink")],
)
def test_bisect_lora_names_a_planted_fault_in_one_lora_op(
    target, which, first, checkpoints, llama_adapter, lora_modules, lora_batch
):
    """An adapter matrix changed on the trainer side only (one entry, relative 1e-3): the LoRA
    step that reads it is the first divergence; everything before it, the base output of the same
    linear included, stays bitwise equal."""
    from zero_mismatch_plugin.tools.checker.bisect import run_bisect

    backend = load_backend("aligned", engine_settings(checkpoints["llama"], MAX_MODEL_LEN, lora_dir=llama_adapter))
    assert run_bisect(lora_modules, backend, lora_batch).first_differing_op is None  # control
    layer = int(first.split(".")[1])
    param = getattr(backend.model.lora.pair(layer, target), f"lora_{which}")
    with torch.no_grad():
        param[0, 0] *= 1.001  # an in-place update: the trainer re-derives vLLM's buffers
    result = run_bisect(lora_modules, backend, lora_batch)
    print(f"planted in {target}.lora_{which}: first differing op {result.first_differing_op}, "
          f"max |diff| {result.first.max_abs_diff:.3g}")
    assert result.first_differing_op == first and result.not_compared == []
    names = [op.name for op in result.ops]
    assert all(op.equal for op in result.ops[: names.index(first)])
    base_linear = first.rsplit(".", 1)[0]
    assert base_linear in names[: names.index(first)]


def test_engine_side_really_serves_the_adapter(lora_modules, lora_batch):
    """The engine side's LoRA steps change the linear's output (the adapter is active there)."""
    record = {}
    lora_modules.forward(lora_batch, record)
    for name in ("layers.0.qkv_proj", "layers.1.down_proj"):
        assert not torch.equal(record[name], record[name + ".lora_expand"])
        assert record[name + ".lora_shrink"][0].abs().max() > 0


def test_bisect_lora_on_a_subset_of_targets_with_qk_norms(checkpoints, numerics_environ, tmp_path):
    """Qwen3 (q/k norms) with PEFT's common q/v-only adapter: only qkv_proj carries LoRA steps;
    vLLM still wraps the other linears (zero adapter there), compared as plain linears."""
    from zero_mismatch_plugin.tools.checker.bisect import bisect_input, run_bisect
    from zero_mismatch_plugin.tools.checker.engine import load_prompts
    from zero_mismatch_plugin.tools.checker.engine_modules import EngineModules

    qwen3 = checkpoints["qwen3"]
    adapter = build_adapter(tmp_path / "qv", qwen3, r=16, lora_alpha=32, targets=("q_proj", "v_proj"), seed=13)
    settings = engine_settings(qwen3, MAX_MODEL_LEN, seed=0, lora_dir=adapter)
    backend = load_backend("aligned", settings)
    with EngineModules(settings) as modules:
        vocab = modules.runtime.hf_config.vocab_size
        batch = bisect_input(load_prompts(qwen3, None, 2, vocab), 6, vocab)
        result = run_bisect(modules, backend, batch)
    names = {op.name for op in result.ops}
    assert result.first_differing_op is None and result.not_compared == []
    assert {"layers.1.qkv_proj.lora_expand", "layers.0.q_norm", "layers.1.o_proj"} <= names
    assert not any(n.startswith(("layers.0.o_proj.", "layers.0.gate_up_proj.", "layers.1.down_proj.")) for n in names)
