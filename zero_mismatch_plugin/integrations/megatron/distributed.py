"""The Megatron face on megatron-core's own parallelism: what each rank runs.

A :class:`Layout` names megatron's parallel sizes and the engine arguments of the rollout it is
bitwise with; the functions in :data:`RANK_CALLS` run on every rank of a
:class:`.rank_group.RankGroup` (torchrun), each rank building the engine rank's part of the
model. :func:`.rank_group.launch` scores prompt+response pairs at some layouts on one group. Collectives run
over gloo on CPU with a timeout, so a rank that dies makes the others fail instead of waiting.
"""

from __future__ import annotations

import dataclasses
import os
from datetime import timedelta

import torch

# Seconds a collective waits for a rank before it fails (torch.distributed's default is 30 min).
COLLECTIVE_TIMEOUT_S = 30.0


DISPATCHERS = ("alltoall", "allgather")


@dataclasses.dataclass(frozen=True)
class Layout:
    """A megatron-core parallel layout (megatron's names). The world is ``tensor_model_parallel_size
    * pipeline_model_parallel_size * context_parallel_size * data_parallel_size`` ranks; the expert-parallel ranks are drawn
    from them as megatron draws them (expert tensor parallelism 1), so ``expert_model_parallel_size``
    must divide the world."""

    tensor_model_parallel_size: int = 1
    sequence_parallel: bool = False
    expert_model_parallel_size: int = 1
    moe_token_dispatcher_type: str = "alltoall"
    data_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1
    # Model chunks per pipeline rank (megatron's interleaved schedule); with pipeline parallelism.
    virtual_pipeline_model_parallel_size: int = 1

    def __post_init__(self):
        if self.virtual_pipeline_model_parallel_size > 1 and self.pipeline_model_parallel_size == 1:
            raise ValueError(f"virtual_pipeline_model_parallel_size={self.virtual_pipeline_model_parallel_size}: virtual "
                             "stages split each pipeline stage's layers; set pipeline_model_parallel_size > 1")
        if self.moe_token_dispatcher_type not in DISPATCHERS:
            raise ValueError(f"moe_token_dispatcher_type={self.moe_token_dispatcher_type!r}: use one of {DISPATCHERS}")
        if self.world_size % self.expert_model_parallel_size:
            raise ValueError(f"expert_model_parallel_size={self.expert_model_parallel_size} does not divide the "
                             f"{self.world_size} ranks (tensor x data parallel) of layout {self.name}")

    @property
    def world_size(self) -> int:
        return (self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size
                * self.data_parallel_size)

    @property
    def expert_tensor_parallel_size(self) -> int:
        """Each expert split over the tensor-parallel ranks as the engine splits it, or whole on
        its expert-parallel rank (which then computes the engine ranks' shards one by one)."""
        return 1 if self.expert_model_parallel_size > 1 else self.tensor_model_parallel_size

    @property
    def name(self) -> str:
        name = f"tp{self.tensor_model_parallel_size}" + ("-sp" if self.sequence_parallel else "")
        if self.expert_model_parallel_size > 1:
            name += f"-ep{self.expert_model_parallel_size}-{self.moe_token_dispatcher_type}"
        if self.pipeline_model_parallel_size > 1:
            name += f"-pp{self.pipeline_model_parallel_size}"
        if self.virtual_pipeline_model_parallel_size > 1:
            name += f"-vp{self.virtual_pipeline_model_parallel_size}"
        if self.context_parallel_size > 1:
            name += f"-cp{self.context_parallel_size}"
        if self.data_parallel_size > 1:
            name += f"-dp{self.data_parallel_size}"
        return name

    def engine_kwargs(self) -> dict:
        """The engine arguments of the rollout this layout is bitwise with: the engine's tensor
        parallelism is the trainer's; its experts all live in one process (the combine is the
        one-process kernel's, whatever the trainer's expert parallelism)."""
        return {"tensor_parallel_size": self.tensor_model_parallel_size}

    def config_overrides(self) -> dict:
        overrides = {"tensor_model_parallel_size": self.tensor_model_parallel_size,
                     "sequence_parallel": self.sequence_parallel,
                     "pipeline_model_parallel_size": self.pipeline_model_parallel_size,
                     "context_parallel_size": self.context_parallel_size}
        if self.virtual_pipeline_model_parallel_size > 1:
            overrides["virtual_pipeline_model_parallel_size"] = self.virtual_pipeline_model_parallel_size
        if self.expert_model_parallel_size > 1:
            overrides.update(expert_model_parallel_size=self.expert_model_parallel_size,
                             expert_tensor_parallel_size=self.expert_tensor_parallel_size,
                             moe_token_dispatcher_type=self.moe_token_dispatcher_type)
        return overrides


