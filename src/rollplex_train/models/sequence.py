"""Full-sequence passes of a Qwen2-VL / Qwen2.5-VL policy: M-RoPE positions and token log-probs.

Legend: N sequences, L tokens per (padded) sequence, R response tokens, H hidden size, V vocab.

M-RoPE positions are always computed explicitly, by our own function (``models/rope.py``, the
reference rule of Qwen2-VL / Qwen2.5-VL) and passed to every pass: rollout prefill and decode,
prefix, suffix and full-sequence scoring alike.

Only tokens the policy did not sample are vision slots. A sampled response token is text to the
model even when it is an ``<|image_pad|>`` / ``<|video_pad|>`` id: the full-sequence pass embeds the
vision features into the prompt's placeholders (and, in a multi-turn trajectory's row, into the
observations between its turns, which carry ``response_mask`` 0) and gives sampled tokens text
positions, as the split (prefix + suffix) pass does.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from rollplex_train.data.types import PromptSample, VisionInputs
from rollplex_train.device import model_device
from rollplex_train.models.rope import RopeSpec, mrope_positions
from rollplex_train.models.logprobs import chosen_token_logprobs

FULL_LOGSOFTMAX_MAX_BYTES = 256 * 1024**2
"""Largest (N, R, V) float32 log-softmax materialised when scoring responses (above: chunked).
256 MiB: 8k response tokens at Qwen2.5's 152k vocabulary take 4.6 GiB, the small checkpoint's
64 x 128 tokens at 1088 entries 36 MiB."""


def mm_token_type_ids(model, input_ids: torch.Tensor, vision_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(N, L) int32: 0 for text, 1 for image placeholders, 2 for video placeholders.

    Args:
        vision_mask: (N, L) bool, the tokens that may be vision slots (the prompt's); elsewhere a
            placeholder id is text. None: every token.
    """
    cfg = model.config
    types = torch.zeros_like(input_ids, dtype=torch.int32)
    types[input_ids == cfg.image_token_id] = 1
    types[input_ids == cfg.video_token_id] = 2
    if vision_mask is not None:
        types = types * vision_mask.to(types.dtype)
    return types


