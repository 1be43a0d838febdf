"""Largest element-wise difference between the final actor weights of two runs.

    python scripts/compare_actor_weights.py RUN_DIR_A RUN_DIR_B

Each run directory holds ``checkpoints/*/actor.pt`` (the torch backend saves one at the end of a run),
the newest of which is compared, or else ``hf_actor/model.safetensors`` (the exported actor: the
Megatron backend's checkpoints are TP shards). Prints ``max_abs_diff=<x> tensors=<n>`` and exits 1 if the tensor names differ.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch


def actor_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    found = sorted(run_dir.glob("checkpoints/*/actor.pt"), key=lambda p: p.stat().st_mtime)
    if found:
        return torch.load(found[-1], weights_only=True)
    exported = run_dir / "hf_actor" / "model.safetensors"
    if not exported.is_file():
        sys.exit(f"{run_dir}: no checkpoints/*/actor.pt and no hf_actor/model.safetensors")
    from safetensors.torch import load_file

    return load_file(str(exported))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("a", type=Path)
    parser.add_argument("b", type=Path)
    args = parser.parse_args()
    a, b = actor_weights(args.a), actor_weights(args.b)
    if a.keys() != b.keys():
        print(f"tensor names differ: {sorted(set(a) ^ set(b))[:5]}")
        sys.exit(1)
    worst = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
    print(f"max_abs_diff={worst:.3g} tensors={len(a)}")


if __name__ == "__main__":
    main()
