"""How the colocated rollout and training workers share one device (``cluster.device_share``).

- ``cores``: on CPU the device's cores, split by torch thread counts (the planner's unit is a
  thread); on GPU the two sides are time-sliced by the driver (no partition).
- ``streams`` (GPU, one process: ``cluster.executor=inprocess``): decode and prefix work are issued
  on two CUDA streams of their own, so prefix kernels fill the SMs that memory-bound decode leaves idle.
- ``green`` (GPU, one process, torch >= 2.13): as ``streams``, each stream belonging to a CUDA green
  context holding a number of SMs (``torch.cuda.green_contexts.GreenContext.create(num_sms=...,
  device_id=...)`` and its ``Stream()``; torch 2.13 ``torch/cuda/green_contexts.py``; ``Stream()``
  came with pytorch PR #171116, so an older torch's green contexts are refused). The two halves
  MAY OVERLAP: each ``GreenContext.create`` splits its SMs off the whole device
  (``cuDevSmResourceSplitByCount`` on the device's resource, ``aten/src/ATen/cuda/CUDAGreenContext.cpp``),
  so the decode and the prefix context can be given the same SMs; a disjoint split needs one
  ``cuDevSmResourceSplit`` call for both (pytorch PR #198178, open in 2026-12). ``auto`` therefore
  never picks ``green``.
- ``mps`` (GPU, one process per worker: ``cluster.executor=ray``): MPS static SM partitions (driver
  CUDA >= 13.1, ``nvidia-cuda-mps-control`` with ``sm_partition add`` and ``CUDA_MPS_SM_PARTITION``).

- ``auto``: :func:`resolve_share` picks ``cores`` on CPU and across processes, ``streams`` for a GPU in
  one process: never a share the installed torch lacks. Every other value is forced as written.

The planner's share unit is a "device unit": a torch thread on CPU, an SM on GPU
(:func:`device_units`). A share that the machine cannot give is refused in one line before any
worker starts: :func:`check_config` (config only, in ``ClusterConfig``) and :func:`check_machine`
(what torch, the driver and ``PATH`` offer, before the workers are spawned).

The GPU paths (streams, green contexts, MPS) are written against the CUDA/torch APIs named above and
have not run on a GPU in this repository's tests (no GPU on the CI machine); the refusals have.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass
from typing import Optional

import torch

log = logging.getLogger(__name__)

SHARES = ("cores", "streams", "green", "mps")
CHOICES = SHARES + ("auto",)
MPS_MIN_DRIVER_CUDA = (13, 1)
GREEN_MIN_TORCH = (2, 13)


def check_config(share: str, device: str, executor: str) -> None:
    """Refuse a share the config itself rules out.

    Raises:
        ValueError: an unknown share; ``streams``/``green``/``mps`` on ``cluster.device=cpu``;
            ``streams``/``green`` across processes (``cluster.executor=ray``); ``mps`` in one process.
    """
    if share not in CHOICES:
        raise ValueError(f"cluster.device_share={share!r}: expected one of {list(CHOICES)}")
    if share in ("cores", "auto"):
        return
    if device != "cuda":
        raise ValueError(f"cluster.device_share={share}: a CPU device is shared by its cores; it needs "
                         f"cluster.device=cuda (got {device!r})")
    if share in ("streams", "green") and executor != "inprocess":
        raise ValueError(f"cluster.device_share={share} splits one process's work: it needs cluster.executor="
                         f"inprocess (got {executor!r}; across processes use mps)")
    if share == "mps" and executor != "ray":
        raise ValueError(f"cluster.device_share=mps partitions SMs between processes: it needs cluster.executor=ray "
                         f"(got {executor!r}; in one process use streams or green)")


@dataclass(frozen=True)
class MachineFacts:
    """What this machine offers for the GPU shares.

    Attributes:
        gpus: GPUs torch sees. torch_version: (major, minor).
        green_contexts: torch was built with green-context support (``torch.cuda.green_contexts.SUPPORTED``).
        driver_cuda: the driver's CUDA version (major, minor), None when unknown.
        mps_control: path of ``nvidia-cuda-mps-control``, None when not on ``PATH``.
        green_streams: torch's green contexts have ``Stream()`` (the C++ class has it: the Python
            shim of torch 2.13 defines the method whatever the build holds).
    """

    gpus: int
    torch_version: tuple[int, int]
    green_contexts: bool
    driver_cuda: Optional[tuple[int, int]]
    mps_control: Optional[str]
    green_streams: bool = False


def _driver_cuda() -> Optional[tuple[int, int]]:
    """The driver's CUDA version from NVML (``nvmlSystemGetCudaDriverVersion``: 1000 * major + 10 * minor),
    or None without pynvml/NVML."""
    try:
        import pynvml

        pynvml.nvmlInit()
        v = int(pynvml.nvmlSystemGetCudaDriverVersion())
        return v // 1000, (v % 1000) // 10
    except Exception:  # noqa: BLE001 - no NVML is "unknown", refused by check_machine for mps
        return None


def probe() -> MachineFacts:
    """The facts of this process's machine (no side effects)."""
    major, minor = (int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    try:
        from torch.cuda import green_contexts

        green = bool(getattr(green_contexts, "SUPPORTED", False))
        streams = green and hasattr(getattr(green_contexts, "_GreenContext", object), "Stream")
    except ImportError:
        green = streams = False
    gpus = torch.cuda.device_count()
    return MachineFacts(gpus=gpus, torch_version=(major, minor), green_contexts=green,
                        driver_cuda=_driver_cuda() if gpus else None,
                        mps_control=shutil.which("nvidia-cuda-mps-control"), green_streams=streams)


def check_machine(share: str, facts: Optional[MachineFacts] = None) -> None:
    """Refuse, in one line, a share this machine cannot give (call before any worker starts).

    Raises:
        RuntimeError: no GPU for streams/green/mps; green without torch green-context support
            (torch >= 2.13 built with it) or without ``GreenContext.Stream()``; mps without driver
            CUDA >= 13.1 or ``nvidia-cuda-mps-control``, and mps where it has them (the per-actor
            ``CUDA_MPS_SM_PARTITION`` is not wired yet). ``auto`` is resolved first (:func:`resolve_share`).
    """
    if share == "auto":
        raise ValueError("cluster.device_share=auto: resolve it first (device_share.resolve_share)")
    if share == "cores":
        return
    facts = facts or probe()
    if facts.gpus == 0:
        raise RuntimeError(f"cluster.device_share={share}: torch sees no GPU on this machine")
    if share == "green" and not facts.green_contexts:
        raise RuntimeError(f"cluster.device_share=green: torch {'.'.join(map(str, facts.torch_version))} has no "
                           f"CUDA green contexts (needs torch >= {'.'.join(map(str, GREEN_MIN_TORCH))} built "
                           "with them); use streams")
    if share == "green" and not facts.green_streams:
        raise RuntimeError(f"cluster.device_share=green: torch {'.'.join(map(str, facts.torch_version))}'s green "
                           "contexts have no Stream() (pytorch PR #171116); use streams")
    if share == "mps":
        if facts.driver_cuda is None or facts.driver_cuda < MPS_MIN_DRIVER_CUDA:
            raise RuntimeError(f"cluster.device_share=mps: static SM partitions need driver CUDA >= 13.1 "
                               f"(found {facts.driver_cuda or 'unknown'})")
        if facts.mps_control is None:
            raise RuntimeError("cluster.device_share=mps: nvidia-cuda-mps-control is not on PATH")
        raise RuntimeError("cluster.device_share=mps: this machine has MPS static partitions, but the workers do "
                           "not set CUDA_MPS_SM_PARTITION yet; use cores (time-sliced) or the in-process streams")


def resolve_share(share: str, device: str, executor: str, facts: Optional[MachineFacts] = None) -> str:
    """The share a run uses: ``share`` itself unless it is ``auto``, which is ``cores`` on a CPU
    device, across processes (``mps`` is not wired) or where torch sees no GPU, and ``streams`` for
    a GPU in one process (never ``green``: its halves may overlap, module docstring). Probes this
    machine only for ``auto`` on ``cuda`` in one process (that is the workers' machine).

    Raises:
        ValueError: an unknown share (``check_config``).
    """
    check_config(share, device, executor)
    if share != "auto":
        return share
    if device != "cuda" or executor != "inprocess":
        return "cores"
    return "streams" if (facts or probe()).gpus > 0 else "cores"


def device_units(device: str, threads_per_device: int, gpu_index: int = 0) -> int:
    """The planner's share unit count of one device: torch threads on CPU, SMs on GPU
    (``torch.cuda.get_device_properties(i).multi_processor_count``; 132 on an H200)."""
    if device == "cpu":
        return threads_per_device
    return int(torch.cuda.get_device_properties(gpu_index).multi_processor_count)


def half_sms(device: torch.device, share: str, side: str) -> Optional[int]:
    """SMs of ``side`` (``decode`` gets the odd one) when ``green`` splits a GPU in halves; else None."""
    if share != "green" or device.type != "cuda":
        return None
    total = device_units("cuda", 1, device.index or 0)
    return (total + 1) // 2 if side == "decode" else total // 2


class SideStream:
    """The CUDA stream one side (``decode`` or ``prefix``) issues its work on, in one process.

    ``enter()`` makes it the calling thread's current stream (torch's current stream is per thread
    and device), so a worker thread calls it once and every kernel it launches afterwards goes there.
    With ``green``, the stream belongs to a green context of ``num_sms`` SMs. Not run on a GPU here.

    Args:
        share: ``streams`` or ``green``. device: the CUDA device. num_sms: SMs of the side (green only).
    """

    def __init__(self, share: str, device: torch.device, num_sms: Optional[int] = None):
        self.share, self.device, self.num_sms = share, device, num_sms
        if share == "green":
            from torch.cuda.green_contexts import GreenContext

            self.context = GreenContext.create(num_sms=num_sms, device_id=device.index or 0)
            self.stream = self.context.Stream()
            log.warning("green context of %d SMs: split off the whole device, it may share SMs with the other "
                        "side's (device_share.py)", num_sms)
        elif share == "streams":
            self.context = None
            self.stream = torch.cuda.Stream(device=device)
        else:
            raise ValueError(f"cluster.device_share={share!r}: no per-side stream (streams or green only)")

    def enter(self) -> None:
        """Issue this thread's later work on the side's stream."""
        torch.cuda.set_stream(self.stream)
        log.info("%s work on its own CUDA stream%s", self.share,
                 f" in a green context of {self.num_sms} SMs" if self.num_sms else "")

    def synchronize(self) -> None:
        """Wait for the side's queued work (before another side reads what it wrote)."""
        self.stream.synchronize()


def enter_side(share: str, device: torch.device, num_sms: Optional[int] = None) -> Optional[SideStream]:
    """On a GPU in-process run with ``streams``/``green``: a :class:`SideStream` entered on the
    calling thread; otherwise None (CPU, ``cores``, ``mps``: nothing to do in the process)."""
    if device.type != "cuda" or share not in ("streams", "green"):
        return None
    side = SideStream(share, device, num_sms)
    side.enter()
    return side
