"""Driver-side glue between phases: rewards, advantages, batch metrics (responses become a
``TrainBatch`` through ``TrainBatch.from_responses``).

Pure tensors, no workers: the step (``runtime/step.py``) calls these between the worker phases;
each returns its values, and the step puts them on the batch in one place.
"""

from __future__ import annotations

from typing import Optional

import torch

from rollplex_train.algo.advantages import apply_kl_penalty, compute_advantages
from rollplex_train.algo.kl import kl_penalty
from rollplex_train.algo.rewards import RewardManager
from rollplex_train.config import Config
from rollplex_train.data.types import Response, TrainBatch


to_train_batch = TrainBatch.from_responses
"""Responses -> a right-padded :class:`TrainBatch` (``TrainBatch.from_responses``)."""


def score_responses(reward: RewardManager, batch: TrainBatch, responses: list[Response]):
    """(N,) float32 scores, (N,) bool failures (the reward function raised or gave no number) and
    reward metrics of the batch's responses."""
    prompts = [batch.prompts[g] for g in batch.group_index.tolist()]
    return reward.score_with_failures(
        [r.text for r in responses],
        [p.ground_truth for p in prompts],
        [p.uid for p in prompts],
        [list(p.options) for p in prompts],
    )


def step_advantages(cfg: Config, batch: TrainBatch, scores: torch.Tensor, failed: Optional[torch.Tensor],
               old: Optional[torch.Tensor], ref: Optional[torch.Tensor],
               groups: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, dict[str, float]]:
    """(N, R) float32 advantages of the configured estimator (KL in the reward if enabled, from the
    (N, R) old-policy and reference log-probs ``old``/``ref``), over the groups ``groups`` ((N,)
    int64; None: ``batch.group_index``, the prompts; an environment run's: the seeds).

    With ``reward.on_failure=exclude`` the responses ``failed`` get advantage 0 and stay out of their
    group's statistics; with ``zero`` they count as scored 0.

    Returns:
        the advantages and ``critic/*`` metrics (scores, token rewards, advantages, returns).
    """
    algo = cfg.algorithm
    token_rewards = None
    metrics: dict[str, float] = {}
    if algo.use_kl_in_reward and ref is not None:
        kl = kl_penalty(old, ref, algo.kl_estimator)
        token_rewards = apply_kl_penalty(scores, kl, batch.response_mask, algo.kl_coef)
        metrics["critic/kl"] = float((kl * batch.response_mask).sum() / batch.response_mask.sum().clamp(min=1))
    advantages, returns = compute_advantages(
        algo.adv_estimator,
        scores=scores,
        group_index=batch.group_index if groups is None else groups,
        response_mask=batch.response_mask,
        norm_adv_by_std=algo.norm_adv_by_std,
        gamma=algo.gamma,
        token_level_rewards=token_rewards,
        exclude=failed if cfg.reward.on_failure == "exclude" else None,
    )
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
    return advantages, metrics


def batch_metrics(batch: TrainBatch, responses: list[Response], max_new_tokens: int,
                  old_rows: Optional[torch.Tensor] = None) -> dict[str, float]:
    """``response_length/*``, ``prompt_length/*`` and the rollout-vs-actor log-prob mismatch.

    ``rollout/logprob_diff_max`` (nats) is the largest ``|rollout logp - old logp|`` over the real
    tokens of ``old_rows`` ((K,) int64 row indices), the rows whose old-policy log-probs were
    computed before the update; the rows that reuse the actor's forward get theirs only inside it
    (``runtime/old_policy.py``), so they are not read. None or empty: not logged.

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
    if batch.rollout_logprobs is not None and batch.old_logprobs is not None and old_rows is not None \
            and old_rows.numel():
        diff = (batch.rollout_logprobs[old_rows] - batch.old_logprobs[old_rows]).abs() * batch.response_mask[old_rows]
        out["rollout/logprob_diff_max"] = float(diff.max())
    return out


def num_tokens(batch: TrainBatch) -> int:
    """Prompt + response tokens of every response in the batch (for ``perf/throughput``)."""
    prompt = sum(batch.prompts[g].prompt_length for g in batch.group_index.tolist())
    return int(prompt + batch.response_mask.sum())
