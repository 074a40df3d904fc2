"""Bad command lines of ``zmrl check``, ``bisect``, ``demo`` and ``selfcheck``.

Every case must be refused with a message that says what to change, and before any work:
while a case runs, starting a vLLM engine, building vLLM's model or a trainer backend, or
building the demo's model raises (and would be counted as a traceback).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import tempfile
from pathlib import Path
from unittest import mock

from support.bad_input import error, run_cli

_WORK_STARTERS = {
    "zero_mismatch_plugin.tools.checker.engine.open_engine": "a vLLM engine",
    "zero_mismatch_plugin.tools.checker.engine_modules.EngineModules": "vLLM's model (bisect)",
    "zero_mismatch_plugin.tools.checker.commands.load_backend": "a trainer backend",
    "zero_mismatch_plugin.tools.demo.engine.start_engine": "the demo's vLLM engine",
    "zero_mismatch_plugin.tools.tiny_models.build_tiny_model": "the demo's model",
}


def _refuse(what):
    def started(*args, **kwargs):
        raise AssertionError(f"{what} was started before the bad input was refused")

    return started


@contextlib.contextmanager
def _nothing_may_start():
    saved_environment = dict(os.environ)
    with contextlib.ExitStack() as stack:
        for target, what in _WORK_STARTERS.items():
            stack.enter_context(mock.patch(target, _refuse(what)))
        try:
            yield
        finally:
            os.environ.clear()
            os.environ.update(saved_environment)


def refused(argv):
    """``zmrl argv`` with every engine / model / training start made to fail."""
    with _nothing_may_start():
        return run_cli(argv)


@functools.cache
def _workdir() -> Path:
    return Path(tempfile.mkdtemp(prefix="zmrl-bad-cli-"))


@functools.cache
def tiny_model() -> str:
    """A real tiny Llama checkpoint (built once): only the input around it is bad."""
    from zero_mismatch_plugin.tools.tiny_models import build_tiny_model

    return str(build_tiny_model(_workdir() / "llama", family="llama", seed=0))


def model_with(name: str, config=None, weights: bool = True, config_text: str | None = None, base=None) -> str:
    """A copy of the tiny checkpoint (or of ``base``) with config.json replaced (``config``: dict,
    or raw text)."""
    path = _workdir() / name
    if not path.exists():
        shutil.copytree(base or tiny_model(), path)
        if not weights:
            for file in path.glob("*.safetensors"):
                file.unlink()
        if config is not None or config_text is not None:
            text = config_text if config_text is not None else json.dumps(config)
            (path / "config.json").write_text(text)
    return str(path)


def tiny_config() -> dict:
    return json.loads((Path(tiny_model()) / "config.json").read_text())


@functools.cache
def tiny_mla_moe_model() -> str:
    """A real tiny DeepSeek-V2 checkpoint: multi-head latent attention, layer 1 Mixture-of-Experts
    whose routing groups are left unset, as transformers' DeepseekV2Config leaves them (built once)."""
    from zero_mismatch_plugin.tools.tiny_models import build_tiny_mla_model

    return str(build_tiny_mla_model(_workdir() / "deepseek-v2-moe", first_k_dense_replace=1, architecture="deepseek_v2"))


@functools.cache
def tiny_moe_model() -> str:
    """A real tiny Qwen3-MoE checkpoint (built once)."""
    from zero_mismatch_plugin.tools.tiny_models import build_tiny_model

    return str(build_tiny_model(_workdir() / "qwen3-moe", family="qwen3_moe", seed=0))


def mla_config(**changes) -> dict:
    return {**json.loads((Path(tiny_mla_moe_model()) / "config.json").read_text()), **changes}


def with_config(command, name, config, *args, base=None):
    """``zmrl command`` on a copy of the tiny Llama (or ``base``) whose config.json is ``config()``:
    the weights are never read, the config is refused first."""
    return lambda: refused([command, "--model", model_with(name, config(), base=base() if base else None), *args])


