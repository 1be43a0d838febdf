"""Model architecture without weights: HF config loading and a meta-device model for planning.

``rollplex-plan`` (memory estimates, weight-sharing plans) needs every parameter's name and shape of
a 7B/32B Qwen2.5-VL without its weights. ``meta_model`` builds the transformers model on the meta
device, so names and shapes are exactly those of the real checkpoint and no memory is allocated.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from rollplex_train.config import ModelConfig


def load_hf_config(model: "ModelConfig") -> "PretrainedConfig":
    """The architecture of ``model``: ``model.hf_config`` if set, else ``model.path/config.json``.

    A relative path is taken from the working directory, else from the repository root (so the
    shipped ``conf/hf/*.json`` resolve from anywhere in an editable install).

    Returns:
        a transformers ``PretrainedConfig`` of the checkpoint's ``model_type``.

    Raises:
        FileNotFoundError: neither file exists (the message names the paths tried).
        ValueError: the JSON has no ``model_type`` or an unknown one.
    """
    from transformers import AutoConfig

    path = Path(model.hf_config) if model.hf_config else Path(model.path) / "config.json"
    repo_root = Path(__file__).resolve().parents[3]
    if not path.is_file() and not path.is_absolute() and (repo_root / path).is_file():
        path = repo_root / path  # e.g. conf/hf/*.json from outside the repository
    if not path.is_file():
        raise FileNotFoundError(
            f"model.hf_config / model.path: no architecture file at {path}; set model.hf_config to a config.json"
        )
    raw = json.loads(path.read_text())
    model_type: Optional[str] = raw.pop("model_type", None)
    if not model_type:
        raise ValueError(f"{path}: no 'model_type' field (expected e.g. 'qwen2_5_vl')")
    raw = {k: v for k, v in raw.items() if not k.startswith("_")}  # "_source" notes
    try:
        return AutoConfig.for_model(model_type, **raw)
    except ValueError as err:
        raise ValueError(f"{path}: model_type={model_type!r} is not a transformers architecture: {err}") from err


def meta_model(hf_config: "PretrainedConfig") -> torch.nn.Module:
    """Build the model class of ``hf_config`` on the meta device (shapes only, no storage).

    Raises:
        ValueError: the config names no image-text-to-text or causal-LM architecture.
    """
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    with torch.device("meta"):
        for auto in (AutoModelForImageTextToText, AutoModelForCausalLM):
            try:
                return auto.from_config(hf_config)
            except ValueError:
                continue
    raise ValueError(f"no model class for model_type={hf_config.model_type!r}")


def parameter_shapes(hf_config: "PretrainedConfig") -> dict[str, tuple[int, ...]]:
    """``{parameter name: shape}`` of the HF model, in ``named_parameters`` order (tied weights once)."""
    return {name: tuple(p.shape) for name, p in meta_model(hf_config).named_parameters()}
