"""The trainer side of in-place sharing for a tensor-parallel rollout (``sharing/share.py``), on the
torch backend in one process: the tensors of SGLang-layout rollout rank j at r = 2 are views of the
actor's parameters where the plan says view and rebuilt buffers elsewhere, equal to the layout's
reference shards before and after an update, refused while the update is in flight, refreshed by
the publish. (The Megatron backend's hand-over is tested in its gloo ranks, ``tests/test_megatron.py``.)"""

from __future__ import annotations

import pytest
import torch

from conftest import scored_batch
from rollplex_train.config import ActorConfig, AlgorithmConfig, ModelConfig
from rollplex_train.models.layouts import Dims, reference_shard
from rollplex_train.rollout.base import SamplingParams
from rollplex_train.rollout.builtin import BuiltinRolloutEngine
from rollplex_train.sharing.plan import plan_sharing
from rollplex_train.training.torch_engine import TorchTrainEngine
from rollplex_train.versioning import StaleWeightsError


@pytest.mark.parametrize("rank", [0, 1])
def test_torch_actor_hands_rollout_rank_its_sglang_tensors_in_place(tiny_ckpt_qwen25, mixed_prompts, rank):
    trainer = TorchTrainEngine(ModelConfig(path=str(tiny_ckpt_qwen25)), ActorConfig(lr=1e-3, micro_batch_size=6),
                               AlgorithmConfig(kl_coef=0.05), seed=1, rank=rank)
    full = lambda: {n: p.detach().clone() for n, p in trainer.actor.named_parameters()}  # noqa: E731
    export = trainer.export_shared_weights(same_process=True, rollout_kind="sglang", rollout_tp=2)
    shared = export["payload"]
    shapes = {n: tuple(p.shape) for n, p in trainer.actor.named_parameters()}
    plan = plan_sharing(shapes, Dims.from_hf_config(trainer.actor.config), t=1, r=2, train_kind="hf",
                        rollout_kind="sglang", itemsize=4)
    assert plan.devices[rank] == (0, rank) and export["rollout_rank"] == rank
    plans = plan.tensors[(0, rank)]
    views = {n for n, tp in plans.items() if tp.action in ("view", "strided_view")}
    storages = {p.untyped_storage().data_ptr() for p in trainer.actor.parameters()}
    assert {n for n, t in shared.tensors.items() if t.untyped_storage().data_ptr() in storages} == views
    assert views and len(views) < len(plans)  # row-parallel columns are views; [q;k;v], gate_up rebuilt
    assert export["view_bytes"] == sum(plans[n].nbytes for n in views)
    assert export["view_bytes"] + export["rebuild_bytes"] == export["rollout_bytes"] and export["remote_bytes"] == 0
    before = full()
    for name, tp in plans.items():
        assert torch.equal(shared.tensors[name], reference_shard(tp.spec, before)), name

    rollout = BuiltinRolloutEngine(str(tiny_ckpt_qwen25))
    trainer.update_actor(scored_batch(rollout, trainer, mixed_prompts, SamplingParams(n=2, max_new_tokens=4, seed=3)))
    with pytest.raises(StaleWeightsError, match="being updated"):
        shared.check(1)
    after = full()
    for name in views:  # seen at once, no copy
        assert torch.equal(shared.tensors[name], reference_shard(plans[name].spec, after)), name
    rebuilt = sorted(set(plans) - views)
    assert all(torch.equal(shared.tensors[n], reference_shard(plans[n].spec, before)) for n in rebuilt)
    assert trainer.publish_weights(1) == {"sharing/rebuild_bytes": float(export["rebuild_bytes"]),
                                          "sharing/remote_bytes": 0.0}
    shared.check(1)
    for name in rebuilt:
        assert torch.equal(shared.tensors[name], reference_shard(plans[name].spec, after)), name
    assert any(not torch.equal(before[n], after[n]) for n in before)
