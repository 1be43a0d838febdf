"""Full-sequence passes of a Qwen2-VL / Qwen2.5-VL policy: M-RoPE positions and token log-probs.

Legend: N sequences, L tokens per (padded) sequence, R response tokens, H hidden size, V vocab.

M-RoPE positions are always computed explicitly with the model's ``get_rope_index`` and the
``mm_token_type_ids`` it needs (without them Qwen2.5-VL silently falls back to 1-D positions).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from rollplex_train.data.types import PromptSample, VisionInputs
from rollplex_train.device import model_device


def mm_token_type_ids(model, input_ids: torch.Tensor) -> torch.Tensor:
    """(N, L) int32: 0 for text, 1 for image placeholders, 2 for video placeholders."""
    cfg = model.config
    types = torch.zeros_like(input_ids, dtype=torch.int32)
    types[input_ids == cfg.image_token_id] = 1
    types[input_ids == cfg.video_token_id] = 2
    return types


def rope_positions(
    model, input_ids: torch.Tensor, attention_mask: torch.Tensor, vision: VisionInputs
) -> tuple[torch.Tensor, torch.Tensor]:
    """M-RoPE position ids for padded sequences (left or right padding).

    Args:
        input_ids: (N, L) int64.
        attention_mask: (N, L) int64, 1 on real tokens.
        vision: the vision inputs of all N sequences, concatenated in sequence order.

    Returns:
        position_ids (3, N, L) int64 (padding positions are 0) and deltas (N, 1) int64 such that a
        text token at real index k (0-based, counting only real tokens) has position ``k + delta``.
    """
    if vision.image_grid_thw is None and vision.video_grid_thw is None:
        pos = (attention_mask.long().cumsum(-1) - 1).clamp(min=0) * attention_mask.long()
        return pos.unsqueeze(0).expand(3, -1, -1).contiguous(), torch.zeros(input_ids.shape[0], 1, dtype=torch.long, device=input_ids.device)
    kwargs = dict(
        input_ids=input_ids,
        mm_token_type_ids=mm_token_type_ids(model, input_ids),
        image_grid_thw=vision.image_grid_thw,
        video_grid_thw=vision.video_grid_thw,
        attention_mask=attention_mask,
    )
    if vision.second_per_grid_ts is not None and "qwen2_5" in model.config.model_type:
        kwargs["second_per_grid_ts"] = vision.second_per_grid_ts
    position_ids, _ = model.model.get_rope_index(**kwargs)
    # The next text token follows the *last real* token (transformers derives its delta from the
    # largest position instead, which differs when a Qwen2.5-VL video with > 1 s per grid step ends
    # the prompt).
    mask = attention_mask.long()
    last = (mask * torch.arange(mask.shape[1], device=mask.device)).argmax(-1, keepdim=True)
    deltas = position_ids[0].gather(1, last) + 1 - mask.sum(-1, keepdim=True)
    return position_ids, deltas.long()


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
        response_ids: (N, R) int64; response_mask: (N, R) float32.

    Returns:
        input_ids (N, L) int64, attention_mask (N, L) int64, prompt_lengths (N,) int64, and the
        vision inputs repeated once per response (the prefix recomputed G times, as verl/TRL do).
    """
    resp_lens = response_mask.sum(-1).long()
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

    Returns:
        logprobs (N, R) float32 and, if requested, entropy (N, R) float32; both zero outside the mask.
    """
    dev = model_device(model)  # the inputs are built on CPU (data/types.py); the model may sit on a GPU
    input_ids, attention_mask, vision = input_ids.to(dev), attention_mask.to(dev), vision.to(dev)
    prompt_lengths, response_ids, response_mask = prompt_lengths.to(dev), response_ids.to(dev), response_mask.to(dev)
    position_ids, _ = rope_positions(model, input_ids, attention_mask, vision)
    out = model.model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=False,
        **vision_kwargs(vision),
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

    Args:
        hidden: (N, R, H) hidden states whose logits score ``response_ids`` (N, R).

    Returns:
        logprobs (N, R) float32 and optional entropy (N, R) float32, zero outside ``response_mask``.
    """
    logits = model.lm_head(hidden).float()
    if temperature != 1.0:
        logits = logits / temperature
    logp_all = F.log_softmax(logits, dim=-1)
    logprobs = logp_all.gather(-1, response_ids.unsqueeze(-1)).squeeze(-1) * response_mask
    entropy = None
    if with_entropy:
        entropy = -(logp_all.exp() * logp_all).sum(-1) * response_mask
    return logprobs, entropy
