"""Full-sequence vs prefix/suffix passes, side by side in one run.

    python scripts/bench_prefix.py            # small checkpoint, G=8, 64-token responses
    python scripts/bench_prefix.py --malloc default   # glibc's allocator defaults, not the workers'

Reference scoring (no grad) and actor training (forward + backward) of P prompts x G responses,
each measured as the median of a few repetitions after a warm-up, on this machine's cores. The last
line is ``prefix-split: ref_speedup=<x> train_speedup=<y> max_abs_logprob_diff=<z>``.
"""

from __future__ import annotations

import argparse
import logging
import resource
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from rollplex_train.data.prompts import build_messages, render_prompt_ids
from rollplex_train.data.types import PromptSample, VisionInputs
from rollplex_train.data.vision import patchify_images
from rollplex_train.memory.host_malloc import keep_freed_memory
from rollplex_train.models.loading import load_model, load_tokenizer
from rollplex_train.models.prefix import encode_prefix, score_suffix
from rollplex_train.models.sequence import build_full_sequences, response_logprobs
from rollplex_train.models.tiny import make_tiny_checkpoint


def make_prompts(tokenizer, num_prompts: int, image_side: int) -> list[PromptSample]:
    """Prompts of one random ``image_side``-pixel square image and a question each."""
    rng = np.random.default_rng(0)
    prompts = []
    for i in range(num_prompts):
        image = Image.fromarray(rng.integers(0, 255, (image_side, image_side, 3), dtype=np.uint8))
        pixels, grid = patchify_images([image], min_pixels=56 * 56, max_pixels=image_side * image_side)
        messages = build_messages("<image>What is the colour of the shape? Options: red, green, blue, yellow.",
                                  num_images=1, num_videos=0)
        ids = render_prompt_ids(tokenizer, messages, image_grid_thw=grid)
        prompts.append(PromptSample(uid=f"bench:{i}", prompt_ids=ids,
                                    vision=VisionInputs(pixel_values=pixels, image_grid_thw=grid), ground_truth=""))
    return prompts


FAULTS: list[int] = []  # minor page faults per timed run, in call order


def timed(fn, repeats: int) -> tuple[float, object]:
    """Median seconds of ``fn()`` over ``repeats`` runs after one warm-up run, and the last result;
    the median minor page faults of a run are appended to :data:`FAULTS`."""
    result = fn()
    times, faults = [], []
    for _ in range(repeats):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    FAULTS.append(int(statistics.median(faults)))
    return statistics.median(times), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="artifacts/checkpoints/small-qwen25vl")
    parser.add_argument("--prompts", type=int, default=4, help="prompts (groups) per pass")
    parser.add_argument("--group-size", type=int, default=8, help="G responses per prompt")
    parser.add_argument("--response-length", type=int, default=64)
    parser.add_argument("--image-side", type=int, default=224)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--malloc", choices=("workers", "default"), default="workers",
                        help="the workers' host allocator setting (memory/host_malloc.py) or glibc's defaults")
    args = parser.parse_args()
    if args.malloc == "workers":
        keep_freed_memory()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    path = Path(args.model)
    if not (path / "config.json").is_file():
        path = path.with_name(path.name + "-random")
        if not (path / "config.json").is_file():
            print(f"building a random-weight small checkpoint at {path} (timing does not depend on the weights)")
            make_tiny_checkpoint(path, size="small", tasks_dir=None, max_pixels=args.image_side ** 2)
    model = load_model(path)
    tokenizer = load_tokenizer(path)
    prompts = make_prompts(tokenizer, args.prompts, args.image_side)
    g = torch.Generator().manual_seed(0)
    n, r = args.prompts * args.group_size, args.response_length
    group_index = torch.arange(args.prompts).repeat_interleave(args.group_size)
    response_ids = torch.randint(0, len(tokenizer) - 20, (n, r), generator=g)
    response_mask = torch.ones(n, r)
    full_inputs = build_full_sequences(prompts, group_index, response_ids, response_mask, tokenizer.pad_token_id)

    def full_pass():
        ids, mask, plen, vision = full_inputs
        return response_logprobs(model, ids, mask, vision, plen, response_ids, response_mask)[0]

    def split_pass(with_grad: bool):
        states = encode_prefix(model, prompts, version=0, with_grad=with_grad)
        return score_suffix(model, states, group_index, response_ids, response_mask)[0]

    def train(pass_fn):
        model.zero_grad(set_to_none=True)
        logprobs = pass_fn()
        logprobs.mean().backward()
        return logprobs.detach()

    with torch.no_grad():
        ref_full_s, lp_full = timed(full_pass, args.repeats)
        ref_split_s, lp_split = timed(lambda: split_pass(False), args.repeats)
    train_full_s, _ = timed(lambda: train(full_pass), args.repeats)
    train_split_s, _ = timed(lambda: train(lambda: split_pass(True)), args.repeats)
    diff = float((lp_full - lp_split).abs().max())
    prompt_len = statistics.mean(p.prompt_length for p in prompts)
    params = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"model {path} ({params:.1f}M params), {args.prompts} prompts x G={args.group_size}, "
          f"prompt {prompt_len:.0f} tokens ({args.image_side}px image), response {r} tokens, "
          f"{torch.get_num_threads()} threads")
    print(f"{'pass':<8}{'full_s':>10}{'split_s':>10}{'speedup':>10}")
    print(f"{'ref':<8}{ref_full_s:>10.3f}{ref_split_s:>10.3f}{ref_full_s / ref_split_s:>10.2f}")
    print(f"{'train':<8}{train_full_s:>10.3f}{train_split_s:>10.3f}{train_full_s / train_split_s:>10.2f}")
    print(f"minor page faults per pass (host allocator: {args.malloc}): ref {FAULTS[0]} / {FAULTS[1]}, "
          f"train {FAULTS[2]} / {FAULTS[3]} (full / split)")
    print(f"prefix-split: ref_speedup={ref_full_s / ref_split_s:.2f} "
          f"train_speedup={train_full_s / train_split_s:.2f} max_abs_logprob_diff={diff:.2e}")


if __name__ == "__main__":
    main()
