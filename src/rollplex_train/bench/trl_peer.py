"""TRL's GRPOTrainer on a rollplex benchmark workload: same checkpoint, data, pixels and settings.

    python -m rollplex_train.bench.trl_peer --experiment bench_image --steps 2 --out outputs/peer/trl

Runs ``trl.GRPOTrainer`` (the version pinned by the ``bench`` extra, 1.16.0) for ``--steps`` optimizer
steps and writes ``<out>/trl.json``: per step the wall seconds of the step and of its phases
(``gen``: ``transformers.generate`` with the prompts repeated G times; ``ref``: the reference pass;
``update``: forward + backward of the loss and the optimizer step), and the check that TRL's model
saw exactly the prompt ids and pixels rollplex's ``PromptDataset`` gives for the same rows.

TRL's processor is ``bench/trl_processor.py`` (transformers' Qwen2.5-VL processor needs
torchvision). TRL 1.16's GRPOTrainer has no video route: for ``bench_video`` the video tensors
travel through TRL's image plumbing (``pixel_values``/``image_grid_thw``, split, shuffled and
chunked per sample as images are) and a forward pre-hook on the model hands them over under the
video names with ``second_per_grid_ts``, so the model computes what rollplex's does.

Settings that cannot be made equal are listed in :data:`UNEQUAL`. The TRL process gets the host
allocator setting of rollplex's workers (``memory/host_malloc.py``: freed memory kept for reuse),
which speeds up its passes as it does rollplex's.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path
from typing import Any

import torch

from rollplex_train.config import Config
from rollplex_train.data.dataset import PromptDataset, load_table
from rollplex_train.data.prompts import build_messages
from rollplex_train.memory.host_malloc import keep_freed_memory
from rollplex_train.models.loading import load_tokenizer

log = logging.getLogger(__name__)

UNEQUAL = (
    "KL estimator: TRL's k3 per token vs rollplex's low_var_kl (k3 clamped to [-10, 10]); equal unless |log ratio| is large",
    "responses: rollplex decodes max_new_tokens with ignore_eos; TRL generate with min_new_tokens=max_new_tokens "
    "(EOS masked until then): same lengths, EOS is never sampled in TRL",
    "TRL computes log-probs of every position of prompt+response on CPU (its fused head scores only the "
    "completion positions on Triton devices); rollplex scores the response positions only",
    "TRL samples with transformers generate (its own RNG); rollplex with its built-in engine: the sampled tokens differ",
    "TRL shuffles the generation batch before the update (one micro-batch of the whole batch here, so no effect on the work)",
    "TRL 1.16 has no video route: bench_video passes the video tensors through TRL's image plumbing to the model's video inputs",
    "preprocessing: both sides patchify each prompt's media once (rollplex in its data loader, the TRL processor "
    "caches per file); neither counts it in the step",
    "threads: TRL runs one process on 2 threads; rollplex's colocated rollout and train workers share the 2 threads",
)


def trl_dataset(cfg: Config):
    """The workload's manifest as TRL rows: ``prompt`` (chat messages, a ``{"type": "image"}`` item
    per medium, videos too), ``images`` (media paths, filled into the items by TRL), and the
    reward's ``ground_truth`` / ``options`` / ``uid`` columns (``uid`` as rollplex names the row)."""
    import datasets

    d = cfg.data
    rows = []
    for index, row in enumerate(load_table(d.train_files)):
        images, videos = list(row.get(d.image_key) or []), list(row.get(d.video_key) or [])
        messages = build_messages(row[d.prompt_key], num_images=len(images), num_videos=len(videos),
                                  system_prompt=d.system_prompt)
        for m in messages:
            if isinstance(m["content"], list):
                m["content"] = [{"type": "image", "text": None} if p["type"] in ("image", "video")
                                else {"type": "text", "text": p["text"]} for p in m["content"]]
        rows.append({"prompt": messages, "images": images + videos, "ground_truth": str(row[d.answer_key]),
                     "options": list(row.get("options") or []), "uid": f"train:{index}"})
    return datasets.Dataset.from_list(rows)


