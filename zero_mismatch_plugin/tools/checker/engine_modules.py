"""vLLM's own model, built outside the engine and run teacher-forced with every op recorded.

The engine side of a bisection: vLLM's model under the engine's ``VllmConfig``, with what the
model runner normally provides supplied here; forward hooks record each op under the names of
:mod:`.oplist`. See docs/alignment-playbook.md (``zmrl bisect``).
"""

from __future__ import annotations

import contextlib

import torch

from zero_mismatch_plugin.tables import upstream_versions
from zero_mismatch_plugin.tools.checker import oplist
from zero_mismatch_plugin.tools.checker.engine import EngineSettings
from zero_mismatch_plugin.tools.checker.recording import OpRecorder, first_of_pair

# vLLM versions whose ``MoERunner`` hands (shared output, routed output) through
# ``_maybe_apply_routed_scale_to_output`` before adding them.
ROUTED_OUTPUT_VERSIONS = upstream_versions.VLLM

# vLLM module attribute -> canonical op name (per decoder layer). Linear layers return
# (output, bias); norms of the residual stream return (normalised, residual sum).
_LAYER_MODULES = (
    ("input_layernorm", "input_norm"),
    ("self_attn.qkv_proj", "qkv_proj"),
    ("self_attn.q_norm", "q_norm"),
    ("self_attn.k_norm", "k_norm"),
    ("self_attn.rotary_emb", "rotary"),
    ("self_attn.attn", "attn"),
    ("self_attn.o_proj", "o_proj"),
    ("post_attention_layernorm", "post_attention_norm"),
    ("mlp.gate_up_proj", "gate_up_proj"),
    ("mlp.act_fn", "act"),
    ("mlp.down_proj", "down_proj"),
    # A linear-attention layer's projections: gated delta-net under ``linear_attn``, KDA under
    # ``self_attn`` (its o_proj is above).
    ("linear_attn.in_proj_qkvz", "in_proj_qkvz"),
    ("linear_attn.in_proj_ba", "in_proj_ba"),
    ("linear_attn.out_proj", "out_proj"),
    ("self_attn.in_proj_qkvgfab", "in_proj"),
    ("self_attn.g_a_proj", "g_a_proj"),
    ("self_attn.g_b_proj", "g_b_proj"),
    ("self_attn.f_b_proj", "f_b_proj"),
)

# The linear layers among them: vLLM names every linear layer ``*_proj*``.
_LINEARS = {kind for attr, kind in _LAYER_MODULES if "_proj" in attr.rsplit(".", 1)[-1]}
# A linear-attention layer's output projection reads its token mixer's output ("mixer"): (reader,
# the module only such a layer has) for a gated delta-net layer and a KDA layer.
_MIXER_READERS = (("linear_attn.out_proj", "linear_attn"), ("self_attn.o_proj", "self_attn.in_proj_qkvgfab"))
_NORMS = {"input_norm", "post_attention_norm"}

# An MoE block's modules (relative to the block: ``mlp`` or Mixtral's ``block_sparse_moe``) ->
# canonical name. The shared expert is ``shared_expert`` (Qwen2-MoE) or ``shared_experts`` (GLM-4.5).
_MOE_BLOCKS = ("mlp", "block_sparse_moe")
_MOE_MODULES = (
    ("gate", "router"),
    ("shared_expert.gate_up_proj", "shared_expert.gate_up_proj"),
    ("shared_expert.act_fn", "shared_expert.act"),
    ("shared_expert.down_proj", "shared_expert.down_proj"),
    ("shared_experts.gate_up_proj", "shared_expert.gate_up_proj"),
    ("shared_experts.act_fn", "shared_expert.act"),
    ("shared_experts.down_proj", "shared_expert.down_proj"),
    ("shared_expert_gate", "shared_expert_gate"),
)
_MOE_PAIRS = {"router", "shared_expert.gate_up_proj", "shared_expert.down_proj", "shared_expert_gate"}
# The shared expert's linears, LoRA layers of vLLM's when the engine serves adapters.
_LORA_SHARED_LINEARS = {"shared_expert.gate_up_proj", "shared_expert.down_proj"}


