"""Two processes: rollout tensors handed over as handles, in-place updates seen, stale refused."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

from rollplex_train.models.layouts import reference_shard
from rollplex_train.rollout.base import StaleWeightsError
from rollplex_train.sharing.ipc import WeightsVersion, export_handles, import_handles
from rollplex_train.sharing.materialize import Materializer
from rollplex_train.sharing.plan import plan_sharing

VIEW = "model.language_model.layers.0.mlp.gate_up_proj.weight"
REBUILT = "model.language_model.layers.0.self_attn.qkv_proj.weight"
ALIAS = "model.language_model.layers.0.mlp.gate_proj.weight"


def _rollout_side(conn) -> None:
    """Child: map the payload, answer queries about what it sees (no weights are ever sent)."""
    shared = import_handles(conn.recv())
    t = shared.tensors
    conn.send({"shared": all(x.untyped_storage().is_shared() for x in t.values()),
               "aliased": t[VIEW].untyped_storage().data_ptr() == t["train." + VIEW].untyped_storage().data_ptr()})
    while True:
        msg = conn.recv()
        if msg == "stop":
            shared.close()
            conn.send("closed")
            return
        try:
            shared.check(msg)
            conn.send({"sum_view": t[VIEW].double().sum().item(), "sum_rebuilt": t[REBUILT].double().sum().item()})
        except StaleWeightsError as err:
            conn.send(f"stale: {err}")


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def test_two_processes_share_without_copy_and_refuse_stale():
    from test_sharing_plan import _train_shards, small_model

    before = _shm()
    shapes, dims, full = small_model(2)
    plan = plan_sharing(shapes, dims, t=1, r=1, itemsize=4)  # megatron -> sglang, one device
    shards = _train_shards(plan.train, full)[0]
    assert plan.tensors[(0, 0)][VIEW].action == "view" and plan.tensors[(0, 0)][REBUILT].action == "local_rebuild"
    for t in shards.values():
        t.share_memory_()  # the trainer's parameters live in shared memory from the start
    mat = Materializer(plan.tensors[(0, 0)], shards, shared=True)
    version = WeightsVersion()
    version.publish(1)
    handed = dict(mat.tensors, **{"train." + VIEW: shards["model.language_model.layers.0.mlp.linear_fc1.weight"]})
    payload = export_handles(handed, version)
    assert len(payload) < 64 * 1024  # handles, not the ~0.9 MB of weights
    assert _shm() - before == set()  # file_descriptor strategy: segments are unlinked at creation

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_rollout_side, args=(child,), daemon=True)
    proc.start()
    try:
        parent.send(payload)
        hello = parent.recv()
        assert hello == {"shared": True, "aliased": True}
        ref_view, ref_rebuilt = (reference_shard(plan.tensors[(0, 0)][n].spec, full) for n in (VIEW, REBUILT))
        parent.send(1)
        got = parent.recv()
        assert got == {"sum_view": ref_view.double().sum().item(), "sum_rebuilt": ref_rebuilt.double().sum().item()}

        version.begin_update()
        for t in shards.values():
            t.mul_(3.0)  # in-place optimizer step
        parent.send(1)
        assert parent.recv().startswith("stale: rollout wants weights version 1, shared weights are being updated")
        mat.sync()
        version.publish(2)
        parent.send(1)
        assert parent.recv().startswith("stale: rollout wants weights version 1, the shared counter holds version 2")
        parent.send(2)
        got = parent.recv()
        assert got["sum_view"] == (ref_view * 3.0).double().sum().item()  # seen without a copy
        assert got["sum_rebuilt"] == (ref_rebuilt * 3.0).double().sum().item()  # same buffer, refilled
        with pytest.raises(StaleWeightsError, match="not newer"):
            version.publish(2)
        parent.send("stop")
        assert parent.recv() == "closed"
    finally:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()  # only on failure: the child blocks on recv
    assert proc.exitcode == 0
    del mat, shards, handed
    assert _shm() - before == set()  # no /dev/shm segment left behind
