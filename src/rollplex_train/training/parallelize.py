"""Parallelism for the torch backend, applied outside model code (torchtitan's
``models/llama3/infra/parallelize.py`` shape: one function takes the model and the layout).

The torch backend is data parallel only (``actor.tensor_parallel_size`` and
``pipeline_parallel_size`` > 1 need the Megatron backend). Each DP rank holds a full replica and,
after the micro-batches of a mini-batch, the ranks sum their gradients with one flattened
all-reduce (what DDP's reducer does at the end of a backward, without its per-bucket hooks).

Why not DDP or FSDP2 here (rechecked when the PPO loop was split from the backends):

* DDP arms its reducer in ``DistributedDataParallel.forward`` (``_pre_forward`` ->
  ``reducer.prepare_for_backward``; the reducer's autograd hook returns early when no forward of
  the wrapper armed it, ``torch/csrc/distributed/c10d/reducer.cpp::autograd_hook``). None of our
  passes is a forward of the wrapped model: the prefix passes (in the decode window, steps ahead of
  the update), the suffix passes and the full-sequence pass call the vision tower, the language
  model and the LM head directly (``models/prefix.py``, ``models/sequence.py``), so DDP would
  reduce nothing. A DP rank with no responses in a mini-batch must also still join the sum.
* FSDP2 (``fully_shard``) keeps 1/N of every parameter per rank and all-gathers them inside each
  forward; the rollout engine maps the actor's parameters as views, in place (``sharing/``), which
  needs every device to hold the whole parameters its rollout rank reads (a sharded actor would cost
  an all-gather copy per weight sync: what sharing removes).

What this costs: the all-reduce runs once after the last backward of the mini-batch instead of
overlapping the backward bucket by bucket (not measured; it matters on GPUs, not on the 2-core
CPU runs). The old reason given here, several backward passes through one retained prefix graph,
no longer holds: with ``model.shared_prefix`` each micro-batch is one group and each prefix graph
gets exactly one backward (``training/log_probs.py::ResponseScorer.micro_batches``).
Summing gradients explicitly works on gloo (CPU) and NCCL (GPU) alike. Losses are normalised by the
mini-batch's global token/sequence counts (``data.types.MiniBatchSpec``), so the summed gradient
equals the single-process one.
"""

from __future__ import annotations

from typing import Optional

import torch


class DataParallel:
    """Gradient and metric sums over a data-parallel group.

    Args:
        params: the trainable parameters, in the same order on every rank.
        group: the torch.distributed process group of the DP ranks (None: a single rank, every
            call is a no-op).

    Raises:
        ValueError: ``group`` is given but torch.distributed is not initialised.
    """

    def __init__(self, params: list[torch.nn.Parameter], group: Optional[object] = None):
        self.params = params
        self.group = group
        if group is not None and not torch.distributed.is_initialized():
            raise ValueError("data parallelism needs torch.distributed to be initialised first")

    @property
    def size(self) -> int:
        """DP ranks in the group (1 without one)."""
        return 1 if self.group is None else torch.distributed.get_world_size(self.group)

    def all_reduce_grads(self) -> int:
        """Sum every parameter's ``.grad`` over the group in place (a missing grad counts as
        zeros, so a rank with no responses in a mini-batch still takes part). Returns the bytes
        reduced (0 without a group)."""
        if self.group is None:
            return 0
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        torch.distributed.all_reduce(flat, op=torch.distributed.ReduceOp.SUM, group=self.group)
        offset = 0
        for p, g in zip(self.params, grads):
            n = g.numel()
            p.grad = flat[offset : offset + n].view_as(p).clone() if p.grad is None else p.grad.copy_(
                flat[offset : offset + n].view_as(p))
            offset += n
        return flat.numel() * flat.element_size()

    def sum_metrics(self, metrics: dict[str, float], keys: tuple[str, ...]) -> dict[str, float]:
        """:func:`sum_metrics` over this group."""
        return sum_metrics(metrics, keys, self.group)


def sum_metrics(metrics: dict[str, float], keys: tuple[str, ...], group=None) -> dict[str, float]:
    """``metrics`` with the values of ``keys`` summed over the process ``group`` (the others
    unchanged; None: one rank, unchanged); every rank gets the same result."""
    if group is None or not keys:
        return metrics
    values = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64)
    torch.distributed.all_reduce(values, op=torch.distributed.ReduceOp.SUM, group=group)
    return {**metrics, **{k: float(v) for k, v in zip(keys, values.tolist())}}

def parallelize_torch(params: list[torch.nn.Parameter], layout, rank: int) -> DataParallel:
    """Apply the layout's data parallelism to a replicated torch model.

    Args:
        params: trainable parameters. layout: :class:`rollplex_train.parallel.ParallelLayout`
            (or None for a single process). rank: this process's training rank.

    Raises:
        ValueError: the layout asks for TP or PP, which the torch backend does not implement.
    """
    if layout is None or layout.train_dp == 1:
        return DataParallel(params, None)
    if layout.train_tp > 1 or layout.train_pp > 1:
        raise ValueError(f"actor.backend=torch is data parallel only: actor.tensor_parallel_size={layout.train_tp}, "
                         f"actor.pipeline_parallel_size={layout.train_pp} need actor.backend=megatron")
    assert torch.distributed.get_world_size() == layout.train_dp, "torch backend: every device is a DP rank"
    return DataParallel(params, torch.distributed.group.WORLD)
