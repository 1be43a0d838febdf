"""M-RoPE position ids of Qwen2-VL / Qwen2.5-VL: our own function, the one every pass uses.

Legend: N sequences, L tokens per (padded) sequence; t/h/w a vision input's patch grid, m the
spatial merge size (a block holds ``t * h * w / m**2`` placeholder tokens).

The reference rule (Qwen2-VL / Qwen2.5-VL as released; SGLang ``MRotaryEmbedding.get_rope_index``
in ``python/sglang/srt/layers/rotary_embedding.py`` and vLLM's ``MRotaryEmbedding`` compute it):

- text tokens get one position on all three axes, +1 per token;
- a vision block starts at ``s`` = the position after the text before it; its token at grid cell
  ``(i, j, k)`` gets ``(s + T(i), s + j, s + k)`` with ``T(i) = i`` for Qwen2-VL and images, and
  ``T(i) = int(i * second_per_grid_t * tokens_per_second)`` (float32, truncated) for Qwen2.5-VL videos;
- whatever follows a block starts at the block's largest position over all three axes + 1
  (``st_idx = llm_pos_ids_list[-1].max() + 1`` in the reference code).

transformers 5.24's ``Qwen2_5_VLModel.get_rope_index`` departs from the last point: it continues
after the spatial extent only (``current_pos += max(h, w) // spatial_merge_size``), so the text after
a Qwen2.5-VL video whose temporal positions outrun its height/width starts inside the video's time
range (transformers issue 45381). For ``[3 text, <vision_start>, video t=3 h=4 w=4, <vision_end>, text]``
at 2 s per grid step and 2 tokens per second, ``<vision_end>`` sits at 13 here and at 6 there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

TEXT, IMAGE, VIDEO = 0, 1, 2


@dataclass(frozen=True)
class RopeSpec:
    """What the position rule needs from a checkpoint's config.

    Attributes:
        spatial_merge_size: m, patches merged per side into one LLM token.
        tokens_per_second: Qwen2.5-VL's temporal position units per second of video; None for
            Qwen2-VL (temporal index = grid step).
    """

    spatial_merge_size: int
    tokens_per_second: Optional[float] = None

    @classmethod
    def from_config(cls, config) -> "RopeSpec":
        """The spec of a ``Qwen2VLConfig`` / ``Qwen2_5_VLConfig`` (``model.config``)."""
        vision = config.vision_config
        scaled = "qwen2_5" in config.model_type
        return cls(spatial_merge_size=int(vision.spatial_merge_size),
                   tokens_per_second=float(vision.tokens_per_second) if scaled else None)


def _block(spec: RopeSpec, grid: torch.Tensor, kind: int, start: int,
           second_per_grid_t: Optional[torch.Tensor]) -> torch.Tensor:
    """(3, t*h*w/m**2) int64 positions of one vision block starting at ``start``."""
    m = spec.spatial_merge_size
    gt, gh, gw = int(grid[0]), int(grid[1]) // m, int(grid[2]) // m
    t_index = torch.arange(gt)
    if kind == VIDEO and spec.tokens_per_second is not None:
        seconds = second_per_grid_t if second_per_grid_t is not None else torch.tensor(1.0)
        t_index = (t_index * seconds.float() * spec.tokens_per_second).long()  # SGLang's float32 order
    t_index = t_index.view(-1, 1, 1).expand(gt, gh, gw)
    h_index = torch.arange(gh).view(1, -1, 1).expand(gt, gh, gw)
    w_index = torch.arange(gw).view(1, 1, -1).expand(gt, gh, gw)
    return torch.stack([t_index, h_index, w_index]).reshape(3, -1) + start


def sequence_positions(spec: RopeSpec, token_types: torch.Tensor, grids: dict[int, list[torch.Tensor]],
                       seconds: list[torch.Tensor]) -> tuple[torch.Tensor, int]:
    """Positions of one sequence of real tokens.

    Args:
        token_types: (L,) int, ``TEXT`` / ``IMAGE`` / ``VIDEO`` per token.
        grids: ``{IMAGE: [...], VIDEO: [...]}``, (3,) int64 grids consumed from the front in order.
        seconds: second_per_grid_t (0-dim float32) of the videos, consumed alongside ``grids[VIDEO]``.

    Returns:
        ``(positions (3, L) int64, next_position)``: the position the token after the sequence gets.

    Raises:
        ValueError: a vision block without a grid, or a grid whose token count the block lacks.
    """
    types = token_types.tolist()
    parts: list[torch.Tensor] = []
    next_position, i = 0, 0
    while i < len(types):
        kind = types[i]
        if kind == TEXT:
            j = i
            while j < len(types) and types[j] == TEXT:
                j += 1
            parts.append(torch.arange(next_position, next_position + j - i).expand(3, -1))
            next_position += j - i
            i = j
            continue
        if not grids[kind]:
            raise ValueError(f"token {i}: a {'video' if kind == VIDEO else 'image'} placeholder without a grid left")
        grid = grids[kind].pop(0)
        spg = seconds.pop(0) if kind == VIDEO and seconds else None
        count = int(grid.prod()) // spec.spatial_merge_size**2
        if types[i:i + count] != [kind] * count:
            raise ValueError(f"token {i}: grid {grid.tolist()} needs {count} consecutive placeholders")
        block = _block(spec, grid, kind, next_position, spg)
        parts.append(block)
        next_position = int(block.max()) + 1
        i += count
    positions = torch.cat(parts, dim=1) if parts else torch.zeros(3, 0, dtype=torch.long)
    return positions, next_position


def mrope_positions(spec: RopeSpec, token_types: torch.Tensor, attention_mask: torch.Tensor,
                    image_grid_thw: Optional[torch.Tensor] = None, video_grid_thw: Optional[torch.Tensor] = None,
                    second_per_grid_ts: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """M-RoPE positions of a padded batch (left or right padding) by the reference rule.

    Args:
        token_types: (N, L) int, ``TEXT`` (0) / ``IMAGE`` (1) / ``VIDEO`` (2) per token; a token that
            looks like a placeholder but is not a vision slot (e.g. inside a response) must be TEXT.
        attention_mask: (N, L), 1 on real tokens.
        image_grid_thw: (num_images, 3) int64, video_grid_thw: (num_videos, 3) int64: the grids of
            all N sequences, concatenated in sequence order.
        second_per_grid_ts: (num_videos,) float32 seconds per temporal grid step (Qwen2.5-VL; None: 1 s).

    Returns:
        ``position_ids`` (3, N, L) int64 (0 on padding) and ``next_positions`` (N, 1) int64, the
        position of the token that would follow each sequence, both on ``attention_mask``'s device
        (the positions are computed on the host from the token types and grids, then copied once).

    Raises:
        ValueError: placeholders and grids disagree (a block without a grid, a short block, or
            grids left over).
    """
    device = attention_mask.device  # the rule walks the tokens on the host; one copy back at the end
    token_types, attention_mask = token_types.cpu(), attention_mask.cpu()
    grids = {IMAGE: list(image_grid_thw.cpu()) if image_grid_thw is not None else [],
             VIDEO: list(video_grid_thw.cpu()) if video_grid_thw is not None else []}
    seconds = list(second_per_grid_ts.cpu()) if second_per_grid_ts is not None else []
    n, width = token_types.shape
    position_ids = torch.zeros(3, n, width, dtype=torch.long)
    next_positions = torch.zeros(n, 1, dtype=torch.long)
    for row in range(n):
        real = attention_mask[row].bool()
        positions, next_positions[row, 0] = sequence_positions(spec, token_types[row][real], grids, seconds)
        position_ids[:, row, real] = positions
    if grids[IMAGE] or grids[VIDEO]:
        raise ValueError(f"{len(grids[IMAGE])} image and {len(grids[VIDEO])} video grids have no placeholders")
    return position_ids.to(device), next_positions.to(device)
