"""A training rank's per-turn scoring of environment trajectories (``schedule=rollplex`` env runs).

While the rollout decodes turn k, the driver (``runtime/env_window.py``) hands this rank the
context every trajectory reached (``rollout.multiturn.TurnInput``); :meth:`TurnStore.extend` scores
the new tokens against each trajectory's cached prefix under the old policy (role ``actor``, no
grad) and the reference (``models/turn_scoring.TurnScorer``), keeping the log-probs. After the
rollout, :meth:`TurnStore.finish` runs only each trajectory's last response and returns the
log-probs of its whole training row. The G trajectories of a seed share their turn-0 pass (one
scorer, copied: an extension builds new cache tensors, never writes the shared ones).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import torch

from rollplex_train.models.turn_scoring import TurnScorer, extend_all


@dataclass
class TurnScoreResult:
    """One call's work: ``seconds`` and ``tokens`` (new tokens scored, all roles), its span
    (``time.perf_counter`` of the worker's process: comparable with the driver's on one machine),
    ``threads`` (torch threads it ran with), ``bytes_held`` (the caches kept after it) and, from
    :meth:`TurnStore.finish`, ``log_probs``: role -> trajectory uid -> (L,) float32 log-probs of
    every token of the trajectory's ids (token 0: 0)."""

    seconds: float
    tokens: int
    start_time: float
    end_time: float
    threads: int
    bytes_held: float
    log_probs: dict[str, dict[str, torch.Tensor]]


class TurnStore:
    """The scorers of one step's trajectories on one rank, by (role, uid).

    Args:
        models: role (``actor``: the old policy, ``ref``) -> the model that scores it.
        compute: the forward's precision context (``training.log_probs.ResponseScorer.compute``).
    """

    def __init__(self, models: dict, compute):
        self.models, self.compute = models, compute
        self.scorers: dict[tuple[str, str], TurnScorer] = {}
        self.pieces: dict[tuple[str, str], list[torch.Tensor]] = {}

    def _models(self, roles: list[str]) -> list:
        for role in roles:
            if self.models.get(role) is None:
                raise ValueError(f"cannot score {role!r} turns (roles here: {sorted(k for k, m in self.models.items() if m)})")
        return [self.models[r] for r in roles]

    def extend(self, items: list, roles: list[str], temperature: float, final: bool = False) -> TurnScoreResult:
        """Score the new tokens of ``items`` (``TurnInput``-like: ``uids``, ``ids``, ``sampled``,
        ``vision``) under ``roles``; ``final``: they are the trajectories' whole ids, return every
        row's log-probs and forget those trajectories.

        Raises:
            ValueError: an unknown role or one without a model; ids that do not continue what the
                trajectory's scorer holds (``TurnScorer.extend``).
        """
        start, tokens, out = time.perf_counter(), 0, {role: {} for role in roles}
        for role, model in zip(roles, self._models(roles)):
            model.eval()
            scorers = [self.scorers.get((role, item.uids[0])) or TurnScorer(model, temperature) for item in items]
            before = sum(s.scored for s in scorers)
            with self.compute():
                pieces = extend_all(scorers, [(item.ids, item.sampled, item.vision) for item in items])
            tokens += sum(s.scored for s in scorers) - before
            for item, scorer, piece in zip(items, scorers, pieces):
                for uid in item.uids:  # turn 0: the seed's G trajectories share the pass
                    key = (role, uid)
                    self.scorers[key] = scorer if uid == item.uids[0] else copy.copy(scorer)
                    self.pieces.setdefault(key, []).append(piece)
                    if final:
                        out[role][uid] = torch.cat(self.pieces.pop(key))
                        del self.scorers[key]
        end = time.perf_counter()
        held = sum(s.nbytes for s in {id(s): s for s in self.scorers.values()}.values())
        return TurnScoreResult(end - start, tokens, start, end, torch.get_num_threads(), float(held),
                               out if final else {})

    def clear(self) -> int:
        """Forget every trajectory (a step that did not finish them); returns how many there were."""
        count = len(self.scorers)
        self.scorers.clear()
        self.pieces.clear()
        return count
