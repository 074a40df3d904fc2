"""The verl 0.9.1 Megatron-engine patch: applies, computes vLLM's logprobs, is undone exactly."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from zero_mismatch_plugin.integrations import patches as runtime_patches
from zero_mismatch_plugin.integrations.verl import megatron_engine

ENGINE = "verl.workers.engine.megatron.transformer_impl"
PATCHED = [
    ("MegatronEngine", "_build_tf_config"),
    ("MegatronEngine", "optimizer_step"),
    ("MegatronEngine", "load_checkpoint"),
    ("MegatronEngineWithLMHead", "_lm_head_logits_processor"),
]


@pytest.fixture(scope="module")
def engine_module():
    import importlib

    from zero_mismatch_plugin.integrations.megatron.standalone import init_single_process

    init_single_process()
    return importlib.import_module(ENGINE)


@pytest.fixture
def clean_patch():
    megatron_engine.remove()
    yield
    megatron_engine.remove()


def _originals(ti):
    return {(c, n): getattr(ti, c).__dict__[n] for c, n in PATCHED}


def _call_processor(ti, logits, label, temperature):
    fake_engine = SimpleNamespace(engine_config=SimpleNamespace(entropy_from_logits_with_chunking=False))
    return ti.MegatronEngineWithLMHead._lm_head_logits_processor(
        fake_engine, logits, label, temperature,
        calculate_sum_pi_squared=False, calculate_entropy=True, distillation_use_topk=False,
        distillation_only=False, logits_processor_func=None, batch=None, data_format="thd",
    )


def _vllm_sampler_logprobs(logits, label, temperature):
    """What vLLM's sampler records for each row: apply_temperature, then compute_logprobs."""
    from vllm.v1.sample.sampler import Sampler

    rows = logits.reshape(-1, logits.shape[-1]).to(torch.float32).clone()
    temp = temperature.reshape(-1).to(torch.float32)
    scaled = Sampler.apply_temperature(rows, temp, all_random=True)
    full = Sampler.compute_logprobs(scaled)
    return full.gather(-1, label.reshape(-1, 1)).reshape(label.shape)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_patched_logits_processor_gives_vllm_logprobs(engine_module, clean_patch, temperature):
    ti = engine_module
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(1, 96, 512, generator=g) * 4
    label = torch.randint(0, 512, (1, 96), generator=g)
    temp = torch.full((1, 96), temperature)
    expected = _vllm_sampler_logprobs(logits, label, temp)

    stock = _call_processor(ti, logits.clone(), label, temp.clone())["log_probs"]
    assert megatron_engine.apply()
    aligned = _call_processor(ti, logits.clone(), label, temp.clone())
    assert torch.equal(aligned["log_probs"], expected)
    assert aligned["entropy"].shape == label.shape
    # Control: verl's own arithmetic (-cross_entropy) is close to vLLM's; whether it is also
    # bit-equal depends on the host's kernels (printed, not asserted).
    assert (stock - expected).abs().max().item() < 1e-4
    print(f"T={temperature}: verl's stock logprobs {(stock == expected).float().mean().item():.1%} bit-equal on this host")


def test_at_tensor_parallelism_entropy_and_sum_pi_squared_are_the_whole_vocabularys(engine_module, clean_patch,
                                                                                     monkeypatch):
    """At TP > 1 every rank holds the gathered logits: the entropy and Σπ² are computed from them on
    the rank (verl's vocabulary-parallel kernels would all-reduce the ranks' identical copies)."""
    import verl.utils.torch_functional as verl_F

    ti = engine_module
    megatron_engine.apply()
    monkeypatch.setattr(megatron_engine, "_tensor_parallel_size", lambda: 2)
    monkeypatch.setattr(ti, "vocab_parallel_entropy", lambda logits: pytest.fail("vocabulary-parallel kernel"))
    g = torch.Generator().manual_seed(5)
    logits, label = torch.randn(1, 6, 40, generator=g), torch.randint(0, 40, (1, 6), generator=g)
    fake_engine = SimpleNamespace(engine_config=SimpleNamespace(entropy_from_logits_with_chunking=False))
    out = ti.MegatronEngineWithLMHead._lm_head_logits_processor(
        fake_engine, logits.clone(), label, torch.ones(1, 6), calculate_sum_pi_squared=True, calculate_entropy=True,
        distillation_use_topk=False, distillation_only=False, logits_processor_func=None, batch=None,
        data_format="thd")
    assert torch.equal(out["entropy"], verl_F.entropy_from_logits(logits))
    assert torch.allclose(out["sum_pi_squared"], torch.softmax(logits, -1).square().sum(-1))
    assert torch.equal(out["log_probs"], _vllm_sampler_logprobs(logits, label, torch.ones(1, 6)))


