"""The training-engine interface the workers call (actor + frozen reference in one worker) and its
registry. Its one implementation is the PPO loop (``training/ppo_loop.py``) over a model backend
(``training/backend.py``): ``torch`` or ``megatron``."""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

from rollplex_train.data.types import TrainBatch
from rollplex_train.registry import Registry


@dataclass
class PrefixResult:
    """What one ``precompute_prefixes`` call did (on a DP rank: its replica's first rank answers).

    Attributes:
        seconds / tokens: per role encoded (``old``, ``ref``, ``actor``): wall seconds and prompt tokens.
        start_time / end_time: the call's span. threads: torch threads it ran on.
        bytes_held: prefix-state bytes the rank holds after the call.
        states: with ``export``, the last role's states (no graph), one per prompt, in call order.
        groups: the step's global prompt indices of the call; dp: the DP rank that ran it (both set
            by ``cluster.groups.TrainGroup``).
        metrics: the rest of the engine's numbers (``prefix/num_states``, ``prefix/seconds``).
    """

    seconds: dict[str, float]
    tokens: dict[str, int]
    start_time: float
    end_time: float
    threads: int
    bytes_held: float
    states: list = field(default_factory=list)
    groups: list[int] = field(default_factory=list)
    dp: int = 0
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class ChunkResult:
    """What one ``score_suffix_chunks`` call did: ``tokens`` input tokens (all rows) of ``role``'s
    suffix pass run in ``seconds`` on ``threads`` threads, between ``start_time`` and ``end_time``
    (``time.perf_counter`` of the process); ``metrics``: ``suffix/bytes_held`` (chunked passes held)."""

    role: str
    seconds: float
    tokens: int
    start_time: float
    end_time: float
    threads: int
    metrics: dict[str, float] = field(default_factory=dict)


class TrainEngine(abc.ABC):
    """Holds the actor (trainable), the reference (frozen) and the optimizer.

    ``weights_version`` counts completed actor updates; it starts at 0 with the loaded checkpoint.
    """

    weights_version: int = 0

    @abc.abstractmethod
    def compute_log_probs(
        self, batch: TrainBatch, role: str, temperature: float = 1.0, with_entropy: bool = False
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Log-probs (N, R) float32 (and entropy) of the batch's responses under ``role``.

        Args:
            role: ``actor`` (current weights, no grad: the old-policy pass) or ``ref``.

        Raises:
            ValueError: unknown role.
        """

    @abc.abstractmethod
    def update_actor(self, batch: TrainBatch, temperature: float = 1.0, old_from_actor: bool = False) -> dict[str, float]:
        """One PPO update over the batch (mini-batches x epochs); returns ``actor/*`` metrics.

        Requires ``batch.advantages`` and ``batch.old_logprobs`` (and ``ref_logprobs`` with a KL loss);
        ``old_from_actor``: the first mini-batch's old log-probs are its own forward (the step decides,
        ``runtime/old_policy.reuse_actor_forward``), ``old_logprobs`` holds the other rows.
        Increments ``weights_version`` by one.
        """

    def precompute_prefixes(self, prompts, roles: list[str], weights_version: int,
                            export: bool = False) -> PrefixResult:
        """Encode prompt prefixes ahead of their suffix passes (``schedule=rollplex``); with
        ``export`` the result's ``states`` are the last role's states without their graph, for the
        rollout engine to decode from.

        Raises:
            NotImplementedError: the backend has no prefix/suffix decomposition.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot precompute prefixes")

    supports_suffix_chunks: bool = False
    """Whether :meth:`score_suffix_chunks` runs (the planner streams suffix chunks only then)."""

    exports_prefix_states: bool = False
    """Whether ``precompute_prefixes(export=True)`` returns whole prefix states a rollout engine can
    decode from (not TP shards; the config's ``schedule.prefill_from_actor`` asks this)."""

    supports_model_parallel: bool = False
    """Whether ``actor.tensor_parallel_size`` / ``pipeline_parallel_size`` above 1 can be honoured."""

    def score_suffix_chunks(self, prompts, role: str, tokens: dict[int, torch.Tensor], width: int,
                            weights_version: int, final: bool = False) -> ChunkResult:
        """Run the suffix pass of decoding groups on the tokens they have so far (``schedule=rollplex``
        under ``rollout.ignore_eos``); the later ``compute_log_probs`` of those groups finishes it.

        Raises:
            NotImplementedError: the backend cannot run suffix chunks.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot score suffix chunks")

    @abc.abstractmethod
    def rollout_weights(self) -> dict[str, torch.Tensor]:
        """The actor weights under the rollout engine's parameter names."""

    def export_shared_weights(self, same_process: bool = False, *, rollout_kind: str = "hf",
                              rollout_tp: Optional[int] = None, **options) -> dict:
        """Share the actor's weights in place with the rollout rank on this device
        (``sharing.enabled``): returns ``payload`` (IPC handles for ``RolloutEngine.map_shared_weights``,
        loaded once while this process lives), ``rollout_kind``/``rollout_tp``/``rollout_rank`` and
        the byte counts ``view_bytes``/``rebuild_bytes``/``remote_bytes``/``rollout_bytes`` of this
        device (``docs/sharing.md``).

        Raises:
            NotImplementedError: the backend cannot share its weights.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot share its weights (sharing.enabled=false)")

    def publish_weights(self, version: int) -> dict[str, float]:
        """After a weight write (update, checkpoint load): refresh the rebuilt rollout tensors and
        publish ``version`` (must equal ``weights_version``) on the shared counter; returns
        ``sharing/*`` metrics.

        Raises:
            StaleWeightsError: ``version`` is not the actor's or not newer than the published one.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot share its weights")

    def offload_states(self, parts: tuple[str, ...]) -> int:
        """Move ``parts`` (``optimizer``, ``grads``; ``params`` only when not shared with a
        rollout engine) to host memory and free their device storage; returns the bytes moved.

        Raises:
            NotImplementedError: the backend has no offload.
            ValueError: an unknown part, or ``params`` while the weights are shared.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot offload its states")

    def prefetch_states(self, parts: tuple[str, ...]) -> int:
        """Bring offloaded ``parts`` back to the device before their next use; returns the bytes."""
        raise NotImplementedError(f"{type(self).__name__} cannot offload its states")

    @abc.abstractmethod
    def save_checkpoint(self, directory: Path) -> None:
        """Write actor weights, optimizer and scheduler state and the weights version into ``directory``."""

    @abc.abstractmethod
    def load_checkpoint(self, directory: Path) -> None:
        """Restore what ``save_checkpoint`` wrote.

        Raises:
            FileNotFoundError: a file of the checkpoint is missing.
        """

    @abc.abstractmethod
    def export_hf(self, directory: Path) -> None:
        """Write the actor as a Hugging Face checkpoint directory (loadable with from_pretrained)."""


TRAIN_ENGINES: Registry[Callable[..., TrainEngine]] = Registry(
    "actor.backend",
    modules={"torch": "rollplex_train.training.torch_engine",
             "megatron": "rollplex_train.training.megatron.engine"},
)
register_train_engine = TRAIN_ENGINES.register


def create_train_engine(name: str, **kwargs) -> TrainEngine:
    """Build the training engine registered as ``name``.

    Raises:
        ValueError: unknown name (lists the known ones).
    """
    return TRAIN_ENGINES.get(name)(**kwargs)
