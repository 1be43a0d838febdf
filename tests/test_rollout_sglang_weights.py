"""The SGLang weight payload, without SGLang: names and shapes against SGLang 0.5.23's own parameter
list (pinned in tests/data, derived from its model code), shard values, the share-plan path, and the
IPC round trip between two processes with torch's reductions (what SGLang's
MultiprocessingSerializer uses)."""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import multiprocessing
import pickle
from pathlib import Path

import pytest
import torch

from rollplex_train.config import ModelConfig
from rollplex_train.models.arch import load_hf_config, parameter_shapes
from rollplex_train.models import layouts
from rollplex_train.models.layouts import Dims, build_layout, reference_shard
from rollplex_train.rollout.sglang_weights import (
    build_update_calls,
    buckets,
    check_rank_tensors,
    expected_params,
    per_rank_entries,
    sglang_layout,
    shard_from_plan,
    shard_state_dict,
)
from rollplex_train.sharing.plan import plan_sharing

DATA = Path(__file__).parent / "data"
PINNED = json.loads((DATA / "sglang_0.5.23_qwen2_5_vl_params.json").read_text())


def _derive_module():
    spec = importlib.util.spec_from_file_location("derive_sglang", DATA / "derive_sglang_qwen2_5_vl_params.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def qwen7b():
    cfg = load_hf_config(ModelConfig(hf_config="conf/hf/qwen2_5_vl_7b_instruct.json"))
    return parameter_shapes(cfg), Dims.from_hf_config(cfg)


@pytest.fixture(scope="module")
def tiny_full(tiny_ckpt_qwen25):
    from rollplex_train.models.loading import load_model

    model = load_model(tiny_ckpt_qwen25)
    return model, {n: p.detach() for n, p in model.named_parameters()}


def _covered_rows(layout, name: str, size: int, dim: int) -> set[int]:
    rows = set()
    for rank in layout.ranks:
        for spec in rank.values():
            if spec.dim == dim:
                for b in spec.blocks:
                    if b.source == name:
                        rows.update(range(b.start, min(b.stop, size)))
    return rows


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_payload_names_and_shapes_are_sglang_0_5_23s_for_qwen25vl_7b(qwen7b, tp):
    assert PINNED["sglang_version"] == "0.5.23"
    shapes, dims = qwen7b
    layout = sglang_layout(shapes, dims, tp)
    pinned = {n: tuple(s) for n, s in PINNED["tp"][str(tp)].items()}
    for rank in range(tp):
        assert expected_params(layout, rank) == pinned  # every name, every shape, nothing extra
    # nothing dropped: every row of every HF tensor is on some rank (along its split dim)
    for name, shape in shapes.items():
        dims_used = {s.dim for r in layout.ranks for s in r.values() for b in s.blocks if b.source == name}
        assert dims_used, f"{name} is in no SGLang parameter"
        for dim in dims_used:
            assert _covered_rows(layout, name, shape[dim], dim) == set(range(shape[dim])), name


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tiny_model_follows_sglangs_rules_with_tied_head_and_replicated_kv_heads(tiny_full, tp):
    model, full = tiny_full
    cfg = model.config
    text, vision = cfg.text_config.to_dict(), cfg.vision_config.to_dict()
    assert cfg.tie_word_embeddings and text["num_key_value_heads"] == 2  # tp 4 replicates KV heads
    want = {n: tuple(s) for n, s in _derive_module().sglang_params(text, vision, True, tp).items()}
    layout = sglang_layout({n: tuple(t.shape) for n, t in full.items()}, Dims.from_hf_config(cfg), tp)
    assert expected_params(layout, tp - 1) == want


@pytest.mark.parametrize("vocab,tp,rows", [(151936, 1, 151936), (151936, 2, 151936), (151936, 8, 151936),
                                           (151936, 3, 152064), (1000, 3, 1152), (1000, 2, 1024), (1025, 5, 1280)])
def test_vocabulary_is_padded_as_sglang_pads_it_at_odd_tp(vocab, tp, rows):
    """SGLang pads to a multiple of 64, or of 64 x TP when TP does not divide that (0.5.23
    VocabParallelEmbedding.__init__); the test data's derivation follows the same line independently."""
    text = {"hidden_size": 8, "num_attention_heads": tp, "num_key_value_heads": tp, "intermediate_size": tp,
            "vocab_size": vocab, "num_hidden_layers": 0}
    vision = {"hidden_size": 2 * tp, "num_heads": tp, "intermediate_size": tp, "depth": 0, "out_hidden_size": 8,
              "spatial_merge_size": 2, "patch_size": 14, "temporal_patch_size": 2}
    derived = _derive_module().sglang_params(text, vision, True, tp)["model.embed_tokens.weight"]
    layout = build_layout("sglang", tp, {"model.language_model.embed_tokens.weight": (vocab, 8)}, Dims(tp, tp, 8, tp, 2))
    specs = [next(iter(rank.values())) for rank in layout.ranks]
    assert [s.shape for s in specs] == [(rows // tp, 8)] * tp and derived == [rows // tp, 8]
    assert [(b.start, b.stop) for s in specs for b in s.blocks] == [(i * rows // tp, (i + 1) * rows // tp)
                                                                     for i in range(tp)]
    assert layouts.sglang_padded_vocab(vocab, tp) == rows


def test_shards_hold_the_right_rows(tiny_full):
    model, full = tiny_full
    cfg = model.config.text_config
    hd, nq, nkv = cfg.hidden_size // cfg.num_attention_heads, cfg.num_attention_heads, cfg.num_key_value_heads
    layout = sglang_layout({n: tuple(t.shape) for n, t in full.items()}, Dims.from_hf_config(model.config), 2)
    ranks = [shard_state_dict(full, layout, r) for r in range(2)]
    pre = "model.language_model.layers.1."
    q, k, v = (full[pre + f"self_attn.{x}_proj.weight"] for x in "qkv")
    # rank 1: query heads 2..3, KV head 1 (nq=4, nkv=2): [q_1; k_1; v_1] as QKVParallelLinear holds it
    want = torch.cat([q[2 * hd:4 * hd], k[hd:2 * hd], v[hd:2 * hd]])
    assert torch.equal(ranks[1]["model.layers.1.self_attn.qkv_proj.weight"], want)
    inter = cfg.intermediate_size
    gate, up = full[pre + "mlp.gate_proj.weight"], full[pre + "mlp.up_proj.weight"]
    assert torch.equal(ranks[0]["model.layers.1.mlp.gate_up_proj.weight"], torch.cat([gate[:inter // 2], up[:inter // 2]]))
    down = full[pre + "mlp.down_proj.weight"]
    assert torch.equal(torch.cat([r["model.layers.1.mlp.down_proj.weight"] for r in ranks], 1), down)
    embed = full["model.language_model.embed_tokens.weight"]
    padded = torch.cat([r["model.embed_tokens.weight"] for r in ranks])
    assert torch.equal(padded[: embed.shape[0]], embed) and not padded[embed.shape[0]:].any()
    assert nq // 2 * hd + 2 * (nkv // 2) * hd == ranks[0]["model.layers.1.self_attn.qkv_proj.bias"].shape[0]
    for rank, tensors in enumerate(ranks):
        check_rank_tensors(tensors, expected_params(layout, rank), rank)
    with pytest.raises(ValueError, match="missing=.*qkv_proj.weight"):
        broken = dict(ranks[0])
        broken.pop("model.layers.1.self_attn.qkv_proj.weight")
        check_rank_tensors(broken, expected_params(layout, 0), 0)
    with pytest.raises(ValueError, match="wrong_shape=.*norm.weight"):
        check_rank_tensors({**ranks[0], "model.norm.weight": torch.zeros(3)}, expected_params(layout, 0), 0)
    with pytest.raises(ValueError, match="lack 1 HF tensors"):
        shard_state_dict({n: t for n, t in full.items() if n != pre + "input_layernorm.weight"}, layout, 0)
    with pytest.raises(ValueError, match=r"wrong_shape \['model.language_model.norm.weight \(3,\)"):
        shard_state_dict({**full, "model.language_model.norm.weight": torch.zeros(3)}, layout, 0)
    with pytest.raises(ValueError, match=r"unknown \['extra.weight'\]"):
        shard_state_dict({**full, "extra.weight": torch.zeros(3)}, layout, 0)


@pytest.mark.parametrize("t,r", [(1, 2), (2, 2), (2, 4), (1, 4), (2, 1)])
def test_share_plan_payload_equals_the_sharded_state_dict(tiny_full, t, r):
    model, full = tiny_full
    shapes = {n: tuple(x.shape) for n, x in full.items()}
    dims = Dims.from_hf_config(model.config)
    plan = plan_sharing(shapes, dims, t=t, r=r, itemsize=4)
    train = build_layout("megatron", t, shapes, dims, vocab_divisible_by=plan.vocab_divisible_by)
    local = [{n: reference_shard(s, full).contiguous() for n, s in rank.items()} for rank in train.ranks]
    from rollplex_train.sharing.materialize import RankFetcher

    fetch = RankFetcher(train, local)
    layout = sglang_layout(shapes, dims, r)
    for train_rank, rollout_rank in plan.devices:
        _, tensors = shard_from_plan(plan, train_rank, rollout_rank, local[train_rank], fetch)
        want = shard_state_dict(full, layout, rollout_rank)
        assert tensors.keys() == want.keys()
        for name in want:
            assert torch.equal(tensors[name], want[name]), (t, r, name)
    split = plan_sharing(shapes, dims, t=t, r=r, itemsize=4, split_qkv=True)
    with pytest.raises(ValueError, match="not SGLang parameters"):
        shard_from_plan(split, *split.devices[0], local[split.devices[0][0]], fetch)


# ---- IPC round trip between two processes -----------------------------------------------------------

ALLOWED = {  # what a payload may reference: torch's rebuild functions and plain containers
    ("torch.multiprocessing.reductions", "rebuild_tensor"),
    ("torch.multiprocessing.reductions", "rebuild_storage_fd"),
    ("torch.multiprocessing.reductions", "rebuild_storage_filename"),
    ("torch.multiprocessing.reductions", "rebuild_typed_storage"),
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),
    ("multiprocessing.resource_sharer", "DupFd"),
    ("torch", "Tensor"), ("torch", "float32"), ("torch", "bfloat16"), ("torch", "float16"), ("torch", "Size"),
    ("torch.storage", "UntypedStorage"), ("torch", "UntypedStorage"),
}


class _AllowListUnpickler(pickle.Unpickler):
    """Like SGLang 0.5.23's ``SafeUnpickler`` (``srt/utils/common.py``): anything outside torch's
    rebuild functions is refused, so a payload can carry no other class."""

    def find_class(self, module, name):
        if (module, name) not in ALLOWED:
            raise RuntimeError(f"blocked global {module}.{name}")
        return super().find_class(module, name)


def _receive(entries: list[tuple[str, list[bytes]]], rank: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """In the receiving process: load rank ``rank``'s tensors, digest them (shape, sha256)."""
    out = {}
    for name, values in entries:
        tensor = _AllowListUnpickler(io.BytesIO(values[rank])).load()
        assert tensor.untyped_storage().is_shared()  # mapped, not copied
        out[name] = (tuple(tensor.shape), hashlib.sha256(tensor.contiguous().numpy().tobytes()).hexdigest())
    return out


def test_payload_round_trip_between_processes(tiny_full):
    model, full = tiny_full
    tp = 2
    layout = sglang_layout({n: tuple(t.shape) for n, t in full.items()}, Dims.from_hf_config(model.config), tp)
    per_rank = [shard_state_dict(full, layout, r) for r in range(tp)]
    per_rank = [{n: t.contiguous().share_memory_() for n, t in ranks.items()} for ranks in per_rank]
    entries = per_rank_entries(per_rank)
    data_bytes = sum(t.numel() * t.element_size() for t in per_rank[0].values())
    assert sum(len(v[0]) for _, v in entries) < data_bytes / 10  # handles, not data
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:  # the sender (this process) stays alive while the receiver maps
        got = [pool.apply(_receive, (entries, rank)) for rank in range(tp)]
    for rank in range(tp):
        want = {n: (tuple(t.shape), hashlib.sha256(t.numpy().tobytes()).hexdigest()) for n, t in per_rank[rank].items()}
        assert got[rank] == want
    assert got[0] != got[1]  # each rank got its own shards


def test_update_calls_bucket_every_parameter_once(tiny_full):
    model, full = tiny_full
    layout = sglang_layout({n: tuple(t.shape) for n, t in full.items()}, Dims.from_hf_config(model.config), 2)
    per_rank = [shard_state_dict(full, layout, r) for r in range(2)]
    limit = 64 * 1024
    calls = build_update_calls(per_rank, wrap=lambda values: ("local", len(values)), bucket_bytes=limit)
    names = [n for call in calls for n, _ in call]
    assert names == list(per_rank[0]) and all(v == ("local", 2) for call in calls for _, v in call)
    sizes = {n: t.numel() * t.element_size() for n, t in per_rank[0].items()}
    for bucket in buckets(per_rank, limit):
        assert len(bucket) == 1 or sum(sizes[n] for n in bucket) <= limit
    assert len(calls) > 1
    with pytest.raises(ValueError, match="other parameters"):
        per_rank_entries([per_rank[0], {"x": torch.zeros(1)}])


# ---- the full-tensor alternative (FlattenedTensorBucket + SGLang's load_weights) ---------------------

def test_every_full_hf_tensor_lands_on_an_sglang_parameter_through_load_weights(qwen7b):
    from rollplex_train.rollout.sglang_weights import check_full_tensors, load_weights_target, sglang_name

    shapes, dims = qwen7b
    layout = sglang_layout(shapes, dims, 2)
    full = {n: torch.empty(s, device="meta") for n, s in shapes.items()}
    assert check_full_tensors(full, layout) == list(shapes)
    targets = {load_weights_target(sglang_name(n)) for n in shapes}
    assert targets == set(PINNED["tp"]["2"])  # SGLang's own list: every parameter, nothing else
    assert load_weights_target("visual.blocks.3.attn.qkv.bias") == "visual.blocks.3.attn.qkv_proj.bias"
    assert load_weights_target("visual.blocks.3.mlp.up_proj.weight") == "visual.blocks.3.mlp.gate_up_proj.weight"
    assert load_weights_target("model.layers.2.self_attn.k_proj.bias") == "model.layers.2.self_attn.qkv_proj.bias"
    with pytest.raises(ValueError, match=r"no tensor for \['model.norm.weight'\]"):
        check_full_tensors({n: t for n, t in full.items() if n != "model.language_model.norm.weight"}, layout)
    with pytest.raises(ValueError, match=r"unknown \['model.language_model.extra.weight'\]"):
        check_full_tensors({**full, "model.language_model.extra.weight": torch.empty(1, device="meta")}, layout)


def test_flattened_bucket_round_trip_keeps_names_dtypes_and_values():
    from rollplex_train.rollout.sglang_weights import flatten_bucket, unflatten_bucket

    named = [("a", torch.randn(3, 5)), ("b", torch.arange(7, dtype=torch.int64)),
             ("c", torch.randn(2, 3).to(torch.bfloat16).t())]  # non-contiguous bf16
    flat, metas = flatten_bucket(named)
    assert flat.dtype == torch.uint8
    assert [(m["start_idx"], m["end_idx"]) for m in metas] == [(0, 60), (64, 120), (128, 140)]  # 16-byte starts
    back = unflatten_bucket(flat, metas)
    assert [n for n, _ in back] == ["a", "b", "c"]
    for (_, want), (_, got) in zip(named, back):
        assert got.dtype == want.dtype and torch.equal(got, want)
