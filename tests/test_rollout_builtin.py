"""The built-in rollout engine: seeded sampling, greedy decoding, truncation, grouping, stopping,
suppressed vision tokens, versioned weight updates and memory release (tiny Qwen2.5-VL)."""

from __future__ import annotations

import math
import shutil

import pytest
import torch
from torch.testing import assert_close

from dataclasses import replace

from rollplex_train.data.types import DecodeProgress
from rollplex_train.models.sequence import build_full_sequences, rope_positions, vision_kwargs
from rollplex_train.rollout.base import SamplingParams, StaleWeightsError, create_rollout_engine
from rollplex_train.rollout.builtin import BuiltinRolloutEngine, filter_logits
from rollplex_train.runtime.batching import to_train_batch

NEG_INF = float("-inf")


@pytest.fixture(scope="module")
def engine(tiny_ckpt_qwen25) -> BuiltinRolloutEngine:
    """A shared engine for tests that do not change it."""
    return BuiltinRolloutEngine(str(tiny_ckpt_qwen25))


@pytest.fixture
def fresh_engine(tiny_ckpt_qwen25) -> BuiltinRolloutEngine:
    """An engine of its own, for tests that change weights, heads or state."""
    return BuiltinRolloutEngine(str(tiny_ckpt_qwen25))


def _tokens(responses) -> list[list[int]]:
    return [r.token_ids.tolist() for r in responses]


def _suppressed(model) -> set[int]:
    cfg = model.config
    return {cfg.image_token_id, cfg.video_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id}


@torch.no_grad()
def _full_logits(model, prompts, responses, pad_id) -> torch.Tensor:
    """(N, R, V) logits that score each response token, from one right-padded full forward."""
    batch = to_train_batch(prompts, responses, pad_id)
    ids, mask, plen, vision = build_full_sequences(prompts, batch.group_index, batch.response_ids,
                                                   batch.response_mask, pad_id)
    position_ids, _ = rope_positions(model, ids, mask, vision)
    hidden = model.model(input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=False,
                         **vision_kwargs(vision)).last_hidden_state
    r = batch.response_ids.shape[1]
    idx = plen.view(-1, 1) - 1 + torch.arange(r).view(1, -1)
    return model.lm_head(hidden.gather(1, idx.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))).float()


# ---- registry ------------------------------------------------------------------------------------
def test_registry_builds_builtin_and_rejects_unknown(tiny_ckpt_qwen25):
    eng = create_rollout_engine("builtin", model_path=str(tiny_ckpt_qwen25), max_batch_size=8)
    assert isinstance(eng, BuiltinRolloutEngine) and eng.max_batch_size == 8 and eng.weights_version == 0
    with pytest.raises(ValueError, match="rollout.name='nope'"):
        create_rollout_engine("nope")


# ---- sampling ------------------------------------------------------------------------------------
def test_same_seed_same_tokens_different_seed_different(engine, mixed_prompts):
    params = SamplingParams(n=2, max_new_tokens=6, seed=11)
    a = engine.generate(mixed_prompts, params)
    b = engine.generate(mixed_prompts, params)
    assert _tokens(a) == _tokens(b)
    for x, y in zip(a, b):
        assert torch.equal(x.logprobs, y.logprobs) and x.text == y.text and x.finish_reason == y.finish_reason
    c = engine.generate(mixed_prompts, SamplingParams(n=2, max_new_tokens=6, seed=12))
    assert _tokens(c) != _tokens(a)
    # the two samples of a group are distinct draws, not copies
    assert _tokens(a)[0] != _tokens(a)[1]


def test_greedy_is_deterministic_and_follows_argmax(engine, mixed_prompts):
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=5)
    a = engine.generate(mixed_prompts, params)
    assert _tokens(a) == _tokens(engine.generate(mixed_prompts, SamplingParams(n=2, temperature=0.0,
                                                                              max_new_tokens=5, seed=99)))
    assert _tokens(a)[0::2] == _tokens(a)[1::2]  # greedy: both responses of a group agree
    logits = _full_logits(engine.model, mixed_prompts, a, engine.pad_id)
    allowed = logits.clone()
    allowed[..., sorted(_suppressed(engine.model))] = NEG_INF
    for i, resp in enumerate(a):
        r = resp.token_ids.shape[0]
        assert r == 5 and resp.finish_reason == "length"
        # every step's token is the argmax of the full-sequence logits at that step
        assert torch.equal(resp.token_ids, allowed[i, :r].argmax(-1))
        # greedy log-probs are log_softmax(logits) of the chosen token (temperature 1 scoring)
        expected = logits[i, :r].log_softmax(-1).gather(-1, resp.token_ids.view(-1, 1)).squeeze(-1)
        assert_close(resp.logprobs, expected, atol=1e-5, rtol=0)


