"""serial vs serial+shared prefix vs disaggregated vs rollplex on one GPU, in one process.

    python scripts/bench_gpu.py                  # one GPU: random-weight ~3.4B Qwen2.5-VL (Qwen2.5-VL-3B widths)
    python scripts/bench_gpu.py --dry-run        # the same code path on CPU with the tiny model (~1 min)

Workload (embodied-like): ``--prompts`` video prompts per step (8 frames of ``--side`` px: 1024
vision tokens at 448 px), ``--n`` responses each (G = 8), ``--response-len`` new tokens (256,
ignore_eos), KL on, one mini-batch. Every schedule starts from the same checkpoint and seeds and runs
``--steps`` steps through the in-process executor (``cluster.executor=inprocess``: no Ray, and
nothing on this path imports Hydra/OmegaConf, Ray, datasets, decord or av; checked at the end).
Rollplex calibrates its cost model in steps 1-3, so steps ``--timed-from``.. are timed.

Device share: ``--device-share`` (default ``auto``: ``streams`` on a GPU, decode and prefix on
separate CUDA streams with no SM cap, so "disaggregated" runs its two halves time-shared, not on
half the SMs each; ``cores`` on CPU). ``green`` caps each side at half the SMs where torch's green
contexts have streams, but the two halves may hold the same SMs (``device_share.py``); the first
output line says which share ran. SM utilisation during decode is the
NVML GPU utilisation (``torch.cuda.utilization``, needs pynvml) sampled every 50 ms inside the
``gen`` spans of the timed steps.

Prints one line per schedule, then ``tokens: step-1 responses identical across schedules=<yes|no>``
(bit-equal token ids; expected under fp32), ``decode_sm_util: ...`` and, as the last line, the
``schedules:`` line of ``scripts/bench_schedules.py``.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import logging
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

FORBIDDEN = ("hydra", "omegaconf", "ray", "datasets", "decord", "av")
SCHEDULES = {  # label -> (schedule.name, model.shared_prefix)
    "serial": ("serial", False),
    "serial_shared": ("serial", True),
    "disaggregated": ("disaggregated", False),
    "rollplex": ("rollplex", True),
}


def build_checkpoint(out: Path, size: str, device: str) -> Path:
    """A random-weight Qwen2.5-VL of ``size`` (``models/tiny.py`` SIZES), saved in bf16 (loaded as fp32)."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    from rollplex_train.models.tiny import build_config, build_image_processor, build_tokenizer

    if (out / "config.json").is_file():
        return out
    tok = build_tokenizer()
    cfg = build_config("qwen2_5_vl", size, tok)
    torch.manual_seed(0)
    with torch.device(device):  # random init on the GPU: minutes faster than on CPU at 3B
        model = Qwen2_5_VLForConditionalGeneration(cfg)
    model.generation_config.eos_token_id = [tok.eos_token_id, tok.pad_token_id]
    model.generation_config.pad_token_id = tok.pad_token_id
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    build_image_processor(56 * 56, 448 * 448).save_pretrained(out)
    params = sum(p.numel() for p in model.parameters())
    del model
    logging.info("random-weight %s checkpoint: %.2fB parameters in %s", size, params / 1e9, out)
    return out


def make_prompts(ckpt: Path, step: int, num: int, frames: int, side: int):
    """``num`` video prompts (random frames, ``side`` x ``side`` px) with uids of ``step``."""
    from rollplex_train.data.prompts import build_messages, render_prompt_ids
    from rollplex_train.data.types import PromptSample, VisionInputs
    from rollplex_train.data.vision import patchify_video
    from rollplex_train.models.loading import load_tokenizer

    tok = load_tokenizer(ckpt)
    rng = np.random.default_rng(1000 + step)
    out = []
    for i in range(num):
        video = rng.integers(0, 256, (frames, side, side, 3), dtype=np.uint8)
        pix, grid, sec = patchify_video(video, min_pixels=side * side, max_pixels=side * side, sample_fps=2.0)
        msgs = build_messages("<video>Which direction does the object move? Put your final answer in \\boxed{}.",
                              num_images=0, num_videos=1)
        ids = render_prompt_ids(tok, msgs, None, grid, merge_size=2)
        out.append(PromptSample(uid=f"bench{step}:{i}", prompt_ids=ids, ground_truth="left", task="direction",
                                vision=VisionInputs(pixel_values_videos=pix, video_grid_thw=grid,
                                                    second_per_grid_ts=sec)))
    return out


