"""Log-probs and entropy of responses on the Megatron model: full sequences, or prefix + suffixes.

The LM head output stays vocab-parallel (``(N, R, V/t)`` per rank); softmax statistics are reduced
over the TP group with megatron-core's autograd-aware ``reduce_from_tensor_model_parallel_region``
(all-reduce forward, identity backward: ``tensor_parallel/mappings.py``), as its
``vocab_parallel_cross_entropy`` does; entropy as verl's ``verl/utils/megatron/tensor_parallel.py::
vocab_parallel_entropy``. Padded vocabulary rows (index >= the HF vocabulary) are masked out, so the
distribution equals the HF model's.

The prefix/suffix decomposition mirrors ``models/prefix.py`` (the torch backend's): a prefix pass
records every layer's post-RoPE keys/values of the prompt (``KVContext.mode = "record"``), a suffix
pass puts them in front of the responses' keys/values with a mask that hides the prefix padding and
keeps the responses causal. With grad the recorded tensors keep their graph, so one backward over
the suffix losses reaches the prefix (and vision tower) exactly as the full-sequence loss does.

Legend: P prompts, Lp prompt tokens, N responses, R response tokens, H hidden, Ng KV heads of the
rank, Dh head dim, NL layers, V/t vocabulary shard.
"""

from __future__ import annotations

from typing import Optional

import torch

from rollplex_train.data.types import PromptSample, VisionInputs
from rollplex_train.device import model_device
from rollplex_train.models.prefix import _GRAPH_IDS, PrefixState, _SavedBytes
from rollplex_train.models.sequence import build_full_sequences, pad_prompts, prompt_columns, rope_positions
from rollplex_train.training.megatron.model import MegatronVLM, causal_padding_mask


def vocab_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int,
                            with_entropy: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-probs of ``targets`` (and entropy) from this rank's vocabulary shard of the logits.

    Args:
        logits: (..., V/t) float, rank i holds vocabulary rows ``[i V/t, (i + 1) V/t)``.
        targets: (...) int64 global token ids.
        vocab_size: real vocabulary rows; columns at or past it are padding and excluded.

    Returns:
        log-probs (...) and entropy (...) or None, float32, differentiable, equal on all TP ranks.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region as reduce_tp

    logits = logits.float()
    shard = logits.shape[-1]
    start = ps.get_tensor_model_parallel_rank() * shard
    columns = torch.arange(start, start + shard, device=logits.device)
    if start + shard > vocab_size:
        logits = logits.masked_fill(columns >= vocab_size, torch.finfo(logits.dtype).min)
    top = logits.detach().max(-1).values
    torch.distributed.all_reduce(top, op=torch.distributed.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group())
    z = logits - top.unsqueeze(-1)
    log_norm = reduce_tp(z.exp().sum(-1)).log()
    local = (targets >= start) & (targets < start + shard)
    picked = z.gather(-1, (targets - start).clamp(0, shard - 1).unsqueeze(-1)).squeeze(-1)
    logp = reduce_tp(torch.where(local, picked, torch.zeros_like(picked))) - log_norm
    entropy = None
    if with_entropy:
        probs = (z - log_norm.unsqueeze(-1)).exp()
        entropy = log_norm - reduce_tp((probs * z).sum(-1))
    return logp, entropy


def _head(model: MegatronVLM, hidden: torch.Tensor, response_ids, response_mask, temperature, with_entropy):
    """LM head on (N, R, H) hidden states + vocab-parallel log-softmax, zero outside the mask."""
    logits = model.local_logits(hidden)
    if temperature != 1.0:
        logits = logits / temperature
    logp, ent = vocab_parallel_logprobs(logits, response_ids, model.vocab_size, with_entropy)
    return logp * response_mask, (ent * response_mask if with_entropy else None)


