"""``zmrl selfcheck``: a CPU check that an installed plugin works inside real verl.

In a fresh interpreter it imports verl (registration through the ``verl.plugins`` entry point) and
runs both estimators and both losses through verl's registries on a synthetic batch: IS ratios
exactly 1, and one ulp moved in μ seen as 24 of 25 tokens bitwise equal. See docs/diagnostics.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

_PROBE = r"""
import json, numpy as np, torch, verl
from verl.trainer.ppo import core_algos
from omegaconf import OmegaConf
names = ("reinforce_zero", "flash_reinforce")
missing = [n for n in names
           if n not in core_algos.ADV_ESTIMATOR_REGISTRY or n not in core_algos.POLICY_LOSS_REGISTRY]
if missing:
    print(json.dumps({"missing": missing}))
    raise SystemExit(0)
algorithm = OmegaConf.create({"rollout_correction": {"bypass_mode": True}})
g = torch.Generator().manual_seed(0)
rewards = torch.zeros(6, 5); rewards[[0, 2, 4], 4] = 1.0
mask = torch.ones(6, 5); mask[5] = 0  # one padding row: 25 response tokens
uids = np.array(["a", "a", "b", "b", "c", "pad"], dtype=object)
logits = torch.randn(6, 5, 11, generator=g)
tokens = torch.randint(0, 11, (6, 5), generator=g)

def token_log_probs(logits):
    return logits.log_softmax(-1).gather(-1, tokens[..., None])[..., 0]

mu = token_log_probs(logits)  # what the rollout recorded
one_ulp_off = mu.clone()
one_ulp_off[1, 2] = torch.nextafter(one_ulp_off[1, 2], torch.tensor(float("-inf")))
out = {}
for name in names:
    adv, _ = core_algos.get_adv_estimator_fn(name)(token_level_rewards=rewards, response_mask=mask,
                                                  config=algorithm, index=uids)
    learner_logits = logits.clone().requires_grad_(True)
    pi = token_log_probs(learner_logits)  # the learner's own forward: a second computation
    loss_fn = core_algos.get_policy_loss_fn(name)
    kwargs = dict(advantages=adv, response_mask=mask.bool(), loss_agg_mode="seq-mean-token-mean",
                  config=None, rollout_is_weights=None)
    loss, metrics = loss_fn(old_log_prob=mu, log_prob=pi, **kwargs)
    loss.backward()
    _, planted = loss_fn(old_log_prob=one_ulp_off, log_prob=pi.detach(), **kwargs)
    out[name] = {"advantage_row0": adv[0, 0].item(), "loss": loss.item(),
                 "grad_finite": bool(torch.isfinite(learner_logits.grad).all()),
                 "bitwise_one_ulp_off": planted["zero_mismatch/bitwise_equal_fraction"], **metrics}
print(json.dumps(out))
"""

# 24 of the 25 response tokens equal when one of them is moved one ulp.
ONE_ULP_OFF_FRACTION = 24 / 25


def _missing_message(missing: list[str]) -> str:
    setting = os.environ.get("VERL_USE_EXTERNAL_PLUGINS")
    hint = (f"VERL_USE_EXTERNAL_PLUGINS={setting} is set: unset it (or list zero_mismatch in it)"
            if setting is not None else "install the package into the environment that runs verl (pip install .)")
    return (f"selfcheck FAILED: verl's registries have no {', '.join(missing)}: the plugin's verl.plugins "
            f"entry point was not loaded; {hint}")


ALGORITHMS = ("reinforce_zero", "flash_reinforce")
EXPECTED_ADVANTAGE_ROW0 = {"reinforce_zero": 0.5, "flash_reinforce": 0.4}
TABLE_ROWS = [
    ("advantage of a rewarded response", "advantage_row0"),
    ("IS ratio mean (pi == mu)", "rollout_corr/rollout_is_mean"),
    ("bitwise-equal fraction (pi == mu)", "zero_mismatch/bitwise_equal_fraction"),
    ("bitwise-equal fraction (one token 1 ulp off)", "bitwise_one_ulp_off"),
    ("k3 / D3 mean", "rollout_corr/k3_kl"),
    ("gradient finite", "grad_finite"),
]


def selfcheck_failures(report: dict) -> list[str]:
    """What the probe's figures get wrong (empty: all hold)."""
    failures = []
    for name in ALGORITHMS:
        got = report[name]
        if abs(got["advantage_row0"] - EXPECTED_ADVANTAGE_ROW0[name]) > 1e-6:
            failures.append(f"{name}: advantage {got['advantage_row0']} != {EXPECTED_ADVANTAGE_ROW0[name]}")
        if got["rollout_corr/rollout_is_mean"] != 1.0 or got["zero_mismatch/bitwise_equal_fraction"] != 1.0:
            failures.append(f"{name}: pi == mu must give IS ratio 1 and bitwise fraction 1")
        if abs(got["bitwise_one_ulp_off"] - ONE_ULP_OFF_FRACTION) > 1e-6:
            failures.append(f"{name}: one token 1 ulp off must give a bitwise fraction of 24/25, "
                            f"got {got['bitwise_one_ulp_off']}")
        if got["rollout_corr/k3_kl"] != 0.0 or not got["grad_finite"]:
            failures.append(f"{name}: k3 must be 0 and the gradient finite")
    return failures


def _print_table(report: dict) -> None:
    print(f"{'check':<48} {ALGORITHMS[0]:>16} {ALGORITHMS[1]:>16}")
    for label, key in TABLE_ROWS:
        values = [report[name].get(key) for name in ALGORITHMS]
        print(f"{label:<48} {values[0]!s:>16} {values[1]!s:>16}")


def run_selfcheck() -> int:
    result = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True)
    if result.returncode != 0:
        print("selfcheck FAILED: verl could not use the plugin\n" + result.stderr[-4000:], file=sys.stderr)
        return 1
    report = json.loads(result.stdout.strip().splitlines()[-1])
    if "missing" in report:
        print(_missing_message(report["missing"]), file=sys.stderr)
        return 1
    _print_table(report)
    failures = selfcheck_failures(report)
    if failures:
        print("selfcheck FAILED:\n  " + "\n  ".join(failures), file=sys.stderr)
        return 1
    print("selfcheck passed: verl loads the plugin through its entry point; both algorithms work")
    return 0
