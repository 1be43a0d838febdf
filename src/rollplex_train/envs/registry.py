"""``env.name`` -> a builder of environment instances (one per trajectory).

Names: a registered environment (``frozenlake``), a registered family with an argument
(``minigrid:<id>``), or a user's class ``path/to/file.py:Class``. A user class is either a
:class:`~rollplex_train.envs.base.VisionEnv` (built with ``Class(**env.kwargs)``) or a VAGEN
``GymImageEnv`` (async ``step``; built with ``Class(env.kwargs)``, VAGEN's ``env_config`` dict, and
wrapped in :class:`~rollplex_train.envs.base.VagenEnv`).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Optional

from rollplex_train.envs.base import VagenEnv, VisionEnv
from rollplex_train.registry import Registry, load_from_file

ENVS: Registry[Callable[..., VisionEnv]] = Registry("env.name")
register_env = ENVS.register
"""Decorator registering an environment factory ``(arg: str | None, **options) -> VisionEnv`` under a
name; ``env.name=<name>:<arg>`` passes ``arg``."""

ADAPTER_OPTIONS = ("max_actions_per_turn", "format_penalty", "answer_format")
"""``env.*`` keys that only the built-in (gymnasium adapter) environments take."""


@register_env("frozenlake")
def _frozenlake(arg: Optional[str], **options: Any) -> VisionEnv:
    from rollplex_train.envs.builtin import frozenlake

    if arg:
        raise ValueError(f"env.name='frozenlake:{arg}': frozenlake takes no argument (map options go in env.kwargs)")
    return frozenlake(**options)


@register_env("minigrid")
def _minigrid(arg: Optional[str], **options: Any) -> VisionEnv:
    from rollplex_train.envs.builtin import minigrid

    if not arg:
        raise ValueError("env.name='minigrid': expected 'minigrid:<id>', e.g. 'minigrid:MiniGrid-Empty-5x5-v0'")
    return minigrid(arg, **options)


def _user_class(spec: str) -> type:
    """The class named by ``path/to/file.py:Class`` (the file imported under a private module name).

    Raises:
        FileNotFoundError: no such file. ValueError: the file fails to import, or has no such class.
    """
    path, cls_name = spec.rsplit(":", 1)
    cls = load_from_file(spec, "env.name", "environment")
    if not inspect.isclass(cls) or not all(callable(getattr(cls, m, None)) for m in ("reset", "step", "system_prompt")):
        raise ValueError(f"env.name={spec!r}: {path!r} has no class {cls_name!r} with reset, step and "
                         "system_prompt methods")
    return cls


def env_builder(name: str, kwargs: Optional[dict[str, Any]] = None, options: Optional[dict[str, Any]] = None
                ) -> Callable[[], VisionEnv]:
    """A zero-argument builder of fresh environments for ``env.name``; names are checked and files
    imported here, once.

    Args:
        name: ``env.name`` (module docstring).
        kwargs: ``env.kwargs``, the environment's own options.
        options: adapter options for built-ins (``ADAPTER_OPTIONS`` set in the config, and the
            pixel budget ``min_pixels``/``max_pixels``); a user class takes none of
            ``ADAPTER_OPTIONS`` (it parses its answers itself).

    Raises:
        ValueError: unknown name (lists the known ones), a user class given adapter options, a
            bad file or class. FileNotFoundError: a missing file. MissingExtraError: the
            ``envs`` extra is missing for a built-in.
    """
    kwargs, options = dict(kwargs or {}), dict(options or {})
    head, _, arg = name.partition(":")
    if head in ENVS.names():
        factory = ENVS.get(head)
        factory(arg or None, **kwargs, **options).close()  # fails here, once, on a missing extra or bad id
        return lambda: factory(arg or None, **kwargs, **options)
    if not arg:
        raise ValueError(f"env.name={name!r}: expected one of {ENVS.names()}, '<name>:<arg>' or 'path/to/file.py:Class'")
    cls = _user_class(name)
    refused = sorted(k for k in ADAPTER_OPTIONS if k in options)
    if refused:
        raise ValueError(f"env.name={name!r}: {', '.join('env.' + k for k in refused)} apply to the built-in "
                         "environments only; pass your class's own options in env.kwargs")
    if inspect.iscoroutinefunction(cls.step):
        return lambda: VagenEnv(cls(dict(kwargs)))
    return lambda: cls(**kwargs)
