"""Load a local Hugging Face VLM checkpoint (Qwen2-VL / Qwen2.5-VL) the way a real one loads.

Only local directories are accepted: nothing is downloaded at run time.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("qwen2_5_vl", "qwen2_vl")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class VisionSpec:
    """Patch geometry of the checkpoint's vision tower (from config.json / preprocessor_config.json)."""

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280


def check_checkpoint_dir(path: str | Path) -> Path:
    """Return the checkpoint directory as a Path.

    Raises:
        FileNotFoundError: the directory or its ``config.json`` does not exist.
        ValueError: ``config.json`` names a model type other than Qwen2-VL / Qwen2.5-VL.
    """
    p = Path(path)
    cfg = p / "config.json"
    if not cfg.is_file():
        raise FileNotFoundError(
            f"model.path={str(path)!r}: no config.json there; expected a local HF checkpoint directory "
            "(build the tiny one with `make assets`, the small one with `make assets-small`, or use "
            "scripts/make_tiny_checkpoint.py)"
        )
    model_type = json.loads(cfg.read_text()).get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"{cfg}: model_type={model_type!r}, expected one of {list(SUPPORTED_MODEL_TYPES)}")
    return p


def load_model(path: str | Path, dtype: str = "float32", attn_implementation: str = "sdpa"):
    """Load the policy as ``*ForConditionalGeneration`` with ``from_pretrained(local_dir)``.

    Returns:
        The model in eval mode, on CPU, with parameters in ``dtype``.
    """
    from transformers import AutoModelForImageTextToText

    p = check_checkpoint_dir(path)
    model = AutoModelForImageTextToText.from_pretrained(
        str(p), dtype=_DTYPES[dtype], attn_implementation=attn_implementation, local_files_only=True
    )
    model.eval()
    return model


def load_tokenizer(path: str | Path):
    """The checkpoint's tokenizer (with its chat template)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(check_checkpoint_dir(path)), local_files_only=True)


def load_vision_spec(path: str | Path) -> VisionSpec:
    """Read the patch geometry from ``config.json`` and pixel bounds from ``preprocessor_config.json``."""
    p = check_checkpoint_dir(path)
    cfg = json.loads((p / "config.json").read_text())
    vision = cfg.get("vision_config", {})
    spec = dict(
        patch_size=vision.get("patch_size", 14),
        temporal_patch_size=vision.get("temporal_patch_size", 2),
        merge_size=vision.get("spatial_merge_size", 2),
    )
    pre = p / "preprocessor_config.json"
    if pre.is_file():
        pcfg = json.loads(pre.read_text())
        size = pcfg.get("size") or {}
        spec["min_pixels"] = pcfg.get("min_pixels") or size.get("shortest_edge", VisionSpec.min_pixels)
        spec["max_pixels"] = pcfg.get("max_pixels") or size.get("longest_edge", VisionSpec.max_pixels)
    return VisionSpec(**spec)


def dropout_rates(config: dict, prefix: str = "") -> dict[str, float]:
    """Every ``*dropout*`` rate of a HF ``config.json`` dict (nested text/vision sections included),
    by dotted key. A non-zero rate makes the actor's training-mode forward differ from its
    eval-mode scoring pass (transformers' attention applies ``attention_dropout`` only in training)."""
    rates: dict[str, float] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            rates.update(dropout_rates(value, f"{prefix}{key}."))
        elif isinstance(key, str) and "dropout" in key and isinstance(value, (int, float)) and not isinstance(value, bool):
            rates[f"{prefix}{key}"] = float(value)
    return rates


def has_dropout(config: dict) -> bool:
    """Whether a HF ``config.json`` dict sets any dropout rate above zero."""
    return any(rate > 0 for rate in dropout_rates(config).values())


def checkpoint_has_dropout(path: str | Path) -> bool:
    """Whether the checkpoint's ``config.json`` sets any dropout rate above zero."""
    return has_dropout(json.loads((check_checkpoint_dir(path) / "config.json").read_text()))
