"""The edits of the mbridge fork patch that lets mbridge build, load and export megatron-core's local
(non-Transformer-Engine) models on a CPU: the fork form of the runtime patches in
``integrations/verl/cpu/mcore_engine.py`` ("verl Megatron engine on the CPU platform (mbridge
backend)" in ``zmrl patches list``). The name mappings and the loader are the plugin's own
functions, inserted verbatim and applied as decorators of the methods the runtime form wraps.
"""

from __future__ import annotations

from zero_mismatch_plugin.fork_patches.edits.edit import Edit, functions_before
from zero_mismatch_plugin.integrations.verl.cpu.mcore_engine import (
    _LOCAL_EXPERT,
    _load_own_local_experts,
    _without_local_experts,
    grouped_expert_name,
    local_experts_as_grouped,
    local_experts_loaded_by_their_rank,
    local_norm_names_as_fused,
    transformer_engine_name,
)

BRIDGE = "mbridge/core/bridge.py"
LLM_BRIDGE = "mbridge/core/llm_bridge.py"
UTIL = "mbridge/core/util.py"


def _decorated(path: str, definition: str, decorator) -> Edit:
    """The method whose ``def`` line is ``definition`` decorated with the plugin's ``decorator``."""
    return Edit(path, old=definition, new=f"    @{decorator.__name__}\n{definition}")


MBRIDGE_LOCAL_MODULES_ON_CPU = [
    # Without CUDA there is no Transformer Engine: megatron's local modules.
    Edit(LLM_BRIDGE, old="use_transformer_engine=True, **extra_args",
         new="use_transformer_engine=torch.cuda.is_available(), **extra_args"),
    # Local modules' names: their own norms, and experts as modules (local_experts.3.linear_fc1).
    Edit(BRIDGE, old="import os\n", new="import os\nimport re\n"),
    Edit(BRIDGE, old="from abc import ABC\n", new="from abc import ABC\nfrom functools import partial\n"),
    Edit(BRIDGE, old="\n\nclass Bridge(ABC):\n", new=(
        "\n\n# A parameter of megatron's local experts (Transformer Engine's grouped GEMM numbers its weights).\n"
        f"_LOCAL_EXPERT = re.compile({_LOCAL_EXPERT.pattern!r})\n\n\nclass Bridge(ABC):\n")),
    functions_before(BRIDGE, "class Bridge(ABC):\n", transformer_engine_name, local_norm_names_as_fused,
                     grouped_expert_name, local_experts_as_grouped, local_experts_loaded_by_their_rank,
                     _without_local_experts, _load_own_local_experts),
    _decorated(BRIDGE, "    def _weight_name_mapping_mcore_to_hf(self, mcore_weights_name: str) -> list[str]:\n",
               local_norm_names_as_fused),
    _decorated(BRIDGE, "    def _weight_name_mapping_mcore_local_to_global(\n", local_experts_as_grouped),
    _decorated(BRIDGE, "    def load_weights(\n", local_experts_loaded_by_their_rank),
    # The model stays on the host, and a pipeline stage receives a weight there.
    Edit(UTIL, old="""\
        for model_module in model:
            model_module.cuda(torch.cuda.current_device())
""", new="""\
        for model_module in model:
            if torch.cuda.is_available():  # on a CPU the chunks stay where they were built
                model_module.cuda(torch.cuda.current_device())
"""),
    Edit(UTIL, old="device=torch.cuda.current_device(),",
         new='device=torch.cuda.current_device() if torch.cuda.is_available() else "cpu",'),
]

# Patch name (as in manifest.yaml) -> its edits.
EDITS: dict[str, list[Edit]] = {
    "mbridge-local-modules-on-cpu": MBRIDGE_LOCAL_MODULES_ON_CPU,
}