def _submodule(module, dotted: str):
    for part in dotted.split("."):
        module = getattr(module, part, None)
        if module is None:
            return None
    return module


@contextlib.contextmanager
def _stdout_with_fileno():
    """vLLM silences stdout around group creation through its file descriptor; where
    ``sys.stdout`` has none (notebooks, captured output), use the process's real stdout."""
    import sys

    try:
        sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        saved = sys.stdout
        sys.stdout = sys.__stdout__
        try:
            yield
        finally:
            sys.stdout = saved
        return
    yield


@contextlib.contextmanager
def single_process_group(runtime):
    """A world of one (gloo) and tensor/pipeline parallel groups of one, torn down afterwards.

    Torn down so that an engine started later in this process does not inherit them. A world
    this process already had (a megatron-core trainer's) is used and left in place: destroying it
    would leave that trainer without its process group.
    """
    import torch.distributed as dist
    from vllm.distributed import parallel_state as ps
    from vllm.utils.network_utils import get_distributed_init_method, get_open_port

    created = False
    owns_world = not dist.is_initialized()
    if not ps.model_parallel_is_initialized():
        with runtime.context(), _stdout_with_fileno():
            init = get_distributed_init_method("127.0.0.1", get_open_port())
            ps.init_distributed_environment(1, 0, init, 0, "gloo")
            ps.ensure_model_parallel_initialized(1, 1)
        created = True
    try:
        yield
    finally:
        if created:
            ps.destroy_model_parallel()
            if owns_world:
                ps.destroy_distributed_environment()


@contextlib.contextmanager
def tensor_parallel_ranks(runtime):
    """On torchrun ranks: vLLM's world over them and tensor-parallel groups of ``runtime``'s size
    (consecutive ranks, as megatron's tensor-parallel groups are; with pipeline stages or
    context-parallel ranks, one group per stage or chunk set), as each engine worker has them, so that vLLM's model is built as the engine rank of
    this index builds it (its shards, its all-reduces). The model-parallel groups are torn down
    afterwards; vLLM's world (over the ranks' own) is kept for the next call.
    """
    import os

    import torch.distributed as dist
    from vllm.distributed import parallel_state as ps

    if not dist.is_initialized():
        raise RuntimeError("vLLM's modules at tensor parallelism are built on torchrun ranks (no process group here)")
    size, rank = dist.get_world_size(), dist.get_rank()
    # The CPU communicator's shared-memory all-reduce names its segment after this (an engine
    # worker sets it from its init method); one name per rank group.
    os.environ.setdefault("VLLM_DIST_IDENT", f"zmrl-ranks-{os.environ.get('MASTER_PORT', os.getppid())}")
    with runtime.context(), _stdout_with_fileno():
        ps.init_distributed_environment(size, rank, "env://", int(os.environ.get("LOCAL_RANK", rank)), "gloo")
        # The ranks beyond one group are vLLM's "external data parallel" replicas of the engine.
        ps.ensure_model_parallel_initialized(runtime.vllm_config.parallel_config.tensor_parallel_size, 1)
    try:
        yield
    finally:
        ps.destroy_model_parallel()


