"""The built-in engine's generate with its fused decode step against transformers' forward, side by side.

    python scripts/bench_decode.py                          # bench_short, bench_image, bench_video
    python scripts/bench_decode.py --workloads bench_image --rounds 5

Per workload (``conf/experiment/<w>.yaml``: its checkpoint, first rollout batch of prompts, G,
response length, ignore_eos): one engine, ``generate`` timed in interleaved rounds (transformers'
forward, then the fused step, ``rollout/decoder.py``), on this process's torch threads. Prints the
seconds of each round, the median of the per-round ratios (each round's two runs are neighbours
in time, so slow spells of a shared machine cancel), the ratio of the fastest runs, and whether both
sampled the same tokens and log-probs; the last line is ``decode: <w>=<median per-round ratio> ...``
(transformers / fused, > 1: fused faster).

Raises SystemExit(1) when the two sampled different tokens (the fused step must be the same forward).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time

import torch

from rollplex_train.bench.peers import compose_config
from rollplex_train.cli import conf_dir
from rollplex_train.data.dataset import PromptDataset
from rollplex_train.models.loading import load_tokenizer
from rollplex_train.rollout.base import SamplingParams
from rollplex_train.rollout.builtin import BuiltinRolloutEngine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    ratios, same = {}, True
    for workload in args.workloads.split(","):
        cfg = compose_config(workload, [])
        dataset = PromptDataset(cfg.data, load_tokenizer(cfg.model.path), cfg.data.train_files, "train")
        prompts = [dataset.get(i) for i in range(cfg.data.rollout_batch_size)]
        engine = BuiltinRolloutEngine(cfg.model.path, attn_implementation=cfg.model.attn_implementation)
        if engine.fused_decode_unsupported:
            sys.exit(f"{workload}: the fused decode step does not apply ({engine.fused_decode_unsupported})")
        params = SamplingParams(n=cfg.rollout.n, temperature=cfg.rollout.temperature,
                                max_new_tokens=cfg.rollout.max_new_tokens, ignore_eos=cfg.rollout.ignore_eos, seed=3)
        seconds: dict[str, list[float]] = {"transformers": [], "fused": []}
        outputs = {}
        for _ in range(args.rounds):
            for mode in seconds:
                engine.fused_decode_unsupported = None if mode == "fused" else "off (bench_decode.py)"
                start = time.perf_counter()
                outputs[mode] = engine.generate(prompts, params)
                seconds[mode].append(time.perf_counter() - start)
        equal = all(a.token_ids.tolist() == b.token_ids.tolist() and torch.equal(a.logprobs, b.logprobs)
                    for a, b in zip(outputs["transformers"], outputs["fused"]))
        same &= equal
        ratios[workload] = statistics.median(t / f for t, f in zip(seconds["transformers"], seconds["fused"]))
        fastest = min(seconds["transformers"]) / min(seconds["fused"])
        print(f"{workload}: {len(prompts)} prompts x G={params.n}, {params.max_new_tokens} tokens; generate s "
              f"transformers {[round(s, 2) for s in seconds['transformers']]} fused "
              f"{[round(s, 2) for s in seconds['fused']]}; median per-round ratio {ratios[workload]:.3f}, "
              f"fastest/fastest {fastest:.3f}; same tokens and log-probs: {equal}")
    print("decode: " + " ".join(f"{w}={r:.3f}" for w, r in ratios.items()))
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
