"""Session-wide fixtures: tiny local checkpoints, one live vLLM engine, aligned trainers."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

# vLLM reads these when its processes start; set before anything imports vLLM.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# One thread per process (two pytest workers share 2 cores), and each engine the suite starts runs
# its tiny model in one process, as a one-thread worker would: ~10 s sooner per engine start.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("ZMRL_CPU_ENGINE_ONE_PROCESS", "1")
# ... forked from the test process, which has vLLM imported already: ~15 s sooner again.
os.environ.setdefault("ZMRL_CPU_ENGINE_FORK", "1")
from zero_mismatch_plugin.tables.switches import default_cpu_kv_cache_space  # noqa: E402

default_cpu_kv_cache_space()  # 1 GiB unless set; a value vLLM's CPU engine would die on stops the session here

from support.engine_pool import EnginePool  # noqa: E402
from support.vllm_session import MAX_MODEL_LEN, Engines, prompts_for, rollout  # noqa: E402

ENGINE_POOLS = []  # this process's pool, for the summary of engine starts
SHARED = {}  # the session's engines and trainers, once created


# DeepSeek-V3's rope scaling, shrunk: yarn over 4x the 128 original positions, mscale in the softmax scale.
MLA_YARN_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
                 "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """Tiny random checkpoints, built once: family -> directory."""
    from zero_mismatch_plugin.tools.tiny_models import (
        MOE_FAMILIES,
        build_tiny_kimi_linear_model,
        build_tiny_mla_model,
        build_tiny_model,
        build_tiny_qwen3_next_model,
    )

    root = tmp_path_factory.mktemp("tiny_models")
    return {
        "llama": build_tiny_model(root / "llama", family="llama", seed=1),
        "qwen3": build_tiny_model(root / "qwen3", family="qwen3", seed=2),
        "mistral": build_tiny_model(root / "mistral", family="mistral", seed=4),
        # Every layer windowed; the window (12) is shorter than most prompts and every prompt + response.
        "mistral_window": build_tiny_model(root / "mistral_window", family="mistral", seed=5, sliding_window=12),
        # Interleaved local/global layers (CWM): layers 0 and 2 windowed (12 tokens), 1 and 3 full.
        "cwm_window": build_tiny_model(root / "cwm_window", family="cwm", seed=6, num_hidden_layers=4),
        # down_proj K = 2816: on some hosts vLLM's CPU GEMM rounds one-row calls differently at this K.
        "llama_wide": build_tiny_model(
            root / "llama_wide", family="llama", seed=3, intermediate_size=2816, num_hidden_layers=1
        ),
        # Mixture-of-Experts: 8 experts, top-2; "qwen3_moe_padded" has an expert width vLLM pads (80 -> 96).
        **{f: build_tiny_model(root / f, family=f, seed=5) for f in MOE_FAMILIES},
        "qwen3_moe_padded": build_tiny_model(root / "qwen3_moe_padded", family="qwen3_moe", seed=6,
                                             moe_intermediate_size=80),
        # Multi-head latent attention (dense MLPs): DeepSeek-V2 as is; DeepSeek-V3 with a query
        # low-rank projection and yarn rope scaling (vLLM's deepseek_yarn, mscale in the softmax scale).
        "deepseek_v2": build_tiny_mla_model(root / "deepseek_v2", seed=7),
        "deepseek_v3_yarn": build_tiny_mla_model(root / "deepseek_v3_yarn", seed=8, architecture="deepseek_v3",
                                                 q_lora_rank=96, rope_parameters=MLA_YARN_ROPE),
        # DeepSeek-V3 MLA with its MoE from the second layer on (sigmoid routing in groups, a shared expert).
        "deepseek_v3_moe": build_tiny_mla_model(root / "deepseek_v3_moe", seed=9, architecture="deepseek_v3",
                                                first_k_dense_replace=1),
        # DeepSeek-V2 MLA with its MoE: softmax top-k over all experts (greedy) and over the best group
        # of two (group_limited_greedy), both with a routed scale on the output.
        **{f"deepseek_v2_moe_{method}": build_tiny_mla_model(
            root / f"deepseek_v2_moe_{method}", seed=seed, first_k_dense_replace=1,
            moe_routing=dict(topk_method=method, scoring_func="softmax", n_group=groups, topk_group=1,
                             routed_scaling_factor=scale))
           for method, groups, scale, seed in (("greedy", 1, 2.5, 10), ("group_limited_greedy", 2, 1.5, 11))},
        # Linear-attention hybrid (bf16 only on CPU): gated delta-net layers 0, 1, 3, gated full attention 2.
        "qwen3_next": build_tiny_qwen3_next_model(root / "qwen3_next", seed=12),
        # Kimi Linear: two Kimi Delta Attention layers, a dense MLP then Kimi's MoE (fp32 and bf16 on CPU).
        "kimi_linear": build_tiny_kimi_linear_model(root / "kimi_linear", seed=13, first_moe_layer=1),
    }


@pytest.fixture(scope="session")
def engine_pool():
    """Every engine the session's tests share, keyed by engine configuration (support/engine_pool.py)."""
    pool = EnginePool()
    ENGINE_POOLS.append(pool)
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def engines(engine_pool, checkpoints):
    SHARED["engines"] = Engines(engine_pool, checkpoints)
    return SHARED["engines"]


