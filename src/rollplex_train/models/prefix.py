"""Prefix/suffix decomposition of a Qwen2-VL / Qwen2.5-VL forward pass.

The prefix of a GRPO group (its images/video and prompt tokens) is the same for the G responses.
``encode_prefix`` runs it once per prompt and keeps what the responses need: the per-layer KV cache
of the prompt, the hidden state of its last real token (which scores response token 0) and the
M-RoPE position where the response starts. ``score_suffix`` then runs only the response tokens of
all G responses against that one cache. With ``with_grad=True`` the prefix keeps its autograd
graph (vision tower included unless frozen), so one backward of a loss over the suffixes gives the
same gradients as the full-sequence loss.

The prefix tensors are never modified: every suffix call wraps them in a fresh ``DynamicCache``
(which concatenates into new tensors), so one prefix serves any number of suffix calls.

Legend: P prompts, Lp prompt tokens, N responses, R response tokens, H hidden size,
K kv heads, D head dim, NL decoder layers.
"""

from __future__ import annotations

import itertools

from dataclasses import dataclass, field
from typing import Optional, Union

import torch

from rollplex_train.data.types import PromptSample, VisionInputs
from rollplex_train.device import model_device
from rollplex_train.models.hf_compat import cache_kwargs
from rollplex_train.models.sequence import (
    embed_with_vision,
    logprobs_from_hidden,
    pad_prompts,
    prompt_columns,
    rope_positions,
)


_GRAPH_IDS = itertools.count()

@dataclass
class PrefixState:
    """Response-independent state of one prompt under one set of weights.

    Attributes:
        uid: the prompt's id.
        version: weights version that produced it (``"ref"`` for the frozen reference).
        keys, values: NL tensors (1, K, Lp, D): the prompt's KV cache, real tokens only.
        last_hidden: (H,) final-layer hidden state of the last real prompt token.
        next_position: M-RoPE position id of response token 0 (same on the t/h/w axes).
        requires_grad: the tensors carry the prefix's autograd graph (actor training).
        saved_bytes: bytes of activations the autograd graph keeps alive (0 without grad).
        graph_id: id of the batched forward that made it (states of one ``encode_prefix`` call
            with grad share one autograd graph; None without grad).
    """

    uid: str
    version: Union[int, str]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    last_hidden: torch.Tensor
    next_position: int
    requires_grad: bool = False
    saved_bytes: int = 0
    graph_id: Optional[int] = None
    extra: dict = field(default_factory=dict)

    @property
    def prompt_length(self) -> int:
        return int(self.keys[0].shape[-2])

    def detached(self, version: Union[int, str, None] = None) -> "PrefixState":
        """The same KV cache and hidden state without the autograd graph (tensors shared, not copied):
        what a rollout engine needs to decode from this prompt instead of prefilling it itself.
        ``version``: the version to record (None: this state's), e.g. the rollout's weights version
        of an actor state keyed by optimizer steps."""
        return PrefixState(uid=self.uid, version=self.version if version is None else version,
                           keys=[k.detach() for k in self.keys],
                           values=[v.detach() for v in self.values], last_hidden=self.last_hidden.detach(),
                           next_position=self.next_position)

    @property
    def nbytes(self) -> int:
        """Bytes held: KV cache + last hidden state + activations kept for backward."""
        kv = sum(t.numel() * t.element_size() for t in self.keys + self.values)
        return kv + self.last_hidden.numel() * self.last_hidden.element_size() + self.saved_bytes


class _SavedBytes:
    """Counts the bytes autograd saves for backward (distinct storages, parameters excluded)."""

    def __init__(self, model):
        self.bytes = 0
        self._seen: set[int] = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(self, t: torch.Tensor):
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in self._seen:
            self._seen.add(key)
            self.bytes += storage.nbytes()
        return t

    @staticmethod
    def unpack(t):
        return t


