"""Sampling of the built-in rollout engine: one seeded generator per sequence, top-k / top-p
filtering, and a draw by inverse CDF (``rollout/builtin.py``'s module docstring gives the order)."""

from __future__ import annotations

import hashlib

import torch


def sequence_generator(seed: int, uid: str, index: int) -> torch.Generator:
    """The sampling generator of response ``index`` of prompt ``uid`` under request ``seed``: seeded
    by a stable hash (BLAKE2b, not Python's salted ``hash``), the same in every process."""
    digest = hashlib.blake2b(f"{seed}:{uid}:{index}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))


def draw(probs: torch.Tensor, gens: list[torch.Generator]) -> torch.Tensor:
    """Sample one token per row by inverse CDF, row ``i`` with its own generator ``gens[i]``.

    Args:
        probs: (B, V) float32 probabilities (rows sum to 1 up to rounding; zeros never drawn).
        gens: B generators.

    Returns:
        (B,) int64 token ids.
    """
    u = torch.cat([torch.rand(1, generator=g, dtype=torch.float64) for g in gens]).to(probs.device, probs.dtype)
    cdf = probs.cumsum(-1)
    u = u * cdf[:, -1]  # inside [0, total) whatever the rounding of the sum
    return torch.searchsorted(cdf, u.unsqueeze(-1), right=True).squeeze(-1).clamp_(max=probs.shape[-1] - 1)


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask logits outside top-k / the top-p nucleus with -inf.

    Args:
        logits: (B, V) float32 (already divided by the temperature).
        top_k: keep the k largest (-1: off). top_p: keep the smallest set with mass >= top_p.

    Returns:
        (B, V) float32 with removed entries at -inf (the most likely token always survives).
    """
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        remove_sorted = cum - sorted_logits.softmax(-1) >= top_p  # mass before this token already >= p
        remove = torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted)
        logits = logits.masked_fill(remove, float("-inf"))
    return logits
