"""Broken checkpoint and adapter files given to ``zmrl check`` / ``zmrl bisect``.

Every case must be refused before any work, naming the file and the field or tensor: config
values that are not finite or not of their JSON type, a dtype torch does not know, weights that
are truncated, empty, garbage, not finite or missing from a sharded index, a missing or broken
tokenizer, and the same for a PEFT adapter (``--lora``). As in ``cases_cli``, starting an engine,
vLLM's model or a trainer raises while a case runs (and would be counted as a traceback).
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

from support.bad_input import error
from support.bad_input.cases_cli import _workdir, jsonl, model_with, refused, tiny_config, tiny_model

NAN, INF = float("nan"), float("inf")


# ----- checkpoints ------------------------------------------------------------------------------


def _copy(name: str, source) -> Path:
    path = _workdir() / name
    if path.exists():
        shutil.rmtree(path)
    shutil.copytree(source, path)
    return path


def with_config(command, name, changes, *args, drop=()):
    """``zmrl command`` on a copy of the tiny Llama whose config.json has ``changes`` (NaN and
    infinities are written as Python's JSON writer does: ``NaN``, ``Infinity``)."""

    def run():
        config = {k: v for k, v in {**tiny_config(), **changes}.items() if k not in drop}
        return refused([command, "--model", model_with(name, config), *args])

    return run


def with_file(command, name, file, content, *args):
    """``zmrl command`` on a copy of the tiny Llama with ``file`` replaced by ``content`` (bytes or
    text; None removes it; a callable gets the checkpoint's directory and makes the change)."""

    def run():
        path = _copy(name, tiny_model())
        target = path / file
        if callable(content):
            content(path)
        elif content is None:
            target.unlink()
        elif isinstance(content, bytes):
            target.write_bytes(content)
        else:
            target.write_text(content)
        return refused([command, "--model", str(path), *args])

    return run


def _weights() -> bytes:
    return (Path(tiny_model()) / "model.safetensors").read_bytes()


def _planted(value: float, name: str = "model.layers.1.mlp.down_proj.weight"):
    """A change of the checkpoint: one value of one weight set to ``value``."""

    def plant(path: Path):
        from safetensors.torch import load_file, save_file

        file = path / "model.safetensors"
        state = load_file(str(file))
        state[name].view(-1)[7] = value
        save_file(state, str(file), metadata={"format": "pt"})

    return plant


def _header(header: bytes, data: bytes = b"") -> bytes:
    return len(header).to_bytes(8, "little") + header + data


def _as_directory(path: Path):
    (path / "model.safetensors").unlink()
    (path / "model.safetensors").mkdir()


def _sharded(weight_map_shards=("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")):
    """The tiny checkpoint as shard 1 of 2, its index naming a second shard that is not there."""

    def shard(path: Path):
        (path / "model.safetensors").rename(path / weight_map_shards[0])
        index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": weight_map_shards[0],
                                                "lm_head.weight": weight_map_shards[1]}}
        (path / "model.safetensors.index.json").write_text(json.dumps(index))

    return shard


