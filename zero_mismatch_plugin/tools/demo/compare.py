"""``zmrl demo --compare``: the papers' aligned-vs-standard contrast on one CPU.

Every variant (:data:`VARIANTS`) runs the same task, model, seeds, lag and learning rate against one
fp32 vLLM engine in consistent numerics; only the learner's forward and the off-policy correction
differ. Runs go to ``OUT/seed-S/VARIANT/``, the comparison to ``OUT/``. See docs/compare.md.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

from zero_mismatch_plugin.tools.demo.learners import ALIGNED, STANDARD_BF16
from zero_mismatch_plugin.tools.demo.runner import DemoConfig, DemoResult
from zero_mismatch_plugin.tools.demo.task import CHAIN

DEFAULT_LAG = 8
DEFAULT_SEEDS = (0, 1, 2)
DEFAULT_UPDATES = 300


@dataclass(frozen=True)
class Variant:
    name: str
    title: str
    kernels: str
    correction: str | None = None
    synchronous: bool = False

    def demo_config(self, config: "CompareConfig", seed: int) -> DemoConfig:
        return DemoConfig(
            algo="reinforce_zero", kernels=self.kernels, correction=self.correction,
            lag=0 if self.synchronous else config.lag, fixed_lag=config.fixed_lag,
            updates=config.updates, seed=seed, task=config.task,
            learning_rate=config.learning_rate, max_model_len=config.max_model_len, dtype=config.dtype,
        )


VARIANTS = (
    Variant("aligned", "REINFORCE Zero, aligned kernels", ALIGNED),
    Variant("standard_is", "IS, standard kernels (bf16 learner)", STANDARD_BF16, correction="is"),
    Variant("standard_is_seq_gate", "IS + sequence gate, standard kernels (bf16)", STANDARD_BF16,
            correction="is_sequence_gate"),
    Variant("standard_is_token_gate", "IS + token gate, standard kernels (bf16)", STANDARD_BF16,
            correction="is_token_gate"),
    Variant("sync_aligned", "Synchronous, aligned kernels (reference)", ALIGNED, synchronous=True),
)
VARIANT_NAMES = tuple(v.name for v in VARIANTS)


@dataclass
class CompareConfig:
    seeds: Sequence[int] = DEFAULT_SEEDS
    updates: int = DEFAULT_UPDATES
    lag: int = DEFAULT_LAG
    # True: every asynchronous variant trains each update on samples exactly ``lag`` versions old,
    # whatever its learner's speed; False: at most ``lag`` (a fast learner sees less lag).
    fixed_lag: bool = False
    task: str = CHAIN
    learning_rate: float = 1e-4
    max_model_len: int = 128
    variants: Sequence[str] = VARIANT_NAMES
    # The engine's dtype: ``bfloat16`` serves bf16 in consistent mode and the aligned learner follows
    # it; the standard learners are bf16 mixed precision either way (docs/compare.md).
    dtype: str = "float32"

    def __post_init__(self):
        self.seeds = tuple(self.seeds)
        self.variants = tuple(self.variants)
        if not self.seeds:
            raise ValueError("--seeds needs at least one seed")
        if len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"--seeds repeats a seed: {list(self.seeds)}")
        if not self.learning_rate > 0:
            raise ValueError(f"--learning-rate must be a positive number, got {self.learning_rate!r}")
        if self.lag < 1:
            raise ValueError(f"--lag must be at least 1 for the comparison (the reference is the synchronous run), "
                             f"got {self.lag}")
        unknown = [name for name in self.variants if name not in VARIANT_NAMES]
        if unknown or not self.variants:
            raise ValueError(f"variants must be among {VARIANT_NAMES}, got {list(self.variants)}")
        if self.updates < 2:
            raise ValueError(f"--updates must be at least 2 for first and last windows, got {self.updates}")
        for variant in self.selected:  # every run's settings checked before any work is spent
            for seed in self.seeds:
                variant.demo_config(self, seed)

    @property
    def selected(self) -> list[Variant]:
        return [v for v in VARIANTS if v.name in self.variants]

    @property
    def window(self) -> int:
        """First/last window: a fifth of the run, as ``zmrl demo`` uses."""
        return max(1, self.updates // 5)


def run_dir(out_dir: Path, seed: int, variant: str) -> Path:
    return Path(out_dir) / f"seed-{seed}" / variant


def run_compare(config: CompareConfig, out_dir: Path, engine, model_dir_for_seed: Callable[[int], Path],
                progress: Callable[[Variant, int, DemoResult], None] | None = None,
                on_record=None) -> dict:
    """Every selected variant for every seed against ``engine``; returns the comparison (also on disk)."""
    from zero_mismatch_plugin.tools.report.compare import write_comparison

    from zero_mismatch_plugin.tools.demo.outputs import write_outputs
    from zero_mismatch_plugin.tools.demo.runner import DemoRun

    summaries: dict[int, dict[str, dict]] = {}
    settings = {**asdict(config), "window": config.window}
    variants = config.selected
    comparison: dict = {}
    for seed in config.seeds:
        model_dir = model_dir_for_seed(seed)
        for variant in config.selected:
            run = DemoRun(variant.demo_config(config, seed), engine, model_dir)
            result = run.run(on_record)
            summary = write_outputs(result, run_dir(out_dir, seed, variant.name), label=variant.name,
                                    window=config.window, plots=False)
            summaries.setdefault(seed, {})[variant.name] = summary
            if progress is not None:
                progress(variant, seed, result)
        # After every seed, so an interrupted comparison keeps the seeds it finished.
        logs = {done: {name: Path(s["files"]["metrics"]) for name, s in by_variant.items()}
                for done, by_variant in summaries.items()}
        comparison = write_comparison(logs, variants, settings, summaries, Path(out_dir))
    return comparison
