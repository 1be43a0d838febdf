"""Tracked prefix states inside a training worker: who holds what, made with which weights.

A prefix state is addressed by (prompt uid, role, weights version) and lives in the worker that
made it. ``take`` hands it to its consumer and refuses one made under another weights version (the
synchronous on-policy guarantee); ``release`` frees it explicitly after its last consumer.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Union

from rollplex_train.models.prefix import PrefixState
from rollplex_train.versioning import StaleWeightsError

Version = Union[int, str]


@dataclass(frozen=True)
class PrefixKey:
    """Address of a prefix state: the prompt, the model role (``actor``/``ref``) and the weights."""

    uid: str
    role: str
    version: Version


class PrefixStore:
    """The prefix states one worker holds.

    Args:
        owner: name of the holding worker (default: ``pid:<pid>``), reported with the states.
    """

    def __init__(self, owner: str | None = None):
        self.owner = owner or f"pid:{os.getpid()}"
        self._states: dict[PrefixKey, PrefixState] = {}

    def put(self, role: str, state: PrefixState) -> PrefixKey:
        """Hold ``state`` under (state.uid, role, state.version); replaces an older one at that key."""
        key = PrefixKey(state.uid, role, state.version)
        self._states[key] = state
        return key

    def take(self, uid: str, role: str, version: Version) -> PrefixState:
        """The state of ``uid``/``role`` made under ``version``.

        Raises:
            StaleWeightsError: the store holds this prompt's prefix only under other versions.
            KeyError: no prefix for this prompt and role at all.
        """
        key = PrefixKey(uid, role, version)
        if key in self._states:
            return self._states[key]
        others = sorted(str(k.version) for k in self._states if k.uid == uid and k.role == role)
        if others:
            raise StaleWeightsError(
                f"prefix of {uid!r} ({role}) was made with weights version(s) {others}; the suffix call "
                f"runs under version {version}: refusing to mix weights versions in one step"
            )
        raise KeyError(f"no {role} prefix held for {uid!r} in {self.owner}")

    def holds(self, uid: str, role: str, version: Version) -> bool:
        """True when the exact (uid, role, version) state is held."""
        return PrefixKey(uid, role, version) in self._states

    def graph_id(self, uid: str, role: str, version: Version):
        """The ``graph_id`` of the held state (None when absent or made without grad)."""
        state = self._states.get(PrefixKey(uid, role, version))
        return None if state is None else state.graph_id

    def release(self, uid: str, role: str, version: Version) -> int:
        """Free the state (drop the store's reference); returns the bytes it held (0 if absent)."""
        state = self._states.pop(PrefixKey(uid, role, version), None)
        return 0 if state is None else state.nbytes

    def drop_other_versions(self, role: str, keep: Version) -> int:
        """Free every ``role`` state not made under ``keep``; returns the bytes freed."""
        stale = [k for k in self._states if k.role == role and k.version != keep]
        return sum(self.release(k.uid, k.role, k.version) for k in stale)

    def __len__(self) -> int:
        return len(self._states)

    @property
    def bytes_held(self) -> int:
        """Bytes of all held states (KV caches, last hidden states, saved activations)."""
        return sum(s.nbytes for s in self._states.values())

    def kv_bytes(self, role: str) -> int:
        """Bytes of the KV caches (keys and values) of the held ``role`` states: the
        ``old_prefix_kv``/``ref_prefix_kv`` groups of ``memory/groups.py``."""
        from rollplex_train.memory.measure import live_tensor_bytes

        return live_tensor_bytes(t for k, s in self._states.items() if k.role == role for t in (*s.keys, *s.values))

    def describe(self) -> list[dict]:
        """One row per held state: uid, role, version, bytes, owner."""
        return [
            {"uid": k.uid, "role": k.role, "version": k.version, "bytes": s.nbytes, "owner": self.owner}
            for k, s in self._states.items()
        ]