def test_patched_logprobs_are_differentiable(engine_module, clean_patch):
    ti = engine_module
    megatron_engine.apply()
    logits = torch.randn(1, 8, 64, requires_grad=True)
    label = torch.randint(0, 64, (1, 8))
    out = _call_processor(ti, logits, label, torch.full((1, 8), 0.5))["log_probs"]
    out.sum().backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0


def test_apply_then_remove_restores_original_callables(engine_module, clean_patch, caplog):
    import importlib

    ti = engine_module
    before = _originals(ti)
    peft_module = importlib.import_module("verl.workers.config.megatron_peft")
    get_peft_cls, get_per_tensor_param = peft_module.get_peft_cls, ti.MegatronEngine.__dict__["get_per_tensor_param"]
    with caplog.at_level("WARNING", logger="zero_mismatch_plugin"):
        assert megatron_engine.apply()
    assert sum("patched" in r.getMessage() for r in caplog.records) == 1
    assert megatron_engine.is_applied()
    for (c, n), original in before.items():
        assert getattr(ti, c).__dict__[n] is not original, (c, n)
        assert getattr(ti, c).__dict__[n].__wrapped__ is original
    assert not megatron_engine.apply()  # idempotent
    # Named entries of the one patch mechanism: the four method patches and the two LoRA ones, not the hook ones.
    names = {patch.name for patch in megatron_engine.METHOD_PATCHES + megatron_engine.LORA_PATCHES}
    assert names <= set(runtime_patches.applied())
    assert not {patch.name for patch in megatron_engine.HOOK_PATCHES} & set(runtime_patches.applied())
    assert peft_module.get_peft_cls.__wrapped__ is get_peft_cls
    assert ti.MegatronEngine.__dict__["get_per_tensor_param"].__wrapped__ is get_per_tensor_param
    assert megatron_engine.remove()
    assert not megatron_engine.is_applied() and not names & set(runtime_patches.applied())
    for (c, n), original in before.items():
        assert getattr(ti, c).__dict__[n] is original, (c, n)
    assert peft_module.get_peft_cls is get_peft_cls
    assert ti.MegatronEngine.__dict__["get_per_tensor_param"] is get_per_tensor_param
    assert not megatron_engine.remove()


def test_other_verl_versions_are_refused(engine_module, clean_patch, monkeypatch):
    import verl

    ti = engine_module
    before = _originals(ti)
    monkeypatch.setattr(verl, "__version__", "0.10.0")
    with pytest.raises(runtime_patches.UnsupportedVersion, match="supports verl 0.9.1; found verl 0.10.0"):
        megatron_engine.apply()
    assert not megatron_engine.is_applied()
    assert _originals(ti) == before


def test_env_switch(engine_module, clean_patch, monkeypatch):
    monkeypatch.delenv(megatron_engine.ENABLE_ENV, raising=False)
    assert not megatron_engine.maybe_apply() and not megatron_engine.is_applied()
    monkeypatch.setenv(megatron_engine.ENABLE_ENV, "1")
    assert megatron_engine.maybe_apply() and megatron_engine.is_applied()


