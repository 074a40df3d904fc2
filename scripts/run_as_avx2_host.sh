#!/usr/bin/env bash
# Run the host-sensitive tests, and the bf16 ones, as an AVX2-only host runs them: vLLM's AVX2
# kernel build (`_C_AVX2`, chosen through scripts/avx2_host/sitecustomize.py in every process),
# MKL's, oneDNN's and aten's AVX2 code paths (docs/hosts.md). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/scripts/avx2_host${PYTHONPATH:+:$PYTHONPATH}"
export MKL_CBWR=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2
# Refuse to report a pass that ran another host's kernels.
loaded=$(.venv/bin/python scripts/avx2_host/vllm_kernel_build.py)
if [ "$loaded" != "_C_AVX2.abi3.so" ]; then
  echo "AVX2 host variant: vLLM loaded '${loaded}', not _C_AVX2.abi3.so alone" >&2
  exit 1
fi
echo "AVX2 host variant: vLLM's kernels from $loaded"
exec bash scripts/run_as_other_host.sh "$@" \
  tests/faces/bf16/test_bf16_bitwise.py \
  tests/tools/checker/test_checker_bf16.py \
  tests/faces/linear_attention/test_gated_delta_net.py \
  tests/aligned/test_expert_parallel.py