def test_filter_logits_top_k_exact():
    row = torch.tensor([[2.0, -1.0, 0.5, 1.0, 0.0]])
    out = filter_logits(row, top_k=2, top_p=1.0)
    assert torch.equal(out, torch.tensor([[2.0, NEG_INF, NEG_INF, 1.0, NEG_INF]]))
    # off: -1 and k >= V leave the row as it is
    assert torch.equal(filter_logits(row, top_k=-1, top_p=1.0), row)
    assert torch.equal(filter_logits(row, top_k=5, top_p=1.0), row)
    # rows are filtered independently
    two = torch.tensor([[0.0, 3.0, 1.0], [5.0, 4.0, -2.0]])
    assert torch.equal(filter_logits(two, top_k=1, top_p=1.0),
                       torch.tensor([[NEG_INF, 3.0, NEG_INF], [5.0, NEG_INF, NEG_INF]]))


def test_filter_logits_top_p_exact():
    # softmax([2, -1, .5, 1, 0]) sorted: .5630, .2071, .1256, .0762, .0280 -> mass *before* each token:
    # 0, .5630, .7701, .8957, .9720. A token is dropped once the mass before it reaches top_p.
    row = torch.tensor([[2.0, -1.0, 0.5, 1.0, 0.0]])
    probs = row.softmax(-1)[0]
    assert abs(float(probs[0]) - math.exp(2) / sum(math.exp(x) for x in (2, -1, .5, 1, 0))) < 1e-6
    assert torch.equal(filter_logits(row, -1, 0.5), torch.tensor([[2.0, NEG_INF, NEG_INF, NEG_INF, NEG_INF]]))
    assert torch.equal(filter_logits(row, -1, 0.7), torch.tensor([[2.0, NEG_INF, NEG_INF, 1.0, NEG_INF]]))
    assert torch.equal(filter_logits(row, -1, 0.8), torch.tensor([[2.0, NEG_INF, 0.5, 1.0, NEG_INF]]))
    assert torch.equal(filter_logits(row, -1, 0.95), torch.tensor([[2.0, NEG_INF, 0.5, 1.0, 0.0]]))
    # the most likely token always survives
    assert torch.equal(filter_logits(row, -1, 1e-6), torch.tensor([[2.0, NEG_INF, NEG_INF, NEG_INF, NEG_INF]]))
    # top-p applies to the renormalised top-k survivors: softmax([2, .5, 1]) = .6285, .1402, .2312,
    # mass before: 0, .6285, .8597 -> p=.8 keeps two, p=.9 keeps three
    assert torch.equal(filter_logits(row, 3, 0.8), torch.tensor([[2.0, NEG_INF, NEG_INF, 1.0, NEG_INF]]))
    assert torch.equal(filter_logits(row, 3, 0.9), torch.tensor([[2.0, NEG_INF, 0.5, 1.0, NEG_INF]]))


def test_top_k_one_sampling_equals_greedy(engine, mixed_prompts):
    greedy = engine.generate(mixed_prompts, SamplingParams(n=1, temperature=0.0, max_new_tokens=4))
    top1 = engine.generate(mixed_prompts, SamplingParams(n=1, temperature=1.0, top_k=1, max_new_tokens=4, seed=3))
    assert _tokens(top1) == _tokens(greedy)


# ---- grouping ------------------------------------------------------------------------------------
def test_n_grouping_and_chunking(fresh_engine, mixed_prompts):
    params = SamplingParams(n=3, temperature=0.0, max_new_tokens=3)
    whole = fresh_engine.generate(mixed_prompts, params)
    assert [r.prompt_index for r in whole] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    # max_batch_size 4 with n=3: one prompt per chunk; indices stay global, greedy tokens unchanged
    fresh_engine.max_batch_size = 4
    chunked = fresh_engine.generate(mixed_prompts, params)
    assert [r.prompt_index for r in chunked] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert _tokens(chunked) == _tokens(whole)
    for a, b in zip(chunked, whole):
        assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)