def init_ranks(layout: Layout, timeout_s: float = COLLECTIVE_TIMEOUT_S) -> None:
    """The process group (torchrun's environment) and megatron's model-parallel state."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != layout.world_size:
        raise ValueError(f"layout {layout.name} needs {layout.world_size} ranks, torchrun started {world}")
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
    use_layout(layout)


def use_layout(layout: Layout) -> None:
    """megatron's model-parallel state at ``layout`` (set up again if another layout of the same
    world set it: one rank group serves every layout of its size)."""
    from megatron.core import parallel_state

    virtual = layout.virtual_pipeline_model_parallel_size
    wanted = (layout.tensor_model_parallel_size, layout.expert_model_parallel_size, layout.pipeline_model_parallel_size,
              layout.context_parallel_size, layout.expert_tensor_parallel_size, virtual if virtual > 1 else None)
    if parallel_state.model_parallel_is_initialized():
        current = (parallel_state.get_tensor_model_parallel_world_size(),
                   parallel_state.get_expert_model_parallel_world_size(),
                   parallel_state.get_pipeline_model_parallel_world_size(),
                   parallel_state.get_context_parallel_world_size(),
                   parallel_state.get_expert_tensor_parallel_world_size(),
                   parallel_state.get_virtual_pipeline_model_parallel_world_size())
        if current == wanted:
            return
        _drop_layout()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=wanted[0], expert_model_parallel_size=wanted[1],
                                             pipeline_model_parallel_size=wanted[2], context_parallel_size=wanted[3],
                                             expert_tensor_parallel_size=wanted[4],
                                             virtual_pipeline_model_parallel_size=wanted[5])


def _drop_layout() -> None:
    """Tear down the current layout: megatron's model-parallel state, the process groups it holds
    and the models built on them. megatron's own teardown forgets most groups without destroying
    them, and every gloo group keeps a thread that polls its sockets every 10 ms: a rank group
    serving many layouts spent a third of a core per rank idling after eighteen switches."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    held = {id(group): group for value in vars(parallel_state).values()
            for group in (value if isinstance(value, (list, tuple)) else (value,))
            if isinstance(group, dist.ProcessGroup) and group is not dist.GroupMember.WORLD}
    parallel_state.destroy_model_parallel()
    _BUILT.clear()  # their layers keep the groups they were built with
    for group in held.values():
        try:
            dist.destroy_process_group(group)
        except ValueError:  # already destroyed by destroy_model_parallel (its gloo copies of some groups)
            pass


@dataclasses.dataclass(frozen=True)
class TrainStep:
    """One step after scoring: the loss ``sum(c_t * logprob_t)`` (``c`` drawn from
    ``coefficient_seed``), megatron's DDP and ``finalize_model_grads``, then SGD at ``lr``."""

    coefficient_seed: int = 0
    lr: float = 1e-3


@dataclasses.dataclass(frozen=True)
class RankModel:
    """The aligned model of one checkpoint at one layout, as the ranks build it: engine arguments
    of the rollout (the layout adds its own, e.g. ``tensor_parallel_size``) as sorted items, and
    the PEFT adapter in ``lora_dir`` if any (the engine arguments then serve LoRA)."""

    model_dir: str
    engine_items: tuple
    layout: Layout
    lora_dir: str | None = None

    @classmethod
    def of(cls, model_dir, engine_kwargs: dict, layout: Layout, lora_dir=None) -> "RankModel":
        return cls(str(model_dir), tuple(sorted(engine_kwargs.items())), layout,
                   None if lora_dir is None else str(lora_dir))


