"""Property tests: extreme log-ratios and empty rows never give NaN/inf or a negative KL;
whatever padding holds never changes a loss, its gradient or its metrics."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zero_mismatch_plugin.algorithms import formulas

log_probs = st.floats(min_value=-1e4, max_value=0.0, allow_nan=False, width=32)


def _tensor(values):
    return torch.tensor(values, dtype=torch.float32)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(log_probs, log_probs), min_size=1, max_size=16))
def test_bernoulli_kl_is_finite_and_non_negative(pairs):
    log_q, log_p = _tensor([q for q, _ in pairs]), _tensor([p for _, p in pairs])
    for direction in ("behaviour_to_learner", "learner_to_behaviour"):
        kl = formulas.sampled_action_bernoulli_kl(log_p, log_q, direction)
        assert torch.isfinite(kl).all() and (kl >= 0).all()


@settings(max_examples=150, deadline=None)
@given(
    rows=st.lists(st.lists(st.tuples(log_probs, log_probs), min_size=0, max_size=6), min_size=1, max_size=6),
    advantages=st.lists(st.floats(-10, 10, allow_nan=False, width=32), min_size=6, max_size=6),
    delta=st.floats(1e-6, 10.0),
)
def test_losses_and_gradients_stay_finite_for_extreme_ratios_and_empty_rows(rows, advantages, delta):
    width = max(1, max(len(r) for r in rows))
    log_pi = torch.zeros(len(rows), width)
    log_mu = torch.zeros(len(rows), width)
    mask = torch.zeros(len(rows), width)
    for i, row in enumerate(rows):
        for t, (pi, mu) in enumerate(row):
            log_pi[i, t], log_mu[i, t], mask[i, t] = pi, mu, 1.0
    advantage = _tensor(advantages[: len(rows)])
    for algorithm in ("reinforce_zero", "flash_reinforce"):
        leaf = log_pi.clone().requires_grad_(True)
        if algorithm == "reinforce_zero":
            token_loss, _ = formulas.reinforce_zero_token_loss(leaf, log_mu, advantage)
        else:
            kl = formulas.sampled_action_bernoulli_kl(leaf.detach(), log_mu)
            admitted, _ = formulas.sequence_trust_region(kl, mask, delta)
            token_loss, _ = formulas.flash_reinforce_token_loss(leaf, log_mu, advantage, admitted)
        loss = formulas.sequence_mean_token_mean(token_loss, mask)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(leaf.grad).all()
        # padding never receives gradient
        assert not (leaf.grad * (1 - mask)).any()


any_float = st.floats(allow_nan=True, allow_infinity=True, width=32)


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(0, 5), min_size=1, max_size=5), poisons=st.tuples(any_float, any_float, any_float),
       loss_mode=st.sampled_from(["reinforce_zero", "flash_reinforce"]))
def test_padding_contents_never_change_loss_gradient_or_metrics(lengths, poisons, loss_mode):
    import verl  # noqa: F401  (registers the plugin)
    from support.verl_batches import fill_padding, loss_call

    generator = torch.Generator().manual_seed(len(lengths))
    mask = torch.arange(5).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
    mu = -torch.rand(mask.shape, generator=generator) * 4
    pi = (mu + torch.randn(mask.shape, generator=generator)).clamp(max=0.0)
    advantages = torch.randn(len(lengths), 1, generator=generator).expand(mask.shape)
    clean = loss_call(loss_mode, *(torch.where(mask, t, 0.0) for t in (pi, mu, advantages)), mask)
    dirty = loss_call(loss_mode, *(fill_padding(t, mask, p) for t, p in zip((pi, mu, advantages), poisons)), mask)
    assert torch.equal(dirty[0], clean[0]) and torch.equal(dirty[1], clean[1]) and dirty[2] == clean[2]
