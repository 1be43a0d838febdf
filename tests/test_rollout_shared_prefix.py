"""One copy of a prompt's KV cache for its n samples (rollout/shared_prefix.py): the merged
prefix/suffix attention against SDPA over the repeated cache, the cache's bookkeeping, and the
engine's tokens, log-probs and KV bytes with and without it (tiny Qwen2.5-VL)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rollplex_train.rollout.base import SamplingParams
from rollplex_train.rollout.builtin import BuiltinRolloutEngine
from rollplex_train.rollout.shared_prefix import SharedPromptCache, shared_prefix_attention

LOGPROB_TOL = 1e-5  # another summation order than SDPA's (on bench_image a near tie flipped a draw: docs/benchmarks.md)


def _prompts_kv(lengths, k=2, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    keys = [[torch.randn(1, k, n, d, generator=g)] for n in lengths]
    values = [[torch.randn(1, k, n, d, generator=g)] for n in lengths]
    width = max(lengths)
    mask = torch.tensor([[0] * (width - n) + [1] * n for n in lengths])
    return keys, values, mask


def test_merged_attention_equals_sdpa_over_the_repeated_cache():
    """Three prompts of 5, 9 and 2 tokens (left-padded to 9), n = 3 samples, 2 KV heads x 2 query
    heads each, 4 response tokens, two sequences dropped: the merged attention is SDPA's over
    [repeated prompt | response] with the padding masked, to float32 rounding; padding values do
    not enter at all."""
    n, heads, d, t = 3, 4, 8, 4
    keys, values, mask = _prompts_kv([5, 9, 2])
    g = torch.Generator().manual_seed(1)
    rows = torch.tensor([0, 1, 2, 4, 5, 6, 7])  # sequences 3 and 8 finished
    q = torch.randn(len(rows), heads, 1, d, generator=g)
    resp_k, resp_v = (torch.randn(len(rows), 2, t, d, generator=g) for _ in range(2))
    cache = SharedPromptCache(keys, values, mask, n, capacity=t)
    cache.batch_select_indices(rows)
    layer = cache.layers[0]
    got = shared_prefix_attention(q, layer.prompt_k, layer.prompt_v, cache.prompt_mask, resp_k, resp_v,
                                  cache.group, cache.slot, n, scale=d ** -0.5)

    prompt_k = layer.prompt_k.repeat_interleave(n, dim=0)[rows]
    prompt_v = layer.prompt_v.repeat_interleave(n, dim=0)[rows]
    full_mask = torch.cat([mask.bool().repeat_interleave(n, dim=0)[rows], torch.ones(len(rows), t, dtype=torch.bool)], 1)
    want = F.scaled_dot_product_attention(q, torch.cat([prompt_k, resp_k], 2), torch.cat([prompt_v, resp_v], 2),
                                          attn_mask=full_mask[:, None, None, :], scale=d ** -0.5, enable_gqa=True)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)

    layer.prompt_k[~cache.prompt_mask.bool()[:, None, :, None].expand_as(layer.prompt_k)] = 1e4  # padding
    again = shared_prefix_attention(q, layer.prompt_k, layer.prompt_v, cache.prompt_mask, resp_k, resp_v,
                                    cache.group, cache.slot, n, scale=d ** -0.5)
    assert torch.equal(again, got)


def test_cache_holds_each_prompt_once_and_drops_finished_groups():
    keys, values, mask = _prompts_kv([5, 9, 2])
    cache = SharedPromptCache(keys, values, mask, n=2, capacity=4)
    layer = cache.layers[0]
    assert layer.prompt_k.shape == (3, 2, 9, 8) and layer._k.shape == (6, 2, 4, 8)
    assert torch.equal(layer.prompt_k[0, :, 4:], keys[0][0][0]) and not layer.prompt_k[0, :, :4].any()
    assert cache.nbytes == 2 * (3 * 2 * 9 * 8 + 6 * 2 * 4 * 8) * 4
    step = torch.arange(6 * 2 * 8.0).view(6, 2, 1, 8)
    k, v = cache.update(step, -step, 0)
    assert k.shape == (6, 2, 1, 8) and torch.equal(k, step)
    cache.batch_select_indices(torch.tensor([1, 4, 5]))  # prompt 1's group is all done
    assert cache.group.tolist() == [0, 1, 1] and cache.slot.tolist() == [1, 0, 1]
    assert torch.equal(layer.prompt_k[1], keys[2][0][0].new_zeros(2, 9, 8).index_copy(
        1, torch.arange(7, 9), keys[2][0][0]))  # prompt 2 is now row 1, still right-aligned
    assert torch.equal(layer._k[:, :, :1], step[[1, 4, 5]]) and cache.prompt_mask.tolist()[1] == mask[2].bool().tolist()
    cache.update(step[:3], step[:3], 0)
    cache.update(step[:3], step[:3], 0)
    cache.update(step[:3], step[:3], 0)
    with pytest.raises(ValueError, match="capacity 4"):
        cache.update(step[:3], step[:3], 0)


def test_engine_samples_the_same_tokens_over_one_prompt_copy(tiny_ckpt_qwen25, mixed_prompts, biased_head):
    """Images and a video, n = 4, EOS made likely so sequences finish at different steps: the same
    tokens as the repeated cache, log-probs within LOGPROB_TOL; the cache holds each prompt once:
    its bytes are the prompts' once plus the responses', against (prompt + responses) x n."""
    repeated = BuiltinRolloutEngine(str(tiny_ckpt_qwen25))
    if repeated.fused_decode_unsupported:  # transformers < 5.24 (rollout/decoder.py): the copy is refused
        with pytest.raises(ValueError, match="share_prompt_kv=true needs the fused decode step"):
            BuiltinRolloutEngine(str(tiny_ckpt_qwen25), share_prompt_kv=True)
        pytest.skip(f"one prompt copy needs the fused decode step: {repeated.fused_decode_unsupported}")
    shared = BuiltinRolloutEngine(str(tiny_ckpt_qwen25), share_prompt_kv=True)
    for engine in (repeated, shared):
        biased_head(engine.model, {engine.tokenizer.eos_token_id: 3.0})
    params = SamplingParams(n=4, max_new_tokens=12, seed=9)
    want, got = repeated.generate(mixed_prompts, params), shared.generate(mixed_prompts, params)
    assert len({len(r.token_ids) for r in want}) > 1  # some sequences were dropped early
    assert [r.token_ids.tolist() for r in got] == [r.token_ids.tolist() for r in want]
    assert max(float((a.logprobs - b.logprobs).abs().max()) for a, b in zip(got, want)) <= LOGPROB_TOL

    cfg = repeated.model.config.get_text_config()
    per_position = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4
    width, p, n, new = max(x.prompt_length for x in mixed_prompts), len(mixed_prompts), 4, 12
    assert repeated.kv_cache_bytes == p * n * (width + new) * per_position
    assert shared.kv_cache_bytes == (p * width + p * n * new) * per_position


def test_one_prompt_copy_needs_the_fused_decode_step(tiny_ckpt_qwen25):
    with pytest.raises(ValueError, match="share_prompt_kv=true needs the fused decode step.*attn_implementation"):
        BuiltinRolloutEngine(str(tiny_ckpt_qwen25), attn_implementation="eager", share_prompt_kv=True)
