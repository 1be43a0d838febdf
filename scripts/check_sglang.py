"""Check the SGLang rollout engine against the built-in one and the trainer, on a GPU machine.

    pip install -e '.[sglang]'          # GPU machine only: SGLang 0.5.23 pins a CUDA torch
    python scripts/check_sglang.py      # tiny Qwen2.5-VL built on the fly, TP 1
    python scripts/check_sglang.py --model /path/to/hf_checkpoint --tp 2 --dtype bfloat16 --atol 0.1

This is the only place the SGLang path runs: the test suite checks everything that needs no
running engine. Steps, each printed as it passes or fails:

1. ``logprobs``: SGLang samples ``--n`` responses per prompt (temperature 1, seeded); the trainer
   recomputes their log-probs (``models.sequence.response_logprobs``, one full-sequence forward):
   max |SGLang - trainer| <= ``--atol``. The built-in engine's greedy responses of the same prompts
   are compared with SGLang's greedy ones (share of identical responses, reported).
2. ``seed``: the same request twice gives the same tokens (``enable_deterministic_inference``).
3. ``update``: the weights are perturbed (the trainer's update stands in: a scaled LM head /
   embedding), pushed as version 1 (``update_weights``); a request for version 0 is refused;
   SGLang's greedy outputs change where the trainer's do, and its log-probs match the trainer's
   recompute under the new weights.
4. ``memory``: release all tags frees device memory (``torch.cuda.mem_get_info``); generation is
   refused while released; after resume and a weight push, greedy outputs equal those before.

The last line is the verdict: ``check_sglang: PASS ...`` or ``check_sglang: FAIL <steps>``; details
go to ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import tempfile
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from rollplex_train.data.prompts import build_messages, render_prompt_ids
from rollplex_train.data.types import PromptSample, VisionInputs
from rollplex_train.data.vision import patchify_images
from rollplex_train.models.loading import load_model, load_tokenizer
from rollplex_train.models.sequence import build_full_sequences, response_logprobs
from rollplex_train.models.tiny import make_tiny_checkpoint
from rollplex_train.rollout.base import SamplingParams, StaleWeightsError, create_rollout_engine
from rollplex_train.rollout.sglang import check_available
from rollplex_train.runtime.batching import to_train_batch

log = logging.getLogger("check_sglang")


def trainer_logprobs(model, prompts, responses, pad_id: int, temperature: float) -> torch.Tensor:
    """(N, R) log-probs of ``responses`` recomputed by the trainer's full-sequence pass."""
    batch = to_train_batch(prompts, responses, pad_id)
    ids, mask, lengths, vision = build_full_sequences(prompts, batch.group_index, batch.response_ids,
                                                      batch.response_mask, pad_id)
    device = next(model.parameters()).device
    vision = dataclasses.replace(vision, **{f.name: getattr(vision, f.name).to(device)
                                            for f in dataclasses.fields(vision) if getattr(vision, f.name) is not None})
    with torch.no_grad():
        logp, _ = response_logprobs(model, ids.to(device), mask.to(device), vision, lengths.to(device),
                                    batch.response_ids.to(device), batch.response_mask.to(device),
                                    temperature=temperature)
    return logp.float().cpu() * batch.response_mask


def max_logprob_diff(model, prompts, responses, pad_id: int, temperature: float) -> float:
    """Max |engine log-prob - trainer log-prob| over all response tokens."""
    batch = to_train_batch(prompts, responses, pad_id)
    want = trainer_logprobs(model, prompts, responses, pad_id, temperature)
    return float(((batch.rollout_logprobs - want).abs() * batch.response_mask).max())


def same_tokens(a, b) -> list[bool]:
    return [torch.equal(x.token_ids, y.token_ids) for x, y in zip(a, b)]


def make_prompts(tokenizer, num: int, seed: int = 0) -> list[PromptSample]:
    """``num`` one-image prompts built in code (random pixels, sides 56/112/168 px in turn), so that
    nothing here needs datasets or pyarrow (the GPU machine has neither)."""
    rng = np.random.default_rng(seed)
    prompts = []
    for i in range(num):
        side = 56 * (1 + i % 3)
        image = Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8))
        pixels, grid = patchify_images([image], min_pixels=56 * 56, max_pixels=side * side)
        messages = build_messages("<image>What colour is the square? Put your final answer in \\boxed{}.",
                                  num_images=1, num_videos=0)
        prompts.append(PromptSample(uid=f"check:{i}", prompt_ids=render_prompt_ids(tokenizer, messages, grid),
                                    vision=VisionInputs(pixel_values=pixels, image_grid_thw=grid),
                                    ground_truth="red", task="color"))
    return prompts


