"""The Megatron backend (``actor.backend=megatron``) on the tiny Qwen2.5-VL, gloo ranks on CPU.

Conversion and the error paths run in this process; everything that needs megatron's parallel state
runs in fresh processes (``training/megatron/check.py::run_ranks``): one pair at TP=2 and one process
at TP=1, each doing the HF comparison of ``scripts/check_megatron.py`` and two PPO updates compared
with the torch backend (full sequences and shared prefix), a checkpoint resume and the rollout tensors.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch

from rollplex_train.config import ActorConfig, AlgorithmConfig, ClusterConfig, ModelConfig
from rollplex_train.data.types import TrainBatch
from rollplex_train.models.layouts import Dims, build_layout
from rollplex_train.models.loading import load_model
from rollplex_train.models.megatron_convert import gpt_key, hf_to_megatron, megatron_layout, megatron_to_hf

pytest.importorskip("megatron.core", reason="the megatron extra is not installed")
pytestmark = pytest.mark.megatron

LR = 1e-3
ACTOR = dict(lr=LR, micro_batch_size=4, ppo_mini_batch_size=2, lr_warmup_steps=2, grad_clip=0.05)


def _configs(ckpt, shared_prefix: bool):
    return dict(model=ModelConfig(path=str(ckpt), shared_prefix=shared_prefix), actor=ActorConfig(**ACTOR),
                algorithm=AlgorithmConfig(use_kl_loss=True, kl_coef=0.1), seed=1)


def _with(batch: TrainBatch, **fields) -> TrainBatch:
    data = {k: getattr(batch, k) for k in ("prompts", "group_index", "response_ids", "response_mask",
                                            "advantages", "old_logprobs", "ref_logprobs", "rollout_logprobs")}
    data.update(fields)
    return TrainBatch(**data)


def _ppo(engine, batch: TrainBatch, shared_prefix: bool, checkpoint: Path | None = None) -> dict:
    """old/ref log-probs, two updates (checkpoint after the first, resumed second update)."""
    if shared_prefix:  # the planner's hook: prefixes encoded ahead of the suffix passes
        engine.precompute_prefixes(batch.prompts, ["ref", "old"], engine.weights_version)
    old, _ = engine.compute_log_probs(batch, "actor")
    ref, _ = engine.compute_log_probs(batch, "ref")
    out = {"old": old, "ref": ref, "prefixes_left": len(engine.prefixes)}
    batch = _with(batch, old_logprobs=old, ref_logprobs=ref)
    out["m1"] = engine.update_actor(batch)
    if checkpoint is not None:
        engine.save_checkpoint(checkpoint)
        # memory.offload_optimizer's round trip: the resumed update below must still repeat m2 exactly
        adam = lambda: [v for st in engine.backend.optimizer.optimizer.state.values()  # noqa: E731
                        for v in st.values() if v.dim()]
        out["adam_bytes"] = sum(v.numel() * v.element_size() for v in adam())
        out["offloaded"] = engine.offload_states(("optimizer",))
        out["held_while_offloaded"] = sum(v.numel() * v.element_size() for v in adam())
        out["prefetched"] = engine.prefetch_states(("optimizer",))
    out["m2"] = engine.update_actor(batch)
    out["state"] = engine.backend.hf_state() if hasattr(engine.backend, "hf_state") else {
        n: p.detach().clone() for n, p in engine.actor.named_parameters()}
    if checkpoint is not None:
        engine.load_checkpoint(checkpoint)
        out["m2_resumed"] = engine.update_actor(batch)
        out["state_resumed"] = engine.backend.hf_state()
    return out


def _rank_body(rank: int, world: int, ckpt: str, batch: TrainBatch, out_dir: str) -> dict:
    """Runs in each spawned rank (TP = world)."""
    from rollplex_train.parallel import ParallelLayout
    from rollplex_train.training.base import create_train_engine
    from rollplex_train.training.megatron.check import check_rank

    out = {"check": check_rank(rank, world, ckpt, batch.prompts, out_dir)}
    layout = ParallelLayout(devices_per_node=world, train_tp=world)
    for shared in (False, True):
        engine = create_train_engine("megatron", **_configs(ckpt, shared), layout=layout, rank=rank)
        out[f"ppo_shared={shared}"] = _ppo(engine, batch, shared, Path(out_dir) / f"ckpt-{shared}")
    params = {p.untyped_storage().data_ptr() for p in engine.actor.parameters()}
    sglang = engine.backend.rollout_tensors("sglang", 2)
    out["sglang"] = {n: t.clone() for n, t in sglang.items()}
    out["sglang_views"] = sorted(n for n, t in sglang.items() if t.untyped_storage().data_ptr() in params)
    out["hf_rollout"] = {n: t.clone() for n, t in engine.rollout_weights().items()}
    out["digest"] = engine.weights_digest()
    out["share"] = _share(engine, _with(batch, old_logprobs=out["ppo_shared=True"]["old"],
                                        ref_logprobs=out["ppo_shared=True"]["ref"]))
    return out


def _share(engine, batch: TrainBatch) -> dict:
    """The in-place hand-over to the SGLang-layout rollout rank at r = 2 on this rank's device, mapped
    from its IPC payload (in this process: torch maps a storage it already holds to itself), across
    one update: what is a view, the stale read, the rebuilt tensors before and after the publish."""
    from rollplex_train.sharing.ipc import import_handles
    from rollplex_train.versioning import StaleWeightsError

    export = engine.export_shared_weights(rollout_kind="sglang", rollout_tp=2)
    mapped = import_handles(export["payload"])
    params = {p.untyped_storage().data_ptr() for p in engine.actor.parameters()}
    out = {"export": {k: v for k, v in export.items() if k != "payload"},
           "views": sorted(n for n, t in mapped.tensors.items() if t.untyped_storage().data_ptr() in params),
           "before": {n: t.clone() for n, t in mapped.tensors.items()}, "state_before": engine.backend.hf_state(),
           "fresh_rollout_tensors": {n: t.clone() for n, t in engine.backend.rollout_tensors("sglang", 2).items()}}
    mapped.check(engine.weights_version)
    engine.update_actor(batch)
    try:
        mapped.check(engine.weights_version)
    except StaleWeightsError as err:
        out["stale"] = str(err)
    out["views_after_update"] = {n: mapped.tensors[n].clone() for n in out["views"]}
    out["published"] = engine.publish_weights(engine.weights_version)
    mapped.check(engine.weights_version)
    out["after"] = {n: t.clone() for n, t in mapped.tensors.items()}
    out["state_after"] = engine.backend.hf_state()
    mapped.close()
    return out


@pytest.fixture(scope="module")
def ppo_batch(rollout_batch_small) -> TrainBatch:
    return rollout_batch_small


@pytest.fixture(scope="module")
def rollout_batch_small(tiny_ckpt_qwen25, mixed_prompts) -> TrainBatch:
    """6 responses (56x56 image, 112x112 image, video; n=2) of varied lengths, random advantages."""
    from rollplex_train.rollout.base import SamplingParams
    from rollplex_train.rollout.builtin import BuiltinRolloutEngine
    from rollplex_train.runtime.batching import to_train_batch

    engine = BuiltinRolloutEngine(str(tiny_ckpt_qwen25))
    responses = engine.generate(mixed_prompts, SamplingParams(n=2, max_new_tokens=5, seed=5))
    batch = to_train_batch(mixed_prompts, responses, engine.pad_id)
    keep = torch.tensor([5, 2, 4, 1, 3, 5])
    cut = torch.arange(5).view(1, -1) >= keep.view(-1, 1)
    batch.response_ids[cut] = engine.pad_id
    batch.response_mask[cut] = 0.0
    g = torch.Generator().manual_seed(0)
    batch.advantages = torch.randn(batch.response_mask.shape, generator=g) * batch.response_mask
    return batch


@pytest.fixture(scope="module")
def torch_reference(tiny_ckpt_qwen25, ppo_batch) -> dict:
    from rollplex_train.training.torch_engine import TorchTrainEngine

    return {shared: _ppo(TorchTrainEngine(**_configs(tiny_ckpt_qwen25, shared)), ppo_batch, shared)
            for shared in (False, True)}


@pytest.fixture(scope="module", params=[2, 1], ids=["tp2", "tp1"])
def ranks(request, tiny_ckpt_qwen25, ppo_batch, tmp_path_factory) -> dict:
    from rollplex_train.training.megatron.check import run_ranks

    out = run_ranks(_rank_body, request.param, str(tiny_ckpt_qwen25), ppo_batch,
                    str(tmp_path_factory.mktemp(f"megatron-tp{request.param}")))
    out["tp"] = request.param
    return out


def _backend_plan(shapes, dims, t: int, r: int):
    """The share plan from the Megatron backend's layout (the vocabulary divisor ``build_model``
    picks) to SGLang's at ``r``, 4-byte elements."""
    from rollplex_train.sharing.plan import megatron_vocab_divisor, plan_sharing

    vocab = shapes["model.language_model.embed_tokens.weight"][0]
    return plan_sharing(shapes, dims, t=t, r=r, itemsize=4,
                        train_layout=megatron_layout(shapes, dims, t, megatron_vocab_divisor(vocab, t)))


