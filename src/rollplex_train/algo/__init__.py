"""Advantage estimators, policy losses, KL estimators and rewards (pure tensors, registries by name).

Nothing here touches devices or processes: inputs are tensors (or strings for rewards) and the
outputs live wherever the inputs do.
"""

from rollplex_train.algo.advantages import (
    apply_kl_penalty,
    compute_advantages,
    get_adv_estimator,
    group_index_from_uids,
    known_adv_estimators,
    masked_whiten,
    register_adv_estimator,
    scores_to_token_rewards,
)
from rollplex_train.algo.kl import get_kl_estimator, kl_penalty, known_kl_estimators, register_kl_estimator
from rollplex_train.algo.losses import (
    LOSS_AGG_MODES,
    agg_loss,
    batch_counts,
    entropy_from_logits,
    kl_loss,
    policy_loss,
)
from rollplex_train.algo.rewards import (
    RewardManager,
    extract_boxed,
    known_rewards,
    load_reward_function,
    register_reward,
)

__all__ = [
    "LOSS_AGG_MODES",
    "RewardManager",
    "agg_loss",
    "apply_kl_penalty",
    "batch_counts",
    "compute_advantages",
    "entropy_from_logits",
    "extract_boxed",
    "get_adv_estimator",
    "get_kl_estimator",
    "group_index_from_uids",
    "kl_loss",
    "kl_penalty",
    "known_adv_estimators",
    "known_kl_estimators",
    "known_rewards",
    "load_reward_function",
    "masked_whiten",
    "policy_loss",
    "register_adv_estimator",
    "register_kl_estimator",
    "register_reward",
    "scores_to_token_rewards",
]
