"""Prompt datasets in the EasyR1 schema (the resumable batch loader is ``data/loader.py``).

A manifest (parquet or jsonl) has one row per prompt: ``problem`` (text with ``<image>``/``<video>``
placeholders), ``answer``, optional ``images`` / ``videos`` (lists of paths relative to the
manifest's directory, or HF ``Image`` dicts), optional ``task`` (or ``data_source``) and ``options``.
Column names come from :class:`~rollplex_train.config.DataConfig`.

File-level problems (missing file, unknown extension, empty table, missing prompt/answer column)
raise at construction. Row-level problems make :meth:`PromptDataset.get` return ``None``; each bad
row is counted once by reason in ``PromptDataset.skipped``; :meth:`PromptDataset.precheck` sums up
its finds in one warning, and rows found bad while loading are logged with their file and row for
the first of each reason only.
"""

from __future__ import annotations

import collections
import json
import logging
import tempfile
from pathlib import Path
from typing import Any, Iterator, Optional, Union

import datasets
import numpy as np
import pyarrow.parquet as pq
import torch

from rollplex_train.config import DataConfig
from rollplex_train.data.jsonl import BadLine, JsonRows
from rollplex_train.data.prompts import build_messages, render_prompt_ids
from rollplex_train.data.types import PromptSample, VisionInputs
from rollplex_train.data.vision import (image_grid, image_size, load_image, load_video, patchify_images, patchify_video,
                                        resolve_path)

logger = logging.getLogger(__name__)

SKIP_REASONS = ("missing_media", "corrupt_media", "bad_schema", "empty_prompt", "placeholder_mismatch",
                "too_long")
_SUFFIXES = (".parquet", ".jsonl", ".json")
Table = Union[datasets.Dataset, JsonRows]


def split_files(files: str) -> list[str]:
    """The non-empty, stripped entries of a comma-separated file list."""
    return [f.strip() for f in files.split(",") if f.strip()]


def _no_image_decoding(ds: datasets.Dataset) -> datasets.Dataset:
    """Cast HF ``Image`` columns (also inside lists) to ``decode=False`` so rows keep bytes/paths."""
    for name, feature in ds.features.items():
        inner = getattr(feature, "feature", None)
        if isinstance(feature, datasets.Image) and feature.decode:
            ds = ds.cast_column(name, datasets.Image(decode=False))
        elif isinstance(inner, datasets.Image) and inner.decode:
            ds = ds.cast_column(name, datasets.List(datasets.Image(decode=False)))
    return ds


def _parquet_rows(path: str) -> int:
    """Rows of a parquet file from its footer (pyarrow), before ``datasets`` reads it: a file that
    is not parquet fails here in one line instead of ``datasets`` logging the error twice first.

    Raises:
        ValueError: the footer cannot be read (names the file and pyarrow's error).
    """
    try:
        return pq.ParquetFile(path).metadata.num_rows
    except Exception as err:  # noqa: BLE001 - pyarrow raises ArrowInvalid, OSError, ... on bad files
        raise ValueError(f"{path}: cannot read as parquet: {type(err).__name__}: {err}") from err


def read_file(path: str, cache_dir: Optional[str] = None) -> Table:
    """Load one manifest: parquet through ``datasets`` (in memory, no network), JSON lines with the
    ``json`` module (``data/jsonl.py``: strings byte-exact, no per-column type inference).

    Args:
        path: a ``.parquet``, ``.jsonl`` or ``.json`` (JSON lines, or one array of objects) file.
        cache_dir: ``datasets`` cache directory (None: a temporary one, removed after loading).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: unknown extension, unreadable content, or no rows.
    """
    suffix = Path(path).suffix.lower()
    if suffix not in _SUFFIXES:
        raise ValueError(f"{path}: unknown data file extension {suffix!r}; expected one of {sorted(_SUFFIXES)}")
    if not Path(path).is_file():
        raise FileNotFoundError(f"data file not found: {path}")
    if suffix != ".parquet":
        return JsonRows(path)
    if _parquet_rows(path) == 0:  # datasets fails obscurely on these; say what is wrong
        raise ValueError(f"{path}: the dataset is empty (0 rows)")
    try:
        with tempfile.TemporaryDirectory(prefix="rollplex-datasets-") as tmp:
            ds = datasets.Dataset.from_parquet(path, cache_dir=cache_dir or tmp, keep_in_memory=True)
    except Exception as err:  # datasets/pyarrow raise many types for malformed files
        raise ValueError(f"{path}: cannot read as {suffix[1:]}: {type(err).__name__}: {err}") from err
    if len(ds) == 0:
        raise ValueError(f"{path}: the dataset is empty (0 rows)")
    return _no_image_decoding(ds)