class EngineModules:
    """vLLM's model for one checkpoint, outside the engine. Use as a context manager."""

    def __init__(self, settings: EngineSettings, on_ranks: bool = False):
        """Built from the run's ``settings``; their adapter (``lora_dir``), if any, is served as the
        engine does (``enable_lora``, vLLM's LoRA manager wrapping the linears, every token mapped
        to the adapter). ``on_ranks``: built on torchrun ranks as the engine's tensor-parallel
        ranks (``settings.tensor_parallel`` of them, :func:`tensor_parallel_ranks`); a row-parallel
        linear's output is then recorded before its all-reduce (this rank's partial, what the
        trainer's rank computes)."""
        from zero_mismatch_plugin.aligned.runtime import VllmRuntime

        self.lora_dir = settings.lora_dir
        self.lora_linears = oplist.lora_linears(settings.lora_targets, settings.blocks)
        self.blocks = settings.blocks
        self.on_ranks = on_ranks
        parallel = {"tensor_parallel_size": settings.tensor_parallel} if on_ranks else {}
        self.runtime = VllmRuntime(settings.model_dir, **settings.trainer_args, **parallel)
        self.model = None
        self.lora_manager = None
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> "EngineModules":
        try:
            groups = tensor_parallel_ranks if self.on_ranks else single_process_group
            self._stack.enter_context(groups(self.runtime))
            self._load()
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc):
        self.model = None
        self._stack.close()

    def _load(self):
        from vllm.model_executor.layers.attention import Attention
        from vllm.model_executor.model_loader import get_model

        from zero_mismatch_plugin.aligned.attention_backend import BackendPagedAttention

        from vllm.model_executor.layers.mamba.gdn.base import GatedDeltaNetAttention

        rt = self.runtime
        if rt.platform == "cpu":
            # What every vLLM CPU worker imports: CPU stand-ins for torch.cuda's streams and events,
            # which some models create and use (Kimi Linear's aux stream).
            import vllm.v1.worker.cpu.shm  # noqa: F401
        with rt.context():
            self.model = get_model(vllm_config=rt.vllm_config)
            if self.lora_dir is not None:
                self._load_lora()
        self.attention_layers = {
            m.layer_name: m for m in self.model.modules() if isinstance(m, Attention)
        }
        # Linear-attention layers (gated delta-net, KDA) read their states from the cache slots
        # the metadata name: each forward gives every sequence a fresh slot (:func:`_prefill_states`).
        self.linear_layers = {m.prefix: m for m in self.model.modules() if isinstance(m, GatedDeltaNetAttention)}
        self.num_layers = rt.hf_config.num_hidden_layers
        self.qk_norm = _submodule(self.model.model.layers[0], "self_attn.q_norm") is not None
        self.paged = None
        if not self.attention_layers:
            if not self.linear_layers:
                raise NotImplementedError("no vLLM Attention or linear-attention layer found in the model")
            return
        first = next(iter(self.attention_layers.values()))
        # A paged-attention helper of the same shape supplies the backend's metadata builder and
        # slot mapping; the metadata depend on the sequence layout only, not on the layer.
        self.paged = BackendPagedAttention(
            rt, first.num_heads, first.num_kv_heads, first.head_size, first.impl.scale
        )
        # The backend's builder also configures the layers it is built for (the CPU backend
        # stores its ISA choice on each layer): build one for the model's own layers.
        with rt.context():
            self.paged.builder = self.paged.backend.get_builder_cls()(
                self.paged.spec, list(self.attention_layers), rt.vllm_config, rt.device
            )

    def _load_lora(self):
        """What the engine's model runner does with ``enable_lora``: vLLM's LoRA manager replaces
        the supported linears with their LoRA layers; the adapter is loaded when activated."""
        from vllm.v1.worker.lora_model_runner_mixin import LoRAModelRunnerMixin

        from zero_mismatch_plugin.aligned.lora.peft import lora_request

        runner = LoRAModelRunnerMixin()
        self.model = runner.load_lora_model(self.model, self.runtime.vllm_config, self.runtime.device)
        self.lora_manager = runner.lora_manager
        self.lora_request = lora_request("bisect", 1, self.lora_dir)

    def _activate_lora(self, num_tokens: int, num_rows: int) -> None:
        """Every token and every scored row served by the adapter (one request's mapping)."""
        from vllm.lora.layers import LoRAMapping

        mapping = LoRAMapping((1,) * num_tokens, (1,) * num_rows, is_prefill=True)
        self.lora_manager.set_active_adapters({self.lora_request}, mapping)

    def op_names(self) -> list[str]:
        return oplist.op_names(self.num_layers, self.qk_norm, self.blocks, lora=self.lora_linears)

    def _attach(self, recorder: OpRecorder) -> None:
        """Hooks on vLLM's modules recording every op into ``recorder``.

        vLLM shares some module instances between layers (``get_rope`` caches one rotary
        embedding per shape): such a module is hooked once and its output is named after the
        decoder layer running.
        """
        model = self.model.model
        recorder.on_output(model.embed_tokens, oplist.EMBED)
        recorder.track_layers(model.layers)
        hooked = set()
        for layer in model.layers:
            for attr, kind in _LAYER_MODULES:
                module = _submodule(layer, attr)
                if module is None or id(module) in hooked:
                    continue
                hooked.add(id(module))
                if kind in _LINEARS and hasattr(module, "punica_wrapper"):
                    recorder.on_lora_linear(module, kind)
                elif kind in _LINEARS:
                    recorder.on_output(module, kind, split=first_of_pair)
                    _reduce_after_recording(recorder, module)
                elif kind in _NORMS:
                    recorder.on_fused_norm(module, kind)
                else:
                    recorder.on_output(module, kind)
            for reader, marker in _MIXER_READERS:
                if _submodule(layer, marker) is not None:
                    recorder.on_input(_submodule(layer, reader), "mixer")
            self._attach_moe(recorder, layer)
        recorder.on_fused_norm(model.norm, oplist.FINAL_NORM)
        if self.blocks.final_add_then_norm:  # the model returns the sum; compute_logits norms the scored rows
            recorder.on_output(model, oplist.FINAL_NORM + ".input")

    @staticmethod
    def _attach_moe(recorder: OpRecorder, layer) -> None:
        """An MoE layer's router logits (the gate linear), the experts its router chose (vLLM's
        capture callback) and its shared expert's ops; the routed output is recorded by
        :func:`_recording_routed_output`."""
        from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

        block = next((b for b in (_submodule(layer, n) for n in _MOE_BLOCKS) if b is not None), None)
        runner = getattr(block, "experts", None)
        # With enable_lora, vLLM's LoRA manager wraps the layer (``FusedMoEWithLoRA``) around it.
        runner = getattr(runner, "base_layer", runner)
        if not isinstance(runner, MoERunner):
            return
        for attr, kind in _MOE_MODULES:
            module = _submodule(block, attr)
            if module is None:
                continue
            if kind in _LORA_SHARED_LINEARS and hasattr(module, "punica_wrapper"):
                recorder.on_lora_linear(module, kind)
                continue
            # A LoRA layer the adapter does not target (the router, the shared expert's gate) may
            # be run as the wrapper or through another reference to its base (vLLM's MoE runner
            # calls its own ``gate``): both are hooked, one of them runs.
            for hooked in dict.fromkeys((module, getattr(module, "base_layer", module))):
                recorder.on_output(hooked, kind, split=first_of_pair if kind in _MOE_PAIRS else None)
        router = runner.router
        previous = router.capture_fn
        router.set_capture_fn(recorder.capture(oplist.TOPK_IDS))
        recorder.on_exit(lambda: router.set_capture_fn(previous))

    @torch.no_grad()
    def forward(self, batch, record: dict | None = None) -> torch.Tensor:
        """Full-vocabulary logprobs [R, V] at the batch's target rows; ops into ``record``."""
        from vllm.forward_context import set_forward_context
        from zero_mismatch_plugin.aligned.sampling import vllm_logprobs, vllm_scaled_logits

        from zero_mismatch_plugin.aligned.attention_backend import _scratch_cache

        rt = self.runtime
        device = rt.device
        metadata, slot_mapping = {}, {}
        if self.paged is not None:
            plan = self.paged.metadata(batch.seq_lens)
            for name, layer in self.attention_layers.items():
                layer.kv_cache = _scratch_cache(
                    self.paged.backend,
                    plan.num_blocks,
                    layer.num_kv_heads,
                    self.paged.block_size,
                    layer.head_size,
                    rt.dtype,
                    device,
                )
                metadata[name], slot_mapping[name] = plan.meta, plan.slot_mapping
        if self.linear_layers:
            prefill = _prefill_metadata(batch.seq_lens)
            for prefix, layer in self.linear_layers.items():
                layer.kv_cache = _prefill_states(layer, len(batch.seq_lens))
                metadata[prefix] = prefill
        if self.lora_manager is not None:
            self._activate_lora(batch.num_tokens, int(batch.target_rows.numel()))
        with OpRecorder() as recorder, _recording_routed_output(recorder if record is not None else None):
            if record is not None:
                self._attach(recorder)
            try:
                with rt.context(), set_forward_context(
                    metadata,
                    rt.vllm_config,
                    num_tokens=batch.num_tokens,
                    slot_mapping=slot_mapping,
                ):
                    hidden = self.model(batch.input_ids.to(device), batch.positions.to(device))
                    logits = self.model.compute_logits(hidden.index_select(0, batch.target_rows.to(device)))
            finally:
                for layer in (*self.attention_layers.values(), *self.linear_layers.values()):
                    layer.kv_cache = torch.tensor([])
        logits = logits[:, : rt.hf_config.vocab_size]
        if record is None:
            return vllm_logprobs(vllm_scaled_logits(logits))
        recorder.keep_head(logits)
        record.update(recorder.ops)
        return recorder.ops[oplist.LOGPROBS]



