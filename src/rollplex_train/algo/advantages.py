"""Advantage estimators of the GRPO family, registered by name (verl ``core_algos.py`` semantics).

Legend: N responses, R response tokens (right-padded), G responses in a group (the responses of one
prompt share a ``group_index``). ``response_mask`` is float32 (N, R) with 1 on real tokens.
Scores are outcome rewards, float32 (N,), one per response.

Every estimator has the signature::

    fn(token_level_rewards (N,R), response_mask (N,R), group_index (N,) int64, *,
       norm_adv_by_std: bool, gamma: float, eps: float) -> (advantages (N,R), returns (N,R))

Outcome estimators (``grpo``, ``drgrpo``, ``rloo``) use the masked row sum of
``token_level_rewards`` as the response's score, as verl does; ``compute_advantages`` builds
``token_level_rewards`` from ``scores`` (score on the last real token) when none are given.
Both outputs are float32 and zero outside the mask. Everything runs under ``torch.no_grad``.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from rollplex_train.registry import Registry

AdvEstimatorFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
ADV_ESTIMATORS: Registry[AdvEstimatorFn] = Registry("algorithm.adv_estimator")
get_adv_estimator = ADV_ESTIMATORS.get
known_adv_estimators = ADV_ESTIMATORS.names


def register_adv_estimator(name: str, needs_group: bool = False) -> Callable[[AdvEstimatorFn], AdvEstimatorFn]:
    """Decorator registering an estimator under ``name``; ``needs_group``: its baseline is the
    other responses of the same prompt, so it needs ``rollout.n >= 2`` (set as ``fn.needs_group``).

    Raises:
        ValueError: another estimator is already registered under ``name``.
    """

    def decorator(fn: AdvEstimatorFn) -> AdvEstimatorFn:
        fn.needs_group = needs_group
        return ADV_ESTIMATORS.register(name)(fn)

    return decorator


def needs_group(name: str) -> bool:
    """Whether estimator ``name``'s baseline is its group (``register_adv_estimator(needs_group=True)``).

    Raises:
        ValueError: unknown ``name``.
    """
    return bool(getattr(get_adv_estimator(name), "needs_group", False))


# ---------------------------------------------------------------------------------------------
# helpers


def group_index_from_uids(uids: Sequence[str]) -> torch.Tensor:
    """(N,) int64 group ids, numbered by first appearance of each prompt uid."""
    ids: dict[str, int] = {}
    return torch.tensor([ids.setdefault(u, len(ids)) for u in uids], dtype=torch.int64)


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` over positions where ``mask`` is 1 (0 when the mask is empty)."""
    return (values * mask).sum() / mask.sum().clamp(min=1)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Whiten ``values`` (N, R) over the masked positions of the whole batch (verl ``masked_whiten``).

    ``(v - mean) / sqrt(var + eps)`` with the masked mean and the unbiased (Bessel) masked variance.
    With fewer than two real tokens the variance is taken as 0. Positions outside the mask are not
    zeroed here.
    """
    mean = masked_mean(values, mask)
    count = mask.sum()
    var = masked_mean((values - mean).square(), mask)
    if count > 1:
        var = var * count / (count - 1)
    return (values - mean) * torch.rsqrt(var + eps)


def scores_to_token_rewards(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Place each response's score on its last real token.

    Args:
        scores: (N,) float outcome rewards.
        response_mask: (N, R) float, 1 on real tokens (right-padded).

    Returns:
        (N, R) float32, zero except at the last real token of each row (a row with no real token
        stays all zero: its score is dropped).
    """
    _check_shapes(scores, response_mask)
    mask = response_mask.float()
    num_r = mask.shape[1]
    positions = torch.arange(num_r, device=mask.device).expand_as(mask)
    last = torch.where(mask > 0, positions, torch.full_like(positions, -1)).max(dim=1).values  # (N,)
    rewards = torch.zeros_like(mask)
    has_token = last >= 0
    rows = torch.nonzero(has_token, as_tuple=True)[0]
    rewards[rows, last[rows]] = scores.float()[rows]
    return rewards