def test_stream_yields_each_group_when_it_finishes(fresh_engine, mixed_prompts, biased_head):
    """generate_stream: whole groups in completion order (the longest response per item never
    decreases; the groups still decoding at the end come in one last item), and together exactly
    what generate returns for the same seed."""
    biased_head(fresh_engine.model, {fresh_engine.tokenizer.eos_token_id: 6.0})  # varied lengths
    params = SamplingParams(n=3, max_new_tokens=10, seed=3)
    streamed = list(fresh_engine.generate_stream(mixed_prompts * 2, params))
    whole = fresh_engine.generate(mixed_prompts * 2, params)
    longest = [max(len(r.token_ids) for r in item) for item in streamed]
    assert longest == sorted(longest) and len(streamed) > 1  # some groups finished early
    for item in streamed:
        indices = [r.prompt_index for r in item]
        assert all(indices.count(i) == 3 for i in indices)  # whole groups only
    flat = sorted((r for item in streamed for r in item), key=lambda r: r.prompt_index)
    assert _tokens(flat) == _tokens(whole)
    assert [r.prompt_index for r in flat] == [r.prompt_index for r in whole]


# ---- KV cache ------------------------------------------------------------------------------------
@pytest.mark.parametrize("capacity_delta", [0, -6])  # sized for prompt + max_new_tokens; too small: grows
def test_preallocated_cache_gives_dynamic_caches_exact_results(fresh_engine, mixed_prompts, biased_head,
                                                               monkeypatch, capacity_delta):
    """The decode's preallocated KV cache against transformers' DynamicCache: the same tokens and
    bitwise the same log-probs, with padded prompts of mixed length, sequences dropped as they
    finish, and a buffer that has to grow."""
    from transformers import DynamicCache

    import rollplex_train.rollout.builtin as builtin
    from rollplex_train.rollout.kv_cache import PreallocatedCache

    biased_head(fresh_engine.model, {fresh_engine.tokenizer.eos_token_id: 5.0})  # varied lengths
    params = SamplingParams(n=3, max_new_tokens=12, seed=5)
    made = []

    class Preallocated:
        @staticmethod
        def left_padded(keys, values, capacity):
            made.append(PreallocatedCache.left_padded(keys, values, capacity + capacity_delta))
            return made[-1]

    class Dynamic:  # the same prompt caches, concatenated into by every decode step
        @staticmethod
        def left_padded(keys, values, capacity):
            filled = PreallocatedCache.left_padded(keys, values, capacity).layers
            return DynamicCache(ddp_cache_data=[(layer.keys.clone(), layer.values.clone()) for layer in filled])

    monkeypatch.setattr(builtin, "PreallocatedCache", Preallocated)
    fast = fresh_engine.generate(mixed_prompts * 2, params)
    monkeypatch.setattr(builtin, "PreallocatedCache", Dynamic)
    slow = fresh_engine.generate(mixed_prompts * 2, params)
    assert len({len(r.token_ids) for r in slow}) > 1  # some sequences were dropped before the end
    assert _tokens(fast) == _tokens(slow)
    assert all(torch.equal(a.logprobs, b.logprobs) for a, b in zip(fast, slow))
    layer = made[0].layers[0]
    grew = layer._k.shape[2] > layer.capacity
    assert grew == (capacity_delta < 0)


def test_preallocated_layer_appends_selects_and_repeats():
    from rollplex_train.rollout.kv_cache import PreallocatedLayer

    layer = PreallocatedLayer(capacity=3)
    k, v = torch.arange(2 * 1 * 2 * 2.0).view(2, 1, 2, 2), -torch.arange(2 * 1 * 2 * 2.0).view(2, 1, 2, 2)
    keys, values = layer.update(k, v)
    assert torch.equal(keys, k) and torch.equal(values, v) and layer.get_seq_length() == 2
    step_k, step_v = torch.full((2, 1, 1, 2), 7.0), torch.full((2, 1, 1, 2), -7.0)
    keys, _ = layer.update(step_k, step_v)
    assert torch.equal(keys, torch.cat([k, step_k], dim=2))
    keys, values = layer.update(step_k + 1, step_v - 1)  # past capacity: the buffer grows
    assert layer.get_seq_length() == 4 and torch.equal(keys, torch.cat([k, step_k, step_k + 1], dim=2))
    assert torch.equal(values, torch.cat([v, step_v, step_v - 1], dim=2))
    layer.batch_repeat_interleave(2)
    assert torch.equal(layer.keys[2], layer.keys[3]) and torch.equal(layer.keys[1], keys[0])
    layer.batch_select_indices(torch.tensor([3, 0]))
    assert torch.equal(layer.keys, keys[[1, 0]]) and torch.equal(layer.values, values[[1, 0]])


