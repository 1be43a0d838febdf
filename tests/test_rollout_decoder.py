"""The built-in engine's fused decode step (rollout/decoder.py) is transformers' forward, bit for bit:
hidden states of padded and unpadded batches, and the engine's sampled tokens and log-probs."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations import sdpa_attention

from rollplex_train.models.hf_compat import cache_kwargs
from rollplex_train.models.sequence import pad_prompts
from rollplex_train.rollout.base import SamplingParams
from rollplex_train.rollout.builtin import BuiltinRolloutEngine
from rollplex_train.rollout.decoder import FusedDecoder
from rollplex_train.rollout.kv_cache import PreallocatedCache


def _decode_hidden(engine, prompts, token_ids: torch.Tensor, fused: bool) -> torch.Tensor:
    """(B, S, H) final hidden states of S decode steps feeding ``token_ids`` (S, B) after the
    prompts' prefill, by the fused step or by transformers' forward."""
    states = engine._prefill(prompts, None)
    _, mask = pad_prompts(prompts, engine.pad_id, side="left")
    cache = PreallocatedCache.left_padded([s.keys for s in states], [s.values for s in states],
                                          capacity=mask.shape[1] + token_ids.shape[0])
    deltas = torch.tensor([[s.next_position - s.prompt_length] for s in states])
    num_real = mask.sum(-1)
    decoder = FusedDecoder(engine.model)
    out = []
    with torch.no_grad():
        for step in range(token_ids.shape[0]):
            mask = torch.cat([mask, torch.ones(len(prompts), 1, dtype=torch.long)], dim=1)
            pos = (num_real.view(-1, 1) + deltas).view(1, -1, 1).expand(3, -1, -1)
            if fused:
                out.append(decoder.step(token_ids[step], mask, pos, cache))
            else:
                out.append(engine.model.model(input_ids=token_ids[step].view(-1, 1), attention_mask=mask,
                                              position_ids=pos, use_cache=True,
                                              **cache_kwargs(engine.model.model, cache)).last_hidden_state[:, -1])
            num_real = num_real + 1
    return torch.stack(out, dim=1)


def test_fused_step_is_bitwise_the_transformers_forward(tiny_ckpt_qwen25, make_prompts, mixed_prompts):
    engine = BuiltinRolloutEngine(str(tiny_ckpt_qwen25))
    if not hasattr(sdpa_attention, "pack_gqa"):  # transformers < 5.24: the engine keeps transformers' forward
        assert "pack_gqa" in engine.fused_decode_unsupported
        pytest.skip("transformers < 5.24: the fused step is not its forward (rollout/decoder.py)")
    assert engine.fused_decode_unsupported is None
    vocab = engine.model.config.text_config.vocab_size
    tokens = torch.randint(0, vocab - 20, (6, 4), generator=torch.Generator().manual_seed(0))
    same_length = make_prompts(("color",), per_task=4)  # one length: no mask (SDPA with enable_gqa)
    assert len({p.prompt_length for p in same_length}) == 1
    mixed = mixed_prompts + make_prompts(("color",))  # left padding: the boolean mask, packed heads
    assert len({p.prompt_length for p in mixed}) > 1
    for prompts in (same_length, mixed):
        fused = _decode_hidden(engine, prompts, tokens, fused=True)
        reference = _decode_hidden(engine, prompts, tokens, fused=False)
        assert fused.shape == (4, 6, engine.model.config.text_config.hidden_size)
        assert torch.equal(fused, reference)


def test_engine_samples_the_same_with_and_without_the_fused_step(tiny_ckpt_qwen25, mixed_prompts):
    engine = BuiltinRolloutEngine(str(tiny_ckpt_qwen25))
    params = SamplingParams(n=3, max_new_tokens=12, seed=5)
    fused = engine.generate(mixed_prompts, params)
    engine.fused_decode_unsupported = "forced off by the test"
    plain = engine.generate(mixed_prompts, params)
    assert [r.token_ids.tolist() for r in fused] == [r.token_ids.tolist() for r in plain]
    assert all(torch.equal(a.logprobs, b.logprobs) for a, b in zip(fused, plain))


def test_unsupported_names_the_reason(tiny_ckpt_qwen25, tiny_ckpt_qwen2):
    eager = BuiltinRolloutEngine(str(tiny_ckpt_qwen25), attn_implementation="eager")
    assert "attn_implementation='eager'" in eager.fused_decode_unsupported
    sdpa = BuiltinRolloutEngine(str(tiny_ckpt_qwen25))
    assert "only float32 on CPU" in FusedDecoder.unsupported(sdpa.model, torch.device("cpu"), "bfloat16")
    qwen2 = BuiltinRolloutEngine(str(tiny_ckpt_qwen2))
    assert "Qwen2_5_VLTextModel" in qwen2.fused_decode_unsupported
