"""``zmrl selfcheck``: a CPU check that an installed plugin works inside real verl.

It imports verl in a fresh interpreter (so registration must come through the
``verl.plugins`` entry point), then runs both estimators and both losses through verl's
own registries on a small synthetic batch and checks what must hold exactly: with
pi == mu every IS ratio is 1 and the bitwise-equal fraction is 1.
"""

from __future__ import annotations

import json
import subprocess
import sys

_PROBE = r"""
import json, numpy as np, torch, verl
from verl.trainer.ppo import core_algos
from omegaconf import OmegaConf
algorithm = OmegaConf.create({"rollout_correction": {"bypass_mode": True}})
torch.manual_seed(0)
rewards = torch.zeros(6, 5); rewards[[0, 2, 4], 4] = 1.0
mask = torch.ones(6, 5); mask[5] = 0  # one padding row
uids = np.array(["a", "a", "b", "b", "c", "pad"], dtype=object)
log_prob = -torch.rand(6, 5) - 0.1
out = {}
for name in ("reinforce_zero", "flash_reinforce"):
    adv, _ = core_algos.get_adv_estimator_fn(name)(token_level_rewards=rewards, response_mask=mask,
                                                  config=algorithm, index=uids)
    pi = log_prob.clone().requires_grad_(True)
    loss, metrics = core_algos.get_policy_loss_fn(name)(
        old_log_prob=log_prob.clone(), log_prob=pi, advantages=adv, response_mask=mask.bool(),
        loss_agg_mode="seq-mean-token-mean", config=None, rollout_is_weights=None)
    loss.backward()
    out[name] = {"advantage_row0": adv[0, 0].item(), "loss": loss.item(),
                 "grad_finite": bool(torch.isfinite(pi.grad).all()), **metrics}
print(json.dumps(out))
"""


def run_selfcheck() -> int:
    result = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True)
    if result.returncode != 0:
        print("selfcheck FAILED: verl could not use the plugin\n" + result.stderr[-4000:], file=sys.stderr)
        return 1
    report = json.loads(result.stdout.strip().splitlines()[-1])
    failures = []
    print(f"{'check':<48} {'reinforce_zero':>16} {'flash_reinforce':>16}")
    rows = [
        ("advantage of a rewarded response", "advantage_row0"),
        ("IS ratio mean (pi == mu)", "rollout_corr/rollout_is_mean"),
        ("bitwise-equal fraction (pi == mu)", "zero_mismatch/bitwise_equal_fraction"),
        ("k3 / D3 mean", "rollout_corr/k3_kl"),
        ("gradient finite", "grad_finite"),
    ]
    for label, key in rows:
        values = [report[name].get(key) for name in ("reinforce_zero", "flash_reinforce")]
        print(f"{label:<48} {values[0]!s:>16} {values[1]!s:>16}")
    for name, expected_advantage in (("reinforce_zero", 0.5), ("flash_reinforce", 0.4)):
        got = report[name]
        if abs(got["advantage_row0"] - expected_advantage) > 1e-6:
            failures.append(f"{name}: advantage {got['advantage_row0']} != {expected_advantage}")
        if got["rollout_corr/rollout_is_mean"] != 1.0 or got["zero_mismatch/bitwise_equal_fraction"] != 1.0:
            failures.append(f"{name}: pi == mu must give IS ratio 1 and bitwise fraction 1")
        if got["rollout_corr/k3_kl"] != 0.0 or not got["grad_finite"]:
            failures.append(f"{name}: k3 must be 0 and the gradient finite")
    if failures:
        print("selfcheck FAILED:\n  " + "\n  ".join(failures), file=sys.stderr)
        return 1
    print("selfcheck passed: verl loads the plugin through its entry point; both algorithms work")
    return 0
