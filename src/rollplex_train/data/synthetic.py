"""Deterministic synthetic visual tasks in the EasyR1 / geometry3k manifest schema.

Three tasks, each small enough that a tiny VLM can learn it in a few hundred RL steps:

- ``color``: one filled shape (circle, square or triangle) of one of four colours on a plain light
  background; the answer is the colour (4 options).
- ``count``: 1-4 shapes of one colour, each in its own cell of a grid of 28x28-pixel cells (one
  cell is one vision token of Qwen2.5-VL: 14-pixel patches merged 2x2); the answer is the number.
- ``direction``: a short H.264 video (default 8 frames at 4 fps) of one shape moving left, right,
  up or down; the answer is the direction (4 options).

Layout written under ``out``::

    out/train.parquet, out/val.parquet                 all tasks, interleaved
    out/<task>_train.parquet, out/<task>_val.parquet   one task
    out/media/<task>/<split>/<index>.png|.mp4          the media (paths in manifests are relative to out)

Manifest columns: ``problem`` (str, with ``<image>``/``<video>`` where the media go), ``answer`` (str),
``images`` (list[str]), ``videos`` (list[str]), ``task`` (str), ``options`` (list[str]).

Every sample is drawn from its own ``numpy`` generator seeded by ``(seed, task, split, index)``, so a
rerun with the same arguments rewrites byte-identical files, and answers are balanced exactly
(``index % num_answers``, then the sample order is permuted).
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image, ImageDraw

logger = logging.getLogger(__name__)

TASKS = ("color", "count", "direction")
SPLITS = ("train", "val")
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (235, 200, 30),
}
SHAPES = ("circle", "square", "triangle")
DIRECTIONS = ("left", "right", "up", "down")
MAX_COUNT = 4
COUNT_CELL = 28  # pixels: one merged vision token (patch 14 x spatial merge 2)

MANIFEST_SCHEMA = pa.schema(
    [
        ("problem", pa.string()),
        ("answer", pa.string()),
        ("images", pa.list_(pa.string())),
        ("videos", pa.list_(pa.string())),
        ("task", pa.string()),
        ("options", pa.list_(pa.string())),
    ]
)

COLOR_PROBLEM = "<image>What is the colour of the shape? Options: red, green, blue, yellow."
COUNT_PROBLEM = "<image>How many shapes are in the image? Answer with a number from 1 to 4."
DIRECTION_PROBLEM = "<video>Which way does the shape move? Options: left, right, up, down."


@dataclass(kw_only=True)
class VisualTaskSpec:
    """Sizes and counts of the generated tasks.

    Attributes:
        num_train: samples per task in the train split.
        num_val: samples per task in the val split.
        seed: base seed; every sample derives its own generator from it.
        color_size: side of the square ``color`` images, pixels.
        count_size: side of the square ``count`` images, pixels (a multiple of 28 with at least
            four 28-pixel cells).
        direction_size: side of the square ``direction`` video frames, pixels (even, for yuv420p).
        num_frames: frames per ``direction`` video.
        video_fps: frame rate written into the mp4, frames per second.
        tasks: which tasks to generate (subset of ``TASKS``).
    """

    num_train: int = 512
    num_val: int = 64
    seed: int = 0
    color_size: int = 56
    count_size: int = 56
    direction_size: int = 56
    num_frames: int = 8
    video_fps: int = 4
    tasks: tuple[str, ...] = TASKS

    def __post_init__(self) -> None:
        for key in ("num_train", "num_val"):
            if getattr(self, key) < 0:
                raise ValueError(f"{key}={getattr(self, key)}: expected >= 0")
        for key in ("color_size", "count_size", "direction_size"):
            if getattr(self, key) < 16:
                raise ValueError(f"{key}={getattr(self, key)}: expected >= 16 pixels")
        if self.count_size % COUNT_CELL or (self.count_size // COUNT_CELL) ** 2 < MAX_COUNT:
            raise ValueError(f"count_size={self.count_size}: expected a multiple of {COUNT_CELL} pixels "
                             f"with room for {MAX_COUNT} cells")
        if self.direction_size % 2:
            raise ValueError(f"direction_size={self.direction_size}: H.264 yuv420p needs an even size")
        if self.num_frames < 2 or self.video_fps < 1:
            raise ValueError(f"num_frames={self.num_frames}, video_fps={self.video_fps}: expected >= 2 and >= 1")
        unknown = [t for t in self.tasks if t not in TASKS]
        if unknown or not self.tasks:
            raise ValueError(f"tasks={list(self.tasks)}: expected a non-empty subset of {list(TASKS)}")


def _background(rng: np.random.Generator) -> tuple[int, int, int]:
    level = int(rng.integers(232, 250))
    return (level, level, level)


def _draw_shape(draw: ImageDraw.ImageDraw, shape: str, box: tuple[int, int, int, int], fill: tuple) -> None:
    """Fill ``shape`` inside the pixel box ``(x0, y0, x1, y1)`` (inclusive corners)."""
    x0, y0, x1, y1 = box
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    else:
        draw.polygon([((x0 + x1) / 2, y0), (x1, y1), (x0, y1)], fill=fill)


def _color_image(rng: np.random.Generator, answer_index: int, size: int) -> Image.Image:
    """One shape of colour ``list(COLORS)[answer_index]`` at a random position and size."""
    colour = COLORS[list(COLORS)[answer_index]]
    img = Image.new("RGB", (size, size), _background(rng))
    # A large shape (half to nearly all of the side): the colour is visible in every vision token.
    side = int(rng.integers(size // 2, size - 3))
    x0 = int(rng.integers(0, size - side))
    y0 = int(rng.integers(0, size - side))
    _draw_shape(ImageDraw.Draw(img), SHAPES[int(rng.integers(len(SHAPES)))], (x0, y0, x0 + side, y0 + side), colour)
    return img


def _count_image(rng: np.random.Generator, count: int, size: int) -> Image.Image:
    """``count`` shapes of one random colour, each in a distinct random cell of the 28-pixel grid.

    A shape covers 60-90% of its cell's side at a random offset inside it, so shapes never touch and
    the count equals the number of vision tokens that hold a shape.
    """
    colour = COLORS[list(COLORS)[int(rng.integers(len(COLORS)))]]
    img = Image.new("RGB", (size, size), _background(rng))
    draw = ImageDraw.Draw(img)
    cells = size // COUNT_CELL
    for cell in rng.choice(cells * cells, size=count, replace=False):
        side = int(rng.integers(COUNT_CELL * 6 // 10, COUNT_CELL * 9 // 10 + 1))
        x0 = int(cell % cells) * COUNT_CELL + int(rng.integers(0, COUNT_CELL - side + 1))
        y0 = int(cell // cells) * COUNT_CELL + int(rng.integers(0, COUNT_CELL - side + 1))
        _draw_shape(draw, SHAPES[int(rng.integers(len(SHAPES)))], (x0, y0, x0 + side - 1, y0 + side - 1), colour)
    return img


def _direction_frames(rng: np.random.Generator, answer_index: int, size: int, num_frames: int) -> np.ndarray:
    """Frames (T, size, size, 3) uint8 of one shape moving in ``DIRECTIONS[answer_index]``.

    A large shape (3/8 to 1/2 of the side) moves a few pixels per frame (3/8 of the side in all):
    its leading and trailing edges shift inside a patch between the two frames of one temporal patch,
    so the motion is visible to the vision tower's first layer wherever the shape is.
    """
    direction = DIRECTIONS[answer_index]
    colour = COLORS[list(COLORS)[int(rng.integers(len(COLORS)))]]
    shape = SHAPES[int(rng.integers(len(SHAPES)))]
    background = _background(rng)
    side = int(rng.integers(size * 3 // 8, size // 2 + 1))
    travel = size * 3 // 8
    start = int(rng.integers(0, size - side - travel + 1))
    cross = int(rng.integers(0, size - side + 1))
    frames = []
    for t in range(num_frames):
        along = start + round(travel * t / (num_frames - 1))
        if direction in ("left", "up"):
            along = size - side - along
        x0, y0 = (along, cross) if direction in ("left", "right") else (cross, along)
        img = Image.new("RGB", (size, size), background)
        _draw_shape(ImageDraw.Draw(img), shape, (x0, y0, x0 + side - 1, y0 + side - 1), colour)
        frames.append(np.asarray(img))
    return np.stack(frames)


def write_mp4(path: Path, frames: np.ndarray, fps: int) -> None:
    """Encode frames (T, H, W, 3) uint8 RGB as H.264 yuv420p MP4 with PyAV (single-threaded: byte-stable).

    Raises:
        ValueError: frames are not (T, H, W, 3) uint8 with even H and W.
    """
    import av

    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
        raise ValueError(f"{path}: expected frames (T, H, W, 3) uint8, got {frames.shape} {frames.dtype}")
    height, width = frames.shape[1:3]
    if height % 2 or width % 2:
        raise ValueError(f"{path}: yuv420p needs even frame sizes, got {height}x{width}")
    with av.open(str(path), "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        # byte-stable output: with only ``threads=1`` about 1 video in 40 came out with different
        # bytes from one encode to the next (x264's macroblock-tree rate control; off here)
        stream.options = {"crf": "18", "threads": "1",
                          "x264-params": "threads=1:lookahead-threads=1:mbtree=0"}
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def _num_answers(task: str) -> int:
    return {"color": len(COLORS), "count": MAX_COUNT, "direction": len(DIRECTIONS)}[task]


def _make_row(task: str, answer_index: int, rng: np.random.Generator, rel: str, out: Path,
              spec: VisualTaskSpec) -> dict:
    """Draw one sample, write its media file to ``out / rel`` (+ extension) and return its manifest row."""
    if task == "color":
        rel += ".png"
        _color_image(rng, answer_index, spec.color_size).save(out / rel, format="PNG")
        return dict(problem=COLOR_PROBLEM, answer=list(COLORS)[answer_index], images=[rel], videos=[],
                    task=task, options=list(COLORS))
    if task == "count":
        rel += ".png"
        _count_image(rng, answer_index + 1, spec.count_size).save(out / rel, format="PNG")
        return dict(problem=COUNT_PROBLEM, answer=str(answer_index + 1), images=[rel], videos=[],
                    task=task, options=[str(k) for k in range(1, MAX_COUNT + 1)])
    rel += ".mp4"
    write_mp4(out / rel, _direction_frames(rng, answer_index, spec.direction_size, spec.num_frames), spec.video_fps)
    return dict(problem=DIRECTION_PROBLEM, answer=DIRECTIONS[answer_index], images=[], videos=[rel],
                task=task, options=list(DIRECTIONS))


def _generate_split(task: str, split: str, count: int, out: Path, spec: VisualTaskSpec) -> list[dict]:
    """Rows of one (task, split), answers balanced, order permuted by a seeded generator."""
    task_id, split_id = TASKS.index(task), SPLITS.index(split)
    media_dir = out / "media" / task / split
    if media_dir.exists():
        shutil.rmtree(media_dir)  # stale files of an earlier, larger run would otherwise linger
    media_dir.mkdir(parents=True)
    order = np.random.default_rng([spec.seed, task_id, split_id]).permutation(count)
    rows = []
    for index in range(count):
        rng = np.random.default_rng([spec.seed, task_id, split_id, index])
        answer_index = int(order[index]) % _num_answers(task)
        rows.append(_make_row(task, answer_index, rng, f"media/{task}/{split}/{index:06d}", out, spec))
    return rows


def write_manifest(path: Path, rows: list[dict]) -> None:
    """Write rows as a parquet file with ``MANIFEST_SCHEMA``."""
    pq.write_table(pa.Table.from_pylist(rows, schema=MANIFEST_SCHEMA), path)


def generate_visual_tasks(out: str | Path, spec: VisualTaskSpec | None = None,
                          progress: Callable[[str], None] | None = None) -> dict[str, Path]:
    """Generate the tasks of ``spec`` under ``out`` (overwriting earlier output deterministically).

    Args:
        out: output directory (created if missing).
        spec: sizes and counts (defaults: 512 train / 64 val per task).
        progress: optional callback called with a short message after each (task, split).

    Returns:
        Manifest name (``train``, ``val``, ``<task>_train``, ``<task>_val``) -> parquet path.
    """
    spec = spec or VisualTaskSpec()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    manifests: dict[str, Path] = {}
    for split in SPLITS:
        count = spec.num_train if split == "train" else spec.num_val
        per_task = {}
        for task in spec.tasks:
            per_task[task] = _generate_split(task, split, count, out, spec)
            manifests[f"{task}_{split}"] = out / f"{task}_{split}.parquet"
            write_manifest(manifests[f"{task}_{split}"], per_task[task])
            msg = f"{task}/{split}: {count} samples"
            logger.info(msg)
            if progress is not None:
                progress(msg)
        # Interleave task by task (row i of each task in turn) so any prefix of the mix is balanced.
        mixed = [rows[i] for i in range(count) for rows in per_task.values()]
        manifests[split] = out / f"{split}.parquet"
        write_manifest(manifests[split], mixed)
    return manifests
