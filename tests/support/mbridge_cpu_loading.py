"""Build, load and export a tiny checkpoint through mbridge on a CPU-only torch, two one-thread ranks over
gloo (tests/fork_patches/test_cpu_training_patches.py::test_mbridge_loads_and_exports_local_modules_without_the_runtime_patches).

``python mbridge_cpu_loading.py patched DIR OUT MOE DENSE``: what DIR holds (copies of mbridge and
megatron-core with the fork patches applied) first on the path, none of the plugin imported.

Each rank builds the MoE checkpoint MOE with its experts over both ranks, then the dense checkpoint
DENSE at two pipeline stages, as verl's Megatron engine does (``AutoBridge.from_config``, megatron's
local modules, ``get_model``, ``load_weights``), exports the weights (``export_weights``: the stages'
and the experts' gathers) and compares them with the checkpoint's tensors. It writes what it saw to
OUT/rank{r}.json or its traceback to OUT/rank{r}.error.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from forked_ranks import bits_digest, start_ranks


def checkpoint_tensors(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors = {}
    for shard in sorted(Path(path).glob("*.safetensors")):
        tensors.update(load_file(shard))
    return tensors


def built_and_exported(checkpoint: str, **layout) -> dict:
    """The checkpoint through mbridge at ``layout``: which exported tensors equal the checkpoint's."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.enums import AttnBackend
    from transformers import AutoConfig

    from mbridge import AutoBridge

    parallel_state.initialize_model_parallel(**layout)
    model_parallel_cuda_manual_seed(0)
    try:
        hf_config = AutoConfig.from_pretrained(checkpoint)
        # transformers 5 keeps it in rope_parameters; verl's import of mbridge patches mbridge to read it there.
        hf_config.rope_theta = hf_config.rope_parameters["rope_theta"]
        bridge = AutoBridge.from_config(hf_config, dtype=torch.float32)
        bridge.set_extra_args(attention_backend=AttnBackend.local, use_cpu_initialization=True,
                              persist_layer_norm=False, bias_activation_fusion=False, bias_dropout_fusion=False,
                              masked_softmax_fusion=False, gradient_accumulation_fusion=False, moe_grouped_gemm=False)
        models = bridge.get_model(wrap_with_ddp=False, fp16=False, bf16=False)
        bridge.load_weights(models, checkpoint)
        expected = checkpoint_tensors(checkpoint)
        exported = dict(bridge.export_weights(models))
        return dict(exported=len(exported), checkpoint=len(expected),
                    equal=sum(name in expected and torch.equal(exported[name], expected[name]) for name in exported),
                    digest=bits_digest(sorted(exported.items())))
    finally:
        parallel_state.destroy_model_parallel()


def round_trips(mode: str, world: int, out: str, moe: str, dense: str) -> dict:
    """This rank's builds and exports (its process group started): what it saw."""
    seen = {"mbridge": __import__("mbridge").__file__, "megatron": __import__("megatron.core").core.__file__}
    seen["experts"] = built_and_exported(moe, expert_model_parallel_size=world)
    seen["pipeline"] = built_and_exported(dense, pipeline_model_parallel_size=world)
    return seen


def main(mode: str, patched: str, out: str, moe: str, dense: str, world: int = 2) -> None:
    if mode == "patched":
        sys.path.insert(0, patched)
    start_ranks(round_trips, world, mode, out, moe, dense)


if __name__ == "__main__":
    main(*sys.argv[1:6])