def test_unsupported_configurations_fail_clearly():
    from zero_mismatch_plugin.faces.megatron.spec import UnsupportedMegatronFeature, require_supported

    base = dict(normalization="RMSNorm", gated_linear_unit=True, hidden_dropout=0.0, attention_dropout=0.0)
    require_supported(SimpleNamespace(**base))
    for extra, word in [
        (dict(num_moe_experts=8, expert_tensor_parallel_size=2), "expert tensor parallelism"),
        (dict(multi_latent_attention=True), "MLA"),
        (dict(tensor_model_parallel_size=2, num_moe_experts=8, expert_model_parallel_size=2,
              expert_tensor_parallel_size=2), "tensor with expert parallelism at expert_tensor_parallel_size > 1"),
        (dict(use_transformer_engine_full_layer_spec=True), "Transformer Engine"),
        (dict(hidden_dropout=0.1), "dropout"),
    ]:
        with pytest.raises(UnsupportedMegatronFeature, match=word):
            require_supported(SimpleNamespace(**{**base, **extra}))
    engine = SimpleNamespace(
        provider=SimpleNamespace(**base), is_value_model=False, peft_cls=None, _qat_enabled=False,
        engine_config=SimpleNamespace(use_fused_kernels=True, use_remove_padding=True),
    )
    with pytest.raises(UnsupportedMegatronFeature, match="use_fused_kernels"):
        megatron_engine.inject_aligned_spec(engine, runtime=object())
    engine.engine_config.use_fused_kernels = False
    engine.engine_config.use_remove_padding = False
    with pytest.raises(UnsupportedMegatronFeature, match="use_remove_padding"):
        megatron_engine.inject_aligned_spec(engine, runtime=object())
    engine.engine_config.use_remove_padding = True
    # Layouts the face runs on its own ranks but verl's engine has not run: each named, with its check.
    for name, flag in (("context_parallel_size", "--context-parallel"),):
        setattr(engine.provider, name, 2)
        with pytest.raises(UnsupportedMegatronFeature,
                           match=f"{name}=2 in verl's Megatron engine: .*zmrl check --trainer megatron {flag} 2"):
            megatron_engine.inject_aligned_spec(engine, runtime=object())
        setattr(engine.provider, name, 1)
    # LoRA through Megatron-Bridge's PEFT (its own adapter modules, megatron's arithmetic).
    engine.peft_cls = object()
    with pytest.raises(UnsupportedMegatronFeature, match="Megatron-Bridge's PEFT .*vanilla_mbridge=True"):
        megatron_engine.inject_aligned_spec(engine, runtime=object())
    engine.peft_cls = None
    # verl's mbridge backend at TP x EP with each expert split over the tensor-parallel ranks (megatron's
    # default expert_tensor_parallel_size): the aligned MoE layer keeps experts whole at EP.
    bridge = SimpleNamespace(config=SimpleNamespace(**base, tensor_model_parallel_size=2, expert_model_parallel_size=2,
                                                    expert_tensor_parallel_size=2, num_moe_experts=4))
    vanilla = SimpleNamespace(provider=None, bridge=bridge, vanilla_bridge=True, is_value_model=False, peft_cls=None,
                              _qat_enabled=False, engine_config=engine.engine_config)
    with pytest.raises(UnsupportedMegatronFeature, match="expert_tensor_parallel_size > 1 .*set it to 1"):
        megatron_engine.inject_aligned_spec(vanilla, runtime=object())


def test_import_verl_applies_the_patch_through_the_entry_point_when_enabled():
    import os

    from support import preloaded_python

    probe = ("import verl\n"
             "from verl.workers.engine.megatron import transformer_impl as engine\n"
             "print(hasattr(engine.MegatronEngineWithLMHead._lm_head_logits_processor, '__wrapped__'))\n")
    env = {key: value for key, value in os.environ.items() if key != "ZMRL_MEGATRON_ALIGNED"}
    results = {}
    for enabled in ("1", None):
        run_env = dict(env, ZMRL_MEGATRON_ALIGNED=enabled) if enabled else env
        result = preloaded_python.shared().run(probe, env=run_env, timeout=300)  # verl not imported yet
        assert result.returncode == 0, result.stderr[-3000:]
        results[enabled] = result.stdout.split()[-1]
    assert results == {"1": "True", None: "False"}


VERL_LORA = dict(type="lora", merge=False, rank=8, alpha=16, dropout=0.0,
                 target_modules=["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"], exclude_modules=[],
                 lora_A_init_method="xavier", lora_B_init_method="zero", a2a_experimental=False, adapter_path=None)


