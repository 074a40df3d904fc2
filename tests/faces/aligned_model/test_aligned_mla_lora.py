"""LoRA on multi-head latent attention (DeepSeek-V2/V3, dense MLPs): what vLLM's CPU engine adapts,
and the aligned trainer (frozen base + adapter) against it.

One LoRA-enabled engine per checkpoint, started after the session's shared engine is shut down
(at most one engine alive). The adapters have rank 8 on every module the aligned path adapts
(``supported_lora_targets``); the engine serves them with the dense LoRA tests' engine arguments
(``max_lora_rank`` 32: zero-padded, as the trainer pads them).
"""

from __future__ import annotations

import json

import pytest
import torch
from support import aligned_checks as checks
from test_aligned_lora import LORA_ENGINE, assert_bitwise, generate, lora_engines, score  # noqa: F401 - a fixture
from torch import nn
from support.vllm_session import prompts_for

from zero_mismatch_plugin.aligned.lora.names import supported_lora_targets
from zero_mismatch_plugin.aligned.lora.peft import LoRAConfig, write_peft_adapter
from zero_mismatch_plugin.aligned.lora.adapter import build_adapter

MODELS = ("deepseek_v2", "deepseek_v3_yarn")
# The linears vLLM 0.31 wraps with a LoRA layer in an MLA decoder layer, under its module names.
ENGINE_LORA_MODULES = {
    "deepseek_v2": {"q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_up_proj", "down_proj"},
    "deepseek_v3_yarn": {"fused_qkv_a_proj", "q_b_proj", "kv_b_proj", "o_proj", "gate_up_proj", "down_proj"},
}


@pytest.fixture(scope="module", params=MODELS)
def model(request):
    """Module-scoped, so pytest runs every test of one model before the next (one engine start each)."""
    return request.param


@pytest.fixture(scope="module", autouse=True)
def engine_accepts_functions():
    """Lets ``collective_rpc`` carry a function to the engine's worker; set before this module's
    engines start and kept until they are closed (``lora_engines`` is torn down first)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        yield


@pytest.fixture(scope="module")
def adapters(checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("mla_lora_adapters")
    return {m: build_adapter(root / m, checkpoints[m], r=8, lora_alpha=16, seed=21) for m in MODELS}


@pytest.fixture(scope="module")
def lora_trainers(checkpoints, adapters):
    from zero_mismatch_plugin.faces.aligned_model import AlignedCausalLM

    cache = {}

    def get(model):
        if model not in cache:
            cache[model] = AlignedCausalLM.from_pretrained(checkpoints[model], lora_dir=adapters[model], **LORA_ENGINE)
        return cache[model]

    return get


def _request(adapters, model):
    from vllm.lora.request import LoRARequest

    return LoRARequest(f"{model}-r8", 1, str(adapters[model]))


def _engine_lora_layers(worker):
    """In the engine's worker: the LoRA-wrapped modules of decoder layer 0 (suffixes), those outside
    the decoder layers, the model's embedding_modules and the modules vLLM accepts adapter tensors for."""
    from vllm.lora.layers import BaseLayerWithLoRA

    model = worker.model_runner.model
    wrapped = [n for n, m in model.named_modules() if isinstance(m, BaseLayerWithLoRA)]
    manager = worker.model_runner.lora_manager._adapter_manager
    # The module MLA's attention implementation runs kv_b_proj through (it is no nn.Module child).
    impl_kv_b = [type(m.impl.kv_b_proj).__name__ for _, m in model.named_modules()
                 if hasattr(getattr(m, "impl", None), "kv_b_proj")]
    return dict(
        impl_kv_b=impl_kv_b,
        layer0={n.rsplit(".", 1)[-1] for n in wrapped if ".layers.0." in n},
        outside=[n for n in wrapped if ".layers." not in n],
        embedding_modules=dict(getattr(model, "embedding_modules", {})),
        packed=dict(manager.packed_modules_mapping),
    )


def test_engine_adapts_the_mla_projections_but_no_embedding(model, lora_engines, checkpoints):
    """What vLLM 0.31 (CPU) serves with LoRA on an MLA checkpoint; the package's targets are those
    modules minus kv_b_proj: vLLM wraps it, but the MLA implementation keeps the unwrapped layer."""
    from transformers import AutoConfig

    llm = lora_engines.get(model)
    facts = llm.collective_rpc(_engine_lora_layers)[0]
    print(f"{model}: engine LoRA layers in layer 0: {sorted(facts['layer0'])}")
    assert facts["layer0"] == ENGINE_LORA_MODULES[model]
    assert facts["impl_kv_b"] == ["ColumnParallelLinear"] * 2  # per layer: the base layer, no LoRA
    assert facts["outside"] == [] and facts["embedding_modules"] == {}  # no embed_tokens / lm_head adapter
    assert "gate" not in facts["layer0"]  # a dense MLP has no router
    engine_targets = set()
    for module in facts["layer0"]:
        engine_targets.update(facts["packed"].get(module, [module]))
    supported = supported_lora_targets(AutoConfig.from_pretrained(str(checkpoints[model])))
    assert engine_targets - {"kv_b_proj"} == set(supported)


