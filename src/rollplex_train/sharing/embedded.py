"""Weight sharing in the embedded run (t = r = 1): the rollout model's parameters *are* the actor's.

Trainer side, ``SharedActor``: plans HF (t = 1) -> HF (r = 1) with ``plan.plan_sharing`` (every
tensor a ``view``), moves the actor's parameters to shared memory once, in place (``share_memory_``
swaps each storage under the same ``Parameter`` objects, so the optimizer keeps updating exactly
those tensors, tied embeddings stay one tensor, and the reference model, a deepcopy made before,
keeps its own storage), builds the ``Materializer`` (views; rebuild buffers when a plan has any)
and exports IPC handles with a ``WeightsVersion`` counter. Each later sync is ``begin_update``
before the trainer writes (optimizer steps, checkpoint load) and ``publish(version)`` after:
the rebuild buffers are refilled (none at t = r = 1) and the counter bumped.

Rollout side, ``map_parameters``: points every parameter of the rollout model at the received tensor
of the same name (``param.data = shared``: no copy; its own loaded copy is freed). The engine then
checks the counter before (and after) decoding and refuses stale or in-flux weights.

Names: the rollout tensors of an HF -> HF plan carry the HF parameter names of
``named_parameters()`` (tied weights once), the names both processes' models use.
"""

from __future__ import annotations

import hashlib
import logging

import torch

from rollplex_train.models.layouts import Dims
from rollplex_train.sharing.ipc import WeightsVersion, export_handles
from rollplex_train.sharing.materialize import Materializer
from rollplex_train.sharing.plan import plan_sharing

log = logging.getLogger(__name__)


class SharedActor:
    """The trainer side of the embedded sharing: the actor's parameters in shared memory.

    Args:
        model: the actor (a transformers VLM; parameters contiguous, on CPU or CUDA).
        version: the weights version the actor holds now (published at once).
        same_process: the rollout engine lives in this process (``cluster.executor=inprocess``):
            nothing is moved to shared memory and ``export`` hands over the tensors themselves.

    Attributes:
        view_bytes, rebuild_bytes, rollout_bytes: of the plan (rollout tensors shared as views,
        copied into rebuild buffers at each ``publish``, all of them).

    Raises:
        ValueError: the plan's tensors do not match the model's parameters.
    """

    def __init__(self, model: torch.nn.Module, version: int, same_process: bool = False):
        named = dict(model.named_parameters())  # tied weights once
        shapes = {n: tuple(p.shape) for n, p in named.items()}
        itemsize = next(iter(named.values())).element_size()
        plan = plan_sharing(shapes, Dims.from_hf_config(model.config), t=1, r=1, train_kind="hf",
                            rollout_kind="hf", itemsize=itemsize)
        plans = plan.tensors[(0, 0)]
        wrong = sorted(n for n, tp in plans.items() if shapes.get(n) != tuple(tp.spec.shape))
        if wrong or set(plans) != set(shapes):
            raise ValueError(f"sharing plan does not match the actor's parameters: {wrong or sorted(set(plans) ^ set(shapes))}")
        local = {n: p.detach() for n, p in named.items()}
        self.same_process = same_process
        self.device = next(iter(local.values())).device
        for t in ([] if same_process else local.values()):
            if t.device.type == "cpu" and not t.untyped_storage().is_shared():
                t.share_memory_()  # in place: the Parameter (and the optimizer's reference) keeps it
        self.materializer = Materializer(plans, local, shared=True)
        self.view_bytes = self.materializer.view_bytes
        self.rebuild_bytes = self.materializer.rebuild_bytes
        self.rollout_bytes = plan.rollout_bytes
        self.version = WeightsVersion()
        self.version.begin_update()
        self.version.publish(version)
        log.info("actor weights shared: %d tensors, %.1f MB as views, %.1f MB rebuilt per sync", len(plans),
                 self.view_bytes / 1e6, self.rebuild_bytes / 1e6)

    def export(self) -> dict:
        """A payload of handles for one rollout process (load it once, while this process lives), or
        in one process a :class:`LocalWeights` holding the tensors themselves, and the plan's byte counts: ``payload``, ``view_bytes``, ``rebuild_bytes``, ``rollout_bytes``."""
        payload = (LocalWeights(self.materializer.tensors, self.version) if self.same_process
                   else export_handles(self.materializer.tensors, self.version))
        return {"payload": payload, "view_bytes": self.view_bytes,
                "rebuild_bytes": self.rebuild_bytes, "rollout_bytes": self.rollout_bytes}

    def begin_update(self) -> None:
        """The trainer is about to write the weights in place: the rollout refuses them until ``publish``."""
        self.version.begin_update()

    def publish(self, version: int) -> dict[str, float]:
        """Refill the rebuild buffers from the updated parameters and declare them ``version``.

        Returns:
            ``sharing/rebuild_bytes``: the bytes copied (0 when every tensor is a view).

        Raises:
            StaleWeightsError: ``version`` is not newer than the last published one.
        """
        self.materializer.sync()
        if self.device.type == "cuda":  # the optimizer's kernels are done before the rollout may read
            torch.cuda.current_stream(self.device).synchronize()
        self.version.publish(version)
        return {"sharing/rebuild_bytes": float(self.rebuild_bytes)}


