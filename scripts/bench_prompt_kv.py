"""The built-in engine's decode over one prompt KV copy per group against the repeated cache, side by side.

    python scripts/bench_prompt_kv.py                          # bench_short, bench_image, bench_video
    python scripts/bench_prompt_kv.py --workloads bench_image --rounds 5

Per workload (``conf/experiment/<w>.yaml``: its checkpoint, first rollout batch of prompts, G,
response length, ignore_eos): one engine; each prompt is prefilled once (``encode_prefix``, the
engine's own prefill) and handed in, so a timed ``generate`` is the decode alone. ``generate`` is
timed in interleaved rounds, ``rollout.share_prompt_kv`` off (the prompt's cache repeated G times)
then on (one copy per group, ``rollout/shared_prefix.py``), on this process's torch threads.
Prints per workload the seconds of each round, the median of the per-round ratios repeated /
shared (> 1: the shared copy decodes faster; each round's two runs are neighbours in time), the
milliseconds per decode step, the bytes of the decode KV cache each engine allocated (its own
tensors, ``engine.kv_cache_bytes``) and their ratio, how many responses got another token (the
two attentions round differently, so a near tie can flip a draw; the response then goes its own
way) and the largest log-prob difference before a response's first different token. The last line
is ``prompt_kv: <w>=<time ratio>x/<bytes ratio>x ...``.
"""

from __future__ import annotations

import statistics
import time
from typing import Optional

import torch

from rollplex_train.bench.decode import decode_bench_args, workload_engine
from rollplex_train.models.prefix import encode_prefix

MODES = ("repeated", "shared")


def _compare(a: list, b: list) -> tuple[int, Optional[int], float]:
    """(responses whose tokens differ, the earliest token index where one differs, the largest
    log-prob difference over the tokens before each response's first difference)."""
    differ, first, diff = 0, None, 0.0
    for x, y in zip(a, b):
        tx, ty = x.token_ids.tolist(), y.token_ids.tolist()
        same = next((i for i, (p, q) in enumerate(zip(tx, ty)) if p != q), min(len(tx), len(ty)))
        if tx != ty:
            differ += 1
            first = same if first is None else min(first, same)
        if same:
            diff = max(diff, float((x.logprobs[:same] - y.logprobs[:same]).abs().max()))
    return differ, first, diff


def main() -> None:
    args = decode_bench_args(__doc__)
    summary = []
    for workload in args.workloads.split(","):
        engine, prompts, params = workload_engine(workload)
        with torch.no_grad():
            prefixes = [encode_prefix(engine.model, [p], version=engine.weights_version)[0] for p in prompts]
        seconds: dict[str, list[float]] = {m: [] for m in MODES}
        outputs, kv_bytes = {}, {}
        for _ in range(args.rounds):
            for mode in MODES:
                engine.share_prompt_kv = mode == "shared"
                start = time.perf_counter()
                outputs[mode] = engine.generate(prompts, params, prefixes=prefixes)
                seconds[mode].append(time.perf_counter() - start)
                kv_bytes[mode] = engine.kv_cache_bytes
        differ, first, diff = _compare(outputs["repeated"], outputs["shared"])
        ratio = statistics.median(r / s for r, s in zip(seconds["repeated"], seconds["shared"]))
        steps = params.max_new_tokens
        per_step = {m: 1e3 * statistics.median(seconds[m]) / steps for m in MODES}
        print(f"{workload}: {len(prompts)} prompts x G={params.n}, prompt width "
              f"{max(p.prompt_length for p in prompts)}, {steps} tokens; decode s repeated "
              f"{[round(s, 2) for s in seconds['repeated']]} shared {[round(s, 2) for s in seconds['shared']]}; "
              f"median per-round ratio {ratio:.3f}; ms/step {per_step['repeated']:.2f} vs {per_step['shared']:.2f}; "
              f"KV cache MiB {kv_bytes['repeated'] / 2**20:.1f} vs {kv_bytes['shared'] / 2**20:.1f} "
              f"({kv_bytes['repeated'] / kv_bytes['shared']:.2f}x); responses with another token {differ}/{len(prompts) * params.n}"
              f"{'' if first is None else f' (first at token {first})'}, max |d log-prob| before it {diff:.2e}")
        summary.append(f"{workload}={ratio:.3f}x/{kv_bytes['repeated'] / kv_bytes['shared']:.2f}x")
    print("prompt_kv: " + " ".join(summary))


if __name__ == "__main__":
    main()
