"""Chat messages from EasyR1 problems and prompt ids with expanded vision pads."""

from __future__ import annotations

import pytest
import torch

from rollplex_train.data.prompts import build_messages, expand_vision_pads, render_prompt_ids

FORMAT_PROMPT = "{{ content | trim }} Think, then put the final answer in \\boxed{}.\n"


@pytest.fixture(scope="module")
def tokenizer():
    from rollplex_train.models.tiny import build_tokenizer

    return build_tokenizer()


def test_placeholders_become_content_items_in_order():
    messages = build_messages("<image>left <video> middle<image>", num_images=2, num_videos=1,
                              system_prompt="Be brief.")
    assert messages[0] == {"role": "system", "content": "Be brief."}
    assert messages[1]["role"] == "user"
    assert messages[1]["content"] == [
        {"type": "image"}, {"type": "text", "text": "left "}, {"type": "video"},
        {"type": "text", "text": " middle"}, {"type": "image"},
    ]
    assert build_messages("no media", num_images=0, num_videos=0) == [
        {"role": "user", "content": [{"type": "text", "text": "no media"}]}
    ]


def test_placeholder_count_mismatch_names_the_sample():
    with pytest.raises(ValueError, match="train.parquet row 7.*1 <image>.*2 images"):
        build_messages("<image>what?", num_images=2, num_videos=0, name="train.parquet row 7")
    with pytest.raises(ValueError, match="video"):
        build_messages("<image>what?", num_images=1, num_videos=1)


def test_format_prompt_renders_content():
    messages = build_messages("<image>What colour? ", num_images=1, num_videos=0, format_prompt=FORMAT_PROMPT)
    assert messages[0]["content"] == [
        {"type": "image"},
        {"type": "text", "text": "What colour? Think, then put the final answer in \\boxed{}."},
    ]


def test_expand_vision_pads_counts_and_errors():
    text = "a<|image_pad|>b<|video_pad|>c<|image_pad|>"
    out = expand_vision_pads(text, torch.tensor([[1, 4, 4], [1, 2, 2]]), torch.tensor([[2, 4, 6]]), merge_size=2)
    assert out == "a" + "<|image_pad|>" * 4 + "b" + "<|video_pad|>" * 12 + "c" + "<|image_pad|>"
    with pytest.raises(ValueError, match="image_pad"):
        expand_vision_pads(text, torch.tensor([[1, 4, 4]]), torch.tensor([[2, 4, 6]]))
    with pytest.raises(ValueError, match="video_pad"):
        expand_vision_pads(text, torch.tensor([[1, 4, 4], [1, 2, 2]]), None)


def test_render_prompt_ids_with_format_prompt(tokenizer):
    messages = build_messages("<image>What is the colour of the shape?", num_images=1, num_videos=0,
                              system_prompt="You are a careful assistant.", format_prompt=FORMAT_PROMPT)
    grid = torch.tensor([[1, 4, 6]])
    ids = render_prompt_ids(tokenizer, messages, grid, None, merge_size=2)
    assert ids.dtype == torch.long and ids.dim() == 1
    image_pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert int((ids == image_pad).sum()) == 6
    text = tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system\nYou are a careful assistant.<|im_end|>\n<|im_start|>user\n")
    assert "<|vision_start|>" + "<|image_pad|>" * 6 + "<|vision_end|>What is the colour of the shape? Think" in text
    assert text.endswith("\\boxed{}.<|im_end|>\n<|im_start|>assistant\n")
    # Same ids as expanding by hand and tokenizing the whole text.
    manual = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    manual = manual.replace("<|image_pad|>", "<|image_pad|>" * 6)
    assert ids.tolist() == tokenizer(manual, add_special_tokens=False)["input_ids"]


def test_render_prompt_ids_video(tokenizer):
    messages = build_messages("<video>Which way?", num_images=0, num_videos=1)
    ids = render_prompt_ids(tokenizer, messages, None, torch.tensor([[2, 4, 4]]))
    video_pad = tokenizer.convert_tokens_to_ids("<|video_pad|>")
    assert int((ids == video_pad).sum()) == 8
    # The default system prompt of the template is kept when none is given.
    assert tokenizer.decode(ids).startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>")
