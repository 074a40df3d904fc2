"""verl on the CPU: seconds per verl step (sync vs async; FSDP and Megatron engines), and the
aligned actor forward's cost inside verl's engines vs verl's stock forward.

Two parts, either or both:

* ``--part forward``: one verl ``FSDPEngineWithLMHead`` (fsdp2, fp32, the CPU platform, one gloo
  rank) built in this process from the cpu_smoke model; the same micro-batch goes through verl's
  ``forward_step`` with the aligned patch (``fsdp_engine``) removed and applied, in alternating
  order, so load from other processes hits both alike, ``--repeats`` rounds or more until the
  ratio settles (up to ``--max-repeats``). Timed: the no-grad forward (verl's old-logprob
  recompute) and forward + backward (the training micro-step), at the default torch thread count
  and again at one thread (this part has the one-thread variant). With ``--engine megatron`` (or
  both): verl's ``MegatronEngineWithLMHead`` built twice here as ``cpu_smoke_megatron`` configures
  its actor (mbridge, fp32, one gloo rank), once from the aligned spec and once stock; the same
  micro-batch goes through ``infer_batch`` (the old-logprob pass) and ``forward_backward_batch``
  (the training micro-step, without the optimizer step) of each, alternating, the engine patch
  applied for the aligned engine's calls and removed for the stock one's.
* ``--part step``: ``zmrl recipes run cpu_smoke`` (real verl processes: Ray, vLLM rollout,
  FSDP actor) in ``trainer.v1.trainer_mode=sync`` and ``colocate_async``, and ``cpu_smoke_megatron``
  (verl's Megatron engine) aligned and stock (``--allow-unaligned-trainer``), alternating; verl's own
  ``timing_s/step``, ``old_log_prob`` (the actor's forward) and ``update_actor`` (forward + backward
  + optimizer) of every step after the first (the first pays for warm-up). No one-thread variant
  and no repeats until stable here: each run is a whole verl run in its own processes; at least
  four steps per side (e.g. ``--step-repeats 2``) are needed to tell whether the ratio settled.

Prints the host's load, CPUs and torch threads before and after, and per side: minimum and median
ms, spread ((p75 - p25) / median), median CPU ms of this process (the forward part; "-" in the step
part, whose work is other processes'), and the ratio of the minima and of the medians; rows are
flagged UNRELIABLE when the host was loaded or the ratio did not settle.

    .venv/bin/python benchmarks/bench_verl_cpu_step.py [--part forward|step|both] [--engine fsdp|megatron|both]
        [--repeats 5] [--batch 4] [--steps 4] [--step-repeats 1]
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from timing import (Comparison, Samples, add_timing_arguments, at_threads, compare, format_rows, halves_agree,
                    host_is_loaded, host_line, row_header, thread_counts)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


# ----- the actor forward inside verl's engine ---------------------------------------------------


def _one_rank(work: Path) -> None:
    """This process as the one gloo rank of verl's engines built here, on verl's CPU platform."""
    import torch.distributed as dist

    import zero_mismatch_plugin.integrations.verl.cpu  # noqa: F401  registers verl's CPU platform

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.FileStore(str(work / "store"), 1), rank=0, world_size=1)


def _engine(model_dir: Path, work: Path):
    """verl's FSDP actor engine as cpu_smoke configures it, in this process (one gloo rank)."""
    _one_rank(work)
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.config.checkpoint import CheckpointConfig
    from verl.workers.engine import EngineRegistry

    model_config = HFModelConfig(path=str(model_dir), use_remove_padding=False, enable_gradient_checkpointing=False,
                                 override_config={"attn_implementation": "sdpa"})
    engine_config = FSDPEngineConfig(strategy="fsdp2", model_dtype="fp32", dtype="float32", use_torch_compile=False,
                                     mixed_precision={"param_dtype": "fp32", "reduce_dtype": "fp32",
                                                      "buffer_dtype": "fp32"})
    engine_config.use_remove_padding = False
    optimizer_config = FSDPOptimizerConfig(lr=1e-3, total_training_steps=10)
    engine = EngineRegistry.new(model_type="language_model", backend="fsdp2", model_config=model_config,
                                engine_config=engine_config, optimizer_config=optimizer_config,
                                checkpoint_config=CheckpointConfig())
    engine.initialize()
    return engine


