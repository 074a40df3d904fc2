"""``zmrl check --lora`` / ``zmrl bisect --lora`` with adapters beyond the dense decoder linears.

``check`` (a live engine serving the adapter against the aligned trainer) on: every routed expert
and attention of Qwen3-MoE; DeepSeek-V3's MLA projections, routed experts and shared expert; the
MLA projections of DeepSeek-V3 with a query low-rank projection; embed_tokens and lm_head of Llama.
``bisect`` (vLLM's modules, wrapped by vLLM's LoRA manager, against the trainer) compares the MoE
op with its adapter and the shared expert's LoRA linears as ops of their own, and names a fault
planted in one adapter matrix on the trainer side; the Megatron face's expert adapters too. MLA
and tied lm_head adapters on the Megatron face, and MLA bisection, are refused.
One engine or one set of vLLM's modules per checkpoint.
"""

from __future__ import annotations

import json

import pytest
import torch

from test_checker_lora import numerics_environ  # noqa: F401 - a fixture
from zero_mismatch_plugin.tools import cli
from zero_mismatch_plugin.aligned.lora.adapter import build_adapter
from zero_mismatch_plugin.tables.architectures import LORA_TARGETS, VOCAB_LORA_TARGETS
from zero_mismatch_plugin.tools.checker import oplist
from zero_mismatch_plugin.tools.checker.backends import load_backend
from zero_mismatch_plugin.tools.checker.engine import engine_settings

MAX_MODEL_LEN = 256
ALL_LINEARS = frozenset({"qkv_proj", "o_proj", "gate_up_proj", "down_proj"})
# Each checkpoint's adapter: by default every module the aligned path adapts on it.
ADAPTER_TARGETS = {"qwen3_moe": None, "qwen2_moe": None, "deepseek_v3_moe": None, "deepseek_v3_yarn": None,
                   "llama": LORA_TARGETS + VOCAB_LORA_TARGETS}