@dataclasses.dataclass
class ScoreRequest:
    """Prompt+response pairs of one checkpoint to score, with the engine arguments of their rollout,
    and optionally a step to take."""

    model_dir: str
    engine_kwargs: dict
    prompts: list
    responses: list
    step: TrainStep | None = None
    lora_dir: str | None = None  # a PEFT adapter the rollout served (engine_kwargs serve LoRA)


def step_coefficients(step: TrainStep, num_tokens: int) -> torch.Tensor:
    return torch.randn(num_tokens, generator=torch.Generator().manual_seed(step.coefficient_seed))


def data_parallel_share(num_sequences: int, ranks: int, rank: int) -> range:
    """The sequences data-parallel rank ``rank`` of ``ranks`` scores: a contiguous share, the
    first ``num_sequences % ranks`` ranks one more (every rank at least one)."""
    if num_sequences < ranks:
        raise ValueError(f"{num_sequences} sequences cannot give each of {ranks} data-parallel ranks one")
    per, extra = divmod(num_sequences, ranks)
    start = rank * per + min(rank, extra)
    return range(start, start + per + (rank < extra))


def share_tokens(responses: list, share: range) -> slice:
    """Where the response tokens of the sequences ``share`` lie among all sequences' tokens."""
    first = sum(len(r) for r in responses[: share.start])
    return slice(first, first + sum(len(responses[i]) for i in share))


