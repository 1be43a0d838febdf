"""Log-probs (and entropy) of chosen tokens without materialising the full-vocabulary log-softmax.

For M hidden states h (M, H), an LM head W (V, H) (optional bias b) and chosen tokens y (M,), with
``z = (h W^T + b) / T`` (temperature T):

    logp = z[y] - logsumexp(z)                  entropy = logsumexp(z) - sum_v softmax(z)_v z_v

computed over chunks of ``chunk_rows`` rows, so at most (chunk_rows, V) logits exist at a time (the
forward keeps only h, y and two floats per row). The backward recomputes each chunk's logits:

    dL/dz = g_logp * (onehot(y) - p) - g_ent * p * (log p + entropy)      (p = softmax(z))

(the entropy term from dH/dz_k = -p_k (log p_k + H)), then dL/dh = dL/dz W / T and
dL/dW = (dL/dz)^T h / T. This is the chunked log-prob kernel that TRL 1.16 uses for its fused LM
head (``trl/kernels/chunked_logprob.py``), written here in plain torch for CPU and GPU alike.

Legend: M rows, H hidden size, V vocabulary. Float32 math (logits are upcast as the rollout does).
"""

from __future__ import annotations

from typing import Optional

import torch

CHUNK_ROWS = 1024
"""Rows per chunk: (1024, V) float32 logits are 0.6 GB at V = 152k (Qwen2.5), 4.5 MB at V = 1.1k."""


def _logits(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], inv_t: float) -> torch.Tensor:
    z = torch.nn.functional.linear(hidden, weight, bias).float()
    return z * inv_t if inv_t != 1.0 else z


class _ChunkedLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, tokens, inv_t, chunk_rows, with_entropy):
        logp = hidden.new_empty(hidden.shape[0], dtype=torch.float32)
        lse = torch.empty_like(logp)
        entropy = torch.zeros_like(logp)
        for start in range(0, hidden.shape[0], chunk_rows):
            rows = slice(start, start + chunk_rows)
            z = _logits(hidden[rows], weight, bias, inv_t)
            lse[rows] = torch.logsumexp(z, dim=-1)
            logp[rows] = z.gather(-1, tokens[rows].unsqueeze(-1)).squeeze(-1) - lse[rows]
            if with_entropy:
                p = torch.exp(z - lse[rows].unsqueeze(-1))
                entropy[rows] = lse[rows] - (p * z).sum(-1)
        ctx.save_for_backward(hidden, weight, bias, tokens, lse, entropy)
        ctx.inv_t, ctx.chunk_rows, ctx.with_entropy = inv_t, chunk_rows, with_entropy
        ctx.mark_non_differentiable(lse)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, tokens, lse, entropy = ctx.saved_tensors
        inv_t = ctx.inv_t
        grad_h = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if ctx.needs_input_grad[1] else None
        grad_b = (torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device)
                  if bias is not None and ctx.needs_input_grad[2] else None)
        use_entropy = ctx.with_entropy and grad_entropy is not None
        for start in range(0, hidden.shape[0], ctx.chunk_rows):
            rows = slice(start, start + ctx.chunk_rows)
            z = _logits(hidden[rows], weight, bias, inv_t)
            logp_all = z - lse[rows].unsqueeze(-1)
            p = torch.exp(logp_all)
            g = grad_logp[rows].unsqueeze(-1) if grad_logp is not None else torch.zeros_like(lse[rows]).unsqueeze(-1)
            dz = -g * p
            dz.scatter_add_(-1, tokens[rows].unsqueeze(-1), g)
            if use_entropy:
                dz -= grad_entropy[rows].unsqueeze(-1) * p * (logp_all + entropy[rows].unsqueeze(-1))
            if inv_t != 1.0:
                dz = dz * inv_t
            if grad_h is not None:
                grad_h[rows] = (dz @ weight.float()).to(hidden.dtype)
            if grad_w is not None:
                grad_w += dz.t() @ hidden[rows].float()
            if grad_b is not None:
                grad_b += dz.sum(0)
        grad_w = None if grad_w is None else grad_w.to(weight.dtype)
        grad_b = None if grad_b is None else grad_b.to(bias.dtype)
        return grad_h, grad_w, grad_b, None, None, None, None


def chosen_token_logprobs(
    hidden: torch.Tensor,
    lm_head: torch.nn.Linear,
    tokens: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_rows: int = CHUNK_ROWS,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-probs of ``tokens`` under ``softmax(lm_head(hidden) / temperature)``, and its entropy.

    Args:
        hidden: (..., H) hidden states (any leading shape, flattened to M rows).
        lm_head: the LM head, a ``torch.nn.Linear`` (V, H) (tied or not, with or without bias).
        tokens: (...) int64 chosen token per row (same leading shape as ``hidden``).
        temperature: > 0; the logits are divided by it.
        with_entropy: also return the entropy of each row's distribution.
        chunk_rows: rows whose logits exist at once.

    Returns:
        logprobs (...) float32 and entropy (...) float32 (None unless ``with_entropy``); both
        differentiable with respect to ``hidden`` and the head's parameters.

    Raises:
        ValueError: a non-positive temperature or chunk size, or mismatched shapes.
    """
    if temperature <= 0 or chunk_rows < 1:
        raise ValueError(f"temperature={temperature}, chunk_rows={chunk_rows}: expected > 0 and >= 1")
    if hidden.shape[:-1] != tokens.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and tokens {tuple(tokens.shape)}: leading shapes differ")
    lead = tokens.shape
    logp, entropy = _ChunkedLogProbs.apply(hidden.reshape(-1, hidden.shape[-1]), lm_head.weight, lm_head.bias,
                                           tokens.reshape(-1), 1.0 / temperature, chunk_rows, with_entropy)
    return logp.view(lead), (entropy.view(lead) if with_entropy else None)