# ---- conversion (this process) ---------------------------------------------------------------------
@pytest.mark.parametrize("tp", [1, 2])
def test_conversion_round_trip_is_exact_and_pads_vocab(tiny_ckpt_qwen25, tp):
    hf = load_model(tiny_ckpt_qwen25)
    full = {n: p.detach() for n, p in hf.named_parameters()}
    shapes = {n: tuple(t.shape) for n, t in full.items()}
    layout = megatron_layout(shapes, Dims.from_hf_config(hf.config), tp, 128)
    ranks = [hf_to_megatron(full, layout, i) for i in range(tp)]
    back = megatron_to_hf(ranks, layout)
    lm = {n for n in full if not n.startswith("model.visual.")}
    assert set(back) == lm
    for name in lm:
        assert torch.equal(back[name], full[name]), name
    vocab = full["model.language_model.embed_tokens.weight"]
    last = ranks[-1]["embedding.word_embeddings.weight"]
    padded = -(-vocab.shape[0] // (128 * tp)) * 128 * tp
    assert last.shape[0] * tp == padded
    assert torch.count_nonzero(last[vocab.shape[0] - (tp - 1) * last.shape[0]:]) == 0  # padding rows are zero
    # qkv per KV group (megatron attention.py::get_query_key_value_tensors): q heads of group 0, k0, v0, ...
    qkv = ranks[0]["decoder.layers.0.self_attention.linear_qkv.weight"]
    d = hf.config.get_text_config().hidden_size // hf.config.get_text_config().num_attention_heads
    q = full["model.language_model.layers.0.self_attn.q_proj.weight"]
    k = full["model.language_model.layers.0.self_attn.k_proj.weight"]
    assert torch.equal(qkv[: 2 * d], q[: 2 * d]) and torch.equal(qkv[2 * d: 3 * d], k[:d])


def test_gpt_keys_follow_the_local_and_te_specs():
    name = "model.language_model.layers.3.input_layernorm.weight"
    assert gpt_key(name) == "decoder.layers.3.input_layernorm.weight"
    assert gpt_key(name, te_names=True) == "decoder.layers.3.self_attention.linear_qkv.layer_norm_weight"
    with pytest.raises(KeyError):
        gpt_key("model.visual.blocks.0.attn.qkv.weight")


def test_missing_extra_is_one_line_error_naming_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "megatron", None)
    monkeypatch.setitem(sys.modules, "megatron.core", None)
    monkeypatch.delitem(sys.modules, "rollplex_train.training.megatron.engine", raising=False)
    from rollplex_train.registry import MissingExtraError

    with pytest.raises(MissingExtraError, match=r"actor.backend=megatron needs megatron-core, the 'megatron' extra: "
                                                r"pip install -e '.\[megatron\]'"):
        importlib.import_module("rollplex_train.training.megatron.engine")


