"""Share planner + materializer over random weights, all (t, r) in {1,2,4,8}^2, simulated ranks."""

from __future__ import annotations

import functools
import itertools
import math

import pytest
import torch

from rollplex_train.models.arch import parameter_shapes
from rollplex_train.models.layouts import Block, Dims, build_layout, reference_shard
from rollplex_train.sharing.materialize import Materializer, RankFetcher
from rollplex_train.sharing.plan import best_mapping, locate, megatron_vocab_divisor, plan_sharing

DEGREES = (1, 2, 4, 8)


@functools.lru_cache(maxsize=None)
def small_model(kv_heads: int):
    """A Qwen2.5-VL-shaped config: LLM hidden 64, 8 heads, ``kv_heads`` KV heads, MLP 96, vocab
    128; vision hidden 64, 8 heads, MLP 60 (padded to 64 by SGLang and megatron)."""
    from transformers import Qwen2_5_VLConfig

    cfg = Qwen2_5_VLConfig(
        text_config=dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
                         num_key_value_heads=kv_heads, vocab_size=128, bos_token_id=0, eos_token_id=1),
        vision_config=dict(depth=2, hidden_size=64, intermediate_size=60, num_heads=8, out_hidden_size=64,
                           fullatt_block_indexes=[1]),
    )
    shapes = parameter_shapes(cfg)
    gen = torch.Generator().manual_seed(kv_heads)
    full = {n: torch.randn(s, generator=gen) for n, s in shapes.items()}
    return shapes, Dims.from_hf_config(cfg), full


def _feasible(kv: int, t: int, r: int, heads: int = 8) -> bool:
    return kv % t == 0 and heads % r == 0 and (kv % r == 0 if kv >= r else r % kv == 0)


def _train_shards(layout, full):
    return [{n: reference_shard(s, full).contiguous() for n, s in rank.items()} for rank in layout.ranks]


