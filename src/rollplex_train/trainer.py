"""The single controller: data -> step (workers) -> metrics, checkpoints, validation.

The loop reads like the algorithm (EasyR1 ``ray_trainer.fit``): take a prompt batch, run one
synchronous on-policy step (``runtime/step.run_step``), log, validate every ``trainer.val_freq`` steps,
checkpoint every ``trainer.save_freq`` steps. Everything that can be checked before a worker starts
(checkpoint path, data files and columns, reward function) is checked in ``__init__``.
"""

from __future__ import annotations

import logging
import os
import random
import signal
from collections import defaultdict
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from omegaconf import OmegaConf

from rollplex_train.algo.advantages import get_adv_estimator
from rollplex_train.algo.rewards import RewardManager
from rollplex_train.rollout.base import ROLLOUT_ENGINES
from rollplex_train.training.base import TRAIN_ENGINES
from rollplex_train.config import Config
from rollplex_train.data.dataset import PromptDataset
from rollplex_train.data.loader import PromptLoader
from rollplex_train.memory.executor import PhaseResidency
from rollplex_train.models.loading import check_checkpoint_dir, load_tokenizer, load_vision_spec
from rollplex_train.resolve import resolve
from rollplex_train.tracking.checkpoint import CheckpointManager, load_json, save_json
from rollplex_train.tracking.loggers import Tracker
from rollplex_train.tracking.plots import plot_val_accuracy
from rollplex_train.tracking.progress import ProgressBar
from rollplex_train.tracking.rollouts import dump_rollouts

log = logging.getLogger(__name__)

# Test hook: SIGKILL the driver at the start of this step (after the previous step's checkpoint).
KILL_AT_STEP_ENV = "ROLLPLEX_KILL_AT_STEP"
# Test hook: SIGKILL the last train rank's process at the start of this step (once per driver).
KILL_WORKER_AT_STEP_ENV = "ROLLPLEX_KILL_WORKER_AT_STEP"