def make_config(args, label: str, ckpt: Path, share: str):
    from rollplex_train.config import (ActorConfig, AlgorithmConfig, ClusterConfig, Config, DataConfig,
                                       ModelConfig, RewardConfig, RolloutConfig, ScheduleConfig, TrainerConfig)
    from rollplex_train.resolve import resolve

    name, shared = SCHEDULES[label]
    return resolve(Config(
        model=ModelConfig(path=str(ckpt), shared_prefix=shared, compute_dtype=args.compute_dtype),
        data=DataConfig(train_files="<in-process prompts>", val_files="", rollout_batch_size=args.prompts,
                        shuffle=False),
        rollout=RolloutConfig(n=args.n, temperature=1.0, max_new_tokens=args.response_len, ignore_eos=True,
                              max_batch_size=args.prompts * args.n),
        actor=ActorConfig(ppo_mini_batch_size=-1, micro_batch_size=args.micro_batch),
        algorithm=AlgorithmConfig(use_kl_loss=True, kl_coef=0.05),
        reward=RewardConfig(function="format"),
        cluster=ClusterConfig(device=args.device, executor="inprocess", device_share=share, threads_per_device=1),
        schedule=ScheduleConfig(name=name),
        trainer=TrainerConfig(seed=1, total_steps=args.steps),
    ))


class UtilSampler:
    """NVML GPU utilisation (%) sampled every ``period_s`` on a thread; None values where unavailable."""

    def __init__(self, device: str, period_s: float = 0.05):
        self.samples: list[tuple[float, float]] = []
        self.ok = device == "cuda"
        if self.ok:
            try:
                torch.cuda.utilization()
            except Exception as err:  # noqa: BLE001 - no pynvml / NVML: reported as n/a
                logging.warning("no SM utilisation: %s", err)
                self.ok = False
        self._stop = threading.Event()
        if self.ok:
            threading.Thread(target=self._run, args=(period_s,), daemon=True).start()

    def _run(self, period_s: float) -> None:
        while not self._stop.is_set():
            self.samples.append((time.perf_counter(), float(torch.cuda.utilization())))
            time.sleep(period_s)

    def mean_in(self, windows: list[tuple[float, float]]):
        vals = [u for t, u in self.samples if any(a <= t <= b for a, b in windows)]
        return sum(vals) / len(vals) if vals else None

    def stop(self) -> None:
        self._stop.set()


def run_schedule(args, label: str, ckpt: Path, share: str, sampler: UtilSampler, out: Path) -> dict:
    """``args.steps`` steps of one schedule; its timed means, step-1 token digest and decode utilisation."""
    from rollplex_train.algo.rewards import RewardManager
    from rollplex_train.cluster.launch import create_workers
    from rollplex_train.models.loading import load_tokenizer
    from rollplex_train.runtime import make_run
    from rollplex_train.runtime.step import run_step

    cfg = make_config(args, label, ckpt, share)
    begin = time.perf_counter()
    workers = create_workers(cfg, out / label)
    rows, digest, util = [], None, []
    try:
        reward = RewardManager(cfg.reward.function, cfg.reward.format_weight)
        run = make_run(cfg, workers, reward, load_tokenizer(ckpt).pad_token_id)
        for step in range(1, args.steps + 1):
            result = run_step(run, make_prompts(ckpt, step, args.prompts, args.frames, args.side), step)
            if step == 1:
                digest = hashlib.sha256(str([r.token_ids.tolist() for r in result.responses]).encode()).hexdigest()
            if step >= args.timed_from:
                rows.append(result.metrics)
                tl = result.timeline
                util.append(sampler.mean_in([(tl.origin + s.start_s, tl.origin + s.end_s) for s in tl.spans
                                             if s.name == "gen"]))
        result.timeline.write_chrome_trace(out / label / "traces" / f"step_{args.steps}.json")
    finally:
        workers.shutdown()
        del workers
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
    mean = {k: sum(r[k] for r in rows) / len(rows) for k in rows[-1] if all(k in r for r in rows)}
    util = [u for u in util if u is not None]
    mean["decode_sm_util"] = sum(util) / len(util) if util else None
    mean["tokens_step1"] = digest
    mean["wall_s"] = time.perf_counter() - begin
    return mean