def full_logprobs(model: MegatronVLM, prompts: list[PromptSample], group_index: torch.Tensor,
                  response_ids: torch.Tensor, response_mask: torch.Tensor, pad_id: int, *,
                  temperature: float = 1.0, with_entropy: bool = False, vision_grad: bool = True):
    """Per-token log-probs of N responses from one full-sequence forward (``models/sequence.py``'s
    ``response_logprobs`` on Megatron).

    The inputs may sit on the host or on the model's device; the result is on the model's device.

    Returns:
        logprobs (N, R) float32 and optional entropy (N, R) float32, zero outside the mask.
    """
    dev = model_device(model)
    ids, mask, plen, vision = build_full_sequences(prompts, group_index, response_ids, response_mask, pad_id)
    ids, mask, plen, vision = ids.to(dev), mask.to(dev), plen.to(dev), vision.to(dev)
    response_ids, response_mask = response_ids.to(dev), response_mask.to(dev)
    prompt_mask = torch.arange(ids.shape[1], device=dev).view(1, -1) < plen.view(-1, 1)  # response tokens are text
    hidden = forward_hidden(model, ids, mask, vision, vision_grad, prompt_mask)  # (N, L, H)
    r = response_ids.shape[1]
    idx = (plen.view(-1, 1) - 1 + torch.arange(r, device=dev).view(1, -1)).clamp(max=hidden.shape[1] - 1)
    h_sel = hidden.gather(1, idx.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))
    return _head(model, h_sel, response_ids, response_mask, temperature, with_entropy)


