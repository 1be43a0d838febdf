"""M-RoPE positions (models/rope.py) pinned to the reference rule, and used by every pass alike.

Token legend in the layouts below: T text, S <vision_start>, E <vision_end>, I/V image/video pads.
The reference rule (Qwen2.5-VL; SGLang/vLLM ``MRotaryEmbedding.get_rope_index``): a vision block
starts after the text before it; what follows a block starts at the block's largest position over
all three axes + 1.
"""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from rollplex_train.data.prompts import build_messages, render_prompt_ids
from rollplex_train.data.types import PromptSample, VisionInputs
from rollplex_train.models.loading import load_model
from rollplex_train.models.prefix import encode_prefix, score_suffix
from rollplex_train.models.rope import IMAGE, TEXT, VIDEO, RopeSpec, mrope_positions
from rollplex_train.models.sequence import build_full_sequences, response_logprobs, rope_positions
from rollplex_train.rollout.base import SamplingParams
from rollplex_train.rollout.builtin import BuiltinRolloutEngine
from rollplex_train.runtime.batching import to_train_batch

QWEN25 = RopeSpec(spatial_merge_size=2, tokens_per_second=2.0)
QWEN2 = RopeSpec(spatial_merge_size=2, tokens_per_second=None)
T, I, V = TEXT, IMAGE, VIDEO


def _positions(spec, types: list[int], **grids) -> tuple[list[list[int]], int]:
    t = torch.tensor([types])
    pos, nxt = mrope_positions(spec, t, torch.ones_like(t), **grids)
    return pos[:, 0].tolist(), int(nxt)


def test_text_after_video_starts_past_the_temporal_extent():
    """[T T T S V*12 E T T], video grid (3, 4, 4) merged 2x2, 2 s per grid step, 2 tokens/s: temporal
    positions 4, 8, 12 -> <vision_end> at 13 (transformers 5.24 puts it at 6, after the spatial extent)."""
    types = [T, T, T, T] + [V] * 12 + [T, T, T]
    pos, nxt = _positions(QWEN25, types, video_grid_thw=torch.tensor([[3, 4, 4]]),
                          second_per_grid_ts=torch.tensor([2.0]))
    assert pos[0] == [0, 1, 2, 3] + [4] * 4 + [8] * 4 + [12] * 4 + [13, 14, 15]
    assert pos[1] == [0, 1, 2, 3] + [4, 4, 5, 5] * 3 + [13, 14, 15]
    assert pos[2] == [0, 1, 2, 3] + [4, 5, 4, 5] * 3 + [13, 14, 15]
    assert nxt == 16
    # Qwen2-VL: the temporal index is the grid step, so the spatial extent (h 0..1) is not the largest
    pos2, nxt2 = _positions(QWEN2, types, video_grid_thw=torch.tensor([[3, 4, 4]]))
    assert pos2[0] == [0, 1, 2, 3] + [4] * 4 + [5] * 4 + [6] * 4 + [7, 8, 9] and nxt2 == 10


def test_image_and_multi_image_positions():
    # [T S I*6 E T]: image grid (1, 4, 6) -> 2x3 merged tokens at s = 2
    pos, nxt = _positions(QWEN25, [T, T] + [I] * 6 + [T, T], image_grid_thw=torch.tensor([[1, 4, 6]]))
    assert pos == [[0, 1] + [2] * 6 + [5, 6],
                   [0, 1, 2, 2, 2, 3, 3, 3, 5, 6],
                   [0, 1, 2, 3, 4, 2, 3, 4, 5, 6]] and nxt == 7
    # [S I E S I*4 E] and two images with no token between them: blocks split by their grids
    pos, nxt = _positions(QWEN25, [T, I, T, T] + [I] * 4 + [T, I, I],
                          image_grid_thw=torch.tensor([[1, 2, 2], [1, 4, 4], [1, 2, 2], [1, 2, 2]]))
    assert pos == [[0, 1, 2, 3, 4, 4, 4, 4, 6, 7, 8],
                   [0, 1, 2, 3, 4, 4, 5, 5, 6, 7, 8],
                   [0, 1, 2, 3, 4, 5, 4, 5, 6, 7, 8]] and nxt == 9