class _RankRun:
    """This rank's part of a :class:`RankModel`: the aligned model of the engine rank's layout."""

    def __init__(self, spec: RankModel):
        from zero_mismatch_plugin.aligned.runtime import VllmRuntime
        from zero_mismatch_plugin.integrations.megatron.standalone import build_gpt_model

        layout = spec.layout
        use_layout(layout)
        # The engine's arguments, its dtype among them (float32 unless the run names another).
        self.runtime = VllmRuntime(spec.model_dir, **{**dict(spec.engine_items), **layout.engine_kwargs()})
        # With virtual pipeline stages this rank's model chunks (megatron's interleaved schedule
        # runs them); self.model is then the first, whose config every chunk shares.
        virtual = layout.virtual_pipeline_model_parallel_size
        self.chunks = [build_gpt_model(self.runtime, aligned=True, vp_stage=v if virtual > 1 else None,
                                       **layout.config_overrides()).eval() for v in range(virtual)]
        self.model = self.chunks[0]
        if spec.lora_dir is not None:  # each model chunk its layers' (and ends') adapters
            from zero_mismatch_plugin.faces.megatron.lora import attach_lora

            for chunk in self.chunks:
                attach_lora(chunk, self.runtime, spec.lora_dir)
        self.adapted = spec.lora_dir is not None
        self.layout = layout
        self.pipelined = layout.pipeline_model_parallel_size > 1
        self.multiple = layout.tensor_model_parallel_size if layout.sequence_parallel else 1
        # megatron's all-gather dispatcher gathers equal token counts from the expert-parallel ranks.
        self.equal_tokens = layout.expert_model_parallel_size > 1 and layout.moe_token_dispatcher_type == "allgather"

    def _min_tokens(self, batch) -> int:
        from megatron.core import parallel_state

        if not self.equal_tokens:
            return 0
        count = torch.tensor([batch.num_tokens])
        torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MAX,
                                     group=parallel_state.get_expert_model_parallel_group())
        return int(count)

    def logits(self, batch, model=None) -> torch.Tensor:
        from zero_mismatch_plugin.integrations.megatron.standalone import packed_logits

        if self.pipelined:
            raise ValueError(f"layout {self.layout.name}: the logits stay on the last pipeline stage; use outputs()")
        return packed_logits(model or self.model, batch, self.multiple, self._min_tokens(batch))

    def outputs(self, batch, model=None, coefficients=None) -> dict:
        """``{"logprobs", "target_logits"}`` of ``batch`` on every rank (under pipeline parallelism
        computed on the last stage and sent to the others); with ``coefficients`` the backward of
        ``sum(coefficients * logprobs)`` runs too (in megatron's schedule under pipeline parallelism)."""
        from zero_mismatch_plugin.faces.megatron import pipeline
        from zero_mismatch_plugin.integrations.megatron.standalone import (
            pipelined_outputs,
            token_logprobs_from_logits,
        )

        model = model or _as_run(self.chunks)
        if self.pipelined:
            out = pipelined_outputs(model, batch, self.multiple, self._min_tokens(batch), coefficients)
            return pipeline.from_last_stage(out, self.model.config)
        logits = self.logits(batch, model)
        values = token_logprobs_from_logits(logits, batch)
        if coefficients is not None:
            (values * coefficients).sum().backward()
        return {"logprobs": values, "target_logits": logits.index_select(0, batch.target_rows.to(logits.device))}

    def logprobs(self, batch, model=None) -> torch.Tensor:
        return self.outputs(batch, model)["logprobs"]

    def step(self, batch, step: TrainStep, coefficients: torch.Tensor) -> dict:
        """Gradients of ``sum(coefficients * logprobs)`` over every data-parallel rank's tokens
        (full, checkpoint names; with an adapter its A and B only, PEFT names), this rank's
        logprobs after the step, and the full weights (with an adapter: the adapter's)."""
        from megatron.core import parallel_state
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads

        from zero_mismatch_plugin.faces.megatron import convert
        from zero_mismatch_plugin.integrations.megatron.standalone import cpu_stock_megatron

        hf = self.runtime.hf_config
        with cpu_stock_megatron():
            ddps = [DistributedDataParallel(chunk.config, DistributedDataParallelConfig(), chunk) for chunk in self.chunks]
            for ddp in ddps:
                ddp.train()
            self.outputs(batch, _as_run(ddps), coefficients)
            # megatron's own reductions: data-parallel grads (scaled by 1 / data-parallel size), and
            # over tensor-parallel ranks the norms that see only this rank's tokens (SP) or heads.
            finalize_model_grads(ddps)
        # DDP averages over the data- and context-parallel ranks; each context-parallel rank's
        # gradients are its own rows' share of the sum.
        ranks = parallel_state.get_data_parallel_world_size(with_context_parallel=True)
        # an adapter's A and B only; with virtual stages one list per model chunk
        trained = [[(n, p) for n, p in chunk.named_parameters() if p.requires_grad] for chunk in self.chunks]
        local_grads = [{n: p.main_grad * ranks for n, p in chunk} for chunk in trained]
        if self.adapted:
            from zero_mismatch_plugin.faces.megatron.lora import adapter_state, full_adapter_tensors

            grads = full_adapter_tensors(_as_run(self.chunks), _as_run(local_grads))
        else:
            grads = convert.megatron_to_hf(convert.full_tensors(_as_run(self.chunks), _as_run(local_grads)), hf)
        # The step takes the gradient it reports (the sum over every rank's tokens, as one process
        # takes it), not DDP's mean over the data- and context-parallel ranks.
        with torch.no_grad():
            for _, p in (pair for chunk in trained for pair in chunk):
                p.add_(p.main_grad * ranks, alpha=-step.lr)
        for ddp in ddps:
            ddp.eval()
        with torch.no_grad():
            after = self.logprobs(batch, _as_run(ddps))
        # The weights the engine loads after the step: the whole adapter (PEFT names), or the model.
        if self.adapted:
            weights = adapter_state(_as_run(self.chunks))
        else:
            weights = convert.engine_weights(_as_run(self.chunks), hf, self.runtime.dtype)
        return dict(grads=grads, logprobs_after=batch.split_per_sequence(after.cpu()), weights=weights)


def _as_run(chunks: list):
    """A rank's model as its forward takes it: the one model, or with virtual pipeline stages the
    list of model chunks (megatron's interleaved schedule runs them)."""
    return chunks if len(chunks) > 1 else chunks[0]


