#!/usr/bin/env bash
# The one prepared command of the GPU check (fresh single-GPU machine, Python 3.12, torch and
# transformers preinstalled, no network). Run from the repository root:
#   bash scripts/gpu_check_megatron.sh
# It installs megatron-core from the wheel carried in build/gpu-wheels (2.6 MB; fetch it on a
# machine with network: pip download 'megatron-core==0.16.1' --no-deps --only-binary=:all:
#   --python-version 3.12 --platform manylinux_2_28_x86_64 -d build/gpu-wheels)
# and runs scripts/gpu_check_megatron.py (under 8 minutes is the target).
set -euo pipefail
python -m pip install -q --no-index --no-deps --find-links build/gpu-wheels 'megatron-core==0.16.1'
PYTHONPATH=src timeout 480 python scripts/gpu_check_megatron.py --out "${TMPDIR:-/tmp}/gpu-check-megatron"