class LocalWeights:
    """The in-process counterpart of ``sharing.ipc.SharedWeights``: the trainer's rollout tensors and
    its version counter by reference (a CUDA IPC handle cannot be opened in the process that made
    it, and a CPU one would only add shared-memory segments). Same interface: ``tensors``,
    ``version``, ``check``, ``close``.

    Args:
        tensors: {HF parameter name: tensor} (the actor's parameters; views, no copy).
        version: the trainer's ``WeightsVersion`` (one object for both sides).
    """

    def __init__(self, tensors: dict[str, torch.Tensor], version: WeightsVersion):
        self.tensors = dict(tensors)
        self.version = version

    def check(self, expected: int) -> None:
        """Raises ``StaleWeightsError`` unless the trainer published ``expected`` and is not writing."""
        self.version.check(expected)

    def close(self) -> None:
        self.tensors.clear()
        self.version = None  # type: ignore[assignment]


def map_parameters(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> int:
    """Point every parameter of ``model`` at ``tensors[name]`` (no copy; tied parameters are one
    ``Parameter`` and are mapped once). Checked before anything changes.

    Returns:
        the bytes of the model's parameters now held in the shared tensors.

    Raises:
        ValueError: a parameter has no tensor, or another shape or dtype; a tensor names no parameter.
    """
    named = dict(model.named_parameters())
    missing = sorted(set(named) - set(tensors))
    unexpected = sorted(set(tensors) - set(named))
    wrong = sorted(n for n, p in named.items() if n in tensors and
                   (tensors[n].shape != p.shape or tensors[n].dtype != p.dtype or tensors[n].device != p.device))
    if missing or unexpected or wrong:
        raise ValueError(f"shared weights do not match the rollout model: missing={missing} "
                         f"unexpected={unexpected} wrong shape/dtype/device={wrong}")
    for name, p in named.items():
        p.data = tensors[name]
    return sum(p.numel() * p.element_size() for p in named.values())


def weights_digest(model: torch.nn.Module) -> dict[str, str]:
    """``{parameter name: sha256 of its bytes}`` (tied weights once): equal digests mean bit-equal
    weights, compared across processes without sending the weights."""
    return tensors_digest(dict(model.named_parameters()))


def tensors_digest(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """``{name: sha256 of the tensor's bytes}`` (what ``weights_digest`` computes per parameter)."""
    out = {}
    for name, t in tensors.items():
        data = t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy()
        out[name] = hashlib.sha256(memoryview(data)).hexdigest()
    return out