@pytest.fixture(scope="module")
def adapters(checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("checker_lora_moe_mla")
    return {m: build_adapter(root / m, checkpoints[m], r=8, lora_alpha=16, targets=t, seed=17)
            for m, t in ADAPTER_TARGETS.items()}


def _cli_json(argv, tmp_path, capsys):
    out = tmp_path / "result.json"
    code = cli.main([*argv, "--max-model-len", str(MAX_MODEL_LEN), "--json", str(out), "--quiet"])
    captured = capsys.readouterr()
    print(captured.out)
    return code, (json.loads(out.read_text()) if out.exists() else None), captured.out + captured.err


# ----- check ----------------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["qwen3_moe", "deepseek_v3_moe", "deepseek_v3_yarn", "llama"])
def test_check_lora_passes_on_experts_mla_and_vocabulary_adapters(
    model, checkpoints, adapters, engines, numerics_environ, tmp_path, capsys
):
    engines.pool.make_room()  # room for the engine started here
    code, report, table = _cli_json(
        ["check", "--model", str(checkpoints[model]), "--lora", str(adapters[model]), "--trainer", "aligned",
         "--num-prompts", "4", "--max-tokens", "12", "--batch-sizes", "1,2"],
        tmp_path,
        capsys,
    )
    assert code == 0, table
    assert "+ LoRA" in table
    assert all(entry["pass"] is True for entry in report.values()), report
    assert report["sampled_token"]["bitwise_equal_fraction"] == 1.0 and report["sampled_token"]["tokens"] == 4 * 12
    assert report["full_distribution"]["bitwise_equal_fraction"] == 1.0
    if model == "qwen3_moe":
        # Layer 1 chooses from hidden states the adapter changed: vLLM's modules serve it too.
        assert report["expert_selection"]["per_layer"] == {"0": 1.0, "1": 1.0}
    else:
        assert "expert_selection" not in report


def test_expert_selection_agrees_only_when_vllms_modules_serve_the_adapter(checkpoints, adapters, numerics_environ):
    """The expert-selection check's engine side serves the adapter: against vLLM's modules without
    it (negative control) the trainer's choices differ, the adapter having moved the router's input."""
    from zero_mismatch_plugin.tools.checker.checks import expert_selection_check
    from zero_mismatch_plugin.tools.checker.engine import Completion, load_prompts
    from zero_mismatch_plugin.tools.checker.engine_modules import EngineModules

    model_dir, adapter = checkpoints["qwen3_moe"], adapters["qwen3_moe"]
    backend = load_backend("aligned", engine_settings(model_dir, MAX_MODEL_LEN, lora_dir=adapter))
    gen = torch.Generator().manual_seed(0)
    completions = [Completion(p, torch.randint(0, 512, (12,), generator=gen).tolist(), [])
                   for p in load_prompts(model_dir, None, 4)]
    agreement = {}
    for served in (adapter, None):
        with EngineModules(engine_settings(model_dir, MAX_MODEL_LEN, seed=0, lora_dir=served)) as modules:
            agreement[served] = expert_selection_check(backend, completions, modules).figures["min_agreement"]
    print(f"expert-set agreement: with the adapter served {agreement[adapter]}, without {agreement[None]}")
    assert agreement[adapter] == 1.0 and agreement[None] < 1.0


def test_megatron_face_refuses_mla_and_tied_lm_head_adapters(checkpoints, adapters, tmp_path, capsys):
    """Refused while the inputs are checked: no engine is started. An MLA model is refused for the
    Megatron face with or without an adapter. Llama's vocabulary adapter and Mixtral's expert
    adapter (w1, w2, w3) pass the same check."""
    import argparse

    from zero_mismatch_plugin.tools.checker.commands import lora_options

    qwen3 = build_adapter(tmp_path / "qwen3", checkpoints["qwen3"], r=8, targets=("q_proj", "embed_tokens", "lm_head"))
    for model, adapter, expected in (
        ("deepseek_v3_yarn", adapters["deepseek_v3_yarn"],
         ("(--trainer megatron): DeepseekV3ForCausalLM: not supported by the Megatron face: multi-head latent "
          "attention", "--trainer aligned runs this model")),
        ("qwen3", qwen3, ("--trainer megatron serves LoRA on the decoder linears, MoE experts and embed_tokens / lm_head",
                          "['lm_head'] with lm_head tied to embed_tokens", "Use --trainer aligned")),
    ):
        code, report, text = _cli_json(
            ["check", "--model", str(checkpoints[model]), "--lora", str(adapter), "--trainer", "megatron"],
            tmp_path,
            capsys,
        )
        assert code == 2 and report is None, text
        assert all(part in text for part in expected), text
    mixtral = build_adapter(tmp_path / "mixtral", checkpoints["mixtral"], r=8)
    for model, adapter in (("llama", adapters["llama"]), ("mixtral", mixtral)):
        args = argparse.Namespace(model=str(checkpoints[model]), lora=str(adapter), trainer="megatron")
        assert lora_options(args) == {"lora_dir": str(adapter)}, model


@pytest.mark.parametrize("model", ["qwen3_moe", "qwen2_moe"])
def test_megatron_bisect_lora_on_moe_experts_compares_every_op(model, checkpoints, adapters, numerics_environ,
                                                               tmp_path, capsys):
    """The Megatron face with an adapter on attention, every routed expert and the shared expert."""
    code, report, table = _cli_json(
        ["bisect", "--model", str(checkpoints[model]), "--lora", str(adapters[model]), "--trainer", "megatron"],
        tmp_path,
        capsys,
    )
    assert code == 0 and report["pass"] is True, table
    assert report["not_compared"] == []
    names = {op["op"] for op in report["ops"]}
    assert {"layers.0.router", "layers.0.experts", "layers.1.qkv_proj.lora_expand"} <= names
    if model == "qwen2_moe":
        assert {"layers.0.shared_expert.gate_up_proj.lora_shrink", "layers.0.shared_expert.down_proj.lora_expand"} <= names


def test_bisect_refuses_mla_models_before_starting_anything(checkpoints, adapters, tmp_path, capsys):
    code, report, text = _cli_json(
        ["bisect", "--model", str(checkpoints["deepseek_v3_moe"]), "--lora", str(adapters["deepseek_v3_moe"])],
        tmp_path,
        capsys,
    )
    assert code == 2 and report is None
    assert "zmrl bisect does not run multi-head latent attention" in text and "use zmrl check" in text


# ----- bisect ---------------------------------------------------------------------------------


def test_bisect_lora_on_moe_experts_compares_every_op(checkpoints, adapters, numerics_environ, tmp_path, capsys):
    code, report, table = _cli_json(
        ["bisect", "--model", str(checkpoints["qwen3_moe"]), "--lora", str(adapters["qwen3_moe"])], tmp_path, capsys
    )
    assert code == 0 and report["pass"] is True, table
    assert report["not_compared"] == []
    names = [op["op"] for op in report["ops"]]
    from transformers import AutoConfig

    from zero_mismatch_plugin.tables.architectures import describe

    blocks = describe(AutoConfig.from_pretrained(str(checkpoints["qwen3_moe"])))
    assert names == oplist.op_names(2, qk_norm=True, blocks=blocks, lora=ALL_LINEARS)
    # Both layers MoE: attention carries LoRA steps, the MLP's adapter is inside the experts op.
    assert {"layers.1.router", "layers.1.topk_ids", "layers.1.experts", "layers.1.qkv_proj.lora_expand"} <= set(names)
    assert not any(".gate_up_proj" in n or ".down_proj" in n for n in names)


def test_check_and_bisect_lora_serve_a_peft_3d_expert_adapter(checkpoints, engines, numerics_environ, tmp_path,
                                                              capsys):
    """A PEFT-written 3-D expert adapter (transformers 5's fused experts): the check's engine is
    started with enable_mixed_moe_lora_format and its requests carry is_3d_lora_weight (a plain
    LoRARequest kills the engine), bisect's LoRA manager likewise; both bitwise."""
    from zero_mismatch_plugin.aligned.lora.fused_experts import build_fused_expert_adapter

    engines.pool.make_room()  # room for the engine started here
    adapter = build_fused_expert_adapter(tmp_path / "peft_3d", checkpoints["qwen3_moe"], r=8, seed=17)
    code, report, table = _cli_json(
        ["check", "--model", str(checkpoints["qwen3_moe"]), "--lora", str(adapter), "--trainer", "aligned",
         "--num-prompts", "4", "--max-tokens", "12", "--batch-sizes", "1,2"],
        tmp_path, capsys,
    )
    assert code == 0 and all(entry["pass"] is True for entry in report.values()), table
    assert report["sampled_token"]["bitwise_equal_fraction"] == 1.0
    code, report, table = _cli_json(["bisect", "--model", str(checkpoints["qwen3_moe"]), "--lora", str(adapter)],
                                    tmp_path, capsys)
    assert code == 0 and report["pass"] is True and report["not_compared"] == [], table


def _side_by_side(model_dir, adapter):
    from zero_mismatch_plugin.tools.checker.bisect import bisect_input
    from zero_mismatch_plugin.tools.checker.engine import load_prompts
    from zero_mismatch_plugin.tools.checker.engine_modules import EngineModules

    settings = engine_settings(model_dir, MAX_MODEL_LEN, seed=0, lora_dir=adapter)
    backend = load_backend("aligned", settings)
    modules = EngineModules(settings)
    vocab = modules.runtime.hf_config.vocab_size
    return modules, backend, bisect_input(load_prompts(model_dir, None, 3, vocab), 8, vocab)


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen2_moe", "llama"])
def side_by_side(request, checkpoints, adapters, numerics_environ):
    """(model, vLLM's modules serving the adapter, aligned backend, batch), one model at a time."""
    model = request.param
    modules, backend, batch = _side_by_side(checkpoints[model], adapters[model])
    with modules:
        yield model, modules, backend, batch


def _expert_matrix(which, target, expert):
    return lambda lora, layer: getattr(lora.expert_pairs(layer)[expert][target], f"lora_{which}")


def _shared_matrix(which, target):
    return lambda lora, layer: getattr(lora.shared_expert_pairs(layer)[target], f"lora_{which}")


def _vocab_matrix(which, target):
    return lambda lora, layer: getattr(lora.vocab_pair(target), f"lora_{which}")


# Per model: (the trainer's adapter matrix changed, its layer, the op bisect must name first).
PLANTED = {
    "qwen3_moe": [(_expert_matrix("B", "down_proj", 0), 1, "layers.1.experts"),
                  (_expert_matrix("A", "gate_proj", 3), 0, "layers.0.experts")],
    "qwen2_moe": [(_expert_matrix("B", "up_proj", 5), 0, "layers.0.experts"),
                  (_shared_matrix("A", "up_proj"), 0, "layers.0.shared_expert.gate_up_proj.lora_shrink"),
                  (_shared_matrix("B", "down_proj"), 0, "layers.0.shared_expert.down_proj.lora_expand")],
    "llama": [(_vocab_matrix("B", "embed_tokens"), None, oplist.EMBED),
              (_vocab_matrix("A", "lm_head"), None, oplist.LOGITS)],
}


def test_bisect_lora_every_op_equal_on_the_clean_adapter(side_by_side):
    from zero_mismatch_plugin.tools.checker.bisect import run_bisect

    model, modules, backend, batch = side_by_side
    result = run_bisect(modules, backend, batch)
    names = [op.name for op in result.ops]
    assert result.first_differing_op is None and result.not_compared == []
    assert names == modules.op_names() and len(names) > 30
    if model == "qwen2_moe":
        # The shared expert's linears are LoRA linears of their own (MoE layer 0).
        assert {"layers.0.shared_expert.gate_up_proj.lora_shrink", "layers.0.shared_expert.down_proj.lora_expand",
                "layers.0.experts", "layers.1.gate_up_proj.lora_expand"} <= set(names)


def test_bisect_lora_names_a_fault_planted_in_one_adapter_matrix(side_by_side):
    """One entry of one adapter matrix changed on the trainer side only (relative 1e-3): the op
    that reads it is the first divergence, every op before it bitwise equal; put back, every op
    is equal again."""
    from zero_mismatch_plugin.tools.checker.bisect import run_bisect

    model, modules, backend, batch = side_by_side
    for matrix, layer, first in PLANTED[model]:
        param = matrix(backend.model.lora, layer)
        original = param.detach().clone()
        with torch.no_grad():
            param[0, 0] *= 1.001  # in place: the trainer re-derives vLLM's buffers
        try:
            result = run_bisect(modules, backend, batch)
        finally:
            with torch.no_grad():
                param.copy_(original)
        print(f"{model}: planted for {first}: first differing op {result.first_differing_op}, "
              f"max |diff| {result.first.max_abs_diff if result.first else 0:.3g}")
        assert result.first_differing_op == first and result.not_compared == []
        names = [op.name for op in result.ops]
        assert all(op.equal for op in result.ops[: names.index(first)])
        assert run_bisect(modules, backend, batch).first_differing_op is None
