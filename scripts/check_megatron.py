"""Check the Megatron backend against HF transformers at TP=1 and TP=2 (gloo, CPU processes).

Usage: .venv/bin/python scripts/check_megatron.py [--ckpt artifacts/checkpoints/tiny-qwen25vl]
       [--tasks artifacts/data/visual_tasks/train.parquet]

Prints one line per TP degree; the last is
``megatron: tp=2 max_abs_logit_diff=<a> max_abs_logprob_diff_split=<b> max_rel_grad_diff=<c> hf_roundtrip=<exact|differs>``
(what each number is: ``rollplex_train/training/megatron/check.py``). Exit code 1 when a number is
over its bound (a, b <= 1e-5; c <= 1e-4) or the round trip differs.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile


def main(argv: list[str] | None = None) -> int:
    from rollplex_train.config import DataConfig
    from rollplex_train.data.dataset import PromptDataset
    from rollplex_train.models.loading import load_tokenizer
    from rollplex_train.training.megatron.check import check_rank, format_result, run_ranks

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt", default="artifacts/checkpoints/tiny-qwen25vl")
    parser.add_argument("--tasks", default="artifacts/data/visual_tasks/train.parquet")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("PYTHONWARNINGS", "ignore")  # the spawned ranks: megatron warns about absent apex/TE
    dataset = PromptDataset(DataConfig(train_files=args.tasks, val_files=""), load_tokenizer(args.ckpt),
                            args.tasks, "check")
    first: dict[str, object] = {}
    for index in range(len(dataset)):  # one prompt per task: two image sizes and a video
        sample = dataset.get(index)
        if sample is not None:
            first.setdefault(sample.task, sample)
        if len(first) == 3:
            break
    prompts = list(first.values())
    ok = True
    with tempfile.TemporaryDirectory(prefix="check-megatron-") as out_dir:
        for tp in args.tp:
            result = run_ranks(check_rank, tp, args.ckpt, prompts, out_dir)
            ok &= (result["max_abs_logit_diff"] <= 1e-5 and result["max_abs_logprob_diff_split"] <= 1e-5
                   and result["max_rel_grad_diff"] <= 1e-4 and result["hf_roundtrip"] == "exact")
            sys.stdout.write(format_result(result) + "\n")
            sys.stdout.flush()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