def rope_positions(
    model, input_ids: torch.Tensor, attention_mask: torch.Tensor, vision: VisionInputs,
    vision_mask: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """M-RoPE position ids for padded sequences (left or right padding), ``models/rope.py``'s rule.

    Args:
        input_ids: (N, L) int64.
        attention_mask: (N, L) int64, 1 on real tokens.
        vision: the vision inputs of all N sequences, concatenated in sequence order.
        vision_mask: (N, L) bool, tokens that may be vision slots (None: all; see mm_token_type_ids).

    Returns:
        position_ids (3, N, L) int64 (padding positions are 0) and deltas (N, 1) int64 such that the
        token after a sequence of ``num_real`` real tokens has position ``num_real + delta`` (the
        sequence's largest position + 1; the rollout decodes and the suffix pass scores from there).

    Raises:
        ValueError: the placeholders disagree with the vision grids.
    """
    num_real = attention_mask.long().sum(-1, keepdim=True)
    if vision.image_grid_thw is None and vision.video_grid_thw is None:
        pos = (attention_mask.long().cumsum(-1) - 1).clamp(min=0) * attention_mask.long()
        return pos.unsqueeze(0).expand(3, -1, -1).contiguous(), torch.zeros(input_ids.shape[0], 1, dtype=torch.long, device=input_ids.device)
    position_ids, next_positions = mrope_positions(
        RopeSpec.from_config(model.config), mm_token_type_ids(model, input_ids, vision_mask), attention_mask,
        vision.image_grid_thw, vision.video_grid_thw, vision.second_per_grid_ts)
    return position_ids, next_positions - num_real


def embed_with_vision(model, input_ids: torch.Tensor, vision: VisionInputs, vision_grad: bool,
                      vision_mask: Optional[torch.Tensor] = None, embed_tokens=None) -> torch.Tensor:
    """Token embeddings with the vision features scattered into the placeholder slots.

    Args:
        input_ids: (N, L) int64 padded sequences. vision: their vision inputs, concatenated.
        vision_grad: build the vision tower's graph (False: frozen tower, features without grad).
        vision_mask: (N, L) bool, the tokens that may be vision slots (None: all); placeholder ids
            outside it keep their text embedding.
        embed_tokens: the token embedding module (None: the HF model's input embeddings; the
            Megatron backend passes its vocab-parallel ``word_embeddings``).

    Returns:
        (N, L, H) input embeddings.

    Raises:
        ValueError: the number of slots differs from the number of vision features.
    """
    inner = model.model
    embeds = (embed_tokens if embed_tokens is not None else inner.get_input_embeddings())(input_ids)
    cfg = model.config
    for pixels, grid, token_id, encode in (
        (vision.pixel_values, vision.image_grid_thw, cfg.image_token_id, inner.get_image_features),
        (vision.pixel_values_videos, vision.video_grid_thw, cfg.video_token_id, inner.get_video_features),
    ):
        if pixels is None:
            continue
        with torch.set_grad_enabled(vision_grad and torch.is_grad_enabled()):
            feats = torch.cat(encode(pixels, grid, return_dict=True).pooler_output, dim=0)
        slots = input_ids == token_id
        if vision_mask is not None:
            slots = slots & vision_mask
        if int(slots.sum()) != feats.shape[0]:
            raise ValueError(f"{int(slots.sum())} placeholder tokens but {feats.shape[0]} vision features")
        embeds = embeds.masked_scatter(slots.unsqueeze(-1), feats.to(embeds.dtype))
    return embeds


def prompt_columns(length: int, width: int, side: str) -> slice:
    """The columns a prompt of ``length`` tokens occupies in a batch ``width`` wide, padded on ``side``."""
    return slice(width - length, width) if side == "left" else slice(0, length)


def pad_prompts(prompts: list[PromptSample], pad_id: int, side: str = "left") -> tuple[torch.Tensor, torch.Tensor]:
    """(P, L) int64 prompt ids padded on ``side`` (``left`` or ``right``) and their attention mask.

    Raises:
        ValueError: unknown side.
    """
    if side not in ("left", "right"):
        raise ValueError(f"padding={side!r}: expected 'left' or 'right'")
    width = max(p.prompt_length for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        cols = prompt_columns(p.prompt_length, width, side)
        ids[i, cols] = p.prompt_ids
        mask[i, cols] = 1
    return ids, mask


def vision_kwargs(vision: VisionInputs) -> dict:
    """Forward keyword arguments for the vision inputs (absent ones left out)."""
    out = {}
    if vision.pixel_values is not None:
        out["pixel_values"] = vision.pixel_values
        out["image_grid_thw"] = vision.image_grid_thw
    if vision.pixel_values_videos is not None:
        out["pixel_values_videos"] = vision.pixel_values_videos
        out["video_grid_thw"] = vision.video_grid_thw
    return out


def build_full_sequences(
    prompts: list[PromptSample],
    group_index: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    pad_id: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, VisionInputs]:
    """Concatenate each response with its prompt, right-padded: the per-response (unshared) layout.

    Args:
        prompts: P prompts; group_index (N,) maps each response to its prompt.
        response_ids: (N, R) int64; response_mask: (N, R) float32 (a row's real length ends at its
            last 1: a trajectory row's observations inside it are 0).

    Returns:
        input_ids (N, L) int64, attention_mask (N, L) int64, prompt_lengths (N,) int64, and the
        vision inputs repeated once per response (the prefix recomputed G times, as verl/TRL do),
        all on the host (the prompts' place; responses on a device are copied back once).
    """
    response_ids, response_mask = response_ids.cpu(), response_mask.cpu()
    resp_lens = response_lengths(response_mask)
    rows, lengths, visions = [], [], []
    for i, g in enumerate(group_index.tolist()):
        p = prompts[g]
        rows.append(torch.cat([p.prompt_ids, response_ids[i, : resp_lens[i]]]))
        lengths.append(p.prompt_length)
        visions.append(p.vision)
    max_len = max(r.shape[0] for r in rows)
    input_ids = torch.full((len(rows), max_len), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), max_len), dtype=torch.long)
    for i, r in enumerate(rows):
        input_ids[i, : r.shape[0]] = r
        attention_mask[i, : r.shape[0]] = 1
    return input_ids, attention_mask, torch.tensor(lengths, dtype=torch.long), VisionInputs.concat(visions)


def response_lengths(response_mask: torch.Tensor) -> torch.Tensor:
    """(N,) int64 real length of each row of an (N, R) mask: one past its last nonzero entry (0 for
    an empty row); equals ``mask.sum(-1)`` when every row's ones are contiguous from 0."""
    cols = torch.arange(1, response_mask.shape[1] + 1, device=response_mask.device).view(1, -1)
    return (cols * (response_mask > 0)).amax(-1).long() if response_mask.shape[1] else \
        torch.zeros(response_mask.shape[0], dtype=torch.long, device=response_mask.device)


