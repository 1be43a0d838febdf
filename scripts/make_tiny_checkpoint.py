"""Write a tiny Qwen2.5-VL / Qwen2-VL checkpoint directory (config, safetensors, tokenizer,
image-processor config), format-warmed-up on the generated visual tasks.

    python scripts/make_tiny_checkpoint.py --size tiny --out artifacts/checkpoints/tiny-qwen25vl \
        --tasks artifacts/data/visual_tasks
"""

import argparse
import logging

from rollplex_train.models.tiny import SIZES, make_tiny_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="checkpoint directory to write")
    parser.add_argument("--arch", default="qwen2_5_vl", choices=["qwen2_5_vl", "qwen2_vl"])
    parser.add_argument("--size", default="tiny", choices=sorted(SIZES))
    parser.add_argument("--tasks", default=None, help="visual tasks dir for the format warm-up (omit: none)")
    parser.add_argument("--warmup-steps", type=int, default=50)
    parser.add_argument("--warmup-batch-size", type=int, default=32)
    parser.add_argument("--warmup-lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    path, losses = make_tiny_checkpoint(
        args.out, arch=args.arch, size=args.size, tasks_dir=args.tasks, warmup_steps=args.warmup_steps,
        warmup_batch_size=args.warmup_batch_size, warmup_lr=args.warmup_lr, seed=args.seed,
    )
    final = f", final warm-up nll {losses[-1]:.4f}" if losses else ""
    logging.info("wrote %s%s", path, final)


if __name__ == "__main__":
    main()