def pick_share(requested: str, device: str) -> str:
    """The in-process share of ``--device-share`` (``auto``: ``device_share.resolve_share``), refused in
    one line (RuntimeError) where this machine cannot give it."""
    from rollplex_train.device_share import check_machine, resolve_share

    share = resolve_share(requested, device, "inprocess")
    check_machine(share)
    return share


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--size", default="3b", help="a models/tiny.py size: 3b, small, tiny")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=8, help="responses per prompt (G)")
    parser.add_argument("--response-len", type=int, default=256)
    parser.add_argument("--frames", type=int, default=8)
    parser.add_argument("--side", type=int, default=448, help="frame side in px (448: 256 tokens per 2 frames)")
    parser.add_argument("--micro-batch", type=int, default=8, help="responses per micro-batch (one group)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--timed-from", type=int, default=4, help="first timed step (rollplex plans from step 4)")
    parser.add_argument("--compute-dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--only", default=",".join(SCHEDULES))
    parser.add_argument("--device-share", default="auto", choices=("auto", "cores", "streams", "green"),
                        help="cluster.device_share of every schedule (auto: streams on a GPU, cores on CPU)")
    parser.add_argument("--out", default="outputs/bench_gpu")
    parser.add_argument("--dry-run", "--tiny", action="store_true",
                        help="CPU, tiny model, 2 prompts x 2 responses x 8 tokens, 4 frames of 56 px, fp32")
    args = parser.parse_args(argv)
    if args.dry_run:
        args.device, args.size, args.prompts, args.n, args.response_len = "cpu", "tiny", 2, 2, 8
        args.frames, args.side, args.compute_dtype, args.micro_batch = 4, 56, "float32", 4
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    torch.set_num_threads(1 if args.device == "cpu" else torch.get_num_threads())
    out = Path(args.out)
    ckpt = build_checkpoint(out / f"checkpoint-{args.size}", args.size, args.device)
    share = pick_share(args.device_share, args.device)
    sampler = UtilSampler(args.device)
    print(f"bench_gpu: {args.size} on {args.device}, share={share}, compute={args.compute_dtype}, "
          f"{args.prompts} prompts x {args.n}, {args.response_len} tokens, "
          f"{make_prompts(ckpt, 0, 1, args.frames, args.side)[0].prompt_length} prompt tokens", flush=True)
    results = {}
    for label in args.only.split(","):
        m = results[label] = run_schedule(args, label, ckpt, share, sampler, out)
        util = "n/a" if m["decode_sm_util"] is None else f"{m['decode_sm_util']:.0f}%"
        print(f"{label:<15} step {m['timing_s/step']:7.2f} s  gen {m['timing_s/gen']:6.2f}  "
              f"update {m['timing_s/update_actor']:6.2f}  decode util {util}  ({m['wall_s']:.0f} s wall)", flush=True)
    sampler.stop()
    digests = {m["tokens_step1"] for m in results.values()}
    print(f"tokens: step-1 responses identical across schedules={'yes' if len(digests) == 1 else 'no'}")
    print("decode_sm_util: " + " ".join(
        f"{k}={'n/a' if m['decode_sm_util'] is None else format(m['decode_sm_util'], '.0f') + '%'}"
        for k, m in results.items()))
    loaded = sorted(m for m in FORBIDDEN if m in sys.modules)
    print(f"imports: {'none of ' + ','.join(FORBIDDEN) if not loaded else 'LOADED ' + ','.join(loaded)}")
    step = {k: m["timing_s/step"] for k, m in results.items()}
    if set(step) == set(SCHEDULES):
        hidden = results["rollplex"].get("rollplex/prefix_hidden_frac", 0.0) * 100
        print(f"schedules: rollplex/serial={step['serial'] / step['rollplex']:.2f} "
              f"rollplex/serial_shared={step['serial_shared'] / step['rollplex']:.2f} "
              f"rollplex/disaggregated={step['disaggregated'] / step['rollplex']:.2f} prefix_hidden={hidden:.0f}%")
    return 1 if loaded else 0


if __name__ == "__main__":
    sys.exit(main())
