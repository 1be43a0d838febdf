"""What the GPU machine offers, measured in under a minute: the first step of ``scripts/gpu_run.sh``.
It has not run on a GPU yet (docs/benchmarks.md).

    python3 scripts/gpu_probe.py --out probe.json        # on the GPU machine
    python3 scripts/gpu_probe.py --device cpu --out p.json  # the dry run: versions and shares only

Reports (JSON, and one ``gpu-probe:`` line on stdout):

- the device (name, compute capability, SMs, total and free memory in GiB), Python, torch,
  transformers and megatron-core versions, the driver's CUDA version (NVML);
- the device shares torch offers (``device_share.probe``: green contexts, their ``Stream()``) and
  what ``cluster.device_share=auto`` picks there (``device_share.resolve_share``);
- ``stream_overlap``: a decode-like loop (8 matmuls (8, 4096) x (4096, 4096) bf16: memory-bound) and
  a prefill-like loop (a (4096, 4096) x (4096, 4096) bf16 matmul: compute-bound), each timed alone
  on its own CUDA stream, then both at once: (t_decode + t_prefill) / t_both. 1.0: no overlap, the
  two queue behind each other; up to 2.0: the decode loop hides behind the prefill work (what the
  rollplex schedule relies on);
- ``green_overlap`` (where green contexts have streams): the prefill loop in a green context of half
  the SMs alone, then in two such contexts at once: t_both / t_one. About 1.0: the two halves are
  disjoint SMs; about 2.0: they share SMs (``device_share.py`` says torch 2.13 may carve them so).

Timings are CUDA events around ``--iters`` launches after a warm-up; every number is this machine's.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import logging
import platform
import sys
from pathlib import Path
from typing import Callable, Optional

import torch

from rollplex_train.device_share import probe, resolve_share

GiB = 1024**3


def _version(distribution: str) -> Optional[str]:
    """The installed version of ``distribution`` (the first on ``sys.path``: a carried overlay wins)."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _timed(streams: list, loops: list[Callable[[], None]], iters: int) -> float:
    """Seconds for ``iters`` calls of each loop, each loop issued on its stream, all at once."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for stream in streams:
        stream.wait_event(start)
    done = []
    for stream, loop in zip(streams, loops):
        with torch.cuda.stream(stream):
            for _ in range(iters):
                loop()
            event = torch.cuda.Event()
            event.record(stream)
            done.append(event)
    for event in done:
        torch.cuda.current_stream().wait_event(event)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000.0


def stream_overlap(iters: int) -> dict:
    """t_decode, t_prefill, t_both (s) and their overlap ratio (module docstring)."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    weight = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16, generator=g)
    tokens = torch.randn(8, 4096, device=dev, dtype=torch.bfloat16, generator=g)
    block = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16, generator=g)

    def decode() -> None:  # 8 decode-sized matmuls per prefill-sized one
        for _ in range(8):
            tokens @ weight

    def prefill() -> None:
        block @ weight

    a, b = torch.cuda.Stream(), torch.cuda.Stream()
    _timed([a, b], [decode, prefill], 3)  # warm-up
    t_decode = _timed([a], [decode], iters)
    t_prefill = _timed([b], [prefill], iters)
    t_both = _timed([a, b], [decode, prefill], iters)
    return {"t_decode_s": t_decode, "t_prefill_s": t_prefill, "t_both_s": t_both,
            "stream_overlap": (t_decode + t_prefill) / t_both}


def green_overlap(sms: int, iters: int) -> dict:
    """t_one, t_both (s) of the prefill loop in green contexts of ``sms`` SMs, and their ratio."""
    from torch.cuda.green_contexts import GreenContext

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    weight = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16, generator=g)
    block = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16, generator=g)
    first, second = GreenContext.create(num_sms=sms, device_id=0), GreenContext.create(num_sms=sms, device_id=0)
    streams = [first.Stream(), second.Stream()]

    def loop() -> None:
        block @ weight

    _timed(streams, [loop, loop], 3)  # warm-up
    t_one = _timed(streams[:1], [loop], iters)
    t_both = _timed(streams, [loop, loop], iters)
    return {"green_sms_each": sms, "t_one_s": t_one, "t_both_s": t_both, "green_overlap": t_both / t_one}


def run(device: str, iters: int) -> dict:
    """Everything the module docstring lists; GPU measurements only when ``device`` is ``cuda``."""
    facts = probe()
    out: dict = {
        "python": platform.python_version(), "torch": torch.__version__,
        "transformers": _version("transformers"), "megatron_core": _version("megatron-core"),
        "device": device, "gpus": facts.gpus, "driver_cuda": facts.driver_cuda,
        "green_contexts": facts.green_contexts, "green_streams": facts.green_streams,
        "auto_share": resolve_share("auto", device, "inprocess", facts),
    }
    if device != "cuda":
        return out
    props = torch.cuda.get_device_properties(0)
    free, total = torch.cuda.mem_get_info(0)
    out.update(name=props.name, capability=f"{props.major}.{props.minor}", sms=props.multi_processor_count,
               total_gib=total / GiB, free_gib=free / GiB)
    out.update(stream_overlap(iters))
    if facts.green_contexts and facts.green_streams:
        try:
            out.update(green_overlap(props.multi_processor_count // 2, iters))
        except Exception as err:  # noqa: BLE001 - reported: the run goes on without green contexts
            out["green_error"] = f"{type(err).__name__}: {err}".splitlines()[0]
    return out


def summary(report: dict) -> str:
    """The one ``gpu-probe:`` line."""
    keys = ("device", "name", "sms", "free_gib", "torch", "transformers", "green_streams", "auto_share",
            "stream_overlap", "green_overlap")
    fmt = lambda v: f"{v:.2f}" if isinstance(v, float) else str(v).replace(" ", "_")  # noqa: E731
    return "gpu-probe: " + " ".join(f"{k}={fmt(report[k])}" for k in keys if k in report)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--iters", type=int, default=50, help="launches of the prefill loop per timing")
    parser.add_argument("--out", default="probe.json")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu-probe: no CUDA device visible (use --device cpu for the dry run)")
        return 2
    report = run(args.device, args.iters)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(summary(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
