"""Advantage estimators against hand-computed values.

Shared batch (N=4 responses, R=3 tokens):
    mask   = [[1,1,0], [1,1,1], [1,0,0], [1,1,0]]
    scores = [1, 0, 1, 0.5]
    groups = [0, 0, 0, 1]      -> group 0 = {1, 0, 1}, group 1 = {0.5} (size 1)
Group 0: mean = 2/3; unbiased var = ((1/3)^2 + (2/3)^2 + (1/3)^2) / (3-1) = (6/9)/2 = 1/3;
         std = 1/sqrt(3) = 0.5773503.
"""

import math

import pytest
import torch

from rollplex_train.algo import advantages as adv_mod
from rollplex_train.algo.advantages import (
    apply_kl_penalty,
    compute_advantages,
    get_adv_estimator,
    group_index_from_uids,
    register_adv_estimator,
    scores_to_token_rewards,
)

MASK = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0]], dtype=torch.float32)
SCORES = torch.tensor([1.0, 0.0, 1.0, 0.5])
GROUPS = torch.tensor([0, 0, 0, 1], dtype=torch.int64)


def _broadcast(values: list[float]) -> torch.Tensor:
    return torch.tensor(values).unsqueeze(-1) * MASK


def _run(name: str, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    return compute_advantages(name, scores=SCORES, group_index=GROUPS, response_mask=MASK, **kwargs)


def test_grpo_normalised_by_std():
    adv, ret = _run("grpo")
    std = 1 / math.sqrt(3)  # 0.5773503
    expected = _broadcast(
        [
            (1 - 2 / 3) / (std + 1e-6),  # +0.5773493
            (0 - 2 / 3) / (std + 1e-6),  # -1.1546985
            (1 - 2 / 3) / (std + 1e-6),  # +0.5773493
            (0.5 - 0.0) / (1.0 + 1e-6),  # size-1 group: mean 0, std 1 -> 0.4999995
        ]
    )
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, expected)
    assert adv.dtype == torch.float32 and adv.shape == (4, 3)
    assert (adv[MASK == 0] == 0).all()


def test_grpo_without_std_and_drgrpo_are_centred_scores():
    # r - mean: [1 - 2/3, 0 - 2/3, 1 - 2/3, 0.5 - 0] = [1/3, -2/3, 1/3, 0.5]
    expected = _broadcast([1 / 3, -2 / 3, 1 / 3, 0.5])
    adv, _ = _run("grpo", norm_adv_by_std=False)
    torch.testing.assert_close(adv, expected)
    adv_dr, ret_dr = _run("drgrpo", norm_adv_by_std=True)  # the flag is ignored by Dr. GRPO
    torch.testing.assert_close(adv_dr, expected)
    torch.testing.assert_close(ret_dr, expected)


def test_rloo_leave_one_out_baseline():
    # row0: 1 - mean(0, 1) = 0.5; row1: 0 - mean(1, 1) = -1; row2: 1 - mean(1, 0) = 0.5;
    # row3: group of size 1 has no other sample -> 0
    adv, ret = _run("rloo")
    expected = _broadcast([0.5, -1.0, 0.5, 0.0])
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, expected)


def test_reinforce_plus_plus_gamma_one_whitened_over_batch():
    # token rewards (score on last real token): [[0,1,0],[0,0,0],[1,0,0],[0,.5,0]]
    # returns (gamma=1, suffix sums over real tokens): [[1,1,0],[0,0,0],[1,0,0],[.5,.5,0]]
    # real-token returns: 1,1, 0,0,0, 1, .5,.5 -> n=8, mean=4/8=0.5
    # squared deviations: 6 * 0.25 + 2 * 0 = 1.5; unbiased var = 1.5/7; std = 0.4629100
    adv, ret = _run("reinforce_plus_plus", gamma=1.0)
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1, 0], [0, 0, 0], [1, 0, 0], [0.5, 0.5, 0]]))
    a = 0.5 / math.sqrt(1.5 / 7 + 1e-8)  # 1.0801234
    expected = torch.tensor([[a, a, 0], [-a, -a, -a], [a, 0, 0], [0, 0, 0]])
    torch.testing.assert_close(adv, expected)