class Trainer:
    """Owns the run: datasets, reward, checkpoints, trackers; drives the steps.

    Args:
        cfg: validated config. output_dir: the run directory (metrics, checkpoints, exports).

    Raises:
        FileNotFoundError / ValueError: a missing checkpoint or data file, a missing column, an
            empty dataset, a bad reward function, or a setting the chosen engines cannot honour
            (``resolve.resolve``), before any worker is started.
    """

    def __init__(self, cfg: Config, output_dir: Path):
        cfg = resolve(cfg)  # derived values and what the engines can do, in one logged step
        self.cfg, self.output_dir = cfg, Path(output_dir)
        # Names chosen by config fail here, before Ray and the workers start.
        get_adv_estimator(cfg.algorithm.adv_estimator)
        for engine in (ROLLOUT_ENGINES.get(cfg.rollout.name), TRAIN_ENGINES.get(cfg.actor.backend)):
            check = getattr(engine, "check_available", None)
            if check is not None:  # an engine from an optional extra (SGLang, Megatron): usable on this machine
                check(cfg)
        if cfg.cluster.device == "cuda" and cfg.cluster.address is None and torch.cuda.device_count() == 0:
            raise ValueError("cluster.device=cuda: no GPU is visible on this machine "
                             "(torch.cuda.device_count() == 0); use cluster.device=cpu for a CPU run")
        check_checkpoint_dir(cfg.model.path)
        PhaseResidency.from_config(cfg)  # a memory plan the run cannot follow fails here (the schedule makes its own)
        self.tokenizer = load_tokenizer(cfg.model.path)
        merge = load_vision_spec(cfg.model.path).merge_size
        self.train_set = PromptDataset(cfg.data, self.tokenizer, cfg.data.train_files, "train", merge_size=merge)
        self.val_set = (
            PromptDataset(cfg.data, self.tokenizer, cfg.data.val_files, "val", merge_size=merge)
            if cfg.data.val_files else None
        )
        self._check_rows()
        self.loader = self._new_loader()
        self.reward = RewardManager(cfg.reward.function, cfg.reward.format_weight, cfg.reward.max_failed_frac)
        # Validation reports accuracy alone (format_weight 0), the number users compare across runs.
        self.val_reward = RewardManager(cfg.reward.function, 0.0, cfg.reward.max_failed_frac)
        self.ckpt = CheckpointManager(self.output_dir / "checkpoints", cfg.trainer.max_ckpt_to_keep)
        self.resume_from = self.ckpt.resolve_resume(cfg.trainer.resume)
        if self.resume_from is not None and not (Path(self.resume_from) / "trainer_state.json").is_file():
            raise FileNotFoundError(f"trainer.resume={cfg.trainer.resume!r}: {self.resume_from} is not a "
                                    "rollplex checkpoint (no trainer_state.json)")
        # the driver state of the checkpoint to resume (its step and wandb run id are needed before Ray)
        self.resume_state = load_json(Path(self.resume_from) / "trainer_state.json") if self.resume_from else None
        if self.resume_state is not None and "loader" in self.resume_state:  # other data: refused before Ray
            self.loader.check_state(self.resume_state["loader"], cfg.data.resume_on_changed_data)
        self._check_lr_schedule()
        self.step = 0
        self._killed_worker = False  # the worker-kill test hook fired
        self.run = None  # runtime.step.Run, once the workers are up
        self.tracker: Optional[Tracker] = None
        self.output_dir.mkdir(parents=True, exist_ok=True)

    def _new_loader(self) -> PromptLoader:
        """The train loader at the run's start (``data.*``; a bad ``data.curriculum`` raises here, before Ray)."""
        d = self.cfg.data
        return PromptLoader(self.train_set, d.rollout_batch_size, d.shuffle, d.seed, curriculum=d.curriculum)

    def _check_rows(self) -> None:
        """Every row checked up front (``PromptDataset.precheck``): data that cannot fill a step's
        batch (or a validation pass) fails here in one line, with the skip counts by reason."""
        cfg = self.cfg.data
        for key, files, dataset, need in (("data.train_files", cfg.train_files, self.train_set, cfg.rollout_batch_size),
                                          ("data.val_files", cfg.val_files, self.val_set, 1)):
            if dataset is None:
                continue
            skipped = dataset.precheck()
            usable = len(dataset) - dataset.num_bad
            if usable < need:
                wanted = "validation needs one" if key == "data.val_files" else f"a step needs data.rollout_batch_size={need}"
                raise ValueError(f"{key}={files!r}: {usable} of {len(dataset)} rows are usable (skipped by reason: "
                                 f"{dict(sorted(skipped.items())) or 'none'}); {wanted}")

    # ---- run --------------------------------------------------------------------------------------
    def fit(self) -> dict[str, float]:
        """Train for ``trainer.total_steps`` steps (resuming if asked); returns the last metrics.

        A failed worker (``cluster.failures.diagnose``) tears every worker down; with restarts left
        (``trainer.max_restarts``) the workers start again and the run resumes from its last
        checkpoint (from the start without one), each restart logged.

        Raises:
            cluster.failures.WorkerFailure: a worker failed and no restart is left (its
                ``last_checkpoint`` attribute set).
        """
        from rollplex_train.cluster.failures import diagnose, tear_down

        if self._already_finished():
            return {}
        tracker = self._start_tracker()  # before Ray and any worker: a tracker that fails costs nothing
        restarts = 0
        try:
            while True:
                workers = None
                try:
                    workers = self._start_workers()
                    return self._train(tracker, workers)
                except Exception as err:
                    failure = diagnose(workers, err) if workers is not None else None
                    if failure is None:
                        raise
                    failure.step, failure.last_checkpoint = self.step, self.last_checkpoint()
                    if failure.raised:  # the worker's traceback goes to the log; stderr gets one line
                        log.error("%s", failure, exc_info=err)
                    tear_down(workers)
                    workers = None
                    if restarts >= self.cfg.trainer.max_restarts:
                        raise failure from None
                    restarts += 1
                    log.warning("restart %d of %d (trainer.max_restarts): %s at step %d; resuming from %s",
                                restarts, self.cfg.trainer.max_restarts, failure, self.step,
                                failure.last_checkpoint or "the start (no checkpoint yet)")
                    self._rewind(failure.last_checkpoint)
                    tracker.close()  # the history cut back to the checkpoint, as a resume does
                    tracker = self._start_tracker()
                finally:
                    if workers is not None:
                        workers.shutdown()
        finally:
            tracker.close()

    def _start_workers(self):
        """The workers up, the run built on them, the checkpoint to resume loaded."""
        from rollplex_train.cluster.launch import create_workers
        from rollplex_train.runtime import make_run

        workers = create_workers(self.cfg, self.output_dir)
        self.run = make_run(self.cfg, workers, self.reward, self.tokenizer.pad_token_id)
        self._maybe_resume()
        return workers

    def _rewind(self, checkpoint: Optional[Path]) -> None:
        """Back to ``checkpoint`` (None: the run's start) before a restart."""
        self.resume_from = checkpoint
        self.resume_state = load_json(Path(checkpoint) / "trainer_state.json") if checkpoint else None
        if checkpoint is None:
            self.step = 0
            self.loader = self._new_loader()

    def _train(self, tracker: Tracker, workers) -> dict[str, float]:
        """The step loop from ``self.step`` to ``trainer.total_steps``; returns the last metrics."""
        from rollplex_train.runtime.step import run_step

        cfg = self.cfg
        last: dict[str, float] = {}
        if cfg.trainer.val_before_train and self.step == 0 and self.val_set is not None:
            last = self.validate()
            tracker.log(last, step=0)
        bar = ProgressBar(cfg.trainer.total_steps, initial=self.step, enabled=cfg.trainer.progress_bar)
        try:
            while self.step < cfg.trainer.total_steps:
                self.step += 1
                self._fault_hook(workers)
                prompts, num_skipped = self.loader.next_batch()
                result = run_step(self.run, prompts, self.step)
                metrics = result.metrics
                if self.step in cfg.trainer.trace_steps:
                    result.timeline.write_chrome_trace(self.output_dir / "traces" / f"step_{self.step}.json")
                if cfg.trainer.rollout_data_dir:
                    dump_rollouts(self.output_dir / cfg.trainer.rollout_data_dir, self.step, result.batch,
                                  result.responses, result.scores)
                metrics["data/skipped"] = float(num_skipped)
                metrics["data/skipped_total"] = float(sum(self.train_set.skipped.values()))
                metrics["training/epoch"] = float(self.loader.state_dict().get("epoch", 0))
                done = self.step == cfg.trainer.total_steps
                if self.val_set is not None and cfg.trainer.val_freq > 0 and (
                    self.step % cfg.trainer.val_freq == 0 or done
                ):
                    metrics.update(self.validate())
                tracker.log(metrics, step=self.step)  # before the checkpoint: a resume never lacks its step
                if done or (cfg.trainer.save_freq > 0 and self.step % cfg.trainer.save_freq == 0):
                    self.save_checkpoint()
                bar.update(metrics)
                last = metrics
            bar.close()
            self._plot_curves()
            if cfg.trainer.export_hf:
                workers.train.export_hf(str(self.output_dir / "hf_actor"))
        finally:
            bar.close()
        return last

    def validate(self) -> dict[str, float]:
        """Greedy accuracy on the validation split, overall and per task (``val/accuracy``,
        ``val/<task>/accuracy``; at most ``data.max_val_samples`` prompts)."""
        accuracy_by_task: dict[str, list[float]] = defaultdict(list)
        for prompts in self.val_set.iter_all(self.cfg.data.val_batch_size, self.cfg.data.max_val_samples):
            responses = self.run.generate_val(prompts, self.step)
            owners = [prompts[r.prompt_index] for r in responses]
            scores, _ = self.val_reward.score(
                [r.text for r in responses], [p.ground_truth for p in owners], [p.uid for p in owners],
                [list(p.options) for p in owners],
            )
            for p, s in zip(owners, scores.tolist()):
                accuracy_by_task[p.task].append(s)
        everything = [s for v in accuracy_by_task.values() for s in v]
        out = {"val/accuracy": float(np.mean(everything)) if everything else float("nan")}
        for task, vals in sorted(accuracy_by_task.items()):
            out[f"val/{task}/accuracy"] = float(np.mean(vals))
        log.info("validation at step %d: %s", self.step, {k: round(v, 4) for k, v in out.items()})
        return out

    # ---- checkpoints ------------------------------------------------------------------------------
    def save_checkpoint(self) -> Path:
        """Atomically write the actor/optimizer (by the train worker) and the driver's state."""
        def write(directory: Path) -> None:
            self.run.workers.train.save_checkpoint(str(directory))
            save_json(self._driver_state(), directory / "trainer_state.json")

        path = self.ckpt.save(self.step, write)
        log.info("checkpoint saved: %s", path)
        return path

    def _start_tracker(self) -> Tracker:
        """The run's loggers; a resume continues the checkpoint's history (metrics cut back to its
        step, TensorBoard purged after it, the same wandb run)."""
        cfg, state = self.cfg, self.resume_state or {}
        self.tracker = Tracker(
            cfg.trainer.loggers, self.output_dir, cfg.trainer.project_name, cfg.trainer.experiment_name,
            OmegaConf.to_container(OmegaConf.structured(cfg)),
            resume_step=int(state["step"]) if state else None, wandb_run_id=state.get("wandb_run_id"),
            wandb_init_timeout_s=cfg.trainer.wandb_init_timeout_s,
        )
        return self.tracker

    def lr_schedule(self) -> dict:
        """The learning-rate schedule as the optimizer follows it (kept in the checkpoint)."""
        a = self.cfg.actor
        return {"lr_scheduler": a.lr_scheduler, "lr_decay_steps": a.lr_decay_steps, "lr": a.lr}

    def _check_lr_schedule(self) -> None:
        """A resume under another learning-rate schedule than its checkpoint's (with a cosine decay
        over the run's optimizer steps, raising ``trainer.total_steps`` stretches the decay) is said
        in one warning: from the resumed step on the learning rate follows the new schedule."""
        saved, now = (self.resume_state or {}).get("lr_schedule"), self.lr_schedule()
        if saved is None or saved == now:
            return
        changed = ", ".join(f"actor.{k}={now[k]} (checkpoint: {saved.get(k)})" for k in now if saved.get(k) != now[k])
        hint = (f"; set actor.lr_decay_steps={saved['lr_decay_steps']} to keep the checkpoint's decay"
                if saved.get("lr_decay_steps") != now["lr_decay_steps"] else "")
        log.warning("resuming under another learning-rate schedule: %s; the new one applies from step %d on%s",
                    changed, int(self.resume_state["step"]), hint)

    def _already_finished(self) -> bool:
        """True (said in one line) when the checkpoint to resume is at ``trainer.total_steps`` already."""
        done = int((self.resume_state or {}).get("step", 0))
        if done < self.cfg.trainer.total_steps:
            return False
        log.warning("nothing to do: checkpoint %s is at step %d and trainer.total_steps=%d; raise "
                    "trainer.total_steps to train further, or use trainer.resume=disable for a new run",
                    self.resume_from, done, self.cfg.trainer.total_steps)
        return True

    def _plot_curves(self) -> None:
        """``<output_dir>/val_accuracy.png``: validation accuracy per task over the run (from
        metrics.jsonl; nothing without the jsonl logger or validation)."""
        if "jsonl" in self.cfg.trainer.loggers:
            plot_val_accuracy(self.output_dir)

    def last_checkpoint(self) -> Optional[Path]:
        """The newest complete checkpoint of this run's directory (None: none yet)."""
        return self.ckpt.latest()

    def _driver_state(self) -> dict:
        return {
            "step": self.step,
            "wandb_run_id": self.tracker.wandb_run_id if self.tracker is not None else None,
            "loader": self.loader.state_dict(),
            "weights_version": self.run.weights_version,
            "lr_schedule": self.lr_schedule(),
            "schedule": self.run.state_dict(),
            "python_rng": repr(random.getstate()),
            "numpy_seed_state": int(np.random.get_state()[1][0]),
            "torch_seed": int(torch.initial_seed()),
        }

    def _maybe_resume(self) -> Optional[Path]:
        path = self.resume_from
        if path is None:
            return None
        state = self.resume_state
        version = self.run.workers.train.load_checkpoint(str(path))
        self.loader.load_state_dict(state["loader"], self.cfg.data.resume_on_changed_data)
        self.run.load_state_dict(state.get("schedule", {}))
        self.step = int(state["step"])
        if version > 0:
            self.run.sync_weights(version)
        log.info("resumed from %s at step %d (weights version %d)", path, self.step, version)
        return Path(path)

    def _fault_hook(self, workers) -> None:
        kill_at = os.environ.get(KILL_AT_STEP_ENV)
        if kill_at is not None and int(kill_at) == self.step:
            log.warning("%s=%s: killing the driver with SIGKILL", KILL_AT_STEP_ENV, kill_at)
            os.kill(os.getpid(), signal.SIGKILL)
        worker_at = os.environ.get(KILL_WORKER_AT_STEP_ENV)  # once per driver: a restart passes the step again
        if worker_at is not None and int(worker_at) == self.step and not self._killed_worker:
            self._killed_worker = True
            rank = workers.train.dp_size - 1
            pid = workers.executor.call(workers.train.handles[rank], "pid").result()
            log.warning("%s=%s: killing train rank %d (pid %d) with SIGKILL", KILL_WORKER_AT_STEP_ENV, worker_at,
                        rank, pid)
            os.kill(pid, signal.SIGKILL)