def load_table(files: str, cache_dir: Optional[str] = None) -> Union[Table, list[dict]]:
    """Load comma-separated parquet/jsonl files as one table (rows in file order): a
    ``datasets.Dataset`` when every file is parquet, else the list of row dicts.

    Raises:
        FileNotFoundError: a file does not exist (named in the message).
        ValueError: no file given, an unknown extension, an unreadable or empty file.
    """
    paths = split_files(files)
    if not paths:
        raise ValueError(f"no data files in {files!r}")
    parts = [read_file(p, cache_dir) for p in paths]
    if len(parts) == 1:
        return parts[0]
    if all(isinstance(p, datasets.Dataset) for p in parts):
        return datasets.concatenate_datasets(parts)
    return [part[i] for part in parts for i in range(len(part))]


def _task_label(task: Any, data_source: Any) -> str:
    """A row's task: its ``task`` column, else ``data_source``, else ``default``."""
    return str(task or data_source or "default")


class _Skip(Exception):
    """A row that cannot become a prompt; ``reason`` is one of ``SKIP_REASONS``."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def _media_list(row: dict, key: str) -> list:
    """The row's media list (missing column or None: empty), or ``_Skip('bad_schema')``."""
    value = row.get(key)
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise _Skip("bad_schema", f"column {key!r} must be a list, got {type(value).__name__}")
    for item in value:
        if not isinstance(item, (str, dict)):
            raise _Skip("bad_schema", f"column {key!r} holds a {type(item).__name__}, expected paths")
    return list(value)


