"""Trainer backend for ``zmrl check --trainer megatron``: an aligned megatron-core GPTModel.

Answers the checker's three questions (see ``zero_mismatch_plugin.tools.checker.backends``) for a
packed batch, run as megatron's packed THD input. Intermediates are recorded at the op layer
(:mod:`.recording`), under the checker's canonical op names; ``qkv_proj`` is reported in vLLM's
``[q; k; v]`` column order. With ``--tensor-parallel N``, ``--expert-parallel N``,
``--pipeline-parallel N`` or ``--context-parallel N`` the model runs on N torchrun ranks
(:class:`DistributedMegatronBackend`), which answer the logprob questions and give ``zmrl bisect``
every rank's records (:mod:`.rank_records`).
"""

from __future__ import annotations

import torch

from zero_mismatch_plugin.aligned.sampling import SamplingTransform
from zero_mismatch_plugin.integrations.megatron.standalone import MegatronScorer, packed_logits, token_logprobs_from_logits
from zero_mismatch_plugin.tools.checker import oplist
from zero_mismatch_plugin.tools.checker.engine import EngineSettings
from zero_mismatch_plugin.tools.checker.recording import OpRecorder


def megatron_backend(settings: EngineSettings):
    """The one-process backend, or at the engine's tensor parallelism the ranks' backend."""
    if (settings.tensor_parallel, settings.sequence_parallel, settings.expert_parallel, settings.pipeline_parallel,
            settings.context_parallel) == (1, False, 1, 1, 1):
        return MegatronBackend(settings)
    return DistributedMegatronBackend(settings)


class DistributedMegatronBackend:
    """The Megatron face on torchrun ranks: ``settings.tensor_parallel`` of them (megatron-core's
    tensor parallelism, sequence parallelism if asked), each rank the engine rank of its index; or
    ``settings.expert_parallel`` (megatron's expert parallelism over as many data-parallel ranks,
    each scoring the whole batch, its experts' rows sent through megatron's token dispatcher); or
    ``settings.pipeline_parallel`` stages of megatron's pipeline schedule, the last sending the
    logprobs to the others; or ``settings.context_parallel`` ranks each holding megatron's chunks of
    every sequence. An adapter (``--lora``) runs at tensor parallelism with sequence parallelism,
    split over the ranks as vLLM splits it."""

    name = "megatron"

    def __init__(self, settings: EngineSettings):
        from zero_mismatch_plugin.integrations.megatron.distributed import Layout, RankModel
        from zero_mismatch_plugin.integrations.megatron.rank_group import RankGroup

        self.layout = Layout(settings.tensor_parallel, settings.sequence_parallel,
                             expert_model_parallel_size=settings.expert_parallel,
                             moe_token_dispatcher_type=settings.moe_token_dispatcher,
                             data_parallel_size=max(1, settings.expert_parallel // settings.tensor_parallel),
                             pipeline_model_parallel_size=settings.pipeline_parallel,
                             context_parallel_size=settings.context_parallel)
        self.spec = RankModel.of(settings.model_dir, settings.trainer_args, self.layout, settings.lora_dir)
        self.settings = settings
        self.group = RankGroup(self.layout)
        self.group.call("token_logprobs", self.spec, _empty_batch())  # build the model on every rank now
        self.blocks = settings.blocks
        self.qk_norm = self.blocks.qk_norm

    def token_logprobs(self, batch) -> torch.Tensor:
        return self.group.call("token_logprobs", self.spec, batch)

    def full_logprobs(self, batch) -> torch.Tensor:
        return SamplingTransform().logprobs(self.group.call("target_logits", self.spec, batch)).float()

    def intermediates(self, batch, perturb=None) -> dict:
        """The routers' expert choices, whole (the expert-selection check); ``zmrl bisect`` reads
        every op rank by rank through :meth:`rank_records`."""
        if perturb is not None:
            raise NotImplementedError(f"at layout {self.layout.name} a difference is planted on one rank: "
                                      "use rank_records with a rank_records.OneUlpOnRank")
        choices = self.group.call("expert_choices", self.spec, batch)
        return {oplist.topk_ids_of(f"layers.{index}.experts"): ids for index, ids in choices.items()}

    def rank_records(self, batch, order: list[str], planted=None) -> list:
        """Every rank's op records of ``batch`` with the rows it holds (:mod:`.rank_records`);
        ``planted``: a :class:`.rank_records.OneUlpOnRank`."""
        from zero_mismatch_plugin.tools.checker.rank_records import BISECT_AT_TENSOR_PARALLEL, RANK_CALL

        layout = self.layout
        model_parallel = (layout.tensor_model_parallel_size * layout.pipeline_model_parallel_size
                          * layout.context_parallel_size)
        if layout.tensor_model_parallel_size > 1 and layout.world_size > model_parallel:
            raise NotImplementedError(f"{BISECT_AT_TENSOR_PARALLEL} (asked: {layout.name})")
        at_tensor_parallel = self.settings if layout.tensor_model_parallel_size > 1 else None
        return self.group.call(RANK_CALL, self.spec, batch, order, planted, at_tensor_parallel)

    def close(self) -> None:
        self.group.close()


def _empty_batch():
    from zero_mismatch_plugin.aligned.packing import pack

    return pack([[0, 0]], [[0]])


class MegatronBackend:
    name = "megatron"

    def __init__(self, settings: EngineSettings):
        self.scorer = MegatronScorer.from_model_dir(settings.model_dir, **settings.trainer_args)
        self.model = self.scorer.model.eval()
        self.runtime = self.scorer.runtime
        if settings.lora_dir is not None:
            from zero_mismatch_plugin.faces.megatron.lora import attach_lora

            attach_lora(self.model, self.runtime, settings.lora_dir)
        self.lora_linears = oplist.lora_linears(settings.lora_targets)
        self.vocab_size = self.runtime.hf_config.vocab_size
        self.blocks = settings.blocks
        self.qk_norm = self.blocks.qk_norm

    @torch.no_grad()
    def token_logprobs(self, batch) -> torch.Tensor:
        return token_logprobs_from_logits(packed_logits(self.model, batch), batch).float()

    @torch.no_grad()
    def full_logprobs(self, batch) -> torch.Tensor:
        logits = packed_logits(self.model, batch)
        rows = logits.index_select(0, batch.target_rows.to(logits.device))
        return SamplingTransform().logprobs(rows).float()

    @torch.no_grad()
    def intermediates(self, batch, perturb=None) -> dict:
        """The model's forward with every op of the op layer recorded (the Megatron modules call
        the same ops as the aligned model, in vLLM's order; an MoE layer's router, experts with
        their choice, and shared expert too)."""
        order = oplist.op_names(
            self.runtime.hf_config.num_hidden_layers, self.qk_norm, self.blocks, lora=self.lora_linears
        )
        with OpRecorder(perturb) as recorder:
            with recorder.op_layer(order):
                logits = packed_logits(self.model, batch)
            recorder.keep_head(logits.index_select(0, batch.target_rows.to(logits.device)))
        return recorder.ops
