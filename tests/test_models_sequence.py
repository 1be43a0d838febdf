"""Full-sequence passes (models/sequence.py) against the built-in rollout engine and HF's own forward.

The rollout engine prefills left-padded prompts and decodes over a KV cache with positions
``num_real + delta``; the actor scores right-padded prompt+response rows in one forward. The two must
give the same per-token log-probs, for every mix of image sizes, videos and text-only prompts.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.testing import assert_close

from rollplex_train.data.prompts import build_messages, render_prompt_ids
from rollplex_train.data.types import PromptSample, VisionInputs
from rollplex_train.models.sequence import (
    build_full_sequences,
    mm_token_type_ids,
    response_logprobs,
    rope_positions,
    vision_kwargs,
)
from rollplex_train.rollout.base import SamplingParams
from rollplex_train.rollout.builtin import BuiltinRolloutEngine
from rollplex_train.runtime.batching import to_train_batch

ATOL = 1e-5
# Added (times the temperature) to the EOS logit so that some responses stop early and others run to max_new_tokens: the
# decode batch then shrinks mid-request (KV-cache rows dropped) and the scored rows are right padded
# to different lengths.
EOS_BIAS = 4.2


@torch.no_grad()
def _score(model, prompts, batch, temperature: float = 1.0) -> torch.Tensor:
    ids, mask, plen, vision = build_full_sequences(prompts, batch.group_index, batch.response_ids,
                                                   batch.response_mask, pad_id=_pad_id(model))
    logprobs, _ = response_logprobs(model, ids, mask, vision, plen, batch.response_ids, batch.response_mask,
                                    temperature=temperature)
    return logprobs


def _pad_id(model) -> int:
    return model.config.get_text_config().pad_token_id


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_rollout_logprobs_equal_full_forward_mixed_vision(tiny_ckpt, mixed_prompts, make_text_prompt, biased_head,
                                                          temperature):
    engine = BuiltinRolloutEngine(str(tiny_ckpt))
    biased_head(engine.model, {engine.tokenizer.eos_token_id: EOS_BIAS * temperature})
    # 56x56 image, 112x112 image, video, and a text-only row inside the same vision batch.
    prompts = mixed_prompts + [make_text_prompt("How many shapes are there?")]
    assert len({p.prompt_length for p in prompts}) > 1  # the rollout left-pads
    responses = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=8, temperature=temperature, seed=3))

    finish = {r.finish_reason for r in responses}
    assert finish == {"stop", "length"}, "precondition: responses of different lengths (decode batch shrinks)"
    batch = to_train_batch(prompts, responses, engine.pad_id)
    logprobs = _score(engine.model, prompts, batch, temperature)

    assert_close(logprobs, batch.rollout_logprobs, atol=ATOL, rtol=0)
    assert torch.all(logprobs[batch.response_mask == 0] == 0)
    assert torch.all(batch.rollout_logprobs[batch.response_mask == 1] < 0)


def test_rollout_logprobs_equal_full_forward_text_only(tiny_ckpt, make_text_prompt):
    """A batch without any vision input takes rope_positions' 1-D branch (deltas 0)."""
    engine = BuiltinRolloutEngine(str(tiny_ckpt))
    prompts = [make_text_prompt("What is the colour?", "text:0"),
               make_text_prompt("Which direction does the shape move? Options: left, right, up, down.", "text:1")]
    assert prompts[0].prompt_length < prompts[1].prompt_length
    responses = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=6, seed=5))
    batch = to_train_batch(prompts, responses, engine.pad_id)
    logprobs = _score(engine.model, prompts, batch)
    assert_close(logprobs, batch.rollout_logprobs, atol=ATOL, rtol=0)