def test_cpu_patches_refuse_a_cuda_machine(monkeypatch):
    from rollplex_train.training.megatron import cpu_patches

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RuntimeError, match="cluster.device=cuda"):
        cpu_patches.apply_cpu_patches()


def test_settings_the_engine_cannot_honour_are_named():
    from rollplex_train.config import Config, MemoryConfig, SharingConfig
    from rollplex_train.training.megatron.engine import MegatronTrainEngine

    with pytest.raises(ValueError, match="actor.pipeline_parallel_size=2"):
        MegatronTrainEngine.check_available(Config(actor=ActorConfig(backend="megatron", pipeline_parallel_size=2),
                                                   cluster=ClusterConfig(devices_per_node=2)))
    # sharing and optimizer offload are honoured now
    MegatronTrainEngine.check_available(Config(actor=ActorConfig(backend="megatron"),
                                               sharing=SharingConfig(enabled=True),
                                               memory=MemoryConfig(offload_optimizer=True)))


def test_tp_without_layout_is_refused(tiny_ckpt_qwen25):
    from rollplex_train.training.megatron.engine import MegatronTrainEngine

    cfg = _configs(tiny_ckpt_qwen25, False)
    cfg["actor"] = ActorConfig(tensor_parallel_size=2)
    with pytest.raises(ValueError, match="actor.tensor_parallel_size=2"):
        MegatronTrainEngine(**cfg)


