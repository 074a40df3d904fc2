#!/usr/bin/env bash
# Run the host-sensitive tests, and the bf16 ones, as a smaller host kind runs them:
#   avx2    an AVX2-only host: vLLM's `_C_AVX2` build, MKL's, oneDNN's and aten's AVX2 paths;
#   avx512  an AVX-512 host without AVX-512-bf16 or AMX: vLLM's `_C_AVX512` build, oneDNN held
#           to AVX512_CORE (no bf16 instructions).
# vLLM's build is chosen through scripts/host_kinds/sitecustomize.py in every process (docs/hosts.md).
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
kind="${1:?usage: run_as_host_kind.sh avx2|avx512 [pytest arguments]}"
shift
case "$kind" in
  avx2) expected=_C_AVX2.abi3.so; export MKL_CBWR=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 ;;
  avx512)
    expected=_C_AVX512.abi3.so; export MKL_CBWR=AVX512 ONEDNN_MAX_CPU_ISA=AVX512_CORE ATEN_CPU_CAPABILITY=avx512
    if ! grep -qw avx512f /proc/cpuinfo; then
      echo "host kind avx512: not run, this host has no AVX-512 (a host cannot run an ISA it lacks)"
      exit 0
    fi ;;
  *) echo "run_as_host_kind.sh: unknown host kind '$kind': use avx2 or avx512" >&2; exit 2 ;;
esac
export ZMRL_AS_HOST_KIND="$kind" PYTHONPATH="$PWD/scripts/host_kinds${PYTHONPATH:+:$PYTHONPATH}"
# Refuse to report a pass that ran another host's kernels.
loaded=$(.venv/bin/python scripts/host_kinds/vllm_kernel_build.py)
if [ "$loaded" != "$expected" ]; then
  echo "host kind $kind: vLLM loaded '${loaded}', not $expected alone" >&2
  exit 1
fi
echo "host kind $kind: vLLM's kernels from $loaded"
exec bash scripts/run_as_other_host.sh "$@" \
  tests/faces/bf16/test_bf16_bitwise.py \
  tests/tools/checker/test_checker_bf16.py \
  tests/faces/linear_attention/test_gated_delta_net.py \
  tests/aligned/test_expert_parallel.py \
  "tests/tools/report/test_compare.py::test_bf16_engine_aligned_learner_bitwise_and_bf16_learner_not"
