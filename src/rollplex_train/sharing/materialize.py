"""Materializer: one rollout rank's tensors, built from the local training shards of its device.

``view``/``strided_view`` tensors are ``as_strided`` views of the training tensors (same untyped
storage, no copy: an in-place optimizer step is seen by the rollout at once). ``local_rebuild`` and
``gather`` tensors live in buffers allocated once; ``sync()`` refills them in place at every
weight sync, so their storage (and any IPC handle to it) stays valid across syncs.

Gathered runs come from a ``fetch(block, dim) -> Tensor`` callable (rows ``block`` of the HF tensor
along ``dim``); ``RankFetcher`` serves it from simulated ranks' shards in one process.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

import torch

from rollplex_train.models.layouts import Block, Layout
from rollplex_train.sharing.plan import TensorPlan, index_rank, locate

log = logging.getLogger(__name__)

Fetch = Callable[[Block, int], torch.Tensor]


def _logical(t: torch.Tensor, groups: int) -> torch.Tensor:
    return t.flatten(0, 1) if groups else t


class Materializer:
    """The rollout tensors of one (training rank, rollout rank) pair.

    Args:
        plans: ``SharePlan.tensors[(training rank, rollout rank)]``.
        local: the training rank's tensors by layout name (contiguous; the spec shapes).
        fetch: serves ``gather`` runs; required when a plan gathers.
        shared: allocate rebuild buffers in shared memory (CPU) so they can be handed over by IPC.

    Attributes:
        tensors: ``{rollout name: tensor}`` (views and buffers), shapes ``spec.shape``.

    Raises:
        ValueError: a plan gathers and no ``fetch`` is given; a local tensor is not contiguous or
        has another shape than its spec.
    """

    def __init__(self, plans: dict[str, TensorPlan], local: dict[str, torch.Tensor],
                 fetch: Optional[Fetch] = None, shared: bool = False):
        self.plans, self.local, self.fetch = plans, local, fetch
        self.tensors: dict[str, torch.Tensor] = {}
        self._rebuilds: list[TensorPlan] = []
        sample = next(iter(local.values()))
        for name, tp in plans.items():
            if tp.view is not None:
                src_name, size, stride, offset = tp.view
                src = local[src_name]
                if not src.is_contiguous():
                    raise ValueError(f"training tensor {src_name} is not contiguous: cannot view it")
                self.tensors[name] = src.as_strided(size, stride, src.storage_offset() + offset)
                continue
            if tp.action == "gather" and fetch is None:
                raise ValueError(f"{name} gathers {tp.remote_bytes} bytes from other ranks: give fetch=")
            buf = torch.empty(tp.spec.shape, dtype=sample.dtype, device=sample.device)
            if shared and buf.device.type == "cpu":
                buf.share_memory_()
            self.tensors[name] = buf
            self._rebuilds.append(tp)
        self.sync()

    @property
    def rebuild_bytes(self) -> int:
        """Bytes copied by one ``sync`` (rebuilt and gathered tensors)."""
        return sum(tp.nbytes for tp in self._rebuilds)

    @property
    def view_bytes(self) -> int:
        return sum(tp.nbytes for tp in self.plans.values() if tp.view is not None)

    @torch.no_grad()
    def sync(self) -> None:
        """Refill every rebuilt tensor from the current training shards (views need nothing)."""
        for tp in self._rebuilds:
            dst = _logical(self.tensors[tp.spec.name], tp.spec.groups)
            dim, offset = tp.spec.dim, 0
            for p in tp.pieces:
                out = dst.narrow(dim, offset, p.block.size)
                if p.tensor is not None:
                    out.copy_(self.local[p.tensor].narrow(dim, p.pos, p.block.size))
                elif p.remote:
                    out.copy_(self.fetch(p.block, dim))
                else:
                    out.zero_()
                offset += p.block.size


class RankFetcher:
    """``fetch`` over simulated training ranks: the rows of ``block`` from whichever rank holds them.

    Args:
        layout: the training layout; rank_tensors[i]: rank i's tensors by layout name.

    Raises:
        KeyError: no rank holds some rows of the block.
    """

    def __init__(self, layout: Layout, rank_tensors: list[dict[str, torch.Tensor]]):
        self.rank_tensors = rank_tensors
        self.indexes = [index_rank(specs) for specs in layout.ranks]
        self.hf_shapes = layout.hf_shapes

    def __call__(self, block: Block, dim: int) -> torch.Tensor:
        parts, cur = [], block.start
        while cur < block.stop:
            for idx, tensors in zip(self.indexes, self.rank_tensors):
                first = locate(Block(block.source, cur, block.stop), idx, self.hf_shapes[block.source][dim])[0]
                if first.tensor is not None:
                    parts.append(tensors[first.tensor].narrow(dim, first.pos, first.block.size))
                    cur = first.block.stop
                    break
            else:
                raise KeyError(f"no training rank holds rows {cur}.. of {block.source}")
        return torch.cat(parts, dim=dim)