def test_reinforce_plus_plus_discounts_returns():
    # gamma = 0.5: row0 t1 = 1, t0 = 0 + 0.5*1 = 0.5; row3 t1 = 0.5, t0 = 0.5*0.5 = 0.25
    _, ret = _run("reinforce_plus_plus", gamma=0.5)
    torch.testing.assert_close(ret, torch.tensor([[0.5, 1, 0], [0, 0, 0], [1, 0, 0], [0.25, 0.5, 0]]))


def test_scores_to_token_rewards_last_real_token():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]], dtype=torch.float32)
    rewards = scores_to_token_rewards(torch.tensor([2.0, 3.0, 4.0]), mask)
    # the empty row drops its score
    torch.testing.assert_close(rewards, torch.tensor([[0.0, 2, 0], [0, 0, 3], [0, 0, 0]]))


def test_kl_in_reward_then_grpo():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.float32)
    kl = torch.tensor([[0.1, 0.2, 9.9], [0.5, 0.5, 0.5]])  # 9.9 sits on padding: ignored
    rewards = apply_kl_penalty(torch.tensor([1.0, 0.0]), kl, mask, kl_coef=0.1)
    # row0: [-0.1*0.1, 1 - 0.1*0.2, 0] = [-0.01, 0.98, 0]; row1: [-0.05, -0.05, -0.05]
    torch.testing.assert_close(rewards, torch.tensor([[-0.01, 0.98, 0.0], [-0.05, -0.05, -0.05]]))
    # grpo uses the row sums 0.97 and -0.15: mean 0.41, deviations +-0.56,
    # unbiased std = 1.12 / sqrt(2) = 0.7919596 -> advantages +-0.56/0.7919596 = +-0.7071059
    adv, _ = compute_advantages(
        "grpo",
        scores=torch.tensor([1.0, 0.0]),
        group_index=torch.tensor([7, 7]),
        response_mask=mask,
        token_level_rewards=rewards,
    )
    a = 0.56 / (1.12 / math.sqrt(2) + 1e-6)
    torch.testing.assert_close(adv, torch.tensor([[a, a, 0], [-a, -a, -a]]))


def test_unknown_estimator_lists_known_names():
    with pytest.raises(ValueError, match="algorithm.adv_estimator='nope'.*grpo"):
        get_adv_estimator("nope")
    with pytest.raises(ValueError, match="algorithm.adv_estimator"):
        _run("nope")


def test_register_custom_estimator_and_duplicate():
    @register_adv_estimator("test_const")
    def const(token_level_rewards, response_mask, group_index, **_):
        return response_mask * 3.0, response_mask * 3.0

    try:
        adv, _ = _run("test_const")
        torch.testing.assert_close(adv, MASK * 3.0)
        with pytest.raises(ValueError, match="already registered"):
            register_adv_estimator("test_const")(lambda *a, **k: None)
    finally:
        adv_mod.ADV_ESTIMATORS.unregister("test_const")


def test_shape_errors():
    with pytest.raises(ValueError, match="group_index"):
        compute_advantages("grpo", scores=SCORES, group_index=GROUPS[:3], response_mask=MASK)
    with pytest.raises(ValueError, match="token_level_rewards"):
        _run("grpo", token_level_rewards=torch.zeros(4, 2))
    with pytest.raises(ValueError, match="kl_coef"):
        apply_kl_penalty(SCORES, torch.zeros(4, 3), MASK, kl_coef=-1.0)


def test_group_index_from_uids():
    assert group_index_from_uids(["b", "a", "b", "c"]).tolist() == [0, 1, 0, 2]