# The models a rank has built at the current layout, for calls that only read them (a step builds
# its own).
_BUILT: dict[RankModel, _RankRun] = {}


def built_model(spec: RankModel) -> _RankRun:
    """This rank's model of ``spec``, built on first use and kept for calls that only read it."""
    use_layout(spec.layout)  # another layout of this world may have set megatron's state since
    if spec not in _BUILT:
        _BUILT[spec] = _RankRun(spec)
    return _BUILT[spec]


def run_request(request: ScoreRequest, layout: Layout) -> dict:
    """``{"logprobs": per-sequence logprobs}`` (plus :meth:`_RankRun.step`'s results with a step)
    of every sequence; each data-parallel rank scores its share (:func:`data_parallel_share`)."""
    from megatron.core import parallel_state

    from zero_mismatch_plugin.aligned.packing import pack

    spec = RankModel.of(request.model_dir, request.engine_kwargs, layout, request.lora_dir)
    run = _RankRun(spec) if request.step is not None else built_model(spec)
    ranks, rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    share = data_parallel_share(len(request.prompts), ranks, rank)
    batch = pack([request.prompts[i] for i in share], [request.responses[i] for i in share])
    with torch.no_grad():
        result = {"logprobs": batch.split_per_sequence(run.logprobs(batch).cpu())}
    if request.step is not None:
        coefficients = step_coefficients(request.step, sum(len(r) for r in request.responses))
        result.update(run.step(batch, request.step, coefficients[share_tokens(request.responses, share)]))
    for key in ("logprobs", "logprobs_after"):
        if key in result:
            result[key] = _all_sequences(result[key])
    return result


def _all_sequences(mine: list) -> list:
    """Every data-parallel rank's per-sequence list, in rank (= sequence) order."""
    from megatron.core import parallel_state

    group = parallel_state.get_data_parallel_group()
    if group.size() == 1:
        return mine
    parts = [None] * group.size()
    torch.distributed.all_gather_object(parts, mine, group=group)
    return [sequence for part in parts for sequence in part]


@torch.no_grad()
def token_logprobs(spec: RankModel, batch) -> torch.Tensor:
    return built_model(spec).logprobs(batch).float().cpu()


@torch.no_grad()
def target_logits(spec: RankModel, batch) -> torch.Tensor:
    """The logits of the rows that score response tokens (whole vocabulary)."""
    return built_model(spec).outputs(batch)["target_logits"].cpu()


@torch.no_grad()
def expert_choices(spec: RankModel, batch) -> dict[int, torch.Tensor]:
    """Layer index -> the experts the engine's router chose for each token of ``batch`` [T, K], per
    MoE layer (this rank's tokens: at expert parallelism every data-parallel rank is given the batch)."""
    from zero_mismatch_plugin.faces.megatron import pipeline

    from zero_mismatch_plugin.faces.megatron import context_parallel
    from zero_mismatch_plugin.integrations.megatron.standalone import context_parallel_rows

    run = built_model(spec)
    run.outputs(batch)
    config = run.model.config
    first = pipeline.stage_layers(config).start
    cp_group = context_parallel.context_parallel_group(config)
    if cp_group is not None:
        split, real = context_parallel_rows(batch, cp_group.size(), run.multiple)
    choices = {}
    for index, layer in enumerate(run.model.decoder.layers):
        ids = getattr(layer.mlp, "last_topk_ids", None)
        if ids is None:
            continue
        if cp_group is not None:  # this rank's rows: every rank's, back in the batch's order
            ids = context_parallel.gather_whole(ids[: sum(split.seq_lens) // cp_group.size()], split, cp_group)[real]
        choices[first + index] = ids[: batch.num_tokens].cpu()
    return pipeline.merged_over_stages(choices, config)


# What a rank group's ranks can be asked to run (rank_group.RankGroup.call).
RANK_CALLS = {
    "run_request": run_request,
    "token_logprobs": token_logprobs,
    "target_logits": target_logits,
    "expert_choices": expert_choices,
}

