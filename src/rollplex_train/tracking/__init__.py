"""Metric loggers, checkpoints and HF export.

Heavy backends (torch, tensorboard, wandb, tqdm) are imported lazily, when first used.
"""

from rollplex_train.tracking.checkpoint import (
    POINTER_FILE,
    CheckpointManager,
    load_json,
    load_torch,
    save_json,
    save_torch,
)
from rollplex_train.tracking.export import export_hf
from rollplex_train.tracking.loggers import LOGGER_NAMES, Tracker, read_metrics_jsonl
from rollplex_train.tracking.progress import ProgressBar
from rollplex_train.tracking.timing import compute_throughput, timer, timing_metrics

__all__ = [
    "LOGGER_NAMES",
    "POINTER_FILE",
    "CheckpointManager",
    "ProgressBar",
    "Tracker",
    "compute_throughput",
    "export_hf",
    "load_json",
    "load_torch",
    "read_metrics_jsonl",
    "save_json",
    "save_torch",
    "timer",
    "timing_metrics",
]
