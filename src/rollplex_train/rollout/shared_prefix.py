"""One copy of a prompt's KV cache for the n responses of its group, during decode.

Without it the built-in engine repeats each prompt's cache n times along the batch
(``PreallocatedCache.batch_repeat_interleave``): n copies of the same keys and values, each read by
every decode step. SGLang keeps one copy per prompt (its radix cache); so does this cache. Per
layer it holds the P prompts' keys/values once, left-padded, ``(P, K, W, D)``, and the B = P x n
sequences' response keys/values ``(B, K, C, D)`` in a buffer preallocated for C = max_new_tokens.

Attention of one new token per sequence over [its prompt | its response] is computed in two parts
whose softmax states are merged, the shared-prefix ("cascade") decomposition of Hydragen (Juravsky
et al. 2024, "Hydragen: High-Throughput LLM Inference with Shared Prefixes", section 3) and
FlashInfer's ``merge_state`` (``include/flashinfer/attention/cascade.cuh``): with scores s, the
prefix part gives (m_p = max s, l_p = sum exp(s - m_p), o_p = sum exp(s - m_p) v), the suffix part
the same over the response, and

    out = (o_p e^(m_p - m) + o_r e^(m_r - m)) / (l_p e^(m_p - m) + l_r e^(m_r - m)),  m = max(m_p, m_r),

which is softmax attention over the concatenation. The prompt part runs as one batched matmul per
prompt and KV head over the queries of all its samples and query heads (n x groups rows), so each
prompt's keys and values are read once per step instead of n times.

Numerics: the same function as SDPA over the repeated cache, in another summation order (SDPA's
CPU kernel accumulates the softmax blockwise): not bitwise. tests/test_rollout_shared_prefix.py
measures the difference; the engine keeps it behind ``rollout.share_prompt_kv``.

Legend: P prompts, n samples per prompt, B live sequences, K KV heads, g query heads per KV head,
H = K g query heads, D head dim, W prompt width (longest prompt), C response capacity.
"""

from __future__ import annotations

import torch