def test_mixed_image_and_video_batch_with_padding():
    """Grids are consumed in sequence order across a padded batch: row 0 (left-padded) holds an image,
    row 1 a video (2, 2, 4) at 0.5 s per grid step (t positions int(i * 0.5 * 2) = 0, 1), row 2
    (right-padded) text only. Padding positions are 0."""
    types = torch.tensor([
        [T, T, T, I, I, I, I, T],
        [T, V, V, V, V, T, T, T],
        [T, T, T, T, T, T, T, T],
    ])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1], [1] * 8, [1, 1, 1, 0, 0, 0, 0, 0]])
    pos, nxt = mrope_positions(QWEN25, types, mask, image_grid_thw=torch.tensor([[1, 4, 4]]),
                               video_grid_thw=torch.tensor([[2, 2, 4]]), second_per_grid_ts=torch.tensor([0.5]))
    assert pos[:, 0].tolist() == [[0, 0, 0, 1, 1, 1, 1, 3], [0, 0, 0, 1, 1, 2, 2, 3], [0, 0, 0, 1, 2, 1, 2, 3]]
    assert pos[:, 1].tolist() == [[0, 1, 1, 2, 2, 3, 4, 5], [0, 1, 1, 1, 1, 3, 4, 5], [0, 1, 2, 1, 2, 3, 4, 5]]
    assert pos[:, 2].tolist() == [[0, 1, 2, 0, 0, 0, 0, 0]] * 3
    assert nxt.flatten().tolist() == [4, 6, 3]


def test_grid_and_placeholder_mismatch_is_an_error():
    with pytest.raises(ValueError, match="needs 4 consecutive placeholders"):
        _positions(QWEN25, [T, I, I, T], image_grid_thw=torch.tensor([[1, 4, 4]]))
    with pytest.raises(ValueError, match="without a grid"):
        _positions(QWEN25, [T, V, T])
    with pytest.raises(ValueError, match="1 image and 0 video grids have no placeholders"):
        _positions(QWEN25, [T, T], image_grid_thw=torch.tensor([[1, 2, 2]]))


def test_three_turn_trajectory_with_images_after_assistant_text():
    """A multi-turn trajectory (rollout/multiturn.py): each observation's image follows the previous
    turn's assistant text. Layout, with grids (1, 4, 4) -> 2x2, (1, 4, 6) -> 2x3, (1, 6, 4) -> 3x2 tokens:

        user 0  [T T T | I*4 | T T]        response 0 [T T T]
        user 1  [T T | I*6 | T T]          response 1 [T T T]
        user 2  [T | I*6 | T]              response 2 [T T]

    Each block starts at the position after the text before it (the assistant's included) and what
    follows it at the block's largest position + 1; turn k's engine input is a prefix of the whole,
    so its positions are the whole's first columns and its next position is response k's first."""
    user0, resp0, user1, resp1, user2, resp2 = [T] * 3 + [I] * 4 + [T] * 2, [T] * 3, \
        [T] * 2 + [I] * 6 + [T] * 2, [T] * 3, [T] + [I] * 6 + [T], [T] * 2
    grids = torch.tensor([[1, 4, 4], [1, 4, 6], [1, 6, 4]])
    pos, nxt = _positions(QWEN25, user0 + resp0 + user1 + resp1 + user2 + resp2, image_grid_thw=grids)
    t_axis = [0, 1, 2, 3, 3, 3, 3, 5, 6, 7, 8, 9, 10, 11] + [12] * 6 + [15, 16, 17, 18, 19, 20] + [21] * 6 + [24, 25, 26]
    h_axis = [0, 1, 2, 3, 3, 4, 4, 5, 6, 7, 8, 9, 10, 11, 12, 12, 12, 13, 13, 13, 15, 16, 17, 18, 19, 20,
              21, 21, 22, 22, 23, 23, 24, 25, 26]
    w_axis = [0, 1, 2, 3, 4, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 12, 13, 14, 15, 16, 17, 18, 19, 20,
              21, 22, 21, 22, 21, 22, 24, 25, 26]
    assert pos == [t_axis, h_axis, w_axis] and nxt == 27
    assert pos == _positions(QWEN2, user0 + resp0 + user1 + resp1 + user2 + resp2, image_grid_thw=grids)[0]
    for turn, (length, first_response) in enumerate([(9, 7), (22, 17), (33, 25)]):
        types = (user0 + resp0 + user1 + resp1 + user2)[:length]
        prefix, next_position = _positions(QWEN25, types, image_grid_thw=grids[:turn + 1])
        assert prefix == [row[:length] for row in pos] and next_position == first_response == t_axis[length]