def _prefill_metadata(seq_lens):
    """vLLM's linear-attention metadata of one step prefilling every sequence from its start, each
    in its own state slot (1, 2, ...; slot 0 is the engine's null block)."""
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

    lens = torch.tensor(list(seq_lens), dtype=torch.int32)
    starts = torch.cat([torch.zeros(1, dtype=torch.int32), lens.cumsum(0, dtype=torch.int32)])
    return GDNAttentionMetadata(
        num_prefills=len(lens), num_prefill_tokens=int(lens.sum()), num_decodes=0, num_decode_tokens=0,
        num_spec_decodes=0, num_spec_decode_tokens=0, num_actual_tokens=int(lens.sum()),
        has_initial_state=torch.zeros(len(lens), dtype=torch.bool), non_spec_query_start_loc=starts,
        non_spec_state_indices_tensor=torch.arange(1, len(lens) + 1, dtype=torch.int32),
    )


def _prefill_states(layer, num_seqs: int):
    """Zeroed conv and recurrent states of a linear-attention layer for ``num_seqs`` sequences
    (and the null slot), in the shapes and dtypes the layer asks the engine for."""
    return tuple(torch.zeros(num_seqs + 1, *shape, dtype=dtype)
                 for shape, dtype in zip(layer.get_state_shape(), layer.get_state_dtype()))


