"""The weights version: the synchronous on-policy check shared by trainer, rollout and sharing.

Every rollout request, prefix task and weight hand-over carries the weights version it was made
for; an engine holding another version refuses it with :class:`StaleWeightsError` (the one error
for every engine, the prefix store and the shared counter), raised by :func:`check_version` (a
request must match the held version) or :func:`check_newer` (an update must be newer). When weights
are shared in memory, :class:`WeightsVersion` is the counter both processes see. This module
depends on nothing of the project, so ``rollout/``, ``training/`` and ``sharing/`` all import it
without importing each other.
"""

from __future__ import annotations

from typing import Optional

import torch

UPDATING = -1
"""Counter value while the trainer writes weights in place."""


class StaleWeightsError(RuntimeError):
    """A request, prefix state or weight update carries a weights version other than the one held."""


def check_version(wanted, held, what: str, holder: str) -> None:
    """The synchronous on-policy check: ``what`` (a request, a prefix task, a state) was made for
    weights version ``wanted`` and may only run where ``holder`` holds that version (``held``).

    Raises:
        StaleWeightsError: ``wanted != held`` (the message names both sides and both versions).
    """
    if wanted != held:
        raise StaleWeightsError(f"{what} wants weights version {wanted}, {holder} holds version {held}")


def check_newer(version: int, current: int, what: str) -> None:
    """A weight update (``what``) must move the version forward.

    Raises:
        StaleWeightsError: ``version <= current``.
    """
    if version <= current:
        raise StaleWeightsError(f"{what}: weights version {version} is not newer than {current}")


class WeightsVersion:
    """A weights-version counter both processes see: one int64 in shared memory.

    Args:
        tensor: the shared counter (receiving side); None makes a new one at version 0.
    """

    def __init__(self, tensor: Optional[torch.Tensor] = None):
        if tensor is None:
            tensor = torch.zeros(1, dtype=torch.int64)
            tensor.share_memory_()
        self.tensor = tensor

    def read(self) -> int:
        return int(self.tensor.item())

    def begin_update(self) -> None:
        """Mark the weights as being written: every ``check`` fails until ``publish``."""
        self.tensor.fill_(UPDATING)

    def publish(self, version: int) -> None:
        """Declare the shared weights to be ``version``.

        Raises:
            StaleWeightsError: ``version`` is not newer than the last published one.
        """
        current = self.read()
        if current != UPDATING:
            check_newer(version, current, "publish of the shared weights")
        self.tensor.fill_(version)

    def check(self, expected: int) -> None:
        """Raises StaleWeightsError unless the shared weights are ``expected`` (and not in flux)."""
        current = self.read()
        if current == UPDATING:
            raise StaleWeightsError(f"rollout wants weights version {expected}, shared weights are being updated")
        check_version(expected, current, "rollout", "the shared counter")