def test_kv_b_proj_adapter_never_reaches_the_output_and_is_refused(model, lora_engines, checkpoints, tmp_path):
    """vLLM wraps kv_b_proj with a LoRA layer, yet its MLA implementation runs the prefill through the
    layer it was built with (unwrapped) and the absorbed decode through W_UK / W_UV computed from the
    base weight at load: a kv_b_proj-only adapter gives the base model's rollout bit for bit, for a
    one-token prompt (decode only) and a long one (prefill, then decode). The package refuses it."""
    from transformers import AutoConfig
    from vllm.lora.request import LoRARequest

    from zero_mismatch_plugin.faces.aligned_model import AlignedCausalLM

    name = model
    config = AutoConfig.from_pretrained(str(checkpoints[name]))
    out_f = config.num_attention_heads * (config.qk_nope_head_dim + config.v_head_dim)
    gen = torch.Generator().manual_seed(5)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        name_of = f"base_model.model.model.layers.{layer}.self_attn.kv_b_proj.lora_{{}}.weight".format
        tensors[name_of("A")] = 0.2 * torch.randn(8, config.kv_lora_rank, generator=gen)
        tensors[name_of("B")] = 0.2 * torch.randn(out_f, 8, generator=gen)
    kv_b = write_peft_adapter(tmp_path / "kv_b", LoRAConfig(r=8, lora_alpha=16, targets=("kv_b_proj",)), tensors)

    llm = lora_engines.get(name)
    request = LoRARequest("kv_b_only", 7, str(kv_b))
    prompts = prompts_for(checkpoints[name])
    one_token = [prompts[0][:1]]
    (adapted,) = generate(llm, one_token, [request], seed=3)
    (base,) = generate(llm, one_token, [None], seed=3)
    assert adapted[1] == base[1] and torch.equal(adapted[2], base[2])
    (adapted,) = generate(llm, [prompts[1]], [request], seed=4)
    (base,) = generate(llm, [prompts[1]], [None], seed=4)
    assert adapted[1] == base[1] and torch.equal(adapted[2], base[2])
    # Positive control: an adapter on o_proj alone, same engine, same seeds, changes the rollout.
    o_proj = build_adapter(tmp_path / "o_proj", checkpoints[name], r=8, targets=("o_proj",), seed=6)
    (adapted_o,) = generate(llm, [prompts[1]], [LoRARequest("o_proj_only", 8, str(o_proj))], seed=4)
    assert not torch.equal(adapted_o[2], base[2])
    print(f"{name}: kv_b_proj-only adapter: {len(adapted[1])} response tokens equal to the base model's "
          f"(an o_proj-only adapter: {(adapted_o[2] == base[2]).float().mean().item():.1%} equal)")

    with pytest.raises(NotImplementedError, match="kv_b_proj.*never applies an adapter"):
        AlignedCausalLM.from_pretrained(checkpoints[name], lora_dir=kv_b, **LORA_ENGINE)


@pytest.mark.parametrize("batch_size", [1, 8])
def test_mla_lora_bitwise_equal_engine(model, lora_engines, lora_trainers, adapters, batch_size):
    """Prompt rows through the prefill path, response rows through the absorbed decode, the adapter
    on every projection through vLLM's punica ops; at batch 1 also a one-token prompt (decode only)."""
    llm = lora_engines.get(model)
    trainer = lora_trainers(model)
    prompts = prompts_for(trainer.runtime.model_dir)[:batch_size]
    request = _request(adapters, model)
    rows = generate(llm, prompts, [request] * batch_size, seed=40 + batch_size, n=2, max_tokens=20)
    assert_bitwise(score(trainer, rows), rows, f"{model} rank-8 LoRA, batch {batch_size}")
    assert not torch.equal(score(trainer, rows, adapter=False), torch.cat([r[2] for r in rows]))
    if batch_size == 1:
        one = generate(llm, [prompts[0][:1]], [request], seed=7)
        assert_bitwise(score(trainer, one), one, f"{model} one-token prompt")
    print(f"{model}: batch {batch_size}: {sum(len(r[1]) for r in rows)} response tokens bitwise equal")


class _LoRADelta(nn.Module):
    """A weight's parametrization ``W + s·BA`` in float64: the reference's LoRA (PEFT maps
    DeepSeek-V2's MLP names to fused expert parameters and would leave the MLP adapters out)."""

    def __init__(self, lora_a, lora_b, scaling):
        super().__init__()
        self.lora_A = nn.Parameter(lora_a.detach().double().clone())
        self.lora_B = nn.Parameter(lora_b.detach().double().clone())
        self.scaling = scaling

    def forward(self, weight):
        return weight + self.scaling * (self.lora_B @ self.lora_A)


