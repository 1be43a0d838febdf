"""Crash-safe checkpoint directories with verl's names.

Layout under ``root``::

    global_step_<k>/                       one complete checkpoint (whatever ``write_fn`` wrote)
    latest_checkpointed_iteration.txt      the step number of the newest checkpoint, e.g. "10"
    .tmp-*                                 work in progress or leftovers of a crash (ignored)

A checkpoint becomes visible only by an atomic ``os.replace`` of a fully written and fsynced
temporary directory, and the pointer file is replaced atomically afterwards; a crash at any point
leaves the previous checkpoint intact and loadable.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

__all__ = [
    "POINTER_FILE",
    "CheckpointManager",
    "fsync_tree",
    "load_json",
    "load_torch",
    "replace_dir",
    "save_json",
    "save_torch",
]

log = logging.getLogger(__name__)

POINTER_FILE = "latest_checkpointed_iteration.txt"
TMP_PREFIX = ".tmp-"
_STEP_DIR = re.compile(r"^global_step_(\d+)$")


def _fsync_dir(path: Path) -> None:
    """fsync a directory entry (makes renames inside it durable); a no-op where unsupported."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """fsync every regular file and directory under ``path`` (and ``path`` itself)."""
    for dirpath, _dirnames, filenames in os.walk(path):
        for name in filenames:
            file_path = os.path.join(dirpath, name)
            if os.path.islink(file_path):
                continue
            fd = os.open(file_path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def _remove_tree(path: Path) -> None:
    """Delete a directory by first renaming it to a ``.tmp-`` name, so a crash mid-delete leaves
    only an ignored leftover, never a half-deleted directory under its real name."""
    doomed = path.parent / f"{TMP_PREFIX}del-{path.name}-{os.getpid()}"
    os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def replace_dir(src: Path, dst: Path) -> None:
    """Atomically make the finished directory ``src`` appear as ``dst``, replacing an old ``dst``.

    ``src`` and ``dst`` must be on the same filesystem (siblings). An existing ``dst`` is first
    renamed aside to a ``.tmp-`` name and deleted afterwards, so between the two renames ``dst`` is
    briefly absent (never partial).
    """
    parent = dst.parent
    aside: Optional[Path] = None
    if dst.exists():
        aside = parent / f"{TMP_PREFIX}old-{dst.name}-{os.getpid()}"
        if aside.exists():
            shutil.rmtree(aside)
        os.replace(dst, aside)
    os.replace(src, dst)
    _fsync_dir(parent)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def _write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` via a fsynced temp file and ``os.replace``."""
    tmp = path.parent / f"{TMP_PREFIX}{path.name}-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


