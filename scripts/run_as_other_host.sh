#!/usr/bin/env bash
# Run the host-sensitive tests with MKL's code path forced to another than this host's own (and
# oneDNN's too where ONEDNN_MAX_CPU_ISA is set), as a host with other kernels would run them
# (docs/hosts.md): the planted-kernel tests and one engine-backed bitwise test per mechanism.
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
export MKL_CBWR="${MKL_CBWR:-COMPATIBLE}"
echo "host variant: MKL_CBWR=$MKL_CBWR ONEDNN_MAX_CPU_ISA=${ONEDNN_MAX_CPU_ISA:-unset, this host decides}"
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@" \
  tests/aligned/test_row_invariant_kernels.py \
  "tests/aligned/test_aligned_cpu_gemm.py::test_host_vllm_gemm_probe_is_reported" \
  "tests/aligned/test_aligned_cpu_gemm.py::test_consistent_bf16_gemm_rows_do_not_depend_on_the_row_count_at_two_threads" \
  "tests/aligned/test_aligned_cpu_gemm.py::test_lone_sequence_decode_at_large_k_is_bitwise_equal" \
  "tests/faces/aligned_model/test_aligned_mla.py::test_trainer_logprobs_bitwise_equal_engine" \
  "tests/faces/aligned_model/test_aligned_expert_lora.py::test_engine_serves_expert_lora_and_alone_equals_batched[qwen3_moe]" \
  "tests/faces/aligned_model/test_aligned_expert_lora.py::test_trainer_bitwise_equal_engine_at_batch_1_and_8_and_mixed[qwen3_moe]"