def apply_kl_penalty(
    scores: torch.Tensor, kl: torch.Tensor, response_mask: torch.Tensor, kl_coef: float
) -> torch.Tensor:
    """Token-level rewards with an in-reward KL penalty (``algorithm.use_kl_in_reward``).

    ``r[i, t] = score_i * [t == last real token of i] - kl_coef * kl[i, t]`` on real tokens, 0 on
    padding (verl ``compute_rewards`` / ``apply_kl_penalty``; Ouyang et al. 2022 eq. 2).

    Args:
        scores: (N,) float outcome rewards.
        kl: (N, R) float per-token KL estimate (``algo.kl.kl_penalty`` of old vs reference log-probs).
        response_mask: (N, R) float, 1 on real tokens.
        kl_coef: penalty weight, >= 0.

    Returns:
        (N, R) float32 token-level rewards.

    Raises:
        ValueError: mismatched shapes or ``kl_coef < 0``.
    """
    if kl_coef < 0:
        raise ValueError(f"algorithm.kl_coef={kl_coef}: expected a number >= 0")
    if kl.shape != response_mask.shape:
        raise ValueError(f"kl {tuple(kl.shape)} and response_mask {tuple(response_mask.shape)} differ")
    mask = response_mask.float()
    penalty = torch.where(mask > 0, kl.float(), torch.zeros_like(mask)) * kl_coef
    return scores_to_token_rewards(scores, response_mask) - penalty


def _check_shapes(scores: torch.Tensor, response_mask: torch.Tensor) -> None:
    if response_mask.dim() != 2 or scores.shape != response_mask.shape[:1]:
        raise ValueError(
            f"scores {tuple(scores.shape)} / response_mask {tuple(response_mask.shape)}: expected (N,) and (N, R)"
        )


