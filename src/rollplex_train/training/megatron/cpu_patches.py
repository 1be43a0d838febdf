"""Every patch that lets megatron-core 0.16.1 run on CPU with gloo, in one place.

Applied only when the training device is the CPU (:func:`apply_cpu_patches`); a CUDA run uses
megatron-core unpatched. Measured on megatron-core 0.16.1 / torch 2.13.0 (CPU): with these patches a
TP=2 ``GPTModel`` (local layer spec, M-RoPE) runs forward and backward over gloo, and Megatron DDP
fills its gradient buffers. What each patch replaces:

1. ``torch.cuda.current_device`` returns ``"cpu"``. megatron-core passes
   ``device=torch.cuda.current_device()`` when it allocates the attention score buffer
   (``utils.GlobalMemoryBuffer``), the rotary ``inv_freq`` (``MultimodalRotaryEmbedding``), the
   DDP grad/param buckets (``distributed/param_and_grad_buffer.py``) and the CPU-initialised
   weights' destination; on CPU every one of those belongs on the CPU.
2. ``tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)``
   replaces ``model_parallel_cuda_manual_seed`` (which seeds CUDA generators that do not exist on
   CPU): the tracker's ``fork()`` becomes a null context. Dropout is 0 in every config this project
   builds, so no random number is drawn inside a fork.
3. Not a patch but a requirement of the same kind, set by ``models/megatron_model.py``:
   ``TransformerConfig(use_cpu_initialization=True)`` and every fusion off (bias/activation,
   bias/dropout, masked softmax, RoPE, gradient accumulation: their kernels are CUDA-only), the
   local (non-Transformer-Engine) layer spec, and a plain ``torch.optim.AdamW`` instead of
   ``get_megatron_optimizer`` (which assumes CUDA tensors and apex/TE multi-tensor kernels).
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

_APPLIED = False


def _cpu_current_device() -> str:
    """Stands in for ``torch.cuda.current_device`` on CPU runs (patch 1)."""
    return "cpu"


def apply_cpu_patches() -> None:
    """Apply patches 1-2 of the module docstring (idempotent; once per process).

    Raises:
        RuntimeError: CUDA is available: the patches would redirect real CUDA allocations.
    """
    global _APPLIED
    if torch.cuda.is_available():
        raise RuntimeError("megatron CPU patches requested on a machine with CUDA: use cluster.device=cuda")
    from megatron.core.tensor_parallel import random as mp_random

    if not _APPLIED:
        torch.cuda.current_device = _cpu_current_device  # patch 1
        _APPLIED = True
        log.info("megatron-core CPU patches applied (torch.cuda.current_device -> 'cpu', null RNG tracker)")
    mp_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)  # patch 2


def patches_applied() -> bool:
    """True once :func:`apply_cpu_patches` ran in this process."""
    return _APPLIED