class CheckpointManager:
    """Saves, finds and prunes ``global_step_<k>`` checkpoint directories under ``root``.

    Args:
        root: Directory holding the checkpoints (created on the first save).
        max_to_keep: Complete checkpoints kept after a save, the new one included; ``>= 1``.

    Raises:
        ValueError: ``max_to_keep < 1``.
    """

    def __init__(self, root: str | Path, max_to_keep: int) -> None:
        if max_to_keep < 1:
            raise ValueError(f"trainer.max_ckpt_to_keep must be >= 1, got {max_to_keep}")
        self.root = Path(root)
        self.max_to_keep = int(max_to_keep)

    # ---- paths -------------------------------------------------------------------------------
    def step_dir(self, step: int) -> Path:
        """``root/global_step_<step>`` (whether or not it exists)."""
        return self.root / f"global_step_{int(step)}"

    @staticmethod
    def step_of(path: str | Path) -> int:
        """The step number of a ``global_step_<k>`` directory.

        Raises:
            ValueError: the directory name is not ``global_step_<k>`` (names the path).
        """
        match = _STEP_DIR.match(Path(path).name)
        if match is None:
            raise ValueError(f"not a checkpoint directory name (expected global_step_<k>): {path}")
        return int(match.group(1))

    def list_checkpoints(self) -> list[Path]:
        """Complete checkpoint directories, ascending by step (``.tmp-*`` leftovers excluded)."""
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.iterdir() if _STEP_DIR.match(p.name) and p.is_dir()]
        return sorted(found, key=self.step_of)

    # ---- save --------------------------------------------------------------------------------
    def save(self, step: int, write_fn: Callable[[Path], None]) -> Path:
        """Write a checkpoint for ``step`` and make it the latest, crash-safely.

        ``write_fn(tmp_dir)`` writes every file of the checkpoint into the fresh, empty directory
        ``root/.tmp-global_step_<k>-<pid>``. Then every file is fsynced, the directory renamed
        atomically to ``root/global_step_<k>`` (replacing an earlier save of the same step), the
        pointer file rewritten atomically, and checkpoints beyond ``max_to_keep`` deleted (never
        the new one: the new one plus the ``max_to_keep - 1`` highest-step others are kept).
        ``.tmp-*`` leftovers of earlier crashes are removed first.

        Args:
            step: Training step the checkpoint holds (``>= 0``).
            write_fn: Callable that writes the checkpoint's files into the directory it is given.

        Returns:
            The path of the new checkpoint, ``root/global_step_<k>``.

        Raises:
            ValueError: ``step < 0``.
            Exception: whatever ``write_fn`` raises; the temp directory is removed and the previous
                checkpoint stays the latest.
        """
        if step < 0:
            raise ValueError(f"checkpoint step must be >= 0, got {step}")
        self.root.mkdir(parents=True, exist_ok=True)
        self._remove_leftovers()
        tmp = self.root / f"{TMP_PREFIX}global_step_{int(step)}-{os.getpid()}"
        tmp.mkdir()
        try:
            write_fn(tmp)
            fsync_tree(tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        final = self.step_dir(step)
        replace_dir(tmp, final)
        _write_text_atomic(self.root / POINTER_FILE, f"{int(step)}\n")
        self._prune(keep=final)
        log.info("saved checkpoint %s", final)
        return final

    def _remove_leftovers(self) -> None:
        for path in self.root.iterdir():
            if not path.name.startswith(TMP_PREFIX):
                continue
            log.warning("removing leftover of an interrupted save: %s", path)
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)

    def _prune(self, keep: Path) -> None:
        others = [p for p in reversed(self.list_checkpoints()) if p != keep]
        for old in others[self.max_to_keep - 1 :]:
            log.info("removing old checkpoint %s (max_to_keep=%d)", old, self.max_to_keep)
            _remove_tree(old)

    # ---- find --------------------------------------------------------------------------------
    def latest(self) -> Optional[Path]:
        """The newest complete checkpoint, or ``None`` when there is none.

        Reads the pointer file; when it is missing, unreadable, not an integer or names a
        directory that does not exist, logs a warning and falls back to the highest-step complete
        ``global_step_*`` directory. ``.tmp-*`` directories are never returned.
        """
        pointer = self.root / POINTER_FILE
        problem: Optional[str] = None
        if pointer.is_file():
            try:
                step = int(pointer.read_text(encoding="utf-8").strip())
            except (OSError, ValueError, UnicodeDecodeError):
                problem = f"pointer file {pointer} is corrupt"
            else:
                candidate = self.step_dir(step)
                if candidate.is_dir():
                    return candidate
                problem = f"pointer file {pointer} names a missing checkpoint {candidate}"
        checkpoints = self.list_checkpoints()
        if not checkpoints:
            if problem:
                log.warning("%s and no checkpoint directory exists", problem)
            return None
        fallback = checkpoints[-1]
        log.warning("%s; using the highest complete checkpoint %s", problem or f"no pointer file {pointer}", fallback)
        return fallback

    def resolve_resume(self, mode: str) -> Optional[Path]:
        """Where to resume from, for ``trainer.resume``.

        Args:
            mode: ``"auto"`` -> :meth:`latest` (``None`` when there is no checkpoint),
                ``"disable"`` -> ``None``, anything else -> a checkpoint directory path that must
                exist (relative paths are relative to the working directory).

        Raises:
            ValueError: ``mode`` is empty.
            FileNotFoundError: the given path does not exist (named in the message).
        """
        mode = str(mode).strip()
        if mode == "auto":
            return self.latest()
        if mode == "disable":
            return None
        if not mode:
            raise ValueError("trainer.resume is empty; use 'auto', 'disable' or a checkpoint directory")
        path = Path(mode).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"trainer.resume: checkpoint directory not found: {path}")
        return path


# ---- file helpers ------------------------------------------------------------------------------
def save_torch(obj: Any, path: str | Path) -> None:
    """``torch.save(obj, path)``, creating the parent directory."""
    import torch

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(obj, path)


def load_torch(path: str | Path, map_location: Any = "cpu") -> Any:
    """``torch.load`` with ``weights_only=True``; if the file holds objects the safe unpickler
    rejects (e.g. numpy RNG state), retries with ``weights_only=False`` (our own checkpoints only).

    Raises:
        FileNotFoundError: ``path`` does not exist (named in the message).
    """
    import torch

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint file not found: {path}")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError:
        log.debug("%s needs the full unpickler (weights_only=False)", path)
        return torch.load(path, map_location=map_location, weights_only=False)


def save_json(obj: Any, path: str | Path) -> None:
    """Write ``obj`` as indented JSON (strict: NaN/inf and non-JSON types raise ValueError/TypeError)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, allow_nan=False)
        f.write("\n")


def load_json(path: str | Path) -> Any:
    """Read a JSON file.

    Raises:
        FileNotFoundError: ``path`` does not exist (named in the message).
        ValueError: the file is not valid JSON (names the file and position).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"JSON file not found: {path}")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: invalid JSON ({exc})") from exc
