"""The resumable loader of fixed-size prompt batches, and the fingerprint of the data it walks."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Optional, Sequence

import numpy as np

from rollplex_train.data.types import PromptSample

if TYPE_CHECKING:
    from rollplex_train.data.dataset import PromptDataset

logger = logging.getLogger(__name__)

WHOLE_FILE_BYTES = 64 * 1024**2
EDGE_BYTES = 8 * 1024**2


def data_fingerprint(paths: list[str], num_rows: int) -> str:
    """SHA-256 hex digest identifying a split's data: its row count and, per file in order, the
    size and the bytes (whole files up to 64 MiB; larger ones by their first and last 8 MiB, which
    hold a parquet file's footer with its row groups and statistics). File names and locations do
    not enter: moved or renamed data resume as the same data.

    Raises:
        FileNotFoundError: a file does not exist.
    """
    digest = hashlib.sha256(f"rows={num_rows};files={len(paths)}".encode())
    for path in paths:
        size = Path(path).stat().st_size
        digest.update(f";size={size};".encode())
        with open(path, "rb") as f:
            if size <= WHOLE_FILE_BYTES:
                digest.update(f.read())
            else:
                digest.update(f.read(EDGE_BYTES))
                f.seek(size - EDGE_BYTES)
                digest.update(f.read(EDGE_BYTES))
    return digest.hexdigest()


class NoBatchError(ValueError):
    """An epoch of the data gave no full batch: too few rows survived loading (the entry point
    reports it in one line with the skip counts)."""


class PromptLoader:
    """Endless, resumable batches of valid prompts, epoch after epoch.

    Each epoch visits every row once, in a permutation drawn from ``(seed, epoch)`` (or in row order
    without ``shuffle``). Bad rows are skipped and counted in the batch's ``num_skipped``. With
    ``drop_last`` a batch never spans two epochs: the short tail of an epoch is dropped, so every
    batch holds exactly ``batch_size`` prompts; without it the tail is returned short.

    A curriculum (``data.curriculum``) puts stages before those epochs: stage ``k`` serves
    ``steps`` batches drawn only from the rows whose task (:meth:`PromptDataset.row_tasks`) is in
    its ``tasks``, in epochs of their own over those rows (permutations drawn from
    ``(seed, epoch, k + 1)``); after the last stage the plain epochs over every row start at epoch 0.

    The saved state carries a fingerprint of the data files (:func:`data_fingerprint`): a position
    in one dataset means nothing in another, so :meth:`load_state_dict` refuses a state saved on
    other data unless told to restart the saved epoch on the new data, and a state saved under
    another curriculum always.

    Args:
        dataset: the prompts.
        batch_size: prompts per batch (> 0).
        shuffle: permute rows each epoch.
        seed: base of the per-epoch permutation.
        drop_last: drop the short last batch of each epoch.
        curriculum: stages with ``steps`` (batches) and ``tasks`` (``config.CurriculumStage``).

    Raises:
        ValueError: ``batch_size`` <= 0; a stage names a task no row has, or its tasks have fewer
            rows than ``batch_size`` (one line naming ``data.curriculum[k].tasks``).
    """

    def __init__(self, dataset: PromptDataset, batch_size: int, shuffle: bool, seed: int, drop_last: bool = True,
                 curriculum: Sequence = ()):
        if batch_size <= 0:
            raise ValueError(f"batch_size={batch_size}: expected > 0")
        self.dataset, self.batch_size, self.shuffle, self.seed, self.drop_last = (
            dataset, batch_size, shuffle, seed, drop_last)
        self.epoch, self.position, self._batches_in_epoch = 0, 0, 0
        self._order: Optional[np.ndarray] = None
        self._fingerprint: Optional[str] = None
        self.curriculum = [(int(stage.steps), tuple(str(t) for t in stage.tasks)) for stage in curriculum]
        self.stage, self.batches_in_stage = 0, 0
        self._stage_rows = self._curriculum_rows() if self.curriculum else []
        if self.curriculum:
            self._log_stage()

    def _curriculum_rows(self) -> list[np.ndarray]:
        """Per stage, the (R,) int64 global rows of its tasks; raises as the class says."""
        tasks = self.dataset.row_tasks()
        found = sorted(set(tasks))
        rows = []
        for k, (_, stage_tasks) in enumerate(self.curriculum):
            missing = [t for t in stage_tasks if t not in found]
            if missing:
                raise ValueError(f"data.curriculum[{k}].tasks={list(stage_tasks)}: no train row has task "
                                 f"{missing[0]!r}; the tasks in data.train_files are {found}")
            stage_rows = np.flatnonzero(np.isin(tasks, list(stage_tasks)))
            if len(stage_rows) < self.batch_size:
                raise ValueError(f"data.curriculum[{k}].tasks={list(stage_tasks)}: {len(stage_rows)} train rows, "
                                 f"fewer than data.rollout_batch_size={self.batch_size}")
            rows.append(stage_rows)
        return rows

    def _in_curriculum(self) -> bool:
        return self.stage < len(self.curriculum)

    def _epoch_order(self) -> np.ndarray:
        if self._order is None:
            if self._in_curriculum():
                rows = self._stage_rows[self.stage]
                key = [self.seed, self.epoch, self.stage + 1]
            else:
                rows, key = np.arange(len(self.dataset)), [self.seed, self.epoch]
            self._order = rows[np.random.default_rng(key).permutation(len(rows))] if self.shuffle else rows
        return self._order

    def _next_stage(self) -> None:
        """Into the next curriculum stage (or the plain epochs after the last), at its epoch 0."""
        self.stage, self.batches_in_stage = self.stage + 1, 0
        self.epoch, self.position, self._batches_in_epoch, self._order = 0, 0, 0, None
        self._log_stage()

    def _log_stage(self) -> None:
        if self._in_curriculum():
            steps, tasks = self.curriculum[self.stage]
            logger.info("data.curriculum[%d]: %d steps of tasks %s", self.stage, steps, list(tasks))
        else:
            logger.info("data.curriculum done: batches from every train row from now on")

    def _curriculum_state(self) -> list:
        """The curriculum as saved in a state: ``[[steps, [tasks]], ...]``."""
        return [[steps, list(tasks)] for steps, tasks in self.curriculum]

    def _next_epoch(self) -> None:
        if self._batches_in_epoch == 0:
            where = f"data.curriculum[{self.stage}] of " if self._in_curriculum() else ""
            raise NoBatchError(
                f"{where}data.train_files: epoch {self.epoch} of split {self.dataset.split!r} gave no batch of {self.batch_size}: only "
                f"{len(self.dataset) - self.dataset.num_bad} of {len(self.dataset)} rows are valid "
                f"(skipped: {dict(self.dataset.skipped)})"
            )
        self.epoch, self.position, self._batches_in_epoch, self._order = self.epoch + 1, 0, 0, None

    def next_batch(self) -> tuple[list[PromptSample], int]:
        """The next batch and the number of bad rows skipped while filling it.

        Raises:
            ValueError: a whole epoch yields no batch (no valid rows, or fewer than ``batch_size``
                with ``drop_last``).
        """
        if self._in_curriculum() and self.batches_in_stage >= self.curriculum[self.stage][0]:
            self._next_stage()
        batch: list[PromptSample] = []
        num_skipped = 0
        while len(batch) < self.batch_size:
            order = self._epoch_order()
            if self.position >= len(order):
                if batch and not self.drop_last:
                    break  # the short tail; the next call rolls over to the next epoch
                self._next_epoch()
                batch = []  # the dropped tail's skips still count in num_skipped
                continue
            sample = self.dataset.get(int(order[self.position]))
            self.position += 1
            if sample is None:
                num_skipped += 1
            else:
                batch.append(sample)
        self._batches_in_epoch += 1
        self.batches_in_stage += 1
        return batch, num_skipped

    def __iter__(self) -> Iterator[list[PromptSample]]:
        while True:
            yield self.next_batch()[0]

    @property
    def fingerprint(self) -> str:
        """:func:`data_fingerprint` of the dataset's files and row count (computed once)."""
        if self._fingerprint is None:
            self._fingerprint = data_fingerprint(self.dataset.paths, len(self.dataset))
        return self._fingerprint

    def state_dict(self) -> dict[str, Any]:
        """Where the next batch starts: ``{"epoch", "position", "batches_in_epoch", "stage",
        "batches_in_stage"}``, the ``curriculum`` (``[[steps, [tasks]], ...]``) and the
        ``data_fingerprint`` of the data it is a position in."""
        return {"epoch": self.epoch, "position": self.position, "batches_in_epoch": self._batches_in_epoch,
                "stage": self.stage, "batches_in_stage": self.batches_in_stage,
                "curriculum": self._curriculum_state(),
                "data_fingerprint": self.fingerprint}

    def check_state(self, state: dict, resume_on_changed_data: bool = False) -> bool:
        """Whether ``state`` was saved on this loader's data (True; also for a state without a
        fingerprint, from before fingerprints were saved).

        Raises:
            ValueError: the data differ and ``resume_on_changed_data`` is false (one line naming
                ``data.resume_on_changed_data``); the state was saved under another ``data.curriculum``.
        """
        saved_curriculum = state.get("curriculum", [])
        now = self._curriculum_state()
        if saved_curriculum != now:
            raise ValueError(f"resume: the checkpoint was saved with data.curriculum={saved_curriculum}, the run "
                             f"has {now}; resume with the checkpoint's curriculum")
        saved = state.get("data_fingerprint")
        if saved is None or saved == self.fingerprint:
            return True
        if not resume_on_changed_data:
            raise ValueError(
                f"resume: the {self.dataset.split} data ({', '.join(self.dataset.paths)}, {len(self.dataset)} rows) "
                f"differ from the data the checkpoint was saved on (fingerprint {saved[:12]}, now "
                f"{self.fingerprint[:12]}); set data.resume_on_changed_data=true to restart epoch "
                f"{int(state['epoch'])} on the new data")
        return False

    def load_state_dict(self, state: dict, resume_on_changed_data: bool = False) -> None:
        """Resume so that the next batch equals the one the saved loader would have produced.

        On other data (fingerprints differ) with ``resume_on_changed_data``: warn and start the
        saved epoch from its beginning, in the new data's order.

        Raises:
            ValueError: as :meth:`check_state`.
        """
        same = self.check_state(state, resume_on_changed_data)
        self.stage, self.batches_in_stage = int(state.get("stage", 0)), int(state.get("batches_in_stage", 0))
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._batches_in_epoch = int(state.get("batches_in_epoch", 1 if self.position else 0))
        self._order = None
        if not same:
            logger.warning("resume on changed %s data (data.resume_on_changed_data=true): the checkpoint's "
                           "position %d of epoch %d is dropped; epoch %d restarts on %s", self.dataset.split,
                           self.position, self.epoch, self.epoch, ", ".join(self.dataset.paths))
            self.position, self._batches_in_epoch = 0, 0

    def iter_all(self, batch_size: int, max_samples: int = -1) -> Iterator[list[PromptSample]]:
        """One in-order pass over the dataset (validation); see :meth:`PromptDataset.iter_all`."""
        return self.dataset.iter_all(batch_size, max_samples)
