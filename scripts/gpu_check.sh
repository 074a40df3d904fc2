#!/usr/bin/env bash
# Zero-mismatch GPU check: one short run (< 8 minutes) on one NVIDIA/AMD GPU.
#
# Needs python3 with torch (CUDA or ROCm); vLLM (and transformers) for every part but the first.
# No network is used. Runs the plugin's own trainer path from the repository tree (PYTHONPATH=.,
# nothing installed); the parts are described in scripts/gpu_check.py:
#   1. trainer: the op layer's backward vs float64 (torch only); the aligned model's forward
#      (vLLM's batch-invariant kernels) alone vs packed vs reordered, its backward vs float64;
#   2. engine: an engine rollout at bf16 in consistent mode vs the aligned trainer, bitwise.
# A part that cannot run here (no vLLM) is reported NOT RUN with the reason. One overall result:
# PASS only when every part ran and passed, INCOMPLETE when one did not run (no vLLM here, or
# --parts chose a subset), FAIL when one failed, crashed or timed out. Writes $OUT/gpu_check.json
# when OUT is set. Arguments go to both groups, e.g. --parts aligned_backward_float64 to rerun
# one part, --device cpu for a dry run of the check's logic on a CPU.
# Exit status: 0 PASS, 1 FAIL, 2 INCOMPLETE.
set -uo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$here"
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
py="${PYTHON:-python3}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

echo "== zero-mismatch GPU check ($(date -u +%FT%TZ)) =="
"$py" - <<'PY' || true
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "hip", torch.version.hip,
      "device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
PY
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader || true

timed_out=()
# run_group GROUP SECONDS [args...]: one group of parts in its own process, results in $work/GROUP.json.
run_group() {
  local group=$1 limit=$2
  shift 2
  timeout -k 10 "$limit" "$py" scripts/gpu_check.py --only "$group" --json "$work/$group.json" "$@"
  local rc=$?
  if [[ $rc -eq 124 || $rc -eq 137 ]]; then
    echo "[FAIL] $group timed out after $limit s"
    timed_out+=(--timed-out "$group")
  fi
}

echo "== part 1: the trainer path (op layer, aligned model) on the device =="
run_group trainer 240 "$@"
echo "== part 2: bf16 equality with the vLLM engine =="
run_group engine 240 "$@"

# One summary of both parts; its exit status is the script's.
"$py" scripts/gpu_check.py --summarize "$work" "${timed_out[@]}"
