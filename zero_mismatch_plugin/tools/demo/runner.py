"""The learner loop: asynchronous RL against a live engine, one weight version per update.

Per update: take the next chunks, measure the kernel gap with the weights that sampled each sample,
train through verl's registry, publish the next version. The IS log-ratio then splits into weight
lag and kernel mismatch (docs/demo.md, "The learner loop").
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from types import SimpleNamespace

import torch

from zero_mismatch_plugin.algorithms.formulas import token_log_importance_ratio
from zero_mismatch_plugin.algorithms.token_metrics import importance_sampling_metrics

from zero_mismatch_plugin.tools.demo.attention_limits import bitwise_context_tokens
from zero_mismatch_plugin.tools.demo.corrections import CORRECTIONS, rollout_correction_settings
from zero_mismatch_plugin.tools.demo.learners import ALIGNED, DTYPE_FLAGS, ENGINE_DTYPES, KERNELS, Learner, make_learner
from zero_mismatch_plugin.tools.demo.engine import EngineProcess
from zero_mismatch_plugin.tools.demo.rollout import Chunk, RolloutPlan, Sample, fixed_lag_version
from zero_mismatch_plugin.tools.demo.task import DIGITS, MAX_PROMPT_TOKENS, TASKS, make_task

ALGORITHMS = ("reinforce_zero", "flash_reinforce")
LOSS_AGG_MODE = "seq-mean-token-mean"
# torch's and numpy's generators both accept seeds in [0, 2**32).
MAX_SEED = 2**32 - 1
# ``--model``: the tiny model the demo builds (a ``tiny_models`` family) and how it is described.
DEMO_MODELS = {
    "dense": ("llama", "a tiny Llama (2 layers, hidden 256, vocab 512)"),
    "moe": ("qwen3_moe", "a tiny Qwen3-MoE (2 MoE layers of 8 experts, top-2, hidden 256, vocab 512)"),
}


def conversation_tokens(turns: int, response_tokens: int) -> int:
    """The most tokens a conversation of ``turns`` turns can reach (questions of at most
    ``MAX_PROMPT_TOKENS``)."""
    return turns * (MAX_PROMPT_TOKENS + response_tokens)


def demo_bitwise_context_tokens() -> int | None:
    """Tokens a sequence of the demo's models (both share the attention shape) may reach with the
    engine and the aligned learner still bitwise on this host (``attention_limits``); None: unknown."""
    from zero_mismatch_plugin.tools.tiny_models import DEFAULT_SHAPE

    return bitwise_context_tokens(DEFAULT_SHAPE["head_dim"], DEFAULT_SHAPE["num_attention_heads"],
                                  DEFAULT_SHAPE["num_key_value_heads"])


@dataclass
class DemoConfig:
    algo: str = "reinforce_zero"
    kernels: str = ALIGNED
    lag: int = 2
    # True: every sample of update u (learner version u) comes from version max(0, u - lag) exactly;
    # False: the newest version the engine has, at most ``lag`` old (``rollout.RolloutPlan``).
    fixed_lag: bool = False
    updates: int = 200
    seed: int = 0
    task: str = DIGITS
    # None: the algorithm's own loss (``algo``). Else one of the standard-kernel baselines in
    # ``corrections.CORRECTIONS``: verl's rollout-correction loss (bypass mode, token IS, optional
    # gate) with the group-mean advantage, as the ablation recipes configure it.
    correction: str | None = None
    # Sequences per update = prompts_per_update * samples_per_prompt; FlashREINFORCE samples
    # one response per prompt (batch-mean baseline), so it uses as many distinct prompts instead.
    prompts_per_update: int = 8
    samples_per_prompt: int = 4
    response_tokens: int = 16
    # Each update's batch arrives in this many chunks, each generated with the newest weights
    # the engine has when it starts, so one batch can mix versions.
    chunks_per_update: int = 2
    learning_rate: float = 1e-4
    grad_clip: float = 1.0
    max_model_len: int = 128
    # The engine's process has a core of its own; more learner threads than the remaining core
    # oversubscribe a small machine (measured ~10x slower updates on 2 shared cores).
    learner_threads: int = 1
    # Score older-version samples under their own weights (an extra no-grad forward per older
    # version in the batch). Off, the kernel gap is measured on the learner-version samples only.
    own_version_check: bool = True
    # Turns per conversation: each later turn re-sends the conversation (prompt, response, a new
    # question) and is answered from the engine's prefix cache; every turn's response is a sample.
    turns: int = 1
    model: str = "dense"  # a key of DEMO_MODELS
    # LoRA: a frozen base and a rank-``lora_rank`` adapter on every linear, the adapter pushed to
    # the engine (vLLM's LoRA serving) after every update. None: full-weight training.
    lora_rank: int | None = None
    # The engine's dtype (``float32`` or ``bfloat16``); the aligned learner's forward follows it
    # (fp32 master weights, the engine's bf16 copies), the standard learners keep their own.
    dtype: str = "float32"

    def __post_init__(self):
        if self.algo not in ALGORITHMS:
            raise ValueError(f"--algo must be one of {ALGORITHMS}, got {self.algo!r}")
        if self.kernels not in KERNELS:
            raise ValueError(f"--kernels must be one of {KERNELS}, got {self.kernels!r}")
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {self.task!r}")
        if self.correction is not None:
            if self.correction not in CORRECTIONS:
                raise ValueError(f"correction must be one of {tuple(CORRECTIONS)} or None, got {self.correction!r}")
            if self.algo != "reinforce_zero":
                raise ValueError("a rollout-correction baseline replaces REINFORCE Zero's loss; use algo reinforce_zero")
        if self.lag < 0:
            raise ValueError(f"--lag must be at least 0 (0: synchronous), got {self.lag}")
        if self.updates < 1:
            raise ValueError(f"--updates must be at least 1, got {self.updates}")
        if not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"--seed must be between 0 and {MAX_SEED}, got {self.seed}")
        if self.prompts_per_update % self.chunks_per_update:
            raise ValueError("prompts_per_update must be a multiple of chunks_per_update")
        if self.lora_rank is not None:
            if not isinstance(self.lora_rank, int) or self.lora_rank < 1:
                raise ValueError(f"--lora must be a positive rank, got {self.lora_rank!r}")
            if self.kernels != ALIGNED or self.correction is not None:
                raise ValueError("--lora trains with the aligned kernels and the algorithm's own loss; "
                                 "drop --kernels / the correction baseline")
        if self.turns < 1:
            raise ValueError(f"--turns must be at least 1, got {self.turns}")
        if not self.learning_rate > 0:
            raise ValueError(f"--learning-rate must be a positive number, got {self.learning_rate!r}")
        if self.dtype not in ENGINE_DTYPES:
            raise ValueError(f"--dtype must be one of {tuple(DTYPE_FLAGS)} (the engine's dtype), got {self.dtype!r}")
        if self.model not in DEMO_MODELS:
            raise ValueError(f"--model must be one of {tuple(DEMO_MODELS)}, got {self.model!r}")
        if self.model == "moe" and self.lora_rank is not None:
            raise ValueError("--lora trains the dense linears; vLLM has no CPU LoRA path for MoE experts: "
                             "use --model dense with --lora")
        if self.model == "moe" and self.turns > 1:
            # Consistent mode keeps prefix caching on only where a hit is proven equal to a miss.
            raise ValueError(
                "--turns answers later turns from the engine's prefix cache, which consistent numerics "
                "keeps off for Mixture-of-Experts models; use --model dense with --turns"
            )
        if conversation_tokens(self.turns, self.response_tokens) > self.max_model_len:
            raise ValueError(
                f"--turns {self.turns}: a conversation reaches {conversation_tokens(self.turns, self.response_tokens)} "
                f"tokens, more than max_model_len={self.max_model_len}; use fewer turns or a longer max_model_len"
            )
        if self.kernels == ALIGNED:
            self._require_bitwise_length()

    def _require_bitwise_length(self) -> None:
        """The aligned learner claims every same-version token bitwise: refuse a conversation longer
        than this host's attention keeps bitwise (``attention_limits``), before any work."""
        bound = demo_bitwise_context_tokens()
        needed = conversation_tokens(self.turns, self.response_tokens)
        if bound is None or needed <= bound:
            return
        per_turn = conversation_tokens(1, self.response_tokens)
        raise ValueError(
            f"--turns {self.turns}: a conversation reaches {needed} tokens, more than the {bound} tokens this host's "
            f"vLLM CPU attention keeps bitwise between the engine and the aligned learner (past {bound} tokens the "
            f"learner's forward sums a row's softmax over two key tiles, the engine's decode step over one); "
            f"use at most {bound // per_turn} turns"
        )

    @property
    def group_size(self) -> int:
        return 1 if self.algo == "flash_reinforce" else self.samples_per_prompt

    @property
    def prompts_per_chunk(self) -> int:
        prompts = self.prompts_per_update * (self.samples_per_prompt // self.group_size)
        return prompts // self.chunks_per_update


@dataclass
class UpdateRecord:
    """What one update saw, per sample (for checks; the metrics log has the aggregates)."""

    step: int
    learner_version: int
    sample_versions: list[int]
    # every token's IS ratio exp(log π_θk − log μ) == 1.0 exactly
    ratios_all_one: list[bool]
    # every token's logprob under the sampling version's weights == μ, bit for bit
    # (None: not scored, when the own-version check is off and the sample is older)
    own_version_bitwise: list[bool | None]
    metrics: dict[str, float]


@dataclass
class DemoResult:
    config: DemoConfig
    records: list[UpdateRecord] = field(default_factory=list)
    loop_seconds: float = 0.0

    @property
    def metric_rows(self) -> list[dict[str, float]]:
        return [r.metrics for r in self.records]


def _pad(rows: list[torch.Tensor], width: int) -> torch.Tensor:
    out = torch.zeros(len(rows), width, dtype=rows[0].dtype)
    for i, row in enumerate(rows):
        out[i, : row.numel()] = row
    return out


class _Batch:
    """An update's samples as verl-shaped (B, T) tensors."""

    def __init__(self, samples: list[Sample]):
        self.samples = samples
        self.prompts = [s.prompt for s in samples]
        self.responses = [s.response for s in samples]
        self.width = max(len(r) for r in self.responses)
        self.mask = _pad([torch.ones(len(r)) for r in self.responses], self.width).bool()
        self.mu = _pad([s.mu for s in samples], self.width)
        rewards = torch.zeros(len(samples), self.width)
        for i, s in enumerate(samples):
            rewards[i, len(s.response) - 1] = s.reward  # outcome reward on the last token, as verl does
        self.token_level_rewards = rewards
        self.uids = [s.uid for s in samples]
        self.versions = torch.tensor([s.version for s in samples])

    def pad(self, rows: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack([torch.nn.functional.pad(r, (0, self.width - r.numel())) for r in rows])


class DemoRun:
    """One demo configuration against a live engine (which is left running for the next)."""

    def __init__(self, config: DemoConfig, engine: EngineProcess, model_dir, engine_seed: int = 0):
        import verl  # noqa: F401 - importing verl registers the plugin's estimators and losses
        from omegaconf import OmegaConf
        from transformers import AutoTokenizer
        from verl.trainer.ppo import core_algos

        self.config = config
        self.engine = engine
        torch.manual_seed(config.seed)
        self.task = make_task(config.task, AutoTokenizer.from_pretrained(str(model_dir)), config.seed)
        self.learner: Learner = make_learner(config.kernels, model_dir, config.max_model_len, engine_seed,
                                             lora_rank=config.lora_rank, seed=config.seed, dtype=config.dtype)
        self.optimizer = torch.optim.AdamW(self.learner.parameters(), lr=config.learning_rate, weight_decay=0.0)
        if config.correction is None:
            self.advantage_fn = core_algos.get_adv_estimator_fn(config.algo)
            self.loss_fn = core_algos.get_policy_loss_fn(config.algo)
            # μ is the rollout's own logprob: verl's bypass mode, which the estimators require.
            self.algorithm_config = OmegaConf.create({"rollout_correction": {"bypass_mode": True}})
            self.advantage_options = {}
            self.rollout_correction = None
        else:
            algorithm, self.rollout_correction = rollout_correction_settings(config.correction)
            self.advantage_fn = core_algos.get_adv_estimator_fn(algorithm["adv_estimator"])
            self.advantage_options = {"norm_adv_by_std_in_grpo": algorithm["norm_adv_by_std_in_grpo"]}
            self.algorithm_config = OmegaConf.create(algorithm)
            # verl's bypass loss reads the correction from the actor's policy-loss config.
            self.loss_fn = core_algos.get_policy_loss_fn("bypass_mode")
        self.version = 0
        self.kept_weights = {0: self.learner.snapshot()}

    def run(self, progress=None) -> DemoResult:
        cfg = self.config
        plan = RolloutPlan(
            seed=cfg.seed, prompts_per_chunk=cfg.prompts_per_chunk, samples_per_prompt=cfg.group_size,
            response_tokens=cfg.response_tokens, chunks_per_update=cfg.chunks_per_update, lag=cfg.lag,
            total_chunks=cfg.updates * cfg.chunks_per_update, turns=cfg.turns,
            lora=getattr(self.learner, "lora_config", None), fixed_lag=cfg.fixed_lag,
        )
        result = DemoResult(cfg)
        threads = torch.get_num_threads()
        torch.set_num_threads(cfg.learner_threads)
        start = time.perf_counter()
        try:
            # Version 0 = the learner's initial weights; the engine may hold another run's.
            with self.engine.rollout(self.task, plan, self.learner.named_weights()) as rollout:
                for step in range(1, cfg.updates + 1):
                    wait_start = time.perf_counter()
                    chunks = [rollout.next_chunk() for _ in range(cfg.chunks_per_update)]
                    waited = time.perf_counter() - wait_start
                    record = self._update(step, chunks, waited)
                    rollout.publish(self.version, self.learner.named_weights())
                    result.records.append(record)
                    if progress is not None:
                        progress(record)
        finally:
            torch.set_num_threads(threads)
        result.loop_seconds = time.perf_counter() - start
        return result

    def _older_version_logprobs(self, batch: _Batch) -> dict[int, torch.Tensor]:
        """Logprobs of samples from older versions under the weights that sampled them (no grad).

        Runs before the training forward: swapping weights in place after it would change
        tensors its backward still needs.
        """
        out: dict[int, torch.Tensor] = {}
        if not self.config.own_version_check:
            return out
        for version in sorted({s.version for s in batch.samples} - {self.version}):
            rows = [i for i, s in enumerate(batch.samples) if s.version == version]
            with torch.no_grad(), self.learner.weights_of(self.kept_weights[version]):
                logprobs = self.learner.response_logprobs([batch.prompts[i] for i in rows],
                                                          [batch.responses[i] for i in rows])
            out.update(zip(rows, logprobs))
        return out

    def _loss_config(self, batch: _Batch):
        """What verl's actor hands a policy loss: its policy-loss settings and the batch sizes."""
        if self.rollout_correction is None:
            return None  # the plugin's losses need no actor config
        return SimpleNamespace(
            policy_loss={"rollout_correction": self.rollout_correction},
            global_batch_info={"dp_size": 1, "batch_num_tokens": int(batch.mask.sum()),
                               "global_batch_size": len(batch.samples), "loss_scale_factor": None},
        )

    def _update(self, step: int, chunks: list[Chunk], waited: float) -> UpdateRecord:
        cfg = self.config
        update_start = time.perf_counter()
        samples = [s for c in chunks for s in c.samples]
        too_old = [s.version for s in samples if self.version - s.version > cfg.lag]
        if too_old:
            raise RuntimeError(f"update {step}: samples of versions {too_old} exceed lag {cfg.lag} at {self.version}")
        if cfg.fixed_lag:
            expected = fixed_lag_version(self.version, cfg.lag)
            off = sorted({s.version for s in samples} - {expected})
            if off:
                raise RuntimeError(f"update {step}: fixed lag {cfg.lag} expects samples of version {expected} "
                                   f"at learner version {self.version}, got versions {off}")
        batch = _Batch(samples)

        older_rows = self._older_version_logprobs(batch)
        current_rows = self.learner.response_logprobs(batch.prompts, batch.responses)
        log_prob = batch.pad(current_rows)
        # Rows with a logprob under their own version's weights (all rows unless the check is off).
        own_available = torch.tensor([s.version == self.version or i in older_rows for i, s in enumerate(samples)])
        own = batch.pad([older_rows.get(i, row.detach()) for i, row in enumerate(current_rows)])

        advantages, _ = self.advantage_fn(
            token_level_rewards=batch.token_level_rewards, response_mask=batch.mask,
            config=self.algorithm_config, index=batch.uids, **self.advantage_options,
        )
        loss, loss_metrics = self.loss_fn(
            old_log_prob=batch.mu, log_prob=log_prob, advantages=advantages, response_mask=batch.mask,
            loss_agg_mode=LOSS_AGG_MODE, config=self._loss_config(batch), rollout_is_weights=None,
        )
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(list(self.learner.parameters()), cfg.grad_clip)
        self.optimizer.step()

        learner_version = self.version
        self.version += 1
        self.kept_weights[self.version] = self.learner.snapshot()
        # Later batches hold versions >= (their learner version) - K >= self.version - K.
        for old in [v for v in self.kept_weights if v < self.version - cfg.lag]:
            del self.kept_weights[old]

        with torch.no_grad():
            ratio = torch.exp(token_log_importance_ratio(log_prob.detach(), batch.mu))
            ratios_all_one = ((ratio == 1.0) | ~batch.mask).all(dim=1).tolist()
            own_bitwise = [bool(b) if a else None for a, b in
                           zip(own_available, ((own == batch.mu) | ~batch.mask).all(dim=1))]
            staleness = (learner_version - batch.versions).float()
            rewards = torch.tensor([s.reward for s in samples])
            own_mask = batch.mask & own_available[:, None]
            kernel_gap = importance_sampling_metrics(own, batch.mu, own_mask)
            lag_gap = importance_sampling_metrics(log_prob.detach(), own, own_mask)

        # verl's own losses already prefix some keys with "actor/".
        metrics = {(k if k.startswith("actor/") else f"actor/{k}"): float(v) for k, v in loss_metrics.items()}
        metrics.update({
            "actor/pg_loss": loss.item(),
            "actor/grad_norm": float(grad_norm),
            "actor/lr": cfg.learning_rate,
            "critic/score/mean": rewards.mean().item(),
            "critic/score/max": rewards.max().item(),
            "critic/score/min": rewards.min().item(),
            "training/off_policy/trajectory_staleness/mean": staleness.mean().item(),
            "training/off_policy/trajectory_staleness/max": staleness.max().item(),
            "demo/fresh_sample_fraction": (batch.versions == learner_version).float().mean().item(),
            "demo/learner_version": float(learner_version),
            "timing_s/wait_for_rollout": waited,
            "timing_s/update": time.perf_counter() - update_start,
            "timing_s/generate": sum(c.generate_s for c in chunks),
            "timing_s/weight_load": sum(c.weight_load_s for c in chunks),
            "demo/prefix_cache/cached_prompt_tokens": float(sum(s.cached_tokens for s in samples)),
        })
        if kernel_gap:  # empty when no sample could be scored under its own version
            metrics.update({
                # The kernel gap: learner at the sampling version vs the engine's μ (no lag by construction).
                "demo/own_version/bitwise_equal_fraction": kernel_gap["zero_mismatch/bitwise_equal_fraction"],
                "demo/own_version/k3_kl": kernel_gap["rollout_corr/k3_kl"],
                "demo/own_version/log_prob_abs_diff_max": kernel_gap["zero_mismatch/log_prob_abs_diff_max"],
                # The weight-lag gap: learner now vs learner at the sampling version (same kernels).
                "demo/weight_lag/k3_kl": lag_gap["rollout_corr/k3_kl"],
            })
        return UpdateRecord(
            step=step, learner_version=learner_version, sample_versions=batch.versions.tolist(),
            ratios_all_one=ratios_all_one, own_version_bitwise=own_bitwise, metrics=metrics,
        )


def run_demo(config: DemoConfig, engine: EngineProcess, model_dir, progress=None,
             engine_seed: int = 0) -> DemoResult:
    """Run one configuration against ``engine`` (``start_engine`` on ``model_dir``'s architecture)."""
    return DemoRun(config, engine, model_dir, engine_seed=engine_seed).run(progress)


def config_dict(config: DemoConfig) -> dict:
    return asdict(config)
