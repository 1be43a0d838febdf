"""Numerical checks of the Megatron backend against HF transformers (``scripts/check_megatron.py``).

``run_ranks`` starts ``world`` gloo processes with ``torch.multiprocessing`` (no Ray) and collects
what rank 0 returns. ``check_rank`` is the per-rank body: it builds the engine at the given TP and
measures, on the given prompts (images and video), left and right padding:

* ``max_abs_logit_diff``: max |logits_megatron - logits_hf| over real tokens (fp32);
* ``max_abs_logprob_diff_split``: max |log p_split - log p_full| of random responses, where the
  split pass encodes each prompt once and scores the responses against its KV (``scoring.py``);
* ``max_rel_grad_diff``: max over parameter shards of max|g_split - g_full| / max|g_full| for the
  loss ``sum(w * log p)`` with fixed random weights w (DDP main grads);
* ``hf_roundtrip``: ``exact`` when the exported HF checkpoint's tensors equal the input's bit for
  bit, with the same names, and the export loads in transformers without missing/unexpected keys.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Callable

import torch


def _rank_main(rank: int, world: int, store_dir: str, fn: Callable, args: tuple) -> None:
    import torch.distributed as dist

    import warnings

    from transformers.utils import logging as hf_logging

    warnings.filterwarnings("ignore")  # megatron-core warns about absent apex/TE on every import
    hf_logging.disable_progress_bar()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_dir}/store", rank=rank, world_size=world)
    try:
        out = fn(rank, world, *args)
        if rank == 0:
            torch.save(out, os.path.join(store_dir, "result.pt"))
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable, world: int, *args):
    """Run ``fn(rank, world, *args)`` in ``world`` fresh processes joined in one gloo group; return
    rank 0's result (``fn`` must be importable: a module-level function).

    Raises:
        torch.multiprocessing.ProcessRaisedException: a rank raised (its traceback is included).
    """
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="rollplex-megatron-") as store_dir:
        mp.spawn(_rank_main, args=(world, store_dir, fn, args), nprocs=world, join=True)
        return torch.load(os.path.join(store_dir, "result.pt"), weights_only=False)


def random_responses(prompts, group_size: int, max_len: int, vocab: int, seed: int = 0):
    """``(group_index (N,), response_ids (N, R), response_mask (N, R))`` of random tokens with random
    real lengths in [1, max_len] (right padded with token 0)."""
    g = torch.Generator().manual_seed(seed)
    n = len(prompts) * group_size
    group_index = torch.arange(len(prompts)).repeat_interleave(group_size)
    ids = torch.randint(0, vocab, (n, max_len), generator=g)
    lengths = torch.randint(1, max_len + 1, (n,), generator=g)
    mask = (torch.arange(max_len).view(1, -1) < lengths.view(-1, 1)).float()
    return group_index, ids * mask.long(), mask


def _grads(engine) -> dict[str, torch.Tensor]:
    engine.backend.ddp.finish_grad_sync()
    out = {n: p.main_grad.clone() for n, p in engine.actor.named_parameters() if p.requires_grad}
    engine.backend.ddp.zero_grad_buffer()
    return out


def _max_over_ranks(value: float) -> float:
    t = torch.tensor(value, dtype=torch.float64)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return float(t)


def check_rank(rank: int, world: int, ckpt: str, prompts, out_dir: str) -> dict:
    """Per-rank body of the check at TP = ``world`` (one DP replica); see the module docstring."""
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText

    from rollplex_train.config import ActorConfig, AlgorithmConfig, ModelConfig
    from rollplex_train.data.types import VisionInputs
    from rollplex_train.models.loading import load_model
    from rollplex_train.models.sequence import pad_prompts, rope_positions, vision_kwargs
    from rollplex_train.parallel import ParallelLayout
    from rollplex_train.training.base import create_train_engine
    from rollplex_train.training.megatron import scoring

    layout = ParallelLayout(devices_per_node=world, train_tp=world)
    engine = create_train_engine("megatron", model=ModelConfig(path=ckpt), actor=ActorConfig(),
                                 algorithm=AlgorithmConfig(use_kl_loss=False, kl_coef=0.0), seed=1,
                                 layout=layout, rank=rank)
    model, hf = engine.actor, load_model(ckpt)
    pad = engine.pad_id
    vision = VisionInputs.concat([p.vision for p in prompts])
    logit_diff = logprob_diff = grad_diff = 0.0
    group_index, rids, rmask = random_responses(prompts, 2, 5, model.vocab_size)
    weights = torch.randn(rmask.shape, generator=torch.Generator().manual_seed(1)) * rmask
    for side in ("left", "right"):
        ids, mask = pad_prompts(prompts, pad, side)
        with torch.no_grad():
            ours = scoring.full_logits(model, ids, mask, vision)
            position_ids, _ = rope_positions(hf, ids, mask, vision)
            ref = hf(input_ids=ids, attention_mask=mask, position_ids=position_ids, **vision_kwargs(vision)).logits
        real = mask.bool()
        logit_diff = max(logit_diff, float((ours[real] - ref[real]).abs().max()))
        engine.backend.zero_grad()  # the engine frees its grad buffers between updates: this brings them back
        full, _ = scoring.full_logprobs(model, prompts, group_index, rids, rmask, pad)
        (full * weights).sum().backward()
        g_full = _grads(engine)
        states = scoring.encode_prefix(model, prompts, version=0, with_grad=True, padding=side)
        split, _ = scoring.score_suffix(model, states, group_index, rids, rmask)
        (split * weights).sum().backward()
        g_split = _grads(engine)
        logprob_diff = max(logprob_diff, float((full - split).detach().abs().max()))
        for name, g in g_full.items():
            scale = float(g.abs().max())
            if scale > 0:
                grad_diff = max(grad_diff, float((g_split[name] - g).abs().max()) / scale)
    export = Path(out_dir) / f"hf_tp{world}"
    engine.export_hf(export)
    roundtrip = "differs"
    if rank == 0:
        source = load_file(str(Path(ckpt) / "model.safetensors"))
        exported = load_file(str(export / "model.safetensors"))
        same = source.keys() == exported.keys() and all(torch.equal(source[k], exported[k]) for k in source)
        _, info = AutoModelForImageTextToText.from_pretrained(str(export), output_loading_info=True,
                                                              local_files_only=True)
        clean = not info["missing_keys"] and not info["unexpected_keys"]
        roundtrip = "exact" if same and clean else "differs"
    return {"tp": world, "max_abs_logit_diff": _max_over_ranks(logit_diff),
            "max_abs_logprob_diff_split": _max_over_ranks(logprob_diff),
            "max_rel_grad_diff": _max_over_ranks(grad_diff), "hf_roundtrip": roundtrip}


def format_result(r: dict) -> str:
    """The one-line summary ``megatron: tp=<t> max_abs_logit_diff=<a> ... hf_roundtrip=<...>``."""
    return (f"megatron: tp={r['tp']} max_abs_logit_diff={r['max_abs_logit_diff']:.3e} "
            f"max_abs_logprob_diff_split={r['max_abs_logprob_diff_split']:.3e} "
            f"max_rel_grad_diff={r['max_rel_grad_diff']:.3e} hf_roundtrip={r['hf_roundtrip']}")
