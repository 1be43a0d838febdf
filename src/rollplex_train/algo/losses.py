"""Policy-gradient loss, loss aggregation, entropy and KL loss (pure tensors).

Legend: N responses, R response tokens (right-padded), V vocabulary size. ``mask`` is float32
(N, R) with 1 on real tokens. Log-probs are (N, R) float in nats.

Micro-batching: a mini-batch (one optimizer step) is split by rows into micro-batches (one
forward/backward each). Pass the mini-batch totals ``num_tokens`` (real tokens) and ``num_seqs``
(responses with at least one real token) to every micro-batch call; the micro-batch losses then
sum to the mini-batch loss, so gradients accumulated with plain ``loss.backward()`` equal the
gradient of the whole mini-batch (no extra scaling by the number of micro-batches).
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from rollplex_train.algo.kl import kl_penalty

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
Count = Union[int, float, torch.Tensor]


def _masked(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``values`` on real tokens, exactly 0 elsewhere (also where padding holds inf/NaN)."""
    return torch.where(mask > 0, values, torch.zeros_like(values))


def _denominator(count: Optional[Count], default: torch.Tensor, key: str) -> torch.Tensor:
    if count is None:
        return default.clamp(min=1)
    value = torch.as_tensor(count, dtype=torch.float32, device=default.device)
    if value.numel() != 1 or not bool(value > 0):
        raise ValueError(f"{key}={count!r}: expected a positive count")
    return value


def agg_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    *,
    num_tokens: Optional[Count] = None,
    num_seqs: Optional[Count] = None,
) -> torch.Tensor:
    """Aggregate a per-token loss (N, R) into a scalar (verl ``agg_loss``, with global normalisers).

    Modes (``actor.loss_agg_mode``):
        - ``token-mean``: ``sum(loss * mask) / num_tokens`` (DAPO, Yu et al. 2025 §3.3).
        - ``seq-mean-token-mean``: ``sum_i (sum_t loss_it m_it / sum_t m_it) / num_seqs``
          (the original GRPO objective, Shao et al. 2024 eq. 3).
        - ``seq-mean-token-sum``: ``sum_i (sum_t loss_it m_it) / num_seqs`` (Dr. GRPO-like, with a
          per-sequence token sum).

    Args:
        loss_mat: (N, R) float per-token loss. Values on padding are ignored (even inf/NaN).
        mask: (N, R) float32, 1 on real tokens.
        mode: one of ``LOSS_AGG_MODES``.
        num_tokens: real tokens of the whole mini-batch (``token-mean``); default: ``mask.sum()``.
        num_seqs: responses with >= 1 real token in the whole mini-batch (``seq-*`` modes);
            default: the rows of ``mask`` with a real token.

    Returns:
        0-dim tensor of the dtype of ``loss_mat`` (0 when the mask is empty and no count is given).

    Raises:
        ValueError: unknown ``mode``, a non-positive count, or mismatched shapes.
    """
    if loss_mat.shape != mask.shape:
        raise ValueError(f"loss_mat {tuple(loss_mat.shape)} and mask {tuple(mask.shape)} differ")
    mask = mask.to(loss_mat.dtype)
    masked = _masked(loss_mat, mask)
    if mode == "token-mean":
        denom = _denominator(num_tokens, mask.sum(), "num_tokens")
        return masked.sum() / denom.to(loss_mat.dtype)
    seq_sum = masked.sum(dim=-1)  # (N,)
    if mode == "seq-mean-token-mean":
        per_seq = seq_sum / mask.sum(dim=-1).clamp(min=1)
    elif mode == "seq-mean-token-sum":
        per_seq = seq_sum
    else:
        raise ValueError(f"actor.loss_agg_mode={mode!r}: expected one of {list(LOSS_AGG_MODES)}")
    denom = _denominator(num_seqs, (mask.sum(dim=-1) > 0).sum().to(loss_mat.dtype), "num_seqs")
    return per_seq.sum() / denom.to(loss_mat.dtype)


def _masked_mean_item(values: torch.Tensor, mask: torch.Tensor) -> float:
    return float((_masked(values, mask).sum() / mask.sum().clamp(min=1)).item())


