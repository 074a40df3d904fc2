"""The batch-invariant GPU kernels compute the right numbers (Triton interpreter, on CPU).

Batch invariance itself is a property of the GPU code generation and is checked on a device by
scripts/gpu_check.sh; here the kernels' arithmetic is checked against float64 references.
"""

import json
import os
import subprocess
import sys

SCRIPT = """
import json
from zero_mismatch_plugin.aligned import gpu_check
ok, details = gpu_check.part_kernels_match_reference()
print(json.dumps({"ok": ok, "details": details}))
"""


def test_invariant_kernels_match_float64_reference():
    env = {**os.environ, "TRITON_INTERPRET": "1", "ZMRL_GPU_CHECK_DRY_RUN": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["ok"], result["details"]