def prepare(args) -> tuple[str, list]:
    """The checkpoint (a tiny one built here unless --model) and ``args.prompts`` prompts."""
    work = Path(tempfile.mkdtemp(prefix="check_sglang_"))
    model_path = args.model or str(make_tiny_checkpoint(work / "ckpt", arch="qwen2_5_vl", size="tiny", tasks_dir=None)[0])
    return model_path, make_prompts(load_tokenizer(model_path), args.prompts)


def run(args) -> dict:
    check_available()
    if not torch.cuda.is_available():
        raise ValueError("no CUDA device visible: SGLang runs on GPUs")
    model_path, prompts = prepare(args)
    device = torch.device("cuda", args.base_gpu_id)
    model = load_model(model_path, dtype=args.dtype).to(device).eval()
    pad_id = load_tokenizer(model_path).pad_token_id
    builtin = create_rollout_engine("builtin", model_path=model_path, dtype="float32")
    sgl = create_rollout_engine("sglang", model_path=model_path, dtype=args.dtype, tp_size=args.tp,
                                base_gpu_id=args.base_gpu_id, mem_fraction_static=args.mem_fraction)
    report: dict = {"model": model_path, "tp": args.tp, "dtype": args.dtype, "prompts": len(prompts)}
    failed = []
    sample = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.max_new_tokens, seed=args.seed)
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=args.max_new_tokens, seed=args.seed)

    sampled = sgl.generate(prompts, sample, weights_version=0)
    report["logprob_max_abs_diff"] = max_logprob_diff(model, prompts, sampled, pad_id, 1.0)
    ref_greedy, sgl_greedy = builtin.generate(prompts, greedy, 0), sgl.generate(prompts, greedy, 0)
    report["greedy_same_as_builtin"] = sum(same_tokens(ref_greedy, sgl_greedy)) / len(prompts)
    if report["logprob_max_abs_diff"] > args.atol:
        failed.append("logprobs")

    again = sgl.generate(prompts, sample, weights_version=0)
    report["seeded_repeat_same"] = sum(same_tokens(sampled, again)) / len(sampled)
    if report["seeded_repeat_same"] < 1.0:
        failed.append("seed")

    with torch.no_grad():  # stand-in for an optimizer step: shift the LM head / embedding
        head = model.get_output_embeddings().weight
        head.mul_(1.0 + args.perturb).add_(torch.randn_like(head) * args.perturb * head.std())
    sgl.update_weights({n: p.detach() for n, p in model.named_parameters()}, version=1)
    try:
        sgl.generate(prompts, greedy, weights_version=0)
        failed.append("stale_refused")
    except StaleWeightsError:
        pass
    after = sgl.generate(prompts, greedy, weights_version=1)
    report["greedy_changed_by_update"] = 1.0 - sum(same_tokens(sgl_greedy, after)) / len(prompts)
    report["logprob_max_abs_diff_after_update"] = max_logprob_diff(model, prompts, after, pad_id, 1.0)
    if report["greedy_changed_by_update"] == 0.0 or report["logprob_max_abs_diff_after_update"] > args.atol:
        failed.append("update")

    free_before = torch.cuda.mem_get_info(device)[0]
    sgl.release_memory()
    report["released_gib"] = (torch.cuda.mem_get_info(device)[0] - free_before) / 1024**3
    try:
        sgl.generate(prompts, greedy, weights_version=1)
        failed.append("released_refused")
    except RuntimeError:
        pass
    sgl.resume_memory()
    sgl.update_weights({n: p.detach() for n, p in model.named_parameters()}, version=2)
    resumed = sgl.generate(prompts, greedy, weights_version=2)
    report["greedy_same_after_resume"] = sum(same_tokens(after, resumed)) / len(prompts)
    if report["released_gib"] <= 0 or report["greedy_same_after_resume"] < 1.0:
        failed.append("memory")
    sgl.shutdown()
    report["failed"] = failed
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="HF checkpoint dir (default: a tiny one built here)")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--base-gpu-id", type=int, default=0)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--mem-fraction", type=float, default=0.3)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--atol", type=float, default=2e-3, help="max |log-prob diff| (float32; ~0.1 for bf16)")
    parser.add_argument("--perturb", type=float, default=0.5)
    parser.add_argument("--out", default="check_sglang.json")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        report = run(args)
    except (ImportError, ValueError) as err:  # the extra or a GPU missing: not runnable here
        print(f"check_sglang: NOT RUN {err}")
        raise SystemExit(2) from err
    Path(args.out).write_text(json.dumps(report, indent=2))
    keys = ("logprob_max_abs_diff", "greedy_same_as_builtin", "greedy_changed_by_update", "released_gib")
    summary = " ".join(f"{k}={report[k]:.4g}" for k in keys)
    verdict = "PASS" if not report["failed"] else "FAIL " + ",".join(report["failed"])
    print(f"check_sglang: {verdict} {summary} (details: {args.out})")


if __name__ == "__main__":
    main()
