"""The rollout-engine protocol and its registry.

A rollout engine turns prompts into sampled responses with per-token log-probs. Its contract has
the shape of an inference server (verl ``workers/rollout/base.py``: generate, update weights,
release / resume memory by tag):

- ``generate`` / ``generate_stream`` under a weights version (a stale request is refused);
- weights: ``update_weights`` from a state dict or an iterator of ``(name, tensor)`` with a version
  (the copied path), or ``map_shared_weights`` once (IPC handles of the trainer's tensors) then
  ``sync_shared_weights(version)`` per step (the shared path);
- ``release_memory(tags)`` / ``resume_memory(tags)`` with SGLang's tags ``kv_cache``, ``weights``;
- optional capabilities: ``supports_compute_share`` (the planner may re-share the device while the
  engine decodes) and streaming (the default ``generate_stream`` yields once at the end).

Registered engines: ``builtin`` (transformers, CPU/GPU, run and tested here) and ``sglang``
(``rollout/sglang.py``, written against SGLang 0.5.23's API; it needs the ``sglang`` extra and a GPU
and has run only where ``scripts/check_sglang.py`` ran; see docs/sglang.md).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Optional

import torch

from rollplex_train.data.types import PromptSample, Response
from rollplex_train.registry import Registry
from rollplex_train.versioning import StaleWeightsError  # noqa: F401  (part of the rollout contract)


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request.

    Attributes:
        n: responses per prompt.
        temperature: 0 means greedy.
        top_p, top_k: nucleus / top-k truncation (top_k=-1 off).
        max_new_tokens: response length cap in tokens.
        stop: stop strings (kept in the response).
        ignore_eos: never stop early (benchmarks).
        seed: seed of the sampling generator (same seed, same weights -> same tokens).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 16
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    seed: int = 0


class RolloutEngine(abc.ABC):
    """Base class of rollout engines (verl ``workers/rollout/base.py`` in spirit)."""

    weights_version: int = 0

    @abc.abstractmethod
    def generate(
        self, prompts: list[PromptSample], params: SamplingParams, weights_version: Optional[int] = None,
        prefixes: Optional[list] = None,
    ) -> list[Response]:
        """Sample ``params.n`` responses per prompt, grouped: prompt 0's n responses first.

        Args:
            prefixes: None, or per prompt a ``models.prefix.PrefixState`` (no graph) holding its KV
                cache under the engine's weights version, or None for a prompt the engine prefills
                itself. Engines that prefill every prompt themselves (SGLang) raise ValueError.

        Raises:
            StaleWeightsError: ``weights_version`` is given and differs from the engine's, or a
                given prefix was encoded under another version.
            RuntimeError: the engine's memory is released.
            ValueError: ``prefixes`` given to an engine that prefills prompts itself.
        """

    @abc.abstractmethod
    def update_weights(self, named_tensors: "dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]",
                       version: int) -> None:
        """Load new policy weights (a state dict, or an iterator of ``(name, tensor)`` as verl's
        ``update_weights(weights: Generator)``) and set the weights version.

        Raises:
            StaleWeightsError: ``version`` is not newer than the current one.
            ValueError: names or shapes that do not match the engine's model.
        """

    def map_shared_weights(self, payload: bytes) -> int:
        """Point the engine's weights at the trainer's shared tensors (``TrainEngine.
        export_shared_weights``'s payload; no copy). From then on ``sync_shared_weights`` replaces
        ``update_weights`` and ``generate`` refuses weights that are stale or being written.

        Returns:
            the bytes of the engine's weights now held in shared memory.

        Raises:
            NotImplementedError: the engine cannot map shared weights.
            ValueError: the tensors do not match the engine's model.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot map shared weights (sharing.enabled=false)")

    def sync_shared_weights(self, version: int) -> None:
        """Adopt ``version`` of the shared weights (the trainer has published it).

        Raises:
            StaleWeightsError: ``version`` is not newer than the engine's, or the shared counter
                is not ``version``.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot map shared weights")

    def generate_stream(
        self, prompts: list[PromptSample], params: SamplingParams, weights_version: Optional[int] = None,
        prefixes: Optional[list] = None, progress_every: int = 0,
    ) -> Iterator[list[Response]]:
        """Like ``generate``, but yield the responses of whole groups (all ``params.n`` responses of
        each of one or more prompts; ``Response.prompt_index`` tells the prompt) as soon as they are
        finished, so suffix work of early groups can start during the decode tail. The groups still
        decoding when a batch of the request ends come in one item. Engines that cannot stream yield
        everything in one item when the request is done (this default).

        ``progress_every > 0`` (engines with ``supports_progress``, ``params.ignore_eos``): also
        yield, every that many decode steps, one item of ``DecodeProgress`` (the tokens of every
        group still decoding), so suffix chunks can be scored while decode goes on."""
        if progress_every and not self.supports_progress:
            raise ValueError(f"{type(self).__name__} cannot report decode progress (progress_every={progress_every})")
        yield self.generate(prompts, params, weights_version, prefixes)

    supports_progress: bool = False
    """Whether ``generate_stream`` can report ``DecodeProgress`` (``progress_every``)."""

    accepts_prefix_states: bool = False
    """Whether ``generate`` decodes from handed-in prefix states (``prefixes``; the config's
    ``schedule.prefill_from_actor`` asks this). Engines that prefill every prompt themselves refuse them."""

    supports_tensor_parallel: bool = False
    """Whether one engine spans ``rollout.tensor_parallel_size > 1`` devices (the config asks this)."""

    supports_compute_share: bool = True
    """Whether ``set_compute_share`` changes anything (the planner only re-shares engines that can)."""

    def set_compute_share(self, threads: int) -> None:
        """This engine's share of the device from now on: on CPU the torch threads of the decode
        loop, applied from its next decode step (so a planner can re-share mid-window). May be
        called from another thread than the one decoding. GPU engines map it to their MPS/stream
        share or ignore it."""
        self._compute_share = threads

    def decode_stats(self) -> dict[int, tuple[float, int]]:
        """Of the last ``generate``: ``{threads: (seconds, steps)}``, the decode time spent at each
        thread count and the decode steps (prefill counted as one) taken meanwhile (the cost
        model's input)."""
        return dict(getattr(self, "_decode_stats", {}))

    @abc.abstractmethod
    def release_memory(self, tags: tuple[str, ...] = ("kv_cache", "weights")) -> None:
        """Free the engine's device memory of the given tags (``kv_cache``, ``weights``; SGLang's
        ``release_memory_occupation(tags=...)``), on an idle engine.

        Raises:
            ValueError: an unknown tag.
        """

    @abc.abstractmethod
    def resume_memory(self, tags: tuple[str, ...] = ("kv_cache", "weights")) -> None:
        """Re-acquire what ``release_memory(tags)`` freed; generate works again once every tag is
        resumed."""

    def memory_bytes(self) -> dict[str, int]:
        """Device bytes of the residency groups (``memory/groups.py``: ``rollout_weights``,
        ``rollout_kv``) the engine holds, measured from its tensors; ``{}`` where it cannot tell
        (an engine in other processes)."""
        return {}


ROLLOUT_ENGINES: Registry[Callable[..., RolloutEngine]] = Registry(
    "rollout.name",
    # shipped engines, imported on first use (the SGLang adapter imports SGLang only when built)
    modules={"builtin": "rollplex_train.rollout.builtin", "sglang": "rollplex_train.rollout.sglang"},
)
register_rollout_engine = ROLLOUT_ENGINES.register


def create_rollout_engine(name: str, **kwargs) -> RolloutEngine:
    """Build the engine registered as ``name``.

    Raises:
        ValueError: unknown name (lists the known ones).
    """
    return ROLLOUT_ENGINES.get(name)(**kwargs)
