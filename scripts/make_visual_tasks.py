#!/usr/bin/env python
"""Write the synthetic visual tasks (color, count, direction) as parquet manifests + PNG/MP4 media.

Example: ``python scripts/make_visual_tasks.py --out artifacts/data/visual_tasks``
(see ``rollplex_train.data.synthetic`` for the layout and schema).
"""

from __future__ import annotations

import argparse
import logging
import time

from rollplex_train.data.synthetic import TASKS, VisualTaskSpec, generate_visual_tasks


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="output directory (rewritten deterministically)")
    d = VisualTaskSpec()  # the defaults live in one place
    p.add_argument("--num-train", type=int, default=d.num_train, help="train samples per task")
    p.add_argument("--num-val", type=int, default=d.num_val, help="val samples per task")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated subset of {','.join(TASKS)}")
    p.add_argument("--color-size", type=int, default=d.color_size, help="color image side, pixels")
    p.add_argument("--count-size", type=int, default=d.count_size, help="count image side, pixels (multiple of 28)")
    p.add_argument("--direction-size", type=int, default=d.direction_size, help="direction video frame side, pixels")
    p.add_argument("--num-frames", type=int, default=d.num_frames, help="frames per direction video")
    p.add_argument("--video-fps", type=int, default=d.video_fps, help="direction video frame rate")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    spec = VisualTaskSpec(
        num_train=args.num_train,
        num_val=args.num_val,
        seed=args.seed,
        color_size=args.color_size,
        count_size=args.count_size,
        direction_size=args.direction_size,
        num_frames=args.num_frames,
        video_fps=args.video_fps,
        tasks=tuple(t.strip() for t in args.tasks.split(",") if t.strip()),
    )
    start = time.perf_counter()
    manifests = generate_visual_tasks(args.out, spec)
    logging.getLogger("make_visual_tasks").info(
        "wrote %d manifests under %s in %.1f s", len(manifests), args.out, time.perf_counter() - start
    )


if __name__ == "__main__":
    main()