def encode_prefix(
    model,
    prompts: list[PromptSample],
    *,
    version: Union[int, str],
    with_grad: bool = False,
    freeze_vision: bool = False,
    padding: str = "left",
) -> list[PrefixState]:
    """Run the prompts (and their images/videos) once; return one PrefixState per prompt.

    Args:
        model: a Qwen2-VL / Qwen2.5-VL ``*ForConditionalGeneration``.
        prompts: P prompts, batched in one forward (padded on ``padding``: ``left`` or ``right``).
        version: the weights version recorded in the states.
        with_grad: keep the autograd graph for a later backward through the suffixes.
        freeze_vision: compute vision features without a graph even when ``with_grad``.

    Raises:
        ValueError: unknown padding, or placeholders that do not match the vision inputs.
    """
    from transformers import DynamicCache

    ids, mask = pad_prompts(prompts, model.config.get_text_config().pad_token_id or 0, side=padding)
    width = ids.shape[1]
    dev = model_device(model)
    ids, mask = ids.to(dev), mask.to(dev)
    vision = VisionInputs.concat([p.vision for p in prompts]).to(dev)
    counter = _SavedBytes(model)
    with torch.set_grad_enabled(with_grad), torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
        position_ids, deltas = rope_positions(model, ids, mask, vision)
        embeds = embed_with_vision(model, ids, vision, vision_grad=with_grad and not freeze_vision)
        cache = DynamicCache(config=model.config)
        text = model.model.language_model
        out = text(inputs_embeds=embeds, attention_mask=mask, position_ids=position_ids, use_cache=True,
                   **cache_kwargs(text, cache))
    states = []
    per_prompt_bytes = counter.bytes // max(len(prompts), 1)
    graph_id = next(_GRAPH_IDS) if with_grad else None
    for i, p in enumerate(prompts):
        cols = prompt_columns(p.prompt_length, width, padding)
        last = cols.stop - 1
        states.append(PrefixState(
            uid=p.uid,
            version=version,
            keys=[layer.keys[i : i + 1, :, cols] for layer in cache.layers],
            values=[layer.values[i : i + 1, :, cols] for layer in cache.layers],
            last_hidden=out.last_hidden_state[i, last],
            next_position=int(p.prompt_length + deltas[i, 0]),
            requires_grad=with_grad,
            saved_bytes=per_prompt_bytes if with_grad else 0,
            graph_id=graph_id,
        ))
    return states


