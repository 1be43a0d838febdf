"""Policy loss, loss aggregation, KL estimators and entropy against hand-computed values."""

import math

import pytest
import torch

from rollplex_train.algo.kl import kl_penalty
from rollplex_train.algo.losses import (
    LOSS_AGG_MODES,
    agg_loss,
    batch_counts,
    entropy_from_logits,
    kl_loss,
    policy_loss,
)

# ---------------------------------------------------------------------------------------------
# policy loss: N=2, R=3, clip range [1 - 0.2, 1 + 0.28] = [0.8, 1.28] (DAPO clip-higher)
#   row0: ratio [1.5, 0.5, 1.0], A = +1 on every token
#   row1: ratio [1.1, 0.5, pad], A = -2, padding holds garbage that must be ignored
# per-token loss = max(-A*r, -A*clip(r)):
#   r0t0: max(-1.5, -1.28) = -1.28  clipped (upper side, A > 0)
#   r0t1: max(-0.5, -0.80) = -0.50
#   r0t2: max(-1.0, -1.00) = -1.00
#   r1t0: max( 2.2,  2.20) =  2.20
#   r1t1: max( 1.0,  1.60) =  1.60  clipped (lower side, A < 0)
# token sums: row0 = -2.78, row1 = 3.8; total = 1.02 over 5 real tokens
# clipfrac = 2/5 = 0.4
# ppo_kl = mean(old - logp) = -(ln1.5 + ln0.5 + 0 + ln1.1 + ln0.5)/5
#        = -(0.4054651 - 0.6931472 + 0.0953102 - 0.6931472)/5 = 0.8855191/5 = 0.1771038
OLD = torch.tensor([[-1.0, -1.0, -1.0], [-2.0, -2.0, -2.0]])
LOG_RATIO = torch.tensor([[math.log(1.5), math.log(0.5), 0.0], [math.log(1.1), math.log(0.5), 0.0]])
PG_MASK = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.float32)
PG_ADV = torch.tensor([[1.0, 1.0, 1.0], [-2.0, -2.0, 100.0]])


def _logprob() -> torch.Tensor:
    logprob = OLD + LOG_RATIO
    logprob[1, 2] = 5.0  # garbage on padding
    return logprob.requires_grad_(True)


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", 1.02 / 5),  # 0.204
        ("seq-mean-token-mean", (-2.78 / 3 + 3.8 / 2) / 2),  # (-0.9266667 + 1.9) / 2 = 0.4866667
        ("seq-mean-token-sum", (-2.78 + 3.8) / 2),  # 0.51
    ],
)
def test_policy_loss_modes_with_two_sided_clipping(mode, expected):
    loss, metrics = policy_loss(
        _logprob(), OLD, PG_ADV, PG_MASK, clip_ratio_low=0.2, clip_ratio_high=0.28, loss_agg_mode=mode
    )
    assert loss.dim() == 0
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert metrics["actor/pg_loss"] == pytest.approx(expected, abs=1e-6)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(0.4)
    assert metrics["actor/ppo_kl"] == pytest.approx(0.8855191 / 5, abs=1e-6)
    assert all(isinstance(v, float) for v in metrics.values())


def test_policy_loss_gradient_zero_on_clipped_tokens():
    logprob = _logprob()
    loss, _ = policy_loss(
        logprob, OLD, PG_ADV, PG_MASK, clip_ratio_low=0.2, clip_ratio_high=0.28, loss_agg_mode="token-mean"
    )
    loss.backward()
    # d(-A*r)/dlogp = -A*r on unclipped tokens, 0 on clipped tokens and padding; / 5 tokens
    # r0t1: -1*0.5/5 = -0.1; r0t2: -1*1/5 = -0.2; r1t0: 2*1.1/5 = 0.44
    expected = torch.tensor([[0.0, -0.1, -0.2], [0.44, 0.0, 0.0]])
    torch.testing.assert_close(logprob.grad, expected)


