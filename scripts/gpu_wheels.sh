#!/usr/bin/env bash
# Wheels that scripts/bench_gpu.py needs beyond the GPU machine's preinstalled torch + transformers
# (Python 3.12, x86_64): pillow (video frames are resized with PIL) and nvidia-ml-py (NVML, for
# torch.cuda.utilization). About 7 MB in all (measured 2026-12: pillow 13.0.0 7.1 MB, nvidia-ml-py 13.615 58 KB). Usage: scripts/gpu_wheels.sh [dir] (default shared/wheels).
# Install there with: pip install --no-index --no-deps shared/wheels/*.whl
set -euo pipefail
out="${1:-shared/wheels}"
mkdir -p "$out"
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
  --platform manylinux2014_x86_64 -d "$out" pillow nvidia-ml-py
du -sh "$out"