def forward_hidden(model: MegatronVLM, ids: torch.Tensor, mask: torch.Tensor, vision: VisionInputs,
                   vision_grad: bool = True, vision_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(B, S, H) final hidden states of padded sequences (left or right padding); ``vision_mask``:
    the tokens that may be vision slots (None: all). Inputs on the host are moved to the model's device."""
    dev = model_device(model)
    ids, mask, vision = ids.to(dev), mask.to(dev), vision.to(dev)
    vision_mask = None if vision_mask is None else vision_mask.to(dev)
    position_ids, _ = rope_positions(model, ids, mask, vision, vision_mask)
    decoder_input = model.embed(ids, vision, vision_grad, vision_mask)
    return model.decode(decoder_input, position_ids, causal_padding_mask(mask)).transpose(0, 1)


def full_logits(model: MegatronVLM, ids: torch.Tensor, mask: torch.Tensor, vision: VisionInputs) -> torch.Tensor:
    """(B, S, V) logits of all positions, gathered over TP (checks and tests only: the training
    path never gathers the vocabulary)."""
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    logits = gather_from_tensor_model_parallel_region(model.local_logits(forward_hidden(model, ids, mask, vision)))
    return logits[..., : model.vocab_size]


def encode_prefix(model: MegatronVLM, prompts: list[PromptSample], *, version, with_grad: bool = False,
                  freeze_vision: bool = False, padding: str = "left") -> list[PrefixState]:
    """Run the prompts once on the Megatron model; one :class:`PrefixState` per prompt whose
    ``keys``/``values`` are this rank's KV heads, ``(1, Ng, Lp, Dh)`` post-RoPE, real tokens only.

    Args: as ``models/prefix.py::encode_prefix``.
    """
    dev = model_device(model)
    ids, mask = pad_prompts(prompts, model.config.get_text_config().pad_token_id or 0, side=padding)
    width = ids.shape[1]
    ids, mask = ids.to(dev), mask.to(dev)
    vision = VisionInputs.concat([p.vision for p in prompts]).to(dev)
    ctx = model.language_model.kv_context
    counter = _SavedBytes(model)
    with torch.set_grad_enabled(with_grad), torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
        position_ids, deltas = rope_positions(model, ids, mask, vision)
        decoder_input = model.embed(ids, vision, vision_grad=with_grad and not freeze_vision)
        ctx.mode, ctx.recorded = "record", {}
        try:
            hidden = model.decode(decoder_input, position_ids, causal_padding_mask(mask))  # [Lp, P, H]
        finally:
            ctx.mode = None
    layers = [(_own(k), _own(v)) for k, v in (ctx.recorded[i] for i in range(len(ctx.recorded)))]
    ctx.recorded = {}
    per_prompt_bytes = counter.bytes // max(len(prompts), 1)
    graph_id = next(_GRAPH_IDS) if with_grad else None
    states = []
    for i, p in enumerate(prompts):
        cols = prompt_columns(p.prompt_length, width, padding)
        to_state = lambda t: t[cols, i : i + 1].permute(1, 2, 0, 3)  # noqa: E731  [Lp,1,Ng,Dh] -> (1,Ng,Lp,Dh)
        states.append(PrefixState(
            uid=p.uid, version=version,
            keys=[to_state(k) for k, _ in layers], values=[to_state(v) for _, v in layers],
            last_hidden=hidden[cols.stop - 1, i], next_position=int(p.prompt_length + deltas[i, 0]),
            requires_grad=with_grad, saved_bytes=per_prompt_bytes if with_grad else 0, graph_id=graph_id,
        ))
    return states


def _own(t: torch.Tensor) -> torch.Tensor:
    """``t`` in storage of its own: mcore's values (and keys without RoPE) are views of the layer's
    fused ``linear_qkv`` output, whose queries a kept view would hold alive too."""
    return t if t.untyped_storage().nbytes() == t.numel() * t.element_size() else t.clone()


def score_suffix(model: MegatronVLM, states: list[PrefixState], group_index: torch.Tensor,
                 response_ids: torch.Tensor, response_mask: torch.Tensor, *, temperature: float = 1.0,
                 with_entropy: bool = False):
    """Per-token log-probs of N responses against their prompts' prefix states
    (``models/prefix.py::score_suffix`` on Megatron: token 0 from ``last_hidden``, tokens 1..R-1
    from a forward of tokens 0..R-2 at positions ``next_position + t``).

    Returns:
        logprobs (N, R) float32 and optional entropy (N, R) float32, zero outside the mask, on the
        model's device (inputs on the host are moved there).
    """
    dev = model_device(model)
    group_index, response_ids, response_mask = group_index.to(dev), response_ids.to(dev), response_mask.to(dev)
    n, r = response_ids.shape
    rows = [states[g] for g in group_index.tolist()]
    h0 = torch.stack([s.last_hidden for s in rows]).unsqueeze(1)  # (N, 1, H)
    if r == 1:
        return _head(model, h0, response_ids, response_mask, temperature, with_entropy)
    width = max(s.prompt_length for s in states)
    pad_len = torch.tensor([width - s.prompt_length for s in states], device=dev)

    def stacked(per_state: list[torch.Tensor]) -> torch.Tensor:  # -> [width, N, Ng, Dh], left-padded
        padded = [torch.nn.functional.pad(t, (0, 0, width - s.prompt_length, 0)) for t, s in zip(per_state, states)]
        return torch.cat(padded, dim=0).index_select(0, group_index).permute(2, 0, 1, 3).contiguous()

    ctx = model.language_model.kv_context
    num_layers = len(states[0].keys)
    prefix = [(stacked([s.keys[l] for s in states]), stacked([s.values[l] for s in states]))
              for l in range(num_layers)]
    prefix_real = torch.arange(width, device=dev).view(1, -1) >= pad_len.index_select(0, group_index).view(-1, 1)  # (N, width)
    causal = torch.ones(r - 1, r - 1, dtype=torch.bool, device=dev).tril()
    allowed = torch.cat([prefix_real.unsqueeze(1).expand(-1, r - 1, -1), causal.expand(n, -1, -1)], dim=2)
    start = torch.tensor([s.next_position for s in rows], device=dev).view(-1, 1)
    position_ids = (start + torch.arange(r - 1, device=dev).view(1, -1)).unsqueeze(0).expand(3, -1, -1)
    decoder_input = model.language_model.embedding.word_embeddings(response_ids[:, : r - 1]).transpose(0, 1)
    ctx.mode, ctx.prefix, ctx.mask = "extend", prefix, ~allowed.unsqueeze(1)
    try:
        out = model.decode(decoder_input.contiguous(), position_ids, ctx.mask)
    finally:
        ctx.mode, ctx.prefix, ctx.mask = None, [], None
    hidden = torch.cat([h0, out.transpose(0, 1)], dim=1)  # (N, R, H)
    return _head(model, hidden, response_ids, response_mask, temperature, with_entropy)

