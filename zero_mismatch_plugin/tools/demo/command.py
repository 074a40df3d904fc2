"""``zmrl demo``: build a tiny model, start vLLM, run asynchronous RL against it, write the results."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

DEFAULT_OUT = "zmrl-demo-out"
# Held in the output directory while a demo writes there: a second demo refuses the directory.
LOCK_FILE = ".zmrl-demo.lock"


class OutDirError(ValueError):
    """``--out`` (or the default output directory) cannot receive the demo's files."""


def _lock_holder(path: Path) -> str:
    """Who holds ``path``'s lock file, as a phrase: its process, and whether it still runs."""
    try:
        pid = int((path / LOCK_FILE).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return "a zmrl demo"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return f"a zmrl demo (pid {pid}, no longer running: it was killed before it could remove the lock)"
    except OSError:
        pass
    return f"a zmrl demo (pid {pid})"


def _refuse_used(path: Path, option: str) -> None:
    """Refuse a directory that another demo is writing to, or that holds another run's outputs."""
    from zero_mismatch_plugin.tools.demo.outputs import RUN_OUTPUTS

    if (path / LOCK_FILE).exists():
        raise OutDirError(f"{option} is in use by {_lock_holder(path)} (lock file {path / LOCK_FILE}); "
                          "choose another directory with --out")
    outputs = [name for name in RUN_OUTPUTS if (path / name).exists()]
    if outputs:
        raise OutDirError(f"{option} holds another zmrl demo run's outputs ({', '.join(outputs)}); "
                          "choose another directory with --out")


def fresh_out_dir(requested: str | None) -> Path:
    """``requested`` if given (it must be empty or absent), else ./zmrl-demo-out, -2, -3, ... not yet used."""
    if requested:
        path = Path(requested)
        if path.exists() and not path.is_dir():
            raise OutDirError(f"--out {path} is an existing file; give a directory (absent or empty)")
        if path.is_dir() and any(path.iterdir()):
            _refuse_used(path, f"--out {path}")
            raise OutDirError(f"--out {path} exists and is not empty; choose a fresh directory")
        return path
    path, n = Path(DEFAULT_OUT), 1
    while path.exists():
        n += 1
        path = Path(f"{DEFAULT_OUT}-{n}")
    return path


def prepare_out_dir(requested: str | None) -> Path:
    """Create the output directory and take its lock (proving it writable), before any work is spent.

    The lock file is created exclusively: of two demos that start on one directory, the second is
    refused (for the default directory it moves on to the next free name). :func:`release_out_dir`
    removes it when the run ends.
    """
    while True:
        path = fresh_out_dir(requested)
        option = f"--out {path}" if requested else f"the output directory {path} (choose one with --out)"
        try:
            path.mkdir(parents=True, exist_ok=bool(requested))
        except FileExistsError:
            continue  # another demo took this default name since it was chosen: take the next
        except OSError as error:
            raise OutDirError(f"{option} cannot be written: {error.strerror or error}") from None
        try:
            handle = os.open(path / LOCK_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            _refuse_used(path, option)
            raise OutDirError(f"{option} is in use by another zmrl demo; choose another directory with --out") from None
        except OSError as error:
            raise OutDirError(f"{option} cannot be written: {error.strerror or error}") from None
        try:
            os.write(handle, f"{os.getpid()}\n".encode())
        finally:
            os.close(handle)
        return path


def release_out_dir(path: Path) -> None:
    """Remove the lock :func:`prepare_out_dir` took (the run's outputs stay)."""
    try:
        (path / LOCK_FILE).unlink()
    except OSError:
        pass


def _quiet_defaults() -> None:
    # Offline, a bounded KV cache (vLLM's CPU default reserves ~21 GiB), and vLLM's INFO and WARNING lines
    # kept out of the progress bar's way. Each can be overridden from the environment.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def validated_config(algo: str, kernels: str, lag: int, updates: int, seed: int, turns: int, model: str,
                     lora_rank: int | None, dtype: str = "float32", learning_rate: float = 1e-4,
                     fixed_lag: bool = False):
    """The run's ``DemoConfig`` once every option is checked (``ValueError`` says what to change);
    nothing is built or started."""
    from zero_mismatch_plugin.tools.tiny_models import DEFAULT_SHAPE

    from zero_mismatch_plugin.tools.demo.runner import DemoConfig, conversation_tokens

    # Room for the whole conversation; 128 for one turn.
    needed = conversation_tokens(turns, DemoConfig.response_tokens)
    positions = DEFAULT_SHAPE["max_position_embeddings"]
    if needed > positions:
        raise ValueError(
            f"--turns {turns}: a conversation reaches {needed} tokens, more than the demo model's "
            f"{positions} positions; use at most {positions // conversation_tokens(1, DemoConfig.response_tokens)} turns"
        )
    if lora_rank is not None and isinstance(lora_rank, int) and lora_rank >= 1:
        _require_served_rank(lora_rank)
    max_model_len = max(DemoConfig.max_model_len, -(-needed // 32) * 32)
    from zero_mismatch_plugin.tables.switches import cpu_kv_cache_space
    cpu_kv_cache_space()  # refuse a KV-cache size the engine would die on, before any work
    return DemoConfig(algo=algo, kernels=kernels, lag=lag, updates=updates, seed=seed, turns=turns,
                      max_model_len=max_model_len, model=model, lora_rank=lora_rank, dtype=dtype,
                      learning_rate=learning_rate, fixed_lag=fixed_lag)


def _require_served_rank(rank: int) -> None:
    """vLLM serves adapters up to its largest ``max_lora_rank``: refuse a larger ``--lora`` now, not
    when the engine starts."""
    from zero_mismatch_plugin.aligned.lora.peft import lora_engine_args_for_rank

    try:
        lora_engine_args_for_rank(rank)
    except NotImplementedError as error:
        raise ValueError(f"--lora {rank}: {error}; choose a smaller rank") from None


def _bitwise_failure(summary: dict) -> str | None:
    """The message when the aligned kernels' claim (every sample scored with the weights that sampled
    it is vLLM's logprob bit for bit) does not hold in this run; None when it holds or is not made."""
    if summary.get("bitwise_claim_holds") is not False:
        return None
    fraction = summary["bitwise_equal_fraction_min"]
    return (
        f"the bitwise claim does not hold: {summary['own_version_samples_not_bitwise']} of "
        f"{summary['own_version_samples_scored']} samples scored with the weights that sampled them differ from "
        f"vLLM's logprobs (bitwise-equal fraction min {'undefined' if fraction is None else f'{fraction:.4g}'}), and "
        f"{summary['fresh_samples_with_is_ratio_not_one']} of {summary['fresh_samples']} samples of the learner's "
        "own version have an IS ratio != 1"
    )


def run_demo_command(algo: str, kernels: str, lag: int, updates: int, seed: int, out: str | None,
                     turns: int = 1, model: str = "dense",
                     lora_rank: int | None = None, note=None, dtype: str = "float32",
                     learning_rate: float = 1e-4, fixed_lag: bool = False) -> int:
    """``zmrl demo``: 0 when the run finished and its claims hold; 1 when the aligned kernels' bitwise
    claim failed; 2 for a refused option or an output that could not be written. ``note``: the
    interrupt note of ``cli.run_interruptible``, told what the run has kept so far."""
    _quiet_defaults()
    try:
        config = validated_config(algo, kernels, lag, updates, seed, turns, model, lora_rank, dtype, learning_rate,
                                  fixed_lag)
        out_dir = prepare_out_dir(out)
    except ValueError as error:
        print(f"ERROR: {error}", file=sys.stderr)
        return 2
    try:
        return _run_demo(config, out_dir, note)
    finally:
        release_out_dir(out_dir)


def _run_demo(config, out_dir: Path, note) -> int:
    from tqdm import tqdm

    from zero_mismatch_plugin.tools.tiny_models import build_tiny_model

    from zero_mismatch_plugin.tools.demo.engine import start_engine
    from zero_mismatch_plugin.tools.demo.outputs import METRICS_FILE, MetricsLog, OutputsNotWritten, format_summary, write_outputs
    from zero_mismatch_plugin.tools.demo.runner import DEMO_MODELS, DemoRun

    started = time.perf_counter()
    metrics_path = out_dir / METRICS_FILE

    def kept(done: int) -> None:
        if note is None:
            return
        if done:
            note.keep(f"{done} of {config.updates} updates done, their metrics kept in {metrics_path} "
                      f"(zmrl report {metrics_path})")
        else:
            note.keep(f"no update had finished, nothing was measured (the model is in {out_dir}/model)")

    kept(0)
    print(f"zmrl demo -> {out_dir}/")
    family, description = DEMO_MODELS[config.model]
    print(f"building {description} and its tokenizer, seed {config.seed}")
    model_dir = build_tiny_model(out_dir / "model", family=family, seed=config.seed)
    print(f"starting the vLLM engine in its own process (CPU, {config.dtype}, consistent numerics; about 10 s)")
    if config.lora_rank is not None:
        print(f"LoRA: frozen base, rank-{config.lora_rank} adapter on every linear, "
              "a new adapter version served after every update")
    log = MetricsLog(metrics_path)
    try:
        with start_engine(model_dir, config.max_model_len, lora_rank=config.lora_rank, dtype=config.dtype) as engine:
            run = DemoRun(config, engine, model_dir)
            print(f"task: {run.task.describe(config.response_tokens)}; chance {run.task.chance_reward:.3f}")
            with tqdm(total=config.updates, desc="updates", unit="upd", dynamic_ncols=True) as bar:

                def progress(record):
                    log.append(record)
                    kept(log.lines)
                    m = record.metrics
                    bar.set_postfix(
                        reward=f"{m['critic/score/mean']:.3f}",
                        lag=int(m["training/off_policy/trajectory_staleness/max"]),
                        bitwise=f"{m.get('demo/own_version/bitwise_equal_fraction', float('nan')):.3f}",
                        refresh=False,
                    )
                    bar.update(1)

                result = run.run(progress)
    finally:
        log.close()
    unwritten = {}
    try:
        summary = write_outputs(result, out_dir, metrics_log=log)
    except OutputsNotWritten as error:
        summary, unwritten = error.summary, error.failures
    print(format_summary(summary, out_dir))
    print(f"wall time {time.perf_counter() - started:.0f} s")
    for path, why in unwritten.items():
        print(f"ERROR: could not write {path}: {why}; the other files are kept in {out_dir}/", file=sys.stderr)
    failure = _bitwise_failure(summary)
    if failure is not None:
        print(f"ERROR: {failure}; outputs in {out_dir}/", file=sys.stderr)
        return 1
    return 2 if unwritten else 0


def run_compare_command(seeds: list[int] | None, updates: int | None, lag: int | None, out: str | None,
                        note=None, dtype: str = "float32", learning_rate: float = 1e-4,
                        fixed_lag: bool = False) -> int:
    """Every comparison variant for every seed, one engine; the comparison table and figures in ``out``."""
    _quiet_defaults()
    from zero_mismatch_plugin.tools.demo.compare import DEFAULT_LAG, DEFAULT_SEEDS, DEFAULT_UPDATES, CompareConfig
    from zero_mismatch_plugin.tools.demo.runner import DemoRun  # noqa: F401 - fail on a broken install before the engine starts

    try:
        from zero_mismatch_plugin.tables.switches import cpu_kv_cache_space
        cpu_kv_cache_space()  # refuse a KV-cache size the engine would die on, before any work
        config = CompareConfig(seeds=DEFAULT_SEEDS if seeds is None else seeds,
                               updates=DEFAULT_UPDATES if updates is None else updates,
                               lag=DEFAULT_LAG if lag is None else lag, dtype=dtype, learning_rate=learning_rate,
                               fixed_lag=fixed_lag)
        out_dir = prepare_out_dir(out)
    except ValueError as error:
        print(f"ERROR: {error}", file=sys.stderr)
        return 2
    if note is not None:
        note.keep(f"the runs that finished are kept under {out_dir}/ (the comparison over every finished seed)")
    try:
        return _run_compare(config, out_dir)
    finally:
        release_out_dir(out_dir)


def _run_compare(config, out_dir: Path) -> int:
    from zero_mismatch_plugin.tools.report.compare import COMPARE_TEXT, FIGURE1, FIGURE3, PLOTS_DIR
    from zero_mismatch_plugin.tools.tiny_models import build_tiny_model

    from zero_mismatch_plugin.tools.demo.compare import run_compare
    from zero_mismatch_plugin.tools.demo.engine import start_engine

    started = time.perf_counter()
    runs = len(config.seeds) * len(config.selected)
    print(f"zmrl demo --compare -> {out_dir}/")
    print(f"{len(config.selected)} variants x seeds {list(config.seeds)}, {config.updates} updates each, "
          f"lag {config.lag}{' exactly' if config.fixed_lag else ' at most'} (the synchronous reference: 0), "
          f"learning rate {config.learning_rate}")
    model_dirs = {seed: build_tiny_model(out_dir / "models" / f"seed-{seed}", family="llama", seed=seed)
                  for seed in config.seeds}
    print(f"starting the vLLM engine in its own process (CPU, {config.dtype}, consistent numerics; about 10 s)")
    done = []

    def progress(variant, seed, result):
        done.append(1)
        rewards = [r.metrics["critic/score/mean"] for r in result.records]
        window = config.window
        print(f"[{len(done)}/{runs}] seed {seed} {variant.name:<24} {len(rewards) / result.loop_seconds:5.2f} upd/s  "
              f"reward {sum(rewards[:window]) / window:.3f} -> {sum(rewards[-window:]) / window:.3f}", flush=True)

    with start_engine(model_dirs[config.seeds[0]], config.max_model_len, dtype=config.dtype) as engine:
        run_compare(config, out_dir, engine, model_dirs.__getitem__, progress)
    print((out_dir / COMPARE_TEXT).read_text())
    print(f"table:   {out_dir / COMPARE_TEXT} (and compare.json)")
    print(f"figures: {out_dir / PLOTS_DIR / FIGURE1}, {out_dir / PLOTS_DIR / FIGURE3}")
    print(f"wall time {time.perf_counter() - started:.0f} s")
    return 0
