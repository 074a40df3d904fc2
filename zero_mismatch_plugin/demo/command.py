"""``zmrl demo``: build a tiny model, start vLLM, run asynchronous RL against it, write the results."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

DEFAULT_OUT = "zmrl-demo-out"


class OutDirError(ValueError):
    """``--out`` (or the default output directory) cannot receive the demo's files."""


def fresh_out_dir(requested: str | None) -> Path:
    """``requested`` if given (it must be empty or absent), else ./zmrl-demo-out, -2, -3, ... not yet used."""
    if requested:
        path = Path(requested)
        if path.exists() and not path.is_dir():
            raise OutDirError(f"--out {path} is an existing file; give a directory (absent or empty)")
        if path.is_dir() and any(path.iterdir()):
            raise OutDirError(f"--out {path} exists and is not empty; choose a fresh directory")
        return path
    path, n = Path(DEFAULT_OUT), 1
    while path.exists():
        n += 1
        path = Path(f"{DEFAULT_OUT}-{n}")
    return path


def prepare_out_dir(requested: str | None) -> Path:
    """Create the output directory and prove it writable, before any work is spent."""
    path = fresh_out_dir(requested)
    option = f"--out {path}" if requested else f"the output directory {path} (choose one with --out)"
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".zmrl-write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        raise OutDirError(f"{option} cannot be written: {error.strerror or error}") from None
    return path


def _quiet_defaults() -> None:
    # Offline, a bounded KV cache (vLLM's CPU default reserves ~21 GiB), and vLLM's INFO and WARNING lines
    # kept out of the progress bar's way. Each can be overridden from the environment.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def run_demo_command(algo: str, kernels: str, lag: int, updates: int, seed: int, out: str | None,
                     turns: int = 1, model: str = "dense",
                     lora_rank: int | None = None) -> int:
    _quiet_defaults()
    from tqdm import tqdm

    from zero_mismatch_plugin.tiny_models import DEFAULT_SHAPE, build_tiny_model

    from .engine import start_engine
    from .outputs import format_summary, write_outputs
    from .runner import DEMO_MODELS, DemoConfig, DemoRun, conversation_tokens

    try:
        # Room for the whole conversation; 128 for one turn.
        needed = conversation_tokens(turns, DemoConfig.response_tokens)
        positions = DEFAULT_SHAPE["max_position_embeddings"]
        if needed > positions:
            raise ValueError(
                f"--turns {turns}: a conversation reaches {needed} tokens, more than the demo model's "
                f"{positions} positions; use at most {positions // conversation_tokens(1, DemoConfig.response_tokens)} turns"
            )
        max_model_len = max(DemoConfig.max_model_len, -(-needed // 32) * 32)
        from zero_mismatch_plugin.switches import cpu_kv_cache_space
        cpu_kv_cache_space()  # refuse a KV-cache size the engine would die on, before any work
        config = DemoConfig(algo=algo, kernels=kernels, lag=lag, updates=updates, seed=seed, turns=turns,
                            max_model_len=max_model_len, model=model,
                            lora_rank=lora_rank)
        out_dir = prepare_out_dir(out)
    except ValueError as error:
        print(f"ERROR: {error}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    print(f"zmrl demo -> {out_dir}/")
    family, description = DEMO_MODELS[model]
    print(f"building {description} and its tokenizer, seed {seed}")
    model_dir = build_tiny_model(out_dir / "model", family=family, seed=seed)
    print("starting the vLLM engine in its own process (CPU, fp32, consistent numerics; about 10 s)")
    if lora_rank is not None:
        print(f"LoRA: frozen base, rank-{lora_rank} adapter on every linear, a new adapter version served after every update")
    with start_engine(model_dir, config.max_model_len, lora_rank=lora_rank) as engine:
        run = DemoRun(config, engine, model_dir)
        print(f"task: {run.task.describe(config.response_tokens)}; chance {run.task.chance_reward:.3f}")
        with tqdm(total=config.updates, desc="updates", unit="upd", dynamic_ncols=True) as bar:

            def progress(record):
                m = record.metrics
                bar.set_postfix(
                    reward=f"{m['critic/score/mean']:.3f}",
                    lag=int(m["training/off_policy/trajectory_staleness/max"]),
                    bitwise=f"{m.get('demo/own_version/bitwise_equal_fraction', float('nan')):.3f}",
                    refresh=False,
                )
                bar.update(1)

            result = run.run(progress)
    summary = write_outputs(result, out_dir)
    print(format_summary(summary, out_dir))
    print(f"wall time {time.perf_counter() - started:.0f} s")
    return 0


def run_compare_command(seeds: list[int] | None, updates: int | None, lag: int | None, out: str | None) -> int:
    """Every comparison variant for every seed, one engine; the comparison table and figures in ``out``."""
    _quiet_defaults()
    from zero_mismatch_plugin.report.compare import COMPARE_TEXT, FIGURE1, FIGURE3, PLOTS_DIR
    from zero_mismatch_plugin.tiny_models import build_tiny_model

    from .compare import DEFAULT_LAG, DEFAULT_SEEDS, DEFAULT_UPDATES, CompareConfig, run_compare
    from .engine import start_engine
    from .runner import DemoRun  # noqa: F401 - fail on a broken install before the engine starts

    try:
        config = CompareConfig(seeds=DEFAULT_SEEDS if seeds is None else seeds,
                               updates=DEFAULT_UPDATES if updates is None else updates,
                               lag=DEFAULT_LAG if lag is None else lag)
        from zero_mismatch_plugin.switches import cpu_kv_cache_space
        cpu_kv_cache_space()  # refuse a KV-cache size the engine would die on, before any work
        out_dir = prepare_out_dir(out)
    except ValueError as error:
        print(f"ERROR: {error}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    runs = len(config.seeds) * len(config.selected)
    print(f"zmrl demo --compare -> {out_dir}/")
    print(f"{len(config.selected)} variants x seeds {list(config.seeds)}, {config.updates} updates each, "
          f"lag {config.lag} (the synchronous reference: 0), learning rate {config.learning_rate}")
    model_dirs = {seed: build_tiny_model(out_dir / "models" / f"seed-{seed}", family="llama", seed=seed)
                  for seed in config.seeds}
    print("starting the vLLM engine in its own process (CPU, fp32, consistent numerics; about 10 s)")
    done = []

    def progress(variant, seed, result):
        done.append(1)
        rewards = [r.metrics["critic/score/mean"] for r in result.records]
        window = config.window
        print(f"[{len(done)}/{runs}] seed {seed} {variant.name:<24} {len(rewards) / result.loop_seconds:5.2f} upd/s  "
              f"reward {sum(rewards[:window]) / window:.3f} -> {sum(rewards[-window:]) / window:.3f}", flush=True)

    with start_engine(model_dirs[config.seeds[0]], config.max_model_len) as engine:
        run_compare(config, out_dir, engine, model_dirs.__getitem__, progress)
    print((out_dir / COMPARE_TEXT).read_text())
    print(f"table:   {out_dir / COMPARE_TEXT} (and compare.json)")
    print(f"figures: {out_dir / PLOTS_DIR / FIGURE1}, {out_dir / PLOTS_DIR / FIGURE3}")
    print(f"wall time {time.perf_counter() - started:.0f} s")
    return 0
