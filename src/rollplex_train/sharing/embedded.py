"""Weight sharing, rollout side: the rollout model's parameters *are* the trainer's tensors.

The trainer side is ``sharing/share.py`` (``WeightShare``: the rollout tensors of this device as
views of the actor's storage, rebuilt buffers where the layouts differ, a version counter). At
t = r = 1 with the ``hf`` layout (the embedded run) every tensor is a view, under the HF parameter
names of ``named_parameters()`` (tied weights once), the names both processes' models use.

``map_parameters`` points every parameter of the rollout model at the received tensor of the same
name (``param.data = shared``: no copy; its own loaded copy is freed). The engine then checks the
counter before (and after) decoding and refuses stale or in-flux weights. ``LocalWeights`` is the
in-process hand-over; ``weights_digest``/``tensors_digest`` compare weights across processes.
"""

from __future__ import annotations

import hashlib

import torch

from rollplex_train.versioning import WeightsVersion


class LocalWeights:
    """The in-process counterpart of ``sharing.ipc.SharedWeights``: the trainer's rollout tensors and
    its version counter by reference (a CUDA IPC handle cannot be opened in the process that made
    it, and a CPU one would only add shared-memory segments). Same interface: ``tensors``,
    ``version``, ``check``, ``close``.

    Args:
        tensors: {rollout name: tensor} (views of the actor's parameters and rebuilt buffers; no copy).
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