def _reduce_after_recording(recorder: OpRecorder, linear) -> None:
    """A row-parallel linear at tensor parallelism: its all-reduce moved behind the recording hook
    (registered before this one, so run before it), so that what is recorded is this rank's partial
    output, as the trainer's rank computes it; the reduce itself is still vLLM's."""
    from vllm.distributed import tensor_model_parallel_all_reduce

    if not getattr(linear, "reduce_results", False) or getattr(linear, "tp_size", 1) == 1:
        return
    linear.reduce_results = False

    def reduce(module, args, output):
        return tensor_model_parallel_all_reduce(output[0]), *output[1:]

    handle = linear.register_forward_hook(reduce)
    recorder.on_exit(handle.remove)
    recorder.on_exit(lambda: setattr(linear, "reduce_results", True))


@contextlib.contextmanager
def _recording_routed_output(recorder: OpRecorder | None):
    """vLLM's MoE layer adds its shared expert's output to the routed experts' inside one module:
    a runtime patch of the step between (the routed scaling) records the routed output alone as
    ``experts``, what the trainer's MoE op returns. Nothing is patched without a recorder."""
    if recorder is None:
        yield
        return
    from zero_mismatch_plugin.integrations import patches as runtime_patches

    def build(original):
        def scaled_outputs(self, shared_output, fused_output):
            shared_output, fused_output = original(self, shared_output, fused_output)
            return shared_output, recorder.keep(recorder.name("experts"), fused_output)

        return scaled_outputs

    patch = runtime_patches.patch_at(
        "vllm.model_executor.layers.fused_moe.runner.moe_runner:MoERunner._maybe_apply_routed_scale_to_output",
        build,
        name="bisect-record-moe-routed-output",
        package="vllm",
        versions=ROUTED_OUTPUT_VERSIONS,
        why="zmrl bisect records the routed experts' output of vLLM's MoE layer, which no module returns",
    )
    runtime_patches.apply(patch)
    try:
        yield
    finally:
        runtime_patches.remove(patch)
