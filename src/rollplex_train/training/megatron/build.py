"""Process groups and model construction of the Megatron backend (one function per job).

``init_parallel`` brings up megatron-core's TP/DP/PP groups from a ``ParallelLayout`` (the worker
has already joined the default group when the layout spans several ranks; a single process gets a
one-rank gloo group here). ``build_model`` loads a local HF checkpoint, converts its language model
into this rank's ``GPTModel`` shard and splits its vision tower over TP (``vision.py``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch

from rollplex_train.models.layouts import Dims, Layout
from rollplex_train.models.loading import load_model
from rollplex_train.models.megatron_convert import hf_to_megatron, megatron_layout, vision_shards
from rollplex_train.sharing.plan import megatron_vocab_divisor
from rollplex_train.training.megatron.model import (
    MegatronVLM, build_gpt_model, has_transformer_engine, transformer_config)
from rollplex_train.training.megatron.vision import parallelize_vision

log = logging.getLogger(__name__)



def init_parallel(layout, rank: int, seed: int) -> None:
    """Megatron's parallel state for ``layout`` (``initialize_model_parallel(tp, pp)``), CPU patches
    on CPU runs, and the RNG tracker.

    Raises:
        RuntimeError: a multi-rank layout without an initialised default process group, or a
            parallel state already initialised with other degrees.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    if not dist.is_initialized():
        if layout.world_size > 1:
            raise RuntimeError(f"rank {rank}: a {layout.world_size}-rank layout needs torch.distributed "
                               "initialised by the worker before the engine is built")
        backend = "nccl" if layout.device == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    if dist.get_world_size() != layout.world_size or dist.get_rank() != rank:
        raise RuntimeError(f"process group rank {dist.get_rank()}/{dist.get_world_size()} != layout rank "
                           f"{rank}/{layout.world_size}")
    if layout.device == "cpu":
        from rollplex_train.training.megatron.cpu_patches import apply_cpu_patches

        apply_cpu_patches()
    if ps.model_parallel_is_initialized():
        if (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()) != (
                layout.train_tp, layout.train_pp):
            raise RuntimeError("megatron parallel state already initialised with other TP/PP degrees")
    else:
        ps.initialize_model_parallel(tensor_model_parallel_size=layout.train_tp,
                                     pipeline_model_parallel_size=layout.train_pp)
    if layout.device == "cuda":
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


@dataclass
class BuiltModel:
    """A rank's model and the conversion layout it was cut with."""

    model: MegatronVLM
    layout: Layout
    te_names: bool


def build_model(path: str, dtype: str, attn_implementation: str, *, tp: int, pp: int, tp_rank: int,
                device, vocab_divisible_by: Optional[int] = None) -> BuiltModel:
    """Load the HF checkpoint at ``path`` and build this TP rank's :class:`MegatronVLM` on ``device``
    (a ``torch.device`` or ``cpu``/``cuda``: the current CUDA device).

    Args:
        vocab_divisible_by: megatron's ``make_vocab_size_divisible_by`` (default 128,
            ``megatron/training/arguments.py``); None picks ``sharing.plan.megatron_vocab_divisor``:
            the largest power of two <= 128 whose padding equals the rollout's (SGLang pads to a
            multiple of 64), so that every rank's vocabulary shard is a view of the rollout's.

    Raises:
        ValueError: pipeline parallelism (``pp > 1``) is not built; TP does not divide the heads.
        FileNotFoundError: as ``models.loading.load_model``.
    """
    if pp != 1:
        raise ValueError(f"actor.pipeline_parallel_size={pp}: the Megatron backend runs PP=1 only so far")
    hf = load_model(path, dtype, attn_implementation)
    shapes = {n: tuple(p.shape) for n, p in hf.named_parameters()}
    vocab = hf.config.get_text_config().vocab_size
    vocab_divisible_by = vocab_divisible_by or megatron_vocab_divisor(vocab, tp)
    layout = megatron_layout(shapes, Dims.from_hf_config(hf.config), tp, vocab_divisible_by)
    device = torch.device(device)
    on_cpu = device.type == "cpu"
    use_te = not on_cpu and has_transformer_engine()
    config = transformer_config(hf.config, tp=tp, pp=pp, dtype=next(hf.parameters()).dtype, on_cpu=on_cpu,
                                fused=use_te)
    padded = -(-vocab // (vocab_divisible_by * tp)) * vocab_divisible_by * tp
    gpt = build_gpt_model(hf.config, config, padded, use_te)
    full = {n: p.detach() for n, p in hf.named_parameters()}
    missing, unexpected = gpt.load_state_dict(hf_to_megatron(full, layout, tp_rank, use_te), strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise RuntimeError(f"GPTModel keys not converted: missing={missing} unexpected={unexpected}")
    parallelize_vision(hf.model.visual, vision_shards(full, layout, tp_rank), tp)
    hf.model.language_model = None  # replaced by the GPTModel; the shell keeps config + vision
    hf.lm_head = None
    model = MegatronVLM(hf, gpt, vocab)
    return BuiltModel(model.to(device), layout, use_te)
