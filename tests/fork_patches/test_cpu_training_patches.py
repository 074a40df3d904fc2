"""The fork forms of the CPU-platform patches of megatron-core and mbridge, run on two CPU ranks: the
patched upstream trains / loads and exports with none of the plugin imported.

Each test starts a two-rank group (``tests/support/megatron_cpu_training.py``,
``mbridge_cpu_loading.py``), so this module is one of the suite's multi-process modules
(``tests/conftest.py``: it never runs beside another rank group).
"""

from __future__ import annotations

from support.forked_ranks import ranks_saw

from zero_mismatch_plugin import fork_patches


def test_megatron_cpu_training_runs_without_the_runtime_patches(patched_megatron, tmp_path):
    """The fork form of the runtime patches "megatron-core on a CPU": megatron-core with the patch
    trains on two CPU ranks with none of the plugin imported — experts over the ranks (all-to-all
    dispatcher, megatron's router), bf16 parameters and megatron's mixed-precision optimizer with
    gradient clipping, dropout under its RNG tracker, packed sequences in its local attention, a
    distributed checkpoint, two pipeline stages with a tied embedding — and every rank's weights
    after each step are the bits the installed megatron-core gives with the runtime patches."""
    patched = ranks_saw("megatron_cpu_training.py", "patched", patched_megatron, tmp_path / "patched")
    assert all(isinstance(rank, dict) for rank in patched), patched
    for rank in patched:
        assert rank["megatron"].startswith(str(patched_megatron)) and not rank["plugin_imported"]
        assert rank["experts"]["updated"] and rank["pipeline"]["updated"]
        assert {"metadata.json", "common.pt"} <= set(rank["checkpoint"])
    assert patched[0]["experts"]["weights"] != patched[1]["experts"]["weights"]  # each rank's own experts
    assert patched[1]["pipeline"]["loss"] and not patched[0]["pipeline"]["loss"]  # the loss on the last stage

    runtime = ranks_saw("megatron_cpu_training.py", "runtime", "-", tmp_path / "runtime")
    for fork_form, runtime_form in zip(patched, runtime):
        assert isinstance(runtime_form, dict), runtime_form
        assert not runtime_form["megatron"].startswith(str(patched_megatron)) and runtime_form["plugin_imported"]
        for part in ("experts", "pipeline"):
            assert fork_form[part] == runtime_form[part], part

    # Negative control: the installed megatron-core with neither fails on a CPU-only torch.
    stock = ranks_saw("megatron_cpu_training.py", "stock", "-", tmp_path / "stock")
    assert all(isinstance(rank, str) and "Torch not compiled with CUDA enabled" in rank for rank in stock), stock


def test_mbridge_loads_and_exports_local_modules_without_the_runtime_patches(manifest, patched_megatron, checkpoints,
                                                                            tmp_path):
    """The fork form of mbridge's CPU runtime patches: mbridge and megatron-core with their fork patches
    build a tiny Qwen3-MoE with its experts over two CPU ranks and a tiny Qwen3 at two pipeline stages
    as verl's Megatron engine does (megatron's local modules), load them, and export every tensor of
    each checkpoint bit for bit (the experts' and the stages' gathers), none of the plugin imported."""
    patched_root = tmp_path / "patched-mbridge"
    for upstream in ("megatron-lm", "mbridge"):
        fork_patches.copy_patched_package(manifest, upstream, patched_root)
    models = (checkpoints["qwen3_moe"], checkpoints["qwen3"])
    patched = ranks_saw("mbridge_cpu_loading.py", "patched", patched_root, tmp_path / "patched", *models)
    assert all(isinstance(rank, dict) for rank in patched), patched
    for rank in patched:
        assert rank["mbridge"].startswith(str(patched_root)) and rank["megatron"].startswith(str(patched_root))
        assert not rank["plugin_imported"]
        for part in ("experts", "pipeline"):
            assert rank[part]["exported"] == rank[part]["checkpoint"] == rank[part]["equal"] > 0, part

    # Negative control: megatron-core patched, the installed mbridge fails to build a local model.
    stock = ranks_saw("mbridge_cpu_loading.py", "patched", patched_megatron, tmp_path / "stock-mbridge", *models)
    assert all(isinstance(rank, str) and "name 'TENorm' is not defined" in rank for rank in stock), stock
