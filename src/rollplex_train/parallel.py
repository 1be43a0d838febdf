"""The run's parallel layout: devices, and the training / rollout degrees over them.

One validated :class:`ParallelLayout` is built from the config once (:meth:`ParallelLayout.
from_config`) and read by everything that needs a degree or a rank: the cluster placement, the
worker groups, the engines, ``rollplex-plan memory`` and ``rollplex-plan sharing``. The shape is
torchtitan's ``distributed/parallel_dims.py::ParallelDims`` (one object, checked once).

Devices are numbered ``0 .. world_size - 1`` node-major: device ``d`` is local index
``d % devices_per_node`` of node ``d // devices_per_node`` (the placement group orders its bundles
the same way, by node IP then device index). A device is a GPU, or on a CPU run a set of
``cluster.threads_per_device`` cores.

Training ranks are the devices. Their grid is Megatron-core's default order ``tp-dp-pp`` (TP
varies fastest, then DP, then PP; megatron-core ``parallel_state.initialize_model_parallel``,
``order="tp-cp-ep-dp-pp"`` with cp = ep = 1), so a TP group is ``tp`` consecutive devices of one
node. Rollout engine ``e`` spans devices ``e * rollout_tp .. (e + 1) * rollout_tp - 1`` (the SGLang
shape: ``base_gpu_id`` is the engine's first local device).
"""

from __future__ import annotations

from dataclasses import dataclass

DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class RankCoords:
    """Position of one training rank in the ``tp-dp-pp`` grid (all 0-based)."""

    tp: int
    dp: int
    pp: int


@dataclass(frozen=True, kw_only=True)
class ParallelLayout:
    """Devices of the run and the parallel degrees laid over them.

    Attributes:
        nnodes: nodes (``cluster.nnodes``). devices_per_node: devices per node
            (``cluster.devices_per_node``). device: ``cpu`` or ``cuda`` (``cluster.device``).
        threads_per_device: torch threads of a device's workers on a CPU run
            (``cluster.threads_per_device``; ignored on GPU runs, where it is 1).
        train_tp, train_pp: actor/reference tensor- and pipeline-parallel degrees
            (``actor.tensor_parallel_size``, ``actor.pipeline_parallel_size``).
        rollout_tp: devices per rollout engine (``rollout.tensor_parallel_size``).

    Raises:
        ValueError: a degree that does not divide the devices, a TP group or a rollout engine that
            would span nodes, or a non-positive count; the message names the config keys.
    """

    nnodes: int = 1
    devices_per_node: int = 1
    device: str = "cpu"
    threads_per_device: int = 1
    train_tp: int = 1
    train_pp: int = 1
    rollout_tp: int = 1

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(f"cluster.device={self.device!r}: expected one of {list(DEVICES)}")
        for key, value in (("cluster.nnodes", self.nnodes), ("cluster.devices_per_node", self.devices_per_node),
                           ("cluster.threads_per_device", self.threads_per_device),
                           ("actor.tensor_parallel_size", self.train_tp),
                           ("actor.pipeline_parallel_size", self.train_pp),
                           ("rollout.tensor_parallel_size", self.rollout_tp)):
            if value < 1:
                raise ValueError(f"{key}={value}: expected an integer >= 1")
        world = self.world_size
        if world % (self.train_tp * self.train_pp):
            raise ValueError(
                f"actor.tensor_parallel_size={self.train_tp} x actor.pipeline_parallel_size={self.train_pp} "
                f"does not divide the {world} devices (cluster.nnodes={self.nnodes} x "
                f"cluster.devices_per_node={self.devices_per_node})")
        if self.devices_per_node % self.train_tp:
            raise ValueError(
                f"actor.tensor_parallel_size={self.train_tp} must divide cluster.devices_per_node="
                f"{self.devices_per_node}: a TP group stays inside one node")
        if self.devices_per_node % self.rollout_tp:
            raise ValueError(
                f"rollout.tensor_parallel_size={self.rollout_tp} must divide cluster.devices_per_node="
                f"{self.devices_per_node}: a rollout engine spans devices of one node")

    # ---- sizes ---------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        """Devices of the run (= training ranks)."""
        return self.nnodes * self.devices_per_node

    @property
    def train_dp(self) -> int:
        """Data-parallel degree of the actor/reference: ``world / (tp * pp)``."""
        return self.world_size // (self.train_tp * self.train_pp)

    @property
    def rollout_dp(self) -> int:
        """Rollout engines: ``world / rollout_tp``."""
        return self.world_size // self.rollout_tp

    # ---- ranks ---------------------------------------------------------------------------------
    def node_of(self, device: int) -> int:
        """The node index of ``device``."""
        return device // self.devices_per_node

    def local_index(self, device: int) -> int:
        """The device's index on its node (``cuda:<local index>`` on GPU runs)."""
        return device % self.devices_per_node

    def train_coords(self, rank: int) -> RankCoords:
        """``rank``'s (tp, dp, pp) coordinates in the ``tp-dp-pp`` grid."""
        assert 0 <= rank < self.world_size, rank
        return RankCoords(tp=rank % self.train_tp, dp=(rank // self.train_tp) % self.train_dp,
                          pp=rank // (self.train_tp * self.train_dp))

    def dp_group_ranks(self, rank: int) -> list[int]:
        """The training ranks holding the same model shard as ``rank`` (its DP group), ascending."""
        c = self.train_coords(rank)
        base = c.pp * self.train_tp * self.train_dp + c.tp
        return [base + d * self.train_tp for d in range(self.train_dp)]

    def tp_group_ranks(self, rank: int) -> list[int]:
        """The training ranks of ``rank``'s TP group, ascending."""
        start = rank - self.train_coords(rank).tp
        return list(range(start, start + self.train_tp))

    def dp_leaders(self) -> list[int]:
        """One rank per DP index (tp = pp = 0): where a DP rank's batch is addressed."""
        return [d * self.train_tp for d in range(self.train_dp)]

    def rollout_engine_of(self, device: int) -> int:
        """The rollout engine whose TP group holds ``device``."""
        return device // self.rollout_tp

    def rollout_devices(self, engine: int) -> list[int]:
        """The devices one rollout engine spans (its first is the engine's ``base_gpu_id`` on its node)."""
        return list(range(engine * self.rollout_tp, (engine + 1) * self.rollout_tp))

    def describe(self) -> str:
        """One line for logs and reports."""
        return (f"{self.world_size} {self.device} devices ({self.nnodes} node(s) x {self.devices_per_node}); "
                f"train TP={self.train_tp} PP={self.train_pp} DP={self.train_dp}; "
                f"rollout {self.rollout_dp} engine(s) x TP={self.rollout_tp}")

    @classmethod
    def from_config(cls, cfg) -> "ParallelLayout":
        """The layout of a validated :class:`rollplex_train.config.Config`.

        Raises:
            ValueError: as the class does.
        """
        c = cfg.cluster
        return cls(nnodes=c.nnodes, devices_per_node=c.devices_per_node, device=c.device,
                   threads_per_device=c.resolved_threads_per_device() if c.device == "cpu" else 1,
                   train_tp=cfg.actor.tensor_parallel_size, train_pp=cfg.actor.pipeline_parallel_size,
                   rollout_tp=cfg.rollout.tensor_parallel_size)
