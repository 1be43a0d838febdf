"""Named implementations of one role, chosen by a config value (verl's ``register_adv_estimator``).

One small class serves every registry of the project: advantage estimators, KL estimators,
rewards, rollout engines and training engines.
"""

from __future__ import annotations

import importlib
from typing import Callable, Generic, Optional, TypeVar

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