class PromptDataset:
    """Rows of one or more manifests turned into :class:`PromptSample` on demand.

    Args:
        cfg: column names, media sizes, ``max_prompt_length``, system/format prompts.
        tokenizer: HF tokenizer with a Qwen2-VL chat template.
        files: comma-separated parquet/jsonl paths.
        split: name used in sample uids (``<split>:<row>``), e.g. ``train`` or ``val``.
        merge_size, patch_size, temporal_patch_size: the vision tower's geometry.
        cache_dir: ``datasets`` cache directory (None: temporary).

    Attributes:
        skipped: bad rows counted once each by reason (``SKIP_REASONS``).
        coerced: rows kept after a conversion, counted once each: ``coerced_answer`` (a non-string
            answer, e.g. a JSON number, replaced by its JSON text: ``30`` -> ``"30"``).

    Raises:
        FileNotFoundError: a data file or ``cfg.format_prompt`` file does not exist.
        ValueError: unknown extension, empty file, or a missing ``prompt_key``/``answer_key`` column.
    """

    def __init__(self, cfg: DataConfig, tokenizer, files: str, split: str, merge_size: int = 2,
                 patch_size: int = 14, temporal_patch_size: int = 2, cache_dir: Optional[str] = None):
        self.cfg, self.tokenizer, self.split = cfg, tokenizer, split
        self.merge_size, self.patch_size, self.temporal_patch_size = merge_size, patch_size, temporal_patch_size
        self._paths = split_files(files)
        if not self._paths:
            raise ValueError(f"data files for split {split!r} are empty: {files!r}")
        self._tables = [read_file(p, cache_dir) for p in self._paths]
        for path, table in zip(self._paths, self._tables):
            for key_name in ("prompt_key", "answer_key"):
                column = getattr(cfg, key_name)
                if column not in table.column_names:
                    raise ValueError(
                        f"{path}: missing column {column!r} (data.{key_name}); columns are {table.column_names}"
                    )
        self._offsets = np.cumsum([0] + [len(t) for t in self._tables])
        self.format_prompt: Optional[str] = None
        if cfg.format_prompt:
            if not Path(cfg.format_prompt).is_file():
                raise FileNotFoundError(f"data.format_prompt file not found: {cfg.format_prompt}")
            self.format_prompt = Path(cfg.format_prompt).read_text(encoding="utf-8")
        self.skipped: collections.Counter = collections.Counter()
        self.coerced: collections.Counter = collections.Counter()
        self._bad: dict[int, str] = {}
        self._logged_reasons: set[str] = set()  # reasons whose first row found bad while loading was logged
        self._coerced_rows: set[int] = set()

    def __len__(self) -> int:
        return int(self._offsets[-1])

    @property
    def paths(self) -> list[str]:
        """The split's data files, in row order."""
        return list(self._paths)

    @property
    def num_bad(self) -> int:
        """Rows found bad so far (each counted once)."""
        return len(self._bad)

    def _locate(self, index: int) -> tuple[int, int]:
        if not 0 <= index < len(self):
            raise IndexError(f"row {index} out of range for {len(self)} rows of split {self.split!r}")
        part = int(np.searchsorted(self._offsets, index, side="right")) - 1
        return part, index - int(self._offsets[part])

    def locate(self, index: int) -> tuple[str, int]:
        """``(file path, row within that file)`` of global row ``index``."""
        part, row_index = self._locate(index)
        return self._paths[part], row_index

    def get(self, index: int) -> Optional[PromptSample]:
        """The prompt of global row ``index``, or None for a bad row (counted and logged once)."""
        if index in self._bad:
            return None
        part, row_index = self._locate(index)
        path = self._paths[part]
        try:
            return self._build(index, self._row(part, row_index), path, row_index)
        except _Skip as skip:
            self._mark_bad(index, skip.reason)
            if skip.reason not in self._logged_reasons:
                self._logged_reasons.add(skip.reason)
                logger.warning("skipping %s row %d (%s): %s; further %s rows of split %r are counted "
                               "(data/skipped_total), not logged", path, row_index, skip.reason, skip, skip.reason,
                               self.split)
            else:
                logger.debug("skipping %s row %d (%s): %s", path, row_index, skip.reason, skip)
            return None

    def row_tasks(self) -> np.ndarray:
        """(len(self),) object array of str: each row's task as :meth:`get` labels it (the ``task``
        column, else ``data_source``, else ``default``), read without decoding any media. A JSON
        line that is not an object is labelled ``default`` (:meth:`get` skips it)."""
        labels: list[str] = []
        for table in self._tables:
            if isinstance(table, datasets.Dataset):
                columns = {k: list(table[k]) if k in table.column_names else [None] * len(table)
                           for k in ("task", "data_source")}
                labels += [_task_label(t, d) for t, d in zip(columns["task"], columns["data_source"])]
                continue
            for i in range(len(table)):
                try:
                    row = table[i]
                except BadLine:
                    row = {}
                labels.append(_task_label(row.get("task"), row.get("data_source")))
        return np.array(labels, dtype=object)

    def _row(self, part: int, row_index: int) -> dict[str, Any]:
        """Row ``row_index`` of file ``part``; a line that is not a JSON object is ``bad_schema``."""
        try:
            return self._tables[part][row_index]
        except BadLine as err:
            raise _Skip("bad_schema", str(err)) from err

    def _mark_bad(self, index: int, reason: str) -> None:
        """Global row ``index`` is bad for ``reason``: counted once, skipped from now on."""
        self._bad[index] = reason
        self.skipped[reason] += 1

    def _build(self, index: int, row: dict[str, Any], path: str, row_index: int) -> PromptSample:
        cfg = self.cfg
        problem, answer = row.get(cfg.prompt_key), row.get(cfg.answer_key)
        if not isinstance(problem, str):
            raise _Skip("bad_schema", f"column {cfg.prompt_key!r} must be a string, got {type(problem).__name__}")
        if not problem.strip():
            raise _Skip("empty_prompt", f"column {cfg.prompt_key!r} is empty")
        ground_truth = self._ground_truth(index, answer, path, row_index)
        images, videos = _media_list(row, cfg.image_key), _media_list(row, cfg.video_key)
        options = row.get("options") or []
        if not isinstance(options, (list, tuple)) or not all(isinstance(o, str) for o in options):
            raise _Skip("bad_schema", f"column 'options' must be a list of strings, got {options!r}")
        task = _task_label(row.get("task"), row.get("data_source"))
        messages = self._messages(problem, images, videos, path, row_index)
        vision = self._vision(images, videos, base_dir=Path(path).parent)
        prompt_ids = render_prompt_ids(self.tokenizer, messages, vision.image_grid_thw, vision.video_grid_thw,
                                       merge_size=self.merge_size)
        if prompt_ids.shape[0] > cfg.max_prompt_length:
            raise _Skip("too_long", f"prompt has {prompt_ids.shape[0]} tokens > data.max_prompt_length="
                                    f"{cfg.max_prompt_length}")
        paths = [(item.get("path") or None) if isinstance(item, dict) else str(item) for item in images + videos]
        media = ["<bytes>" if p is None else str(resolve_path(p, Path(path).parent)) for p in paths]
        return PromptSample(uid=f"{self.split}:{index}", prompt_ids=prompt_ids, vision=vision,
                            ground_truth=ground_truth, task=str(task), options=list(options), problem=problem,
                            media=media)

    def _ground_truth(self, index: int, answer: Any, path: str, row_index: int) -> str:
        """The answer as a string: strings as they are; other JSON values as their JSON text
        (``30`` -> ``"30"``, ``[1, 2]`` -> ``"[1, 2]"``), counted once per row in ``coerced``."""
        if isinstance(answer, str):
            return answer
        key = self.cfg.answer_key
        if answer is None:
            raise _Skip("bad_schema", f"column {key!r} is missing or null")
        try:
            text = json.dumps(answer, ensure_ascii=False)
        except (TypeError, ValueError) as err:
            raise _Skip("bad_schema", f"column {key!r} holds a {type(answer).__name__}, expected a string") from err
        if index not in self._coerced_rows:
            self._coerced_rows.add(index)
            self.coerced["coerced_answer"] += 1
            logger.warning("%s row %d: column %r holds a %s, used as the string %r (coerced_answer)",
                           path, row_index, key, type(answer).__name__, text)
        return text

    def _vision(self, images: list, videos: list, base_dir: Path) -> VisionInputs:
        """Load and patchify the row's media; missing/corrupt files become ``_Skip``."""
        cfg, geometry = self.cfg, dict(patch_size=self.patch_size, temporal_patch_size=self.temporal_patch_size,
                                       merge_size=self.merge_size)
        out = VisionInputs()
        try:
            if images:
                pil = [load_image(item, base_dir) for item in images]
                out.pixel_values, out.image_grid_thw = patchify_images(
                    pil, min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels, **geometry)
            parts = []
            for item in videos:
                video_path = item.get("path") if isinstance(item, dict) else item
                if not video_path:
                    raise _Skip("bad_schema", f"video item {item!r} has no path")
                frames, sample_fps = load_video(resolve_path(video_path, base_dir), fps=cfg.video_fps,
                                                max_frames=cfg.video_max_frames,
                                                temporal_patch_size=self.temporal_patch_size)
                parts.append(patchify_video(frames, min_pixels=cfg.video_min_pixels,
                                            max_pixels=cfg.video_max_pixels, sample_fps=sample_fps, **geometry))
        except FileNotFoundError as err:
            raise _Skip("missing_media", str(err)) from err
        except ValueError as err:
            raise _Skip("corrupt_media", str(err)) from err
        if len(parts) == 1:
            out.pixel_values_videos, out.video_grid_thw, out.second_per_grid_ts = parts[0]
        elif parts:
            out.pixel_values_videos, out.video_grid_thw, out.second_per_grid_ts = (
                torch.cat([p[k] for p in parts]) for k in range(3))
        return out

    def precheck(self) -> collections.Counter:
        """Check every row without decoding media, before training starts: schema, placeholder
        counts, media files exist, image headers readable, and the prompt's length in tokens
        (images' tokens from their header sizes, each video counted as one token: a lower bound)
        against ``data.max_prompt_length``. Bad rows are counted in :attr:`skipped` and skipped by
        :meth:`get` without a retry. One warning sums them up (counts by reason, the first row of each).

        Returns:
            :attr:`skipped` (bad rows by reason; media whose body is corrupt behind a good header,
            and prompts too long only by their videos' tokens, are found when a row is loaded).
        """
        first: dict[str, str] = {}
        for part, (path, table) in enumerate(zip(self._paths, self._tables)):
            for row_index in range(len(table)):
                try:
                    self._precheck_row(self._row(part, row_index), path, row_index)
                except _Skip as skip:
                    self._mark_bad(int(self._offsets[part]) + row_index, skip.reason)
                    first.setdefault(skip.reason, f"{path} row {row_index}: {skip}")
        if first:
            logger.warning("split %r: %d of %d rows skipped (%s); first of each: %s", self.split, self.num_bad, len(self),
                           ", ".join(f"{k} {v}" for k, v in sorted(self.skipped.items())), " | ".join(first.values()))
        return self.skipped

    def _messages(self, problem: str, images: list, videos: list, path: str, row_index: int) -> list[dict]:
        """The row's chat messages (``data/prompts.build_messages``); a placeholder count that does
        not match its media is skipped as ``placeholder_mismatch``."""
        try:
            return build_messages(problem, num_images=len(images), num_videos=len(videos),
                                  system_prompt=self.cfg.system_prompt, format_prompt=self.format_prompt,
                                  name=f"{path} row {row_index}")
        except ValueError as err:
            raise _Skip("placeholder_mismatch", str(err)) from err

    def _precheck_row(self, row: dict[str, Any], path: str, row_index: int) -> None:
        cfg = self.cfg
        problem, answer = row.get(cfg.prompt_key), row.get(cfg.answer_key)
        if not isinstance(problem, str):
            raise _Skip("bad_schema", f"column {cfg.prompt_key!r} must be a string, got {type(problem).__name__}")
        if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
            raise _Skip("bad_schema", f"column {cfg.answer_key!r} must be a string, got {type(answer).__name__}")
        images, videos = _media_list(row, cfg.image_key), _media_list(row, cfg.video_key)
        messages = self._messages(problem, images, videos, path, row_index)
        for item in images + videos:
            if isinstance(item, dict) and item.get("bytes") is not None:
                continue
            file = item.get("path") if isinstance(item, dict) else item
            if not file:
                raise _Skip("bad_schema", f"media item {item!r} has no path")
            if not resolve_path(file, Path(path).parent).is_file():
                raise _Skip("missing_media", f"media file not found: {resolve_path(file, Path(path).parent)}")
        grids = []
        for item in images:  # headers only: an unreadable one is corrupt; the size gives the tokens
            try:
                grids.append(image_grid(*image_size(item, Path(path).parent), min_pixels=cfg.min_pixels,
                                        max_pixels=cfg.max_pixels, patch_size=self.patch_size,
                                        merge_size=self.merge_size))
            except ValueError as err:
                raise _Skip("corrupt_media", str(err)) from err
        one_token = (1, self.merge_size, self.merge_size)  # a video has at least one: a lower bound
        length = render_prompt_ids(self.tokenizer, messages, torch.tensor(grids) if grids else None,
                                   torch.tensor([one_token] * len(videos)) if videos else None,
                                   merge_size=self.merge_size).shape[0]
        if length > cfg.max_prompt_length:
            raise _Skip("too_long", f"prompt has {'at least ' if videos else ''}{length} tokens > "
                                    f"data.max_prompt_length={cfg.max_prompt_length}")

    def iter_all(self, batch_size: int, max_samples: int = -1) -> Iterator[list[PromptSample]]:
        """One pass in row order, valid samples in lists of ``batch_size`` (the last may be shorter).

        Args:
            batch_size: prompts per list (> 0).
            max_samples: stop after this many valid prompts (-1: all).
        """
        if batch_size <= 0:
            raise ValueError(f"batch_size={batch_size}: expected > 0")
        batch: list[PromptSample] = []
        taken = 0
        for index in range(len(self)):
            if 0 <= max_samples <= taken:
                break
            sample = self.get(index)
            if sample is None:
                continue
            batch.append(sample)
            taken += 1
            if len(batch) == batch_size:
                yield batch
                batch = []
        if batch:
            yield batch


from rollplex_train.data.loader import PromptLoader  # noqa: E402,F401  (its home before data/loader.py)