def test_left_padded_cache_places_each_prompt_at_the_right_end():
    from rollplex_train.rollout.kv_cache import PreallocatedCache

    long = [torch.arange(1 * 2 * 3 * 4.0).view(1, 2, 3, 4) + 1]
    short = [torch.full((1, 2, 1, 4), 9.0)]
    cache = PreallocatedCache.left_padded([long, short], [[-t for t in long], [-t for t in short]], capacity=5)
    layer = cache.layers[0]
    assert layer.get_seq_length() == 3 and layer._k.shape == (2, 2, 5, 4)
    assert torch.equal(layer.keys[0], long[0][0]) and torch.equal(layer.values[0], -long[0][0])
    assert torch.equal(layer.keys[1, :, 2:], short[0][0]) and not layer.keys[1, :, :2].any()
    with pytest.raises(ValueError, match="capacity of 2"):
        PreallocatedCache.left_padded([long], [long], capacity=2)


# ---- prefixes handed in --------------------------------------------------------------------------
def test_handed_in_prefixes_give_the_engines_own_results(fresh_engine, mixed_prompts, tiny_ckpt_qwen25):
    """The rollout decodes from KV caches the training side encoded (a model of its own with grad,
    ``encode_prefix``, as the train worker's actor prefix) exactly as from its own prefill: the same
    tokens and bitwise the same log-probs, with prompts of mixed lengths and some prompts left for
    the engine to prefill; a state of another weights version or prompt is refused."""
    from rollplex_train.models.loading import load_model
    from rollplex_train.models.prefix import encode_prefix

    actor = load_model(str(tiny_ckpt_qwen25))
    actor.train()
    states = [encode_prefix(actor, [p], version=7, with_grad=True)[0] for p in mixed_prompts]
    assert states[0].keys[0].requires_grad
    given = [s.detached(version=0) for s in states]
    params = SamplingParams(n=3, max_new_tokens=10, seed=11)
    own = fresh_engine.generate(mixed_prompts, params)
    for prefixes in (given, [given[0], None, given[2]]):
        got = fresh_engine.generate(mixed_prompts, params, prefixes=prefixes)
        assert _tokens(got) == _tokens(own)
        assert all(torch.equal(a.logprobs, b.logprobs) for a, b in zip(got, own))
    # the engine decodes from what it is handed, not from a prefill of its own: a changed state changes
    # the first prompt's responses and only those
    changed = given[0].detached()
    changed.last_hidden = changed.last_hidden + 1.0
    got = fresh_engine.generate(mixed_prompts, params, prefixes=[changed, given[1], given[2]])
    assert not torch.equal(got[0].logprobs[:1], own[0].logprobs[:1])
    assert all(torch.equal(a.logprobs, b.logprobs) for a, b in zip(got[3:], own[3:]))
    with pytest.raises(StaleWeightsError, match="version 7"):
        fresh_engine.generate(mixed_prompts, params, prefixes=[states[0].detached(), None, None])
    with pytest.raises(StaleWeightsError, match="for prompt"):
        fresh_engine.generate(mixed_prompts, params, prefixes=[given[1], None, None])


# ---- stopping ------------------------------------------------------------------------------------
def test_eos_stops_and_ignore_eos_runs_to_max_new_tokens(fresh_engine, mixed_prompts, biased_head):
    eos = fresh_engine.tokenizer.eos_token_id
    biased_head(fresh_engine.model, {eos: 50.0})
    stopped = fresh_engine.generate(mixed_prompts, SamplingParams(n=2, max_new_tokens=5, seed=1))
    for r in stopped:
        assert r.token_ids.tolist() == [eos] and r.finish_reason == "stop" and r.text == ""
    full = fresh_engine.generate(mixed_prompts, SamplingParams(n=2, max_new_tokens=5, seed=1, ignore_eos=True))
    for r in full:
        assert r.token_ids.shape == (5,) and r.logprobs.shape == (5,) and r.finish_reason == "length"
        assert r.token_ids.tolist() == [eos] * 5


