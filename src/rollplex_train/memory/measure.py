"""Measured memory: live bytes of known tensors and the peak allocation of a piece of work.

On a GPU the peak comes from the CUDA caching allocator's statistics (``max_memory_allocated``).
On CPU torch keeps no such statistics, so :func:`peak_allocation` runs the work under
``torch.profiler`` with ``profile_memory=True``: the CPU allocator reports every allocation and
free (signed byte counts, time-stamped) to the profiler, and the running sum of those events in time
order gives the bytes allocated beyond the start at every moment; its maximum is the peak. Only
memory allocated through torch's allocators is counted (tensors, not Python objects).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch


def live_tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (shared storages and tied weights once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None or not torch.is_tensor(t) or t.device.type == "meta":
            continue
        storage = t.untyped_storage()
        if storage.nbytes():
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


@dataclass
class Peak:
    """Result of :func:`peak_allocation`: ``peak_bytes`` above the allocation at the start, and
    ``end_bytes`` still allocated at the end (relative to the start; negative if more was freed)."""

    peak_bytes: int = 0
    end_bytes: int = 0


@contextmanager
def peak_allocation(device: torch.device | str = "cpu") -> Iterator[Peak]:
    """Measure the peak allocation of the ``with`` block on ``device`` (see the module docstring).

    Example::

        with peak_allocation() as peak:
            engine.update_actor(batch)
        peak.peak_bytes  # bytes, above what was allocated when the block started
    """
    device = torch.device(device)
    result = Peak()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        yield result
        torch.cuda.synchronize(device)
        result.peak_bytes = torch.cuda.max_memory_allocated(device) - start
        result.end_bytes = torch.cuda.memory_allocated(device) - start
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        yield result
    events = [e for e in prof.profiler.kineto_results.events()
              if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU]
    current = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        current += event.nbytes()
        result.peak_bytes = max(result.peak_bytes, current)
    result.end_bytes = current