def response_logprobs(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    vision: VisionInputs,
    prompt_lengths: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Per-token log-probs of the responses under ``model`` from one full-sequence forward.

    The logits that score response token t sit at position ``prompt_length - 1 + t`` (token 0 is
    scored by the prompt's last real token). Only those R rows go through the LM head.

    Args:
        input_ids, attention_mask: (N, L) right-padded prompt+response (see build_full_sequences).
        prompt_lengths: (N,) int64 real prompt tokens per row.
        response_ids: (N, R) int64; response_mask: (N, R) float32.
        temperature: logits are divided by it (the sampling distribution of the rollout).

    Vision slots: every real token the policy did not sample (the prompt, and a trajectory row's
    observations, ``response_mask`` 0); sampled tokens are text.

    Returns:
        logprobs (N, R) float32 and, if requested, entropy (N, R) float32; both zero outside the mask.
    """
    dev = model_device(model)  # the inputs are built on CPU (data/types.py); the model may sit on a GPU
    input_ids, attention_mask, vision = input_ids.to(dev), attention_mask.to(dev), vision.to(dev)
    prompt_lengths, response_ids, response_mask = prompt_lengths.to(dev), response_ids.to(dev), response_mask.to(dev)
    n_rows, width = input_ids.shape
    sampled = torch.zeros((n_rows, width + response_ids.shape[1]), dtype=torch.bool, device=dev)
    cols = prompt_lengths.view(-1, 1) + torch.arange(response_ids.shape[1], device=dev).view(1, -1)
    sampled.scatter_(1, cols, response_mask > 0)  # distinct columns per row
    prompt_mask = attention_mask.bool() & ~sampled[:, :width]  # the vision slots' candidates
    position_ids, _ = rope_positions(model, input_ids, attention_mask, vision, prompt_mask)
    embeds = embed_with_vision(model, input_ids, vision, vision_grad=True, vision_mask=prompt_mask)
    out = model.model.language_model(
        inputs_embeds=embeds,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=False,
    )
    hidden = out.last_hidden_state  # (N, L, H)
    n, r = response_ids.shape
    idx = (prompt_lengths.view(-1, 1) - 1 + torch.arange(r, device=dev).view(1, -1)).clamp(max=hidden.shape[1] - 1)
    h_sel = hidden.gather(1, idx.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))  # (N, R, H)
    return logprobs_from_hidden(model, h_sel, response_ids, response_mask, temperature, with_entropy)


def logprobs_from_hidden(
    model,
    hidden: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    temperature: float,
    with_entropy: bool,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """LM head + log-softmax on selected hidden states.

    When the (N, R, V) float32 log-softmax would exceed ``FULL_LOGSOFTMAX_MAX_BYTES`` and the head is
    a plain ``torch.nn.Linear`` (every HF checkpoint), the chosen tokens' log-probs and the entropy
    come from ``models/logprobs.py`` in chunks of rows (no (N, R, V) tensor is materialised or kept
    for backward). Below that size the full log-softmax runs: it gives the same values to float
    rounding, and AdamW's per-element normalisation would turn that rounding into weight
    differences above 1e-6 after a few steps.

    Args:
        hidden: (N, R, H) hidden states whose logits score ``response_ids`` (N, R).

    Returns:
        logprobs (N, R) float32 and optional entropy (N, R) float32, zero outside ``response_mask``.
    """
    vocab = model.lm_head.weight.shape[0] if type(model.lm_head) is torch.nn.Linear else 0
    if vocab and hidden.shape[0] * hidden.shape[1] * vocab * 4 > FULL_LOGSOFTMAX_MAX_BYTES:
        logprobs, entropy = chosen_token_logprobs(hidden, model.lm_head, response_ids, temperature=temperature,
                                                  with_entropy=with_entropy)
        return logprobs * response_mask, (entropy * response_mask if with_entropy else None)
    logits = model.lm_head(hidden).float()
    if temperature != 1.0:
        logits = logits / temperature
    logp_all = F.log_softmax(logits, dim=-1)
    logprobs = logp_all.gather(-1, response_ids.unsqueeze(-1)).squeeze(-1) * response_mask
    entropy = None
    if with_entropy:
        entropy = -(logp_all.exp() * logp_all).sum(-1) * response_mask
    return logprobs, entropy
