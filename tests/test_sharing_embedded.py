"""Weight sharing in the embedded run (t = r = 1): the rollout engine decodes with the trainer's own
tensors. In one process (engines) and through Ray (the real run): in-place updates are seen after a
version bump, stale or in-flux weights are refused, nothing is copied or pickled per sync, the
shared and the pickled paths train identically, and no /dev/shm entry is left."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from conftest import scored_batch
from rollplex_train.config import ActorConfig, AlgorithmConfig, ModelConfig
from rollplex_train.rollout.base import SamplingParams, StaleWeightsError
from rollplex_train.rollout.builtin import BuiltinRolloutEngine
from rollplex_train.runtime.batching import to_train_batch
from rollplex_train.training.torch_engine import TorchTrainEngine

ROOT = Path(__file__).resolve().parents[1]
PARAMS = SamplingParams(n=2, max_new_tokens=4, seed=3)


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def _storages(model) -> set[int]:
    return {p.untyped_storage().data_ptr() for p in model.parameters()}


def test_engines_share_the_actor_in_place(tiny_ckpt_qwen25, mixed_prompts, tmp_path):
    trainer = TorchTrainEngine(ModelConfig(path=str(tiny_ckpt_qwen25)), ActorConfig(lr=1e-3, micro_batch_size=6),
                               AlgorithmConfig(kl_coef=0.05), seed=1)
    trainer.save_checkpoint(tmp_path)  # version 0, for the in-place load below
    rollout = BuiltinRolloutEngine(str(tiny_ckpt_qwen25))
    export = trainer.export_shared_weights()
    assert export["view_bytes"] == export["rollout_bytes"] > 0 and export["rebuild_bytes"] == 0
    assert len(export["payload"]) < 64 * 1024  # handles, not the weights
    assert rollout.map_shared_weights(export["payload"]) == export["rollout_bytes"]

    # the optimizer updates the shared tensors themselves; the reference keeps storage of its own
    actor = dict(trainer.actor.named_parameters())
    assert all(p.is_shared() for p in actor.values())
    assert {id(p) for g in trainer.backend.optimizer.param_groups for p in g["params"]} <= {id(p) for p in actor.values()}
    assert not any(p.is_shared() for p in trainer.ref.parameters())
    assert not _storages(trainer.ref) & _storages(trainer.actor)
    # tied embeddings stay one tensor on both sides
    assert trainer.actor.lm_head.weight is trainer.actor.model.language_model.embed_tokens.weight
    assert rollout.model.lm_head.weight is rollout.model.model.language_model.embed_tokens.weight
    assert rollout.weights_digest() == trainer.weights_digest()

    batch = scored_batch(rollout, trainer, mixed_prompts, PARAMS)
    before = trainer.weights_digest()
    trainer.update_actor(batch)
    assert rollout.weights_digest() == trainer.weights_digest() != before  # seen without a copy
    with pytest.raises(StaleWeightsError, match="being updated"):  # written but not published
        rollout.generate(mixed_prompts, PARAMS, weights_version=0)
    with pytest.raises(StaleWeightsError, match="being updated"):
        rollout.sync_shared_weights(1)
    with pytest.raises(StaleWeightsError, match="actor holds version 1"):
        trainer.publish_weights(2)
    assert trainer.publish_weights(1) == {"sharing/rebuild_bytes": 0.0, "sharing/remote_bytes": 0.0}
    with pytest.raises(StaleWeightsError, match="the shared counter holds version 1"):
        rollout.generate(mixed_prompts, PARAMS, weights_version=0)  # engine still at 0: stale
    rollout.sync_shared_weights(1)
    after = rollout.generate(mixed_prompts, PARAMS, weights_version=1)
    scored = to_train_batch(mixed_prompts, after, rollout.pad_id)
    logps, _ = trainer.compute_log_probs(scored, "actor")
    torch.testing.assert_close(logps, scored.rollout_logprobs, atol=1e-5, rtol=0)
    with pytest.raises(RuntimeError, match="sync_shared_weights"):
        rollout.update_weights({k: v.clone() for k, v in rollout.model.state_dict().items()}, 2)

    # a checkpoint load writes into the shared storage in place
    trainer.load_checkpoint(tmp_path)
    assert trainer.weights_version == 0 and rollout.weights_digest() == trainer.weights_digest() == before
    assert all(p.is_shared() for p in trainer.actor.parameters())


@pytest.fixture(scope="module")
def embedded_runs(embedded_assets, tmp_path_factory):
    """Two-step Ray runs of ``tiny_cpu`` with shared and with pickled weights: ``{enabled: (metrics,
    trainer digest, rollout digest, stale refusal message)}``, /dev/shm before and after."""
    import ray
    from hydra import compose, initialize_config_dir

    from rollplex_train.cli import conf_dir
    from rollplex_train.config import register_configs, to_config
    from rollplex_train.tracking.loggers import read_metrics_jsonl
    from rollplex_train.trainer import Trainer

    register_configs()
    shm_before, runs = _shm(), {}
    cwd = os.getcwd()
    os.chdir(ROOT)  # the experiment's relative asset paths
    try:
        for enabled in (True, False):
            out = tmp_path_factory.mktemp("run") / f"sharing_{enabled}"
            with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
                cfg = to_config(compose(config_name="config", overrides=[
                    "+experiment=tiny_cpu", f"trainer.output_dir={out}", "trainer.total_steps=2",
                    "trainer.val_freq=0", "trainer.save_freq=0", "trainer.val_before_train=false",
                    "trainer.export_hf=false", "trainer.progress_bar=false", "trainer.loggers=[jsonl]",
                    "data.rollout_batch_size=4", "rollout.n=4", f"sharing.enabled={str(enabled).lower()}",
                ]))
            trainer = Trainer(cfg, out)
            try:
                trainer.fit()
                w = trainer.run.workers
                digests = [w.train.weights_digest(), w.rollout.weights_digest()]
                prompts, _ = trainer.loader.next_batch()
                try:
                    w.rollout.generate(w.train.place(prompts[:1], [0]), PARAMS,
                                       trainer.run.weights_version - 1).result()
                    stale = None
                except StaleWeightsError as err:  # Ray re-raises the worker's exception type
                    stale = str(err)
                runs[enabled] = (read_metrics_jsonl(out / "metrics.jsonl"), *digests, stale)
            finally:
                ray.shutdown()
    finally:
        os.chdir(cwd)
    return runs, shm_before


@pytest.mark.slow
def test_ray_run_rollout_decodes_with_the_trainers_weights(embedded_runs):
    runs, _ = embedded_runs
    records, trained, rolled, stale = runs[True]
    assert [r["actor/weights_version"] for r in records] == [1.0, 2.0]
    assert trained == rolled  # bit-equal after two updates, through the mapped handles
    assert all(r["sharing/shared_bytes_frac"] == 1.0 for r in records)
    assert all(r["sharing/copied_bytes"] == 0.0 for r in records)  # no state dict sent or copied
    # the sync is two small actor calls (measured 2.8-3.4 ms of a 0.25 s step): one Ray round trip that
    # a busy machine stalls must not fail the test, so the cheaper of the two steps is held to 5%
    assert min(r["timing_s/update_weights"] / r["timing_s/step"] for r in records) < 0.05, records
    assert stale is not None and "version" in stale


@pytest.mark.slow
def test_ray_run_pickled_path_trains_identically_and_no_shm_is_left(embedded_runs):
    runs, shm_before = embedded_runs
    shared, pickled = runs[True][0], runs[False][0]
    records, trained, rolled, _ = runs[False]
    assert trained == rolled == runs[True][1]  # the same weights after two steps either way
    assert all(r["sharing/shared_bytes_frac"] == 0.0 for r in records)
    assert all(r["sharing/copied_bytes"] > 1e6 for r in records)  # the whole state dict every sync
    assert len(shared) == len(pickled) == 2
    for a, b in zip(shared, pickled):
        compared = [k for k in a if not k.startswith(("timing_s/", "perf/", "sharing/", "planner/", "rollplex/",
                                                      "cost/"))]
        assert len(compared) > 20 and "actor/grad_norm" in compared
        for key in compared:
            assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-7), key
    assert _shm() - shm_before == set()  # after both Ray runs ended