@pytest.mark.parametrize("kv", [2, 1, 8])
@pytest.mark.parametrize("options", [False, True])
def test_every_rollout_shard_equals_reference_and_views_alias(kv, options):
    shapes, dims, full = small_model(kv)
    model_bytes = sum(math.prod(s) for s in shapes.values()) * 4
    checked = 0
    for t, r in itertools.product(DEGREES, DEGREES):
        if not _feasible(kv, t, r):
            with pytest.raises(ValueError, match="does not divide"):
                plan_sharing(shapes, dims, t=t, r=r, split_qkv=options, split_gate_up=options, itemsize=4)
            continue
        plan = plan_sharing(shapes, dims, t=t, r=r, split_qkv=options, split_gate_up=options, itemsize=4)
        shards = _train_shards(plan.train, full)
        fetch = RankFetcher(plan.train, shards)
        assert len(plan.devices) == math.lcm(t, r)
        assert sorted(j for _, j in plan.devices) == sorted(list(range(r)) * (math.lcm(t, r) // r))
        total = 0
        for i, j in plan.devices:
            mat = Materializer(plan.tensors[(i, j)], shards[i], fetch)
            assert set(mat.tensors) == set(plan.rollout.ranks[j])
            for name, tensor in mat.tensors.items():
                tp = plan.tensors[(i, j)][name]
                torch.testing.assert_close(tensor, reference_shard(tp.spec, full), rtol=0, atol=0)
                total += tensor.numel() * 4
                if tp.action in ("view", "strided_view"):
                    src = shards[i][tp.view[0]]
                    assert tensor.untyped_storage().data_ptr() == src.untyped_storage().data_ptr()
                    assert tensor.is_contiguous() == (tp.action == "view")
                else:
                    assert all(tensor.untyped_storage().data_ptr() != s.untyped_storage().data_ptr()
                               for s in shards[i].values())
            assert mat.view_bytes + mat.rebuild_bytes == sum(tp.nbytes for tp in plan.tensors[(i, j)].values())
            checked += 1
        assert total == plan.rollout_bytes
        assert plan.rollout_bytes == sum(plan.totals[a] for a in ("view", "strided_view", "local_rebuild", "gather"))
        # one rollout engine's real (non-padding) rows cover every HF element exactly once, KV
        # replication and replicated tensors aside: the distinct elements add up to the model
        covered: dict[str, set] = {n: set() for n in shapes}
        for j in range(r):
            for spec in plan.rollout.ranks[j].values():
                for b in spec.blocks:
                    covered[b.source].update(range(b.start, min(b.stop, shapes[b.source][spec.dim])))
        distinct = sum(len(rows) * math.prod(shapes[n]) // shapes[n][_dim(plan, n)] for n, rows in covered.items())
        assert distinct * 4 == model_bytes
        if options and r >= t:
            assert plan.shared_fraction() == 1.0, (t, r, plan.totals)
        if t > r:
            assert plan.totals["gather"] > 0 and plan.totals["remote"] > 0
    assert checked > 0


def _dim(plan, hf_name: str) -> int:
    for spec in plan.rollout.ranks[0].values():
        if any(b.source == hf_name for b in spec.blocks):
            return spec.dim
    raise AssertionError(hf_name)


def test_views_follow_in_place_training_updates_and_rebuilds_follow_sync():
    shapes, dims, full = small_model(2)
    plan = plan_sharing(shapes, dims, t=2, r=2, itemsize=4)
    shards = _train_shards(plan.train, full)
    mat = Materializer(plan.tensors[(0, 0)], shards[0])
    ptrs = {n: t.untyped_storage().data_ptr() for n, t in mat.tensors.items()}
    for t in shards[0].values():
        t.mul_(2.0)  # an in-place optimizer step
    for name, tp in plan.tensors[(0, 0)].items():
        expect = reference_shard(tp.spec, full) * (2.0 if tp.view else 1.0)
        torch.testing.assert_close(mat.tensors[name], expect, rtol=0, atol=0)
    mat.sync()
    for name, tp in plan.tensors[(0, 0)].items():
        torch.testing.assert_close(mat.tensors[name], reference_shard(tp.spec, full) * 2.0, rtol=0, atol=0)
    assert ptrs == {n: t.untyped_storage().data_ptr() for n, t in mat.tensors.items()}  # buffers persist


def test_decisions_on_known_cases():
    shapes, dims, _ = small_model(2)
    qkv = "model.language_model.layers.0.self_attn.qkv_proj.weight"
    # t = r = 2, kv 2: one KV group per rank, megatron [q_g, k_g, v_g] == sglang [q_i, k_i, v_i]
    plan = plan_sharing(shapes, dims, t=2, r=2, itemsize=4)
    assert plan.tensors[(1, 1)][qkv].action == "view"
    # t = r = 1: two groups on one rank, [q0 k0 v0 q1 k1 v1] != [q0 q1 k0 k1 v0 v1]
    plan = plan_sharing(shapes, dims, t=1, r=1, itemsize=4)
    assert plan.tensors[(0, 0)][qkv].action == "local_rebuild"
    o_proj = "model.language_model.layers.0.self_attn.o_proj.weight"
    plan = plan_sharing(shapes, dims, t=1, r=2, itemsize=4)
    assert plan.tensors[(0, 1)][o_proj].action == "strided_view"
    assert plan.tensors[(0, 1)][o_proj].view[2] == (64, 1)  # row-parallel: columns 32..64
    # split_qkv from two groups: q is a (2, 32, 64) view with a stride of one whole group (48 rows)
    plan = plan_sharing(shapes, dims, t=1, r=1, split_qkv=True, itemsize=4)
    q = plan.tensors[(0, 0)]["model.language_model.layers.0.self_attn.q_proj.weight"]
    assert (q.action, q.view[1], q.view[2]) == ("strided_view", (2, 32, 64), (48 * 64, 64, 1))
    # t = 2 -> r = 1: half of every split tensor is on the other device
    plan = plan_sharing(shapes, dims, t=2, r=1, itemsize=4)
    gu = plan.tensors[(0, 0)]["model.language_model.layers.0.mlp.gate_up_proj.weight"]
    assert (gu.action, gu.remote_bytes) == ("gather", gu.nbytes // 2)


def test_rank_mapping_puts_rollout_ranks_on_their_training_shard():
    # rollout rank j holds 1/4 of the heads; training rank i of 2 holds heads of j in {2i, 2i+1}
    overlap = [[10 if j // 2 == i else 0 for i in range(2)] for j in range(4)]
    assert sorted(best_mapping(overlap, 2, 4)) == [(0, 0), (0, 1), (1, 2), (1, 3)]
    with pytest.raises(ValueError, match="lcm"):
        best_mapping([[0] * 9] * 32, 9, 32)


def test_locate_splits_local_remote_and_padding_runs():
    index = {"w": [(0, 4, "a", 0), (8, 12, "b", 2)]}
    pieces = locate(Block("w", 2, 14), index, hf_rows=13)
    assert [(p.block.start, p.block.stop, p.tensor, p.pos, p.remote) for p in pieces] == [
        (2, 4, "a", 2, False), (4, 8, None, 0, True), (8, 12, "b", 2, False),
        (12, 13, None, 0, True), (13, 14, None, 0, False)]


def test_megatron_vocab_padding_and_the_aligned_divisor():
    assert megatron_vocab_divisor(152064, 8) == 64 and megatron_vocab_divisor(152064, 4) == 128
    shapes, dims, _ = small_model(8)
    big = dict(shapes, **{"model.language_model.embed_tokens.weight": (152064, 64), "lm_head.weight": (152064, 64)})
    default = build_layout("megatron", 8, big, dims, vocab_divisible_by=128)
    spec = default.ranks[7]["model.language_model.word_embeddings.weight"]
    assert spec.shape == (19072, 64) and spec.blocks[0].stop == 152576  # 512 padding rows
    aligned = plan_sharing(big, dims, t=8, r=8, itemsize=2)
    assert aligned.vocab_divisible_by == 64
    assert aligned.tensors[(7, 7)]["lm_head.weight"].action == "view"
    shifted = plan_sharing(big, dims, t=8, r=8, itemsize=2, vocab_divisible_by=128)
    assert shifted.tensors[(7, 7)]["lm_head.weight"].action == "gather"