def _without_tokenizer(path: Path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (path / name).unlink()


def _token_ids() -> str:
    return jsonl("token-ids.jsonl", {"prompt_token_ids": [5, 6, 7, 8]})


# ----- adapters ---------------------------------------------------------------------------------


@functools.cache
def tiny_adapter() -> str:
    """A real rank-8 PEFT adapter on every linear of the tiny Llama (built once)."""
    from zero_mismatch_plugin.aligned.lora.adapter import build_adapter

    return str(build_adapter(_workdir() / "adapter", tiny_model(), r=8, lora_alpha=16, seed=3))


def with_adapter(command, name, config_changes=None, *args, config_text=None, weights=None):
    """``zmrl command --lora`` with a copy of the tiny adapter: adapter_config.json with
    ``config_changes`` (or replaced by ``config_text``), adapter_model.safetensors replaced by
    ``weights`` (bytes; None removes it; a callable changes the directory)."""

    def run():
        path = _copy(name, tiny_adapter())
        if config_changes is not None:
            config = {**json.loads((path / "adapter_config.json").read_text()), **config_changes}
            (path / "adapter_config.json").write_text(json.dumps(config))
        if config_text is not None:
            (path / "adapter_config.json").write_text(config_text)
        if callable(weights):
            weights(path)
        elif weights is not None:
            (path / "adapter_model.safetensors").write_bytes(weights)
        return refused([command, "--model", tiny_model(), "--lora", str(path), *args])

    return run


def _adapter_weights() -> bytes:
    return (Path(tiny_adapter()) / "adapter_model.safetensors").read_bytes()


def _adapter_planted(value: float):
    def plant(path: Path):
        from safetensors.torch import load_file, save_file

        file = path / "adapter_model.safetensors"
        state = load_file(str(file))
        name = sorted(state)[3]
        state[name].view(-1)[0] = value
        save_file(state, str(file))

    return plant


def _no_adapter_weights(path: Path):
    (path / "adapter_model.safetensors").unlink()


UNREADABLE = r"model\.safetensors: not a readable safetensors file"

CASES = [
    # ----- config.json: values that are not finite ---------------------------------------------
    error("check-config-nan-norm-epsilon", with_config("check", "nan-eps", {"rms_norm_eps": NAN}),
          r"nan-eps/config\.json: \"rms_norm_eps\" is NaN: give a finite number"),
    error("bisect-config-nan-norm-epsilon", with_config("bisect", "nan-eps", {"rms_norm_eps": NAN}),
          r"nan-eps/config\.json: \"rms_norm_eps\" is NaN"),
    error("check-config-infinite-rope-theta",
          with_config("check", "inf-theta", {"rope_parameters": {"rope_type": "default", "rope_theta": INF}}),
          r"inf-theta/config\.json: \"rope_parameters\.rope_theta\" is Infinity: give a finite number"),
    error("bisect-config-nan-positions", with_config("bisect", "nan-positions", {"max_position_embeddings": NAN}),
          r"\"max_position_embeddings\" is NaN"),
    # ----- config.json: values of the wrong JSON type, out of range, missing --------------------
    error("check-config-vocab-size-a-string", with_config("check", "vocab-string", {"vocab_size": "512"}),
          r"vocab-string/config\.json: \"vocab_size\" must be a positive integer, got '512' \(a string\)"),
    error("bisect-config-hidden-size-a-boolean", with_config("bisect", "hidden-bool", {"hidden_size": True}),
          r"\"hidden_size\" must be a positive integer, got True \(a boolean\)"),
    error("check-config-layers-a-fraction", with_config("check", "layers-float", {"num_hidden_layers": 2.5}),
          r"\"num_hidden_layers\" must be a positive integer, got 2\.5"),
    error("check-config-without-vocab-size", with_config("check", "no-vocab", {}, drop=("vocab_size",)),
          r"no-vocab/config\.json: \"vocab_size\" is missing: give the model's vocab_size"),
    error("check-config-negative-norm-epsilon", with_config("check", "negative-eps", {"rms_norm_eps": -1e-6}),
          r"\"rms_norm_eps\" must be a positive number, got -1e-06"),
    error("bisect-config-tie-a-string", with_config("bisect", "tie-string", {"tie_word_embeddings": "false"}),
          r"\"tie_word_embeddings\" must be true or false, got 'false' \(a string\)"),
    error("check-config-rope-parameters-a-list", with_config("check", "rope-list", {"rope_parameters": [10000.0]}),
          r"\"rope_parameters\" must be an object \(or null\), got \[10000\.0\] \(a list\)"),
    error("check-config-unknown-dtype", with_config("check", "dtype-unknown", {"dtype": "float33"}),
          r"dtype-unknown/config\.json: \"dtype\": 'float33' is not a torch dtype name; use one of float32"),
    error("bisect-config-unknown-torch-dtype",
          with_config("bisect", "torch-dtype-unknown", {"torch_dtype": "fp8"}, drop=("dtype",)),
          r"\"torch_dtype\": 'fp8' is not a torch dtype name"),
    error("check-config-dtype-a-number", with_config("check", "dtype-number", {"dtype": 16}),
          r"\"dtype\": 16 is not a torch dtype name"),
    error("check-config-transformers-rejects",
          with_config("check", "cwm-three-types", {"architectures": ["CwmForCausalLM"], "model_type": "cwm",
                                                   "sliding_window": 12,
                                                   "layer_types": ["sliding_attention", "full_attention", "full_attention"]}),
          r"cwm-three-types/config\.json is not a config transformers can read .*number of `layer_types` \(3\)"),
    # ----- the weights ---------------------------------------------------------------------------
    error("check-config-of-another-vocabulary", with_config("check", "vocab-1024", {"vocab_size": 1024}),
          r"vocab-1024/config\.json does not describe the weights next to it: model\.safetensors holds "
          r"model\.embed_tokens\.weight of shape \[512, 256\], config\.json's vocab_size and hidden_size say \[1024, 256\]"),
    error("bisect-config-with-more-layers-than-the-weights", with_config("bisect", "layers-4", {"num_hidden_layers": 4}),
          r"layers-4/config\.json does not describe the weights next to it: num_hidden_layers is 4 but the weights "
          r"hold no decoder layer 2, 3"),
    error("check-weights-with-nan", with_file("check", "weights-nan", "model.safetensors", _planted(NAN)),
          r"weights-nan/model\.safetensors: non-finite values \(NaN or infinity\) in the weights: "
          r"model\.layers\.1\.mlp\.down_proj\.weight \(1 of 131072\)"),
    error("bisect-weights-with-infinity", with_file("bisect", "weights-inf", "model.safetensors", _planted(-INF, "lm_head.weight")),
          r"weights-inf/model\.safetensors: non-finite values .* lm_head\.weight \(1 of 131072\)"),
    error("check-weights-truncated",
          with_file("check", "weights-truncated", "model.safetensors", lambda p: (p / "model.safetensors").write_bytes(
              _weights()[: len(_weights()) // 2])),
          UNREADABLE + r" \(its tensors need \d+ bytes of data, the file holds \d+: truncated"),
    error("bisect-weights-truncated-in-the-header",
          with_file("bisect", "weights-header-cut", "model.safetensors", lambda p: (p / "model.safetensors").write_bytes(
              _weights()[:100])),
          UNREADABLE + r" \(its header length says \d+ bytes, the file has 92 after it"),
    error("check-weights-empty", with_file("check", "weights-empty", "model.safetensors", b""),
          UNREADABLE + r" \(it is 0 bytes, empty or truncated"),
    error("bisect-weights-garbage", with_file("bisect", "weights-garbage", "model.safetensors", b"PK\x03\x04 not weights" * 40),
          UNREADABLE),
    error("check-weights-header-not-json", with_file("check", "weights-bad-header", "model.safetensors",
                                                     _header(b"\xff\xfe not json at all")),
          UNREADABLE + r" \(its header is not JSON"),
    error("check-weights-header-a-list", with_file("check", "weights-list-header", "model.safetensors", _header(b"[1, 2]  ")),
          UNREADABLE + r" \(its header is a JSON list, not an object\)"),
    error("bisect-weights-without-tensors", with_file("bisect", "weights-none", "model.safetensors", _header(b"{}      ")),
          r"weights-none/model\.safetensors holds no tensors"),
    error("check-weights-a-directory", with_file("check", "weights-directory", "model.safetensors", _as_directory),
          r"weights-directory/model\.safetensors is not a file \(a directory\?\)"),
    error("check-sharded-index-names-a-missing-shard", with_file("check", "shard-missing", "model.safetensors", _sharded()),
          r"shard-missing/model\.safetensors\.index\.json names shards that are not in .*: "
          r"model-00002-of-00002\.safetensors: copy every shard"),
    error("bisect-sharded-index-not-an-object",
          with_file("bisect", "index-list", "model.safetensors.index.json", "[\"model.safetensors\"]"),
          r"index-list/model\.safetensors\.index\.json \(the sharded checkpoint's index\) is not a JSON object"),
    error("check-sharded-index-without-weight-map",
          with_file("check", "index-no-map", "model.safetensors.index.json", json.dumps({"weight_map": ["a"]})),
          r"index-no-map/model\.safetensors\.index\.json: \"weight_map\" must map every tensor name to its shard"),
    # ----- the tokenizer -------------------------------------------------------------------------
    error("check-without-tokenizer", with_file("check", "no-tokenizer", "tokenizer.json", _without_tokenizer),
          r"--model .*no-tokenizer has no tokenizer \(none of tokenizer\.json"),
    error("bisect-without-tokenizer-token-id-prompts",
          lambda: with_file("bisect", "no-tokenizer-ids", "tokenizer.json", _without_tokenizer, "--prompts", _token_ids())(),
          r"no-tokenizer-ids has no tokenizer"),
    error("check-tokenizer-garbage", with_file("check", "tokenizer-garbage", "tokenizer.json", "{\"version\": 3, garbage"),
          r"--model .*tokenizer-garbage: its tokenizer cannot be loaded"),
    # ----- a PEFT adapter (--lora) ---------------------------------------------------------------
    error("check-lora-at-tensor-parallel-without-sequence-parallel",
          with_adapter("check", "adapter-tp2", None, "--trainer", "megatron", "--tensor-parallel", "2"),
          r"--lora with --trainer megatron: LoRA at tensor parallelism 2 runs with sequence parallelism: .*turn "
          r"sequence parallelism on \(flags --tensor-parallel N --sequence-parallel\)"),
    error("check-adapter-config-a-list", with_adapter("check", "adapter-list", config_text="[\"q_proj\"]"),
          r"adapter-list/adapter_config\.json is not a JSON object \(it holds a list\)"),
    error("check-adapter-config-not-json", with_adapter("check", "adapter-not-json", config_text="{r: 8"),
          r"cannot read .*adapter-not-json/adapter_config\.json: Expecting property name"),
    error("bisect-adapter-alpha-a-string", with_adapter("bisect", "adapter-alpha-string", {"lora_alpha": "16"}),
          r"adapter-alpha-string/adapter_config\.json: lora_alpha='16': must be a number"),
    error("check-adapter-alpha-nan", with_adapter("check", "adapter-alpha-nan", {"lora_alpha": NAN}),
          r"adapter-alpha-nan/adapter_config\.json: lora_alpha=nan: give a finite number"),
    error("check-adapter-targets-a-number", with_adapter("check", "adapter-targets-number", {"target_modules": 5}),
          r"target_modules=5: give module names, a list of strings"),
    error("check-adapter-rslora-a-string", with_adapter("check", "adapter-rslora-string", {"use_rslora": "yes"}),
          r"use_rslora='yes': must be true or false"),
    error("check-adapter-weights-missing", with_adapter("check", "adapter-no-weights", weights=_no_adapter_weights),
          r"--lora .*adapter-no-weights has no adapter_model\.safetensors"),
    error("check-adapter-weights-truncated",
          with_adapter("check", "adapter-truncated", weights=lambda p: (p / "adapter_model.safetensors").write_bytes(
              _adapter_weights()[:-1000])),
          r"adapter-truncated/adapter_model\.safetensors: not a readable safetensors file \(its tensors need"),
    error("bisect-adapter-weights-empty", with_adapter("bisect", "adapter-empty", weights=b""),
          r"adapter-empty/adapter_model\.safetensors: not a readable safetensors file \(it is 0 bytes"),
    error("check-adapter-weights-garbage", with_adapter("check", "adapter-garbage", weights=_header(b"\x00\x01garbage")),
          r"adapter-garbage/adapter_model\.safetensors: not a readable safetensors file"),
    error("check-adapter-weights-with-nan", with_adapter("check", "adapter-nan", weights=_adapter_planted(NAN)),
          r"adapter-nan/adapter_model\.safetensors: non-finite values \(NaN or infinity\) in the adapter: "
          r"base_model\.model\.model\.layers\.0\.\S+ \(1 of \d+\); .*use an adapter without them"),
    error("bisect-adapter-weights-with-infinity", with_adapter("bisect", "adapter-inf", weights=_adapter_planted(INF)),
          r"adapter-inf/adapter_model\.safetensors: non-finite values"),
]
