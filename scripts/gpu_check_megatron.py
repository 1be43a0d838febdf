"""GPU check of the Megatron backend's model path: a random-weight ~1.5B Qwen2.5-VL, bf16, one CUDA
device, against HF transformers. Written for a fresh single-GPU machine without network (Python
3.12, torch and transformers preinstalled, megatron-core from a carried wheel): one step of
``scripts/gpu_run.sh``. It has not run on a GPU yet (see ``docs/benchmarks.md``).

Every input is made on the host (CPU generators) and moved to the device; every comparison moves
both sides to the host first (``tests/test_device_placement.py`` runs ``--smoke`` under a pretend
device and fails on any op a GPU would refuse).

What it does (each step timed):
1. builds the checkpoint locally (``Qwen2_5_VLConfig``: Qwen2.5-1.5B language model, 8-block
   vision tower) and saves it as safetensors;
2. builds the Megatron model from it (``training/megatron/build.py``: HF vision tower + mcore
   ``GPTModel``, TP=1, NCCL group of one) and the HF model;
3. compares logits on two prompts (an image and a video, left padding), split-prefix vs full
   log-probs, the HF round trip of the converter, and runs one forward/backward + AdamW step
   through Megatron DDP, timing it against the same step of the HF model.

Prints as its last line ``megatron-gpu: params=<n> max_abs_logit_diff=<a> mean_abs_logit_diff=<m>
max_abs_logprob_diff_split=<b> hf_roundtrip=<exact|differs> megatron_step_s=<s> hf_step_s=<h>``.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import torch


SMOKE_SPECIAL = dict(pad=1000, eos=1001, vision_start=1002, vision_end=1003, image=1004, video=1005)
"""Token ids of the smoke config (vocabulary 1024: the 152k head would make each CPU step seconds)."""


def qwen25vl_1b5_config(smoke: bool = False):
    """A Qwen2.5-VL config of about 1.5B parameters (Qwen2.5-1.5B LM + an 8-block vision tower);
    ``smoke``: the same shape family at 2 layers, width 128 and a 1024-token vocabulary (a CPU dry run
    of this script)."""
    from transformers import Qwen2_5_VLConfig

    ids = dict(image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653)
    text = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
                tie_word_embeddings=True, pad_token_id=151643, bos_token_id=151643, eos_token_id=151645)
    if smoke:
        s = SMOKE_SPECIAL
        text.update(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                    vocab_size=1024, pad_token_id=s["pad"], bos_token_id=s["pad"], eos_token_id=s["eos"],
                    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [4, 6, 6]})
        ids = dict(image_token_id=s["image"], video_token_id=s["video"], vision_start_token_id=s["vision_start"],
                   vision_end_token_id=s["vision_end"])
    vision = dict(depth=2 if smoke else 8, hidden_size=1280 // (10 if smoke else 1),
                  intermediate_size=3420 // (10 if smoke else 1), num_heads=16 // (4 if smoke else 1),
                  out_hidden_size=text["hidden_size"],
                  patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                  fullatt_block_indexes=[3, 7], tokens_per_second=2)
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **ids)


def make_prompts(cfg):
    """Two prompts: a 224x224 image (grid 1x16x16 -> 64 tokens) and a 4-frame 112x112 video (grid
    2x8x8 -> 32 tokens), random text around them; on the host, as the data loader makes them (the
    model paths move what they need to the model's device)."""
    from rollplex_train.data.types import PromptSample, VisionInputs

    g = torch.Generator().manual_seed(0)
    words = lambda n: torch.randint(100, cfg.vision_start_token_id, (n,), generator=g)  # noqa: E731
    feat = 3 * 2 * 14 * 14
    prompts = []
    for uid, (grid, key) in enumerate((((1, 16, 16), "image"), ((2, 8, 8), "video"))):
        grid_t = torch.tensor([grid])
        tokens = int(grid_t.prod()) // 4
        token = cfg.image_token_id if key == "image" else cfg.video_token_id
        ids = torch.cat([words(20), torch.tensor([cfg.vision_start_token_id]), torch.full((tokens,), token),
                         torch.tensor([cfg.vision_end_token_id]), words(30 + 10 * uid)])
        pixels = torch.randn(int(grid_t.prod()), feat, generator=g)
        vision = (VisionInputs(pixel_values=pixels, image_grid_thw=grid_t) if key == "image"
                  else VisionInputs(pixel_values_videos=pixels, video_grid_thw=grid_t,
                                    second_per_grid_ts=torch.tensor([1.0])))
        prompts.append(PromptSample(uid=f"gpu:{uid}", prompt_ids=ids, vision=vision, ground_truth=""))
    return prompts


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| in float32, both sides on the host (a device tensor is never compared with a host one)."""
    return float((a.detach().float().cpu() - b.detach().float().cpu()).abs().max())


def same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """The same names and bit-identical values, compared on the host."""
    return set(a) == set(b) and all(torch.equal(a[k].detach().cpu(), b[k].detach().cpu()) for k in a)


def main(argv: list[str] | None = None) -> int:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from rollplex_train.data.types import VisionInputs
    from rollplex_train.models.loading import load_model
    from rollplex_train.models.megatron_convert import megatron_to_hf
    from rollplex_train.models.sequence import pad_prompts, rope_positions, vision_kwargs
    from rollplex_train.parallel import ParallelLayout
    from rollplex_train.training.megatron import scoring
    from rollplex_train.training.megatron.build import build_model, init_parallel
    from rollplex_train.training.megatron.check import random_responses

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="/tmp/gpu-check-megatron")
    parser.add_argument("--smoke", action="store_true", help="CPU dry run on a 2-layer model (fp32, gloo)")
    parser.add_argument("--steps", type=int, default=3, help="timed optimizer steps of each model (after one warm-up)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    log = logging.getLogger("gpu_check")
    device, dtype = ("cpu", torch.float32) if args.smoke else ("cuda", torch.bfloat16)
    if device == "cuda":
        assert torch.cuda.is_available(), "needs a CUDA device (or --smoke)"
        torch.cuda.set_device(0)
    t0 = time.perf_counter()
    from transformers import Qwen2_5_VLForConditionalGeneration

    cfg = qwen25vl_1b5_config(args.smoke)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2_5_VLForConditionalGeneration._from_config(cfg, dtype=dtype)
    n_params = sum(p.numel() for p in model.parameters())
    out = Path(args.out)
    model.save_pretrained(out)
    del model
    log.info("checkpoint: %.2fB params written in %.1f s", n_params / 1e9, time.perf_counter() - t0)

    dtype_name = str(dtype).removeprefix("torch.")
    init_parallel(ParallelLayout(device=device), 0, seed=1)
    built = build_model(str(out), dtype_name, "sdpa", tp=1, pp=1, tp_rank=0, device=device)
    ours = built.model
    hf = load_model(out, dtype_name, "sdpa").to(device)
    log.info("models built at %.1f s", time.perf_counter() - t0)

    prompts = make_prompts(cfg)
    ids, mask = pad_prompts(prompts, cfg.get_text_config().pad_token_id, "left")  # host
    vision = VisionInputs.concat([p.vision for p in prompts])
    with torch.no_grad():
        logits = scoring.full_logits(ours, ids, mask, vision).float().cpu()
        ids_d, mask_d, vision_d = ids.to(device), mask.to(device), vision.to(device)
        position_ids, _ = rope_positions(hf, ids_d, mask_d, vision_d)
        ref = hf(input_ids=ids_d, attention_mask=mask_d, position_ids=position_ids,
                 **vision_kwargs(vision_d)).logits.float().cpu()
    real = mask.bool()
    diff = (logits[real] - ref[real]).abs()

    group, length = (2, 8) if args.smoke else (4, 64)
    group_index, rids, rmask = random_responses(prompts, group, length, ours.vocab_size)  # on the host
    group_index, rids, rmask = group_index.to(device), rids.to(device), rmask.to(device)
    with torch.no_grad():
        full, _ = scoring.full_logprobs(ours, prompts, group_index, rids, rmask, cfg.get_text_config().pad_token_id)
        states = scoring.encode_prefix(ours, prompts, version=0)
        split, _ = scoring.score_suffix(ours, states, group_index, rids, rmask)
    split_diff = max_abs_diff(full, split)

    hf_cpu = {n: p.detach().cpu() for n, p in hf.named_parameters() if not n.startswith("model.visual.")}
    back = megatron_to_hf([{k: v.detach().cpu() for k, v in ours.language_model.named_parameters()}], built.layout)
    roundtrip = "exact" if same_tensors(back, hf_cpu) else "differs"

    ddp = DistributedDataParallel(config=ours.language_model.config,
                                  ddp_config=DistributedDataParallelConfig(overlap_grad_reduce=False), module=ours)
    params = [p for p in ours.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-6)

    def megatron_step():
        ddp.zero_grad_buffer()
        logp, _ = scoring.full_logprobs(ours, prompts, group_index, rids, rmask, cfg.get_text_config().pad_token_id)
        (-(logp * rmask).sum() / rmask.sum()).backward()
        ddp.finish_grad_sync()
        for p in params:
            p.grad = p.main_grad
        optimizer.step()

    hf_params = [p for p in hf.parameters()]
    hf_opt = torch.optim.AdamW(hf_params, lr=1e-6)

    def hf_step():
        from rollplex_train.models.sequence import build_full_sequences, response_logprobs

        hf_opt.zero_grad(set_to_none=True)
        ids_, mask_, plen, vis = build_full_sequences(prompts, group_index, rids, rmask,
                                                      cfg.get_text_config().pad_token_id)
        logp, _ = response_logprobs(hf, ids_, mask_, vis, plen, rids, rmask)
        (-(logp * rmask).sum() / rmask.sum()).backward()
        hf_opt.step()

    timings = {}
    for name, step in (("megatron", megatron_step), ("hf", hf_step)):
        step()  # warm-up (allocations, kernels)
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        sync()
        begin = time.perf_counter()
        for _ in range(args.steps):
            step()
        sync()
        timings[name] = (time.perf_counter() - begin) / args.steps
    log.info("done at %.1f s", time.perf_counter() - t0)
    sys.stdout.write(
        f"megatron-gpu: params={n_params} max_abs_logit_diff={float(diff.max()):.3e} "
        f"mean_abs_logit_diff={float(diff.mean()):.3e} max_abs_logprob_diff_split={split_diff:.3e} "
        f"hf_roundtrip={roundtrip} megatron_step_s={timings['megatron']:.3f} hf_step_s={timings['hf']:.3f}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
