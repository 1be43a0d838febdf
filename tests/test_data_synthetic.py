"""The synthetic visual-task generator: deterministic, balanced, readable media, EasyR1 schema."""

from __future__ import annotations

import collections
import hashlib
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image

from rollplex_train.data.synthetic import COLORS, DIRECTIONS, TASKS, VisualTaskSpec, generate_visual_tasks

SPEC = VisualTaskSpec(num_train=12, num_val=4, seed=3)
REPO = Path(__file__).resolve().parents[1]


def _digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def tasks_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("visual_tasks")
    generate_visual_tasks(out, SPEC)
    return out


def test_layout_and_schema(tasks_dir: Path):
    names = {"train", "val"} | {f"{t}_{s}" for t in TASKS for s in ("train", "val")}
    assert {p.stem for p in tasks_dir.glob("*.parquet")} == names
    table = pq.read_table(tasks_dir / "train.parquet")
    assert table.column_names == ["problem", "answer", "images", "videos", "task", "options"]
    rows = table.to_pylist()
    assert len(rows) == 3 * SPEC.num_train
    assert collections.Counter(r["task"] for r in rows) == {t: SPEC.num_train for t in TASKS}
    for r in rows:
        assert r["problem"].count("<image>") == len(r["images"])
        assert r["problem"].count("<video>") == len(r["videos"])
        for rel in r["images"] + r["videos"]:
            assert not Path(rel).is_absolute() and (tasks_dir / rel).is_file()
        if r["task"] == "color":
            assert r["options"] == list(COLORS) and r["answer"] in COLORS
        elif r["task"] == "direction":
            assert r["options"] == list(DIRECTIONS) and r["answer"] in DIRECTIONS
        else:
            assert r["options"] == ["1", "2", "3", "4"] and r["answer"] in {"1", "2", "3", "4"}


def test_answers_balanced(tasks_dir: Path):
    for task, k in (("color", 4), ("count", 4), ("direction", 4)):
        counts = collections.Counter(pq.read_table(tasks_dir / f"{task}_train.parquet").column("answer").to_pylist())
        assert len(counts) == k and max(counts.values()) - min(counts.values()) <= 1, (task, counts)


def test_media_readable(tasks_dir: Path):
    import decord

    rows = pq.read_table(tasks_dir / "val.parquet").to_pylist()
    sizes = {"color": SPEC.color_size, "count": SPEC.count_size}
    for r in rows:
        for rel in r["images"]:
            with Image.open(tasks_dir / rel) as img:
                assert img.format == "PNG" and img.size == (sizes[r["task"]],) * 2
        for rel in r["videos"]:
            reader = decord.VideoReader(str(tasks_dir / rel))
            assert len(reader) == SPEC.num_frames
            assert reader.get_avg_fps() == pytest.approx(SPEC.video_fps)
            frames = reader.get_batch(list(range(len(reader)))).asnumpy()
            assert frames.shape == (SPEC.num_frames, SPEC.direction_size, SPEC.direction_size, 3)
            assert not np.array_equal(frames[0], frames[-1])  # the shape moves


def test_direction_video_moves_the_right_way(tasks_dir: Path):
    import decord

    for r in pq.read_table(tasks_dir / "direction_train.parquet").to_pylist():
        frames = decord.VideoReader(str(tasks_dir / r["videos"][0])).get_batch([0, SPEC.num_frames - 1]).asnumpy()
        centres = []
        for f in frames.astype(np.int32):
            mask = np.abs(f - f[0, 0]).sum(-1) > 60  # pixels far from the background corner
            ys, xs = np.nonzero(mask)
            centres.append((xs.mean(), ys.mean()))
        dx, dy = centres[1][0] - centres[0][0], centres[1][1] - centres[0][1]
        expect = ("right" if dx > 0 else "left") if abs(dx) > abs(dy) else ("down" if dy > 0 else "up")
        assert expect == r["answer"]


def test_deterministic_and_idempotent(tasks_dir: Path, tmp_path: Path):
    other = tmp_path / "again"
    generate_visual_tasks(other, SPEC)
    assert _digest(other) == _digest(tasks_dir)
    generate_visual_tasks(other, VisualTaskSpec(num_train=20, num_val=4, seed=3))
    generate_visual_tasks(other, SPEC)  # shrinking again leaves no stale media behind
    assert _digest(other) == _digest(tasks_dir)
    changed = tmp_path / "seed4"
    generate_visual_tasks(changed, VisualTaskSpec(num_train=12, num_val=4, seed=4))
    assert _digest(changed) != _digest(tasks_dir)


def test_script_runs(tmp_path: Path):
    out = tmp_path / "script"
    cmd = [sys.executable, str(REPO / "scripts" / "make_visual_tasks.py"), "--out", str(out),
           "--num-train", "4", "--num-val", "2", "--tasks", "color,direction"]
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    assert pq.read_table(out / "train.parquet").num_rows == 8
    assert not (out / "count_train.parquet").exists()


def test_bad_spec():
    with pytest.raises(ValueError, match="tasks"):
        VisualTaskSpec(tasks=("shapes",))
    with pytest.raises(ValueError, match="direction_size"):
        VisualTaskSpec(direction_size=57)