# Configs of the other architectures on the tiny Llama's files (refused before any weight is read).
def mistral_config(**changes) -> dict:
    return {**tiny_config(), "architectures": ["MistralForCausalLM"], "model_type": "mistral", **changes}


def cwm_config(**changes) -> dict:
    return {**tiny_config(), "architectures": ["CwmForCausalLM"], "model_type": "cwm", "sliding_window": 12, **changes}


def mixtral_config(**changes) -> dict:
    return {**tiny_config(), "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
            "num_local_experts": 8, "num_experts_per_tok": 2, **changes}


def qwen3_moe_config(**changes) -> dict:
    return {**tiny_config(), "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
            "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 96, **changes}


def glm4_moe_config(**changes) -> dict:
    from transformers import Glm4MoeConfig

    config = Glm4MoeConfig(vocab_size=512, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, n_routed_experts=8, n_group=4, topk_group=2).to_dict()
    return {**config, "architectures": ["Glm4MoeForCausalLM"], **changes}


def deepseek_v3_config(**changes) -> dict:
    return mla_config(**{"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "n_group": 2,
                         "topk_group": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid", **changes})


NOT_ALIGNED = r"not supported by the aligned trainer forward: "


def no_config_dir() -> str:
    path = _workdir() / "no-config"
    path.mkdir(exist_ok=True)
    (path / "model.safetensors").write_bytes(b"")
    return str(path)


def a_file(name: str, content: bytes | str = "x\n") -> str:
    path = _workdir() / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    return str(path)


def jsonl(name: str, *lines) -> str:
    return a_file(name, "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))


def check(*args):
    return lambda: refused(["check", "--model", tiny_model(), *args])


def bisect(*args):
    return lambda: refused(["bisect", "--model", tiny_model(), *args])


def on_model(command, model, *args):
    return lambda: refused([command, "--model", model() if callable(model) else model, *args])


def demo(*args):
    return lambda: refused(["demo", *args])


def selfcheck_without_entry_points():
    with mock.patch.dict(os.environ, {"VERL_USE_EXTERNAL_PLUGINS": "none"}):
        return run_cli(["selfcheck"])


from zero_mismatch_plugin.tables.architectures import SUPPORTED_ARCHITECTURES  # noqa: E402

ARCH = ", ".join(SUPPORTED_ARCHITECTURES)  # what the messages must list, every one of them
SUPPORTED = "supported: " + ARCH

CASES = [
    # ----- option values: check and bisect -----------------------------------------------
    *(
        error(f"{command}-max-model-len-{value}", on_model(command, tiny_model, "--max-model-len", value),
              r"--max-model-len must be at least 1, got " + value)
        for command in ("check", "bisect") for value in ("0", "-5")
    ),
    *(
        error(f"{command}-max-tokens-{value}", on_model(command, tiny_model, "--max-tokens", value),
              r"--max-tokens must be at least 1, got " + value)
        for command in ("check", "bisect") for value in ("0", "-1")
    ),
    error("check-num-prompts-0", check("--num-prompts", "0"), r"--num-prompts must be at least 1, got 0"),
    error("bisect-num-prompts-negative", bisect("--num-prompts", "-2"), r"--num-prompts must be at least 1, got -2"),
    error("check-max-model-len-not-an-int", check("--max-model-len", "lots"), r"--max-model-len: invalid int value"),
    error("check-max-model-len-above-the-model", check("--max-model-len", "4096"),
          r"--max-model-len 4096 is more than the model's max_position_embeddings \(512\); use at most 512"),
    error("bisect-max-model-len-above-the-model", bisect("--max-model-len", "100000"),
          r"max_position_embeddings \(512\); use at most 512"),
    error("check-max-tokens-plus-prompt-over-max-model-len", check("--max-model-len", "32", "--max-tokens", "30"),
          r"with --max-tokens 30 a sequence needs \d+ positions, more than --max-model-len 32"),
    error("bisect-honours-max-model-len", bisect("--max-model-len", "16"),
          r"more than --max-model-len 16; raise --max-model-len to \d+"),
    error("check-prompt-longer-than-max-model-len",
          lambda: check("--max-model-len", "24", "--max-tokens", "1",
                        "--prompts", jsonl("long.jsonl", {"prompt_token_ids": list(range(5, 45))}))(),
          r"prompt 0 has 40 tokens: with --max-tokens 1 a sequence needs 41 positions, more than --max-model-len 24"),
    error("bisect-prompt-longer-than-max-model-len",
          lambda: bisect("--max-model-len", "24", "--prompts", jsonl("long-b.jsonl", {"prompt_token_ids": list(range(5, 45))}))(),
          r"prompt 0 has 40 tokens"),
    error("check-prompt-longer-than-one-prefill-step",
          lambda: on_model("check", model_with("long-positions", {**tiny_config(), "max_position_embeddings": 4096}),
                           "--max-model-len", "4096", "--max-tokens", "4",
                           "--prompts", jsonl("prefill.jsonl", {"prompt_token_ids": [5 + i % 500 for i in range(2100)]}))(),
          r"prompt 0 has 2100 tokens, more than the engine prefills in one step \(\d+\); shorten it"),
    error("check-seed-negative", check("--seed", "-1"), r"--seed must be between 0 and 4294967295, got -1"),
    error("bisect-seed-too-large", bisect("--seed", str(2**32)), r"--seed must be between 0 and 4294967295"),
    error("check-batch-sizes-not-integers", check("--batch-sizes", "2,x"), r"--batch-sizes must be comma-separated integers"),
    error("check-batch-sizes-zero", check("--batch-sizes", "0,2"), r"--batch-sizes must be positive integers"),
    error("check-batch-sizes-empty", check("--batch-sizes", ","), r"--batch-sizes must be positive integers"),
    error("check-unknown-trainer", check("--trainer", "deepspeed"), r"argument --trainer: invalid choice: 'deepspeed'"),
    error("check-expert-parallel-on-the-aligned-face", check("--expert-parallel", "2"),
          r"--expert-parallel runs the Megatron face's experts on several ranks: use --trainer megatron"),
    error("check-expert-parallel-on-a-dense-checkpoint", check("--trainer", "megatron", "--expert-parallel", "2"),
          r"--expert-parallel 2: .* has no MoE layers; leave it at 1"),
    error("check-expert-parallel-unlike-the-tensor-parallel",
          check("--trainer", "megatron", "--expert-parallel", "4", "--tensor-parallel", "2"),
          r"--expert-parallel 4 with --tensor-parallel 2: the checker runs the experts over the tensor-parallel "
          r"ranks \(expert tensor parallelism 1\); give them the same size"),
    error("check-expert-parallel-zero", check("--trainer", "megatron", "--expert-parallel", "0"),
          r"--expert-parallel 0: give a number of ranks, 1 or more"),
    error("check-moe-at-tensor-parallel-without-sequence-parallel",
          lambda: refused(["check", "--model", tiny_moe_model(), "--trainer", "megatron", "--tensor-parallel", "2"]),
          r"--tensor-parallel 2 on an MoE checkpoint: add --sequence-parallel"),
    error("check-pipeline-parallel-on-the-aligned-face", check("--pipeline-parallel", "2"),
          r"--pipeline-parallel runs the Megatron face's layers in stages on several ranks: use --trainer megatron"),
    error("check-pipeline-parallel-zero", check("--trainer", "megatron", "--pipeline-parallel", "0"),
          r"--pipeline-parallel 0: give a number of ranks, 1 or more"),
    error("check-pipeline-parallel-not-dividing-the-layers", check("--trainer", "megatron", "--pipeline-parallel", "3"),
          r"--pipeline-parallel 3 does not divide the checkpoint's \d+ layers"),
    error("check-context-parallel-on-the-aligned-face", check("--context-parallel", "2"),
          r"--context-parallel runs each sequence's rows split on several ranks: use --trainer megatron"),
    error("check-context-parallel-negative", check("--trainer", "megatron", "--context-parallel", "-2"),
          r"--context-parallel -2: give a number of ranks, 1 or more"),
    error("check-unknown-token-dispatcher", check("--moe-token-dispatcher", "flex"),
          r"argument --moe-token-dispatcher: invalid choice: 'flex'"),
    error("bisect-at-tensor-parallel-with-more-expert-ranks",
          on_model("bisect", tiny_moe_model, "--trainer", "megatron", "--tensor-parallel", "2", "--sequence-parallel",
                   "--expert-parallel", "4"),
          r"--expert-parallel 4 with --tensor-parallel 2: .* give them the same size"),
    error("bisect-pipeline-parallel-on-the-aligned-face", bisect("--pipeline-parallel", "2"),
          r"--pipeline-parallel runs the Megatron face's layers in stages on several ranks: use --trainer megatron"),
    error("bisect-unknown-numerics", bisect("--numerics", "exact"), r"argument --numerics: invalid choice: 'exact'"),
    error("check-without-model", lambda: refused(["check"]), r"the following arguments are required: --model"),
    error("check-json-into-a-directory", check("--json", str(_workdir())), r"--json .* is a directory; give a file path"),
    error("bisect-json-in-a-missing-directory", bisect("--json", str(_workdir() / "nowhere" / "out.json")),
          r"--json .*out\.json: .*nowhere is not an existing directory"),
    error("check-json-under-a-file", lambda: refused(["check", "--model", tiny_model(), "--json",
                                                     a_file("plain-file") + "/out.json"]),
          r"plain-file is not an existing directory"),
    # ----- the checkpoint ------------------------------------------------------------------
    error("check-model-missing", on_model("check", str(_workdir() / "no-such-model")),
          r"--model .*no-such-model: no such directory"),
    error("bisect-model-is-a-file", on_model("bisect", lambda: a_file("weights.bin")),
          r"--model .*weights\.bin is a file; give the checkpoint's directory"),
    error("check-model-without-config", on_model("check", no_config_dir), r"has no config\.json"),
    error("bisect-model-without-weights", on_model("bisect", lambda: model_with("no-weights", weights=False)),
          r"holds no weights: no \*\.safetensors file"),
    error("check-unsupported-architecture",
          on_model("check", lambda: model_with("gpt2", {**tiny_config(), "architectures": ["GPT2LMHeadModel"]})),
          r"architecture GPT2LMHeadModel .* is not supported by the aligned forward; " + SUPPORTED),
    error("bisect-unsupported-architecture",
          on_model("bisect", lambda: model_with("gemma2", {**tiny_config(), "architectures": ["Gemma2ForCausalLM"]})),
          r"architecture Gemma2ForCausalLM .*; " + SUPPORTED),
    error("check-unsupported-architecture-with-hf-trainer",
          on_model("check", lambda: model_with("gpt2", {**tiny_config(), "architectures": ["GPT2LMHeadModel"]}),
                   "--trainer", "hf"),
          r"architecture GPT2LMHeadModel"),
    error("check-config-without-architectures",
          on_model("check", lambda: model_with("no-arch", {k: v for k, v in tiny_config().items() if k != "architectures"})),
          r"names no architecture .*; " + SUPPORTED),
    error("bisect-architectures-not-a-list",
          on_model("bisect", lambda: model_with("arch-str", {**tiny_config(), "architectures": "LlamaForCausalLM"})),
          r"names no architecture \(\"architectures\": 'LlamaForCausalLM'\)"),
    error("check-config-not-json", on_model("check", lambda: model_with("bad-json", config_text="{not json")),
          r"cannot read .*config\.json"),
    error("bisect-config-a-json-list", on_model("bisect", lambda: model_with("list-json", config_text="[1, 2]")),
          r"config\.json is not a JSON object"),
    # ----- settings of a supported architecture that a trainer face does not cover ------------
    # (describe() refuses them; before, the refusal came as a traceback once the trainer was built)
    *(
        error(f"{command}-deepseek-v2-moe-with-mla-{trainer}", on_model(command, tiny_mla_moe_model, "--trainer", trainer),
              rf"--model .*deepseek-v2-moe \(--trainer {trainer}\): DeepseekV2ForCausalLM: {NOT_ALIGNED}"
              r"n_group=None, topk_group=None: vLLM routes DeepSeek experts in groups always; state both in config\.json")
        for command, trainer in (("check", "aligned"), ("bisect", "aligned"), ("check", "hf"), ("bisect", "megatron"))
    ),
    error("check-sliding-window-on-llama", with_config("check", "llama-window", lambda: {**tiny_config(), "sliding_window": 12}),
          NOT_ALIGNED + r"sliding_window=12 \(windowed attention\): set it to null"),
    error("bisect-layer-types-windows-on-llama",
          with_config("bisect", "llama-layer-types", lambda: {**tiny_config(), "sliding_window": 12,
                                                              "layer_types": ["sliding_attention", "full_attention"]}),
          r"sliding-window layers by layer_types \(interleaved windows are covered for CwmForCausalLM only\)"),
    error("check-cwm-unknown-layer-type",
          with_config("check", "cwm-chunked", lambda: cwm_config(layer_types=["sliding_attention", "chunked_attention"])),
          r"CwmForCausalLM: .*layer_types \['chunked_attention'\]: only sliding_attention / full_attention"),
    error("check-mistral-window-of-zero", with_config("check", "mistral-window-0", lambda: mistral_config(sliding_window=0)),
          r"MistralForCausalLM: .*sliding_window=0: a positive number of tokens \(or null\)"),
    error("bisect-mistral-llama-4-scaling",
          with_config("bisect", "mistral-l4", lambda: mistral_config(llama_4_scaling={"beta": 0.1})),
          r"llama_4_scaling \(position-dependent query scaling\): set it to null"),
    error("check-mistral-time-conditioned-norms",
          with_config("check", "mistral-ada", lambda: mistral_config(ada_rms_norm_t_cond=True)),
          r"ada_rms_norm_t_cond \(time-conditioned norms\): set it to false"),
    error("check-gelu-mlp", with_config("check", "llama-gelu", lambda: {**tiny_config(), "hidden_act": "gelu"}),
          NOT_ALIGNED + r"hidden_act='gelu': only SwiGLU \(silu\) MLPs"),
    error("bisect-mlp-bias", with_config("bisect", "llama-mlp-bias", lambda: {**tiny_config(), "mlp_bias": True}),
          NOT_ALIGNED + r"mlp_bias: set it to false"),
    error("check-non-causal", with_config("check", "llama-non-causal", lambda: {**tiny_config(), "is_causal": False}),
          NOT_ALIGNED + r"a non-causal model: only causal decoders"),
    error("check-quantized-experts",
          with_config("check", "mixtral-fp8", lambda: mixtral_config(quantization_config={"quant_method": "fp8"})),
          r"MixtralForCausalLM: .*quantized experts \(quantization_config 'fp8'\): use an unquantized checkpoint"),
    error("check-qwen3-moe-shared-expert",
          with_config("check", "qwen3-moe-shared", lambda: qwen3_moe_config(shared_expert_intermediate_size=96)),
          r"Qwen3MoeForCausalLM with shared_expert_intermediate_size > 0 is not covered: set it to 0"),
    error("bisect-glm-tied-head", with_config("bisect", "glm-tied", lambda: glm4_moe_config(tie_word_embeddings=True)),
          r"Glm4MoeForCausalLM: .*tie_word_embeddings=true \(vLLM's GLM-4.5 model never ties the head\): untie it"),
    error("check-glm-expert-groups", with_config("check", "glm-groups", lambda: glm4_moe_config(n_group=3)),
          r"n_routed_experts=8 not divisible by n_group=3"),
    error("check-mla-latent-rank", with_config("check", "mla-rank-256", lambda: mla_config(first_k_dense_replace=2,
                                                                                           kv_lora_rank=256),
                                               base=tiny_mla_moe_model),
          r"kv_lora_rank=256, qk_rope_head_dim=64: vLLM's CPU MLA decode kernel runs only kv_lora_rank=512"),
    error("check-mla-sparse-attention", with_config("check", "mla-index", lambda: mla_config(first_k_dense_replace=2,
                                                                                             index_topk=64),
                                                    base=tiny_mla_moe_model),
          r"index_topk \(DeepSeek-V3\.2 sparse attention\): vLLM runs sparse MLA on no CPU"),
    error("check-deepseek-v3-softmax-with-selection-bias",
          with_config("check", "v3-noaux-softmax", lambda: deepseek_v3_config(scoring_func="softmax"),
                      base=tiny_mla_moe_model),
          r"DeepseekV3ForCausalLM: .*MoE routing topk_method='noaux_tc', scoring_func='softmax': covered are "
          r"topk_method 'noaux_tc' with scoring_func 'sigmoid'"),
    error("check-deepseek-v3-expert-groups",
          with_config("check", "v3-groups", lambda: deepseek_v3_config(n_group=3), base=tiny_mla_moe_model),
          r"DeepseekV3ForCausalLM: .*n_routed_experts=4, n_group=3, topk_group=1: the experts must split into "
          r"n_group equal groups"),
    # The Megatron face's own refusals.
    error("check-megatron-o-proj-bias",
          with_config("check", "llama-attention-bias", lambda: {**tiny_config(), "attention_bias": True}, "--trainer", "megatron"),
          r"\(--trainer megatron\): LlamaForCausalLM: an o_proj bias \(attention_bias=true\) is not supported by the "
          r"Megatron face.*\. --trainer aligned runs this model"),
    error("bisect-megatron-rope-scaling",
          with_config("bisect", "llama-linear-rope",
                      lambda: {**tiny_config(), "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}},
                      "--trainer", "megatron"),
          r"rope scaling 'linear' is not supported by the Megatron face\. --trainer aligned runs this model"),
    error("check-megatron-mla",
          with_config("check", "mla-dense", lambda: mla_config(first_k_dense_replace=2), "--trainer", "megatron",
                      base=tiny_mla_moe_model),
          r"DeepseekV2ForCausalLM: not supported by the Megatron face: multi-head latent attention .*\. "
          r"--trainer aligned runs this model"),
    # ----- the prompts file ----------------------------------------------------------------
    error("check-jsonl-without-prompt-key",
          lambda: check("--prompts", jsonl("text-key.jsonl", {"prompt": "a b"}, {"text": "hello"}))(),
          r"text-key\.jsonl line 2: no \"prompt\" \(text\) or \"prompt_token_ids\" \(list of ints\) key"),
    error("bisect-jsonl-malformed-line",
          lambda: bisect("--prompts", jsonl("broken.jsonl", {"prompt": "a"}, "", '{"prompt": "b"'))(),
          r"broken\.jsonl line 3: not valid JSON"),
    error("check-jsonl-empty-file", lambda: check("--prompts", a_file("empty.jsonl", ""))(),
          r"--prompts .*empty\.jsonl holds no prompt"),
    error("check-text-file-only-blank-lines", lambda: check("--prompts", a_file("blank.txt", "\n  \n\n"))(),
          r"blank\.txt holds no prompt"),
    error("bisect-jsonl-array-line", lambda: bisect("--prompts", jsonl("array.jsonl", [1, 2, 3]))(),
          r"array\.jsonl line 1: expected a JSON object"),
    error("check-jsonl-prompt-not-a-string", lambda: check("--prompts", jsonl("num.jsonl", {"prompt": 5}))(),
          r"num\.jsonl line 1: \"prompt\" must be a non-empty string, got 5"),
    error("bisect-jsonl-prompt-empty", lambda: bisect("--prompts", jsonl("empty-prompt.jsonl", {"prompt": " "}))(),
          r"\"prompt\" must be a non-empty string"),
    error("check-jsonl-token-ids-a-string",
          lambda: check("--prompts", jsonl("ids-str.jsonl", {"prompt_token_ids": "1 2 3"}))(),
          r"ids-str\.jsonl line 1: \"prompt_token_ids\" must be a non-empty list of integers"),
    error("bisect-jsonl-token-ids-floats",
          lambda: bisect("--prompts", jsonl("ids-float.jsonl", {"prompt_token_ids": [1, 2.5]}))(),
          r"must be a non-empty list of integers"),
    error("check-jsonl-token-ids-booleans",
          lambda: check("--prompts", jsonl("ids-bool.jsonl", {"prompt_token_ids": [True, False]}))(),
          r"must be a non-empty list of integers"),
    error("check-jsonl-token-ids-empty",
          lambda: check("--prompts", jsonl("ids-empty.jsonl", {"prompt_token_ids": []}))(),
          r"must be a non-empty list of integers"),
    error("check-jsonl-token-id-beyond-vocabulary",
          lambda: check("--prompts", jsonl("ids-big.jsonl", {"prompt_token_ids": [5, 512, 9000]}))(),
          r"ids-big\.jsonl line 1: token ids \[512, 9000\] are outside the model's vocabulary \[0, 512\)"),
    error("bisect-jsonl-negative-token-id",
          lambda: bisect("--prompts", jsonl("ids-neg.jsonl", {"prompt": "x"}, {"prompt_token_ids": [3, -1]}))(),
          r"ids-neg\.jsonl line 2: token ids \[-1\] are outside"),
    error("check-prompts-file-missing", check("--prompts", str(_workdir() / "nope.txt")),
          r"--prompts .*nope\.txt cannot be read: No such file or directory"),
    error("bisect-prompts-file-is-a-directory", bisect("--prompts", str(_workdir())), r"--prompts .* cannot be read"),
    error("check-prompts-not-utf8", lambda: check("--prompts", a_file("latin1.txt", "caf\xe9\n".encode("latin-1")))(),
          r"latin1\.txt is not UTF-8 text"),
    # ----- demo ------------------------------------------------------------------------------
    error("demo-out-is-an-existing-file", lambda: demo("--out", a_file("existing-out"))(),
          r"--out .*existing-out is an existing file; give a directory"),
    error("demo-out-not-empty", lambda: demo("--out", str(Path(tiny_model()).parent))(),
          r"exists and is not empty; choose a fresh directory"),
    error("demo-out-under-a-file", lambda: demo("--out", a_file("out-parent") + "/run")(),
          r"--out .*out-parent/run cannot be written"),
    error("demo-out-on-a-filesystem-without-room-for-it", demo("--out", "/proc/zmrl-demo-out"),
          r"--out /proc/zmrl-demo-out cannot be written"),
    error("demo-updates-0", demo("--updates", "0"), r"--updates must be at least 1, got 0"),
    error("demo-updates-negative", demo("--updates", "-3"), r"--updates must be at least 1, got -3"),
    error("demo-lag-negative", demo("--lag", "-1"), r"--lag must be at least 0 \(0: synchronous\), got -1"),
    error("demo-seed-negative", demo("--seed", "-7"), r"--seed must be between 0 and 4294967295, got -7"),
    error("demo-unknown-algo", demo("--algo", "ppo"), r"argument --algo: invalid choice: 'ppo'"),
    error("demo-unknown-kernels", demo("--kernels", "fast"), r"argument --kernels: invalid choice: 'fast'"),
    error("demo-updates-not-an-int", demo("--updates", "many"), r"argument --updates: invalid int value: 'many'"),
    error("demo-turns-0", demo("--turns", "0"), r"--turns must be at least 1, got 0"),
    error("demo-turns-beyond-the-model", demo("--turns", "40"),
          r"--turns 40: a conversation reaches 1120 tokens, more than the demo model's 512 positions; "
          r"use at most 18 turns"),
    # ----- selfcheck -------------------------------------------------------------------------
    error("selfcheck-takes-no-arguments", lambda: refused(["selfcheck", "--model", "x"]), r"unrecognized arguments: --model x"),
    error("selfcheck-without-verl-entry-points", selfcheck_without_entry_points,
          r"verl's registries have no reinforce_zero, flash_reinforce: the plugin's verl\.plugins entry point was not "
          r"loaded; VERL_USE_EXTERNAL_PLUGINS=none is set"),
]
