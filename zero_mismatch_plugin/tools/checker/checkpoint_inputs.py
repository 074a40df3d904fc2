"""The checkpoint and adapter directories ``zmrl check`` / ``zmrl bisect`` refuse before any work.

Everything that can be wrong with the files a run reads (``config.json``, the safetensors weights,
the tokenizer, the model as the chosen trainer face builds it, a ``--lora`` adapter) is refused
with a :class:`~.inputs.CheckerInputError` naming the file and the field or tensor, before any
engine, vLLM model or trainer is built. The list: docs/diagnostics.md, "Inputs the other commands refuse".
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

from zero_mismatch_plugin.tools.checker.inputs import CheckerInputError

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
# Names of ``dtype`` / ``torch_dtype`` transformers turns into a torch dtype (``getattr(torch, name)``).
# The checker runs engine and trainer in float32 whatever the checkpoint says.
KNOWN_DTYPES = ("float32", "bfloat16", "float16", "float64", "float", "half", "double")
# Files one of which a Hugging Face tokenizer directory holds.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json", "tiktoken.model")
# Tensors named per file when weights are not finite (the message counts the rest).
TENSORS_NAMED = 5

# config.json fields by the JSON type transformers' configs and vLLM read them as. Required ones
# must be present; the others may be absent or null.
_REQUIRED_POSITIVE_INTS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
_POSITIVE_INTS = (
    "intermediate_size", "num_key_value_heads", "head_dim", "max_position_embeddings", "num_experts_per_tok",
    "moe_intermediate_size", "num_local_experts", "n_routed_experts", "kv_lora_rank", "q_lora_rank",
    "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_group", "topk_group", "decoder_sparse_step",
    "moe_layer_freq",
)
_NON_NEGATIVE_INTS = ("num_experts", "shared_expert_intermediate_size", "n_shared_experts", "first_k_dense_replace")
_POSITIVE_NUMBERS = ("rms_norm_eps", "rope_theta", "routed_scaling_factor")
_BOOLS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "norm_topk_prob", "use_sliding_window",
          "use_qk_norm", "qkv_bias")
_STRINGS = ("model_type", "hidden_act", "topk_method", "scoring_func")
_OBJECTS = ("rope_parameters", "rope_scaling", "quantization_config")
# Inside rope_parameters / rope_scaling.
_ROPE_POSITIVE_NUMBERS = ("rope_theta", "factor", "partial_rotary_factor")


# ----- config.json ------------------------------------------------------------------------------


def read_checkpoint_config(model_dir) -> dict:
    """config.json of a checkpoint the checker can run: a directory with safetensors weights
    whose architecture the aligned forward supports and whose values have their types and are
    finite. Reads config.json and the weight files' headers only (see :func:`validate_checkpoint`
    for the rest)."""
    path = Path(model_dir)
    if not path.exists():
        raise CheckerInputError(f"--model {path}: no such directory (give a Hugging Face checkpoint directory)")
    if not path.is_dir():
        raise CheckerInputError(f"--model {path} is a file; give the checkpoint's directory")
    config_file = path / CONFIG_FILE
    if not config_file.is_file():
        raise CheckerInputError(f"--model {path} has no config.json: give a Hugging Face checkpoint directory")
    config = read_json_object(config_file)
    require_supported_architecture(config, config_file)
    problems = config_value_problems(config)
    if problems:
        raise CheckerInputError(f"{config_file}: " + "; ".join(problems))
    require_weights_match_config(config, config_file, weight_headers(path))
    return config


def read_json_object(file: Path, what: str = "") -> dict:
    """A JSON file that must hold one object (``what``: the role named in the message)."""
    try:
        value = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckerInputError(f"cannot read {file}{what}: {error}") from None
    if not isinstance(value, dict):
        raise CheckerInputError(f"{file}{what} is not a JSON object (it holds a {_json_type(value)})")
    return value


def supported_architectures() -> tuple[str, ...]:
    from zero_mismatch_plugin.tables.architectures import SUPPORTED_ARCHITECTURES

    return SUPPORTED_ARCHITECTURES


def require_supported_architecture(config: dict, config_file) -> str:
    supported = supported_architectures()
    architectures = config.get("architectures")
    if not isinstance(architectures, list) or not architectures or not isinstance(architectures[0], str):
        raise CheckerInputError(
            f"{config_file} names no architecture (\"architectures\": {architectures!r}); "
            f"supported: {', '.join(supported)}"
        )
    if architectures[0] not in supported:
        raise CheckerInputError(
            f"architecture {architectures[0]} ({config_file}) is not supported by the aligned forward; "
            f"supported: {', '.join(supported)}"
        )
    return architectures[0]


def _json_type(value) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return {str: "string", list: "list", dict: "object", type(None): "null"}.get(type(value), type(value).__name__)


def _got(value) -> str:
    return f"got {value!r} (a {_json_type(value)})"


def non_finite_fields(value, prefix: str = "") -> list[str]:
    """The dotted paths of every NaN / infinite number in a JSON value (``a.b``, ``a[2]``)."""
    if isinstance(value, float) and not math.isfinite(value):
        return [prefix or "(the value)"]
    if isinstance(value, dict):
        return [p for key, item in value.items() for p in non_finite_fields(item, f"{prefix}.{key}" if prefix else str(key))]
    if isinstance(value, list):
        return [p for i, item in enumerate(value) for p in non_finite_fields(item, f"{prefix}[{i}]")]
    return []


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def config_value_problems(config: dict) -> list[str]:
    """What in a config.json (as read from JSON) has the wrong type or is not finite, one
    sentence each naming the field and what to give instead."""
    problems = [f"\"{field}\" is {_json_number(config_at(config, field))}: give a finite number"
                for field in non_finite_fields(config)]
    for key in _REQUIRED_POSITIVE_INTS:
        if key not in config or config[key] is None:
            problems.append(f"\"{key}\" is missing: give the model's {key} as a positive integer")
    for key in _REQUIRED_POSITIVE_INTS + _POSITIVE_INTS:
        value = config.get(key)
        if value is not None and not (_is_int(value) and value > 0):
            problems.append(f"\"{key}\" must be a positive integer, {_got(value)}")
    for key in _NON_NEGATIVE_INTS:
        value = config.get(key)
        if value is not None and not (_is_int(value) and value >= 0):
            problems.append(f"\"{key}\" must be an integer >= 0, {_got(value)}")
    for key in _POSITIVE_NUMBERS:
        value = config.get(key)
        if value is not None and not (_is_number(value) and value > 0) and not _non_finite_number(value):
            problems.append(f"\"{key}\" must be a positive number, {_got(value)}")
    for key in _BOOLS:
        value = config.get(key)
        if value is not None and not isinstance(value, bool):
            problems.append(f"\"{key}\" must be true or false, {_got(value)}")
    for key in _STRINGS:
        value = config.get(key)
        if value is not None and not isinstance(value, str):
            problems.append(f"\"{key}\" must be a string, {_got(value)}")
    for key in _OBJECTS:
        value = config.get(key)
        if value is not None and not isinstance(value, dict):
            problems.append(f"\"{key}\" must be an object (or null), {_got(value)}")
        elif isinstance(value, dict):
            for inner in _ROPE_POSITIVE_NUMBERS if key != "quantization_config" else ():
                item = value.get(inner)
                if item is not None and not (_is_number(item) and item > 0) and not _non_finite_number(item):
                    problems.append(f"\"{key}.{inner}\" must be a positive number, {_got(item)}")
    layer_types = config.get("layer_types")
    if layer_types is not None and not (isinstance(layer_types, list) and all(isinstance(t, str) for t in layer_types)):
        problems.append(f"\"layer_types\" must be a list of strings (or null), {_got(layer_types)}")
    problems += dtype_problems(config)
    return problems


def _json_number(value: float) -> str:
    """NaN / Infinity / -Infinity as config.json spells them."""
    if math.isnan(value):
        return "NaN"
    return "Infinity" if value > 0 else "-Infinity"


def _non_finite_number(value) -> bool:
    # Already named by non_finite_fields.
    return isinstance(value, float) and not math.isfinite(value)


def config_at(config: dict, dotted: str):
    """The value at a path of :func:`non_finite_fields` (for the message)."""
    value = config
    for part in dotted.replace("[", ".[").split("."):
        if not part:
            continue
        value = value[int(part[1:-1])] if part.startswith("[") else value[part]
    return value


def dtype_problems(config: dict) -> list[str]:
    """``dtype`` / ``torch_dtype`` that transformers cannot turn into a torch dtype."""
    problems = []
    for key in ("dtype", "torch_dtype"):
        value = config.get(key)
        if value is None:
            continue
        if not isinstance(value, str) or value not in KNOWN_DTYPES:
            problems.append(
                f"\"{key}\": {value!r} is not a torch dtype name; use one of {', '.join(KNOWN_DTYPES[:3])} "
                "(the checker runs the model in float32 whatever the checkpoint states)"
            )
    return problems


# ----- the weights ------------------------------------------------------------------------------


def weight_files(model_dir) -> list[Path]:
    """The checkpoint's safetensors files, each with a readable header (:func:`safetensors_header`),
    and every shard its ``model.safetensors.index.json`` names."""
    return list(weight_headers(model_dir))


def weight_headers(model_dir) -> dict[Path, dict]:
    """{safetensors file: its tensor entries} (see :func:`weight_files`)."""
    path = Path(model_dir)
    index = path / INDEX_FILE
    if index.exists():
        _require_index_shards(path, index)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckerInputError(f"--model {path} holds no weights: no *.safetensors file next to config.json")
    headers = {}
    for file in files:
        if not file.is_file():
            raise CheckerInputError(f"{file} is not a file (a directory?): give the weights as safetensors files")
        headers[file] = safetensors_header(file)
    return headers


_EMBEDDING = "model.embed_tokens.weight"
_LAYER_PREFIX = "model.layers."


def require_weights_match_config(config: dict, config_file, headers: dict[Path, dict]) -> None:
    """The weights are the config's model: the embedding is [vocab_size, hidden_size] and every
    decoder layer the config counts has weights (read from the headers: nothing is loaded). A
    config.json of another model would otherwise fail inside the engine's or trainer's loader."""
    problems = []
    for file, tensors in headers.items():
        entry = tensors.get(_EMBEDDING)
        shape = entry.get("shape") if isinstance(entry, dict) else None
        expected = [config.get("vocab_size"), config.get("hidden_size")]
        if isinstance(shape, list) and shape != expected:
            problems.append(f"{file.name} holds {_EMBEDDING} of shape {shape}, config.json's vocab_size and "
                            f"hidden_size say {expected}")
    layers = {int(name[len(_LAYER_PREFIX):].split(".", 1)[0]) for tensors in headers.values() for name in tensors
              if name.startswith(_LAYER_PREFIX) and name[len(_LAYER_PREFIX):].split(".", 1)[0].isdigit()}
    missing = sorted(set(range(config["num_hidden_layers"])) - layers) if layers else []
    if missing:
        problems.append(f"num_hidden_layers is {config['num_hidden_layers']} but the weights hold no decoder "
                        f"layer {', '.join(map(str, missing[:TENSORS_NAMED]))}"
                        + (f" (and {len(missing) - TENSORS_NAMED} more)" if len(missing) > TENSORS_NAMED else ""))
    if problems:
        raise CheckerInputError(f"{config_file} does not describe the weights next to it: " + "; ".join(problems)
                                + ": give the checkpoint's own config.json")


def _require_index_shards(model_dir: Path, index: Path) -> None:
    data = read_json_object(index, " (the sharded checkpoint's index)")
    weight_map = data.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckerInputError(
            f"{index}: \"weight_map\" must map every tensor name to its shard file, {_got(weight_map)}"
        )
    missing = sorted({shard for shard in weight_map.values() if not (model_dir / shard).is_file()})
    if missing:
        raise CheckerInputError(
            f"{index} names shards that are not in {model_dir}: {', '.join(missing[:TENSORS_NAMED])}"
            + (f" and {len(missing) - TENSORS_NAMED} more" if len(missing) > TENSORS_NAMED else "")
            + ": copy every shard of the checkpoint (or remove the index of a single-file checkpoint)"
        )


def safetensors_header(file: Path) -> dict:
    """The tensor entries of a safetensors file's header ({name: {dtype, shape, data_offsets}}),
    refused when the file cannot be one: shorter than the 8-byte header length, a header length
    beyond the file, a header that is not a JSON object, tensor bytes beyond the end (truncated).
    Reads the header only, then lets safetensors open the file (what both loaders do)."""
    where = f"{file}: not a readable safetensors file"
    try:
        size = file.stat().st_size
        with open(file, "rb") as handle:
            length_bytes = handle.read(8)
            if size < 8 or len(length_bytes) < 8:
                raise CheckerInputError(f"{where} (it is {size} bytes, empty or truncated: a safetensors "
                                        "file starts with an 8-byte header length)")
            length = int.from_bytes(length_bytes, "little")
            if length == 0 or 8 + length > size:
                raise CheckerInputError(f"{where} (its header length says {length} bytes, the file has "
                                        f"{size - 8} after it: truncated, or not a safetensors file)")
            raw = handle.read(length)
    except OSError as error:
        raise CheckerInputError(f"{where} ({error.strerror or error})") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise CheckerInputError(f"{where} (its header is not JSON: garbage, or another format)") from None
    if not isinstance(header, dict):
        raise CheckerInputError(f"{where} (its header is a JSON {_json_type(header)}, not an object)")
    tensors = {name: entry for name, entry in header.items() if name != "__metadata__"}
    data_size = size - 8 - length
    offsets = [entry.get("data_offsets") for entry in tensors.values() if isinstance(entry, dict)]
    end = max((o[1] for o in offsets if isinstance(o, list) and len(o) == 2 and _is_int(o[1])), default=0)
    if end > data_size:
        raise CheckerInputError(f"{where} (its tensors need {end} bytes of data, the file holds {data_size}: "
                                "truncated; copy it again)")
    try:
        from safetensors import safe_open

        with safe_open(str(file), framework="pt") as handle:
            handle.keys()
    except Exception as error:  # noqa: BLE001 - safetensors' own error type (SafetensorError) and others
        raise CheckerInputError(f"{where} ({type(error).__name__}: {error})") from None
    if not tensors:
        raise CheckerInputError(f"{file} holds no tensors: give the checkpoint's weights")
    return tensors


def non_finite_tensors(file: Path) -> list[tuple[str, int, int]]:
    """(name, non-finite values, values) of every floating-point tensor of a safetensors file that
    holds a NaN or an infinity.

    Cost: reads every tensor of the file once (memory-mapped, one tensor in memory at a time,
    plus a boolean mask of its size): for a checkpoint as long as one read of its weights from
    disk, which the engine and the trainer then read again. Cheap for the tiny and local
    checkpoints the checker runs on CPU; minutes for tens of gigabytes on a slow disk."""
    import torch
    from safetensors import safe_open

    found = []
    try:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                tensor = handle.get_tensor(name)
                if not tensor.is_floating_point():
                    continue
                bad = int((~torch.isfinite(tensor)).sum().item())
                if bad:
                    found.append((name, bad, tensor.numel()))
    except Exception as error:  # noqa: BLE001 - a tensor safetensors cannot read is an unreadable file
        raise CheckerInputError(f"{file}: not a readable safetensors file ({type(error).__name__}: {error})") from None
    return found


def require_finite_weights(files, what: str = "the weights", instead: str = "a checkpoint") -> None:
    """Refuse files whose tensors hold NaN or infinities, naming them (cost: see
    :func:`non_finite_tensors`)."""
    for file in files:
        found = non_finite_tensors(Path(file))
        if found:
            named = ", ".join(f"{name} ({bad} of {numel})" for name, bad, numel in found[:TENSORS_NAMED])
            more = f" and {len(found) - TENSORS_NAMED} more tensors" if len(found) > TENSORS_NAMED else ""
            raise CheckerInputError(
                f"{file}: non-finite values (NaN or infinity) in {what}: {named}{more}; "
                f"a forward through them has nothing to compare: use {instead} without them"
            )


# ----- the tokenizer ----------------------------------------------------------------------------


@functools.lru_cache(maxsize=4)
def _tokenizer(model_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def load_tokenizer(model_dir):
    """The checkpoint's tokenizer (loaded once per directory), refused clearly when it has none or
    it cannot be loaded: the engine loads the same tokenizer when it starts."""
    path = Path(model_dir)
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise CheckerInputError(
            f"--model {path} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}): copy the model's "
            "tokenizer files next to config.json"
        )
    try:
        return _tokenizer(str(path))
    except Exception as error:  # noqa: BLE001 - transformers raises many types for a broken tokenizer
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise CheckerInputError(
            f"--model {path}: its tokenizer cannot be loaded ({type(error).__name__}: {first_line}); "
            "copy the model's own tokenizer files next to config.json"
        ) from None


# ----- the whole checkpoint, and the model the trainer face builds --------------------------------


def validate_checkpoint(model_dir, trainer: str | None = "aligned") -> dict:
    """Every check of this module on a checkpoint directory, cheapest first: what
    :func:`read_checkpoint_config` checks, the model as the ``trainer`` face builds it
    (:func:`precheck_model`; None: not checked), the tokenizer, and every weight finite (which
    reads every weight once: see :func:`non_finite_tensors`). Returns config.json. ``zmrl check``
    and ``bisect`` run the same steps with their option checks between them."""
    config = read_checkpoint_config(model_dir)
    if trainer is not None:
        precheck_model(model_dir, trainer)
    load_tokenizer(model_dir)
    require_finite_weights(weight_files(model_dir))
    return config


def precheck_model(model_dir, trainer: str = "aligned"):
    """The checkpoint's :class:`~zero_mismatch_plugin.tables.architectures.Blocks` as the ``trainer``
    face ("aligned", "megatron" or "hf") would build it, refused with a
    :class:`~.inputs.CheckerInputError` naming every setting it does not cover and what to
    change, before anything is built (:func:`zero_mismatch_plugin.faces.precheck`).
    Run it after :func:`read_checkpoint_config` (config.json is then known to be well typed)."""
    from zero_mismatch_plugin.faces import precheck

    config_file = Path(model_dir) / CONFIG_FILE
    config = transformers_config(model_dir)
    try:
        return precheck(config, face=trainer)
    except NotImplementedError as why:
        hint = ""
        if trainer == "megatron" and _covered(config, "aligned"):
            hint = ". --trainer aligned runs this model"
        raise CheckerInputError(f"--model {model_dir} (--trainer {trainer}): {why}{hint}") from None
    except (ValueError, AttributeError, TypeError, KeyError) as error:
        raise CheckerInputError(f"{config_file} cannot describe the model ({type(error).__name__}: {error})") from None


def _covered(config, face: str) -> bool:
    from zero_mismatch_plugin.faces import precheck

    try:
        precheck(config, face=face)
    except Exception:  # noqa: BLE001 - only whether it is covered
        return False
    return True


def transformers_config(model_dir):
    """The checkpoint's transformers config (what the engine and every face read), refused when
    transformers rejects config.json."""
    from zero_mismatch_plugin.aligned.checkpoint import read_config

    try:
        return read_config(model_dir)
    except Exception as error:  # noqa: BLE001 - transformers' validation errors have many types
        text = " ".join(str(error).split())
        raise CheckerInputError(
            f"{Path(model_dir) / CONFIG_FILE} is not a config transformers can read ({type(error).__name__}: "
            f"{text[:300]})"
        ) from None


# ----- a PEFT adapter ---------------------------------------------------------------------------


def validate_adapter(adapter_dir) -> dict:
    """A PEFT adapter directory (``--lora``): ``adapter_config.json`` a JSON object the adapter
    reader can read (:func:`zero_mismatch_plugin.aligned.lora.peft.malformed_lora_settings`: types,
    finite numbers), ``adapter_model.safetensors`` a readable safetensors file with finite tensors
    (adapters are small: every tensor is read, see :func:`non_finite_tensors`). Whether the
    engine serves it on this model is :func:`..engine.served_adapter`'s check. Returns the config."""
    from zero_mismatch_plugin.aligned.lora.peft import CONFIG_FILE as ADAPTER_CONFIG
    from zero_mismatch_plugin.aligned.lora.peft import WEIGHTS_FILE as ADAPTER_WEIGHTS
    from zero_mismatch_plugin.aligned.lora.peft import malformed_lora_settings

    path = Path(adapter_dir)
    if not path.is_dir():
        raise CheckerInputError(
            f"--lora {path}: {'no such directory' if not path.exists() else 'a file'}; give the PEFT adapter's "
            f"directory ({ADAPTER_CONFIG} and {ADAPTER_WEIGHTS})"
        )
    config_file, weights = path / ADAPTER_CONFIG, path / ADAPTER_WEIGHTS
    for file in (config_file, weights):
        if not file.is_file():
            raise CheckerInputError(f"--lora {path} has no {file.name}: a PEFT adapter directory holds "
                                    f"{ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}")
    config = read_json_object(config_file)
    problems = malformed_lora_settings(config)
    if problems:
        raise CheckerInputError(f"{config_file}: " + "; ".join(problems))
    safetensors_header(weights)
    require_finite_weights([weights], "the adapter", "an adapter")
    return config
