"""Named implementations of one role, chosen by a config value (verl's ``register_adv_estimator``).

One small class serves every registry of the project: advantage estimators, KL estimators,
rewards, rollout engines and training engines. Where a config value may also name the user's own
code (``reward.function=path/to/file.py:fn``, ``env.name=path/to/file.py:Class``),
:func:`load_from_file` imports it.
"""

from __future__ import annotations

import importlib
import importlib.util
import traceback
from pathlib import Path
from typing import Any, Callable, Generic, Optional, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Implementations registered by name.

    Args:
        config_key: the config key whose value picks an entry (named in errors, e.g.
            ``algorithm.adv_estimator``).
        modules: entries shipped with the package but imported on first use (name -> module),
            so that GPU-only backends pull their libraries only when chosen.
    """

    def __init__(self, config_key: str, modules: Optional[dict[str, str]] = None):
        self.config_key = config_key
        self._entries: dict[str, T] = {}
        self._modules = dict(modules or {})

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator registering a function or class under ``name``.

        Raises:
            ValueError: another object is already registered under ``name``.
        """

        def decorator(obj: T) -> T:
            if name in self._entries and self._entries[name] is not obj:
                raise ValueError(f"{self.config_key}: {name!r} is already registered ({self._entries[name]!r})")
            self._entries[name] = obj
            return obj

        return decorator

    def get(self, name: str) -> T:
        """The entry registered under ``name`` (importing its module first if it is a lazy one).

        Raises:
            ValueError: unknown name (the message lists the known ones).
        """
        if name not in self._entries and name in self._modules:
            importlib.import_module(self._modules[name])  # runs the module's register decorator
        if name not in self._entries:
            raise ValueError(f"{self.config_key}={name!r}: expected one of {self.names()}")
        return self._entries[name]

    def unregister(self, name: str) -> None:
        """Remove ``name`` (tests that register temporary entries)."""
        self._entries.pop(name, None)

    def names(self) -> list[str]:
        """Registered and lazily importable names, sorted."""
        return sorted(set(self._entries) | set(self._modules))

    def __contains__(self, name: str) -> bool:
        return name in self._entries


class MissingExtraError(ImportError, ValueError):
    """An optional dependency group (pip extra) a chosen component needs is not installed. A
    ``ValueError`` too, so the CLI reports it as a one-line config error (exit code 2)."""


def load_from_file(spec: str, key: str, what: str) -> Any:
    """The attribute named by ``spec`` = ``path/to/file.py:name`` (the file imported with importlib
    under a private module name; a relative path is relative to the working directory), or None
    when the file defines no such name (the caller says what it expected).

    Args:
        key: the config key holding ``spec`` (named in every error). what: the file's kind in
            errors (``reward``, ``environment``).

    Raises:
        FileNotFoundError: the file does not exist (names it).
        ValueError: ``spec`` without ``path:name``; a directory; a file that fails to import
            (names the file, the line in it and the error).
    """
    path_str, _, name = spec.rpartition(":")
    if not path_str or not name:
        raise ValueError(f"{key}={spec!r}: expected 'path/to/file.py:name'")
    path = Path(path_str).expanduser()
    if path.is_dir():
        raise ValueError(f"{key}={spec!r}: {str(path)!r} is a directory; expected a Python file")
    if not path.is_file():
        raise FileNotFoundError(f"{key}={spec!r}: {what} file {str(path)!r} not found")
    module_spec = importlib.util.spec_from_file_location(f"rollplex_user_{what}_{abs(hash(str(path.resolve())))}", path)
    if module_spec is None or module_spec.loader is None:
        raise ValueError(f"{key}={spec!r}: cannot import {str(path)!r} as a Python file")
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as err:  # noqa: BLE001 - the user's file may raise anything while it imports
        raise ValueError(f"{key}={spec!r}: importing {str(path)!r} failed at {_where(err, path)}: "
                         f"{type(err).__name__}: {err}") from err
    return getattr(module, name, None)


def _where(err: BaseException, path: Path) -> str:
    """``file:line`` of the innermost frame of ``err`` inside the file ``path`` (a syntax error's
    own position; the file itself when no frame is in it)."""
    if isinstance(err, SyntaxError) and err.filename:
        return f"{err.filename}:{err.lineno}"
    frames = [f for f in traceback.extract_tb(err.__traceback__) if Path(f.filename).resolve() == path.resolve()]
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else str(path)