def test_full_forward_equals_hf_forward(tiny_ckpt, mixed_prompts, tiny_tokenizer):
    """response_logprobs (our embedding, R rows through the head) == HF's own forward given the same
    M-RoPE positions; and those positions are HF's own wherever transformers 5.24 follows the
    reference rule (images; Qwen2-VL videos), differing only after a Qwen2.5-VL video whose
    temporal positions outrun its spatial ones (models/rope.py)."""
    from rollplex_train.models.loading import load_model

    model = load_model(tiny_ckpt)
    g = torch.Generator().manual_seed(0)
    response_ids = torch.randint(0, 800, (3, 5), generator=g)
    response_mask = torch.ones(3, 5)
    response_mask[0, 3:] = 0  # right padding inside the response block too
    response_ids[0, 3:] = tiny_tokenizer.pad_token_id
    group = torch.arange(3)
    ids, mask, plen, vision = build_full_sequences(mixed_prompts, group, response_ids, response_mask,
                                                   tiny_tokenizer.pad_token_id)
    with torch.no_grad():
        logprobs, entropy = response_logprobs(model, ids, mask, vision, plen, response_ids, response_mask,
                                              with_entropy=True)
        kwargs = vision_kwargs(vision)
        if model.config.model_type == "qwen2_5_vl":
            kwargs["second_per_grid_ts"] = vision.second_per_grid_ts
        ours, _ = rope_positions(model, ids, mask, vision)
        hf, _ = model.model.get_rope_index(input_ids=ids, attention_mask=mask, **{
            k: v for k, v in kwargs.items() if k in ("image_grid_thw", "video_grid_thw", "second_per_grid_ts")},
            mm_token_type_ids=mm_token_type_ids(model, ids))
        assert torch.equal(ours[:, :2], hf[:, :2])  # the two image rows
        video = model.config.model_type == "qwen2_5_vl"  # 1 s per grid step, 2 tokens/s: t reaches 2, h/w 1
        assert torch.equal(ours[:, 2], hf[:, 2]) != video
        logits = model(input_ids=ids, attention_mask=mask, position_ids=ours, **kwargs).logits.float()
    log_softmax = logits.log_softmax(-1)
    expected = torch.zeros(3, 5)
    expected_entropy = torch.zeros(3, 5)
    for i in range(3):
        for t in range(int(response_mask[i].sum())):
            row = log_softmax[i, plen[i] - 1 + t]
            expected[i, t] = row[response_ids[i, t]]
            expected_entropy[i, t] = -(row.exp() * row).sum()
    assert_close(logprobs, expected, atol=1e-6, rtol=0)
    assert_close(entropy, expected_entropy, atol=1e-5, rtol=0)


def test_rope_positions_text_only_batch(tiny_ckpt_qwen25):
    from rollplex_train.models.loading import load_model

    model = load_model(tiny_ckpt_qwen25)
    ids = torch.tensor([[5, 6, 7, 0, 0], [0, 0, 5, 6, 7], [1, 2, 3, 4, 5]])
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    pos, deltas = rope_positions(model, ids, mask, VisionInputs())
    row = torch.tensor([[0, 1, 2, 0, 0], [0, 0, 0, 1, 2], [0, 1, 2, 3, 4]])
    assert pos.shape == (3, 3, 5) and pos.dtype == torch.long
    assert torch.equal(pos, row.unsqueeze(0).expand(3, -1, -1))
    assert torch.equal(deltas, torch.zeros(3, 1, dtype=torch.long))