# ---- gloo ranks --------------------------------------------------------------------------------------
@pytest.mark.slow
def test_matches_hf_and_split_prefix_is_exact(ranks):
    c = ranks["check"]
    assert c["tp"] == ranks["tp"]
    assert c["max_abs_logit_diff"] <= 1e-5
    assert c["max_abs_logprob_diff_split"] <= 1e-5
    assert c["max_rel_grad_diff"] <= 1e-4
    assert c["hf_roundtrip"] == "exact"


@pytest.mark.slow
@pytest.mark.parametrize("shared", [False, True])
def test_ppo_updates_match_the_torch_backend(ranks, torch_reference, shared):
    ours, ref = ranks[f"ppo_shared={shared}"], torch_reference[shared]
    torch.testing.assert_close(ours["old"], ref["old"], atol=1e-5, rtol=0)
    torch.testing.assert_close(ours["ref"], ref["ref"], atol=1e-5, rtol=0)
    assert ours["prefixes_left"] == 0  # every precomputed prefix was consumed
    for step in ("m1", "m2"):
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm", "actor/lr"):
            assert ours[step][key] == pytest.approx(ref[step][key], rel=1e-4, abs=1e-6), (step, key)
    assert set(ours["state"]) == set(ref["state"])
    worst = max(float((ours["state"][n] - ref["state"][n]).abs().max()) for n in ref["state"])
    assert worst <= 1e-4
    moved = max(float((ref["state"][n] - ours["state_resumed"][n]).abs().max()) for n in ref["state"])
    assert moved <= 1e-4


@pytest.mark.slow
def test_resume_repeats_the_next_update_exactly(ranks):
    for shared in (False, True):
        run = ranks[f"ppo_shared={shared}"]
        assert run["m2_resumed"] == run["m2"]
        for name, t in run["state"].items():
            assert torch.equal(run["state_resumed"][name], t), name


@pytest.mark.slow
def test_rollout_tensors_follow_the_share_plan(ranks, tiny_ckpt_qwen25):
    from rollplex_train.models.layouts import reference_shard

    state = ranks["ppo_shared=True"]["state_resumed"]  # the engine's weights when the tensors were made
    hf_rollout = ranks["hf_rollout"]
    assert set(hf_rollout) == set(state)
    for name, t in state.items():
        assert torch.equal(hf_rollout[name], t), name
    from rollplex_train.sharing.embedded import tensors_digest

    assert ranks["digest"] == tensors_digest(state)  # comparable with the rollout engine's digest

    hf = load_model(tiny_ckpt_qwen25)
    shapes = {n: tuple(p.shape) for n, p in hf.named_parameters()}
    dims = Dims.from_hf_config(hf.config)
    plan = _backend_plan(shapes, dims, ranks["tp"], r=2)
    rollout_rank = plan.devices[0][1]  # the rollout rank on training rank 0's device
    rank0 = build_layout("sglang", 2, shapes, dims).ranks[rollout_rank]
    assert set(ranks["sglang"]) == set(rank0)
    for name, spec in rank0.items():
        assert torch.equal(ranks["sglang"][name], reference_shard(spec, state)), name
    planned = {n for n, tp in plan.tensors[plan.devices[0]].items() if tp.action in ("view", "strided_view")}
    assert set(ranks["sglang_views"]) == planned  # same storage as the parameters exactly where planned
    if ranks["tp"] == 2:  # at t = r: [gate_i; up_i] is linear_fc1 of rank i, the vocabulary shards line up,
        assert "model.language_model.layers.0.mlp.gate_up_proj.weight" in planned  # the vision tower is split as
        assert "model.language_model.embed_tokens.weight" in planned  # SGLang splits it: every tensor a view
        assert planned == set(rank0)


