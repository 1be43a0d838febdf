"""Offload and prefetch of a module's parameters, gradients and optimizer states.

``offload`` copies each tensor into a host buffer (pinned when the device is a GPU, allocated once
and reused) and frees the device storage: a parameter's ``.data`` becomes an empty tensor, its
``.grad`` None, an optimizer state tensor an empty tensor. ``prefetch`` allocates device storage
again and copies the bytes back; on a GPU the copies run on a side stream and
:meth:`Prefetch.wait` makes the compute stream wait for them (the copy overlaps whatever the compute
stream does in between). On CPU the same code runs with the "device" and the host both in host
memory, so the byte accounting and the round trip are testable without a GPU.

Parameters keep their identity (``p.data`` is swapped, the ``nn.Parameter`` object stays), so the
optimizer's param groups and state keys stay valid across a round trip, and training continues
bit for bit (tested in ``tests/test_memory_offload.py``).
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch

log = logging.getLogger(__name__)
PARTS = ("params", "grads", "optimizer")


@dataclass
class _Slot:
    """One offloadable tensor: how to read and write it, and its host buffer."""

    get: object  # () -> Tensor | None
    set: object  # (Tensor | None) -> None
    host: Optional[torch.Tensor] = None
    meta: Optional[tuple] = None  # (shape, dtype, device) while offloaded


@dataclass
class Prefetch:
    """Pending host -> device copies; :meth:`wait` orders them before later work on the compute stream."""

    nbytes: int
    event: Optional["torch.cuda.Event"] = None
    tensors: list = field(default_factory=list)

    def wait(self) -> None:
        if self.event is not None:
            stream = torch.cuda.current_stream()
            stream.wait_event(self.event)
            for t in self.tensors:  # the side stream allocated them: keep the caching allocator honest
                t.record_stream(stream)
            self.tensors.clear()


class ModuleOffloader:
    """Moves ``module``'s parameters and grads and ``optimizer``'s state tensors to host and back.

    Args:
        module: its parameters are offloaded (all of them, trainable or not).
        optimizer: its per-parameter state tensors (e.g. AdamW ``exp_avg``, ``exp_avg_sq``) too.
        pin_memory: page-locked host buffers (default: True when the parameters live on a GPU).
    """

    def __init__(self, module: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, *,
                 pin_memory: Optional[bool] = None):
        self.module, self.optimizer = module, optimizer
        first = next(module.parameters(), None)
        self.device = first.device if first is not None else torch.device("cpu")
        self.pin_memory = self.device.type == "cuda" if pin_memory is None else pin_memory
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._slots: dict[str, dict[int, _Slot]] = {part: {} for part in PARTS}
        self.offloaded: set[str] = set()

    # ---- what can move ----------------------------------------------------------------------------
    def _tensors(self, part: str) -> Iterator[tuple[int, _Slot]]:
        """(key, slot) of every tensor of ``part``; slots are created once and keep their host buffer."""
        slots = self._slots[part]
        if part in ("params", "grads"):
            for p in self.module.parameters():
                key = id(p)
                if key not in slots:
                    if part == "params":
                        slots[key] = _Slot(get=lambda p=p: p.data, set=lambda t, p=p: setattr(p, "data", t))
                    else:
                        slots[key] = _Slot(get=lambda p=p: p.grad, set=lambda t, p=p: setattr(p, "grad", t))
                yield key, slots[key]
        elif self.optimizer is not None:
            for state in self.optimizer.state.values():
                for name, value in state.items():
                    if not torch.is_tensor(value) or value.dim() == 0:
                        continue  # AdamW's step counter: a 0-d (host) scalar, left in place
                    key = (id(state), name)
                    if key not in slots:
                        slots[key] = _Slot(get=lambda s=state, n=name: s[n],
                                           set=lambda t, s=state, n=name: s.__setitem__(n, t))
                    yield key, slots[key]

    def device_bytes(self, part: str) -> int:
        """Bytes of ``part`` currently held in device storage."""
        total = 0
        for _, slot in self._tensors(part):
            t = slot.get()
            if t is not None and t.numel():
                total += t.numel() * t.element_size()
        return total

    # ---- moves ------------------------------------------------------------------------------------
    def offload(self, parts: tuple[str, ...] = PARTS) -> int:
        """Copy ``parts`` to host buffers and free their device storage; returns the bytes moved.

        Raises:
            ValueError: an unknown part name.
        """
        moved = 0
        if self.stream is not None:  # the copies must see everything the compute stream wrote
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        for part in self._check(parts):
            for _, slot in self._tensors(part):
                t = slot.get()
                if t is None or t.numel() == 0:  # no grad yet, or already offloaded
                    slot.meta = None if t is None else slot.meta
                    continue
                if slot.host is None or slot.host.shape != t.shape or slot.host.dtype != t.dtype:
                    slot.host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self.pin_memory)
                with torch.cuda.stream(self.stream) if self.stream is not None else nullcontext():
                    slot.host.copy_(t.detach(), non_blocking=self.stream is not None)
                if self.stream is not None:
                    t.record_stream(self.stream)  # freed only after the side stream is done with it
                slot.meta = (t.shape, t.dtype, t.device)
                slot.set(None if part == "grads" else torch.empty(0, dtype=t.dtype, device=t.device))
                moved += t.numel() * t.element_size()
            self.offloaded.add(part)
        if self.stream is not None:
            self.stream.synchronize()  # host buffers are complete before anyone may reuse them
        log.debug("offloaded %s: %d bytes", parts, moved)
        return moved

    def prefetch(self, parts: tuple[str, ...] = PARTS) -> Prefetch:
        """Allocate device storage for offloaded ``parts`` and copy the host bytes back.

        On a GPU the copies are queued on a side stream: call :meth:`Prefetch.wait` before the
        tensors are used. On CPU they are done when this returns.
        """
        moved, tensors = 0, []
        if self.stream is not None:  # device memory freed by compute-stream work is reusable
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        for part in self._check(parts):
            if part not in self.offloaded:
                continue
            for _, slot in self._tensors(part):
                if slot.meta is None:
                    continue
                shape, dtype, device = slot.meta
                with torch.cuda.stream(self.stream) if self.stream is not None else nullcontext():
                    t = torch.empty(shape, dtype=dtype, device=device)
                    t.copy_(slot.host, non_blocking=self.stream is not None)
                if self.stream is not None:
                    tensors.append(t)
                slot.set(t)
                slot.meta = None
                moved += t.numel() * t.element_size()
            self.offloaded.discard(part)
        event = None
        if self.stream is not None:
            event = torch.cuda.Event()
            event.record(self.stream)
        return Prefetch(moved, event, tensors)

    @staticmethod
    def _check(parts: tuple[str, ...]) -> tuple[str, ...]:
        unknown = [p for p in parts if p not in PARTS]
        if unknown:
            raise ValueError(f"unknown part(s) {unknown}: expected any of {list(PARTS)}")
        return parts



class StorageOffload:
    """Moves the storages behind ``tensors`` to host buffers and back, in place: a storage is copied
    out and resized to 0 bytes, so every tensor and view on it stays the same object (a module whose
    weights are views of one fused tensor keeps them), and on the way back it is resized and
    refilled (FSDP's ``_free_storage``/``_alloc_storage``; megatron-core's grad-buffer offload does
    the same with ``storage().resize_(0)``). Use it where swapping ``p.data`` would cut views apart.

    A storage that cannot be resized (a memory-mapped safetensors file, ``torch.frombuffer``) is first
    copied once into a fresh one and every tensor of ``tensors`` on it is pointed there (``set_``):
    ``tensors`` must then hold every tensor on such a storage.

    Args:
        tensors: the tensors whose storages move (shared storages once).
        pin_memory: page-locked host buffers (default: on a GPU).
    """

    def __init__(self, tensors, *, pin_memory: Optional[bool] = None):
        tensors = list(tensors)
        self._storages = {}
        for t in tensors:
            self._storages.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage())
        fixed = {ptr: self._resizable(s) for ptr, s in self._storages.items() if not s.resizable()}
        with torch.no_grad():
            for t in tensors:
                new = fixed.get(t.untyped_storage().data_ptr())
                if new is not None:
                    t.set_(new, t.storage_offset(), t.size(), t.stride())
        self._storages.update(fixed)
        self._storages = list(self._storages.values())
        self._host: list[Optional[torch.Tensor]] = [None] * len(self._storages)
        self._sizes = [s.nbytes() for s in self._storages]
        device = self._storages[0].device if self._storages else torch.device("cpu")
        self.pin_memory = device.type == "cuda" if pin_memory is None else pin_memory
        self.offloaded = False

    @staticmethod
    def _resizable(storage) -> torch.UntypedStorage:
        """A resizable copy of ``storage`` on its device."""
        out = torch.UntypedStorage(storage.nbytes(), device=storage.device)
        out.copy_(storage)
        return out

    @staticmethod
    def _bytes_of(storage) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)

    def offload(self) -> int:
        """Copy every storage to its host buffer and free it; returns the bytes moved (0 if away)."""
        if self.offloaded:
            return 0
        for i, storage in enumerate(self._storages):
            if self._host[i] is None:
                self._host[i] = torch.empty(self._sizes[i], dtype=torch.uint8, pin_memory=self.pin_memory)
            self._host[i].copy_(self._bytes_of(storage))
            storage.resize_(0)
        self.offloaded = True
        return sum(self._sizes)

    def onload(self) -> int:
        """Reallocate every storage and copy its bytes back; returns the bytes moved (0 if here)."""
        if not self.offloaded:
            return 0
        for i, storage in enumerate(self._storages):
            storage.resize_(self._sizes[i])
            self._bytes_of(storage).copy_(self._host[i])
        self.offloaded = False
        return sum(self._sizes)
