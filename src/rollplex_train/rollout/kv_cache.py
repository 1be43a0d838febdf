"""The decode KV cache of the built-in rollout engine: one buffer per layer, allocated once.

transformers' ``DynamicCache`` grows each layer's keys and values with ``torch.cat`` at every decode
step, which copies the whole cache per step: O(L^2) bytes over a response of L tokens
(``aten::cat`` is the largest single op of a CPU decode under ``torch.profiler``). This cache
writes each step's keys and values into a buffer sized for the prompt plus every new token and
hands attention a view of the filled part, so each step copies only its own token.

The view holds the same numbers in the same order as the concatenated tensor (only its batch and
head strides differ), so attention sees identical inputs: sampled tokens and log-probs are
bit-identical to ``DynamicCache``'s (checked in tests/test_rollout_builtin.py).

API facts: the layer/cache interface (``update``, ``get_seq_length``, ``get_mask_sizes``,
``batch_repeat_interleave``, ``batch_select_indices``) is that of ``transformers/cache_utils.py``
(``CacheLayerMixin``, ``DynamicLayer``, ``Cache``), transformers 5.x.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer


class PreallocatedLayer(DynamicLayer):
    """One attention layer's keys and values in a buffer of ``capacity`` positions.

    ``keys``/``values`` (what attention reads) are views ``buffer[:, :, :length]`` of shape
    (B, H_kv, length, D), in the model's dtype. A write past ``capacity`` reallocates the buffer at
    twice the needed size (never expected: the engine sizes it for prompt + max_new_tokens).
    """

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = int(capacity)
        self.length = 0
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        batch, heads, _, dim = key_states.shape
        self._k = key_states.new_empty(batch, heads, self.capacity, dim)
        self._v = value_states.new_empty(batch, heads, self.capacity, value_states.shape[-1])
        self.is_initialized = True

    def _views(self) -> None:
        self.keys, self.values = self._k[:, :, : self.length], self._v[:, :, : self.length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append (B, H_kv, q, D) keys/values; returns the (B, H_kv, length, D) views of all so far."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self._k.shape[2]:
            self._k, self._v = self._grown(self._k, 2 * end), self._grown(self._v, 2 * end)
        self._k[:, :, self.length:end] = key_states
        self._v[:, :, self.length:end] = value_states
        self.length = end
        self._views()
        return self.keys, self.values

    def _grown(self, buffer: torch.Tensor, positions: int) -> torch.Tensor:
        """A (B, H_kv, ``positions``, D) buffer holding ``buffer``'s first ``length`` positions."""
        bigger = buffer.new_empty(*buffer.shape[:2], positions, buffer.shape[3])
        bigger[:, :, : self.length] = buffer[:, :, : self.length]
        return bigger

    def get_seq_length(self) -> int:
        return self.length

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat each sequence ``repeats`` times along the batch (the n responses of a prompt)."""
        if self.length > 0:
            self._k, self._v = self._k.repeat_interleave(repeats, dim=0), self._v.repeat_interleave(repeats, dim=0)
            self._views()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the sequences at ``indices`` (1-D int64), in that order (finished ones dropped)."""
        if self.length > 0:
            self._k, self._v = self._k[indices], self._v[indices]
            self._views()


class PreallocatedCache(Cache):
    """A ``transformers`` cache of ``num_layers`` :class:`PreallocatedLayer` of ``capacity`` positions
    each: pass it as the model's cache for a prefill and the decode steps after it."""

    def __init__(self, num_layers: int, capacity: int):
        super().__init__(layers=[PreallocatedLayer(capacity) for _ in range(num_layers)])

    @property
    def nbytes(self) -> int:
        """Bytes of the key/value buffers of all layers (allocated capacity, not only the filled part)."""
        return sum(t.numel() * t.element_size() for layer in self.layers for t in (layer._k, layer._v)
                   if t is not None)

    @classmethod
    def left_padded(cls, keys: list[list[torch.Tensor]], values: list[list[torch.Tensor]], capacity: int
                    ) -> "PreallocatedCache":
        """A cache holding P prompts' KV caches, left-padded to the longest, as a batched prefill of
        left-padded prompts leaves it (the padded columns are zeros here: attention masks them).

        Args:
            keys, values: per prompt, per layer, (1, H_kv, L_p, D) tensors (``PrefixState.keys``).
            capacity: positions per buffer (>= the longest L_p; prompt + max_new_tokens).

        Raises:
            ValueError: no prompts, prompts with different layer counts, or a prompt longer than
                ``capacity``.
        """
        if not keys or len({len(k) for k in keys + values}) != 1:
            raise ValueError("left_padded: expected one (keys, values) list per prompt, all with the same layers")
        width = max(k[0].shape[-2] for k in keys)
        if width > capacity:
            raise ValueError(f"left_padded: a {width}-token prompt does not fit a capacity of {capacity}")
        cache = cls(len(keys[0]), capacity)
        for index, layer in enumerate(cache.layers):
            for store, per_prompt in (("_k", [k[index] for k in keys]), ("_v", [v[index] for v in values])):
                first = per_prompt[0]
                buffer = first.new_zeros(len(per_prompt), first.shape[1], capacity, first.shape[-1])
                for row, t in enumerate(per_prompt):
                    buffer[row, :, width - t.shape[-2]: width] = t[0]
                setattr(layer, store, buffer)
            layer.device, layer.length, layer.is_initialized = keys[0][index].device, width, True
            layer._views()
        return cache


def cache_nbytes(cache) -> int:
    """Bytes of a decode cache's key/value tensors: ``cache.nbytes`` where it has one (this module's,
    ``rollout/shared_prefix.py``'s), else the ``keys``/``values`` of a transformers cache's layers."""
    nbytes = getattr(cache, "nbytes", None)
    if nbytes is not None:
        return int(nbytes)
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)
               if t is not None)
