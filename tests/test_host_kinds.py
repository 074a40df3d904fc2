"""``scripts/run_as_host_kind.sh``: its switch must really give vLLM the kernel build of the named
host kind, in the process it starts and in the processes that one spawns (vLLM's engine core,
torchrun ranks), or CI's host-kind phases would pass on this host's own kernels and prove nothing
about another host kind; and it must only ever lower what the host has."""

import contextlib
import io
import os
import subprocess
import sys

import pytest

from support import REPO

HOST_KINDS = REPO / "scripts" / "host_kinds"
SPAWNED_CHILD_REPORTS = """
import multiprocessing, runpy, sys
import torch.cpu

def capabilities(_):
    return torch.cpu._is_avx512_supported(), torch.cpu._is_avx512_bf16_supported(), torch.cpu._is_amx_tile_supported()

if __name__ == "__main__":
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        print("spawned child:", pool.map(capabilities, [0])[0])
    runpy.run_path(sys.argv[1], run_name="__main__")
"""


def _run(args, kind: str | None) -> list[str]:
    """stdout of ``python args`` with the folder on PYTHONPATH and the host kind set (or not)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ZMRL_AS_HOST_KIND")}
    env["PYTHONPATH"] = str(HOST_KINDS)
    if kind is not None:
        env["ZMRL_AS_HOST_KIND"] = kind
    done = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.split("\n")


@pytest.mark.parametrize("kind", ["avx2", "avx512"])
def test_the_host_kind_gives_vllm_its_build_in_its_process_and_in_spawned_ones(kind, tmp_path):
    import torch

    report = HOST_KINDS / "vllm_kernel_build.py"
    parent = tmp_path / "spawns_a_child.py"  # a file: a spawned child re-imports its parent's main module
    parent.write_text(SPAWNED_CHILD_REPORTS)
    lines = _run([str(parent), str(report)], kind)
    # Lowered, never raised: the avx512 kind keeps the host's own answer to "AVX-512?".
    avx512 = kind == "avx512" and torch.cpu._is_avx512_supported()
    assert f"spawned child: ({avx512}, False, False)" in lines
    assert [line for line in lines if line.startswith("_C")] == ["_C_AVX512.abi3.so" if avx512 else "_C_AVX2.abi3.so"]


def test_without_a_host_kind_the_folder_changes_nothing():
    import runpy

    with contextlib.redirect_stdout(io.StringIO()) as this_process:  # the host's own build
        runpy.run_path(str(HOST_KINDS / "vllm_kernel_build.py"), run_name="__main__")
    own = this_process.getvalue().split()
    with_folder = [line for line in _run([str(HOST_KINDS / "vllm_kernel_build.py")], kind=None) if line.startswith("_C")]
    assert len(own) == 1 and own == with_folder
    print(f"this host's own vLLM kernel build: {own[0]}")


def test_an_unknown_host_kind_is_named_in_every_process_it_reaches():
    env = {**os.environ, "PYTHONPATH": str(HOST_KINDS), "ZMRL_AS_HOST_KIND": "avx"}
    done = subprocess.run([sys.executable, "-c", "pass"], env=env, capture_output=True, text=True, timeout=60)
    assert "ZMRL_AS_HOST_KIND='avx': use one of avx2, avx512, or unset it" in done.stderr
