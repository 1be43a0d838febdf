"""Every shipped config composes into the validated schema; bad keys and values are clear errors."""

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ConfigAttributeError, ConfigKeyError

from rollplex_train.cli import conf_dir
from rollplex_train.config import Config, hydra_version_base, register_configs, to_config
from rollplex_train.resolve import resolve

EXPERIMENTS = sorted(p.stem for p in (conf_dir() / "experiment").glob("*.yaml"))


def _compose(overrides):
    register_configs()
    with initialize_config_dir(config_dir=str(conf_dir()), **hydra_version_base()):
        cfg = compose(config_name="config", overrides=["trainer.output_dir=/tmp/unused", *overrides])
    return resolve(to_config(cfg))  # as a run sees it: derived values resolved (rollplex_train.resolve)


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_composes(experiment):
    cfg = _compose([f"+experiment={experiment}"])
    assert isinstance(cfg, Config)
    assert cfg.trainer.experiment_name == experiment


def test_every_group_option_composes():
    for group in ("model", "data", "algorithm", "rollout", "actor", "reward", "cluster", "schedule", "trainer"):
        for option in sorted((conf_dir() / group).glob("*.yaml")):
            extra = ["model.shared_prefix=true"] if (group, option.stem) == ("schedule", "rollplex") else []
            cfg = _compose([f"{group}={option.stem}", *extra])
            assert isinstance(cfg, Config)


def test_default_values_reach_the_dataclasses():
    cfg = _compose(["+experiment=tiny_cpu", "actor.lr=0.5", "rollout.n=3"])
    assert cfg.actor.lr == 0.5 and cfg.rollout.n == 3
    assert cfg.algorithm.adv_estimator == "grpo"
    assert Path(cfg.model.path).name == "tiny-qwen25vl"


@pytest.mark.parametrize("override", ["actor.learning_rate=1e-3", "+actor.learning_rate=1e-3"])
def test_misspelt_key_is_an_error(override):
    # On the command line and as an appended key alike: the schema has no such field.
    with pytest.raises((ConfigAttributeError, ConfigKeyError, ConfigCompositionException), match="learning_rate"):
        _compose([override])


@pytest.mark.parametrize(
    "override, message",
    [
        ("actor.loss_agg_mode=mean", "actor.loss_agg_mode"),
        ("algorithm.kl_estimator=k9", "algorithm.kl_estimator"),
        ("rollout.top_p=1.5", "rollout.top_p"),
        ("data.rollout_batch_size=0", "data.rollout_batch_size"),
        ("actor.ppo_mini_batch_size=3", "actor.ppo_mini_batch_size"),
        ("model.shared_prefix=false", "model.shared_prefix"),
        ("actor.clip_ratio_c=0.5", "actor.clip_ratio_c"),
        ("actor.lr_scheduler=linear", "actor.lr_scheduler"),
        ("actor.min_lr_ratio=1.5", "actor.min_lr_ratio"),
        ("actor.lr_decay_steps=0", "actor.lr_decay_steps"),
        ("schedule.prefill_from_actor=sometimes", "schedule.prefill_from_actor"),
        # the KV caches come from the rollplex schedule's prefix passes and go to the built-in engine only
        ("schedule.prefill_from_actor=true schedule.name=serial", "schedule.prefill_from_actor"),
        ("schedule.prefill_from_actor=true rollout.name=sglang", "schedule.prefill_from_actor"),
        ("schedule.prefill_from_actor=true schedule.prefix_memory_gib=0", "schedule.prefill_from_actor"),
    ],
)
def test_bad_value_names_the_key(override, message):
    with pytest.raises(ValueError, match=message):
        _compose(["+experiment=tiny_cpu", "schedule=rollplex", *override.split()])


def test_cosine_schedule_decays_over_the_whole_run():
    """-1 resolves to the run's optimizer steps after the warm-up; the factor falls from 1 to the
    floor along half a cosine and stays there."""
    import math

    from rollplex_train.training.torch_engine import lr_factor

    cfg = _compose(["+experiment=tiny_cpu", "actor.lr_scheduler=cosine", "actor.min_lr_ratio=0.1",
                    "actor.lr_warmup_steps=10", "trainer.total_steps=50"])
    a = cfg.actor
    assert a.lr_decay_steps == 50 * (16 // 4) - 10  # 4 mini-batches of 4 prompts per step of 16
    assert lr_factor(0, a) == pytest.approx(0.1) and lr_factor(9, a) == pytest.approx(1.0)
    assert lr_factor(10, a) == pytest.approx(1.0)
    assert lr_factor(10 + a.lr_decay_steps // 2, a) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_factor(10 + a.lr_decay_steps, a) == pytest.approx(0.1) == lr_factor(10**6, a)
    steps = [lr_factor(k, a) for k in range(10, 10 + a.lr_decay_steps)]
    assert all(x > y for x, y in zip(steps, steps[1:]))
    assert not math.isnan(sum(steps))
    constant = _compose(["+experiment=tiny_cpu", "actor.lr_scheduler=constant"]).actor
    assert constant.lr_decay_steps == -1 and lr_factor(10**6, constant) == 1.0


def test_the_32b_experiment_passes_every_check_before_ray_on_tiny_assets(tmp_path, monkeypatch, embedded_assets):
    """``rollplex-train +experiment=qwen25vl32b_embodied`` with its checkpoint and data paths pointed at
    the tiny assets: the trainer is built (config, derived values, the engines' capability checks,
    the residency plan at 80 GiB, the data) and only this machine's lack of SGLang and GPUs would
    stop it, which is what is patched here (SGLang's check keeps its config half)."""
    import ray

    from rollplex_train.paths import resolve_config_paths
    from rollplex_train.rollout import sglang
    from rollplex_train.rollout.base import ROLLOUT_ENGINES
    from rollplex_train.trainer import Trainer

    tasks, ckpt = embedded_assets
    cfg = _compose(["+experiment=qwen25vl32b_embodied", f"model.path={ckpt}", f"data.train_files={tasks}/train.parquet",
                    f"data.val_files={tasks}/val.parquet"])
    monkeypatch.setattr(ROLLOUT_ENGINES.get("sglang"), "check_available", staticmethod(sglang.check_config))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    trainer = Trainer(resolve_config_paths(cfg, conf_dir().parent), tmp_path)
    assert (trainer.cfg.rollout.name, trainer.cfg.rollout.tensor_parallel_size, trainer.cfg.actor.backend,
            trainer.cfg.sharing.enabled, trainer.cfg.schedule.name) == ("sglang", 4, "megatron", True, "rollplex")
    assert len(trainer.train_set) > 0 and not ray.is_initialized()
