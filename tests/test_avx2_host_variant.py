"""``scripts/run_as_avx2_host.sh``: its switch must really give vLLM's AVX2 kernel build, in the
process it starts and in the processes that one spawns (vLLM's engine core, torchrun ranks), or
the AVX2 phase of CI would pass on this host's own kernels and prove nothing about an AVX2 host."""

import os
import subprocess
import sys

from support import REPO

AVX2_HOST = REPO / "scripts" / "avx2_host"
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


def _run(args, with_variant: bool) -> list[str]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    if with_variant:
        env["PYTHONPATH"] = str(AVX2_HOST)
    done = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.split("\n")


def test_the_variant_loads_vllms_avx2_build_in_its_process_and_in_spawned_ones(tmp_path):
    report = AVX2_HOST / "vllm_kernel_build.py"
    parent = tmp_path / "spawns_a_child.py"  # a file: a spawned child re-imports its parent's main module
    parent.write_text(SPAWNED_CHILD_REPORTS)
    lines = _run([str(parent), str(report)], with_variant=True)
    assert "spawned child: (False, False, False)" in lines
    assert [line for line in lines if line.startswith("_C")] == ["_C_AVX2.abi3.so"]
    # Without it the host's own build; a host that is AVX2-only loads the same library either way.
    own = [line for line in _run([str(report)], with_variant=False) if line.startswith("_C")]
    assert len(own) == 1 and own[0] in {"_C.abi3.so", "_C_AVX512.abi3.so", "_C_AVX2.abi3.so"}
    print(f"this host's own vLLM kernel build: {own[0]}")