class SharedPromptLayer:
    """One layer: the prompts' KV once, the sequences' response KV in a preallocated buffer."""

    def __init__(self, prompt_k: torch.Tensor, prompt_v: torch.Tensor, rows: int, capacity: int):
        self.prompt_k, self.prompt_v = prompt_k, prompt_v
        p, k, _, d = prompt_k.shape
        self._k = prompt_k.new_empty(rows, k, capacity, d)
        self._v = prompt_v.new_empty(rows, k, capacity, prompt_v.shape[-1])
        self.length = 0

    def update(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the (B, K, 1, D) key/value of the new token; returns the (B, K, length, D) views."""
        if self.length == self._k.shape[2]:
            raise ValueError(f"shared prompt cache: response capacity {self._k.shape[2]} exceeded")
        self._k[:, :, self.length] = key[:, :, 0]
        self._v[:, :, self.length] = value[:, :, 0]
        self.length += 1
        return self._k[:, :, : self.length], self._v[:, :, : self.length]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.prompt_k, self.prompt_v, self._k, self._v))


class SharedPromptCache:
    """Decode cache of P prompts sampled n times each (sequence b = prompt b // n, sample b % n at the
    start; rows are dropped as sequences finish).

    Args:
        keys, values: per prompt, per layer, (1, K, L_p, D) prompt caches (``PrefixState.keys``).
        prompt_mask: (P, W) int/bool, 1 on each prompt's real (right-aligned) columns, W = max L_p.
        n: samples per prompt. capacity: response tokens the buffers hold (max_new_tokens).

    Raises:
        ValueError: no prompts, layer counts that differ, or a mask narrower than a prompt.
    """

    def __init__(self, keys: list[list[torch.Tensor]], values: list[list[torch.Tensor]],
                 prompt_mask: torch.Tensor, n: int, capacity: int):
        if not keys or len({len(k) for k in keys + values}) != 1:
            raise ValueError("SharedPromptCache: expected one (keys, values) list per prompt, all with the same layers")
        width = prompt_mask.shape[1]
        if max(k[0].shape[-2] for k in keys) > width:
            raise ValueError(f"SharedPromptCache: a prompt is longer than the mask's {width} columns")
        self.n = n
        self.layers = [SharedPromptLayer(_left_padded([k[i] for k in keys], width),
                                         _left_padded([v[i] for v in values], width), len(keys) * n, capacity)
                       for i in range(len(keys[0]))]
        dev = keys[0][0].device
        self.prompt_mask = prompt_mask.to(dev).bool()
        rows = torch.arange(len(keys) * n, device=dev)
        self.group, self.slot = rows // n, rows % n  # (B,) prompt row and sample index of each sequence

    @property
    def nbytes(self) -> int:
        """Bytes of the cache's tensors (prompt KV once + response buffers), all layers."""
        return sum(layer.nbytes for layer in self.layers)

    def update(self, key: torch.Tensor, value: torch.Tensor, layer: int):
        return self.layers[layer].update(key, value)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the sequences at ``indices`` (1-D int64), in that order; prompts none of them uses
        are dropped."""
        group = self.group[indices]
        live = torch.unique(group)  # sorted
        if len(live) < self.prompt_mask.shape[0]:
            self.prompt_mask = self.prompt_mask[live]
            group = torch.searchsorted(live, group)
        for layer in self.layers:
            layer._k, layer._v = layer._k[indices], layer._v[indices]
            if len(live) < layer.prompt_k.shape[0]:
                layer.prompt_k, layer.prompt_v = layer.prompt_k[live], layer.prompt_v[live]
        self.group, self.slot = group, self.slot[indices]

    def attend(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        """Attention of the new token's (B, H, 1, D) queries over [prompt | response so far].

        Returns:
            (B, H, 1, D), as ``F.scaled_dot_product_attention`` over the repeated cache returns it.
        """
        cache = self.layers[layer]
        return shared_prefix_attention(q, cache.prompt_k, cache.prompt_v, self.prompt_mask,
                                       cache._k[:, :, : cache.length], cache._v[:, :, : cache.length],
                                       self.group, self.slot, self.n, scale)


def _left_padded(per_prompt: list[torch.Tensor], width: int) -> torch.Tensor:
    """(P, K, width, D): each (1, K, L_p, D) tensor at the right end of its row, zeros before."""
    first = per_prompt[0]
    out = first.new_zeros(len(per_prompt), first.shape[1], width, first.shape[-1])
    for row, t in enumerate(per_prompt):
        out[row, :, width - t.shape[-2]:] = t[0]
    return out


def shared_prefix_attention(q: torch.Tensor, prompt_k: torch.Tensor, prompt_v: torch.Tensor,
                            prompt_mask: torch.Tensor, resp_k: torch.Tensor, resp_v: torch.Tensor,
                            group: torch.Tensor, slot: torch.Tensor, n: int, scale: float) -> torch.Tensor:
    """Softmax attention of one query token per sequence over its prompt's shared KV and its own
    response KV (module docstring's merge).

    Args:
        q: (B, H, 1, D) queries (query head h reads KV head h // g, transformers' ``repeat_kv``).
        prompt_k, prompt_v: (P, K, W, D); prompt_mask: (P, W) bool, True on real columns (each row
            has at least one).
        resp_k, resp_v: (B, K, T, D) response keys/values, the new token's included (T >= 1).
        group, slot: (B,) int64: each sequence's prompt row and its sample index in [0, n).

    Returns:
        (B, H, 1, D) in q's dtype.
    """
    b, h, _, d = q.shape
    p, k, w, _ = prompt_k.shape
    g = h // k
    qh = q.reshape(b, k, g, d)
    grouped = q.new_zeros(p, n, k, g, d)
    grouped[group, slot] = qh
    grouped = grouped.permute(0, 2, 1, 3, 4).reshape(p, k, n * g, d)  # a prompt's queries, all samples
    s = torch.matmul(grouped, prompt_k.transpose(-1, -2)) * scale  # (P, K, n g, W)
    s = s.masked_fill(~prompt_mask[:, None, None, :], float("-inf"))
    m_p = s.amax(-1, keepdim=True)
    e = torch.exp(s - m_p)
    l_p, o_p = e.sum(-1, keepdim=True), torch.matmul(e, prompt_v)

    def per_sequence(t: torch.Tensor) -> torch.Tensor:  # (P, K, n g, X) -> (B, K, g, X)
        return t.reshape(p, k, n, g, -1).permute(0, 2, 1, 3, 4)[group, slot]

    m_p, l_p, o_p = per_sequence(m_p), per_sequence(l_p), per_sequence(o_p)
    s = torch.matmul(qh, resp_k.transpose(-1, -2)) * scale  # (B, K, g, T)
    m_r = s.amax(-1, keepdim=True)
    e = torch.exp(s - m_r)
    l_r, o_r = e.sum(-1, keepdim=True), torch.matmul(e, resp_v)
    m = torch.maximum(m_p, m_r)
    a, c = torch.exp(m_p - m), torch.exp(m_r - m)
    out = (o_p * a + o_r * c) / (l_p * a + l_r * c)
    return out.reshape(b, h, 1, d)