def _micro_batch(batch: int, prompt_len: int, response_len: int, vocab: int):
    import torch
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    generator = torch.Generator().manual_seed(0)
    lengths = [prompt_len + response_len] * batch
    ids = [torch.randint(0, vocab, (n,), generator=generator) for n in lengths]
    micro_batch = TensorDict({
        "input_ids": torch.nested.as_nested_tensor(ids, layout=torch.jagged),
        "position_ids": torch.nested.as_nested_tensor([torch.arange(n) for n in lengths], layout=torch.jagged),
        "temperature": torch.ones(batch),
    }, batch_size=[batch])
    tu.assign_non_tensor(micro_batch, use_remove_padding=False)
    return micro_batch


def _print_comparison(title: str, comparison, baseline: str) -> None:
    print(f"  {title}: {comparison.line()}")
    print("  " + row_header(20))
    for row in format_rows(comparison, baseline=baseline, name_width=20):
        print(f"  {row}")


def _measure_and_print(args, contenders: dict, switch: dict, engine_words: str) -> None:
    """``contenders``: {"forward": {side: call}, "forward+backward": {side: call}}, each side's
    ``switch`` run untimed before its calls; compared at each thread count, then printed."""
    def measure():
        return {kind: compare(calls, repeats=args.repeats, warmup=1, max_repeats=args.max_repeats, setup=switch)
                for kind, calls in contenders.items()}

    results = {threads: at_threads(threads, measure) for threads in thread_counts(args)}
    tokens = args.batch * (args.prompt_len + args.response_len)
    print(f"{engine_words}, micro-batch {args.batch} x {args.prompt_len + args.response_len} tokens ({tokens}), "
          f"alternating order, {args.repeats} rounds or more until the ratio settles; ratios: side / stock")
    for threads, kinds in results.items():
        for kind, comparison in kinds.items():
            _print_comparison(f"{kind}, torch threads {threads}", comparison, "stock")


def bench_forward(args) -> None:
    import torch

    from zero_mismatch_plugin.integrations.verl import fsdp_engine
    from zero_mismatch_plugin.tools.smoke_assets import build_smoke_model

    work = Path(tempfile.mkdtemp(prefix="zmrl-bench-verl-"))
    model_dir = build_smoke_model(work / "model")
    engine = _engine(model_dir, work)
    micro_batch = _micro_batch(args.batch, args.prompt_len, args.response_len, engine.module.config.vocab_size)

    def no_grad():
        with torch.no_grad():
            engine.forward_step(micro_batch, loss_function=None, forward_only=True)

    def with_grad():
        def loss_function(model_output, data, dp_group):
            return model_output["log_probs"].values().sum(), {}

        loss, _ = engine.forward_step(micro_batch, loss_function=loss_function, forward_only=False)
        loss.backward()
        engine.optimizer_zero_grad()

    # The patch is switched untimed before every call; the first aligned call (warm-up) builds the
    # vLLM runtime and ops.
    switch = {"stock": fsdp_engine.remove, "aligned": fsdp_engine.apply}
    _measure_and_print(args, {"forward": {"stock": no_grad, "aligned": no_grad},
                              "forward+backward": {"stock": with_grad, "aligned": with_grad}}, switch,
                       "verl FSDPEngineWithLMHead.forward_step, fsdp2 fp32, 1 rank, cpu_smoke model")
    fsdp_engine.remove()


def _megatron_engine(model_dir: Path, work: Path, aligned: bool):
    """verl's Megatron actor engine as cpu_smoke_megatron configures it (the recipe composed as
    ``zmrl recipes run`` composes it), in this process; ``aligned``: built from the aligned spec
    (the engine patch applied while it builds), else verl's own modules."""
    _one_rank(work)
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.engine import EngineRegistry

    from zero_mismatch_plugin.integrations.verl import megatron_engine
    from zero_mismatch_plugin.tools.recipes import compose_recipe

    cfg = compose_recipe("cpu_smoke_megatron", [f"actor_rollout_ref.model.path={model_dir}"])
    model_config = omega_conf_to_dataclass(cfg.actor_rollout_ref.model)
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    actor.engine.use_remove_padding = model_config.get("use_remove_padding", False)
    actor.optim.total_training_steps = 10  # verl's trainer sets it from the data; the schedule needs one
    (megatron_engine.apply if aligned else megatron_engine.remove)()
    engine = EngineRegistry.new(model_type="language_model", backend="megatron", model_config=model_config,
                                engine_config=actor.engine, optimizer_config=actor.optim,
                                checkpoint_config=actor.checkpoint)
    engine.initialize()
    return engine


