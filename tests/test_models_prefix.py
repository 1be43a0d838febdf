"""Prefix/suffix decomposition equals the full-sequence pass (float32), in values and gradients."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from rollplex_train.data.prompts import build_messages, render_prompt_ids
from rollplex_train.data.types import PromptSample, VisionInputs
from rollplex_train.data.vision import patchify_images
from rollplex_train.models.loading import load_model
from rollplex_train.models.prefix import ChunkedSuffix, encode_prefix, score_suffix
from rollplex_train.models.sequence import build_full_sequences, response_logprobs
from rollplex_train.training.prefix_store import PrefixStore
from rollplex_train.versioning import StaleWeightsError


def image_prompt(tokenizer, size: tuple[int, int], seed: int) -> PromptSample:
    """A prompt around one random image of ``size`` (width, height) pixels."""
    rng = np.random.default_rng(seed)
    image = Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8))
    pixels, grid = patchify_images([image], min_pixels=28 * 28, max_pixels=112 * 112)
    messages = build_messages("<image>What colour is the shape?", num_images=1, num_videos=0)
    ids = render_prompt_ids(tokenizer, messages, image_grid_thw=grid)
    return PromptSample(uid=f"img:{seed}", prompt_ids=ids, vision=VisionInputs(pixel_values=pixels, image_grid_thw=grid),
                        ground_truth="red")


def random_responses(num_groups: int, group_size: int, length: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    n = num_groups * group_size
    ids = torch.randint(0, 800, (n, length), generator=g)
    lengths = torch.randint(1, length + 1, (n,), generator=g)
    mask = (torch.arange(length).view(1, -1) < lengths.view(-1, 1)).float()
    return torch.arange(num_groups).repeat_interleave(group_size), ids * mask.long(), mask


def grads(model) -> dict[str, torch.Tensor]:
    out = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def full_and_split(model, prompts, group_size, *, padding, freeze_vision, length=6, seed=0):
    """(full log-probs, split log-probs, full grads, split grads) of sum(log-probs)."""
    group_index, resp, mask = random_responses(len(prompts), group_size, length, seed)
    model.zero_grad(set_to_none=True)
    model.model.visual.requires_grad_(not freeze_vision)
    ids, attn, plen, vision = build_full_sequences(prompts, group_index, resp, mask, pad_id=0)
    full, _ = response_logprobs(model, ids, attn, vision, plen, resp, mask)
    full.sum().backward()
    g_full = grads(model)
    states = encode_prefix(model, prompts, version=0, with_grad=True, freeze_vision=freeze_vision, padding=padding)
    split, _ = score_suffix(model, states, group_index, resp, mask)
    split.sum().backward()
    return full.detach(), split.detach(), g_full, grads(model)


def assert_same_grads(g_full, g_split, expect_vision: bool):
    assert g_full.keys() == g_split.keys()
    assert any(k.startswith("model.visual") for k in g_full) == expect_vision
    for name, g in g_full.items():
        rel = (g - g_split[name]).norm() / g.norm().clamp(min=1e-12)
        assert rel <= 1e-4, (name, float(rel))


@pytest.mark.parametrize("group_size", [1, 4, 8])
@pytest.mark.parametrize("padding", ["left", "right"])
def test_split_equals_full_images_and_video(tiny_ckpt, make_prompts, group_size, padding):
    model = load_model(tiny_ckpt)
    prompts = make_prompts(("color", "count", "direction"))  # 56x56 image, 112x112 image, video
    full, split, g_full, g_split = full_and_split(model, prompts, group_size, padding=padding, freeze_vision=False)
    assert (full - split).abs().max() <= 1e-5
    assert_same_grads(g_full, g_split, expect_vision=True)


@pytest.mark.parametrize("freeze_vision", [True, False])
def test_split_equals_full_three_image_sizes(tiny_ckpt, tiny_tokenizer, freeze_vision):
    model = load_model(tiny_ckpt)
    prompts = [image_prompt(tiny_tokenizer, size, seed) for seed, size in enumerate([(56, 56), (84, 112), (112, 56)])]
    assert len({tuple(p.vision.image_grid_thw[0].tolist()) for p in prompts}) == 3
    full, split, g_full, g_split = full_and_split(model, prompts, 4, padding="right", freeze_vision=freeze_vision)
    assert (full - split).abs().max() <= 1e-5
    assert_same_grads(g_full, g_split, expect_vision=not freeze_vision)


def test_prefix_cache_is_never_mutated(tiny_ckpt_qwen25, mixed_prompts):
    model = load_model(tiny_ckpt_qwen25)
    with torch.no_grad():
        states = encode_prefix(model, mixed_prompts, version=0)
        before = [k.clone() for k in states[0].keys]
        group_index, resp, mask = random_responses(3, 4, 5, seed=1)
        first, _ = score_suffix(model, states, group_index, resp, mask)
        second, _ = score_suffix(model, states, group_index, resp, mask)
    assert torch.equal(first, second)
    assert all(torch.equal(a, b) for a, b in zip(before, states[0].keys))
    assert states[0].keys[0].shape[-2] == mixed_prompts[0].prompt_length


def test_prefix_state_bytes_and_graph(tiny_ckpt_qwen25, mixed_prompts):
    model = load_model(tiny_ckpt_qwen25)
    with torch.no_grad():
        (plain,) = encode_prefix(model, mixed_prompts[:1], version=3)
    (graph,) = encode_prefix(model, mixed_prompts[:1], version=3, with_grad=True)
    cfg = model.config.get_text_config()
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    kv_bytes = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * mixed_prompts[0].prompt_length * head_dim * 4
    assert plain.nbytes == kv_bytes + cfg.hidden_size * 4  # KV cache + last hidden, float32
    assert plain.saved_bytes == 0 and not plain.last_hidden.requires_grad
    assert graph.saved_bytes > 0 and graph.last_hidden.requires_grad and graph.nbytes > plain.nbytes


def test_store_tracks_frees_and_refuses_other_versions(tiny_ckpt_qwen25, mixed_prompts):
    model = load_model(tiny_ckpt_qwen25)
    store = PrefixStore(owner="worker-0")
    with torch.no_grad():
        states = encode_prefix(model, mixed_prompts, version=5)
    for s in states:
        store.put("actor", s)
    assert len(store) == 3 and store.bytes_held == sum(s.nbytes for s in states)
    assert {row["owner"] for row in store.describe()} == {"worker-0"}
    uid = mixed_prompts[0].uid
    assert store.take(uid, "actor", 5) is states[0]
    with pytest.raises(StaleWeightsError, match="version"):
        store.take(uid, "actor", 6)  # a suffix under weights version 6 refuses a version-5 prefix
    with pytest.raises(KeyError):
        store.take(uid, "ref", "ref")
    freed = store.release(uid, "actor", 5)
    assert freed == states[0].nbytes and len(store) == 2
    assert store.bytes_held == states[1].nbytes + states[2].nbytes
    for p in mixed_prompts[1:]:
        store.release(p.uid, "actor", 5)
    assert len(store) == 0 and store.bytes_held == 0


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("padded", [False, True])
def test_chunked_suffix_is_bitwise_score_suffix(tiny_ckpt, mixed_prompts, threads, padded):
    """The suffix pass run in chunks as tokens are decoded gives exactly score_suffix's numbers,
    for each prompt kind, any chunking, on 1 and 2 threads (responses padded or all full width)."""
    model = load_model(tiny_ckpt)
    model.eval()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for k, prompt in enumerate(mixed_prompts):
            _, ids, mask = random_responses(1, 8, 20, seed=k)
            if not padded:
                mask, ids = torch.ones_like(mask), torch.randint(0, 800, ids.shape, generator=torch.Generator().manual_seed(k))
            width = int(mask.sum(-1).max())
            ids, mask = ids[:, :width], mask[:, :width]
            with torch.no_grad():
                state, = encode_prefix(model, [prompt], version=0)
                expected, expected_ent = score_suffix(model, [state], torch.zeros(8, dtype=torch.long), ids, mask,
                                                      temperature=0.7, with_entropy=True)
            assert width >= 13, width  # room for chunks of >= MIN_CHUNK_TOKENS
            for cuts in ([], [4], [width - 5], *(list(range(step, width - 4, step)) for step in (4, 5, 7))):
                chunked = ChunkedSuffix(model, state, 8, width)
                for cut in cuts:
                    chunked.extend(ids[:, :cut], mask[:, :cut])
                got, ent = chunked.log_probs(ids, mask, temperature=0.7, with_entropy=True)
                assert torch.equal(got, expected), (prompt.task, cuts)
                assert torch.equal(ent, expected_ent), (prompt.task, cuts)
                assert chunked.scored == width - 1
    finally:
        torch.set_num_threads(before)


def test_chunked_suffix_refuses_out_of_order_chunks(tiny_ckpt_qwen25, mixed_prompts):
    model = load_model(tiny_ckpt_qwen25)
    with torch.no_grad():
        state, = encode_prefix(model, mixed_prompts[:1], version=0)
    chunked = ChunkedSuffix(model, state, 2, 12)
    ids, mask = torch.ones(2, 12, dtype=torch.long), torch.ones(2, 12)
    chunked.extend(ids[:, :4], mask[:, :4])
    with pytest.raises(ValueError, match="expected 4 .. 11"):
        chunked.extend(ids[:, :2], mask[:, :2])
    with pytest.raises(ValueError, match="expected 4 .. 11"):
        chunked.extend(ids, mask)
    with pytest.raises(ValueError, match="chunk of 3 tokens"):
        chunked.extend(ids[:, :7], mask[:, :7])
    chunked.extend(ids[:, :8], mask[:, :8])
    with pytest.raises(ValueError, match="chunk of 3 tokens"):  # the tail left to finish is too short
        chunked.log_probs(ids, mask)
    whole = ChunkedSuffix(model, state, 2, 3)  # a 2-token pass runs in one chunk
    assert whole.extend(ids[:, :2], mask[:, :2]) == 2