class _StepClock:
    """Wall seconds of TRL's steps and of their phases, from method wrappers and a callback."""

    def __init__(self):
        self.steps: list[dict[str, float]] = []
        self.current: dict[str, float] = {}
        self.begin = 0.0

    def wrap(self, obj, name: str, phase, ) -> None:
        """Time every call of ``obj.<name>`` under ``phase(args, kwargs)`` (a phase name or None)."""
        inner = getattr(obj, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                key = phase(args, kwargs)
                if key is not None:
                    self.current[key] = self.current.get(key, 0.0) + time.perf_counter() - start

        setattr(obj, name, timed)

    def callback(self):
        from transformers import TrainerCallback

        clock = self

        class Clock(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                clock.current, clock.begin = {}, time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                step = dict(clock.current, step=time.perf_counter() - clock.begin)
                step["update"] = step["step"] - step.get("gen", 0.0) - step.get("ref", 0.0)
                clock.steps.append(step)

        return Clock()


class _InputCheck:
    """Forward pre-hooks on a Qwen2.5-VL model: records the prompt ids (the backbone's prefill call)
    and pixels (the vision tower's input) of every ``generate`` (between :meth:`begin` and
    :meth:`end`), and renames video tensors that TRL carries under the image names."""

    def __init__(self, processor, video_pad: int, image_pad: int):
        self.processor, self.video_pad, self.image_pad = processor, video_pad, image_pad
        self.prefills: list[dict] = []
        self.recording = False

    def install(self, model) -> None:
        model.model.register_forward_pre_hook(self._backbone, with_kwargs=True)
        model.model.visual.register_forward_pre_hook(self._vision, with_kwargs=True)

    def begin(self) -> None:
        self.prefills.append({"input_ids": None, "attention_mask": None, "pixels": []})
        self.recording = True

    def end(self) -> None:
        self.recording = False

    def _vision(self, module, args, kwargs):
        if self.recording:
            self.prefills[-1]["pixels"].append((args[0] if args else kwargs["hidden_states"]).detach().clone())

    def _backbone(self, module, args, kwargs):
        ids = kwargs.get("input_ids")
        if ids is None:
            return None
        if self.recording and self.prefills[-1]["input_ids"] is None:  # generate's prefill
            mask = kwargs.get("attention_mask")
            self.prefills[-1]["input_ids"] = ids.clone()
            self.prefills[-1]["attention_mask"] = torch.ones_like(ids) if mask is None else mask.clone()
        if kwargs.get("image_grid_thw") is not None and bool((ids == self.video_pad).any()) \
                and not bool((ids == self.image_pad).any()):
            kwargs = dict(kwargs)
            kwargs["pixel_values_videos"] = kwargs.pop("pixel_values")
            kwargs["video_grid_thw"] = kwargs.pop("image_grid_thw")
            seconds = sorted(set(self.processor.second_per_grid_ts))
            if len(seconds) != 1:
                raise ValueError(f"the TRL peer's videos must share one second_per_grid_ts, got {seconds}")
            kwargs["second_per_grid_ts"] = torch.full((kwargs["video_grid_thw"].shape[0],), seconds[0])
            return args, kwargs
        return None


def check_inputs(prefills: list[dict], dataset: PromptDataset, prompts_per_step: int, n: int) -> dict[str, Any]:
    """Compare each step's generate prefill with rollplex's prompts of the same rows (in order).

    Returns:
        ``{"steps_checked", "rows_checked", "ids_equal", "pixels_equal", "max_abs_pixel_diff"}``.
    """
    ids_equal = pixels_equal = True
    rows = 0
    worst = 0.0
    for step, seen in enumerate(prefills):
        expected = [dataset.get(step * prompts_per_step + k) for k in range(prompts_per_step)]
        if seen["input_ids"] is None or seen["input_ids"].shape[0] != prompts_per_step * n:
            return {"steps_checked": step, "rows_checked": rows, "ids_equal": False, "pixels_equal": False,
                    "max_abs_pixel_diff": float("nan")}
        for r in range(seen["input_ids"].shape[0]):
            real = seen["input_ids"][r][seen["attention_mask"][r].bool()]
            ids_equal &= torch.equal(real.cpu(), expected[r // n].prompt_ids)
            rows += 1
        mine = torch.cat([(p.vision.pixel_values if p.vision.pixel_values is not None else p.vision.pixel_values_videos)
                          for p in expected for _ in range(n)])
        theirs = torch.cat(seen["pixels"]).cpu() if seen["pixels"] else torch.empty(0)
        if mine.shape != theirs.shape:
            pixels_equal = False
            continue
        worst = max(worst, float((mine - theirs).abs().max()))
        pixels_equal &= torch.equal(mine, theirs)
    return {"steps_checked": len(prefills), "rows_checked": rows, "ids_equal": ids_equal,
            "pixels_equal": pixels_equal, "max_abs_pixel_diff": worst}


def run_trl(cfg: Config, steps: int, out: Path, threads: int = 2) -> dict[str, Any]:
    """Train ``steps`` GRPO steps with TRL's GRPOTrainer on ``cfg``'s model and data; write and
    return ``{"steps": [per-step seconds], "check": check_inputs(...), "settings": {...}, "unequal": UNEQUAL}``."""
    import trl
    from transformers import AutoModelForImageTextToText

    from rollplex_train.algo.rewards import RewardManager
    from rollplex_train.bench.trl_processor import make_processor_class

    torch.set_num_threads(threads)
    # the host allocator setting of rollplex's workers (memory/host_malloc.py), so that it is equal
    malloc_tuned = keep_freed_memory()
    out.mkdir(parents=True, exist_ok=True)
    processor = make_processor_class()(cfg, Path(cfg.data.train_files).parent)
    tokenizer = load_tokenizer(cfg.model.path)
    model = AutoModelForImageTextToText.from_pretrained(cfg.model.path, dtype=torch.float32,
                                                        attn_implementation=cfg.model.attn_implementation)
    reward = RewardManager(cfg.reward.function, cfg.reward.format_weight)

    def reward_fn(completions, ground_truth, options, uid, **_):
        texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
        return reward.score(texts, list(ground_truth), list(uid), [list(o) for o in options])[0].tolist()

    reward_fn.__name__ = f"rollplex_{cfg.reward.function}"
    r, a = cfg.rollout, cfg.actor
    if a.lr_scheduler != "constant":  # TRL's constant schedule below is the only one mapped
        raise ValueError(f"actor.lr_scheduler={a.lr_scheduler}: the TRL peer runs a constant learning rate; "
                         "benchmark with actor.lr_scheduler=constant")
    vision_ids = [tokenizer.convert_tokens_to_ids(t) for t in
                  ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")]
    settings = dict(
        output_dir=str(out), max_steps=steps, per_device_train_batch_size=cfg.data.rollout_batch_size * r.n,
        gradient_accumulation_steps=1, num_generations=r.n, max_completion_length=r.max_new_tokens,
        temperature=r.temperature, top_p=r.top_p, top_k=max(r.top_k, 0), beta=cfg.algorithm.kl_coef,
        epsilon=a.clip_ratio_low, epsilon_high=a.clip_ratio_high, learning_rate=a.lr, weight_decay=a.weight_decay,
        adam_beta1=a.betas[0], adam_beta2=a.betas[1], max_grad_norm=a.grad_clip if a.grad_clip > 0 else 1e9,
        lr_scheduler_type="constant", warmup_steps=a.lr_warmup_steps, loss_type="dapo",
        scale_rewards="group" if cfg.algorithm.norm_adv_by_std else "none", num_iterations=a.ppo_epochs,
        shuffle_dataset=cfg.data.shuffle, seed=cfg.trainer.seed, bf16=False, fp16=False, use_cpu=True,
        gradient_checkpointing=False, pad_to_multiple_of=None, remove_unused_columns=False, logging_steps=1,
        report_to="none", save_strategy="no", disable_dropout=True, log_completions=False, dataloader_num_workers=0,
        generation_kwargs={"min_new_tokens": r.max_new_tokens, "suppress_tokens": vision_ids} if r.ignore_eos
        else {"suppress_tokens": vision_ids},
    )
    trainer = trl.GRPOTrainer(model=model, reward_funcs=[reward_fn], args=trl.GRPOConfig(**settings),
                              train_dataset=trl_dataset(cfg), processing_class=processor)
    check = _InputCheck(processor, processor.video_pad, processor.image_pad)
    for m in (trainer.model, trainer.ref_model):
        if m is not None:
            check.install(m)
    clock = _StepClock()
    generate = trainer._generate_single_turn

    def recorded(*args, **kwargs):
        check.begin()
        try:
            return generate(*args, **kwargs)
        finally:
            check.end()

    trainer._generate_single_turn = recorded
    clock.wrap(trainer, "_generate_single_turn", lambda args, kw: "gen")
    clock.wrap(trainer, "_get_per_token_logps_and_entropies",
               lambda args, kw: "ref" if args and args[0] is trainer.ref_model else None)
    trainer.add_callback(clock.callback())
    trainer.train()
    dataset = PromptDataset(cfg.data, tokenizer, cfg.data.train_files, "train",
                            merge_size=processor.geometry["merge_size"])
    result = {"steps": clock.steps, "check": check_inputs(check.prefills, dataset, cfg.data.rollout_batch_size, r.n),
              "settings": {k: v for k, v in settings.items() if k != "output_dir"}, "unequal": list(UNEQUAL),
              "trl_version": trl.__version__, "threads": threads, "malloc_keeps_freed_memory": malloc_tuned}
    (out / "trl.json").write_text(json.dumps(result, indent=1, default=str))
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experiment", required=True, help="bench_short | bench_image | bench_video")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out", required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides (e.g. model.path=...)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    from rollplex_train.bench.peers import compose_config

    run_trl(compose_config(args.experiment, args.overrides), args.steps, Path(args.out), args.threads)


if __name__ == "__main__":
    main()
