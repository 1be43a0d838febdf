"""Chat messages from EasyR1-style problems, and prompt token ids with vision placeholders expanded.

A problem is text with ``<image>`` / ``<video>`` where the media go (EasyR1 / geometry3k). The user
message becomes a list of content items in that order: ``{"type": "text", "text": ...}``,
``{"type": "image"}``, ``{"type": "video"}``. The chat template renders each image/video item as
``<|vision_start|><|image_pad|><|vision_end|>`` (or ``<|video_pad|>``), and
:func:`render_prompt_ids` expands every pad token into one token per merged patch, as
``Qwen2_5_VLProcessor`` does: ``grid_thw.prod() // merge_size**2`` copies.
"""

from __future__ import annotations

import functools
import re
from typing import Any, Optional

import torch
from jinja2.sandbox import ImmutableSandboxedEnvironment

IMAGE_PLACEHOLDER = "<image>"
VIDEO_PLACEHOLDER = "<video>"
IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
_PLACEHOLDER_RE = re.compile(f"({re.escape(IMAGE_PLACEHOLDER)}|{re.escape(VIDEO_PLACEHOLDER)})")
_PAD_RE = re.compile(f"({re.escape(IMAGE_PAD)}|{re.escape(VIDEO_PAD)})")


@functools.lru_cache(maxsize=16)
def _compile_template(source: str):
    return ImmutableSandboxedEnvironment(keep_trailing_newline=True).from_string(source)


def apply_format_prompt(problem: str, format_prompt: Optional[str]) -> str:
    """Render the Jinja template ``format_prompt`` (stripped, as EasyR1 does) with ``content=problem``.

    None or an empty template returns ``problem`` unchanged.
    """
    if not format_prompt:
        return problem
    return _compile_template(format_prompt.strip()).render(content=problem)


def build_messages(problem: str, *, num_images: int, num_videos: int, system_prompt: Optional[str] = None,
                   format_prompt: Optional[str] = None, name: str = "sample") -> list[dict[str, Any]]:
    """Chat messages for one problem, placeholders turned into image/video content items.

    Args:
        problem: the question text with ``<image>`` / ``<video>`` placeholders.
        num_images, num_videos: media counts of the sample; they must equal the placeholder counts
            (after the format prompt is applied).
        system_prompt: system message (None: the chat template's default).
        format_prompt: Jinja template source rendering ``content`` (the problem) into the user text.
        name: how errors refer to the sample (e.g. ``train.parquet row 12``).

    Returns:
        ``[{"role": "system", ...}?, {"role": "user", "content": [items...]}]``.

    Raises:
        ValueError: the placeholder counts disagree with ``num_images`` / ``num_videos``.
    """
    text = apply_format_prompt(problem, format_prompt)
    n_img, n_vid = text.count(IMAGE_PLACEHOLDER), text.count(VIDEO_PLACEHOLDER)
    if (n_img, n_vid) != (num_images, num_videos):
        raise ValueError(
            f"{name}: the prompt has {n_img} {IMAGE_PLACEHOLDER} and {n_vid} {VIDEO_PLACEHOLDER} placeholders "
            f"but the sample has {num_images} images and {num_videos} videos"
        )
    content: list[dict[str, Any]] = []
    for piece in _PLACEHOLDER_RE.split(text):
        if piece == IMAGE_PLACEHOLDER:
            content.append({"type": "image"})
        elif piece == VIDEO_PLACEHOLDER:
            content.append({"type": "video"})
        elif piece:
            content.append({"type": "text", "text": piece})
    messages: list[dict[str, Any]] = []
    if system_prompt is not None:
        messages.append({"role": "system", "content": system_prompt})
    messages.append({"role": "user", "content": content})
    return messages


def expand_vision_pads(text: str, image_grid_thw: Optional[torch.Tensor], video_grid_thw: Optional[torch.Tensor],
                       merge_size: int = 2) -> str:
    """Replace the i-th ``<|image_pad|>`` (``<|video_pad|>``) by ``prod(grid_thw[i]) // merge_size**2`` copies.

    Args:
        text: chat-formatted prompt with one pad token per image/video.
        image_grid_thw: (num_images, 3) int64 or None; video_grid_thw: (num_videos, 3) int64 or None.

    Raises:
        ValueError: the pad-token counts disagree with the numbers of grids.
    """
    grids = {
        IMAGE_PAD: [] if image_grid_thw is None else image_grid_thw.tolist(),
        VIDEO_PAD: [] if video_grid_thw is None else video_grid_thw.tolist(),
    }
    used = {IMAGE_PAD: 0, VIDEO_PAD: 0}
    pieces = []
    for piece in _PAD_RE.split(text):
        if piece in grids:
            i = used[piece]
            if i >= len(grids[piece]):
                raise ValueError(f"the prompt has more {piece} tokens than the {len(grids[piece])} grids given")
            t, h, w = grids[piece][i]
            pieces.append(piece * (t * h * w // merge_size**2))
            used[piece] = i + 1
        else:
            pieces.append(piece)
    for pad, n in used.items():
        if n != len(grids[pad]):
            raise ValueError(f"the prompt has {n} {pad} tokens but {len(grids[pad])} grids were given")
    return "".join(pieces)


def render_prompt_ids(tokenizer, messages: list[dict[str, Any]], image_grid_thw: Optional[torch.Tensor] = None,
                      video_grid_thw: Optional[torch.Tensor] = None, merge_size: int = 2) -> torch.Tensor:
    """Token ids of the chat-formatted prompt (ending with the assistant header), vision pads expanded.

    Args:
        tokenizer: a Hugging Face tokenizer with a Qwen2-VL chat template.
        messages: from :func:`build_messages`.
        image_grid_thw: (num_images, 3) int64 patch grids, in placeholder order (or None).
        video_grid_thw: (num_videos, 3) int64 patch grids (or None).
        merge_size: spatial merge of the vision tower (tokens per image = patches / merge_size**2).

    Returns:
        (L,) int64 token ids.

    Raises:
        ValueError: the rendered pad tokens disagree with the grids.
    """
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    text = expand_vision_pads(text, image_grid_thw, video_grid_thw, merge_size)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.long)
