"""Input paths of a config resolved the same way wherever a run is started.

A relative path (``model.path``, ``data.train_files``, ``data.val_files``, ``data.format_prompt``,
``model.hf_config``, the file of ``reward.function=path/to/file.py:fn``) is looked up first in the
current directory, then in the project root (the directory holding ``conf/``), where the defaults
(``artifacts/...`` built by ``make assets``) live. The first existing candidate becomes an absolute
path in the config, so the workers (other processes, other working directories) read the same file.
A path found nowhere is an error naming every path tried.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from rollplex_train.config import Config

__all__ = ["resolve_config_paths", "resolve_input_path"]


def resolve_input_path(value: str, key: str, root: Path, strict: bool = True) -> str:
    """The absolute path of ``value`` (see the module docstring for the search order).

    Args:
        value: the configured path (``~`` expanded). key: the config key, named in errors.
        root: the project root. strict: raise when nothing exists (False: return ``value`` as given).

    Raises:
        FileNotFoundError: ``strict`` and no candidate exists; the message names key, value and
            every candidate tried.
    """
    path = Path(value).expanduser()
    candidates = [path] if path.is_absolute() else [Path.cwd() / path, Path(root) / path]
    for candidate in candidates:
        if candidate.exists():
            return str(candidate.resolve())
    if not strict:
        return value
    tried = " and ".join(str(c) for c in dict.fromkeys(candidates))
    hint = " (run `make assets` in the project root)" if "artifacts" in path.parts else ""
    raise FileNotFoundError(f"{key}={value!r}: not found; tried {tried}{hint}")


def _files(value: str, key: str, root: Path, strict: bool) -> str:
    parts = [p.strip() for p in value.split(",") if p.strip()]
    return ",".join(resolve_input_path(p, key, root, strict) for p in parts)


def resolve_config_paths(cfg: Config, root: Path, strict: bool = True) -> Config:
    """A copy of ``cfg`` with its input paths made absolute (registered reward names untouched).

    Raises:
        FileNotFoundError: ``strict`` and a configured path exists nowhere (see
            :func:`resolve_input_path`).
    """
    model, data, reward = cfg.model, cfg.data, cfg.reward
    model = dataclasses.replace(
        model,
        path=resolve_input_path(model.path, "model.path", root, strict and model.hf_config is None),
        hf_config=None if model.hf_config is None else resolve_input_path(model.hf_config, "model.hf_config", root, strict),
    )
    data = dataclasses.replace(
        data,
        train_files=_files(data.train_files, "data.train_files", root, strict),
        val_files=_files(data.val_files, "data.val_files", root, strict) if data.val_files else data.val_files,
        format_prompt=None if data.format_prompt is None else resolve_input_path(
            data.format_prompt, "data.format_prompt", root, strict),
    )
    if ":" in reward.function:
        file, fn = reward.function.rsplit(":", 1)
        reward = dataclasses.replace(reward, function=f"{resolve_input_path(file, 'reward.function', root, strict)}:{fn}")
    return dataclasses.replace(cfg, model=model, data=data, reward=reward)