def test_generation_config_eos_ids_also_stop(fresh_engine, mixed_prompts, biased_head):
    """The checkpoint's generation_config lists <|im_end|> and <|endoftext|>: both end a response."""
    pad = fresh_engine.tokenizer.pad_token_id  # <|endoftext|>
    assert pad != fresh_engine.tokenizer.eos_token_id and pad in fresh_engine.eos_ids
    biased_head(fresh_engine.model, {pad: 50.0})
    for r in fresh_engine.generate(mixed_prompts[:1], SamplingParams(n=2, max_new_tokens=5, seed=1)):
        assert r.token_ids.tolist() == [pad] and r.finish_reason == "stop"


def test_stop_string_stops_and_is_kept(engine, mixed_prompts):
    prompt = mixed_prompts[:1]  # one sequence: the draws before the stop are the same with and without it
    base = engine.generate(prompt, SamplingParams(n=1, max_new_tokens=8, seed=7))[0]
    assert base.finish_reason == "length"
    ids = base.token_ids.tolist()
    texts = [engine.tokenizer.decode(ids[:k], skip_special_tokens=True) for k in range(len(ids) + 1)]
    choice = None
    for k in range(2, len(ids)):
        stop = texts[k][-2:]
        if len(stop) == 2 and stop.isascii() and stop.isprintable() and not any(
                texts[j].endswith(stop) for j in range(k)):
            choice = (k, stop)
            break
    assert choice is not None, f"no usable stop string in {texts[-1]!r}"
    k, stop = choice
    out = engine.generate(prompt, SamplingParams(n=1, max_new_tokens=8, seed=7, stop=("never-there", stop)))[0]
    assert out.token_ids.tolist() == ids[:k]
    assert out.finish_reason == "stop"
    assert out.text == texts[k] and out.text.endswith(stop)
    assert torch.equal(out.logprobs, base.logprobs[:k])


def test_vision_placeholders_are_never_sampled(fresh_engine, mixed_prompts, biased_head):
    model = fresh_engine.model
    suppressed = _suppressed(model)
    biased_head(model, {tok: 100.0 for tok in suppressed})
    for params in (SamplingParams(n=2, temperature=0.0, max_new_tokens=4, ignore_eos=True),
                   SamplingParams(n=4, temperature=1.0, max_new_tokens=4, seed=2, ignore_eos=True),
                   SamplingParams(n=2, temperature=1.0, top_p=0.9, top_k=5, max_new_tokens=4, seed=2,
                                  ignore_eos=True)):
        responses = fresh_engine.generate(mixed_prompts, params)
        produced = {t for r in responses for t in r.token_ids.tolist()}
        assert produced and not produced & suppressed
        assert all(r.token_ids.shape[0] == 4 for r in responses)
    # the test has teeth: without the suppression the placeholders hold the argmax
    logits = _full_logits(model, mixed_prompts, responses, fresh_engine.pad_id)
    assert set(logits.argmax(-1).flatten().tolist()) <= suppressed


# ---- weights and memory --------------------------------------------------------------------------
def test_weight_versions(fresh_engine, mixed_prompts):
    weights = {k: v.clone() for k, v in fresh_engine.model.state_dict().items()}
    params = SamplingParams(n=1, max_new_tokens=2)
    with pytest.raises(StaleWeightsError):
        fresh_engine.generate(mixed_prompts, params, weights_version=1)
    assert len(fresh_engine.generate(mixed_prompts, params, weights_version=0)) == 3
    with pytest.raises(StaleWeightsError):
        fresh_engine.update_weights(weights, version=0)  # equal: not newer
    fresh_engine.update_weights(weights, version=2)
    assert fresh_engine.weights_version == 2
    for older in (1, 2):
        with pytest.raises(StaleWeightsError):
            fresh_engine.update_weights(weights, version=older)
    assert fresh_engine.weights_version == 2
    with pytest.raises(StaleWeightsError):
        fresh_engine.generate(mixed_prompts, params, weights_version=0)
    assert len(fresh_engine.generate(mixed_prompts, params, weights_version=2)) == 3