def test_verls_megatron_lora_settings_become_the_face_adapter_or_a_refusal_naming_the_key():
    """verl's default Megatron LoRA settings (rank 8 here) are the face's adapter: each megatron
    linear's vLLM slices as PEFT targets, verl's alpha and init; a setting the rollout would not
    compute the same way is refused, naming the key and what to set."""
    from zero_mismatch_plugin.integrations.verl.megatron_lora import FaceLoRA

    peft = FaceLoRA.from_verl(VERL_LORA)
    assert peft.lora_config.targets == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    assert (peft.lora_config.r, peft.lora_config.scaling, peft.a_init, peft.adapter_path) == (8, 2.0, "xavier", None)
    assert FaceLoRA.from_verl({**VERL_LORA, "target_modules": ["linear_proj"]}).lora_config.targets == ("o_proj",)
    for change, message in [
        (dict(merge=True), "merge=true: .*set it to false"),
        (dict(dropout=0.1), "dropout=0.1: .*set it to 0.0"),
        (dict(type="dora"), "type=dora: set it to lora"),
        (dict(exclude_modules=["linear_fc2"]), "exclude_modules=\\['linear_fc2'\\]"),
        (dict(lora_A_init_method="normal"), "lora_A_init_method=normal: use one of \\['kaiming', 'xavier'\\]"),
        (dict(lora_B_init_method="normal"), "lora_B_init_method=normal: set it to zero"),
        (dict(target_modules=["linear_qkv", "*.linear_fc1"]), "target_modules=.*adapts megatron-core's"),
    ]:
        with pytest.raises(ValueError, match="actor_rollout_ref.model.lora." + message):
            FaceLoRA.from_verl({**VERL_LORA, **change})


def test_get_peft_cls_gives_the_face_adapter_on_the_mbridge_builder_only(engine_module, clean_patch):
    """Patched, verl's get_peft_cls returns the face's adapter when the engine builds through mbridge
    (no Megatron-Bridge provider) with a LoRA rank, and is verl's own otherwise."""
    import importlib

    from zero_mismatch_plugin.integrations.verl.megatron_lora import FaceLoRA

    peft_module = importlib.import_module("verl.workers.config.megatron_peft")
    with_lora = SimpleNamespace(lora=VERL_LORA)
    with pytest.raises(AssertionError, match="only supported via Megatron-Bridge"):  # unpatched
        peft_module.get_peft_cls(with_lora, bridge=object(), provider=None)
    megatron_engine.apply()
    assert isinstance(peft_module.get_peft_cls(with_lora, bridge=object(), provider=None), FaceLoRA)
    assert peft_module.get_peft_cls(SimpleNamespace(lora={**VERL_LORA, "rank": 0}), bridge=object(), provider=None) is None
    with pytest.raises(ModuleNotFoundError, match="megatron.bridge"):  # verl's own Megatron-Bridge route
        peft_module.get_peft_cls(with_lora, bridge=object(), provider=object())


def test_verl_checkpoints_the_face_adapters_entries_and_leaves_other_runs_to_verl(engine_module, clean_patch):
    """Patched, verl's PEFT state-dict filter (Megatron-Bridge's, not installed) keeps each model
    chunk's adapter entries for a face adapter; without PEFT it is verl's (the state as it is)."""
    import importlib

    from zero_mismatch_plugin.integrations.verl.megatron_lora import FaceLoRA

    manager_class = importlib.import_module("verl.utils.checkpoint.megatron_checkpoint_manager").MegatronCheckpointManager
    qkv = "decoder.layers.0.self_attention.linear_qkv"
    state = {chunk: {f"{qkv}.weight": 0, f"{qkv}.lora.q_proj.lora_A": 1, f"{qkv}.lora.q_proj.lora_B": 2,
                     "output_layer.weight": 3} for chunk in ("model0", "model1")}
    face = SimpleNamespace(peft_cls=FaceLoRA.from_verl(VERL_LORA))
    with pytest.raises(ModuleNotFoundError, match="megatron.bridge"):  # unpatched: verl asks Megatron-Bridge
        manager_class._maybe_filter_peft_state_dict(face, state)
    megatron_engine.apply()
    kept = manager_class._maybe_filter_peft_state_dict(face, state)
    assert kept == {chunk: {f"{qkv}.lora.q_proj.lora_A": 1, f"{qkv}.lora.q_proj.lora_B": 2} for chunk in state}
    # Copies: megatron's load replaces the data of what it is given, and verl matches the optimizer's
    # parameters to the model's entries (the originals) by identity afterwards.
    sharded = SimpleNamespace(data=torch.zeros(2))
    (copied,) = manager_class._maybe_filter_peft_state_dict(face, {"model": {f"{qkv}.lora.v_proj.lora_B": sharded}}
                                                            )["model"].values()
    assert copied is not sharded and copied.data is sharded.data
    assert manager_class._maybe_filter_peft_state_dict(SimpleNamespace(peft_cls=None), state) is state
