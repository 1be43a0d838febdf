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

import statistics
import sys
import time

import torch

from rollplex_train.bench.decode import decode_bench_args, workload_engine


def main() -> None:
    args = decode_bench_args(__doc__)
    ratios, same = {}, True
    for workload in args.workloads.split(","):
        engine, prompts, params = workload_engine(workload)
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