@pytest.fixture(scope="module")
def consistent_mode():
    """Consistent numerics while a module's tests run, undone afterwards.

    Engines read ZMRL_NUMERICS when they are created (inside these tests), a GPU trainer needs
    vLLM's batch-invariant mode in this process; the rest of the test session sees neither.
    """
    from zero_mismatch_plugin.aligned.numerics import consistent_numerics

    with consistent_numerics():
        yield


@pytest.fixture(scope="module", autouse=True)
def _checkpoint_weights_for_the_next_module():
    """A test may train a shared trainer and sync its engine (the pair stays equal); the next
    module gets both fresh from the checkpoint."""
    yield
    engines, trainers = SHARED.get("engines"), SHARED.get("trainers")
    for name, llm in engines.updated.items() if engines else ():
        engines.pool.discard(llm)  # by the object: the environment it started in may be gone by now
        if trainers:
            trainers.forget(name)
    if engines:
        engines.updated.clear()


@pytest.fixture(scope="session")
def trainers(checkpoints):
    """Aligned trainer models (one per checkpoint), created on first use."""
    from zero_mismatch_plugin.faces.aligned_model import AlignedCausalLM

    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = AlignedCausalLM.from_pretrained(
                checkpoints[name], max_model_len=MAX_MODEL_LEN, seed=0
            )
        return cache[name]

    get.forget = lambda name: cache.pop(name, None)  # a test changed its weights
    SHARED["trainers"] = get
    return get


# What megatron-core writes into os.environ whenever it builds a model (LanguageModule's attention
# backend check sets all three; a later build with another backend asserts against them). A module
# that builds a Megatron model in the test process would hand them to a later module's verl run on
# the same worker, whose Megatron engine then refuses its own backend: each module leaves them as
# it found them.
MEGATRON_ATTENTION_ENV = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")


@pytest.fixture(scope="module", autouse=True)
def megatron_attention_env_as_found():
    found = {name: os.environ.get(name) for name in MEGATRON_ATTENTION_ENV}
    yield
    for name, value in found.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture
def make_rollout():
    return rollout


@pytest.fixture
def make_prompts():
    return prompts_for


# Seconds each module took in a recorded run of the suite (``--record-module-durations``). Under
# ``--dist loadscope`` a worker takes whole work units (a module, or the group of modules below) in
# collection order: the longest go out first (longest-processing-time order), so that the suite
# does not end with one worker running a long unit while the other idles. A module missing from
# the table counts as the longest.
MODULE_DURATIONS = Path(__file__).with_name("module_durations.json")
# Modules whose tests start several compute processes at once (verl's whole trainer: a Ray cluster,
# vLLM replicas, trainer ranks; torchrun rank groups; tensor-parallel engines): one work unit, so
# that one worker runs them one after another while the other runs the one-process modules. Two of
# them at once on two cores ran ~2x slower each (the TP2 x EP2 verl run 249 s vs 101 s alone) and
# took the host to 19.8 of its 23.5 GiB (a verl run beside the TP-4 rank group and engine), near
# where Ray's memory monitor kills a worker and the verl run hangs to its timeout.
MULTI_PROCESS_MODULES = ("tests/integrations/verl/cpu/test_main_ppo_megatron.py",
                         "tests/integrations/verl/cpu/test_main_ppo_moe.py",
                         "tests/faces/megatron/test_megatron_tensor_parallel.py",
                         "tests/faces/megatron/test_megatron_two_rank_layouts.py",
                         "tests/faces/megatron/test_megatron_reduction_order.py",
                         "tests/faces/fsdp/test_fsdp_data_parallel.py",
                         "tests/fork_patches/test_cpu_training_patches.py")
MULTI_PROCESS_UNIT = "multi-process-runs"


def work_unit(module: str) -> str:
    """The xdist work unit of a test module (its path unless grouped)."""
    return MULTI_PROCESS_UNIT if module in MULTI_PROCESS_MODULES else module


