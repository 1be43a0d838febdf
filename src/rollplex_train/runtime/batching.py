"""Driver-side glue between phases: responses -> TrainBatch, rewards, advantages, batch metrics.

Pure tensors, no workers: the schedules call these between the worker phases.
"""

from __future__ import annotations

import dataclasses

import torch

from rollplex_train.algo.advantages import apply_kl_penalty, compute_advantages
from rollplex_train.algo.kl import kl_penalty
from rollplex_train.algo.rewards import RewardManager
from rollplex_train.config import Config
from rollplex_train.data.types import PromptSample, Response, TrainBatch


def to_train_batch(prompts: list[PromptSample], responses: list[Response], pad_id: int) -> TrainBatch:
    """Stack grouped responses into a right-padded TrainBatch.

    Args:
        responses: N responses, those of one prompt contiguous (as engines return them).

    Raises:
        ValueError: an empty response list (nothing to train on).
    """
    if not responses:
        raise ValueError("no responses to train on")
    max_len = max(1, max(int(r.token_ids.shape[0]) for r in responses))
    n = len(responses)
    ids = torch.full((n, max_len), pad_id, dtype=torch.long)
    mask = torch.zeros((n, max_len), dtype=torch.float32)
    rollout_logprobs = torch.zeros((n, max_len), dtype=torch.float32)
    for i, r in enumerate(responses):
        length = int(r.token_ids.shape[0])
        ids[i, :length] = r.token_ids
        mask[i, :length] = 1.0
        rollout_logprobs[i, :length] = r.logprobs
    return TrainBatch(
        prompts=prompts,
        group_index=torch.tensor([r.prompt_index for r in responses], dtype=torch.long),
        response_ids=ids,
        response_mask=mask,
        rollout_logprobs=rollout_logprobs,
    )


def groups_batch(prompts: list[PromptSample], groups: dict[int, list[Response]], indices: list[int],
                 pad_id: int) -> TrainBatch:
    """The TrainBatch of some finished groups (``groups[i]``: prompt i's responses), prompts
    renumbered 0..len(indices)-1 in ``indices`` order — the input of a suffix task during decode."""
    responses = [dataclasses.replace(r, prompt_index=local) for local, i in enumerate(indices) for r in groups[i]]
    return to_train_batch([prompts[i] for i in indices], responses, pad_id)


def group_rows(batch: TrainBatch, indices: list[int]) -> torch.Tensor:
    """Row indices of the responses of prompts ``indices``, in ``TrainBatch.select_groups`` order."""
    wanted = set(indices)
    return torch.tensor([row for row, g in enumerate(batch.group_index.tolist()) if g in wanted], dtype=torch.long)


def score_responses(reward: RewardManager, batch: TrainBatch, responses: list[Response]):
    """(N,) float32 scores and reward metrics for the batch's responses; the responses whose
    reward function failed are marked in ``batch.reward_failed``."""
    prompts = [batch.prompts[g] for g in batch.group_index.tolist()]
    scores, batch.reward_failed, metrics = reward.score_with_failures(
        [r.text for r in responses],
        [p.ground_truth for p in prompts],
        [p.uid for p in prompts],
        [list(p.options) for p in prompts],
    )
    return scores, metrics


def add_advantages(cfg: Config, batch: TrainBatch, scores: torch.Tensor) -> dict[str, float]:
    """Fill ``batch.advantages`` with the configured estimator (KL in the reward if enabled).

    With ``reward.on_failure=exclude`` the responses in ``batch.reward_failed`` get advantage 0 and
    stay out of their group's statistics; with ``zero`` they count as scored 0.

    Returns:
        ``critic/*`` metrics (scores, token rewards, advantages, returns).
    """
    algo = cfg.algorithm
    token_rewards = None
    metrics: dict[str, float] = {}
    if algo.use_kl_in_reward and batch.ref_logprobs is not None:
        kl = kl_penalty(batch.old_logprobs, batch.ref_logprobs, algo.kl_estimator)
        token_rewards = apply_kl_penalty(scores, kl, batch.response_mask, algo.kl_coef)
        metrics["critic/kl"] = float((kl * batch.response_mask).sum() / batch.response_mask.sum().clamp(min=1))
    advantages, returns = compute_advantages(
        algo.adv_estimator,
        scores=scores,
        group_index=batch.group_index,
        response_mask=batch.response_mask,
        norm_adv_by_std=algo.norm_adv_by_std,
        gamma=algo.gamma,
        token_level_rewards=token_rewards,
        exclude=batch.reward_failed if cfg.reward.on_failure == "exclude" else None,
    )
    batch.advantages = advantages
    mask = batch.response_mask.bool()
    seq_rewards = token_rewards.sum(-1) if token_rewards is not None else scores
    metrics.update({
        "critic/score/mean": float(scores.mean()),
        "critic/score/max": float(scores.max()),
        "critic/score/min": float(scores.min()),
        "critic/rewards/mean": float(seq_rewards.mean()),
        "critic/advantages/mean": float(advantages[mask].mean()) if mask.any() else 0.0,
        "critic/advantages/max": float(advantages[mask].max()) if mask.any() else 0.0,
        "critic/advantages/min": float(advantages[mask].min()) if mask.any() else 0.0,
        "critic/returns/mean": float(returns[mask].mean()) if mask.any() else 0.0,
    })
    return metrics


def batch_metrics(batch: TrainBatch, responses: list[Response], max_new_tokens: int) -> dict[str, float]:
    """``response_length/*``, ``prompt_length/*`` and the rollout-vs-actor log-prob mismatch.

    ``response_length/clip_ratio`` is the fraction of responses cut at ``max_new_tokens``
    (``finish_reason == "length"``); one that ended on EOS or a stop string exactly at the limit
    is not clipped.
    """
    lengths = batch.response_mask.sum(-1)
    prompt_lengths = torch.tensor([float(batch.prompts[g].prompt_length) for g in batch.group_index.tolist()])
    out = {
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        "response_length/min": float(lengths.min()),
        "response_length/clip_ratio": sum(r.finish_reason == "length" for r in responses) / max(len(responses), 1),
        "prompt_length/mean": float(prompt_lengths.mean()),
        "prompt_length/max": float(prompt_lengths.max()),
    }
    if batch.rollout_logprobs is not None and batch.old_logprobs is not None:
        diff = (batch.rollout_logprobs - batch.old_logprobs).abs() * batch.response_mask
        out["rollout/logprob_diff_max"] = float(diff.max())
    return out


def num_tokens(batch: TrainBatch) -> int:
    """Prompt + response tokens of every response in the batch (for ``perf/throughput``)."""
    prompt = sum(batch.prompts[g].prompt_length for g in batch.group_index.tolist())
    return int(prompt + batch.response_mask.sum())
