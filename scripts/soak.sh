#!/usr/bin/env bash
# Soak test: 200 steps of the tiny experiment on 2 devices (1 core each); RSS of every process and
# leftovers in /dev/shm and /tmp checked (scripts/soak.py). Needs `make install assets` first.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p outputs
exec .venv/bin/python scripts/soak.py "$@"