def test_dual_clip_bounds_negative_advantage_loss_like_verl():
    """ratio 5 with A = -1: plain PPO gives loss 5.0; verl's dual clip bounds it at clip_ratio_c = 3.
    Row layout (N=1, R=4): ratios [5, 2, 5, 0.5], A [-1, -1, +1, -1]:
      t0: max(5, 1.2) = 5 -> min(5, 3) = 3   (bounded, counted in pg_clipfrac_lower)
      t1: max(2, 1.2) = 2 -> min(2, 3) = 2
      t2: A > 0: max(-5, -1.2) = -1.2        (no lower bound for A > 0)
      t3: max(0.5, 0.8) = 0.8 -> 0.8
    token-mean = (3 + 2 - 1.2 + 0.8) / 4 = 1.15; pg_clipfrac_lower = 1/4; pg_clipfrac = 2/4 (t2, t3)."""
    old = torch.zeros(1, 4)
    logprob = torch.log(torch.tensor([[5.0, 2.0, 5.0, 0.5]])).requires_grad_(True)
    adv = torch.tensor([[-1.0, -1.0, 1.0, -1.0]])
    mask = torch.ones(1, 4)
    loss, metrics = policy_loss(logprob, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.2,
                                loss_agg_mode="token-mean", clip_ratio_c=3.0)
    assert loss.item() == pytest.approx(1.15, abs=1e-6)
    assert metrics["actor/pg_clipfrac_lower"] == pytest.approx(0.25)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(0.5)
    loss.backward()  # the bounded token (t0) and the clipped ones (t2, t3) pass no gradient
    torch.testing.assert_close(logprob.grad, torch.tensor([[0.0, 2.0 / 4, 0.0, 0.0]]))
    single, _ = policy_loss(torch.log(torch.tensor([[5.0]])), torch.zeros(1, 1), -torch.ones(1, 1),
                            torch.ones(1, 1), clip_ratio_low=0.2, clip_ratio_high=0.2, loss_agg_mode="token-mean")
    assert single.item() == pytest.approx(3.0)  # verl's default clip_ratio_c
    with pytest.raises(ValueError, match="clip_ratio_c"):
        policy_loss(logprob, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.2,
                    loss_agg_mode="token-mean", clip_ratio_c=1.0)


def _verl_policy_loss(old_log_prob, log_prob, advantages, response_mask, low, high, clip_ratio_c):
    """verl ``core_algos.compute_policy_loss`` (vanilla, token-mean), transcribed for comparison."""
    def masked_mean(x, m):
        return (x * m).sum() / m.sum()

    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - low, 1 + high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask)
    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    pg_clipfrac_lower = masked_mean(torch.gt(clip_pg_losses1, pg_losses3) * (advantages < 0).float(), response_mask)
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    return masked_mean(pg_losses, response_mask), pg_clipfrac, pg_clipfrac_lower


def test_policy_loss_equals_verl_on_random_inputs():
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(6, 9, generator=g) * 3
    logprob = old + torch.randn(6, 9, generator=g) * 1.5  # ratios from ~0.01 to ~90: every branch taken
    adv = torch.randn(6, 9, generator=g)
    mask = (torch.rand(6, 9, generator=g) > 0.2).float()
    loss, metrics = policy_loss(logprob, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28,
                                loss_agg_mode="token-mean", clip_ratio_c=2.5)
    ref_loss, ref_clipfrac, ref_lower = _verl_policy_loss(old, logprob, adv, mask, 0.2, 0.28, 2.5)
    assert 0 < float(ref_lower) < 1
    assert loss.item() == pytest.approx(float(ref_loss), abs=1e-6)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(float(ref_clipfrac), abs=1e-6)
    assert metrics["actor/pg_clipfrac_lower"] == pytest.approx(float(ref_lower), abs=1e-6)


# ---------------------------------------------------------------------------------------------
# agg_loss


def test_agg_loss_hand_computed():
    loss = torch.tensor([[1.0, 2, 3], [4, 5, 6], [7, 8, 9]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]], dtype=torch.float32)  # last row empty
    assert agg_loss(loss, mask, "token-mean").item() == pytest.approx(7 / 3)  # (1+2+4)/3
    assert agg_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx(2.75)  # (1.5+4)/2
    assert agg_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx(3.5)  # (3+4)/2
    # global normalisers replace the local ones
    assert agg_loss(loss, mask, "token-mean", num_tokens=7).item() == pytest.approx(1.0)  # 7/7
    assert agg_loss(loss, mask, "seq-mean-token-sum", num_seqs=7).item() == pytest.approx(1.0)
    assert agg_loss(loss, torch.zeros_like(mask), "token-mean").item() == 0.0