@pytest.mark.slow
def test_optimizer_offload_round_trip_is_exact(ranks):
    run = ranks["ppo_shared=True"]
    assert run["offloaded"] == run["prefetched"] == run["adam_bytes"] > 0  # Adam m and v, every byte
    assert run["held_while_offloaded"] == 0
    assert run["m2_resumed"] == run["m2"]  # the update after the round trip = the one from the checkpoint


@pytest.mark.slow
def test_rollout_maps_views_of_the_megatron_shards_and_refuses_stale_reads(ranks, tiny_ckpt_qwen25):
    from rollplex_train.models.layouts import reference_shard

    share = ranks["share"]
    hf = load_model(tiny_ckpt_qwen25)
    shapes = {n: tuple(p.shape) for n, p in hf.named_parameters()}
    plan = _backend_plan(shapes, Dims.from_hf_config(hf.config), ranks["tp"], r=2)
    pair = plan.devices[0]
    plans = plan.tensors[pair]
    views = {n for n, tp in plans.items() if tp.action in ("view", "strided_view")}
    export = share["export"]
    assert (export["rollout_kind"], export["rollout_tp"], export["rollout_rank"]) == ("sglang", 2, pair[1])
    # the mapped views are the Megatron parameters' storage (data_ptr), exactly where the plan says view
    assert set(share["views"]) == views and views
    assert export["view_bytes"] == sum(plans[n].nbytes for n in views)
    assert export["rebuild_bytes"] == sum(tp.nbytes for n, tp in plans.items() if n not in views)
    # t = r = 2: every rollout tensor is a view (the vision tower's qkv and gate_up too: training/megatron/vision.py);
    # t = 1 -> r = 2: [q_i; k_i; v_i] and [gate_i; up_i] are rebuilt from the whole tensors
    assert (export["rebuild_bytes"] > 0) == (ranks["tp"] == 1)
    assert export["view_bytes"] + export["rebuild_bytes"] == export["rollout_bytes"]
    assert export["remote_bytes"] == 0  # t = r or t = 1: nothing crosses devices
    rollout = plan.rollout.ranks[pair[1]]
    for name, spec in rollout.items():  # views and rebuilt tensors = the SGLang layout of the weights
        assert torch.equal(share["before"][name], reference_shard(spec, share["state_before"])), name
        assert torch.equal(share["before"][name], share["fresh_rollout_tensors"][name]), name
    # an update in flight is refused; the views see it at once, the rebuilt tensors after the publish
    assert "being updated" in share["stale"]
    assert share["published"] == {"sharing/rebuild_bytes": float(export["rebuild_bytes"]), "sharing/remote_bytes": 0.0}
    for name, spec in rollout.items():
        expected = reference_shard(spec, share["state_after"])
        assert not torch.equal(expected, share["before"][name]), name  # the update moved every tensor
        assert torch.equal(share["after"][name], expected), name
        if name in views:
            assert torch.equal(share["views_after_update"][name], expected), name


@pytest.mark.slow
def test_qwen2_vl_matches_hf_at_tp2(tiny_ckpt_qwen2, mixed_prompts, tmp_path):
    from rollplex_train.training.megatron.check import check_rank, run_ranks

    c = run_ranks(check_rank, 2, str(tiny_ckpt_qwen2), mixed_prompts, str(tmp_path))
    assert c["max_abs_logit_diff"] <= 1e-5 and c["max_abs_logprob_diff_split"] <= 1e-5
    assert c["max_rel_grad_diff"] <= 1e-4 and c["hf_roundtrip"] == "exact"
