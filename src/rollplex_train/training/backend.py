"""The model-backend protocol the PPO loop (``training/ppo_loop.py``) is written against.

A backend owns the actor, the frozen reference and the optimizer of one training rank and knows how
to run them; the loop owns everything else (mini-batches, micro-batches, losses over global counts,
metrics, the prefix store, the learning-rate schedule, weights versions, the sharing bookkeeping).
Two backends implement it: ``training/torch_engine.py::TorchBackend`` (transformers modules, DP
over ``training/parallelize.py``) and ``training/megatron/engine.py::MegatronBackend`` (megatron-core
TP shards, Megatron DDP). Neither derives from the other.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional, Protocol, Union

import torch


class PrefixStateLike(Protocol):
    """What the ``PrefixStore`` needs of a backend's prefix state (the torch backend's is
    ``models.prefix.PrefixState``: per-layer KV of the prompt, last hidden state, next M-RoPE
    position, and the autograd graph when made for the actor)."""

    uid: str
    version: Union[int, str]
    graph_id: Optional[int]

    @property
    def nbytes(self) -> int: ...


class PrefixPasses(Protocol):
    """The prefix/suffix decomposition of one backend.

    ``encode`` runs P prompts (and their images/videos) once and returns one state per prompt;
    ``score`` runs only the response tokens of N responses against their prompt's state and
    returns ((N, R) float32 log-probs, (N, R) float32 entropy or None). Both must equal the
    full-sequence pass (log-probs to 1e-5, gradients through ``score`` into the prefix graph to
    1e-4 relative). ``chunked`` (None where the backend has none) starts a group's suffix pass that
    runs in chunks of decoded tokens with ``score``'s numbers (``models.prefix.ChunkedSuffix``).
    """

    chunked: Optional[Callable]

    def encode(self, model, prompts: list, *, version: Union[int, str], with_grad: bool,
               freeze_vision: bool) -> list[PrefixStateLike]: ...

    def score(self, model, states: list[PrefixStateLike], group_index: torch.Tensor, response_ids: torch.Tensor,
              response_mask: torch.Tensor, *, temperature: float,
              with_entropy: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]: ...


class PrefixFunctions:
    """A :class:`PrefixPasses` made of a backend's module functions ``encode_prefix(model, prompts,
    *, version, with_grad, freeze_vision)``, ``score_suffix(model, states, group_index,
    response_ids, response_mask, *, temperature, with_entropy)`` and optionally a chunked-suffix
    class ``chunked(model, state, num_responses, width)`` (the torch backend's ``models.prefix``,
    the Megatron backend's ``training.megatron.scoring``)."""

    def __init__(self, encode_prefix: Callable, score_suffix: Callable, chunked: Optional[Callable] = None):
        self._encode, self._score, self.chunked = encode_prefix, score_suffix, chunked

    def encode(self, model, prompts, *, version, with_grad: bool, freeze_vision: bool):
        return self._encode(model, prompts, version=version, with_grad=with_grad, freeze_vision=freeze_vision)

    def score(self, model, states, group_index, response_ids, response_mask, *, temperature: float,
              with_entropy: bool):
        return self._score(model, states, group_index, response_ids, response_mask, temperature=temperature,
                           with_entropy=with_entropy)


class ModelBackend(Protocol):
    """One training rank's models and optimizer, as the PPO loop drives them.

    Attributes:
        actor: the trainable policy (its ``config`` is the HF config). ref: the frozen reference,
            or None without a KL term. device: where the loss inputs go. tokenizer, pad_id: the
            checkpoint's. prefix_passes: the backend's :class:`PrefixPasses`. layout: the run's
            ``ParallelLayout`` (None: one process). rank: this process's training rank.

    Every method is collective over the ranks of one model replica where the backend is sharded
    (Megatron TP): call it on all of them.
    """

    actor: torch.nn.Module
    ref: Optional[torch.nn.Module]
    device: torch.device
    tokenizer: object
    pad_id: int
    prefix_passes: PrefixPasses
    layout: Optional[object]
    rank: int

    def score_full(self, model, part, *, temperature: float,
                   with_entropy: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(N, R) float32 log-probs (and entropy) of the responses of ``part`` (a ``TrainBatch``
        selection: ``prompts``, ``group_index``, ``response_ids``, ``response_mask``) from
        full-sequence forwards of ``model``."""

    def zero_grad(self) -> None:
        """Clear the gradients (before a mini-batch's first backward and after its step)."""

    def sync_grads(self) -> int:
        """Sum the gradients of this mini-batch over the data-parallel group (and hand them to the
        optimizer); returns the bytes reduced (0 on one rank)."""

    def sum_metrics(self, metrics: dict[str, float], keys: tuple[str, ...]) -> dict[str, float]:
        """``metrics`` with the values of ``keys`` summed over the data-parallel group."""

    def clip_grad_norm(self, max_norm: float) -> float:
        """The global L2 norm of the synced gradients (each element once over TP/DP shards); scales
        them to at most ``max_norm`` (``min(1, max_norm / (norm + 1e-6))``)."""

    def optimizer_step(self, lr: float) -> None:
        """One optimizer step at learning rate ``lr`` (the loop's schedule)."""

    def offload(self, parts: tuple[str, ...]) -> int:
        """Move ``parts`` (``optimizer``: the Adam states, ``ref``: the reference's parameters,
        ``params``: the actor's where the backend can) to host memory; returns the bytes moved.

        Raises:
            ValueError: a part this backend cannot move.
        """

    def onload(self, parts: tuple[str, ...]) -> int:
        """Bring offloaded ``parts`` back to the device (done when it returns); returns the bytes."""

    def release_grads(self) -> None:
        """Free the gradients' device memory until the next update (after its last optimizer step)."""

    def memory_bytes(self) -> dict[str, int]:
        """Device bytes the groups ``actor_weights``, ``master_weights``, ``optimizer_states``,
        ``grads``, ``ref_weights`` (``memory/groups.py``) hold now, measured from the tensors."""

    def rollout_weights(self) -> dict[str, torch.Tensor]:
        """The actor under the built-in rollout engine's HF names, full tensors."""

    def share_weights(self, rollout_kind: str, rollout_tp: int, same_process: bool, **options):
        """The ``sharing.share.WeightShare`` of this rank: the rollout tensors of the rollout rank on
        its device, as views of the actor's storage where ``sharing/plan.py`` allows."""

    def weights_digest(self) -> dict[str, str]:
        """``{HF name: sha256}`` of the actor's full weights."""

    def save(self, directory: Path, trainer_state: dict) -> None:
        """Write the actor, the optimizer and ``trainer_state`` (the loop's) into ``directory``."""

    def load(self, directory: Path) -> dict:
        """Restore what ``save`` wrote; returns ``trainer_state``.

        Raises:
            FileNotFoundError: a file of the checkpoint is missing.
        """

    def export_hf(self, directory: Path) -> None:
        """Write the actor as a Hugging Face checkpoint directory."""