def test_agg_loss_ignores_non_finite_padding():
    loss = torch.tensor([[1.0, float("nan")], [2.0, float("inf")]])
    mask = torch.tensor([[1, 0], [1, 0]], dtype=torch.float32)
    assert agg_loss(loss, mask, "token-mean").item() == pytest.approx(1.5)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_agg_loss_micro_batches_sum_to_mini_batch(mode):
    gen = torch.Generator().manual_seed(0)
    loss = torch.randn(6, 5, generator=gen, dtype=torch.float64)
    lengths = [5, 1, 3, 0, 2, 4]
    mask = (torch.arange(5).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)).double()
    num_tokens, num_seqs = batch_counts(mask)
    assert (num_tokens, num_seqs) == (15, 5)
    full = agg_loss(loss, mask, mode)
    parts = [slice(0, 2), slice(2, 3), slice(3, 6)]
    total = sum(agg_loss(loss[p], mask[p], mode, num_tokens=num_tokens, num_seqs=num_seqs) for p in parts)
    torch.testing.assert_close(total, full, rtol=0, atol=1e-12)
    # without the mini-batch counts the micro-batch losses do not add up
    local = sum(agg_loss(loss[p], mask[p], mode) for p in parts)
    assert not torch.isclose(local, full)


def test_agg_loss_errors():
    loss, mask = torch.zeros(2, 2), torch.ones(2, 2)
    with pytest.raises(ValueError, match="actor.loss_agg_mode='seq-sum'"):
        agg_loss(loss, mask, "seq-sum")
    with pytest.raises(ValueError, match="num_tokens"):
        agg_loss(loss, mask, "token-mean", num_tokens=0)
    with pytest.raises(ValueError, match="differ"):
        agg_loss(loss, torch.ones(2, 3), "token-mean")


# ---------------------------------------------------------------------------------------------
# KL estimators: d = ref - logp = [-0.5, 1.0, 0.0]
LOGP = torch.tensor([[-1.0, -2.0, -0.5]])
REF = torch.tensor([[-1.5, -1.0, -0.5]])


def test_kl_estimators_hand_computed():
    # k1 = logp - ref = [0.5, -1.0, 0]
    torch.testing.assert_close(kl_penalty(LOGP, REF, "k1"), torch.tensor([[0.5, -1.0, 0.0]]))
    # k2 = 0.5 * (logp - ref)^2 = [0.125, 0.5, 0]
    torch.testing.assert_close(kl_penalty(LOGP, REF, "k2"), torch.tensor([[0.125, 0.5, 0.0]]))
    # k3 = exp(d) - d - 1: exp(-0.5) + 0.5 - 1 = 0.1065307; exp(1) - 2 = 0.7182818; 0
    k3 = torch.tensor([[0.1065307, 0.7182818, 0.0]])
    torch.testing.assert_close(kl_penalty(LOGP, REF, "k3"), k3)
    torch.testing.assert_close(kl_penalty(LOGP, REF, "low_var_kl"), k3)  # within the clamps


def test_low_var_kl_clamps():
    logp = torch.tensor([[0.0, 0.0]])
    ref = torch.tensor([[30.0, -30.0]])
    # d = +30: k3 = e^30 - 31 = 1.0686e13 -> low_var_kl clamps d to 20, then the value to 10
    # d = -30: k3 = e^-30 + 30 - 1 = 29 -> low_var_kl: d -> -20, e^-20 + 19 = 19 -> 10
    torch.testing.assert_close(kl_penalty(logp, ref, "low_var_kl"), torch.tensor([[10.0, 10.0]]))
    k3 = kl_penalty(logp, ref, "k3")
    assert k3[0, 0].item() == pytest.approx(math.exp(30) - 31, rel=1e-5)
    assert k3[0, 1].item() == pytest.approx(29.0)


def test_kl_loss_aggregates_and_errors():
    mask = torch.tensor([[1, 1, 0]], dtype=torch.float32)
    # k1 on real tokens: (0.5 - 1.0) / 2 = -0.25
    assert kl_loss(LOGP, REF, mask, "k1", "token-mean").item() == pytest.approx(-0.25)
    with pytest.raises(ValueError, match="algorithm.kl_estimator='k4'"):
        kl_loss(LOGP, REF, mask, "k4", "token-mean")


# ---------------------------------------------------------------------------------------------
# entropy


def test_entropy_from_logits():
    logits = torch.stack(
        [
            torch.zeros(4),  # uniform over 4: ln 4 = 1.3862944
            torch.log(torch.tensor([0.25, 0.75, 1e-30, 1e-30])),  # -(.25 ln .25 + .75 ln .75) = 0.5623351
            torch.tensor([1000.0, 0.0, 0.0, 0.0]),  # one-hot in effect: 0, no overflow
            torch.tensor([0.0, 0.0, -float("inf"), -float("inf")]),  # masked vocabulary: ln 2 = 0.6931472
        ]
    ).reshape(2, 2, 4)
    ent = entropy_from_logits(logits)
    assert ent.shape == (2, 2)
    torch.testing.assert_close(ent.flatten(), torch.tensor([1.3862944, 0.5623351, 0.0, 0.6931472]))