def _merged_grid(t: int, h: int, w: int, merge: int = 2) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Expected (t, h, w) index offsets of the placeholders of one (t, h, w) patch grid."""
    hm, wm = h // merge, w // merge
    tt = torch.arange(t).repeat_interleave(hm * wm)
    hh = torch.arange(hm).repeat_interleave(wm).repeat(t)
    ww = torch.arange(wm).repeat(hm * t)
    return tt, hh, ww


def test_rope_positions_mrope_values(tiny_ckpt, mixed_prompts, tiny_tokenizer):
    """M-RoPE values for right-padded image (4x4, 8x8 patches) and video (2x4x4) prompts."""
    from rollplex_train.models.loading import load_model

    model = load_model(tiny_ckpt)
    cfg = model.config
    resp = torch.full((3, 1), tiny_tokenizer.pad_token_id)
    ids, mask, plen, vision = build_full_sequences(mixed_prompts, torch.arange(3), resp, torch.zeros(3, 1),
                                                   tiny_tokenizer.pad_token_id)
    pos, deltas = rope_positions(model, ids, mask, vision)
    grids = [mixed_prompts[0].vision.image_grid_thw[0], mixed_prompts[1].vision.image_grid_thw[0],
             mixed_prompts[2].vision.video_grid_thw[0]]
    assert [g.tolist() for g in grids] == [[1, 4, 4], [1, 8, 8], [2, 4, 4]]
    for i, grid in enumerate(grids):
        pad = cfg.video_token_id if i == 2 else cfg.image_token_id
        slots = (ids[i] == pad).nonzero().flatten()
        start, end = int(slots[0]), int(slots[-1])
        assert end - start + 1 == int(grid.prod()) // 4
        # text before the vision block: 1-D positions 0..start-1 in all three sections
        assert torch.equal(pos[:, i, :start], torch.arange(start).expand(3, -1))
        tt, hh, ww = _merged_grid(*grid.tolist())
        if i == 2 and cfg.model_type == "qwen2_5_vl":
            # Qwen2.5-VL spaces video frames by tokens_per_second * seconds per temporal grid step.
            tt = (tt * cfg.vision_config.tokens_per_second * float(mixed_prompts[2].vision.second_per_grid_ts[0])).long()
        assert torch.equal(pos[0, i, start:end + 1], start + tt)
        assert torch.equal(pos[1, i, start:end + 1], start + hh)
        assert torch.equal(pos[2, i, start:end + 1], start + ww)
        # text after the block: one position for all sections, +1 per token, past the spatial extent
        after = pos[:, i, end + 1: plen[i]]
        assert torch.equal(after[0], after[1]) and torch.equal(after[0], after[2])
        assert torch.equal(after[0], after[0][0] + torch.arange(after.shape[1]))
        assert after[0][0] > start + max(hh.max(), ww.max())
        # the contract the rollout decode relies on: last real token at index plen-1 sits at plen-1+delta
        assert int(pos[0, i, plen[i] - 1]) == int(plen[i]) - 1 + int(deltas[i])
        assert torch.all(pos[:, i, plen[i]:] == 0)  # padding


def test_build_full_sequences_layout():
    pad = 99
    prompts = [
        PromptSample(uid="a", prompt_ids=torch.tensor([1, 2, 3]), vision=VisionInputs(
            pixel_values=torch.full((16, 4), 1.0), image_grid_thw=torch.tensor([[1, 4, 4]])), ground_truth="x"),
        PromptSample(uid="b", prompt_ids=torch.tensor([4, 5]), vision=VisionInputs(), ground_truth="y"),
        PromptSample(uid="c", prompt_ids=torch.tensor([6, 7, 8, 9]), vision=VisionInputs(
            pixel_values=torch.full((64, 4), 3.0), image_grid_thw=torch.tensor([[1, 8, 8]])), ground_truth="z"),
    ]
    group = torch.tensor([0, 0, 1, 2, 2])
    response_ids = torch.tensor([[10, 11, 12], [13, pad, pad], [14, 15, pad], [pad, pad, pad], [16, 17, 18]])
    response_mask = (response_ids != pad).float()
    ids, mask, plen, vision = build_full_sequences(prompts, group, response_ids, response_mask, pad)

    P = pad
    assert torch.equal(ids, torch.tensor([
        [1, 2, 3, 10, 11, 12, P],
        [1, 2, 3, 13, P, P, P],
        [4, 5, 14, 15, P, P, P],
        [6, 7, 8, 9, P, P, P],  # an empty response: the prompt alone
        [6, 7, 8, 9, 16, 17, 18],
    ]))
    assert torch.equal(mask, torch.tensor([
        [1, 1, 1, 1, 1, 1, 0],
        [1, 1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 1, 1, 1],
    ]))
    assert ids.dtype == torch.long and mask.dtype == torch.long
    assert torch.equal(plen, torch.tensor([3, 3, 2, 4, 4]))
    # vision repeated once per response, in row order (prompt b has none)
    assert torch.equal(vision.image_grid_thw, torch.tensor([[1, 4, 4], [1, 4, 4], [1, 8, 8], [1, 8, 8]]))
    assert vision.pixel_values.shape == (16 + 16 + 64 + 64, 4)
    assert torch.equal(vision.pixel_values[:32], torch.full((32, 4), 1.0))
    assert torch.equal(vision.pixel_values[32:], torch.full((128, 4), 3.0))
    assert vision.pixel_values_videos is None and vision.video_grid_thw is None


def test_rollout_logprobs_equal_full_forward_video_at_prompt_end(tiny_ckpt_qwen25, make_prompts, tiny_tokenizer):
    engine = BuiltinRolloutEngine(str(tiny_ckpt_qwen25))
    (video,) = make_prompts(("direction",))
    # 4 s per temporal grid step: what patchify_video gives for frames sampled at 0.5 fps
    # (second_per_grid_ts = temporal_patch_size / sample_fps), e.g. a long clip under data.video_fps=0.5.
    vision = dataclasses.replace(video.vision, second_per_grid_ts=torch.tensor([4.0]))
    messages = build_messages("Which way does it move?<video>", num_images=0, num_videos=1)
    prompt = PromptSample(uid="video-last", prompt_ids=render_prompt_ids(tiny_tokenizer, messages, None,
                                                                        vision.video_grid_thw),
                          vision=vision, ground_truth="left", task="direction")
    responses = engine.generate([prompt], SamplingParams(n=2, max_new_tokens=4, seed=1))
    batch = to_train_batch([prompt], responses, engine.pad_id)
    assert_close(_score(engine.model, [prompt], batch), batch.rollout_logprobs, atol=ATOL, rtol=0)
