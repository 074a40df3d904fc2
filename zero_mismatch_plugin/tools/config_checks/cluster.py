"""The parallel layouts, batch arithmetic and policy lag of a verl config, and what verl would
reject about them only at start-up on the cluster."""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig

from zero_mismatch_plugin.tools.config_checks.problems import Problem
from zero_mismatch_plugin.tools.config_checks.values import read

ACTOR = "actor_rollout_ref.actor"
MEGATRON = "actor_rollout_ref.actor.megatron"
ROLLOUT = "actor_rollout_ref.rollout"


@dataclass(frozen=True)
class TrainerLayout:
    """The training engine's parallel layout over ``world`` GPUs (Megatron naming)."""

    world: int
    tp: int
    pp: int
    cp: int
    dp: int
    ep: int
    etp: int
    expert_dp: int

    def dense_product(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    def expert_product(self) -> int:
        return self.etp * self.ep * self.pp * self.expert_dp


@dataclass(frozen=True)
class RolloutLayout:
    """The rollout engine's replicas over ``world`` GPUs (vLLM: a replica spans TP x DP x PP GPUs)."""

    world: int
    tp: int
    dp: int
    pp: int
    ep: int
    replica_size: int
    replicas: int


@dataclass(frozen=True)
class PolicyLag:
    """How stale a trained sample can be.

    ``max_versions``: weight versions between the sampling weights and the learner's (verl's
    staleness span minus one). ``max_updates``: the same in optimizer updates, which is how the
    papers count lag. ``None`` means unbounded.
    """

    trainer_mode: str
    updates_per_step: int
    max_versions: int | None
    max_updates: int | None


def uses_megatron(cfg: DictConfig) -> bool:
    return read(cfg, f"{ACTOR}.strategy") == "megatron"


def trainer_layout(cfg: DictConfig) -> TrainerLayout:
    """TP/PP/CP/EP/DP of the actor over ``trainer.nnodes x trainer.n_gpus_per_node`` GPUs.

    Megatron: dense DP = world / (TP x PP x CP); experts: expert DP = world / (ETP x EP x PP),
    ETP defaulting to TP. FSDP: every GPU is a data-parallel rank (Ulysses SP counted as CP).
    Integer division; :func:`cluster_problems` reports a layout that does not divide.
    """
    world = read(cfg, "trainer.nnodes") * read(cfg, "trainer.n_gpus_per_node")
    if uses_megatron(cfg):
        tp = read(cfg, f"{MEGATRON}.tensor_model_parallel_size")
        pp = read(cfg, f"{MEGATRON}.pipeline_model_parallel_size")
        cp = read(cfg, f"{MEGATRON}.context_parallel_size")
        ep = read(cfg, f"{MEGATRON}.expert_model_parallel_size")
        etp = read(cfg, f"{MEGATRON}.expert_tensor_parallel_size") or tp
    else:
        tp = pp = ep = etp = 1
        cp = read(cfg, f"{ACTOR}.ulysses_sequence_parallel_size")
    return TrainerLayout(world=world, tp=tp, pp=pp, cp=cp, dp=world // (tp * pp * cp), ep=ep, etp=etp,
                         expert_dp=world // (etp * ep * pp))


def uses_separate_rollout_pool(cfg: DictConfig) -> bool:
    return read(cfg, "trainer.v1.trainer_mode") == "separate_async" and not read(cfg, "actor_rollout_ref.hybrid_engine")


def rollout_layout(cfg: DictConfig) -> RolloutLayout:
    """vLLM replicas: each spans TP x DP x PP GPUs; they share the training GPUs when colocated,
    or the ``rollout.nnodes x rollout.n_gpus_per_node`` pool in separate-async mode."""
    if uses_separate_rollout_pool(cfg):
        world = read(cfg, f"{ROLLOUT}.nnodes") * read(cfg, f"{ROLLOUT}.n_gpus_per_node")
    else:
        world = trainer_layout(cfg).world
    tp = read(cfg, f"{ROLLOUT}.tensor_model_parallel_size")
    dp = read(cfg, f"{ROLLOUT}.data_parallel_size")
    pp = read(cfg, f"{ROLLOUT}.pipeline_model_parallel_size")
    ep = read(cfg, f"{ROLLOUT}.expert_parallel_size")
    size = tp * dp * pp
    return RolloutLayout(world=world, tp=tp, dp=dp, pp=pp, ep=ep, replica_size=size, replicas=world // size)


def cluster_gpus(cfg: DictConfig) -> int:
    """All GPUs the recipe occupies: the training GPUs, plus the rollout pool when separate."""
    extra = rollout_layout(cfg).world if uses_separate_rollout_pool(cfg) else 0
    return trainer_layout(cfg).world + extra


def policy_lag(cfg: DictConfig) -> PolicyLag:
    """The maximum policy lag a recipe allows, from verl's trainer mode and staleness bound.

    verl counts a trajectory's span inclusively: sampled and trained at the same version is a
    span of 1, so ``max_off_policy_threshold = T`` bounds the lag at ``T - 1`` versions. Weights
    are synced once per trainer step, which holds ``U`` optimizer updates (ppo_epochs x
    mini-batches); a sample is at most ``U * T - 1`` updates old. In ``sync`` mode samples come
    from the weights of the step that trains on them (0 versions).
    """
    mode = read(cfg, "trainer.v1.trainer_mode")
    train = read(cfg, "data.train_batch_size")
    mini = read(cfg, f"{ACTOR}.ppo_mini_batch_size")
    updates = read(cfg, f"{ACTOR}.ppo_epochs") * max(train // mini, 1)
    if mode == "sync":
        return PolicyLag(mode, updates, 0, updates - 1)
    threshold = read(cfg, "trainer.v1.sampler.max_off_policy_threshold")
    if threshold is None:
        return PolicyLag(mode, updates, None, None)
    return PolicyLag(mode, updates, threshold - 1, updates * threshold - 1)


def lora_rank(cfg: DictConfig) -> int:
    rank = read(cfg, "actor_rollout_ref.model.lora.rank")
    return rank if rank > 0 else read(cfg, "actor_rollout_ref.model.lora_rank")


def _trainer_layout_problems(cfg: DictConfig, layout: TrainerLayout) -> list[Problem]:
    problems = []
    if layout.world % (layout.tp * layout.pp * layout.cp):
        problems.append(Problem(MEGATRON, f"{layout.world} training GPUs are not divisible by TP {layout.tp} x "
                                          f"PP {layout.pp} x CP {layout.cp}"))
    if layout.world % (layout.etp * layout.ep * layout.pp):
        problems.append(Problem(f"{MEGATRON}.expert_model_parallel_size",
                                f"{layout.world} training GPUs are not divisible by expert TP {layout.etp} x "
                                f"EP {layout.ep} x PP {layout.pp}"))
    return problems


def _rollout_layout_problems(cfg: DictConfig) -> list[Problem]:
    problems = []
    roll = rollout_layout(cfg)
    if uses_separate_rollout_pool(cfg) and roll.world < 1:
        problems.append(Problem(f"{ROLLOUT}.nnodes", "separate_async without colocated replicas needs a rollout "
                                                     "pool (rollout.nnodes x rollout.n_gpus_per_node > 0)"))
    elif roll.world % roll.replica_size:
        problems.append(Problem(f"{ROLLOUT}.tensor_model_parallel_size",
                                f"{roll.world} rollout GPUs are not a whole number of replicas of TP {roll.tp} x "
                                f"DP {roll.dp} x PP {roll.pp}"))
    gpus_per_node = read(cfg, f"{ROLLOUT}.n_gpus_per_node")
    if roll.replica_size % min(gpus_per_node, roll.replica_size):
        problems.append(Problem(f"{ROLLOUT}.tensor_model_parallel_size",
                                f"a {roll.replica_size}-GPU replica does not fill whole {gpus_per_node}-GPU nodes"))
    if roll.ep > 1 and roll.ep != roll.tp * roll.dp:
        problems.append(Problem(f"{ROLLOUT}.expert_parallel_size",
                                f"vLLM expert parallelism must equal TP x DP = {roll.tp * roll.dp}"))
    return problems


def _trainer_mode_problems(cfg: DictConfig) -> list[Problem]:
    mode = read(cfg, "trainer.v1.trainer_mode")
    if mode != "separate_async":
        if not read(cfg, "actor_rollout_ref.hybrid_engine"):
            return [Problem("actor_rollout_ref.hybrid_engine", f"false is only supported with separate_async "
                                                               f"(now {mode})")]
        return []
    problems = []
    if not uses_separate_rollout_pool(cfg) and read(cfg, f"{ROLLOUT}.nnodes") < 1:
        problems.append(Problem(f"{ROLLOUT}.nnodes", "separate_async needs a rollout pool (rollout.nnodes > 0)"))
    if read(cfg, f"{ROLLOUT}.checkpoint_engine.backend") == "naive":
        problems.append(Problem(f"{ROLLOUT}.checkpoint_engine.backend",
                                "separate_async needs a collective backend (nccl, nixl, ...)"))
    return problems


def _batch_problems(cfg: DictConfig, layout: TrainerLayout) -> list[Problem]:
    problems = []
    train = read(cfg, "data.train_batch_size")
    mini = read(cfg, f"{ACTOR}.ppo_mini_batch_size")
    n = read(cfg, f"{ROLLOUT}.n")
    if train % mini:
        problems.append(Problem(f"{ACTOR}.ppo_mini_batch_size", f"{mini} does not divide data.train_batch_size {train}"))
    if layout.dp and (mini * n) % layout.dp:
        problems.append(Problem(f"{ACTOR}.ppo_mini_batch_size",
                                f"{mini} prompts x n {n} = {mini * n} responses per update do not split over "
                                f"{layout.dp} data-parallel ranks"))
    if read(cfg, "trainer.v1.trainer_mode") == "separate_async":
        sync_step = read(cfg, "trainer.v1.separate_async.parameter_sync_step")
        if train != sync_step * mini:
            problems.append(Problem(f"{ACTOR}.ppo_mini_batch_size",
                                    f"separate_async needs train_batch_size {train} == parameter_sync_step "
                                    f"{sync_step} x ppo_mini_batch_size {mini}"))
    if read(cfg, f"{ACTOR}.use_dynamic_bsz"):
        longest = read(cfg, "data.max_prompt_length") + read(cfg, "data.max_response_length")
        budget = read(cfg, f"{ACTOR}.ppo_max_token_len_per_gpu") * layout.cp
        if budget < longest:
            problems.append(Problem(f"{ACTOR}.ppo_max_token_len_per_gpu",
                                    f"a full trajectory ({longest} tokens) does not fit one micro-batch "
                                    f"(token budget x CP = {budget})"))
    return problems


def _static_cp_problems(cfg: DictConfig, layout: TrainerLayout) -> list[Problem]:
    """verl 0.9.1's Megatron engine mis-normalizes seq-mean-token-mean under static CP."""
    if (uses_megatron(cfg) and layout.cp > 1
            and read(cfg, f"{ACTOR}.loss_agg_mode") == "seq-mean-token-mean"
            and not read(cfg, f"{MEGATRON}.dynamic_context_parallel")):
        return [Problem(f"{MEGATRON}.context_parallel_size",
                        "static context parallelism > 1 mis-normalizes seq-mean-token-mean on verl 0.9.1; "
                        "use CP 1 or megatron.dynamic_context_parallel=true")]
    return []


def cluster_problems(cfg: DictConfig) -> list[Problem]:
    """What verl would reject only at start-up on the cluster: layouts, batch sizes, trainer mode."""
    layout = trainer_layout(cfg)
    if layout.dp < 1:
        key = MEGATRON if uses_megatron(cfg) else f"{ACTOR}.ulysses_sequence_parallel_size"
        return [Problem(key, f"{layout.world} training GPUs are fewer than TP {layout.tp} x PP {layout.pp} "
                             f"x CP {layout.cp}")]
    return (_trainer_layout_problems(cfg, layout) + _rollout_layout_problems(cfg) + _trainer_mode_problems(cfg)
            + _batch_problems(cfg, layout) + _static_cp_problems(cfg, layout))