def score_suffix(
    model,
    states: list[PrefixState],
    group_index: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Per-token log-probs of N responses, each attending to its prompt's shared prefix cache.

    Token 0 of a response is scored by its prefix's ``last_hidden``; tokens 1..R-1 by the suffix
    forward over tokens 0..R-2 with explicit M-RoPE positions ``next_position + t`` and an attention
    mask covering the (left-padded) prefix and the response.

    Args:
        states: P prefix states; group_index (N,) int64 picks each response's state.
        response_ids: (N, R) int64 right-padded; response_mask: (N, R) float32.

    Returns:
        logprobs (N, R) float32 and optional entropy (N, R) float32, zero outside the mask.
    """
    from transformers import DynamicCache

    dev = model_device(model)  # the responses are built on CPU (data/types.py)
    group_index, response_ids, response_mask = group_index.to(dev), response_ids.to(dev), response_mask.to(dev)
    n, r = response_ids.shape
    rows = [states[g] for g in group_index.tolist()]
    h0 = torch.stack([s.last_hidden for s in rows]).unsqueeze(1)  # (N, 1, H)
    if r == 1:
        return logprobs_from_hidden(model, h0, response_ids, response_mask, temperature, with_entropy)
    width = max(s.prompt_length for s in states)
    pad_len = torch.tensor([width - s.prompt_length for s in states], device=dev)

    def stacked(per_state: list[torch.Tensor]) -> torch.Tensor:
        padded = [torch.nn.functional.pad(t, (0, 0, width - s.prompt_length, 0)) for t, s in zip(per_state, states)]
        return torch.cat(padded, dim=0).index_select(0, group_index)  # (N, K, width, D)

    num_layers = len(states[0].keys)
    layers = [(stacked([s.keys[l] for s in states]), stacked([s.values[l] for s in states]))
              for l in range(num_layers)]
    prefix_mask = (torch.arange(width, device=dev).view(1, -1) >= pad_len.index_select(0, group_index).view(-1, 1)).long()
    suffix_mask = response_mask[:, : r - 1].long()
    attention_mask = torch.cat([prefix_mask, suffix_mask], dim=1)
    start = torch.tensor([s.next_position for s in rows], device=dev).view(-1, 1)
    position_ids = (start + torch.arange(r - 1, device=dev).view(1, -1)).unsqueeze(0).expand(3, -1, -1)
    text = model.model.language_model
    out = text(
        input_ids=response_ids[:, : r - 1],
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=True,
        **cache_kwargs(text, DynamicCache(ddp_cache_data=layers, config=model.config)),
    )
    hidden = torch.cat([h0, out.last_hidden_state], dim=1)  # (N, R, H)
    return logprobs_from_hidden(model, hidden, response_ids, response_mask, temperature, with_entropy)


class _FixedWidthLayer:
    """One layer's keys/values in a (N, K, width, D) buffer that attention always reads whole.

    ``update`` writes the new positions at the fill mark and returns the whole buffer: the unfilled
    columns are zeros that the attention mask hides. API: the ``update``/``get_seq_length``/
    ``get_mask_sizes`` methods of ``transformers.cache_utils.CacheLayerMixin`` (transformers 5.x).
    """

    is_sliding = False
    is_compileable = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, filled: int):
        self.keys, self.values, self.filled = keys, values, filled
        self.is_initialized = True
        self.device = keys.device

    def update(self, key_states, value_states, *args, **kwargs):
        end = self.filled + key_states.shape[-2]
        self.keys[:, :, self.filled:end] = key_states
        self.values[:, :, self.filled:end] = value_states
        self.filled = end
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.filled

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.keys.shape[-2], 0


MIN_CHUNK_TOKENS = 4
"""Fewest input tokens of a :class:`ChunkedSuffix` chunk: chunks of 1-3 tokens differ from the
one-call pass in the last bits (measured, torch 2.13 CPU: any N, both checkpoints); 4 and more
give identical numbers (tests/test_models_prefix.py)."""


def chunk_end(scored: int, decoded: int, width: int) -> int:
    """Where the next :class:`ChunkedSuffix` chunk may end: at ``decoded`` (tokens decoded so far),
    held back so that the tail left to the last chunk keeps ``MIN_CHUNK_TOKENS``; ``scored`` (no
    chunk) when fewer than ``MIN_CHUNK_TOKENS`` could run.

    Args:
        scored: input tokens already run. decoded: tokens decoded so far. width: R, the final
            response width (the pass runs inputs 0 .. R - 2).
    """
    end = min(decoded, width - 1 - MIN_CHUNK_TOKENS)
    return end if end - scored >= MIN_CHUNK_TOKENS else scored


class ChunkedSuffix:
    """The suffix pass of one group's N responses, run in chunks of response tokens as they are
    decoded, with the same numbers as one :func:`score_suffix` call over the whole responses.

    Why the numbers are the same: ``score_suffix`` runs its R-1 input tokens in one forward whose
    attention reads a (N, K, Lp + R - 1, D) cache through a boolean (N, 1, R - 1, Lp + R - 1) mask.
    Here every chunk's attention reads a buffer of that same width (columns not decoded yet are
    zeros) through the same rows of that same mask, so each query row sees identical inputs, in
    identical blocks. The projections and MLPs are row-wise GEMMs, bitwise the same for any number
    of rows on the CPU BLAS measured, provided each chunk has at least ``MIN_CHUNK_TOKENS`` tokens
    (tests/test_models_prefix.py checks the whole result, chunked against ``score_suffix``, on 1
    and 2 threads).

    Args:
        model: the Qwen2(.5)-VL model whose ``state`` this is (eval mode, no grad).
        state: the group's prefix (:class:`PrefixState`, its Lp real tokens, no padding).
        num_responses: N, the group's responses. width: R, the responses' token width (the
            scored width of the whole pass: all responses are that long under ``rollout.ignore_eos``).

    Raises:
        ValueError: a chunk that does not continue where the last one ended, goes past R - 1, or
            is shorter than ``MIN_CHUNK_TOKENS`` (unless it is the whole pass).
    """

    def __init__(self, model, state: PrefixState, num_responses: int, width: int):
        self.model, self.state, self.n, self.width = model, state, num_responses, width
        self.scored = 0  # response input tokens run so far (tokens 0 .. scored-1)
        lp = state.prompt_length
        total = lp + width - 1
        self.layers = []
        for k, v in zip(state.keys, state.values):
            kb = k.new_zeros(num_responses, k.shape[1], total, k.shape[-1])
            vb = v.new_zeros(num_responses, v.shape[1], total, v.shape[-1])
            kb[:, :, :lp], vb[:, :, :lp] = k, v
            self.layers.append(_FixedWidthLayer(kb, vb, lp))
        self.hidden = [state.last_hidden.detach().view(1, 1, -1).expand(num_responses, 1, -1)]

    @property
    def nbytes(self) -> int:
        """Bytes held: the key/value buffers and the hidden states scored so far."""
        kv = sum(l.keys.numel() * l.keys.element_size() * 2 for l in self.layers)
        return kv + sum(h.numel() * h.element_size() for h in self.hidden[1:])

    @torch.no_grad()
    def extend(self, response_ids: torch.Tensor, response_mask: torch.Tensor) -> int:
        """Run input tokens ``scored .. end-1`` (end = ``response_ids.shape[1]``, at most R - 1).

        Args:
            response_ids: (N, end) int64, the responses decoded so far (their first ``end`` tokens).
            response_mask: (N, end) float32 (ones where a token is real).

        Returns:
            the input tokens run by this call.
        """
        from transformers.cache_utils import Cache

        start, end = self.scored, response_ids.shape[1]
        if end > self.width - 1 or end < start:
            raise ValueError(f"suffix chunk to token {end}: expected {start} .. {self.width - 1}")
        if end == start:
            return 0
        if end - start < MIN_CHUNK_TOKENS and not (start == 0 and end == self.width - 1):
            raise ValueError(f"suffix chunk of {end - start} tokens ({start} .. {end - 1}): expected at least "
                             f"{MIN_CHUNK_TOKENS} (shorter chunks round differently), or the whole pass")
        lp, dev = self.state.prompt_length, model_device(self.model)
        cols = torch.arange(lp + self.width - 1, device=dev)
        rows = torch.arange(start, end, device=dev)
        seen = torch.ones(self.n, lp + self.width - 1, dtype=torch.bool, device=dev)
        seen[:, lp:lp + end] = response_mask.to(dev).bool()
        causal = cols.view(1, -1) <= (lp + rows).view(-1, 1)  # (q, kv): the cache position of each query
        mask = (causal.view(1, 1, end - start, -1) & seen.view(self.n, 1, 1, -1))
        position_ids = (self.state.next_position + rows).view(1, 1, -1).expand(3, self.n, -1)
        text = self.model.model.language_model
        out = text(input_ids=response_ids[:, start:end].to(dev), attention_mask={"full_attention": mask},
                   position_ids=position_ids, use_cache=True, **cache_kwargs(text, Cache(layers=self.layers)))
        self.hidden.append(out.last_hidden_state)
        self.scored = end
        return end - start

    def log_probs(self, response_ids: torch.Tensor, response_mask: torch.Tensor, temperature: float = 1.0,
                  with_entropy: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Finish the pass (tokens left up to R - 1) and score the responses, as ``score_suffix``.

        Args:
            response_ids, response_mask: (N, R) the whole responses (int64 / float32).

        Returns:
            logprobs (N, R) float32 and optional entropy (N, R) float32, zero outside the mask.
        """
        self.extend(response_ids[:, : self.width - 1], response_mask[:, : self.width - 1])
        dev = model_device(self.model)
        hidden = torch.cat(self.hidden, dim=1)
        return logprobs_from_hidden(self.model, hidden, response_ids.to(dev), response_mask.to(dev),
                                    temperature, with_entropy)
