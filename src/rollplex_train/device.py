"""Where an engine's tensors live and in which precision it computes.

``engine_device``: the torch device of the engine on run device ``local_index`` of its node. On a
CPU run it is ``cpu``. On a GPU run it is ``cuda:<local index>``, except where only one GPU is
visible to the process: Ray gives each actor the GPU of its placement-group bundle by setting
``CUDA_VISIBLE_DEVICES`` (Ray docs, "GPU support": an actor with ``num_gpus`` sees only its
assigned GPUs), so there the bundle's GPU is ``cuda:0``.

``compute_context``: the precision of forward passes (``model.compute_dtype``). ``float32``
computes in the weights' dtype (no context; CPU numerics unchanged). ``bfloat16`` keeps fp32
parameters (the master weights) and fp32 AdamW states and runs the forward under
``torch.autocast(device_type, dtype=torch.bfloat16)`` (torch docs, "Automatic Mixed Precision"):
matmuls and attention in bf16, reductions such as softmax/log-softmax in fp32. Gradients land in the
fp32 parameters' ``.grad``, so no loss scaling is needed for bf16.
"""

from __future__ import annotations

import contextlib
from typing import ContextManager

import torch

COMPUTE_DTYPES = {"float32": None, "bfloat16": torch.bfloat16}


def engine_device(device: str, local_index: int = 0) -> torch.device:
    """The torch device of an engine on ``device`` (``cpu`` or ``cuda``) at ``local_index`` of its node.

    Raises:
        ValueError: ``device`` is neither ``cpu`` nor ``cuda``.
        RuntimeError: ``cuda`` while torch sees no GPU (the message names ``cluster.device``).
    """
    if device == "cpu":
        return torch.device("cpu")
    if device != "cuda":
        raise ValueError(f"cluster.device={device!r}: expected 'cpu' or 'cuda'")
    visible = torch.cuda.device_count()
    if visible == 0:
        raise RuntimeError("cluster.device=cuda: torch sees no GPU in this process")
    return torch.device("cuda", 0 if visible == 1 else local_index)


def layout_device(layout, device_index: int) -> torch.device:
    """The engine device of run device ``device_index`` under ``layout`` (a ``ParallelLayout``; None: a
    single-process run, where the model stays where ``load_model`` put it)."""
    if layout is None:
        return torch.device(torch.get_default_device())
    return engine_device(layout.device, layout.local_index(device_index))


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of ``model``'s first parameter (where its inputs must be)."""
    return next(model.parameters()).device


def compute_context(device: torch.device, compute_dtype: str = "float32") -> ContextManager:
    """The context forward passes of an engine on ``device`` run in (see the module docstring).

    Raises:
        ValueError: an unknown ``compute_dtype`` (names ``model.compute_dtype``).
    """
    if compute_dtype not in COMPUTE_DTYPES:
        raise ValueError(f"model.compute_dtype={compute_dtype!r}: expected one of {list(COMPUTE_DTYPES)}")
    dtype = COMPUTE_DTYPES[compute_dtype]
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)