def _group_mean_std(values: torch.Tensor, group_index: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per-response group mean, unbiased group std and group size, each (N,) float64.

    A group of size 1 gets mean 0 and std 1 (verl ``compute_grpo_outcome_advantage``).
    """
    vals = values.double()
    _, inverse = torch.unique(group_index, return_inverse=True)
    num_groups = int(inverse.max()) + 1 if inverse.numel() else 0

    def group_sum(x: torch.Tensor) -> torch.Tensor:  # (N,) -> (num_groups,)
        return torch.zeros(num_groups, dtype=torch.float64, device=vals.device).index_add_(0, inverse, x)

    counts = group_sum(torch.ones_like(vals))
    mean = group_sum(vals) / counts
    sq = group_sum((vals - mean[inverse]).square())
    std = torch.sqrt(sq / (counts - 1).clamp(min=1))
    single = counts == 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    return mean[inverse], std[inverse], counts[inverse]


def _outcome(advantage: torch.Tensor, response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    mask = response_mask.float()
    adv = torch.where(mask > 0, advantage.float().unsqueeze(-1).expand_as(mask), torch.zeros_like(mask))
    return adv, adv.clone()


# ---------------------------------------------------------------------------------------------
# estimators


@register_adv_estimator("grpo", needs_group=True)
def grpo_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_index: torch.Tensor,
    *,
    norm_adv_by_std: bool = True,
    eps: float = 1e-6,
    **_: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO (Shao et al. 2024, DeepSeekMath §4.1.2): ``A_i = (r_i - mean_g) / (std_g + eps)``.

    ``std_g`` is the unbiased (``torch.std``) std of the group's scores; without
    ``norm_adv_by_std`` the advantage is ``r_i - mean_g``. A group of size 1 has mean 0, std 1.
    Returns (advantages, returns), both equal, (N, R) float32, broadcast over real tokens.
    """
    scores = (token_level_rewards * response_mask).sum(dim=-1)
    mean, std, _ = _group_mean_std(scores, group_index)
    adv = scores.double() - mean
    if norm_adv_by_std:
        adv = adv / (std + eps)
    return _outcome(adv, response_mask)


@register_adv_estimator("drgrpo", needs_group=True)
def drgrpo_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, group_index: torch.Tensor, **_: object
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training", §3.1): ``A_i = r_i - mean_g``.

    Never divided by the group std (``norm_adv_by_std`` is ignored). A group of size 1 has mean 0.
    """
    scores = (token_level_rewards * response_mask).sum(dim=-1)
    mean, _, _ = _group_mean_std(scores, group_index)
    return _outcome(scores.double() - mean, response_mask)


@register_adv_estimator("rloo", needs_group=True)
def rloo_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, group_index: torch.Tensor, **_: object
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO (Ahmadian et al. 2024, eq. 5): ``A_i = r_i - (sum_{j != i} r_j) / (G - 1)``.

    Equivalently ``G / (G - 1) * (r_i - mean_g)`` (verl). A group of size 1 has no baseline sample
    and gets advantage 0 (verl leaves the raw score there instead).
    """
    scores = (token_level_rewards * response_mask).sum(dim=-1).double()
    mean, _, counts = _group_mean_std(scores, group_index)
    adv = torch.where(counts > 1, (scores - mean) * counts / (counts - 1).clamp(min=1), torch.zeros_like(scores))
    return _outcome(adv, response_mask)


@register_adv_estimator("reinforce_plus_plus")
def reinforce_plus_plus_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_index: Optional[torch.Tensor] = None,
    *,
    gamma: float = 1.0,
    **_: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025, arXiv:2501.03262, §3): discounted returns, whitened over the batch.

    ``G_t = r_t + gamma * G_{t+1}`` over the real tokens of each response, then
    ``A = masked_whiten(G)`` over all real tokens of the batch (verl
    ``compute_reinforce_plus_plus_outcome_advantage``). Groups are not used.
    Returns (advantages (N,R), returns (N,R)), both float32 and zero outside the mask.
    """
    mask = response_mask.float()
    rewards = token_level_rewards.float() * mask
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        running = rewards[:, t] + gamma * running
        returns[:, t] = running
        running = running * mask[:, t]
    zeros = torch.zeros_like(returns)
    advantages = torch.where(mask > 0, masked_whiten(returns, mask), zeros)
    return advantages, torch.where(mask > 0, returns, zeros)


# ---------------------------------------------------------------------------------------------
# entry point


@torch.no_grad()
def compute_advantages(
    name: str,
    *,
    scores: torch.Tensor,
    group_index: torch.Tensor,
    response_mask: torch.Tensor,
    norm_adv_by_std: bool = True,
    gamma: float = 1.0,
    token_level_rewards: Optional[torch.Tensor] = None,
    eps: float = 1e-6,
    exclude: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and returns of a rollout batch with the estimator registered under ``name``.

    Args:
        name: ``algorithm.adv_estimator`` (``grpo``, ``drgrpo``, ``rloo``, ``reinforce_plus_plus``
            or a user-registered name).
        scores: (N,) float32 outcome reward per response.
        group_index: (N,) int64 group id per response (the responses of one prompt share an id;
            see ``group_index_from_uids``).
        response_mask: (N, R) float32, 1 on real response tokens.
        norm_adv_by_std: ``grpo`` only: divide by the group std.
        gamma: ``reinforce_plus_plus`` only: discount factor.
        token_level_rewards: (N, R) float32 rewards per token (e.g. from ``apply_kl_penalty``);
            None places each score on the last real token. When given, ``scores`` is only used for
            its shape check and outcome estimators use the masked row sums instead.
        eps: added to the group std (``grpo``).
        exclude: (N,) bool, responses left out of every statistic (group mean/std, batch
            whitening) with advantage and return 0 (``reward.on_failure=exclude``: their reward
            function failed). None: none excluded.

    Returns:
        ``(advantages, returns)``, each (N, R) float32, zero outside ``response_mask``.

    Raises:
        ValueError: unknown ``name`` (lists the known ones) or mismatched shapes.
    """
    fn = get_adv_estimator(name)
    _check_shapes(scores, response_mask)
    if group_index.shape != scores.shape:
        raise ValueError(f"group_index {tuple(group_index.shape)} and scores {tuple(scores.shape)} differ")
    if exclude is not None and bool(exclude.any()):
        if exclude.shape != scores.shape:
            raise ValueError(f"exclude {tuple(exclude.shape)} and scores {tuple(scores.shape)} differ")
        keep = torch.nonzero(~exclude.bool(), as_tuple=True)[0]
        advantages = torch.zeros_like(response_mask, dtype=torch.float32)
        returns = torch.zeros_like(advantages)
        if keep.numel():
            kept = compute_advantages(
                name, scores=scores[keep], group_index=group_index[keep], response_mask=response_mask[keep],
                norm_adv_by_std=norm_adv_by_std, gamma=gamma, eps=eps,
                token_level_rewards=None if token_level_rewards is None else token_level_rewards[keep],
            )
            advantages[keep], returns[keep] = kept
        return advantages, returns
    if token_level_rewards is None:
        token_level_rewards = scores_to_token_rewards(scores, response_mask)
    elif token_level_rewards.shape != response_mask.shape:
        raise ValueError(
            f"token_level_rewards {tuple(token_level_rewards.shape)} and response_mask "
            f"{tuple(response_mask.shape)} differ"
        )
    mask = response_mask.float()
    return fn(
        token_level_rewards.float() * mask,
        mask,
        group_index,
        norm_adv_by_std=norm_adv_by_std,
        gamma=gamma,
        eps=eps,
    )