@pytest.hookimpl(optionalhook=True)  # an xdist hook: the suite also runs with -p no:xdist
def pytest_xdist_make_scheduler(config, log):
    """xdist's loadscope scheduling over :func:`work_unit` instead of modules. (xdist 3.8's
    ``loadgroup`` marks do not reach the scheduler under this pytest: it renames ``item._nodeid``,
    which pytest no longer reads.)"""
    if config.getoption("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class WorkUnitScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid.split("::", 1)[0])

    return WorkUnitScheduling(config, log)


def pytest_addoption(parser):
    parser.addoption("--record-module-durations", metavar="PATH", default=None,
                     help="write each test module's total seconds (setup, call, teardown) as JSON to PATH")


def _recorded_durations() -> dict:
    import json

    return json.loads(MODULE_DURATIONS.read_text()) if MODULE_DURATIONS.exists() else {}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    durations = _recorded_durations()
    unknown = max(durations.values(), default=0.0) + 1.0
    modules = {item: Path(item.path).relative_to(config.rootpath).as_posix() for item in items}
    unit_seconds = {}
    for module in set(modules.values()):
        unit = work_unit(module)
        unit_seconds[unit] = unit_seconds.get(unit, 0.0) + durations.get(module, unknown)

    def longest_unit_first(item):
        unit = work_unit(modules[item])
        return -unit_seconds[unit], unit

    items.sort(key=longest_unit_first)  # stable: a unit's tests stay together and keep their order


MODULE_SECONDS: dict = {}
# On the xdist controller, per worker: [seconds of its reports, seconds since the start at its last].
WORKER_SECONDS: dict = {}
STARTED = time.monotonic()


def pytest_runtest_logreport(report):
    """Per module, the seconds of every phase of its tests (on the xdist controller: every worker's),
    and per xdist worker its busy seconds and when it last reported (the schedule's balance)."""
    module = report.nodeid.split("::")[0]
    MODULE_SECONDS[module] = MODULE_SECONDS.get(module, 0.0) + report.duration
    node = getattr(report, "node", None)  # set by xdist on the controller
    if node is not None:
        busy = WORKER_SECONDS.setdefault(node.gateway.id, [0.0, 0.0])
        busy[0] += report.duration
        busy[1] = time.monotonic() - STARTED


def _engine_summary(pools) -> dict:
    started = [start for pool in pools for start in pool.started]
    return {"started": len(started), "seconds": round(sum(s for _, s in started), 1),
            "reused": sum(pool.reused for pool in pools)}


def pytest_sessionfinish(session):
    import json

    if hasattr(session.config, "workeroutput"):  # an xdist worker: hand the figures to the controller
        session.config.workeroutput["engine_pool"] = json.dumps(_engine_summary(ENGINE_POOLS))
        return
    path = session.config.getoption("--record-module-durations")
    if path:
        ordered = dict(sorted(((m, round(s, 1)) for m, s in MODULE_SECONDS.items()), key=lambda kv: -kv[1]))
        Path(path).write_text(json.dumps(ordered, indent=1) + "\n")


ENGINE_SUMMARIES = []


@pytest.hookimpl(optionalhook=True)  # an xdist hook
def pytest_testnodedown(node, error):
    import json

    if "engine_pool" in getattr(node, "workeroutput", {}):
        ENGINE_SUMMARIES.append(json.loads(node.workeroutput["engine_pool"]))


def pytest_terminal_summary(terminalreporter):
    summaries = ENGINE_SUMMARIES or ([_engine_summary(ENGINE_POOLS)] if ENGINE_POOLS else [])
    if summaries:
        terminalreporter.write_line(
            f"shared engines: {sum(s['started'] for s in summaries)} started "
            f"({sum(s['seconds'] for s in summaries):.0f} s), {sum(s['reused'] for s in summaries)} requests reused one")
    if WORKER_SECONDS:
        unit = sum(seconds for module, seconds in MODULE_SECONDS.items() if module in MULTI_PROCESS_MODULES)
        terminalreporter.write_line(
            "workers: " + "; ".join(f"{worker} busy {busy:.0f} s, last report at {last:.0f} s"
                                    for worker, (busy, last) in sorted(WORKER_SECONDS.items()))
            + f"; the multi-process unit {unit:.0f} s")

    """Counts of tests/tools/test_bad_input.py by outcome (the measure of the bad-input table)."""
    from collections import Counter

    counts = Counter()
    for reports in terminalreporter.stats.values():
        for report in reports:
            if getattr(report, "when", None) != "call":
                continue
            for key, value in getattr(report, "user_properties", ()):
                if key == "bad_input_outcome":
                    counts[value] += 1
    if counts:
        tried = sum(counts.values())
        terminalreporter.write_line(
            f"bad input: {tried} tried, {counts['clear_error']} clear error, "
            f"{counts['documented_result']} documented result, {counts['traceback']} traceback, "
            f"{counts['silent']} silent"
        )
