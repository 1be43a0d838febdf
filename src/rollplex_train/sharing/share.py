"""The trainer side of in-place weight sharing, for any training layout and rollout layout.

One ``WeightShare`` per training rank: the rollout tensors of the rollout rank that runs on the
rank's device (``SharePlan.devices``), made by a ``Materializer`` from the rank's local training
tensors: ``view``/``strided_view`` tensors are views of the actor's parameters (same storage: an
optimizer step is seen by the rollout with no copy), ``local_rebuild`` and ``gather`` tensors are
buffers allocated once (in shared memory on CPU) and refilled by ``publish``. ``gather`` runs (only
where t != r puts rows of a rollout tensor on another training rank) come from ``TPGather``: one
``all_gather`` per training tensor that holds such rows, in the same order on every TP rank.

The hand-over (``export``) and its versioning are those of the embedded run: IPC handles
(``sharing/ipc.py``) or, in one process, the tensors themselves (``sharing.embedded.LocalWeights``),
plus a ``WeightsVersion`` counter the trainer sets to -1 (``begin_update``) before writing in place
and to the new version after (``publish``). ``docs/sharing.md`` gives the payload format.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from rollplex_train.models.layouts import Block, Layout
from rollplex_train.sharing.materialize import Materializer, RankFetcher
from rollplex_train.sharing.plan import SharePlan

log = logging.getLogger(__name__)


def gathered_names(plan: SharePlan) -> list[str]:
    """Training tensor names (the same on every TP rank) whose shards some device's ``gather`` runs
    read: every TP rank all-gathers exactly these, in this order. Empty when nothing is gathered."""
    sources = {p.block.source for pair in set(plan.devices) for tp in plan.tensors[pair].values()
               for p in tp.pieces if p.remote}
    return sorted({name for specs in plan.train.ranks for name, spec in specs.items()
                   if any(b.source in sources for b in spec.blocks)})


class TPGather:
    """``fetch`` for a ``Materializer`` on one TP rank: rows held by other training ranks, served
    from an all-gather of the tensors that hold them (``refresh`` before a ``sync``, collective
    over the TP group; ``release`` frees the gathered copies after it).

    Args:
        layout: the training layout. local: this rank's tensors by layout name.
        names: ``gathered_names(plan)``. group: the TP process group.
    """

    def __init__(self, layout: Layout, local: dict[str, torch.Tensor], names: list[str], group):
        self.layout, self.local, self.names, self.group = layout, local, names, group
        self._fetcher: Optional[RankFetcher] = None

    def refresh(self) -> int:
        """All-gather ``names`` over the TP group; returns the bytes received from other ranks."""
        ranks = [{} for _ in range(self.layout.tp)]
        received = 0
        for name in self.names:
            tensor = self.local[name].contiguous()
            parts = [torch.empty_like(tensor) for _ in range(self.layout.tp)]
            torch.distributed.all_gather(parts, tensor, group=self.group)
            for i, part in enumerate(parts):
                ranks[i][name] = part
            received += tensor.numel() * tensor.element_size() * (self.layout.tp - 1)
        self._fetcher = RankFetcher(self.layout, ranks)
        return received

    def release(self) -> None:
        self._fetcher = None

    def __call__(self, block: Block, dim: int) -> torch.Tensor:
        assert self._fetcher is not None, "TPGather.refresh() before a sync"
        return self._fetcher(block, dim)


def materialize(plan: SharePlan, device_index: int, local: dict[str, torch.Tensor], *, group=None,
                shared: bool = False) -> tuple[Materializer, Optional[TPGather], tuple[int, int]]:
    """The ``Materializer`` of the (training rank, rollout rank) pair on device ``device_index``
    (its rebuilt tensors filled; collective over the TP group when the plan gathers).

    Args:
        local: this training rank's tensors by layout name (contiguous, the spec shapes).
        group: the TP process group (required when the plan gathers). shared: rebuild buffers in
            shared memory.

    Returns:
        (materializer, the ``TPGather`` or None, (training rank, rollout rank)).
    """
    pair = plan.devices[device_index % len(plan.devices)]
    names = gathered_names(plan)
    gather = TPGather(plan.train, local, names, group) if names else None
    if gather is not None:
        gather.refresh()
    mat = Materializer(plan.tensors[pair], local, gather, shared=shared)
    if gather is not None:
        gather.release()
    return mat, gather, pair


class WeightShare:
    """The rollout tensors of one device, shared in place with the rollout rank running there.

    Args:
        plan: the share plan of the run's (training layout, t) -> (rollout layout, r).
        device_index: this training rank's device (``plan.devices[device_index % D]``).
        local: the training rank's tensors by layout name (views of the actor's parameters).
        rollout_kind: the rollout layout's name (recorded in ``export``).
        group: the TP process group (when the plan gathers). same_process: the rollout engine
            lives in this process (nothing moves to shared memory; the payload is the tensors).

    Attributes:
        view_bytes: rollout bytes that are views of the training storage. rebuild_bytes: bytes
        copied into buffers by one ``publish`` (rebuilt and gathered tensors). remote_bytes: the part
        of those fetched from other ranks. rollout_bytes: all rollout bytes of this device.

    Raises:
        ValueError: a plan gathers without ``group``, or a local tensor is not contiguous.
    """

    def __init__(self, plan: SharePlan, device_index: int, local: dict[str, torch.Tensor], *,
                 rollout_kind: str, group=None, same_process: bool = False):
        from rollplex_train.versioning import WeightsVersion

        if gathered_names(plan) and group is None:
            raise ValueError("the share plan gathers rows from other TP ranks: give the TP group")
        self.same_process = same_process
        for t in ([] if same_process else local.values()):
            if t.device.type == "cpu" and not t.untyped_storage().is_shared():
                t.share_memory_()  # in place: the Parameter (and the optimizer's reference) keeps it
        self.materializer, self.gather, pair = materialize(plan, device_index, local, group=group,
                                                           shared=not same_process)
        self.train_rank, self.rollout_rank = pair
        self.rollout_kind, self.rollout_tp = rollout_kind, plan.rollout.tp
        plans = plan.tensors[pair]
        self.view_bytes = self.materializer.view_bytes
        self.rebuild_bytes = self.materializer.rebuild_bytes
        self.remote_bytes = sum(tp.remote_bytes for tp in plans.values())
        self.rollout_bytes = sum(tp.nbytes for tp in plans.values())
        self.device = next(iter(local.values())).device
        self._train_storages = {t.untyped_storage().data_ptr() for t in local.values()}
        self.version = WeightsVersion()
        log.info("rollout rank %d of %s r=%d shared: %d tensors, %.1f MB as views, %.1f MB rebuilt per sync "
                 "(%.1f MB from other ranks)", self.rollout_rank, rollout_kind, self.rollout_tp, len(plans),
                 self.view_bytes / 1e6, self.rebuild_bytes / 1e6, self.remote_bytes / 1e6)

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """``{rollout name: tensor}`` of this device's rollout rank (views and buffers)."""
        return self.materializer.tensors

    def rebuilt_device_bytes(self) -> int:
        """Bytes of the storages behind this device's rollout tensors that are not the training
        tensors' (the rebuilt and gathered buffers: the ``rollout_rebuilt`` group of
        ``memory/groups.py``), measured from the tensors themselves."""
        from rollplex_train.memory.measure import live_tensor_bytes

        return live_tensor_bytes(t for t in self.tensors.values() if t.untyped_storage().data_ptr() not in self._train_storages)

    def export(self) -> dict:
        """The hand-over for the rollout rank on this device (load it once, while this process
        lives): ``payload`` (IPC handle bytes, or a ``LocalWeights`` in one process),
        ``rollout_kind``, ``rollout_tp``, ``rollout_rank``, and the byte counts ``view_bytes``,
        ``rebuild_bytes``, ``remote_bytes``, ``rollout_bytes`` (``docs/sharing.md``)."""
        from rollplex_train.sharing.embedded import LocalWeights
        from rollplex_train.sharing.ipc import export_handles

        payload = (LocalWeights(self.tensors, self.version) if self.same_process
                   else export_handles(self.tensors, self.version))
        return {"payload": payload, "rollout_kind": self.rollout_kind, "rollout_tp": self.rollout_tp,
                "rollout_rank": self.rollout_rank, "view_bytes": self.view_bytes,
                "rebuild_bytes": self.rebuild_bytes, "remote_bytes": self.remote_bytes,
                "rollout_bytes": self.rollout_bytes}

    def begin_update(self) -> None:
        """The trainer is about to write the weights in place: the rollout refuses them until ``publish``."""
        self.version.begin_update()

    def publish(self, version: int) -> dict[str, float]:
        """Refill the rebuilt and gathered tensors from the current weights (collective over the TP
        group when the plan gathers) and declare them ``version``.

        Returns:
            ``sharing/rebuild_bytes`` (copied into buffers) and ``sharing/remote_bytes`` (of those,
            received from other ranks).

        Raises:
            StaleWeightsError: ``version`` is not newer than the last published one.
        """
        if self.gather is not None:
            self.gather.refresh()
        self.materializer.sync()
        if self.gather is not None:
            self.gather.release()
        if self.device.type == "cuda":  # the optimizer's kernels are done before the rollout may read
            torch.cuda.current_stream(self.device).synchronize()
        self.version.publish(version)
        return {"sharing/rebuild_bytes": float(self.rebuild_bytes), "sharing/remote_bytes": float(self.remote_bytes)}