def policy_loss(
    logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_ratio_low: float,
    clip_ratio_high: float,
    loss_agg_mode: str,
    clip_ratio_c: float = 3.0,
    num_tokens: Optional[Count] = None,
    num_seqs: Optional[Count] = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Dual-clip PPO surrogate loss with an asymmetric clip range (verl ``compute_policy_loss``).

    Per token, with ``rho = exp(logprob - old_logprob)`` (log-ratio clamped to [-20, 20] as in
    verl) and advantage ``A``:

        clipped = max(-A * rho, -A * clip(rho, 1 - clip_ratio_low, 1 + clip_ratio_high))
        loss    = min(clipped, -A * clip_ratio_c)  if A < 0,  else clipped

    i.e. the negated clipped objective of Schulman et al. 2017 (PPO) eq. 7, with the clip-higher
    range of DAPO (Yu et al. 2025 §3.1) when ``clip_ratio_high > clip_ratio_low``, and the lower
    bound of dual-clip PPO (Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep RL",
    eq. 5) on negative-advantage tokens, as verl's ``core_algos.compute_policy_loss`` (vanilla)
    does. Aggregated with ``agg_loss`` (see there for ``num_tokens`` / ``num_seqs``).

    Args:
        logprob: (N, R) float actor log-probs of the sampled tokens, with grad.
        old_logprob: (N, R) float log-probs under the policy that sampled them (no grad needed).
        advantages: (N, R) float32.
        mask: (N, R) float32, 1 on real tokens.
        clip_ratio_low, clip_ratio_high: ``actor.clip_ratio_low`` / ``actor.clip_ratio_high``, >= 0.
        loss_agg_mode: ``actor.loss_agg_mode``.
        clip_ratio_c: ``actor.clip_ratio_c`` (> 1): a negative-advantage token's loss is at most
            ``-A * clip_ratio_c`` (verl's default 3.0).

    Returns:
        ``(loss, metrics)``: the 0-dim loss and floats ``actor/pg_loss`` (the loss value; a
        micro-batch's share when mini-batch counts are passed), ``actor/pg_clipfrac`` (fraction of
        this call's real tokens where the clipped term is the larger loss), ``actor/pg_clipfrac_lower``
        (fraction of real tokens with ``A < 0`` whose loss the dual clip bounds) and ``actor/ppo_kl``
        (masked mean of ``old_logprob - logprob``, a k1 estimate of KL(old || current)).

    Raises:
        ValueError: mismatched shapes, an unknown ``loss_agg_mode`` or ``clip_ratio_c <= 1``.
    """
    if not clip_ratio_c > 1.0:
        raise ValueError(f"actor.clip_ratio_c={clip_ratio_c}: expected a number > 1 (dual-clip PPO)")
    for name, t in (("old_logprob", old_logprob), ("advantages", advantages), ("mask", mask)):
        if t.shape != logprob.shape:
            raise ValueError(f"{name} {tuple(t.shape)} and logprob {tuple(logprob.shape)} differ")
    mask = mask.to(logprob.dtype)
    log_ratio = torch.clamp(logprob - old_logprob, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    clipped = torch.maximum(loss_unclipped, loss_clipped)
    loss_lower = -advantages * clip_ratio_c
    negative = advantages < 0
    loss_mat = torch.where(negative, torch.minimum(clipped, loss_lower), clipped)
    loss = agg_loss(loss_mat, mask, loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs)
    with torch.no_grad():
        metrics = {
            "actor/pg_loss": float(loss.detach().item()),
            "actor/pg_clipfrac": _masked_mean_item(torch.gt(loss_clipped, loss_unclipped).float(), mask),
            "actor/pg_clipfrac_lower": _masked_mean_item((torch.gt(clipped, loss_lower) & negative).float(), mask),
            "actor/ppo_kl": _masked_mean_item(-log_ratio, mask),
        }
    return loss, metrics


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the categorical distribution ``softmax(logits)`` over the last axis.

    ``H = logsumexp(z) - sum_v softmax(z)_v * z_v`` (verl ``entropy_from_logits``): no ``log(0)``
    and no overflow for large logits. Entries of ``-inf`` (masked vocabulary) are allowed.

    Args:
        logits: (..., V) float.

    Returns:
        (...) float entropy in nats, same dtype as ``logits``.
    """
    probs = torch.softmax(logits, dim=-1)
    finite = torch.where(torch.isfinite(logits), logits, torch.zeros_like(logits))
    return torch.logsumexp(logits, dim=-1) - (probs * finite).sum(dim=-1)


def kl_loss(
    logprob: torch.Tensor,
    ref_logprob: torch.Tensor,
    mask: torch.Tensor,
    estimator: str,
    mode: str,
    num_tokens: Optional[Count] = None,
    num_seqs: Optional[Count] = None,
) -> torch.Tensor:
    """KL(actor || reference) loss term (GRPO style, ``algorithm.use_kl_loss``), unweighted.

    ``agg_loss(kl_penalty(logprob, ref_logprob, estimator), mask, mode)``; multiply by
    ``algorithm.kl_coef`` outside.

    Args:
        logprob: (N, R) float actor log-probs, with grad.
        ref_logprob: (N, R) float reference log-probs (detached).
        mask: (N, R) float32, 1 on real tokens.
        estimator: ``algorithm.kl_estimator`` (``k1``, ``k2``, ``k3``, ``low_var_kl``).
        mode: ``actor.loss_agg_mode``.
        num_tokens, num_seqs: mini-batch counts, as in ``agg_loss``.

    Returns:
        0-dim tensor.

    Raises:
        ValueError: unknown estimator or mode, or mismatched shapes.
    """
    kl = kl_penalty(logprob, ref_logprob, estimator)
    return agg_loss(kl, mask, mode, num_tokens=num_tokens, num_seqs=num_seqs)


def batch_counts(mask: torch.Tensor) -> tuple[int, int]:
    """``(num_tokens, num_seqs)`` of a mini-batch mask (N, R): real tokens, rows with a real token."""
    return int(mask.sum().item()), int((mask.sum(dim=-1) > 0).sum().item())