def test_release_and_resume_memory(fresh_engine, mixed_prompts):
    params = SamplingParams(n=2, max_new_tokens=3, seed=4)
    before = fresh_engine.generate(mixed_prompts, params)
    fresh_engine.release_memory()
    with pytest.raises(RuntimeError, match="resume_memory"):
        fresh_engine.generate(mixed_prompts, params)
    fresh_engine.resume_memory()
    after = fresh_engine.generate(mixed_prompts, params)
    assert _tokens(after) == _tokens(before)


def _perturbed_state(model, seed: int = 0, scale: float = 0.05) -> dict[str, torch.Tensor]:
    """The model's state dict with noise added (tied embeddings stay tied)."""
    g = torch.Generator().manual_seed(seed)
    noise = {id(p): torch.randn(p.shape, generator=g) * scale for p in model.parameters()}
    out = {}
    for name, t in model.state_dict(keep_vars=True).items():
        out[name] = (t.detach() + noise[id(t)]) if id(t) in noise else t.detach().clone()
    return out


def test_update_weights_changes_outputs_and_equals_direct_load(fresh_engine, mixed_prompts, tiny_ckpt_qwen25,
                                                               tmp_path):
    params = SamplingParams(n=2, max_new_tokens=6, seed=21)
    before = fresh_engine.generate(mixed_prompts, params)
    new = _perturbed_state(fresh_engine.model)
    fresh_engine.update_weights(new, version=1)
    for name, tensor in fresh_engine.model.state_dict().items():
        assert torch.equal(tensor, new[name]), name
    after = fresh_engine.generate(mixed_prompts, params, weights_version=1)
    assert _tokens(after) != _tokens(before)

    # the same weights loaded from disk, as a fresh engine would load a checkpoint
    direct_dir = tmp_path / "direct"
    shutil.copytree(tiny_ckpt_qwen25, direct_dir)
    model = BuiltinRolloutEngine(str(tiny_ckpt_qwen25)).model
    model.load_state_dict(new)
    model.save_pretrained(direct_dir)
    direct = BuiltinRolloutEngine(str(direct_dir)).generate(mixed_prompts, params)
    assert _tokens(direct) == _tokens(after)
    for a, b in zip(direct, after):
        assert torch.equal(a.logprobs, b.logprobs)


def test_rejected_weight_update_leaves_engine_unchanged(fresh_engine):
    old = {k: v.clone() for k, v in fresh_engine.model.state_dict().items()}
    bad = _perturbed_state(fresh_engine.model)
    del bad["model.language_model.norm.weight"]
    with pytest.raises(ValueError, match="norm.weight"):
        fresh_engine.update_weights(bad, version=1)
    assert fresh_engine.weights_version == 0
    for name, tensor in fresh_engine.model.state_dict().items():
        assert torch.equal(tensor, old[name]), f"{name} changed by a rejected update"


def test_stream_reports_decode_progress_under_ignore_eos(fresh_engine, mixed_prompts):
    """progress_every=k: every k decode steps (not after the last) one DecodeProgress per group
    still decoding, holding the first tokens of its responses; the responses are unchanged.
    Without ignore_eos (responses of different lengths) it is refused."""
    params = SamplingParams(n=2, max_new_tokens=10, seed=5, ignore_eos=True)
    items = list(fresh_engine.generate_stream(mixed_prompts, params, progress_every=4))
    progress = [p for item in items for p in item if isinstance(p, DecodeProgress)]
    responses = sorted((r for item in items for r in item if not isinstance(r, DecodeProgress)),
                       key=lambda r: r.prompt_index)
    assert _tokens(responses) == _tokens(fresh_engine.generate(mixed_prompts, params))
    assert sorted((p.prompt_index, p.token_ids.shape[1]) for p in progress) == sorted(
        (g, t) for g in range(3) for t in (4, 8))
    for p in progress:
        rows = [r for r in responses if r.prompt_index == p.prompt_index]
        assert torch.equal(p.token_ids, torch.stack([r.token_ids[: p.token_ids.shape[1]] for r in rows]))
    with pytest.raises(ValueError, match="needs ignore_eos"):
        list(fresh_engine.generate_stream(mixed_prompts, replace(params, ignore_eos=False), progress_every=4))