def _megatron_batch(batch: int, prompt_len: int, response_len: int, vocab: int):
    """A batch as verl's actor hands it to the Megatron engine: packed sequences, the responses'
    loss mask, one micro-batch."""
    import torch
    from verl.utils import tensordict_utils as tu

    data = _micro_batch(batch, prompt_len, response_len, vocab)
    n = prompt_len + response_len
    mask = torch.cat([torch.zeros(prompt_len), torch.ones(response_len)])
    data["loss_mask"] = torch.nested.as_nested_tensor([mask.clone() for _ in range(batch)], layout=torch.jagged)
    tu.assign_non_tensor(data, use_remove_padding=True, use_dynamic_bsz=False, micro_batch_size_per_gpu=batch,
                         max_token_len_per_gpu=batch * n, use_fused_kernels=False)
    return data


def bench_forward_megatron(args) -> None:
    from zero_mismatch_plugin.integrations.verl import megatron_engine
    from zero_mismatch_plugin.tools.smoke_assets import build_smoke_model

    work = Path(tempfile.mkdtemp(prefix="zmrl-bench-verl-megatron-"))
    model_dir = build_smoke_model(work / "model")
    engines = {"stock": _megatron_engine(model_dir, work, aligned=False),
               "aligned": _megatron_engine(model_dir, work, aligned=True)}
    for name, engine in engines.items():  # the aligned engine computes with the plugin's modules, the stock one not
        plugin_modules = any(type(m).__module__.startswith("zero_mismatch_plugin.") for m in engine.module[0].modules())
        if plugin_modules != (name == "aligned"):
            raise SystemExit(f"the {name} engine was built {'without' if name == 'aligned' else 'with'} the aligned spec")
    vocab = engines["stock"].model_config.hf_config.vocab_size
    data = _megatron_batch(args.batch, args.prompt_len, args.response_len, vocab)

    def loss_function(model_output, data, dp_group):
        return model_output["log_probs"].values().sum(), {}

    def forward(engine):
        def call():
            with engine.eval_mode():
                engine.infer_batch(data.clone())
        return call

    def forward_backward(engine):
        def call():
            with engine.train_mode():
                engine.forward_backward_batch(data.clone(), loss_function, forward_only=False)
            engine.optimizer_zero_grad()
        return call

    # The patch is switched untimed before every call: applied for the aligned engine, removed for verl's own.
    switch = {"stock": megatron_engine.remove, "aligned": megatron_engine.apply}
    _measure_and_print(args, {kind: {name: make(engine) for name, engine in engines.items()}
                              for kind, make in (("forward", forward), ("forward+backward", forward_backward))},
                       switch, "verl MegatronEngineWithLMHead (mbridge, fp32, 1 rank, cpu_smoke model), aligned vs "
                               "stock engine")
    megatron_engine.remove()


# ----- seconds per verl step ------------------------------------------------------------------


def _run_seconds(work: Path, name: str, inputs: dict, overrides: list[str], recipe: str, steps: int) -> dict:
    """verl's own timings of one run's steps after the first (the first pays for warm-up)."""
    from zero_mismatch_plugin.integrations.verl.cpu.launch import run_smoke

    run = run_smoke(work / name, inputs, [*overrides, f"trainer.total_training_steps={steps}",
                                          f"trainer.default_local_dir={work / 'checkpoints' / name}"],
                    timeout_s=3600, recipe=recipe)
    if run.returncode != 0:
        raise SystemExit(f"{name} run failed; log: {work / name / 'log.txt'}")
    return {key: run.metric(f"timing_s/{key}")[1:] for key in STEP_TIMINGS}


# verl's timings per step: the whole step, the actor's no-grad logprob pass (old_log_prob: the
# forward), and its update (forward + backward + optimizer step on every mini-batch).
STEP_TIMINGS = ("step", "old_log_prob", "update_actor")


