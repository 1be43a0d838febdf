"""What the decode benchmarks (``scripts/bench_decode.py``, ``scripts/bench_prompt_kv.py``) share:
their command line and one workload's engine, prompts and sampling parameters."""

from __future__ import annotations

import argparse
import logging
import sys

import torch

from rollplex_train.bench.peers import compose_config


def decode_bench_args(doc: str) -> argparse.Namespace:
    """``--workloads`` (comma-separated ``conf/experiment`` names), ``--rounds``, ``--threads``, checked;
    sets the torch threads. Exits with one line on an unknown workload or ``--rounds < 1``."""
    from rollplex_train.cli import conf_dir

    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="bench_short,bench_image,bench_video")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if args.rounds < 1:
        sys.exit(f"--rounds={args.rounds}: expected at least 1")
    for workload in args.workloads.split(","):
        if not (conf_dir() / "experiment" / f"{workload}.yaml").is_file():
            sys.exit(f"--workloads: no experiment {workload!r} in {conf_dir() / 'experiment'}")
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    return args


def workload_engine(workload: str):
    """``(engine, prompts, params)`` of a workload: a built-in engine on its checkpoint, its first
    rollout batch and its sampling settings (seed 3). Exits when the fused decode step does not apply."""
    from rollplex_train.data.dataset import PromptDataset
    from rollplex_train.models.loading import load_tokenizer
    from rollplex_train.rollout.base import SamplingParams
    from rollplex_train.rollout.builtin import BuiltinRolloutEngine

    cfg = compose_config(workload, [])
    dataset = PromptDataset(cfg.data, load_tokenizer(cfg.model.path), cfg.data.train_files, "train")
    prompts = [dataset.get(i) for i in range(cfg.data.rollout_batch_size)]
    engine = BuiltinRolloutEngine(cfg.model.path, attn_implementation=cfg.model.attn_implementation)
    if engine.fused_decode_unsupported:
        sys.exit(f"{workload}: the fused decode step does not apply ({engine.fused_decode_unsupported})")
    params = SamplingParams(n=cfg.rollout.n, temperature=cfg.rollout.temperature,
                            max_new_tokens=cfg.rollout.max_new_tokens, ignore_eos=cfg.rollout.ignore_eos, seed=3)
    return engine, prompts, params
