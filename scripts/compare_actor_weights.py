"""Largest element-wise difference between the final actor weights of two runs.

    python scripts/compare_actor_weights.py RUN_DIR_A RUN_DIR_B

Each run directory holds ``checkpoints/*/actor.pt`` (a run saves one at its end); the newest of each
is compared. Prints ``max_abs_diff=<x> tensors=<n>`` and exits 1 if the tensor names differ.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch


def newest_actor(run_dir: Path) -> Path:
    found = sorted(run_dir.glob("checkpoints/*/actor.pt"), key=lambda p: p.stat().st_mtime)
    if not found:
        sys.exit(f"{run_dir}: no checkpoints/*/actor.pt")
    return found[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("a", type=Path)
    parser.add_argument("b", type=Path)
    args = parser.parse_args()
    a = torch.load(newest_actor(args.a), weights_only=True)
    b = torch.load(newest_actor(args.b), weights_only=True)
    if a.keys() != b.keys():
        print(f"tensor names differ: {sorted(set(a) ^ set(b))[:5]}")
        sys.exit(1)
    worst = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
    print(f"max_abs_diff={worst:.3g} tensors={len(a)}")


if __name__ == "__main__":
    main()