def _video_question(tokenizer, seconds_per_grid: float) -> PromptSample:
    """'Watch <video> then answer: which way?' with a (3, 4, 4) video grid (12 tokens), random patches."""
    grid = torch.tensor([[3, 4, 4]])
    messages = build_messages("Watch<video>then answer: which way does it move?", num_images=0, num_videos=1)
    ids = render_prompt_ids(tokenizer, messages, video_grid_thw=grid)
    pixels = torch.randn(48, 1176, generator=torch.Generator().manual_seed(0))
    return PromptSample(uid="video-mid", prompt_ids=ids, ground_truth="left", task="direction",
                        vision=VisionInputs(pixel_values_videos=pixels, video_grid_thw=grid,
                                            second_per_grid_ts=torch.tensor([seconds_per_grid])))


def test_model_passes_use_the_reference_positions(tiny_ckpt_qwen25, tiny_tokenizer):
    """rope_positions (every pass's positions) equals the pinned rule on a real prompt; the rollout's
    decode, the split (prefix + suffix) and the full-sequence passes all score with it."""
    engine = BuiltinRolloutEngine(str(tiny_ckpt_qwen25))
    model, cfg = engine.model, engine.model.config
    prompt = _video_question(tiny_tokenizer, 2.0)
    ids = prompt.prompt_ids
    start = int((ids == cfg.video_token_id).nonzero()[0])
    assert int(ids[start - 1]) == cfg.vision_start_token_id and int(ids[start + 12]) == cfg.vision_end_token_id
    pos, delta = rope_positions(model, ids.view(1, -1), torch.ones(1, ids.shape[0], dtype=torch.long), prompt.vision)
    assert pos[:, 0, start:start + 12].tolist() == [[start + 0] * 4 + [start + 4] * 4 + [start + 8] * 4,
                                                    [start, start, start + 1, start + 1] * 3,
                                                    [start, start + 1] * 6]
    after = torch.arange(start + 9, start + 9 + ids.shape[0] - start - 12)
    assert torch.equal(pos[:, 0, start + 12:], after.expand(3, -1))  # <vision_end> at start + 9
    assert int(delta) == int(after[-1]) + 1 - ids.shape[0]
    assert encode_prefix(model, [prompt], version=0)[0].next_position == int(after[-1]) + 1

    responses = engine.generate([prompt], SamplingParams(n=3, max_new_tokens=5, seed=2))
    batch = to_train_batch([prompt], responses, engine.pad_id)
    with torch.no_grad():
        full_ids, attn, plen, vision = build_full_sequences([prompt], batch.group_index, batch.response_ids,
                                                            batch.response_mask, engine.pad_id)
        full, _ = response_logprobs(model, full_ids, attn, vision, plen, batch.response_ids, batch.response_mask)
        split, _ = score_suffix(model, encode_prefix(model, [prompt], version=0), batch.group_index,
                                batch.response_ids, batch.response_mask)
    assert_close(full, batch.rollout_logprobs, atol=1e-5, rtol=0)
    assert_close(split, batch.rollout_logprobs, atol=1e-5, rtol=0)


def test_vision_tokens_inside_a_response_are_text(tiny_ckpt, make_prompts, tiny_tokenizer):
    """A response holding <|image_pad|>/<|video_pad|>/<|vision_start|> ids is scored as text: the
    full-sequence pass (model.shared_prefix=false) agrees with the split pass, values and gradients."""
    model = load_model(tiny_ckpt)
    cfg = model.config
    prompts = make_prompts(("color", "direction"))  # an image prompt and a video prompt
    pad = tiny_tokenizer.pad_token_id
    responses = torch.tensor([
        [11, cfg.image_token_id, 12, cfg.image_token_id, pad],
        [cfg.video_token_id, cfg.vision_start_token_id, cfg.image_token_id, 13, 14],
        [15, 16, cfg.video_token_id, pad, pad],
        [cfg.image_token_id, cfg.vision_end_token_id, 17, 18, 19],
    ])
    mask = (responses != pad).float()
    group_index = torch.tensor([0, 0, 1, 1])
    ids, attn, plen, vision = build_full_sequences(prompts, group_index, responses, mask, pad)
    full, _ = response_logprobs(model, ids, attn, vision, plen, responses, mask)
    full.sum().backward()
    g_full = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    split, _ = score_suffix(model, encode_prefix(model, prompts, version=0, with_grad=True), group_index,
                            responses, mask)
    split.sum().backward()
    assert_close(full.detach(), split.detach(), atol=1e-5, rtol=0)
    for name, p in model.named_parameters():
        if p.grad is not None:
            assert ((g_full[name] - p.grad).norm() / g_full[name].norm().clamp(min=1e-12)) <= 1e-4, name