def _step_comparison(seconds: dict, sides: tuple[str, ...], key: str, loaded: tuple[bool, bool]) -> Comparison:
    """verl's ``key`` timings of ``sides`` as a comparison (no CPU time: verl's processes did the
    work); "settled" says whether the ratio agrees between the earlier and the later steps."""
    samples = {side: Samples(list(seconds[side][key]), []) for side in sides}
    first, *others = samples.values()
    settled = all(halves_agree(first, other) for other in others)
    threads = 0  # verl's processes' own threads, not this process's setting
    return Comparison(samples, len(first.walls), settled, *loaded, threads)


def bench_step(args) -> None:
    from zero_mismatch_plugin.integrations.verl.cpu.launch import MEGATRON_RECIPE_NAME, RECIPE_NAME
    from zero_mismatch_plugin.tools.smoke_assets import build_smoke_inputs

    work = Path(tempfile.mkdtemp(prefix="zmrl-bench-verl-step-"))
    inputs = build_smoke_inputs(work / "inputs", count=64)
    runs = {}
    if args.engine in ("fsdp", "both"):
        runs["sync"] = (RECIPE_NAME, ["trainer.v1.trainer_mode=sync"])
        # lag 1: the next batch is sampled with the old weights while the actor trains.
        runs["colocate_async"] = (RECIPE_NAME, ["trainer.v1.trainer_mode=colocate_async"])
    if args.engine in ("megatron", "both"):
        # verl's Megatron engine, synchronous: the aligned spec, and verl's own forward of the same model.
        runs["megatron_aligned"] = (MEGATRON_RECIPE_NAME, [])
        runs["megatron_stock"] = (MEGATRON_RECIPE_NAME, ["--allow-unaligned-trainer"])
    seconds = {name: {key: [] for key in STEP_TIMINGS} for name in runs}
    loaded_before = host_is_loaded()
    for repeat in range(args.step_repeats):
        for name, (recipe, overrides) in runs.items():
            for key, values in _run_seconds(work, f"{name}-{repeat}", inputs, overrides, recipe, args.steps).items():
                seconds[name][key] += values
    loaded = (loaded_before, host_is_loaded())
    print(f"verl's own timings per step (cpu_smoke recipes, {args.steps} steps per run, first step excluded, "
          f"{args.step_repeats} alternating run(s) each); CPU: not measured (verl's processes)")
    pairs = []
    if "sync" in seconds:
        pairs.append(("FSDP engine, colocate_async vs sync", ("colocate_async", "sync")))
    if "megatron_aligned" in seconds:
        pairs.append(("verl's Megatron engine, aligned vs stock actor", ("megatron_aligned", "megatron_stock")))
    for title, sides in pairs:
        print(f"{title}; ratios: side / {sides[-1]}")
        for key in STEP_TIMINGS:
            comparison = _step_comparison(seconds, sides, key, loaded)
            print(f"  {key}: {comparison.rounds} steps per side, ratio "
                  f"{'' if comparison.settled else 'not '}settled between the earlier and the later steps")
            print("  " + row_header(20))
            for row in format_rows(comparison, baseline=sides[-1], name_width=20):
                print(f"  {row}")
        for side in sides:
            print(f"  every step, {side}: {', '.join(f'{v:.2f}' for v in seconds[side]['step'])} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("forward", "step", "both"), default="both")
    parser.add_argument("--engine", choices=("fsdp", "megatron", "both"), default="both",
                        help="which engine the forward part builds and the step part's runs use")
    for flag, default in (("--repeats", 5), ("--batch", 4), ("--prompt-len", 24), ("--response-len", 8),
                          ("--steps", 4), ("--step-repeats", 1)):
        parser.add_argument(flag, type=int, default=default)
    add_timing_arguments(parser)
    args = parser.parse_args()
    # verl's CPU platform for the engine built here: chosen before the plugin or verl is imported.
    os.environ["ZMRL_VERL_PLATFORM"] = "cpu"
    print(host_line("before"), flush=True)
    if args.part in ("step", "both"):
        bench_step(args)  # subprocesses first: the forward part initializes a process group here
    if args.part in ("forward", "both") and args.engine in ("fsdp", "both"):
        bench_forward(args)
    if args.part in ("forward", "both") and args.engine in ("megatron", "both"):
        bench_forward_megatron(args)
    print(host_line("after"))


if __name__ == "__main__":
    main()
