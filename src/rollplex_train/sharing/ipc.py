"""Hand rollout tensors to another process as handles, with a shared weights-version counter.

The sender pickles ``{name: tensor}`` with ``torch.multiprocessing``'s reductions
(``multiprocessing.reduction.ForkingPickler``): a CUDA tensor becomes a CUDA IPC handle, a CPU
tensor a handle to shared memory. The receiver maps the same memory: no copy, and every later
in-place write of the trainer (optimizer step on a viewed parameter, ``Materializer.sync`` into a
rebuild buffer) is seen by the rollout engine. Views of one storage stay views of one storage on
the other side (torch caches rebuilt storages by their shared-memory identity).

CPU sharing strategy: ``file_descriptor``, not ``file_system``. With ``file_descriptor`` torch
creates each segment with ``shm_open`` and unlinks its name at once; the segment lives only as
open descriptors/mappings (passed over a Unix socket by ``multiprocessing.resource_sharer``), so it
is freed when the last process holding it exits or drops it, and nothing can be left behind in
``/dev/shm``, even after a crash. ``file_system`` keeps a named ``/dev/shm/torch_*`` file until the
``torch_shm_manager`` daemon sees every client gone; a killed process can leak it. The costs of
``file_descriptor``: one open descriptor per shared storage (well under ``ulimit -n`` for a model's
~1200 parameters), and a payload must be loaded exactly once, while the sender is alive, by a
process with the sender's ``multiprocessing`` authkey (children inherit it; ``set_authkey``).

The version counter is a one-element int64 tensor in the same payload: the trainer sets it to -1
(``begin_update``) before it writes weights in place and to the new version after (``publish``);
the engine calls ``check(version)`` before decoding and refuses anything else with
``StaleWeightsError``.
"""

from __future__ import annotations

import io
import logging
import multiprocessing
import pickle
from typing import Optional

import torch
import torch.multiprocessing as tmp  # registers the tensor/storage reductions with ForkingPickler
from multiprocessing.reduction import ForkingPickler

from rollplex_train.versioning import StaleWeightsError, WeightsVersion, check_newer  # noqa: F401  (re-exported)

log = logging.getLogger(__name__)

SHARING_STRATEGY = "file_descriptor"


def use_sharing_strategy() -> None:
    """Select ``file_descriptor`` for CPU tensors in this process (see the module docstring).

    Raises:
        RuntimeError: the platform lacks it (torch lists the strategies it has).
    """
    if SHARING_STRATEGY not in tmp.get_all_sharing_strategies():
        raise RuntimeError(f"torch sharing strategy {SHARING_STRATEGY!r} unavailable: {tmp.get_all_sharing_strategies()}")
    tmp.set_sharing_strategy(SHARING_STRATEGY)


def set_authkey(key: bytes) -> None:
    """Give this process the authkey of the process it exchanges CPU handles with (Ray actors)."""
    multiprocessing.current_process().authkey = key


def export_handles(tensors: dict[str, torch.Tensor], version: WeightsVersion) -> bytes:
    """Move ``tensors`` to shared memory (CPU; once, in place) and pickle handles to them.

    Returns:
        a payload for ``import_handles`` in one other process (handles, not data: a few KB).

    Raises:
        ValueError: a tensor is neither on CPU nor CUDA.
    """
    use_sharing_strategy()
    for name, t in tensors.items():
        if t.device.type == "cpu":
            if not t.untyped_storage().is_shared():
                t.share_memory_()
        elif t.device.type != "cuda":
            raise ValueError(f"{name}: cannot share a tensor on {t.device} across processes")
    buf = io.BytesIO()
    ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump({"tensors": tensors, "version": version.tensor})
    payload = buf.getvalue()
    log.info("exported %d tensor handles (%d bytes of payload)", len(tensors), len(payload))
    return payload


class SharedWeights:
    """The receiving side: tensors mapped from the sender's memory and the version counter."""

    def __init__(self, payload: bytes):
        use_sharing_strategy()
        data = pickle.loads(payload)
        self.tensors: dict[str, torch.Tensor] = data["tensors"]
        self.version = WeightsVersion(data["version"])

    def check(self, expected: int) -> None:
        self.version.check(expected)

    def close(self) -> None:
        """Drop every mapping held here; the memory goes once the sender drops it too."""
        self.tensors.clear()
        self.version = None  # type: ignore[assignment]


def check_sync(shared: Optional[SharedWeights], current: int, version: int) -> SharedWeights:
    """The checks of a rollout engine's ``sync_shared_weights(version)`` holding ``current``.

    Raises:
        RuntimeError: nothing is mapped yet. StaleWeightsError: ``version`` is not newer than
            ``current``, or the shared counter is not ``version``.
    """
    if shared is None:
        raise RuntimeError("sync_shared_weights before map_shared_weights")
    check_newer(version, current, "sync_shared_weights")
    shared.check(version)
    return shared


def import_handles(payload: bytes) -> SharedWeights:
    """Map the tensors of an ``export_handles`` payload (load it exactly once)."""
    return SharedWeights(payload)