def _float64_reference(trainer):
    """transformers in float64 with the trainer's base weights and its adapter on each target;
    returns the model and ``{trainer adapter parameter name: reference parameter}``."""
    from torch.nn.utils.parametrize import register_parametrization
    from transformers import AutoModelForCausalLM

    from zero_mismatch_plugin.aligned.lora.names import PARENT_MODULE

    model = AutoModelForCausalLM.from_pretrained(str(trainer.runtime.model_dir), dtype=torch.float64)
    base = {k: v.detach().double() for k, v in trainer.state_dict().items() if not k.startswith("lora.")}
    assert not model.load_state_dict(base, strict=False).unexpected_keys
    model.get_input_embeddings().padding_idx = None  # vLLM's embedding has no padding row
    params = {}
    for i, target, pair in trainer.lora.pairs():
        delta = _LoRADelta(pair.lora_A, pair.lora_B, trainer.lora.lora_config.scaling)
        register_parametrization(model.get_submodule(f"model.layers.{i}.{PARENT_MODULE[target]}.{target}"), "weight", delta)
        params[f"layers.{i}.{target}.lora_A"], params[f"layers.{i}.{target}.lora_B"] = delta.lora_A, delta.lora_B
    return model.eval(), params


def test_mla_lora_backward_matches_float64_and_base_gets_no_gradient(model, lora_engines, lora_trainers, adapters):
    llm = lora_engines.get(model)
    trainer = lora_trainers(model)
    prompts = prompts_for(trainer.runtime.model_dir)[:4]
    rows = generate(llm, prompts, [_request(adapters, model)] * len(prompts), seed=60)
    worst = checks.check_lora_backward_matches_float64(trainer, rows, _float64_reference)
    print(f"{model}: worst relative LoRA gradient error vs float64 {worst:.3g}")


def test_mla_adapter_targets_the_engine_ignores_are_refused(checkpoints, tmp_path):
    from zero_mismatch_plugin.faces.aligned_model import AlignedCausalLM

    for target, reason in (("gate", "router"), ("lm_head", "embedding / lm_head"), ("q_b_proj", "covers")):
        path = build_adapter(tmp_path / "ok", checkpoints["deepseek_v2"], r=8)
        config_path = path / "adapter_config.json"
        config = json.loads(config_path.read_text())
        config_path.write_text(json.dumps({**config, "target_modules": ["q_proj", target]}))
        with pytest.raises(NotImplementedError, match=f"{target}.*{reason}"):
            AlignedCausalLM.from_pretrained(checkpoints["deepseek_v2"], lora_dir=path, **LORA_ENGINE)


def _engine_embedding_lora_layers(worker):
    """In the engine's worker: the LoRA layer classes on the embedding and the logits (lm_head) side."""
    from vllm.lora.layers import BaseLayerWithLoRA

    model = worker.model_runner.model
    return sorted(type(m).__name__ for n, m in model.named_modules()
                  if isinstance(m, BaseLayerWithLoRA) and ".layers." not in n)


def test_engine_serves_embedding_and_lm_head_adapters_for_llama_only(lora_engines, tmp_path):
    """vLLM 0.31 adapts embed_tokens and lm_head for models that list ``embedding_modules`` (Llama:
    VocabParallelEmbeddingWithLoRA, LogitsProcessorWithLoRA), not for DeepSeek-V2/V3 (the first
    test). The aligned model face adapts both for Llama (``test_aligned_vocab_lora.py``); readers
    of the decoder linears only (the Megatron face, ``zmrl check``) refuse them, naming why."""
    from zero_mismatch_plugin.faces.aligned_model import AlignedCausalLM
    from zero_mismatch_plugin.aligned.lora.peft import read_lora_config
    from zero_mismatch_plugin.aligned.lora.adapter import LoRAAdapter

    llm = lora_engines.get("llama")
    layers = llm.collective_rpc(_engine_embedding_lora_layers)[0]
    print(f"llama: engine LoRA layers outside the decoder layers: {layers}")
    assert layers == ["LogitsProcessorWithLoRA", "VocabParallelEmbeddingWithLoRA"]
    path = build_adapter(tmp_path / "llama", lora_engines.checkpoints["llama"], r=8,
                         targets=("q_proj", "embed_tokens", "lm_head"))
    trainer = AlignedCausalLM.from_pretrained(lora_engines.checkpoints["llama"], lora_dir=path, **LORA_ENGINE)
    assert set(trainer.lora_vocab_ops) == {"embed_tokens", "lm_head"}
    with pytest.raises(NotImplementedError, match="embed_tokens.*embedding_modules.*lm_head.*embedding_modules"):
        read_lora_config(path)
    with pytest.raises(NotImplementedError, match="embed_tokens.*Megatron face"):
        LoRAAdapter.from_dir(path, trainer.config, trainer.head_dim)
